"""Overflow diagnostics: which gradient leaves hold NaN or inf, and whether a run is stuck."""

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _checks
from jax_lossscale._checks import check_array_leaves, describe, path_name
from jax_lossscale._counters import count_true
from jax_lossscale._fp8_meta import OVERWRITE_WITH_GRADIENT
from jax_lossscale._lookup import get_loss_scale_stats
from jax_lossscale._numerics import is_floating
from jax_lossscale._types import PyTree


def count_non_finite(tree: PyTree) -> PyTree:
    """Counts the NaN, +inf and -inf entries of each leaf of `tree`.

    Works inside `jit`, so a train step can return it next to the loss, and
    `non_finite_paths` can name the layers that overflowed on the host. Leaves
    that are not floating (integer, boolean, float0) count 0; `None` stays `None`.

    Args:
      tree: a pytree of arrays, typically the (scaled or unscaled) gradients.

    Returns:
      A pytree of the same structure whose leaves are int32 scalar arrays. A count
      stops at 2**31 - 1, for leaves with more non-finite entries than that.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> grads = {"dense": {"b": jnp.zeros(2), "w": jnp.array([1.0, jnp.inf, jnp.nan])}}
      >>> jls.count_non_finite(grads)
      {'dense': {'b': Array(0, dtype=int32), 'w': Array(2, dtype=int32)}}
    """
    check_array_leaves(tree, arg_name="tree", caller="count_non_finite")
    return _count_non_finite(tree)


@jax.jit
def _count_non_finite(tree: PyTree) -> PyTree:
    def count(leaf: jax.Array) -> jax.Array:
        if not is_floating(leaf):
            return jnp.zeros([], jnp.int32)
        return count_true(jnp.logical_not(jnp.isfinite(leaf)))

    return jax.tree.map(count, tree)


