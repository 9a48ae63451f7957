"""A ResNet18 train step shaped like flax's ImageNet example, three ways, under `pmap`.

What it measures: the seconds per call of one data-parallel float16 train step, `jax.pmap`
over 2 devices with `axis_name="batch"`, as `examples/imagenet/train.py` of the flax
repository writes it: a flax linen ResNet18 (basic blocks, stages [2, 2, 2, 2], BatchNorm
with `momentum=0.9`, `epsilon=1e-5`, synchronised over the batch axis), float16 compute and
float32 params, weight decay added to the loss, `optax.sgd(schedule, momentum=0.9,
nesterov=True)`, the gradients and the BatchNorm statistics averaged with `lax.pmean`. The
contenders, each with its own train state donated from call to call (`donate_argnums=0`):

- `bare`: that step without any loss scaling.
- `flax DynamicScale`: as the example does it, `dynamic_scale.value_and_grad(loss_fn,
  has_aux=True, axis_name="batch")`, then new or old params and optimizer state selected on
  `is_fin` with `jnp.where`; here the BatchNorm statistics are selected too (the example
  selects params and optimizer state only).
- `jax_lossscale`: migrated as docs/migrating.md says (`jls.loss_scaled` around the same sgd,
  with the flax-equivalent `DynamicLossScale` and `axis_name`, `jls.value_and_grad`, a
  `pmean` of the float32 gradients, `jls.where_applied` for the statistics).

The contenders take turns block by block (`benchmarks.measure.block_medians`), so the ratios to
`bare` come from the same run. Images are 32x32x3 and 10 classes by default; the batch is
the same one each step. Run:

    python -m benchmarks.resnet --filters 16,64 --repeats 150 --block 6 \
        --out benchmarks/results/resnet-cpu.json
"""

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training.dynamic_scale import DynamicScale
from jax import lax

import jax_lossscale as jls
from benchmarks import measure

AXIS = "batch"
WEIGHT_DECAY = 1e-4
CONTENDERS = ("bare", "flax DynamicScale", "jax_lossscale")


# --- the model ------------------------------------------------------------------------------


class Block(nn.Module):
    """A basic ResNet block: two 3x3 convolutions, a projected shortcut when shapes change."""

    filters: int
    strides: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name=AXIS if train else None,
        )
        y = nn.relu(norm()(conv(self.filters, (3, 3), self.strides)(x)))
        y = norm(scale_init=nn.initializers.zeros_init())(conv(self.filters, (3, 3))(y))
        if x.shape != y.shape:
            x = norm(name="norm_proj")(conv(self.filters, (1, 1), self.strides, name="proj")(x))
        return nn.relu(x + y)


class ResNet18(nn.Module):
    """ResNet18 (v1.5) as in flax's ImageNet example; params float32, compute `dtype`."""

    num_filters: int
    num_classes: int = 10
    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Conv(self.num_filters, (7, 7), 2, padding=3, use_bias=False, dtype=self.dtype)(x)
        x = nn.BatchNorm(
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name=AXIS if train else None,
        )(x)
        x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
        for stage, blocks in enumerate((2, 2, 2, 2)):
            for index in range(blocks):
                strides = 2 if stage > 0 and index == 0 else 1
                x = Block(self.num_filters * 2**stage, strides, self.dtype)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x)


def learning_rate_fn(base: float = 0.1, warmup: int = 5, total: int = 10_000) -> optax.Schedule:
    """Linear warm-up, then cosine decay, as the example's `create_learning_rate_fn`."""
    warmup_fn = optax.linear_schedule(0.0, base, warmup)
    cosine_fn = optax.cosine_decay_schedule(base, total - warmup)
    return optax.join_schedules([warmup_fn, cosine_fn], [warmup])


def sgd() -> optax.GradientTransformation:
    return optax.sgd(learning_rate_fn(), momentum=0.9, nesterov=True)


def flax_like(scale: float = 65536.0) -> jls.DynamicLossScale:
    """flax's `DynamicScale(scale=scale)` mapped as docs/migrating.md maps it."""
    return jls.DynamicLossScale(
        initial_loss_scale=scale,  # DynamicScale's default scale is 65536
        increment_period=2000 + 1,  # flax grows on the (growth_interval + 1)-th finite step
        backoff_factor=0.5,
        min_loss_scale=float(np.finfo(np.float32).tiny),  # DynamicScale's minimum_scale
    )


# --- the three train steps ------------------------------------------------------------------


