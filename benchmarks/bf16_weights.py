"""bfloat16 weights without a float32 copy: four ways to train one model with adamw.

What it measures: a character-level MLP language model on the Python standard library's
own source (the text of `benchmarks.gpt`), a window of `--context` characters embedded,
concatenated and passed through two GELU layers, computing in bfloat16 with the loss in
float32, trained by `optax.adamw` for `--steps` steps on the same batches four ways:

- `float32 master`: float32 params and adamw state, cast to bfloat16 for the forward pass;
- `bf16 nearest`: bfloat16 params and adamw state, `optax.apply_updates` rounding to nearest;
- `bf16 + stochastic_rounding`: the same, `jls.stochastic_rounding(key)` last in the chain;
- `bf16 + kahan_summation`: the same, `jls.kahan_summation()` last in the chain.

Reported: the mean training loss over the last tenth of the steps and its ratio to the
float32 master run's, the median seconds per step and its ratio to `bf16 nearest`, and
the bytes of params and optimizer state per parameter. The four runs take turns block by
block of `--block` steps, so each timing comes from the same stretch of machine time; the
first step of a block (after switching programs) is not timed.

Then the optimizer step alone at `--step-sizes` parameters (bfloat16, in 8 leaves), with
bfloat16 gradients and with float32 ones:
`tx.update` and `optax.apply_updates` jitted with params and state donated, for adamw
rounding to nearest and with each remedy last in the chain, taking turns step by step
`--step-repeats` times; reported: the median and its ratio to rounding to nearest. Run:

    python -m benchmarks bf16-weights --json benchmarks/results/bf16-weights-cpu.json
"""

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls
from benchmarks import gpt
from benchmarks.measure import command, default_path, machine, parse_count, write_results

BF16, F32 = jnp.bfloat16, jnp.float32
CONTENDERS = (
    "float32 master",
    "bf16 nearest",
    "bf16 + stochastic_rounding",
    "bf16 + kahan_summation",
)


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parse(argv)
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    results = measure(args)
    results["optimizer_step"] = measure_optimizer_steps(args)
    results = {"machine": machine(), "command": _command(argv), **results}
    print(table(results), flush=True)
    write_results(results, args.json or default_path("bf16-weights-"))
    return results


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks bf16-weights", description=__doc__)
    parser.add_argument("--platform", default=None, help="cpu, gpu or tpu; default: JAX's")
    add_training_arguments(parser, step_sizes="160K,1M,4M")
    return parser.parse_args(argv)


def add_training_arguments(parser: argparse.ArgumentParser, step_sizes: str) -> None:
    """The arguments of the MLP's training runs and of the optimizer step alone (at
    `step_sizes` by default), shared with `benchmarks.low_precision_state`."""
    parser.add_argument("--steps", type=int, default=2000, help="training steps of each run")
    parser.add_argument("--block", type=int, default=50, help="steps of one run in a row")
    parser.add_argument("--batch", type=int, default=1024, help="windows per step")
    parser.add_argument("--context", type=int, default=16, help="characters per window")
    parser.add_argument("--embed", type=int, default=16, help="embedding width")
    parser.add_argument("--hidden", type=int, default=256, help="hidden layers' width")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument(
        "--step-sizes",
        type=lambda text: [parse_count(item) for item in text.split(",") if item.strip()],
        default=step_sizes,
        help="parameter counts of the optimizer step alone, comma-separated ('' for none)",
    )
    parser.add_argument("--step-repeats", type=int, default=30, help="timed steps of each")
    parser.add_argument("--json", default=None, help="where to write the results (JSON)")


def _command(argv: Sequence[str] | None) -> str:
    return command(None if argv is None else ["bf16-weights", *argv])


# --- the model ------------------------------------------------------------------------------


