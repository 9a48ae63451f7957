"""The state of `loss_scaled`, the stats it counts, and the checks of a state given back."""

import contextlib
import functools
import pathlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax_lossscale._checks import check_named_arrays
from jax_lossscale._counters import counted
from jax_lossscale._numerics import GradientSummary
from jax_lossscale._spikes import SpikeRule, SpikeWindows
from jax_lossscale._types import PyTree


class StepStats(NamedTuple):
    """What `loss_scaled` keeps in its state about the steps taken so far.

    `get_loss_scale_stats` returns these fields with the current scale in front,
    as a `LossScaleStats` (`LossScaleStats._fields == ("loss_scale", *StepStats._fields)`).

    Examples:
      >>> import optax
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> stats = jls.loss_scaled(optax.sgd(0.1), jls.FixedLossScale(8.0)).init({}).stats
      >>> type(stats) is jls.StepStats, int(stats.skipped_steps)
      (True, 0)
    """

    grad_norm: jax.Array  # float32: the last step's unscaled gradients' global L2 norm
    skipped_steps: jax.Array  # int32: steps skipped so far
    nan_skipped_steps: jax.Array  # int32: of those, steps whose gradients held a NaN
    inf_skipped_steps: jax.Array  # int32: ... held +-inf but no NaN
    spike_skipped_steps: jax.Array  # int32: ... were finite but a spike
    consecutive_skipped_steps: jax.Array  # int32: skips since the last applied step
    last_step_applied: jax.Array  # bool: true before the first step


class LossScaleStats(NamedTuple):
    """What `loss_scaled` records for logging; read it with `get_loss_scale_stats`.

    `grad_norm` is the global L2 norm of the last step's unscaled gradients (0 before
    the first step; NaN only when they held a NaN; +inf when they held an infinity, or when
    their squares add up past the float32 maximum, a norm above about 1.8e19), from the
    pass that checks them. A step whose `grad_norm` is not finite is an overflow, on every
    platform and in every distribution: a `DynamicLossScale` skips it and backs off. The
    squares are float32, as `optax.tree.norm` takes them: an entry below about 1.1e-19
    (2**-63) squares to below float32's normal range and adds nothing, so gradients that
    small throughout (float32 or bfloat16 ones; no float16 gradient unscales that small at
    a scale below 2**39) read a `grad_norm` of 0.
    The counters saturate at `2**31 - 1`. A skipped step counts as a NaN skip when its
    gradients held a NaN, as an inf skip when `grad_norm` was +inf (an infinity, before or
    after unscaling, or a squared norm past float32) and no NaN, as a spike skip when they
    were finite but `grad_norm` or the loss was a spike (see `loss_scaled`), and as none of
    these when a custom `LossScale` skipped finite gradients. A run whose
    `consecutive_skipped_steps` keeps growing is stuck, typically at the minimum scale.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(initial_loss_scale=8.0))
      >>> opt_state = tx.init({"w": jnp.zeros(2)})
      >>> jls.get_loss_scale_stats(opt_state)
      LossScaleStats(loss_scale=Array(8., dtype=float32),
                     grad_norm=Array(0., dtype=float32),
                     skipped_steps=Array(0, dtype=int32),
                     nan_skipped_steps=Array(0, dtype=int32),
                     inf_skipped_steps=Array(0, dtype=int32),
                     spike_skipped_steps=Array(0, dtype=int32),
                     consecutive_skipped_steps=Array(0, dtype=int32),
                     last_step_applied=Array(True, dtype=bool))
    """

    loss_scale: jax.Array  # float32: the scale to multiply the next step's loss by
    # Then the fields of `StepStats`, in its order (what each holds is said there); the
    # annotations are written out for type checkers and the API reference, and the values
    # come from a `StepStats` whole (`stats_with_scale`).
    grad_norm: jax.Array
    skipped_steps: jax.Array
    nan_skipped_steps: jax.Array
    inf_skipped_steps: jax.Array
    spike_skipped_steps: jax.Array
    consecutive_skipped_steps: jax.Array
    last_step_applied: jax.Array


class LossScaledState(NamedTuple):
    """State of a `loss_scaled` transformation.

    The scale lives in `loss_scale_state` alone, as its `loss_scale`; `stats`
    holds what the wrapper counts; `spike_windows` the windows of spike skipping,
    None unless `skip_spike_sigmas` is set.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> tx = jls.loss_scaled(optax.sgd(0.1), jls.FixedLossScale(4.0))
      >>> tx.init({"w": jnp.zeros(2)})
      LossScaledState(inner_state=(EmptyState(), EmptyState()),
                      loss_scale_state=FixedLossScaleState(loss_scale=Array(4., dtype=float32)),
                      stats=StepStats(grad_norm=Array(0., dtype=float32),
                                      skipped_steps=Array(0, dtype=int32),
                                      nan_skipped_steps=Array(0, dtype=int32),
                                      inf_skipped_steps=Array(0, dtype=int32),
                                      spike_skipped_steps=Array(0, dtype=int32),
                                      consecutive_skipped_steps=Array(0, dtype=int32),
                                      last_step_applied=Array(True, dtype=bool)),
                      spike_windows=None)
    """

    inner_state: optax.OptState
    loss_scale_state: PyTree
    stats: StepStats
    spike_windows: SpikeWindows | None = None


