"""`loss_scaled`: the optax wrapper that unscales, checks, skips and adjusts the scale."""

import contextlib
import functools
import numbers
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale import _validation
from jax_lossscale._base import LossScale, check_named_arrays, is_scalar_array
from jax_lossscale._tree import (
    AxisName,
    PyTree,
    any_nan,
    check_array_leaves,
    check_axis_name,
    global_norm_and_finite,
    short_repr,
)

_INT32_MAX = np.iinfo(np.int32).max


class StepStats(NamedTuple):
    """What `loss_scaled` keeps in its state about the steps taken so far.

    `get_loss_scale_stats` returns these fields with the current scale in front,
    as a `LossScaleStats`.
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
    the first step; NaN when they were not finite), from the pass that checks them.
    The counters saturate at 2**31 - 1. A skipped step counts as a NaN skip when its
    gradients held a NaN, as an inf skip when they held +-inf (before or after
    unscaling) and no NaN, as a spike skip when they were finite but `grad_norm` or
    the loss was a spike (see `loss_scaled`), and as none of these when a custom
    `LossScale` skipped finite gradients. A run whose `consecutive_skipped_steps` keeps
    growing is stuck, typically at the minimum scale.

    Example:
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
    grad_norm: jax.Array
    skipped_steps: jax.Array
    nan_skipped_steps: jax.Array
    inf_skipped_steps: jax.Array
    spike_skipped_steps: jax.Array
    consecutive_skipped_steps: jax.Array
    last_step_applied: jax.Array


class SpikeWindow(NamedTuple):
    """The last values of a signal (the gradient norm or the loss) on applied steps."""

    values: jax.Array  # float32[spike_window]: a ring, the oldest value overwritten first
    filled: jax.Array  # int32: how many of `values` hold a value, up to spike_window
    next_index: jax.Array  # int32: where the next value goes


class SpikeWindows(NamedTuple):
    """The windows `loss_scaled(..., skip_spike_sigmas=...)` tests spikes against."""

    grad_norm: SpikeWindow
    loss: SpikeWindow  # filled only by steps given `value=`


class LossScaledState(NamedTuple):
    """State of a `loss_scaled` transformation.

    The scale lives in `loss_scale_state` alone, as its `loss_scale`; `stats`
    holds what the wrapper counts; `spike_windows` the windows of spike skipping,
    None unless `skip_spike_sigmas` is set.

    Example:
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