def loss_fn(model, params, batch_stats, batch):
    """Cross-entropy plus weight decay; the aux is the new BatchNorm statistics and logits."""
    logits, mutated = model.apply(
        {"params": params, "batch_stats": batch_stats},
        batch["image"],
        mutable=["batch_stats"],
    )
    labels = jax.nn.one_hot(batch["label"], logits.shape[-1])
    loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=labels))
    weight_l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
    return loss + WEIGHT_DECAY * 0.5 * weight_l2, (mutated["batch_stats"], logits)


def compute_metrics(loss, logits, labels):
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return lax.pmean({"loss": loss, "accuracy": accuracy}, axis_name=AXIS)


def bare_step(model, tx, state, batch):
    params = state["params"]
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, model), has_aux=True)
    (loss, (new_stats, logits)), grads = grad_fn(params, state["batch_stats"], batch)
    grads = lax.pmean(grads, axis_name=AXIS)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_state = {
        "params": optax.apply_updates(params, updates),
        "batch_stats": lax.pmean(new_stats, AXIS),
        "opt_state": opt_state,
    }
    return new_state, compute_metrics(loss, logits, batch["label"])


def flax_step(model, tx, state, batch):
    params = state["params"]
    grad_fn = state["dynamic_scale"].value_and_grad(
        lambda p: loss_fn(model, p, state["batch_stats"], batch), has_aux=True, axis_name=AXIS
    )
    dynamic_scale, is_fin, (loss, (new_stats, logits)), grads = grad_fn(params)
    # dynamic_scale has averaged the gradients across the replicas
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    select = functools.partial(jnp.where, is_fin)  # is_fin False: keep the old state
    new_state = {
        "params": jax.tree_util.tree_map(select, new_params, params),
        "batch_stats": jax.tree_util.tree_map(
            select, lax.pmean(new_stats, AXIS), state["batch_stats"]
        ),
        "opt_state": jax.tree_util.tree_map(select, opt_state, state["opt_state"]),
        "dynamic_scale": dynamic_scale,
    }
    metrics = compute_metrics(loss, logits, batch["label"])
    return new_state, {**metrics, "scale": dynamic_scale.scale}


def jls_step(model, tx, state, batch):
    params, opt_state = state["params"], state["opt_state"]
    grad_fn = jls.value_and_grad(functools.partial(loss_fn, model), opt_state, has_aux=True)
    (loss, (new_stats, logits)), grads = grad_fn(params, state["batch_stats"], batch)
    grads = lax.pmean(grads, axis_name=AXIS)  # float32 already: the params are float32
    updates, opt_state = tx.update(grads, opt_state, params)
    batch_stats = jls.where_applied(opt_state, lax.pmean(new_stats, AXIS), state["batch_stats"])
    new_state = {
        "params": optax.apply_updates(params, updates),
        "batch_stats": batch_stats,
        "opt_state": opt_state,
    }
    metrics = compute_metrics(loss, logits, batch["label"])
    return new_state, {**metrics, "scale": jls.get_loss_scale(opt_state)}


# --- state, batches, runner -----------------------------------------------------------------


def replicate(tree: Any, devices: Sequence[jax.Device]) -> Any:
    """One copy of `tree` on each device, as a pmap'ed step takes and returns it."""
    stacked = jax.tree.map(lambda x: np.broadcast_to(x, (len(devices), *np.shape(x))), tree)
    return _placed_over(tuple(devices))(stacked)


def shard(tree: Any, devices: Sequence[jax.Device]) -> Any:
    """Split the leading axis of every leaf of `tree` over the devices."""
    split = jax.tree.map(lambda x: x.reshape(len(devices), -1, *x.shape[1:]), tree)
    return _placed_over(tuple(devices))(split)


@functools.cache
def _placed_over(devices: tuple[jax.Device, ...]) -> Any:
    """The identity, pmap'ed over `devices`: one per device set, so that a tree placed twice
    is traced and compiled once."""
    return jax.pmap(lambda x: x, axis_name=AXIS, devices=devices)


@functools.lru_cache
def initial_variables(filters: int, image: int) -> tuple[dict, dict]:
    """The model's initial params and BatchNorm statistics, on the host, one copy per size.

    The key is an "rbg" one: XLA compiles threefry's init of this model in 15 s on a CPU, rbg's
    in 4 s.
    """
    model = ResNet18(filters)
    variables = jax.jit(functools.partial(model.init, train=False))(
        jax.random.key(0, impl="rbg"), jnp.ones((1, image, image, 3), model.dtype)
    )
    host = jax.tree.map(np.asarray, variables)
    return host["params"], host["batch_stats"]


