"""What XLA compiles for the benchmark steps: `python -m benchmarks.hlo --help`.

For each step of the benchmarks (the optimizer step alone, the float16 MLP step and the
float16 GPT step, with each loss scale), it compiles the donated step and counts the
instructions of the optimized HLO by kind (reductions, conditionals, fusions, custom calls,
collectives), with XLA's temp memory beside. Two runs of it on two versions of the library
show whether a change altered what XLA compiles: a change of form only leaves every count
the same. No step is run, so it takes a minute or two on 2 CPU cores.
"""

import argparse
import collections
import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

import jax_lossscale as jls
from benchmarks import contenders, gpt, measure, run

# An instruction of the optimized HLO, `name = type opcode(operands), ...`: its opcode is the
# first word followed by a parenthesis after the ` = ` (a type holds none).
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?[\w.-]+ = .*?(?<![\w.-])([a-z][a-z0-9-]*)\(", re.MULTILINE
)
KINDS = ("reduce", "conditional", "fusion", "custom-call", "all-reduce", "all-gather", "while")


def op_counts(compiled: Any) -> dict[str, int]:
    """The instructions of a compiled step's optimized HLO counted by opcode, with
    `instructions` (all of them) and `temp_bytes` (XLA's temp buffer)."""
    opcodes = collections.Counter(_INSTRUCTION.findall(compiled.as_text()))
    counts = {kind: opcodes.get(kind, 0) for kind in KINDS}
    counts["instructions"] = sum(opcodes.values())
    counts["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
    return counts


def _loss_scales() -> dict[str, Callable[[optax.GradientTransformation], Any]]:
    scale = contenders.LOSS_SCALE
    return {
        "DynamicLossScale": lambda inner: jls.loss_scaled(
            inner, jls.DynamicLossScale(initial_loss_scale=scale)
        ),
        "DynamicLossScale, spike skipping": lambda inner: jls.loss_scaled(
            inner,
            jls.DynamicLossScale(initial_loss_scale=scale),
            skip_grad_norm_above=100.0,
            skip_spike_sigmas=6.0,
        ),
        "FixedLossScale": lambda inner: jls.loss_scaled(inner, jls.FixedLossScale(scale)),
    }


def _optimizer_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _compiled(step: Callable[..., Any], init: Callable[[Any], Any], params, *inputs) -> Any:
    state = jax.eval_shape(init, params)
    return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, *inputs).compile()


def counts_of_steps(size: int, leaves: int, gpt_size: str | None) -> dict[str, dict[str, Any]]:
    """Op counts of every benchmark step, keyed by `case / optimizer / loss scale`."""
    results: dict[str, dict[str, Any]] = {}
    params, grads = measure.params_and_grads(size, leaves)
    mlp_params, batch = run.mlp(256, 4, 64)
    for optimizer, make_inner in measure.OPTIMIZERS.items():
        results[f"step / {optimizer} / bare"] = op_counts(
            _compiled(_optimizer_step(make_inner()), make_inner().init, params, grads)
        )
        for name, wrap in _loss_scales().items():
            tx = wrap(make_inner())
            step = _optimizer_step(tx)
            results[f"step / {optimizer} / {name}"] = op_counts(
                _compiled(step, tx.init, params, grads)
            )
            contender = contenders.jax_lossscale(make_inner())
            if name == "DynamicLossScale":  # the benchmarks' own MLP step
                mlp_step = functools.partial(run.mlp_train_step, contender.train_step)
                results[f"mlp / {optimizer} / {name}"] = op_counts(
                    _compiled(mlp_step, contender.init, mlp_params, batch)
                )
    if gpt_size is not None:
        tokens, vocab = gpt.stdlib_text(max_bytes=200_000)
        inputs, targets = next(gpt.batches(tokens, gpt.SIZES[gpt_size]))
        for name, make_tx in gpt.contenders().items():
            graphdef, state = gpt.shapes_of_build(
                gpt.train_state, gpt.SIZES[gpt_size], vocab, make_tx()
            )
            step = gpt.train_step_of(graphdef, name != "bare")
            compiled = jax.jit(step, donate_argnums=0).lower(state, inputs, targets).compile()
            results[f"gpt {gpt_size} / adamw / {name}"] = op_counts(compiled)
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hlo", description=__doc__)
    parser.add_argument("--size", default="1M", help="parameters of the optimizer step")
    parser.add_argument("--leaves", type=int, default=64, help="leaves of the optimizer step")
    parser.add_argument(
        "--gpt-size", default="70 leaves", help=f"one of {', '.join(gpt.SIZES)}, or none"
    )
    parser.add_argument("--json", default=None, help="where to write the counts as JSON")
    args = parser.parse_args(argv)
    gpt_size = None if args.gpt_size == "none" else args.gpt_size
    results = counts_of_steps(measure.parse_count(args.size), args.leaves, gpt_size)
    report(results, [*KINDS, "instructions", "temp_bytes"], args.json)
    return results


def report(results: dict[str, dict[str, int]], columns: Sequence[str], path: str | None) -> None:
    """Prints `results` as a table of `columns`, a row per step, and writes them to `path` as
    JSON when it is given."""
    width = max(len(name) for name in results)
    print(f"{'step':<{width}} | " + " | ".join(columns))
    for name, counts in results.items():
        print(f"{name:<{width}} | " + " | ".join(str(value) for value in counts.values()))
    if path:
        with open(path, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
