"""A real model's train step: a GPT-style character decoder in flax nnx, trained in float16.

The model: learned token and position embeddings, pre-LayerNorm blocks of causal
self-attention (separate query, key, value and output projections) and a GELU MLP, a final
LayerNorm and an output projection. Parameters are float32 master weights; the projections
and the attention compute in float16; layer norms, the softmax and the loss in float32
(`Size.compute` and `Size.weights` change the first two: bfloat16 weights computing in
bfloat16 for `benchmarks.low_precision_state`).
The text is the Python standard library's own source, found on every machine.

`SIZES` holds the two shapes measured: about 0.85M parameters in 70 leaves (4 layers of
width 128), and about 0.9M in 294 leaves (18 layers of width 64).
"""

import dataclasses
import functools
import glob
import os
import sysconfig
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_lossscale as jls

F16, F32 = jnp.float16, jnp.float32


@dataclasses.dataclass(frozen=True)
class Size:
    layers: int
    width: int
    heads: int
    seq: int = 128
    batch: int = 16
    compute: Any = F16  # the dtype of the projections and the attention
    weights: Any = F32  # the dtype of every parameter


SIZES = {"70 leaves": Size(layers=4, width=128, heads=4), "294 leaves": Size(18, 64, 4)}


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, heads: int) -> jax.Array:
    """Multi-head causal self-attention; the scores' softmax is taken in float32."""
    batch, seq, width = q.shape
    q, k, v = (x.reshape(batch, seq, heads, width // heads) for x in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // heads).astype(q.dtype)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores.astype(F32), -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(q.dtype), v)
    return out.reshape(batch, seq, width)


class Block(nnx.Module):
    def __init__(self, size: Size, rngs: nnx.Rngs):
        width = size.width
        half = {"dtype": size.compute, "param_dtype": size.weights, "rngs": rngs}
        self.compute = size.compute
        self.heads = size.heads
        self.norm1 = nnx.LayerNorm(width, dtype=F32, param_dtype=size.weights, rngs=rngs)
        self.query = nnx.Linear(width, width, **half)
        self.key = nnx.Linear(width, width, **half)
        self.value = nnx.Linear(width, width, **half)
        self.out = nnx.Linear(width, width, **half)
        self.norm2 = nnx.LayerNorm(width, dtype=F32, param_dtype=size.weights, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, **half)
        self.down = nnx.Linear(4 * width, width, **half)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm1(x).astype(self.compute)
        attended = causal_attention(self.query(h), self.key(h), self.value(h), self.heads)
        x = x + self.out(attended).astype(F32)
        h = self.norm2(x).astype(self.compute)
        return x + self.down(nnx.gelu(self.up(h))).astype(F32)


class GPT(nnx.Module):
    def __init__(self, size: Size, vocab: int, rngs: nnx.Rngs):
        half = {"dtype": size.compute, "param_dtype": size.weights, "rngs": rngs}
        self.compute = size.compute
        self.embed = nnx.Embed(vocab, size.width, **half)
        positions = 0.02 * jax.random.normal(rngs.params(), (size.seq, size.width))
        self.positions = nnx.Param(positions.astype(size.weights))
        self.blocks = nnx.List([Block(size, rngs) for _ in range(size.layers)])
        self.norm = nnx.LayerNorm(size.width, dtype=F32, param_dtype=size.weights, rngs=rngs)
        self.head = nnx.Linear(size.width, vocab, **half)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens).astype(F32) + self.positions[...].astype(F32)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).astype(self.compute)).astype(F32)  # logits in float32


def stdlib_text(max_bytes: int = 4_000_000) -> tuple[np.ndarray, int]:
    """The standard library's Python sources as token ids, one per distinct byte."""
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    data = bytearray()
    for path in paths:
        with open(path, "rb") as file:
            data += file.read()
        if len(data) >= max_bytes:
            break
    raw = np.frombuffer(bytes(data[:max_bytes]), np.uint8)
    alphabet, tokens = np.unique(raw, return_inverse=True)
    return tokens.astype(np.int32), len(alphabet)