def build(
    contender: str,
    filters: int,
    image: int,
    devices: Sequence[jax.Device],
    scale: float = 65536.0,
):
    """The contender's un-pmap'ed step and its replicated train state (fresh buffers);
    `scale` is the initial loss scale of both scaled contenders (flax's default)."""
    model = ResNet18(filters)
    params, batch_stats = initial_variables(filters, image)
    if contender == "bare":
        tx, step = sgd(), bare_step
    elif contender == "flax DynamicScale":
        tx, step = sgd(), flax_step
    elif contender == "jax_lossscale":
        tx, step = jls.loss_scaled(sgd(), flax_like(scale), axis_name=AXIS), jls_step
    else:
        raise ValueError(f"unknown contender {contender!r}; one of {CONTENDERS}")
    state = {"params": params, "batch_stats": batch_stats, "opt_state": tx.init(params)}
    if contender == "flax DynamicScale":
        state["dynamic_scale"] = jax.tree.map(jnp.asarray, DynamicScale(scale=scale))
    state = replicate(jax.tree.map(np.asarray, state), devices)
    return functools.partial(step, model, tx), state


def pmapped(step, devices: Sequence[jax.Device]):
    return jax.pmap(step, axis_name=AXIS, devices=devices, donate_argnums=0)


def fake_batch(batch: int, image: int, classes: int = 10, seed: int = 0) -> dict:
    """A host batch of float16 images (as the example feeds them) and integer labels."""
    rng = np.random.default_rng(seed)
    return {
        "image": rng.standard_normal((batch, image, image, 3)).astype(np.float16),
        "label": rng.integers(0, classes, batch).astype(np.int32),
    }


class PmapRunner:
    """One contender's pmap'ed train step, its state donated from call to call."""

    def __init__(self, step, state, batch, devices):
        self.step, self.state, self.batch = pmapped(step, devices), state, batch

    def __call__(self) -> float:
        start = time.perf_counter()
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        return time.perf_counter() - start


def scale_of(contender: str, state: dict) -> float:
    """The loss scale a scaled contender's replicated state holds (device 0's copy)."""
    if contender == "flax DynamicScale":
        return float(state["dynamic_scale"].scale[0])
    return float(jls.get_loss_scale(state["opt_state"])[0])


def parameter_count(state: dict) -> tuple[int, int]:
    leaves = jax.tree.leaves(state["params"])
    return sum(int(np.prod(leaf.shape[1:])) for leaf in leaves), len(leaves)  # one replica's


# --- the benchmark --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parse(argv)
    devices = jax.local_devices()[: args.devices]
    if len(devices) < args.devices:
        raise SystemExit(
            f"{args.devices} devices wanted, {len(devices)} found: run as `python -m "
            "benchmarks.resnet`, which asks for 2 CPU devices, or set XLA_FLAGS="
            "--xla_force_host_platform_device_count=2"
        )
    batch = shard(fake_batch(args.batch * len(devices), args.image), devices)
    rows = []
    for filters in args.filters:
        runners = {}
        for contender in CONTENDERS:
            step, state = build(contender, filters, args.image, devices)
            runners[contender] = PmapRunner(step, state, batch, devices)
        params, leaves = parameter_count(runners["bare"].state)
        medians, faults = measure.block_medians(runners, args.repeats, args.block)
        label = (
            f"sgd nesterov, ResNet18 f{filters}, {args.image}px, batch {args.batch}x{len(devices)}"
        )
        row = measure.result_row(label, params, leaves, medians)
        row["page_faults_per_step"] = faults
        row["final_scale"] = {name: scale_of(name, runners[name].state) for name in CONTENDERS[1:]}
        rows.append(row)
        print(measure.table("resnet_step", [row]), flush=True)
    results = {"machine": measure.machine(), "command": _command(argv), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as file:
        json.dump(results, file, indent=1)
    print(measure.table("resnet_step", rows))
    print(f"wrote {args.out}")
    return results


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.resnet", description=__doc__)
    parser.add_argument("--filters", type=_ints, default=[16, 64], help="e.g. 16,64")
    parser.add_argument("--image", type=int, default=32, help="image side in pixels")
    parser.add_argument("--batch", type=int, default=8, help="images per device")
    parser.add_argument("--devices", type=int, default=2, help="devices to pmap over")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per contender")
    parser.add_argument("--block", type=int, default=6, help="calls per contender per turn")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "resnet-cpu.json"))
    return parser.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _command(argv: Sequence[str] | None) -> str:
    return "python -m benchmarks.resnet " + " ".join(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 2)  # before anything starts a backend
    main()
