"""Optimizer state in bfloat16: `low_precision_state` on the model of `benchmarks.bf16_weights`.

The character-level MLP language model of `benchmarks.bf16_weights` (computing in bfloat16,
the loss in float32), trained by `optax.adamw` for `--steps` steps on the same batches:

- `float32 master`: float32 params and adamw state;
- `bf16 + kahan, float32 state`: bfloat16 params, `jls.kahan_summation()` last in the chain,
  adamw's moments float32 (`jls.low_precision_state(adamw, jnp.float32)`: optax makes them
  in the params' dtype, bfloat16 rounded to nearest, unless told);
- `bf16 + kahan, bf16 state nearest`: the same, adamw inside
  `jls.low_precision_state(..., rounding="nearest")`;
- `bf16 + kahan, bf16 state stochastic`: the same, rounded stochastically.

Reported: the mean training loss over the last tenth of the steps and its ratio to the float32
master's, the median seconds a step (the runs take turns block by block), and the bytes of
params and optimizer state a parameter. The same four train the GPT-style decoder of
`benchmarks.gpt` in flax nnx (a nanoGPT-like character model: `--decoder-layers` blocks of
width `--decoder-width`, computing in bfloat16) for `--decoder-steps` steps of
`--decoder-batch` windows of `--decoder-seq` characters. Then the optimizer step alone
(`tx.update` and `optax.apply_updates`, jitted, donated) at `--step-sizes` bfloat16 parameters
in 8 leaves, for the three bfloat16 contenders, timed in turns (`benchmarks.measure.block_medians`).
Run:

    python -m benchmarks.low_precision_state --json benchmarks/results/low-precision-state-cpu.json
"""

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_lossscale as jls
from benchmarks import bf16_weights, gpt
from benchmarks.measure import (
    Runner,
    block_medians,
    default_path,
    machine,
    write_results,
)

BF16, F32 = jnp.bfloat16, jnp.float32
CONTENDERS = (
    "float32 master",
    "bf16 + kahan, float32 state",
    "bf16 + kahan, bf16 state nearest",
    "bf16 + kahan, bf16 state stochastic",
)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.low_precision_state")
    bf16_weights.add_training_arguments(parser, step_sizes="1M,4M")
    parser.add_argument(
        "--decoder-steps", type=int, default=800, help="the decoder's steps (0: none)"
    )
    parser.add_argument("--decoder-layers", type=int, default=4)
    parser.add_argument("--decoder-width", type=int, default=128)
    parser.add_argument("--decoder-seq", type=int, default=64)
    parser.add_argument("--decoder-batch", type=int, default=16)
    args = parser.parse_args(argv)
    results = {
        "machine": machine(),
        "command": " ".join(["python -m benchmarks.low_precision_state", *(argv or [])]),
        **measure(args),
        "decoder": measure_decoder(args) if args.decoder_steps else None,
        "optimizer_step": measure_optimizer_steps(args),
    }
    print(table(results), flush=True)
    write_results(results, args.json or default_path("low-precision-state-"))
    return results