def batches(tokens: np.ndarray, size: Size, seed: int = 0):
    """Endless (inputs, targets) batches of windows taken at random."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - size.seq - 1, size.batch)
        windows = np.stack([tokens[s : s + size.seq + 1] for s in starts])
        yield jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])


def adamw() -> optax.GradientTransformation:
    """The inner optimizer of every contender: adamw on a linear schedule."""
    return optax.adamw(optax.linear_schedule(1e-3, 1e-4, 10_000), weight_decay=0.01)


def contenders() -> dict[str, Callable[[], optax.GradientTransformation]]:
    """The optimizers of `nnx.Optimizer` compared: bare adamw and adamw through `loss_scaled`,
    with spike skipping on (a bound and a window) and off.

    These are the contenders of `train_step_of`; `all_contenders` adds the peers, which
    bring their own train steps.
    """

    def skipping_spikes():
        return jls.loss_scaled(
            adamw(), jls.DynamicLossScale(), skip_grad_norm_above=100.0, skip_spike_sigmas=6.0
        )

    return {
        "bare": adamw,
        "DynamicLossScale": lambda: jls.loss_scaled(adamw(), jls.DynamicLossScale()),
        "DynamicLossScale, spike skipping": skipping_spikes,
        "FixedLossScale": lambda: jls.loss_scaled(adamw(), jls.FixedLossScale(2.0**10)),
    }


def train_state(size: Size, vocab: int, tx: optax.GradientTransformation) -> tuple[Any, Any]:
    """`(graphdef, state)` of the model and its `nnx.Optimizer`, split for `jax.jit`."""
    return nnx.split(_model_and_optimizer(size, vocab, tx))


def _model_and_optimizer(size: Size, vocab: int, tx: optax.GradientTransformation) -> tuple:
    model = GPT(size, vocab, nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def shapes_of_build(build: Callable[..., tuple[Any, Any]], *args: Any) -> tuple[Any, Any]:
    """`build(*args)`, a `(step or graphdef, state)` pair, traced rather than run: the first
    as built, the state as `jax.ShapeDtypeStruct`s. Nothing is initialised: enough to lower,
    compile or count, in a fraction of a second where initialising takes seconds.

    `shapes_of_build(train_state, size, vocab, tx)`, or a contender's `build`.
    """
    firsts: list[Any] = []

    def state_of_build():
        first, state = build(*args)
        firsts.append(first)
        return state

    state = jax.eval_shape(state_of_build)
    return firsts[0], state


def train_step_of(graphdef: Any, scaled: bool) -> Callable:
    """The train step `(state, inputs, targets) -> (state, loss)`, in nnx's functional form.

    A loss-scaled step passes its loss to the optimizer as `value=`, which spike skipping
    tests against its window.
    """

    def train_step(state, inputs, targets):
        model, optimizer = nnx.merge(graphdef, state)
        scale = jls.get_loss_scale(optimizer) if scaled else 1.0

        def loss_fn(model):
            loss = optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()
            return loss * scale, loss

        grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads, **({"value": loss} if scaled else {}))
        return nnx.state((model, optimizer)), loss

    return train_step


# --- every contender, peers included ------------------------------------------------------

LOSS_SCALE = 2.0**15  # where a peer takes a starting loss scale; as benchmarks/contenders.py


@dataclasses.dataclass(frozen=True)
class Contender:
    """One train step and its initial state.

    `build(size, vocab)` gives `(train_step, state)`: the step `(state, inputs, targets) ->
    (state, loss)`, to be jitted with `state` donated, and the state of a model made from
    `nnx.Rngs(0)`, the same model for every contender. `state[0]` is the model's `nnx.State`.
    `skips_non_finite`: whether a step with non-finite gradients leaves the model as it was.
    """

    name: str
    build: Callable[[Size, int], tuple[Callable, Any]]
    skips_non_finite: bool


def all_contenders() -> dict[str, Contender]:
    """Every train step compared: `contenders()` through `nnx.Optimizer`, then the peers,
    each written the way its own documentation writes it, all on `adamw()`.

    * "jmp": `jmp.DynamicLossScale` (README): `scale` the loss, `unscale` the gradients,
      `all_finite`, `adjust`, and `select_tree` between the new and the old params and
      optimizer state.
    * "flax": `flax.training.dynamic_scale.DynamicScale.value_and_grad`, then a `jnp.where`
      on `is_fin` over params and optimizer state, as flax's ImageNet example does.
    * "optax.apply_if_finite": `optax.apply_if_finite(adamw(), max_consecutive_errors=5)`
      through `nnx.Optimizer`, as optax's docs wrap an optimizer. It skips non-finite
      updates but has no loss scale, so its loss is not scaled: it gets the true gradients
      (as in benchmarks/contenders.py).
    * "mpx" (mixed-precision-for-JAX, when installed): `mpx.filter_value_and_grad` with an
      `mpx.DynamicLossScaling`, then `mpx.optimizer_update`, as mpx's README trains.

    jmp, flax and mpx are functional, so their steps take nnx's functional form too:
    `nnx.split` once, then `nnx.merge` inside the loss and gradients over the `nnx.State`
    of the parameters, with plain optax state beside it.
    """
    everything = {
        # A FixedLossScale applies non-finite steps, by design (see its docstring).
        name: Contender(
            name,
            functools.partial(_with_nnx_optimizer, make_tx, name != "bare"),
            skips_non_finite=name not in ("bare", "FixedLossScale"),
        )
        for name, make_tx in contenders().items()
    }
    peers = {"jmp": _jmp, "flax": _flax, "optax.apply_if_finite": _apply_if_finite}
    try:
        import mpx  # noqa: F401
    except ImportError:  # mixed-precision-for-JAX is optional
        pass
    else:
        peers["mpx"] = _mpx
    for name, build in peers.items():
        everything[name] = Contender(name, build, skips_non_finite=True)
    return everything


def _with_nnx_optimizer(make_tx, scaled, size, vocab):
    graphdef, state = train_state(size, vocab, make_tx())
    return train_step_of(graphdef, scaled), state


def _split_model(size: Size, vocab: int) -> tuple[Any, Any]:
    """`(graphdef, params)` of the model alone, for the functional peers."""
    return nnx.split(GPT(size, vocab, nnx.Rngs(0)))


def _loss_of(graphdef):
    def loss_fn(params, inputs, targets):
        model = nnx.merge(graphdef, params)
        return optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()

    return loss_fn


def _jmp(size: Size, vocab: int) -> tuple[Callable, Any]:
    """jmp's README: scale, unscale, `all_finite`, `adjust`, `select_tree`.

    jmp 0.0.4's `DynamicLossScale` cannot be a jit argument on current JAX, so the state
    carries its arrays and the step rebuilds it (as benchmarks/contenders.py does).
    """
    import jmp

    tx = adamw()
    graphdef, params = _split_model(size, vocab)
    loss_of = _loss_of(graphdef)

    def train_step(state, inputs, targets):
        params, opt_state, (scale, counter) = state
        loss_scale = jmp.DynamicLossScale(scale, counter, period=2000, factor=2)

        def loss_fn(params):
            loss = loss_of(params, inputs, targets)
            return loss_scale.scale(loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        grads = loss_scale.unscale(grads)
        grads_finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(grads_finite)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            grads_finite, (new_params, new_opt_state), (params, opt_state)
        )
        return (params, opt_state, (loss_scale.loss_scale, loss_scale.counter)), loss

    return train_step, (params, tx.init(params), (jnp.float32(LOSS_SCALE), jnp.int32(0)))


def _flax(size: Size, vocab: int) -> tuple[Callable, Any]:
    """flax's `DynamicScale.value_and_grad`, and the select on `is_fin` of its ImageNet
    example. The scale and step count start as strongly typed arrays, so that the state
    the step returns has the types of the one it took."""
    from flax.training.dynamic_scale import DynamicScale

    tx = adamw()
    graphdef, params = _split_model(size, vocab)
    loss_of = _loss_of(graphdef)

    def train_step(state, inputs, targets):
        params, opt_state, dynamic_scale = state
        grad_fn = dynamic_scale.value_and_grad(loss_of)
        dynamic_scale, is_fin, loss, grads = grad_fn(params, inputs, targets)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # if is_fin == False the gradients contain Inf/NaNs and optimizer state and
        # params should be restored (= skip this step).
        select = functools.partial(jnp.where, is_fin)
        params = jax.tree.map(select, new_params, params)
        opt_state = jax.tree.map(select, new_opt_state, opt_state)
        return (params, opt_state, dynamic_scale), loss

    dynamic_scale = DynamicScale(fin_steps=jnp.int32(0), scale=jnp.float32(LOSS_SCALE))
    return train_step, (params, tx.init(params), dynamic_scale)


def _apply_if_finite(size: Size, vocab: int) -> tuple[Callable, Any]:
    """`optax.apply_if_finite` around adamw in `nnx.Optimizer`; unscaled loss."""
    tx = optax.apply_if_finite(adamw(), max_consecutive_errors=5)
    graphdef, state = train_state(size, vocab, tx)
    return train_step_of(graphdef, scaled=False), state


def _mpx(size: Size, vocab: int) -> tuple[Callable, Any]:
    """mpx's README: `mpx.filter_value_and_grad(loss, scaling)` then `mpx.optimizer_update`.

    `filter_value_and_grad` casts every floating argument to float16 before the loss, the
    float32 parameters included, and differentiates with respect to that float16 copy.
    mpx's README jits with `eqx.filter_jit`, which keeps the `DynamicLossScaling`'s
    integer fields static; under `jax.jit` the state carries its arrays, split off with
    `eqx.partition`, and the step combines them with the static rest again.
    """
    import equinox as eqx
    import mpx

    tx = adamw()
    graphdef, params = _split_model(size, vocab)
    loss_of = _loss_of(graphdef)
    scaling = mpx.DynamicLossScaling(
        loss_scaling=jnp.float32(LOSS_SCALE), min_loss_scaling=jnp.float32(1.0), period=2000
    )
    scaling_arrays, scaling_static = eqx.partition(scaling, eqx.is_array)

    def train_step(state, inputs, targets):
        params, opt_state, scaling_arrays = state
        loss_scaling = eqx.combine(scaling_arrays, scaling_static)
        loss, loss_scaling, grads_finite, grads = mpx.filter_value_and_grad(
            loss_of, scaling=loss_scaling
        )(params, inputs, targets)
        params, opt_state = mpx.optimizer_update(params, tx, opt_state, grads, grads_finite)
        scaling_arrays, _ = eqx.partition(loss_scaling, eqx.is_array)
        return (params, opt_state, scaling_arrays), loss

    return train_step, (params, tx.init(params), scaling_arrays)


def parameter_count(state: Any) -> tuple[int, int]:
    """`(parameters, leaves)` of the model in a split `(model, optimizer)` state."""
    leaves = jax.tree.leaves(state[0])
    return sum(leaf.size for leaf in leaves), len(leaves)