def loss_scaled(
    inner: optax.GradientTransformation | optax.MultiSteps,
    loss_scale: LossScale,
    axis_name: AxisName | None = None,
    *,
    skip_grad_norm_above: float | None = None,
    skip_spike_sigmas: float | None = None,
    spike_window: int = 128,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation so that it takes the gradients of a scaled loss.

    Each `update` receives the gradients of the loss multiplied by the current
    scale (`get_loss_scale(opt_state)`) and does, in this order:

    1. unscale: divide the gradients by that scale;
    2. check: are all the unscaled gradients finite? (combined over `axis_name`),
       and their global L2 norm, `grad_norm`, from the same pass;
    3. adjust: advance the loss scale's state (`loss_scale.update`);
    4. if finite and not a spike, return `inner.update(unscaled_grads, inner_state,
       params, ...)`; if not, skip: return updates of negative zeros and the inner
       state as it was, so schedules inside `inner` do not advance.

    A finite step is a spike when `grad_norm > skip_grad_norm_above`, or, with
    `skip_spike_sigmas`, when the last `spike_window` applied steps are on record
    and `grad_norm` is above their mean plus `skip_spike_sigmas` standard deviations
    (the population standard deviation); a NaN or infinite `grad_norm` of finite
    gradients (squares beyond float32) is then a spike too. A loss passed as
    `update(..., value=loss)`, the optax convention, is tested against its own window
    the same way. The loss scale sees a spike as the finite step it is; skipped steps
    do not enter the windows.

    On a skipped step `optax.apply_updates(params, updates)` returns `params`
    bit for bit (signed zeros, infinities and quiet NaNs included), except where
    the backend's own addition changes a value: XLA on CPU flushes float32 and
    bfloat16 subnormal numbers to zero, quiets signalling NaNs and gives bfloat16
    NaNs the canonical payload in any addition.
    The inner state keeps its bits. Where `inner` changes a state leaf's dtype across
    an update (adam's moments of bfloat16 params given float32 gradients become
    float32), skipped and applied steps both return the leaf in the dtype that holds
    the old and the new values exactly, the old ones converted; a weakly typed leaf
    (made from a Python number) takes the dtype the update gives it.

    Put everything that should see the true gradients, gradient clipping and
    `optax.MultiSteps` included, inside `inner`. `optax.MultiSteps(loss_scaled(...))`
    is a trap: one overflowing microbatch leaves NaN in MultiSteps' accumulator.

    Args:
      inner: the optax transformation to apply to the unscaled gradients, e.g.
        `optax.adam(1e-3)`, or an `optax.MultiSteps` for gradient accumulation.
      loss_scale: a `LossScale`, e.g. `DynamicLossScale()`. A state made under other
        hyperparameters (a checkpoint resumed with changed settings) obeys these
        from the next update on.
      axis_name: inside `pmap` or `shard_map` with per-device gradients, the axis
        over which devices agree on skipping. Not needed under SPMD `jit`. Under
        `shard_map`, a gradient leaf that varies over it is a shard of the gradient
        whose norm is taken; under `pmap`, each device's gradients are the whole of
        it (as after a `pmean`) and the devices agree on the largest norm. A `value=`
        is averaged over it.
      skip_grad_norm_above: skip finite steps whose `grad_norm` is above this, or
        None; a positive finite number.
      skip_spike_sigmas: skip finite steps whose `grad_norm` (or loss) is this many
        standard deviations above the mean of the last `spike_window` applied
        steps', or None; a positive finite number.
      spike_window: how many applied steps' values the spike test looks back on,
        an integer >= 2.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `LossScaledState`.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> tx = jls.loss_scaled(optax.sgd(0.5), jls.DynamicLossScale(initial_loss_scale=4.0))
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> opt_state = tx.init(params)
      >>> scaled_grads = jax.grad(lambda p: jnp.sum(p["w"]) * jls.get_loss_scale(opt_state))(params)
      >>> updates, opt_state = tx.update(scaled_grads, opt_state, params)
      >>> optax.apply_updates(params, updates)
      {'w': Array([0.5, 1.5], dtype=float32)}
      >>> updates, opt_state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, opt_state, params)
      >>> optax.apply_updates(params, updates), jls.get_loss_scale(opt_state)
      ({'w': Array([1., 2.], dtype=float32)}, Array(2., dtype=float32))
    """
    if isinstance(inner, optax.MultiSteps):
        # optax types MultiSteps.update's state as its MultiStepsState, narrower than the
        # OptState of the update protocol.
        inner = optax.GradientTransformationExtraArgs(inner.init, inner.update)  # type: ignore[arg-type]
    if not isinstance(inner, optax.GradientTransformation):
        hint = "; call it first, e.g. optax.adam(1e-3)" if callable(inner) else ""
        raise TypeError(
            f"loss_scaled(inner={short_repr(inner)}): inner must be an optax "
            f"GradientTransformation, got {type(inner).__name__}{hint}"
        )
    if not isinstance(loss_scale, LossScale):
        if isinstance(loss_scale, type):
            received = f"the class {loss_scale.__name__}; instantiate it first"
        else:
            received = type(loss_scale).__name__
        raise TypeError(
            f"loss_scaled(loss_scale={short_repr(loss_scale)}): loss_scale must be a "
            f"jax_lossscale.LossScale such as DynamicLossScale(), got {received}"
        )
    check_axis_name(axis_name, caller="loss_scaled", require_bound=False)
    _check_scale_field(loss_scale)
    skip_grad_norm_above = _optional_positive("skip_grad_norm_above", skip_grad_norm_above)
    skip_spike_sigmas = _optional_positive("skip_spike_sigmas", skip_spike_sigmas)
    spike_window = _window_length(spike_window)
    windows = skip_spike_sigmas is not None
    # A public optax function that optax's __init__ imports but leaves out of its __all__.
    inner = optax.with_extra_args_support(inner)  # type: ignore[attr-defined]

    def init_fn(params: optax.Params) -> LossScaledState:
        inner_state = inner.init(params)
        if _wrapper_states(inner_state):
            raise ValueError(
                "loss_scaled: inner already holds a loss_scaled transformation; the gradients "
                "would be unscaled twice. Use one loss_scaled around the whole optimizer"
            )
        loss_scale_state = loss_scale.init()
        loss_scale._checked_scale(loss_scale_state)  # a user subclass's __call__, checked early
        return LossScaledState(
            inner_state=inner_state,
            loss_scale_state=loss_scale_state,
            stats=StepStats(
                grad_norm=jnp.zeros([], jnp.float32),
                skipped_steps=jnp.zeros([], jnp.int32),
                nan_skipped_steps=jnp.zeros([], jnp.int32),
                inf_skipped_steps=jnp.zeros([], jnp.int32),
                spike_skipped_steps=jnp.zeros([], jnp.int32),
                consecutive_skipped_steps=jnp.zeros([], jnp.int32),
                last_step_applied=jnp.ones([], jnp.bool_),
            ),
            spike_windows=_empty_windows(spike_window) if windows else None,
        )

    def update_fn(
        updates: optax.Updates,
        state: LossScaledState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaledState]:
        _check_wrapper_state(state, spike_window if windows else None)
        check_array_leaves(updates, arg_name="updates", caller="loss_scaled.update")
        check_axis_name(axis_name, caller="loss_scaled.update")
        loss = _loss_value(extra_args.get("value")) if windows else None
        scaled_grads = updates

        def unscale(loss_scale_state: PyTree) -> PyTree:
            return loss_scale.unscale(loss_scale_state, scaled_grads)

        grads = unscale(state.loss_scale_state)
        loss_scale_state, loss_scale_applies = loss_scale.update(
            state.loss_scale_state, grads, axis_name
        )
        _check_should_apply(loss_scale, loss_scale_applies)
        # The same reductions as DynamicLossScale's check, so XLA computes them once.
        grad_norm, grads_finite = global_norm_and_finite(grads, axis_name)
        if loss is not None and axis_name is not None:
            loss = jax.lax.pmean(loss, axis_name)

        spikes = []
        if skip_grad_norm_above is not None:
            spikes.append(grad_norm > np.float32(skip_grad_norm_above))
        old_windows = state.spike_windows  # None unless `windows`, as checked above
        if old_windows is not None and skip_spike_sigmas is not None:  # both: `windows`
            spikes.append(_is_spike(grad_norm, old_windows.grad_norm, skip_spike_sigmas))
            if loss is not None:
                spikes.append(_is_spike(loss, old_windows.loss, skip_spike_sigmas))
        if spikes:
            spike = functools.reduce(jnp.logical_or, spikes) & loss_scale_applies & grads_finite
            finite = loss_scale_applies & ~spike
        else:  # a FixedLossScale's constant true stays a constant: no `cond` at all
            spike, finite = jnp.array(False), loss_scale_applies

        def skip_for_nan() -> jax.Array:  # for the stats; unscaling makes no NaN and removes none
            return any_nan(scaled_grads)

        # The branch unscales on its own, so that XLA can fuse the multiplication into the
        # inner update instead of keeping the unscaled gradients in memory. The barrier keeps
        # XLA from merging it with the check's, which it does where the `cond` is gone (a
        # FixedLossScale's), so that both read the scaled gradients and neither is kept.
        def inner_update() -> tuple[optax.Updates, optax.OptState]:
            with _explaining_failures(inner, state.inner_state, [params, scaled_grads]):
                grads = unscale(jax.lax.optimization_barrier(state.loss_scale_state))
                return inner.update(grads, state.inner_state, params, **extra_args)

        # The types both branches return, taken from the trace of the applied branch, which
        # `cond` traces first: the inner update is traced once, not again for the skip.
        branch_types: list[tuple[PyTree, PyTree]] = []

        def types_of(
            new_updates: optax.Updates, new_inner_state: optax.OptState
        ) -> tuple[PyTree, PyTree]:
            if not branch_types:
                branch_types.append(_branch_types(state.inner_state, new_updates, new_inner_state))
            return branch_types[0]

        def apply_inner() -> tuple[optax.Updates, optax.OptState, jax.Array]:
            new_updates, new_inner_state = inner_update()
            _, inner_state_type = types_of(new_updates, new_inner_state)
            no_nan = jnp.zeros_like(jax.eval_shape(skip_for_nan))
            return new_updates, _as_types(new_inner_state, inner_state_type), no_nan

        def skip_inner() -> tuple[optax.Updates, optax.OptState, jax.Array]:
            if not branch_types:  # traced alone, as under jax.disable_jit
                types_of(*jax.eval_shape(inner_update))
            updates_type, inner_state_type = branch_types[0]
            return (
                jax.tree.map(_negative_zeros, updates_type),
                _as_types(state.inner_state, inner_state_type),
                skip_for_nan(),
            )

        if isinstance(finite, jax.core.Tracer):
            new_updates, inner_state, had_nan = jax.lax.cond(finite, apply_inner, skip_inner)
        else:  # known when tracing (a FixedLossScale's, or eager): the branch is taken here
            new_updates, inner_state, had_nan = apply_inner() if finite else skip_inner()
        if axis_name is not None:  # outside the cond: a collective there could wait forever
            had_nan = jax.lax.pmax(had_nan.astype(jnp.int32), axis_name).astype(jnp.bool_)

        old = state.stats
        skipped = jnp.logical_not(finite)
        stats = StepStats(
            grad_norm=grad_norm,
            skipped_steps=_saturating_increment(old.skipped_steps, skipped),
            nan_skipped_steps=_saturating_increment(old.nan_skipped_steps, skipped & had_nan),
            inf_skipped_steps=_saturating_increment(
                old.inf_skipped_steps, skipped & ~had_nan & ~grads_finite
            ),
            spike_skipped_steps=_saturating_increment(old.spike_skipped_steps, spike),
            consecutive_skipped_steps=jnp.where(
                finite, 0, _saturating_increment(old.consecutive_skipped_steps, skipped)
            ),
            last_step_applied=finite,
        )
        spike_windows = None
        if old_windows is not None:  # `windows`
            spike_windows = SpikeWindows(
                grad_norm=_recorded(old_windows.grad_norm, grad_norm, finite),
                loss=old_windows.loss
                if loss is None
                else _recorded(old_windows.loss, loss, finite),
            )
        return new_updates, LossScaledState(inner_state, loss_scale_state, stats, spike_windows)

    # optax types the state as an ArrayTree, which has no place for None (spike_windows).
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def get_loss_scale(opt_state: Any) -> jax.Array:
    """Returns the current loss scale held in an optax state built by `loss_scaled`.

    The `LossScaledState` may sit anywhere in `opt_state`: inside `optax.chain`,
    `optax.inject_hyperparams`, `optax.MultiSteps` or any other nesting, in a flax
    `nnx.Optimizer` (pass the optimizer, its `opt_state` or `nnx.state(optimizer)`)
    or in any pytree that holds it. Multiply the loss by this scale before
    differentiating.

    Raises:
      LookupError: if `opt_state` holds no `LossScaledState`.
      ValueError: if it holds more than one; pass the part that holds the one you mean.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> tx = optax.chain(
      ...     optax.clip(1.0), jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale())
      ... )
      >>> jls.get_loss_scale(tx.init({"w": jnp.zeros(3)}))
      Array(32768., dtype=float32)
    """
    return _read_scale(_find_state(opt_state, "get_loss_scale"), "get_loss_scale")


def get_loss_scale_stats(opt_state: Any) -> LossScaleStats:
    """Returns the `LossScaleStats` of the `loss_scaled` state inside `opt_state`.

    The fields are the current scale, the steps skipped so far (in all, for NaN,
    for inf, and in a row up to now) and whether the last step was applied: scalar
    arrays, ready to log (use `._asdict()` for a dict). The state is found as by
    `get_loss_scale`.

    Raises:
      LookupError: if `opt_state` holds no `LossScaledState`.
      ValueError: if it holds more than one.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale())
      >>> params = {"w": jnp.zeros(2)}
      >>> opt_state = tx.init(params)
      >>> _, opt_state = tx.update({"w": jnp.array([jnp.nan, 0.0])}, opt_state, params)
      >>> stats = jls.get_loss_scale_stats(opt_state)
      >>> int(stats.skipped_steps), bool(stats.last_step_applied)
      (1, False)
    """
    state = _find_state(opt_state, "get_loss_scale_stats")
    stats = _unwrapped(_field(state, "stats"))
    recorded = {field: _field(stats, field) for field in StepStats._fields}
    return LossScaleStats(loss_scale=_read_scale(state, "get_loss_scale_stats"), **recorded)


def _is_wrapper_state(node: Any) -> bool:
    # flax nnx's `nnx.state` turns the NamedTuple into a mapping of its fields.
    if isinstance(node, Mapping):
        return set(LossScaledState._fields[:3]) <= set(node) <= set(LossScaledState._fields)
    return isinstance(node, LossScaledState)


def _wrapper_states(tree: PyTree) -> list[tuple[Any, Any]]:
    nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_wrapper_state)[0]
    return [(path, node) for path, node in nodes if _is_wrapper_state(node)]


def _find_state(opt_state: Any, caller: str) -> Any:
    found = _wrapper_states(opt_state)
    if not found:
        raise LookupError(
            f"{caller}: opt_state ({type(opt_state).__name__}) holds no LossScaledState; "
            "build the optimizer with jax_lossscale.loss_scaled(inner, loss_scale)"
        )
    if len(found) > 1:
        paths = ", ".join(jax.tree_util.keystr(path) or "<root>" for path, _ in found)
        raise ValueError(
            f"{caller}: opt_state holds {len(found)} LossScaledStates (at {paths}); "
            "pass the part of the state that holds the one you mean"
        )
    return found[0][1]


def _read_scale(state: Any, caller: str) -> jax.Array:
    """The `loss_scale` of the loss scale's state inside a `LossScaledState` (or its mapping).

    With leading axes where the state was stacked by `vmap` or replicated for `pmap`.
    """
    loss_scale_state = _unwrapped(_field(state, "loss_scale_state"))
    try:
        scale = _field(loss_scale_state, "loss_scale")
    except (AttributeError, KeyError, TypeError):
        scale = None
    if getattr(scale, "dtype", None) != np.float32:
        raise LookupError(
            f"{caller}: the loss scale's state in opt_state ({type(loss_scale_state).__name__}) "
            "holds no float32 loss_scale"
        )
    return cast(jax.Array, scale)  # a float32 array, as just checked


def _field(node: Any, name: str) -> Any:
    return node[name] if isinstance(node, Mapping) else getattr(node, name)


def _check_scale_field(loss_scale: LossScale) -> None:
    """Raises unless the loss scale's state holds its scale as a float32 scalar `loss_scale`."""
    try:
        scale = jax.eval_shape(lambda: loss_scale.init().loss_scale)
    except AttributeError:
        found = "none"
    else:
        if scale.shape == () and scale.dtype == np.float32:
            return
        found = f"dtype {scale.dtype} and shape {scale.shape}"
    state_type = type(jax.eval_shape(loss_scale.init)).__name__
    raise TypeError(
        f"loss_scaled(loss_scale={short_repr(loss_scale)}): the state of a LossScale must hold "
        "its current scale as a float32 scalar loss_scale (a field or a property), where "
        f"get_loss_scale reads it; {type(loss_scale).__name__}.init() returns {state_type} "
        f"with loss_scale of {found}"
    )