def stats_with_scale(loss_scale: jax.Array, stats: StepStats) -> LossScaleStats:
    """The stats of a state for logging: its scale in front of its `StepStats`."""
    return LossScaleStats(loss_scale, *stats)


def initial_stats() -> StepStats:
    return StepStats(
        grad_norm=jnp.zeros([], jnp.float32),
        skipped_steps=jnp.zeros([], jnp.int32),
        nan_skipped_steps=jnp.zeros([], jnp.int32),
        inf_skipped_steps=jnp.zeros([], jnp.int32),
        spike_skipped_steps=jnp.zeros([], jnp.int32),
        consecutive_skipped_steps=jnp.zeros([], jnp.int32),
        last_step_applied=jnp.ones([], jnp.bool_),
    )


def next_stats(
    old: StepStats, summary: GradientSummary, *, applied: jax.Array, spike: jax.Array
) -> StepStats:
    """The stats after a step that `summary` tells of: a skip is a NaN skip, else an inf
    skip, else a spike skip (or none of these, when a custom LossScale skipped finite
    gradients)."""
    skipped = jnp.logical_not(applied)
    return StepStats(
        grad_norm=summary.norm,
        skipped_steps=counted(old.skipped_steps, skipped),
        nan_skipped_steps=counted(old.nan_skipped_steps, skipped & summary.has_nan),
        inf_skipped_steps=counted(
            old.inf_skipped_steps, skipped & ~summary.has_nan & ~summary.finite
        ),
        spike_skipped_steps=counted(old.spike_skipped_steps, spike),
        consecutive_skipped_steps=jnp.where(
            applied, 0, counted(old.consecutive_skipped_steps, skipped)
        ),
        last_step_applied=applied,
    )


def check_state(state: Any, spike_rule: SpikeRule) -> None:
    """Raises unless `state` is a `LossScaledState` that this `loss_scaled` can update.

    The inner state is checked by `inner.update` itself; `explaining_failures` says
    when it failed because the state was not `inner`'s.
    """
    where = "loss_scaled.update"
    if not isinstance(state, LossScaledState):
        raise TypeError(
            f"{where}: state must be the LossScaledState returned by init(), "
            f"got {type(state).__name__}"
        )
    check_named_arrays(
        state.stats, _stats_template(), where=where, label="state.stats", source="init()"
    )
    spike_rule.check_windows(state.spike_windows, where)


@functools.cache
def _stats_template() -> StepStats:
    template: StepStats = jax.eval_shape(initial_stats)
    return template


@contextlib.contextmanager
def explaining_failures(
    inner: optax.GradientTransformation, inner_state: PyTree, params: PyTree, scaled_grads: PyTree
) -> Iterator[None]:
    """Re-raises a failure of `inner.update` as a TypeError if the state is not `inner`'s;
    one raised by this library (a remedy's, which names its cause) goes through as it is.
    Where float16 gradients reached `inner.update` unscaled in float32, a note says so."""
    try:
        yield
    except Exception as error:
        if _raised_by_this_library(error):
            raise
        mismatch = _inner_state_mismatch(inner, inner_state, [params, scaled_grads])
        if mismatch is not None:
            raise TypeError(mismatch) from error
        if any(
            getattr(leaf, "dtype", None) == jnp.float16 for leaf in jax.tree.leaves(scaled_grads)
        ):
            error.add_note(
                "loss_scaled gave inner.update the unscaled gradients of float16 leaves in "
                "float32 (float16 holds a scaled gradient, not always the unscaled one), where "
                "inner.init saw the float16 params: a function of the updates' dtypes "
                "(optax.multi_transform's param_labels, optax.masked's mask) then chooses "
                "otherwise than at init. Choose by the leaves' paths, or give the labels as a "
                "tree"
            )
        raise


def _raised_by_this_library(error: Exception) -> bool:
    """Whether the innermost frame of `error`'s traceback is in this package."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and pathlib.Path(frame.tb_frame.f_code.co_filename).parent == _HERE


_HERE = pathlib.Path(__file__).parent


def _inner_state_mismatch(
    inner: optax.GradientTransformation, inner_state: PyTree, init_arguments: list[PyTree]
) -> str | None:
    """Why `inner.update` refused `inner_state`, if it is not what `inner.init` makes.

    Called only once `inner.update` has failed, so it never refuses what `inner`
    accepts. Params that `inner.init` was not given (an equinox model where the state
    was initialised on its filtered arrays) are tried as the gradients' structure too.
    """
    # jaxlib's PyTreeDef has no stubs: annotated, it is Any to mypy, and `==` type-checks.
    actual: jax.tree_util.PyTreeDef = jax.tree.structure(inner_state)
    expected = None
    for argument in init_arguments:
        if argument is None:
            continue
        try:
            expected = jax.tree.structure(jax.eval_shape(inner.init, argument))
        except Exception:
            continue
        if expected == actual:
            return None
    if expected is None:
        return None
    return (
        f"loss_scaled.update: state.inner_state has the structure {actual}, but "
        f"inner.init(params) gives {expected}; pass the state returned by this "
        "transformation's init()"
    )