def non_finite_paths(counts: PyTree) -> dict[str, int]:
    """Names the leaves with a non-zero count in the output of `count_non_finite`.

    Runs on the host: it fetches the counts from the device. Paths are written
    with `/` between keys, e.g. `"encoder/layers/0/kernel"`. Counts with a leading
    device axis, from `pmap(count_non_finite)`, are summed over the devices.

    Args:
      counts: the pytree returned by `count_non_finite`, possibly after `jit` or `pmap`.

    Returns:
      A dict from path to count, in the tree's leaf order; empty when all is finite.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> grads = {"dense": {"b": jnp.zeros(2), "w": jnp.array([1.0, jnp.inf, jnp.nan])}}
      >>> jls.non_finite_paths(jls.count_non_finite(grads))
      {'dense/w': 2}
    """
    found = {}
    for path, count in jax.tree_util.tree_flatten_with_path(jax.device_get(counts))[0]:
        if not np.issubdtype(np.asarray(count).dtype, np.integer):
            raise TypeError(
                f"non_finite_paths: counts leaf at {path_name(path)} is "
                f"{describe(count, limit=None)}; pass the tree returned by count_non_finite"
            )
        total = int(np.sum(count))
        if total:
            found[jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"] = total
    return found


class LossScaleStuckError(FloatingPointError):
    """Raised by `check_not_stuck` when a run keeps skipping its steps."""


LossScaleStuckError.__module__ = "jax_lossscale"  # where users import it from


def check_not_stuck(
    opt_state: Any,
    max_consecutive_skips: int = 100,
    *,
    non_finite_counts: PyTree | None = None,
    on_stuck: str = "raise",
) -> str | None:
    """Says when a run is stuck: its last `max_consecutive_skips` steps or more all skipped.

    A run whose gradients are non-finite whatever the scale (a NaN or inf in the forward
    pass, a loss that overflows float16 by itself) skips every step at `min_loss_scale`
    and its params stop changing. A run can stall on spikes too, its gradients finite:
    a norm above `skip_grad_norm_above` at every step, or a loss (`value=`) that is not
    finite; the message tells the two kinds apart, by the last step, and advises for each. Call this
    on the host between steps, where you log: it reads the stats that `tx.update` returns
    and adds nothing to the jitted step.

    Args:
      opt_state: the optax state (or flax nnx `Optimizer`) holding a `LossScaledState`,
        replicated for `pmap` or not.
      max_consecutive_skips: how many skipped steps in a row make a run stuck, >= 1: a
        Python int or a concrete integer array of shape () (`jnp.int32(5)`).
      non_finite_counts: optionally, `count_non_finite` of the last step's gradients,
        returned by the step; the message then names the leaves that overflowed, and
        where flax's fp8 meta state is among them, what that tells: an inf or NaN that
        reached fp8 layers (the other gradients finite), or an fp8 layer with
        dtype=float16 that overflows in its matmuls (the other gradients too).
      on_stuck: `"raise"` a `LossScaleStuckError`, or `"warn"` (a `RuntimeWarning`) and
        go on.

    Returns:
      None when the run is not stuck; else the message it raised or warned with.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(initial_loss_scale=2.0))
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> for _ in range(3):
      ...     _, opt_state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, opt_state, params)
      >>> jls.check_not_stuck(opt_state, 4) is None
      True
      >>> jls.check_not_stuck(opt_state, 3)
      Traceback (most recent call last):
      ...
      jax_lossscale.LossScaleStuckError: loss_scaled is stuck: 3 steps in a row were skipped, ...
    """
    owner = "check_not_stuck"
    max_consecutive_skips = _checks.integer(
        owner,
        "max_consecutive_skips",
        max_consecutive_skips,
        traced=f"a concrete integer, not a traced value: call {owner} on the host, outside "
        "jit, between steps",
    )
    if on_stuck not in ("raise", "warn"):
        _checks.fail(owner, "on_stuck", on_stuck, "'raise' or 'warn'")
    stats = get_loss_scale_stats(opt_state)
    skipped = int(np.max(jax.device_get(stats.consecutive_skipped_steps)))
    if skipped < max_consecutive_skips:
        return None
    scales = np.unique(jax.device_get(stats.loss_scale))
    counts = {
        "NaN": int(np.max(jax.device_get(stats.nan_skipped_steps))),
        "inf": int(np.max(jax.device_get(stats.inf_skipped_steps))),
        "spike": int(np.max(jax.device_get(stats.spike_skipped_steps))),
    }
    message = (
        f"loss_scaled is stuck: {skipped} steps in a row were skipped, at least "
        f"max_consecutive_skips={max_consecutive_skips}, at a loss scale of "
        f"{', '.join(repr(float(scale)) for scale in scales)}; skipped so far: {counts['NaN']} "
        f"for NaN, {counts['inf']} for inf, {counts['spike']} as spikes"
    )
    paths = None if non_finite_counts is None else non_finite_paths(non_finite_counts)
    if paths is not None:
        named = ", ".join(f"{path}: {count} entries" for path, count in paths.items())
        message += f"; the last step's gradients held NaN or inf in {named or 'no leaf'}"
    # The last step was skipped; its grad_norm tells how (the totals are the whole run's):
    # NaN or +inf for an overflow, finite for a spike.
    norms = np.asarray(jax.device_get(stats.grad_norm))
    meta = [path for path in paths or {} if OVERWRITE_WITH_GRADIENT in path.split("/")]
    if counts["spike"] > 0 and np.all(np.isfinite(norms)) and not paths:
        message += (
            "; the last step was skipped as a spike, with finite gradients and a grad_norm of "
            f"{float(np.max(norms))!r}; a norm above skip_grad_norm_above at every step is a new "
            "level, not a bad batch: raise the bound, or leave the judging to skip_spike_sigmas, "
            "whose window follows a new level after spike_window // 4 spikes in a row; a loss "
            "given as value= that is not finite is a spike at every step: find the op that "
            "makes it with jax_debug_nans on the forward pass"
        )
    elif paths == {} and np.all(np.isposinf(norms)):
        message += (
            "; every entry was finite, but their squares added up past the float32 maximum "
            "(a grad_norm above about 1.8e19), which loss_scaled counts as an overflow on "
            "every platform: the unscaled gradients are that large whatever the scale; find "
            "the leaves whose norms are largest (optax.tree.norm of each), and scale the loss "
            "down, lower the learning rate, or restore a checkpoint from before"
        )
    elif meta and len(meta) == len(paths or {}) and np.all(np.isfinite(norms)):
        message += (
            f"; the gradients were finite (a grad_norm of {float(np.max(norms))!r}), but new fp8 "
            "meta values were not, whatever the scale: an inf or NaN reached those layers (fp8 "
            "casts saturate, so the loss stayed finite); find where it enters them, in the data "
            "or the op before (jax_debug_nans on the forward pass), and compute that in float32"
        )
    else:
        message += (
            "; they are not finite whatever the scale (a NaN or an infinity, or a grad_norm "
            "above about 1.8e19, whose square overflows float32): find the op that overflows "
            "(count_non_finite on the gradients, jax_debug_nans on the forward pass) and "
            "compute it in float32, lower the learning rate, or restore a checkpoint from before"
        )
        if meta:
            message += (
                "; the gradients hold fp8 meta state ('_overwrite_with_gradient'): flax's "
                "Fp8DirectDotGeneralOp with dtype=float16 overflows float16 in its matmuls once "
                "its scales are set, at every loss scale; give those layers dtype=jnp.bfloat16 "
                "or jnp.float32"
            )
    if on_stuck == "raise":
        raise LossScaleStuckError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return message