def _unwrapped(tree: PyTree) -> PyTree:
    """`tree` with array wrappers, such as flax nnx's `OptArray`, replaced by their arrays."""

    def is_wrapper(node: Any) -> bool:
        return hasattr(node, "__jax_array__") and not isinstance(node, jax.Array)

    def unwrap(node: Any) -> Any:
        return node.__jax_array__() if is_wrapper(node) else node

    return jax.tree.map(unwrap, tree, is_leaf=is_wrapper)


def _scalar_type(dtype: Any) -> jax.Array:
    """A scalar `jax.ShapeDtypeStruct`, typed as the array it stands for in a template."""
    return cast(jax.Array, jax.ShapeDtypeStruct((), dtype))


_COUNT = _scalar_type(jnp.int32)
_STATS_TEMPLATE = StepStats(
    grad_norm=_scalar_type(jnp.float32),
    skipped_steps=_COUNT,
    nan_skipped_steps=_COUNT,
    inf_skipped_steps=_COUNT,
    spike_skipped_steps=_COUNT,
    consecutive_skipped_steps=_COUNT,
    last_step_applied=_scalar_type(jnp.bool_),
)


def _check_wrapper_state(state: Any, spike_window: int | None) -> LossScaledState:
    """`state`, once checked to be a `LossScaledState` this `loss_scaled` can update."""
    where = "loss_scaled.update"
    if not isinstance(state, LossScaledState):
        raise TypeError(
            f"{where}: state must be the LossScaledState returned by init(), "
            f"got {type(state).__name__}"
        )
    check_named_arrays(
        state.stats, _STATS_TEMPLATE, where=where, label="state.stats", source="init()"
    )
    if spike_window is None:
        if state.spike_windows is not None:
            raise TypeError(
                f"{where}: state.spike_windows holds spike windows, but this loss_scaled has "
                "skip_spike_sigmas=None; pass the state returned by this transformation's init()"
            )
        return state
    if not isinstance(state.spike_windows, SpikeWindows):
        raise TypeError(
            f"{where}: state.spike_windows must be the SpikeWindows that init() makes when "
            f"skip_spike_sigmas is set, got {short_repr(state.spike_windows)}"
        )
    template = jax.eval_shape(lambda: _empty_windows(spike_window))
    for name in SpikeWindows._fields:
        window = getattr(state.spike_windows, name)
        values: Any = getattr(window, "values", None)
        if getattr(values, "shape", (spike_window,)) != (spike_window,):
            raise ValueError(
                f"{where}: state.spike_windows.{name}.values has shape {values.shape}, but "
                f"this loss_scaled has spike_window={spike_window}; pass the state returned by "
                "this transformation's init()"
            )
        check_named_arrays(
            window,
            getattr(template, name),
            where=where,
            label=f"state.spike_windows.{name}",
            source="init()",
        )
    return state