def init_params(vocab: int, context: int, embed: int, hidden: int) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(0), 4)

    def dense(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
        return jax.random.normal(key, (fan_in, fan_out), F32) / np.sqrt(fan_in)

    return {
        "embed": jax.random.normal(keys[0], (vocab, embed), F32),
        "w1": dense(keys[1], context * embed, hidden),
        "b1": jnp.zeros(hidden, F32),
        "w2": dense(keys[2], hidden, hidden),
        "b2": jnp.zeros(hidden, F32),
        "w3": dense(keys[3], hidden, vocab),
        "b3": jnp.zeros(vocab, F32),
    }


def loss_fn(params: dict[str, jax.Array], inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Cross-entropy of the next character, computed in bfloat16, the loss in float32."""
    p = jls.cast_tree(params, BF16)
    x = p["embed"][inputs].reshape(inputs.shape[0], -1)
    x = jax.nn.gelu(x @ p["w1"] + p["b1"])
    x = jax.nn.gelu(x @ p["w2"] + p["b2"])
    logits = (x @ p["w3"] + p["b3"]).astype(F32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def optimizers(args: argparse.Namespace) -> dict[str, tuple[Any, optax.GradientTransformation]]:
    """Each contender's param dtype and optimizer."""
    adamw = optax.adamw(args.learning_rate, weight_decay=args.weight_decay)
    return {
        "float32 master": (F32, adamw),
        "bf16 nearest": (BF16, adamw),
        "bf16 + stochastic_rounding": (
            BF16,
            optax.chain(adamw, jls.stochastic_rounding(jax.random.key(1))),
        ),
        "bf16 + kahan_summation": (BF16, optax.chain(adamw, jls.kahan_summation())),
    }


def train_step_of(tx: optax.GradientTransformation, loss: Callable = loss_fn) -> Callable:
    def step(params, opt_state, inputs, targets):
        loss_value, grads = jax.value_and_grad(loss)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_value

    return jax.jit(step, donate_argnums=(0, 1))


def windows(tokens: np.ndarray, args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """All steps' (inputs, targets), drawn once, the same for every contender."""
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(tokens) - args.context - 1, (args.steps, args.batch))
    offsets = np.arange(args.context + 1)
    taken = tokens[starts[..., None] + offsets]
    return taken[..., :-1], taken[..., -1]


# --- the measurement ------------------------------------------------------------------------


class Task(NamedTuple):
    """A model to train: its float32 master params, the loss `(params, inputs, targets)`, and
    every step's batch, the same for each contender."""

    params: Any
    loss: Callable[[Any, Any, Any], jax.Array]
    inputs: np.ndarray  # one batch a step
    targets: np.ndarray
    vocab: int


def mlp_task(args: argparse.Namespace) -> Task:
    """The MLP language model of `init_params` and `loss_fn` on `windows` of the text."""
    tokens, vocab = gpt.stdlib_text(max_bytes=2_000_000)
    inputs, targets = windows(tokens, args)
    master = init_params(vocab, args.context, args.embed, args.hidden)
    return Task(master, loss_fn, inputs, targets, vocab)


class Training(NamedTuple):
    """What `train` measured of each contender, by name."""

    params: int  # parameters of the model
    vocab: int
    bytes_per_param: dict[str, float]  # params and optimizer state, over `params`
    losses: dict[str, list[Any]]  # one a step
    final_loss: dict[str, float]  # the mean over the last tenth of the steps
    step_seconds: dict[str, float]  # the median step, the first of each block not counted


def train(
    args: argparse.Namespace, contenders: dict[str, tuple[Any, Any]], task: Task | None = None
) -> Training:
    """Trains `task` (by default the MLP, `mlp_task`) from the same master params with each
    `(params dtype, tx)` of `contenders` on the same batches, taking turns block by block,
    for as many steps as the task has batches."""
    task = mlp_task(args) if task is None else task
    master, inputs, targets, vocab = task.params, task.inputs, task.targets, task.vocab
    states, steps = {}, {}
    for name, (dtype, tx) in contenders.items():
        params = jls.cast_tree(master, dtype)
        states[name] = (params, tx.init(params))
        steps[name] = train_step_of(tx, task.loss)
    size = sum(leaf.size for leaf in jax.tree.leaves(master))
    state_bytes = {
        name: sum(leaf.nbytes for leaf in jax.tree.leaves(state)) / size
        for name, state in states.items()
    }
    losses: dict[str, list[Any]] = {name: [] for name in states}
    times: dict[str, list[float]] = {name: [] for name in states}
    total = len(inputs)
    for start in range(0, total, args.block):
        for name in states:
            for t in range(start, min(start + args.block, total)):
                begin = time.perf_counter()
                params, opt_state, loss = steps[name](*states[name], inputs[t], targets[t])
                loss.block_until_ready()
                if t > start:
                    times[name].append(time.perf_counter() - begin)
                states[name] = (params, opt_state)
                losses[name].append(loss)
    tail = max(total // 10, 1)
    final = {name: float(np.mean(np.asarray(values[-tail:]))) for name, values in losses.items()}
    step_time = {name: statistics.median(values) for name, values in times.items()}
    return Training(size, vocab, state_bytes, losses, final, step_time)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    run = train(args, optimizers(args))
    size, vocab, state_bytes, losses = run.params, run.vocab, run.bytes_per_param, run.losses
    final, step_time = run.final_loss, run.step_seconds
    tail = max(args.steps // 10, 1)
    curves = {
        name: [
            float(np.mean(np.asarray(values[i : i + tail]))) for i in range(0, len(values), tail)
        ]
        for name, values in losses.items()
    }
    return {
        "model": {
            "params": size,
            "vocab": vocab,
            "context": args.context,
            "embed": args.embed,
            "hidden": args.hidden,
            "batch": args.batch,
            "steps": args.steps,
            "learning_rate": args.learning_rate,
            "weight_decay": args.weight_decay,
        },
        "rows": [
            {
                "contender": name,
                "final_loss": final[name],
                "loss_ratio_to_master": final[name] / final["float32 master"],
                "step_seconds": step_time[name],
                "time_ratio_to_nearest": step_time[name] / step_time["bf16 nearest"],
                "bytes_per_param": state_bytes[name],
            }
            for name in CONTENDERS
        ],
        "loss_curves": {"every_steps": tail, "values": curves},
    }


def measure_optimizer_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The optimizer step alone at each of `args.step_sizes` parameters."""
    adamw = optax.adamw(args.learning_rate, weight_decay=args.weight_decay)
    contenders = {
        "bf16 nearest": adamw,
        "bf16 + stochastic_rounding": optax.chain(
            adamw, jls.stochastic_rounding(jax.random.key(1))
        ),
        "bf16 + kahan_summation": optax.chain(adamw, jls.kahan_summation()),
    }
    rows = []
    for size in args.step_sizes:
        for grads_dtype in (BF16, F32):
            rows.extend(_optimizer_steps(args, contenders, size, grads_dtype))
    return rows


def _optimizer_steps(
    args: argparse.Namespace, contenders: dict[str, Any], size: int, grads_dtype: Any
) -> list[dict[str, Any]]:
    """The optimizer step alone at `size` bfloat16 parameters and gradients of `grads_dtype`
    (bfloat16, as `jax.grad` gives bfloat16 weights, or float32, as from a float32 loss)."""
    leaf = max(size // 8, 1)
    shape = (max(leaf // 1000, 1), min(leaf, 1000))
    keys = jax.random.split(jax.random.key(2), 8)
    grads = [(jax.random.normal(key, shape) * 1e-3).astype(grads_dtype) for key in keys]
    states, steps = {}, {}
    for name, tx in contenders.items():
        params = [jnp.ones(shape, BF16) * 0.5 for _ in keys]
        states[name] = (params, tx.init(params))
        steps[name] = _optimizer_step_of(tx)
        states[name] = steps[name](*states[name], grads)  # compiled, not timed
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.step_repeats):
        for name in contenders:
            begin = time.perf_counter()
            states[name] = steps[name](*states[name], grads)
            jax.block_until_ready(states[name])
            times[name].append(time.perf_counter() - begin)
    median = {name: statistics.median(values) for name, values in times.items()}
    return [
        {
            "params": len(keys) * shape[0] * shape[1],
            "grads": jnp.dtype(grads_dtype).name,
            "contender": name,
            "step_seconds": median[name],
            "time_ratio_to_nearest": median[name] / median["bf16 nearest"],
        }
        for name in contenders
    ]


def _optimizer_step_of(tx: optax.GradientTransformation) -> Callable:
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


def table(results: dict[str, Any]) -> str:
    model = results["model"]
    lines = [
        f"\n## bf16-weights: MLP LM, {model['params'] / 1e3:g}K params, adamw "
        f"lr {model['learning_rate']:g}, {model['steps']} steps",
        "contender | final loss (vs float32 master) | step (vs bf16 nearest) | bytes/param",
        "--- | --- | --- | ---",
    ]
    lines += training_lines(results["rows"])
    if results.get("optimizer_step"):
        lines += [
            "\n## the optimizer step alone (adamw, bfloat16 params in 8 leaves, donated)",
            "params | grads | contender | step (vs bf16 nearest)",
            "--- | --- | --- | ---",
        ]
        for row in results["optimizer_step"]:
            lines.append(
                f"{row['params'] / 1e3:g}K | {row['grads']} | {row['contender']} | "
                f"{row['step_seconds'] * 1e3:.2f} ms ({row['time_ratio_to_nearest']:.2f}x)"
            )
    return "\n".join(lines)


def training_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The table lines of training runs: final loss, step time and bytes a parameter."""
    return [
        f"{row['contender']} | {row['final_loss']:.4f} ({row['loss_ratio_to_master']:.3f}x)"
        f" | {row['step_seconds'] * 1e3:.2f} ms ({row['time_ratio_to_nearest']:.2f}x)"
        f" | {row['bytes_per_param']:.1f}"
        for row in rows
    ]


if __name__ == "__main__":
    main()