def optimizers(learning_rate: float, weight_decay: float) -> dict[str, tuple[Any, Any]]:
    """Each contender's param dtype and optimizer."""
    adamw = optax.adamw(learning_rate, weight_decay=weight_decay)
    key = jax.random.key(1)
    return {
        "float32 master": (F32, adamw),
        # optax makes adam's moments in the params' dtype: float32 ones need a float32 state
        "bf16 + kahan, float32 state": (
            BF16,
            optax.chain(jls.low_precision_state(adamw, F32), jls.kahan_summation()),
        ),
        "bf16 + kahan, bf16 state nearest": (
            BF16,
            optax.chain(jls.low_precision_state(adamw, rounding="nearest"), jls.kahan_summation()),
        ),
        "bf16 + kahan, bf16 state stochastic": (
            BF16,
            optax.chain(jls.low_precision_state(adamw, key=key), jls.kahan_summation()),
        ),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    run = bf16_weights.train(args, optimizers(args.learning_rate, args.weight_decay))
    return {
        "model": {"params": run.params, "steps": args.steps, "batch": args.batch},
        "rows": _rows(run),
    }


def measure_decoder(args: argparse.Namespace) -> dict[str, Any]:
    """The four contenders on the GPT-style decoder, bfloat16 compute, in flax nnx."""
    tokens, vocab = gpt.stdlib_text(max_bytes=2_000_000)
    size = gpt.Size(
        args.decoder_layers,
        args.decoder_width,
        heads=4,
        seq=args.decoder_seq,
        batch=args.decoder_batch,
        compute=BF16,
    )
    graphdef, master = nnx.split(gpt.GPT(size, vocab, nnx.Rngs(0)))
    stream = gpt.batches(tokens, size, seed=1)
    inputs, targets = zip(*(next(stream) for _ in range(args.decoder_steps)), strict=True)

    def loss(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    task = bf16_weights.Task(master, loss, np.stack(inputs), np.stack(targets), vocab)
    run = bf16_weights.train(args, optimizers(args.learning_rate, args.weight_decay), task)
    return {
        "model": {
            "params": run.params,
            "leaves": len(jax.tree.leaves(master)),
            "layers": size.layers,
            "width": size.width,
            "seq": size.seq,
            "batch": size.batch,
            "steps": args.decoder_steps,
        },
        "rows": _rows(run),
    }


def _rows(run: bf16_weights.Training) -> list[dict[str, Any]]:
    held, final, step_time = run.bytes_per_param, run.final_loss, run.step_seconds
    reference = "bf16 + kahan, bf16 state nearest"
    return [
        {
            "contender": name,
            "final_loss": final[name],
            "loss_ratio_to_master": final[name] / final["float32 master"],
            "step_seconds": step_time[name],
            "time_ratio_to_nearest": step_time[name] / step_time[reference],
            "bytes_per_param": held[name],
        }
        for name in CONTENDERS
    ]


def measure_optimizer_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The optimizer step alone at each of `args.step_sizes` bfloat16 parameters."""
    contenders = {
        name: tx
        for name, (dtype, tx) in optimizers(args.learning_rate, args.weight_decay).items()
        if dtype == BF16
    }

    def step_of(tx: Any) -> Any:
        def step(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step

    rows = []
    for size in args.step_sizes:
        shape = (8, size // 8 // 1000, 1000)
        params = [jnp.full(shape[1:], 0.5, BF16) for _ in range(shape[0])]
        keys = jax.random.split(jax.random.key(2), shape[0])
        grads = [jax.random.normal(key, shape[1:], BF16) * 1e-3 for key in keys]
        runners = {
            name: Runner(step_of(tx), tx.init, params, grads) for name, tx in contenders.items()
        }
        held = {
            name: sum(leaf.nbytes for leaf in jax.tree.leaves((params, runner.state)))
            / (8 * shape[1] * shape[2])
            for name, runner in runners.items()
        }
        medians, _ = block_medians(runners, args.step_repeats, block=5)
        nearest = medians["bf16 + kahan, bf16 state nearest"]
        rows.extend(
            {
                "params": 8 * shape[1] * shape[2],
                "contender": name,
                "step_seconds": medians[name],
                "time_ratio_to_nearest": medians[name] / nearest,
                "bytes_per_param": held[name],
            }
            for name in contenders
        )
    return rows


def table(results: dict[str, Any]) -> str:
    model = results["model"]
    lines = [
        f"\n## low-precision-state: MLP LM, {model['params'] / 1e3:g}K params, adamw, "
        f"{model['steps']} steps",
        "contender | final loss (vs float32 master) | step (vs bf16 state nearest) | bytes/param",
        "--- | --- | --- | ---",
    ]
    lines += bf16_weights.training_lines(results["rows"])
    if results.get("decoder"):
        decoder = results["decoder"]["model"]
        lines += [
            f"\n## the GPT-style decoder, {decoder['params'] / 1e3:g}K params in "
            f"{decoder['leaves']} leaves, bfloat16 compute, {decoder['steps']} steps",
            "contender | final loss (vs float32 master) | step (vs bf16 state nearest) "
            "| bytes/param",
            "--- | --- | --- | ---",
            *bf16_weights.training_lines(results["decoder"]["rows"]),
        ]
    if results.get("optimizer_step"):
        lines += [
            "\n## the optimizer step alone (adamw + kahan, bfloat16 params in 8 leaves, donated)",
            "params | contender | step (vs bf16 state nearest) | bytes/param",
            "--- | --- | --- | ---",
        ]
        for row in results["optimizer_step"]:
            lines.append(
                f"{row['params'] / 1e6:g}M | {row['contender']} | "
                f"{row['step_seconds'] * 1e3:.2f} ms ({row['time_ratio_to_nearest']:.2f}x)"
                f" | {row['bytes_per_param']:.1f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