def _optional_positive(name: str, value: Any) -> float | None:
    if value is None:
        return None
    number = _validation.real("loss_scaled", name, value)
    if number <= 0:
        _validation.fail("loss_scaled", name, value, "None or a positive finite number")
    return number


def _window_length(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _validation.fail("loss_scaled", "spike_window", value, "an integer >= 2", TypeError)
    if not 2 <= int(value) <= _INT32_MAX:
        requirement = f"an integer >= 2 and <= {_INT32_MAX}"
        _validation.fail("loss_scaled", "spike_window", value, requirement)
    return int(value)


def _empty_windows(spike_window: int) -> SpikeWindows:
    def empty() -> SpikeWindow:
        return SpikeWindow(
            values=jnp.zeros([spike_window], jnp.float32),
            filled=jnp.zeros([], jnp.int32),
            next_index=jnp.zeros([], jnp.int32),
        )

    return SpikeWindows(grad_norm=empty(), loss=empty())


def _loss_value(value: Any) -> jax.Array | None:
    """The `value=` extra argument as a float32 scalar, None when not given."""
    if value is None:
        return None
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        real = value.shape == () and (
            jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)
        )
    else:
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not real:
        raise TypeError(
            "loss_scaled.update: value must be the step's loss, a real scalar (a Python "
            f"number or an array of shape ()), got {short_repr(value)}"
        )
    return jnp.asarray(value).astype(jnp.float32)


