"""`loss_scaled`: the optax wrapper that unscales, checks, skips and adjusts the scale."""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jax_lossscale._base import LossScale, check_adjusted, check_holds_scale, scale_of
from jax_lossscale._checks import (
    check_array_leaves,
    check_axis_name,
    checked_transformation,
    describe,
)
from jax_lossscale._fp8_meta import MetaLeaves
from jax_lossscale._lookup import wrapper_states
from jax_lossscale._numerics import (
    summarize_gradients,
    unscaled_gradients,
)
from jax_lossscale._platforms import Form, reciprocal_factors, scalars_read_together
from jax_lossscale._skip import Operands, apply_or_skip, initial_inner_state
from jax_lossscale._spikes import SpikeRule
from jax_lossscale._states import (
    LossScaledState,
    check_state,
    explaining_failures,
    initial_stats,
    next_stats,
)
from jax_lossscale._types import AxisName, PyTree


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
    (`get_loss_scale(opt_state)`). It checks, in one pass over them, that they are finite
    once divided by that scale (every device of `axis_name` agreeing) and advances the
    loss scale (`loss_scale.adjust`, given that flag). A step the loss scale applies goes
    to `inner.update`, with the gradients divided by the scale; one it does not (a
    `DynamicLossScale`'s overflow), or a spike, is skipped: its updates are negative
    zeros, which leave the params as they were, bit for bit, and the inner state is
    returned as it was, so schedules inside `inner` do not advance. Put
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
      axis_name: inside `pmap` or `shard_map`, the axis over which devices agree on
        skipping: pass it there always (after a `pmean` it costs one scalar all-reduce).
        Not needed under SPMD `jit`.
      skip_grad_norm_above: skip finite steps whose `grad_norm` is above this, or None.
      skip_spike_sigmas: skip finite steps this many standard deviations above the
        recent mean, or None.
      spike_window: how many applied steps the spike test looks back on, >= 2.
      fp8_meta: which leaves are fp8 meta state (scales, amax histories), whose
        "gradients" are their new values: None for every leaf under a dict key
        `"_overwrite_with_gradient"` (flax's `fp8_ops.OVERWRITE_WITH_GRADIENT`), a
        predicate `(path, leaf) -> bool`, or a pytree of bools, a prefix of the
        gradients' structure. Those leaves are never unscaled nor given to `inner`,
        nor counted in `grad_norm`; their updates set them to their new values on an
        applied step and are -0.0 on a skipped one, except the output gradients'
        histories and scales, which follow every change of the scale; a non-finite new
        value skips the step
        ([fp8 layers](integrations.md#fp8-layers-scales-and-amax-histories)).

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
    return in_form(
        Form.LOWERED,
        inner,
        loss_scale,
        axis_name,
        skip_grad_norm_above=skip_grad_norm_above,
        skip_spike_sigmas=skip_spike_sigmas,
        spike_window=spike_window,
        fp8_meta=fp8_meta,
    )


def in_form(
    form: Form,
    inner: optax.GradientTransformation | optax.MultiSteps,
    loss_scale: LossScale,
    axis_name: AxisName | None = None,
    *,
    skip_grad_norm_above: float | None = None,
    skip_spike_sigmas: float | None = None,
    spike_window: int = 128,
    fp8_meta: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """`loss_scaled` in the `form` given: `Form.LOWERED` is the platform's; tests pass
    `Form.CPU` or `Form.GPU` to run either on any platform."""
    inner = checked_transformation(inner, "loss_scaled")
    _check_loss_scale(loss_scale)
    check_axis_name(axis_name, caller="loss_scaled", require_bound=False)
    check_holds_scale(loss_scale, caller="loss_scaled")
    spike_rule = SpikeRule(skip_grad_norm_above, skip_spike_sigmas, spike_window)
    meta_leaves = MetaLeaves(fp8_meta)  # fp8 scales and amax histories: _fp8_meta.py

    def init_fn(params: optax.Params) -> LossScaledState:
        inner_state = initial_inner_state(inner.init, meta_leaves.without(params))
        if wrapper_states(inner_state):
            raise ValueError(
                "loss_scaled: inner already holds a loss_scaled transformation; the gradients "
                "would be unscaled twice. Use one loss_scaled around the whole optimizer"
            )
        loss_scale_state = jax.tree.map(jnp.copy, loss_scale.init())  # its own buffers
        return LossScaledState(
            _own_arrays(inner_state, params), loss_scale_state, initial_stats(), spike_rule.init()
        )

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
        loss = spike_rule.loss(extra_args.get("value"), axis_name)
        scale = scale_of(loss_scale, state.loss_scale_state)
        factors = reciprocal_factors(scale, form)

        # One pass over the scaled gradients gives the unscaled gradients' norm and flags.
        summary = meta.joined(summarize_gradients(scaled_grads, axis_name, factors, form))
        state, summary = scalars_read_together((state, summary), form)  # on a GPU: one vector
        loss_scale_state, scale_applies = loss_scale.adjust(state.loss_scale_state, summary.finite)
        check_adjusted(loss_scale, loss_scale_state, scale_applies, "loss_scaled")
        spike, apply = spike_rule.decide(summary, loss, state.spike_windows, scale_applies)
        apply = meta.gated(apply)  # a non-finite new meta value is skipped under every scale

        def inner_update(given: Operands) -> tuple[optax.Updates, optax.OptState]:
            with explaining_failures(inner, given.inner_state, given.params, given.scaled_grads):
                grads = unscaled_gradients(given.scaled_grads, given.factors, given.params)
                return inner.update(grads, given.inner_state, given.params, **given.extra_args)

        operands = Operands(scaled_grads, state.inner_state, params, factors, extra_args)
        new_updates, inner_state = apply_or_skip(apply, inner_update, operands, form)
        new_updates = meta.merged(
            new_updates, apply, lambda: scale_of(loss_scale, loss_scale_state) / scale
        )
        stats = next_stats(state.stats, summary, applied=apply, spike=spike)
        spike_windows = spike_rule.record(state.spike_windows, summary.norm, loss, apply)
        new_state = LossScaledState(inner_state, loss_scale_state, stats, spike_windows)
        return new_updates, new_state

    # optax types the state as an ArrayTree, which has no place for None (spike_windows).
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def _own_arrays(tree: PyTree, params: PyTree) -> PyTree:
    """`tree` with a copy of each array that `params` hold too or that `tree` held before (an
    inner `init` that keeps the params themselves, as `optax.contrib.prodigy`'s does), so
    that a step can donate the params and the state from its first call."""
    seen: set[int] = set()  # the buffers met, by address

    def once(leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            return leaf
        buffers = {shard.data.unsafe_buffer_pointer() for shard in leaf.addressable_shards}
        if buffers & seen:
            return jnp.copy(leaf)
        seen.update(buffers)
        return leaf

    jax.tree.map(once, params)
    return jax.tree.map(once, tree)


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
