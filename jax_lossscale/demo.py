"""Float16 training with and without loss scaling, side by side: `python -m jax_lossscale.demo`.

The demo fits a small MLP to a regression task it generates itself, whose targets are of
order 1e-3. The gradients of its mean squared error are then tiny: at initialisation the
median gradient entry is about 6e-9, ten times below float16's smallest positive number
(6e-8), and they shrink as training goes on. It trains the same model from the same
initialisation three ways, for the same number of steps with the same optimizer (Adam with a
cosine learning rate decay):

* ``float32``: the reference;
* ``float16``: parameters and inputs cast to float16 for the forward and backward pass, no
  loss scaling: most gradient entries underflow to exactly zero and training stalls;
* ``float16_scaled``: the same float16 computation, with the loss multiplied by the scale of
  a `DynamicLossScale` and the optimizer wrapped in `loss_scaled`: it tracks float32.

The parameters are kept in float32 (master weights) in every run, and the loss is computed in
float32 from the float16 predictions. The scale starts high, at 2**32, as the
`DynamicLossScale` docstring advises: the first steps overflow and are skipped while it backs
off, then it doubles every 100 finite steps, backing off again whenever it overflows, and
climbs as the gradients shrink during training.

It needs tqdm, and matplotlib for ``--plot``: ``pip install -e ".[demo]"``. Usage::

    python -m jax_lossscale.demo                 # 3000 steps per run, under a minute on 2 cores
    python -m jax_lossscale.demo --steps 1000 --seed 1 --plot curves.png

`main` returns the runs' results, for use from Python or a notebook.
"""

import argparse
import dataclasses
import functools
import importlib
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls

DEFAULT_STEPS = 3000
NUM_EXAMPLES = 1024
INPUT_DIM = 16
HIDDEN_DIM = 64
TARGET_SIZE = 1e-3
LEARNING_RATE = 1e-3
INITIAL_LOSS_SCALE = 2.0**32
INCREMENT_PERIOD = 100
SYNC_EVERY = 50  # steps between progress bar updates

Params = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What one training run produced.

    Attributes:
      label: the run's name in the summary table.
      losses: float32 [steps]: the training loss at each step, before its update.
      loss_scales: float32 [steps]: the loss scale each step used (1 without loss scaling).
      applied: bool [steps]: whether each step's update was applied (false: skipped).
      zero_grad_shares: float32 [steps]: the share of gradient entries that are exactly 0.
      grad_errors: per parameter, float32 [steps]: the relative error of the run's (unscaled)
        gradient against the float32 gradient at the same parameters, `|g - g32| / |g32|`.
      stats: with loss scaling, `get_loss_scale_stats` of the final optimizer state.
    """

    label: str
    losses: np.ndarray
    loss_scales: np.ndarray
    applied: np.ndarray
    zero_grad_shares: np.ndarray
    grad_errors: dict[str, np.ndarray]
    stats: jls.LossScaleStats | None

    @property
    def final_loss(self) -> float:
        return float(self.losses[-1])

    @property
    def zero_grad_share(self) -> float:
        """The mean over all steps of the share of exactly-zero gradient entries."""
        return float(np.mean(self.zero_grad_shares))

    def median_grad_errors(self) -> dict[str, float]:
        """Per parameter, the median over the applied steps of its gradient's relative error."""
        return {
            name: float(np.median(errors[self.applied])) if self.applied.any() else math.nan
            for name, errors in self.grad_errors.items()
        }


class _Run(NamedTuple):
    key: str
    label: str
    dtype: jax.typing.DTypeLike
    loss_scale: jls.LossScale | None


_RUNS = (
    _Run("float32", "float32", jnp.float32, None),
    _Run("float16", "float16, no loss scaling", jnp.float16, None),
    _Run(
        "float16_scaled",
        "float16, DynamicLossScale",
        jnp.float16,
        jls.DynamicLossScale(INITIAL_LOSS_SCALE, increment_period=INCREMENT_PERIOD),
    ),
)


class _StepLog(NamedTuple):
    loss: jax.Array
    loss_scale: jax.Array
    applied: jax.Array
    zero_grad_share: jax.Array
    grad_errors: dict[str, jax.Array]