def _is_spike(value: jax.Array, window: SpikeWindow, sigmas: float) -> jax.Array:
    """Whether `value` is not finite, or above the mean of a full `window` plus `sigmas`
    standard deviations. A value that is not finite never enters a window, where it
    would make every later value a spike."""
    mean = jnp.mean(window.values)
    std = jnp.sqrt(jnp.mean(jnp.square(window.values - mean)))
    full = window.filled >= window.values.shape[0]
    return ~jnp.isfinite(value) | (full & (value > mean + np.float32(sigmas) * std))


def _recorded(window: SpikeWindow, value: jax.Array, applied: jax.Array) -> SpikeWindow:
    """`window` with `value` written at its next index if the step was applied."""
    size = window.values.shape[0]
    return SpikeWindow(
        values=jnp.where(applied, window.values.at[window.next_index].set(value), window.values),
        filled=jnp.where(applied, jnp.minimum(window.filled + 1, size), window.filled),
        next_index=jnp.where(applied, (window.next_index + 1) % size, window.next_index),
    )


def _branch_types(
    inner_state: PyTree, new_updates: PyTree, new_inner_state: PyTree
) -> tuple[PyTree, PyTree]:
    """The types of the updates, and those the inner state takes on both branches.

    A skipped step returns the old inner state, the applied one the new: each leaf
    takes the dtype that holds both exactly (bfloat16 moments that become float32
    stay float32 on a skip), so that the two branches of the `cond` agree. A weakly
    typed leaf (one made from a Python number) takes the new leaf's dtype, as it
    would in any operation with it.
    """
    updates_type = jax.tree.map(_type_of, new_updates)
    new_state_type = jax.tree.map(_type_of, new_inner_state)
    return updates_type, jax.tree_util.tree_map_with_path(_joined_type, inner_state, new_state_type)


