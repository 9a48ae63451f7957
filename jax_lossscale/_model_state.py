"""`where_applied`: the model state a skipped step must not change, kept."""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jax_lossscale._axes import explicit_sharding
from jax_lossscale._checks import check_array_leaves, describe, describe_array, path_name
from jax_lossscale._fp8_meta import follows_scale, times_saturating
from jax_lossscale._lookup import get_loss_scale, get_loss_scale_stats
from jax_lossscale._types import PyTree


def where_applied(opt_state: Any, new: PyTree, old: PyTree, *, scale_before: Any = None) -> PyTree:
    """`new` if the last `loss_scaled` step was applied, `old` if it was skipped.

    For the state a model changes in its forward pass, which `tx.update` never sees:
    BatchNorm's running statistics (flax linen `batch_stats`, flax nnx `BatchStat`
    variables, equinox's `eqx.nn.State`, haiku's state). A batch that overflows makes
    them NaN or inf while its step is skipped; pass the `opt_state` returned by this
    step's `tx.update`, and the statistics of a skipped step are the old ones, bit
    for bit. It runs inside `jit`, `pmap` and `shard_map` with no host round trip.

    Args:
      opt_state: the optax state (or flax nnx `Optimizer`) after this step's update,
        holding one `LossScaledState`, found as by `get_loss_scale`.
      new: the model state after this step's forward pass: arrays of any numeric or
        boolean dtype, and typed PRNG keys (an nnx model's `RngKey`s).
      old: the model state before it; a pytree of the same structure, shapes and
        dtypes as `new`.
      scale_before: for fp8 meta state taken this way (flax's `_overwrite_with_gradient`
        collection, the params alone given to the optimizer): the loss scale before this
        step, `jls.get_loss_scale(opt_state)` read before `tx.update`. The output
        gradients' amax histories and scales (`output_grad_amax_history`,
        `output_grad_scale`), which hold amaxes at the scale, are then multiplied by the new
        scale over it, applied or skipped, as `loss_scaled` does to the meta state it sets.

    Returns:
      A pytree like `new`: each leaf from `new` or from `old`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale())
      >>> params = {"w": jnp.ones(2)}
      >>> _, opt_state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, tx.init(params), params)
      >>> old_stats, new_stats = {"mean": jnp.zeros(2)}, {"mean": jnp.array([jnp.inf, 1.0])}
      >>> jls.where_applied(opt_state, new_stats, old_stats)
      {'mean': Array([0., 0.], dtype=float32)}
    """
    applied = get_loss_scale_stats(opt_state).last_step_applied
    if jnp.shape(applied) != ():
        raise ValueError(
            f"where_applied: the last_step_applied of opt_state has shape {jnp.shape(applied)}; "
            "call it inside the step (inside pmap, where a replicated state is scalar)"
        )
    # Typed PRNG keys (the RNG state of an nnx model with Dropout) are selected as any array.
    check_array_leaves(_key_data(new), arg_name="new", caller="where_applied")
    check_array_leaves(_key_data(old), arg_name="old", caller="where_applied")
    new_leaves, structure = jax.tree_util.tree_flatten_with_path(new)
    # jaxlib's PyTreeDef has no stubs: annotated, it is Any to mypy, and `!=` type-checks.
    old_structure: jax.tree_util.PyTreeDef = jax.tree.structure(old)
    old_leaves = jax.tree.leaves(old)
    if old_structure != structure:
        raise ValueError(
            f"where_applied: old has the structure {old_structure}, but new has {structure}; "
            "pass the model state from before and after the same step"
        )
    for (path, new_leaf), old_leaf in zip(new_leaves, old_leaves, strict=True):
        if jnp.shape(new_leaf) != jnp.shape(old_leaf) or new_leaf.dtype != old_leaf.dtype:
            raise ValueError(
                f"where_applied: the leaf at {path_name(path)} is {describe_array(new_leaf)} "
                f"in new but {describe_array(old_leaf)} in old; the two must match"
            )
    kept = [
        jnp.where(applied, new_leaf, _placed_like(old_leaf, new_leaf))
        for (_, new_leaf), old_leaf in zip(new_leaves, old_leaves, strict=True)
    ]
    if scale_before is not None:
        ratio = get_loss_scale(opt_state) / _scale_before(scale_before)
        kept = [
            times_saturating(leaf, ratio) if follows_scale(path) else leaf
            for (path, _), leaf in zip(new_leaves, kept, strict=True)
        ]
    return jax.tree.unflatten(structure, kept)


def _scale_before(value: Any) -> jax.Array:
    """`scale_before` as a float32 scalar, or a TypeError naming it."""
    try:
        scale = jnp.asarray(value)
    except TypeError:
        scale = None
    if scale is None or scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(
            f"where_applied(scale_before={describe(value)}): scale_before must be the loss "
            "scale before the step, a float scalar: jls.get_loss_scale(opt_state) read "
            "before tx.update"
        )
    return scale.astype(jnp.float32)


def _placed_like(old: Any, new: Any) -> Any:
    """`old` split as `new` is where either is split over an explicit mesh axis and they
    differ (batch statistics made at init replicated, computed from activations split over
    the axis): over explicit axes JAX selects between arrays of one sharding only."""
    target, source = explicit_sharding(new), explicit_sharding(old)
    if target == source:
        return old
    if target is None:  # replicated over the mesh `old` is split over
        target = NamedSharding(source.mesh, PartitionSpec())
    return jax.sharding.reshard(old, target)


def _key_data(tree: PyTree) -> PyTree:
    """`tree` with its typed PRNG key arrays replaced by their data, for the leaf checks."""

    def data(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(leaf)
        return leaf

    return jax.tree.map(data, tree)
