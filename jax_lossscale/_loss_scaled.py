"""`loss_scaled`: the optax wrapper that unscales, checks, skips and adjusts the scale."""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jax_lossscale._base import LossScale
from jax_lossscale._branches import apply_or_skip, skips_by_select
from jax_lossscale._checks import (
    check_array_leaves,
    check_axis_name,
    check_holds_scale,
    check_should_apply,
    checked_scale,
    describe,
)
from jax_lossscale._fp8_meta import MetaLeaves
from jax_lossscale._lookup import wrapper_states
from jax_lossscale._numerics import check_gradients, finite_flag, on_gpu, unscaled_dtype
from jax_lossscale._spikes import SpikeRule
from jax_lossscale._states import (
    LossScaledState,
    check_state,
    explaining_failures,
    initial_stats,
    next_stats,
)
from jax_lossscale._types import AxisName


def loss_scaled(
    inner: optax.GradientTransformation | optax.MultiSteps,
    loss_scale: LossScale,
    axis_name: AxisName | None = None,
    *,
    skip_grad_norm_above: float | None = None,
    skip_spike_sigmas: float | None = None,
    spike_window: int = 128,
    fp8_meta: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation so that it takes the gradients of a scaled loss.

    Each `update` receives the gradients of the loss multiplied by the current scale
    (`get_loss_scale(opt_state)`). It divides them by that scale, checks that they are
    finite (every device of `axis_name` agreeing) and advances the loss scale
    (`loss_scale.update`). A step the loss scale applies goes to `inner.update`; one it
    does not (a `DynamicLossScale`'s overflow), or a spike, is skipped: its updates are
    negative zeros, which leave the params as they were, bit for bit, and the inner
    state is returned as it was, so schedules inside `inner` do not advance. Put
    everything that should see the true gradients, gradient clipping and
    `optax.MultiSteps` included, inside `inner`.

    A `FixedLossScale` applies every step, non-finite ones included, as TensorFlow's
    does, unless a spike option is set: then a non-finite step is skipped under every
    loss scale. A finite step is a spike when its `grad_norm` (the gradients' global L2
    norm, from the pass that checks them) is above `skip_grad_norm_above`, or, with
    `skip_spike_sigmas`, when it (or the true, unscaled loss passed as
    `update(..., value=loss)`) is not finite or is that many standard deviations above
    the mean of the last `spike_window` applied steps'. The loss scale sees a spike as
    the finite step it is. The windows re-baseline: after `max(1, spike_window // 4)`
    spikes in a row against them, later steps above them are applied and enter them
    until one is within them, so a lasting change of level never stops a run.

    Args:
      inner: the optax transformation to apply to the unscaled gradients, e.g.
        `optax.adam(1e-3)`, or an `optax.MultiSteps` for gradient accumulation.
      loss_scale: a `LossScale`, e.g. `DynamicLossScale()`. A state made under other
        hyperparameters (a resumed checkpoint) obeys these from the next update on.
      axis_name: inside `pmap` or `shard_map` with per-device gradients, the axis over
        which devices agree on skipping. Not needed under SPMD `jit`.
      skip_grad_norm_above: skip finite steps whose `grad_norm` is above this, or None.
      skip_spike_sigmas: skip finite steps this many standard deviations above the
        recent mean, or None.
      spike_window: how many applied steps the spike test looks back on, >= 2.
      fp8_meta: which leaves are fp8 meta state (scales, amax histories), whose
        "gradients" are their new values: None for every leaf under a dict key
        `"_overwrite_with_gradient"` (flax's `fp8_ops.OVERWRITE_WITH_GRADIENT`), a
        predicate `(path, leaf) -> bool`, or a pytree of bools, a prefix of the
        gradients' structure. Those leaves are never unscaled nor given to `inner`,
        nor counted in `grad_norm`; their updates are `new - old` on an applied step,
        -0.0 on a skipped one, and a non-finite new value skips the step
        (docs/integrations.md, "fp8 layers").

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `LossScaledState`.

    Examples:
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
    inner = _checked_inner(inner)
    _check_loss_scale(loss_scale)
    check_axis_name(axis_name, caller="loss_scaled", require_bound=False)
    check_holds_scale(loss_scale, caller="loss_scaled")
    spike_rule = SpikeRule(skip_grad_norm_above, skip_spike_sigmas, spike_window)
    meta_leaves = MetaLeaves(fp8_meta)  # fp8 scales and amax histories: _fp8_meta.py

    def init_fn(params: optax.Params) -> LossScaledState:
        inner_state = inner.init(_as_gradients_come(meta_leaves.without(params)))
        if wrapper_states(inner_state):
            raise ValueError(
                "loss_scaled: inner already holds a loss_scaled transformation; the gradients "
                "would be unscaled twice. Use one loss_scaled around the whole optimizer"
            )
        loss_scale_state = loss_scale.init()
        checked_scale(loss_scale, loss_scale_state)  # a user subclass's __call__, checked early
        return LossScaledState(inner_state, loss_scale_state, initial_stats(), spike_rule.init())

    def update_fn(
        updates: optax.Updates,
        state: LossScaledState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaledState]:
        check_state(state, spike_rule)
        check_array_leaves(updates, arg_name="updates", caller="loss_scaled.update")
        check_axis_name(axis_name, caller="loss_scaled.update")
        scaled_grads, params, meta = meta_leaves.split(updates, params, axis_name)
        loss = spike_rule.loss(extra_args.get("value"))
        # The arguments are checked once, here: from now on the loss scale's private cores
        # take them, which are its public methods where its class defines them (LossScale).
        scale = checked_scale(loss_scale, state.loss_scale_state)

        # Check. Where the skip is made by selects and the loss scale's `update` reads only
        # whether the gradients are finite (`reads_only_finiteness`: it is `adjust` given
        # that), the scaled gradients are read once, each entry times the reciprocal of the
        # scale the state holds inside the pass: the flags and the norm are the unscaled
        # gradients' at any scale, no unscaled copy is made (docs/design.md says why only
        # there), and the flag goes to `adjust`. Otherwise the loss scale's `update` gets
        # the unscaled gradients, whose sums for the norm are the check's own (XLA makes
        # them once). On a GPU every skip is made by selects (`apply_or_skip`), so there the
        # first form is taken wherever the loss scale reads only finiteness.
        def check_scaled() -> tuple[Any, jax.Array]:
            check = meta.joined(check_gradients(scaled_grads, axis_name, scale))
            return check, check.finite

        def check_unscaled() -> tuple[Any, jax.Array]:
            grads = loss_scale._unscale_checked(state.loss_scale_state, scale, scaled_grads)
            finite = finite_flag(meta.with_values(grads), axis_name)  # as `update` reads it
            return meta.joined(check_gradients(grads, axis_name)), finite

        select = skips_by_select(state.inner_state, scaled_grads)
        if loss_scale.reads_only_finiteness:
            check, finite = check_scaled() if select else on_gpu(check_scaled, check_unscaled)
            loss_scale_state, scale_applies = loss_scale._adjust_checked(
                state.loss_scale_state, finite
            )
            check_should_apply(loss_scale, scale_applies, "loss_scaled", method="adjust")
        else:
            grads = loss_scale._unscale_checked(state.loss_scale_state, scale, scaled_grads)
            loss_scale_state, scale_applies = loss_scale._update_checked(
                state.loss_scale_state, meta.with_values(grads), axis_name
            )
            check_should_apply(loss_scale, scale_applies, "loss_scaled")
            check = meta.joined(check_gradients(grads, axis_name))
        grad_norm, grads_finite = check.norm, check.finite
        if loss is not None and axis_name is not None:
            loss = _mean_over(loss, axis_name)

        spike = spike_rule.is_spike(grad_norm, loss, state.spike_windows)
        if spike is None:  # the loss scale alone decides (XLA folds a FixedLossScale's cond)
            spike, apply = jnp.array(False), scale_applies
        else:  # a non-finite step, the largest spike there is, is skipped under every loss scale
            spike = spike & scale_applies & grads_finite
            apply = scale_applies & grads_finite & ~spike
        apply = meta.gated(apply)  # a non-finite new meta value is skipped under every scale

        # The applied branch unscales on its own, fused into the inner update (docs/design.md).
        def inner_update() -> tuple[optax.Updates, optax.OptState]:
            with explaining_failures(inner, state.inner_state, [params, scaled_grads]):
                barrier_state, barrier_scale = on_gpu(  # (a GPU shares the check's reciprocal)
                    lambda x: x, jax.lax.optimization_barrier, (state.loss_scale_state, scale)
                )
                grads = loss_scale._unscale_checked(barrier_state, barrier_scale, scaled_grads)
                grads = _widened(grads, scaled_grads, params)
                return inner.update(grads, state.inner_state, params, **extra_args)

        new_updates, inner_state = apply_or_skip(
            apply, inner_update, state.inner_state, select=select
        )
        new_updates = meta.merged(
            new_updates,
            apply,
            lambda: loss_scale(loss_scale_state) / scale,
        )
        stats = next_stats(
            state.stats,
            grad_norm=grad_norm,
            applied=apply,
            spike=spike,
            had_nan=check.has_nan,
            grads_finite=grads_finite,
        )
        spike_windows = spike_rule.record(state.spike_windows, grad_norm, loss, apply)
        return new_updates, LossScaledState(inner_state, loss_scale_state, stats, spike_windows)

    # optax types the state as an ArrayTree, which has no place for None (spike_windows).
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def _mean_over(value: jax.Array, axis_name: AxisName) -> jax.Array:
    """The mean of `value` over `axis_name`, the same on every device.

    Under `shard_map`, a value (a data-parallel loss) may vary over some of the axes only
    (over "data" of ("data", "model")); `psum` refuses such a mix, so the mean is taken over
    the axes it varies over, and it is already the same along the others. Where nothing
    says which axes it varies over (`pmap`, or `check_vma=False`), over all of them.
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    axis_type = getattr(jax.typeof(value), "manual_axis_type", None)
    varying: frozenset[Any] = getattr(axis_type, "varying", frozenset())
    axes = tuple(name for name in names if name in varying) or axis_name
    mean: jax.Array = jax.lax.pmean(value, axes)
    return mean


def _as_gradients_come(params: optax.Params) -> optax.Params:
    """`params` with each float16 leaf as float32, the dtype its unscaled gradients take: the
    inner state (adam's moments, MultiSteps' sums) is made in the dtype its updates give
    it, so a step keeps the state's types (a `lax.scan` carry, a donated buffer)."""

    def as_gradient_comes(param: Any) -> Any:
        if getattr(param, "dtype", None) == jnp.float16:
            return jnp.asarray(param, unscaled_dtype(param.dtype))
        return param

    widened: optax.Params = jax.tree.map(as_gradient_comes, params)
    return widened


def _widened(
    grads: optax.Updates, scaled_grads: optax.Updates, params: optax.Params | None
) -> optax.Updates:
    """`grads`, each unscaled float16 leaf in its param's dtype where that is wider than
    float32 (float64 under x64), when `params` has the gradients' structure."""
    structures = {str(jax.tree.structure(tree)) for tree in (grads, scaled_grads, params)}
    if params is None or len(structures) > 1:  # (a user's unscale may change the structure)
        return grads

    def widen(grad: jax.Array, scaled: jax.Array, param: Any) -> jax.Array:
        param_dtype = getattr(param, "dtype", None)
        if (
            scaled.dtype == jnp.float16
            and param_dtype is not None
            and jnp.issubdtype(param_dtype, jnp.floating)
            and jnp.finfo(param_dtype).bits > jnp.finfo(grad.dtype).bits
            and jnp.promote_types(grad.dtype, param_dtype) == param_dtype
        ):
            return grad.astype(param_dtype)
        return grad

    widened: optax.Updates = jax.tree.map(widen, grads, scaled_grads, params)
    return widened


def _checked_inner(
    inner: optax.GradientTransformation | optax.MultiSteps,
) -> optax.GradientTransformationExtraArgs:
    if isinstance(inner, optax.MultiSteps):
        # optax types MultiSteps.update's state as its MultiStepsState, narrower than the
        # OptState of the update protocol.
        inner = optax.GradientTransformationExtraArgs(inner.init, inner.update)  # type: ignore[arg-type]
    if not isinstance(inner, optax.GradientTransformation):
        hint = "; call it first, e.g. optax.adam(1e-3)" if callable(inner) else ""
        raise TypeError(
            f"loss_scaled(inner={describe(inner)}): inner must be an optax "
            f"GradientTransformation, got {type(inner).__name__}{hint}"
        )
    # A public optax function that optax's __init__ imports but leaves out of its __all__.
    return optax.with_extra_args_support(inner)  # type: ignore[attr-defined]


def _check_loss_scale(loss_scale: Any) -> None:
    if not isinstance(loss_scale, LossScale):
        if isinstance(loss_scale, type):
            received = f"the class {loss_scale.__name__}; instantiate it first"
        else:
            received = type(loss_scale).__name__
        raise TypeError(
            f"loss_scaled(loss_scale={describe(loss_scale)}): loss_scale must be a "
            f"jax_lossscale.LossScale such as DynamicLossScale(), got {received}"
        )