def _type_of(value: Any) -> jax.ShapeDtypeStruct:
    """The shape, dtype, weak type and varying manual axes of `value`, a tracer.

    (`jax.ShapeDtypeStruct.like` first asks a tracer for its sharding, which takes far
    longer than tracing.)
    """
    aval = jax.typeof(value)
    if _manual_axes(aval) is None:
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
    return jax.ShapeDtypeStruct(  # inside shard_map: the axes over which it varies
        aval.shape,
        aval.dtype,
        sharding=aval.sharding,
        weak_type=aval.weak_type,
        manual_axis_type=aval.manual_axis_type,
    )


@contextlib.contextmanager
def _explaining_failures(
    inner: optax.GradientTransformation, inner_state: PyTree, init_arguments: list[PyTree]
) -> Iterator[None]:
    """Re-raises a failure of `inner.update` as a TypeError if the state is not `inner`'s."""
    try:
        yield
    except Exception as error:
        mismatch = _inner_state_mismatch(inner, inner_state, init_arguments)
        if mismatch is None:
            raise
        raise TypeError(mismatch) from error


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


def _joined_type(path: Any, old: Any, new: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    old_type = jax.typeof(old)
    if old_type.weak_type:  # it takes the dtype the update gives it, as JAX's promotion does
        return new
    if old_type.dtype == new.dtype:  # (ShapeDtypeStruct.update has no annotations)
        return cast(jax.ShapeDtypeStruct, new.update(weak_type=False))
    candidates = [new.dtype, old_type.dtype]
    with contextlib.suppress(jax.dtypes.TypePromotionError):  # as between 8-bit floats
        candidates.append(jnp.promote_types(old_type.dtype, new.dtype))
    candidates.append(jnp.dtype(jnp.float32))
    for dtype in candidates:
        if _holds_exactly(dtype, old_type.dtype) and _holds_exactly(dtype, new.dtype):
            return cast(jax.ShapeDtypeStruct, new.update(dtype=dtype, weak_type=False))
    raise TypeError(
        f"loss_scaled.update: inner.update turns the state leaf at "
        f"{jax.tree_util.keystr(path) or '<root>'} from {old_type.dtype} into {new.dtype}, and "
        "no dtype holds the values of both exactly, so a skipped step could not keep it"
    )


def _holds_exactly(dtype: Any, other: Any) -> bool:
    """Whether every value of dtype `other` is a value of `dtype`."""
    dtype, other = jnp.dtype(dtype), jnp.dtype(other)
    if dtype == other or other == jnp.bool_:
        return True
    if not jnp.issubdtype(dtype, jnp.floating):
        return bool(np.can_cast(other, dtype, casting="safe"))
    # jnp.finfo and jnp.iinfo are ml_dtypes' classes, which have no annotations.
    wide = jnp.finfo(dtype)
    if jnp.issubdtype(other, jnp.integer):
        limits = jnp.iinfo(other)
        return max(-int(limits.min), int(limits.max)).bit_length() <= wide.nmant + 1
    if not jnp.issubdtype(other, jnp.floating):
        return False
    narrow = jnp.finfo(other)
    return (
        wide.nmant >= narrow.nmant
        and wide.maxexp >= narrow.maxexp
        and wide.minexp - wide.nmant <= narrow.minexp - narrow.nmant  # the smallest subnormal
        and (_has_infinity(dtype) or not _has_infinity(other))
    )


def _has_infinity(dtype: Any) -> bool:
    return bool(np.isinf(np.array(np.inf).astype(dtype)))


def _as_types(tree: PyTree, types: PyTree) -> PyTree:
    return jax.tree.map(_as_type, tree, types)


def _as_type(value: jax.Array, target: jax.ShapeDtypeStruct) -> jax.Array:
    """`value` with the dtype, weak type and varying manual axes of `target`.

    A state that comes in replicated comes out of the inner update varying when the
    gradients vary per device (under `shard_map`); both branches of the `cond` must
    agree on that.
    """
    value_type = jax.typeof(value)
    if value_type.dtype != target.dtype or value_type.weak_type != target.weak_type:
        value = jax.lax.convert_element_type(value, target.dtype)
    if _manual_axes(value_type) != _manual_axes(target):
        value = jnp.where(jnp.full_like(target, True, dtype=jnp.bool_), value, value)
    return value


def _manual_axes(value_type: Any) -> Any:
    """The `shard_map` axes over which a value varies, None for none."""
    manual_axes = getattr(value_type, "manual_axis_type", None)
    return None if manual_axes is None or manual_axes.empty else manual_axes


def _check_should_apply(loss_scale: LossScale, should_apply: Any) -> None:
    if not is_scalar_array(should_apply, np.bool_):
        raise TypeError(
            f"loss_scaled: {type(loss_scale).__name__}.update must return should_apply as a "
            f"bool scalar array, got {short_repr(should_apply)}"
        )


def _negative_zeros(shape: jax.ShapeDtypeStruct) -> jax.Array:
    # -0.0 is the additive identity for every float, +0.0 and -0.0 included.
    if jnp.issubdtype(shape.dtype, jnp.complexfloating):
        fill = complex(-0.0, -0.0)
    elif jnp.issubdtype(shape.dtype, jnp.floating):
        fill = -0.0
    else:
        fill = 0
    return jnp.full_like(shape, fill)  # like the update: dtype, shape and varying manual axes


def _saturating_increment(count: jax.Array, increment: jax.Array) -> jax.Array:
    return count + (increment & (count < _INT32_MAX)).astype(jnp.int32)