def main(argv: list[str] | None = None) -> dict[str, RunResult]:
    """Runs the demo with command line arguments `argv` (default: `sys.argv[1:]`).

    Prints a progress bar per run and a summary table, writes the figure when `--plot` is
    given, and returns the results keyed "float32", "float16" and "float16_scaled".
    """
    args = _parser().parse_args(argv)
    tqdm = _require("tqdm").tqdm
    if args.plot is not None:
        _require("matplotlib")

    x, y, params = _make_task(args.seed)
    results = {}
    for run in _RUNS:
        with tqdm(total=args.steps, desc=f"{run.label:<26}", unit="step") as bar:
            results[run.key] = _train(run, x, y, params, args.steps, bar.update)

    print(_summary(results))
    if args.plot is not None:
        _plot(results, args.plot)
        print(f"\nwrote {args.plot}")
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jax_lossscale.demo",
        description=(
            "Trains a small MLP on a generated task three ways: float32, float16 without loss "
            "scaling, and float16 with jax_lossscale.DynamicLossScale. Without scaling, most "
            "float16 gradient entries underflow to zero and training stalls; with it, float16 "
            "training tracks float32."
        ),
    )
    parser.add_argument(
        "--steps",
        type=_positive_int,
        default=DEFAULT_STEPS,
        help=f"training steps per run (default: {DEFAULT_STEPS})",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the data and the initialisation (default: 0)"
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="write a figure of the loss curves and the loss scale trajectory (needs matplotlib)",
    )
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _require(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise SystemExit(
            f"jax_lossscale.demo needs {name}, which is not installed. "
            'Install the demo extra: pip install -e ".[demo]"'
        ) from None


def _make_task(seed: int) -> tuple[jax.Array, jax.Array, Params]:
    """Inputs, targets of order `TARGET_SIZE` from a random teacher, and initial parameters."""
    key_x, key_teacher, key_1, key_2, key_3 = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(key_x, (NUM_EXAMPLES, INPUT_DIM))
    teacher = jax.random.normal(key_teacher, (INPUT_DIM, 8)) / math.sqrt(INPUT_DIM)
    y = TARGET_SIZE * jnp.sin(2 * x @ teacher).sum(-1, keepdims=True) / math.sqrt(8)

    def dense(key: jax.Array, fan_in: int, fan_out: int, size: float = 1.0) -> jax.Array:
        return size * jax.random.normal(key, (fan_in, fan_out)) / math.sqrt(fan_in)

    params = {
        "w1": dense(key_1, INPUT_DIM, HIDDEN_DIM),
        "b1": jnp.zeros(HIDDEN_DIM),
        "w2": dense(key_2, HIDDEN_DIM, HIDDEN_DIM),
        "b2": jnp.zeros(HIDDEN_DIM),
        "w3": dense(key_3, HIDDEN_DIM, 1, size=TARGET_SIZE),
        "b3": jnp.zeros(1),
    }
    return x, y, params


def _loss(params: Params, x: jax.Array, y: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
    """Mean squared error of the MLP computed in `dtype`, returned in float32."""
    p = jls.cast_tree(params, dtype)
    h = jnp.tanh(x.astype(dtype) @ p["w1"] + p["b1"])
    h = jnp.tanh(h @ p["w2"] + p["b2"])
    prediction = (h @ p["w3"] + p["b3"]).astype(jnp.float32)
    return jnp.mean((prediction - y) ** 2)


def _optimizer(run: _Run, steps: int) -> optax.GradientTransformation:
    tx = optax.adam(optax.cosine_decay_schedule(LEARNING_RATE, steps))
    return tx if run.loss_scale is None else jls.loss_scaled(tx, run.loss_scale)


@functools.partial(jax.jit, static_argnames=("run", "steps"))
def _train_step(
    params: Params,
    opt_state: optax.OptState,
    x: jax.Array,
    y: jax.Array,
    *,
    run: _Run,
    steps: int,
) -> tuple[Params, optax.OptState, _StepLog]:
    scaled = run.loss_scale is not None
    scale = jls.get_loss_scale(opt_state) if scaled else jnp.ones([], jnp.float32)
    loss, grads = jls.value_and_grad(_loss, scale)(params, x, y, run.dtype)
    # The gradients with respect to the float32 parameters are the float16 ones cast up:
    # they have the same zeros.
    leaves = jax.tree.leaves(grads)
    zeros = sum(jnp.count_nonzero(leaf == 0) for leaf in leaves)
    zero_grad_share = (zeros / sum(leaf.size for leaf in leaves)).astype(jnp.float32)
    # What few zeros do not show: how far the float16 gradient is from float32's.
    reference = jax.grad(_loss)(params, x, y, jnp.float32)
    grad_errors = {
        name: jnp.linalg.norm(grads[name] / scale - reference[name])
        / jnp.linalg.norm(reference[name])
        for name in grads
    }

    updates, opt_state = _optimizer(run, steps).update(grads, opt_state, params)
    if scaled:
        applied = jls.get_loss_scale_stats(opt_state).last_step_applied
    else:
        applied = jnp.ones([], jnp.bool_)
    log = _StepLog(loss, scale, applied, zero_grad_share, grad_errors)
    # optax types the new params as any tree; they have the structure of `params`.
    return cast(Params, optax.apply_updates(params, updates)), opt_state, log


def _train(
    run: _Run,
    x: jax.Array,
    y: jax.Array,
    params: Params,
    steps: int,
    progress: Callable[[int], object],
) -> RunResult:
    opt_state = _optimizer(run, steps).init(params)
    logs = []
    reported = 0
    for step in range(1, steps + 1):
        params, opt_state, log = _train_step(params, opt_state, x, y, run=run, steps=steps)
        logs.append(log)
        if step % SYNC_EVERY == 0 or step == steps:
            log.loss.block_until_ready()
            progress(step - reported)
            reported = step

    history = jax.tree.map(lambda *values: np.stack(values), *jax.device_get(logs))
    stats = None if run.loss_scale is None else jls.get_loss_scale_stats(opt_state)
    return RunResult(
        label=run.label,
        losses=history.loss,
        loss_scales=history.loss_scale,
        applied=history.applied,
        zero_grad_shares=history.zero_grad_share,
        grad_errors=history.grad_errors,
        stats=jax.device_get(stats),
    )


def _summary(results: dict[str, RunResult]) -> str:
    reference = results["float32"].final_loss
    header = (
        "run",
        "final loss",
        "vs float32",
        "skipped steps",
        "final scale",
        "zero grads*",
        "grad error**",
    )
    rows = [header]
    worst = []
    for key, result in results.items():
        stats = result.stats
        errors = result.median_grad_errors()
        rows.append(
            (
                result.label,
                f"{result.final_loss:.3e}",
                f"{result.final_loss / reference:.2f}x",
                "-" if stats is None else str(stats.skipped_steps),
                "-" if stats is None else f"2**{math.log2(stats.loss_scale):g}",
                f"{result.zero_grad_share:.1%}",
                "-" if key == "float32" else f"{max(errors.values()):.1%}",
            )
        )
        if key != "float32":
            ranked = sorted(errors.items(), key=lambda item: -item[1])[:3]
            named = ", ".join(f"{name} {error:.1%}" for name, error in ranked)
            worst.append(f"  {result.label}: {named}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    steps = len(next(iter(results.values())).losses)
    lines.append(
        f"\n{steps} steps per run. *: share of the gradient entries that are exactly zero, mean "
        "over all steps\n(for the scaled run, of the scaled gradients; unscaling keeps zeros "
        "zero). **: relative error\n|g - g32| / |g32| of the unscaled gradient against "
        "float32's at the same params, median\nover the applied steps, of the worst parameter. "
        "The worst ones:"
    )
    return "\n" + "\n".join([*lines, *worst])


def _plot(results: dict[str, RunResult], path: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4), layout="constrained")
    loss_axes, zeros_axes, scale_axes = figure.subplots(1, 3)
    styles: dict[str, dict[str, Any]] = {
        "float32": {"color": "k", "linestyle": "--", "zorder": 3},
        "float16": {"color": "C1"},
        "float16_scaled": {"color": "C0"},
    }
    for key, result in results.items():
        steps = np.arange(len(result.losses))
        style = styles[key]
        loss_axes.plot(steps, result.losses, label=result.label, **style)
        zeros_axes.plot(steps, 100 * result.zero_grad_shares, label=result.label, **style)
    loss_axes.set(title="training loss (mean squared error)", xlabel="step", yscale="log")
    loss_axes.legend()
    zeros_axes.set(title="gradient entries exactly zero (%)", xlabel="step", ylim=(-2, 102))

    scaled = results["float16_scaled"]
    steps = np.arange(len(scaled.loss_scales))
    skipped = ~scaled.applied
    scale_axes.step(steps, scaled.loss_scales, where="post", color="C0", label="loss scale")
    scale_axes.plot(
        steps[skipped],
        scaled.loss_scales[skipped],
        "x",
        color="C3",
        label=f"skipped step ({np.count_nonzero(skipped)})",
    )
    scale_axes.set(title="DynamicLossScale", xlabel="step", ylabel="scale used")
    scale_axes.set_yscale("log", base=2)
    scale_axes.legend()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
