"""Apply or skip: a `lax.cond` between the inner update and a skip that keeps every bit.

The two branches of a `cond` must return the same types. The skip's updates take the
types of the inner update's, and each inner-state leaf the dtype that holds its old
and its new values exactly; both are read off the trace of the applied branch, so the
inner update is traced once.
"""

import contextlib
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale._checks import path_name
from jax_lossscale._numerics import on_gpu
from jax_lossscale._types import PyTree


def apply_or_skip(
    apply: jax.Array,
    inner_update: Callable[[], tuple[optax.Updates, optax.OptState]],
    inner_state: optax.OptState,
    select: bool = False,
) -> tuple[optax.Updates, optax.OptState]:
    """`(updates, inner_state)` of `inner_update()` where `apply`, else of a skip.

    A skip returns updates of -0.0, the additive identity of every float (so that
    `optax.apply_updates` keeps the params' bits, signed zeros included), and the inner
    state as it was. With `select` (see `skips_by_select`) both are chosen by
    `jnp.where`, otherwise by a `cond`, except on a GPU, where a `cond` waits on the host
    (`on_gpu`): there always by selects. An `apply` concrete when traced (eagerly) takes
    its branch with no `cond`; under `jit` even a FixedLossScale's constant true is a
    tracer, and XLA folds the `cond` on it.
    """
    applied_types: tuple[PyTree, PyTree] | None = None

    def applied() -> tuple[optax.Updates, optax.OptState]:
        nonlocal applied_types
        new_updates, new_inner_state = inner_update()
        applied_types = _branch_types(inner_state, new_updates, new_inner_state)
        return new_updates, _as_types(new_inner_state, applied_types[1])

    def skipped() -> tuple[optax.Updates, optax.OptState]:
        # `cond` traces the applied branch first; alone (under jax.disable_jit) it is not.
        updates_type, inner_state_type = applied_types or _branch_types(
            inner_state, *jax.eval_shape(inner_update)
        )
        return (
            jax.tree.map(_negative_zeros, updates_type),
            _as_types(inner_state, inner_state_type),
        )

    if not isinstance(apply, jax.core.Tracer):
        return applied() if apply else skipped()
    if select:
        return _selected(apply, inner_update, inner_state)
    # The inner update traced once for both forms, each replaying its equations.
    closed, shape = jax.make_jaxpr(inner_update, return_shape=True)()

    def replayed() -> tuple[optax.Updates, optax.OptState]:
        outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts)
        return cast(
            tuple[optax.Updates, optax.OptState],
            jax.tree.unflatten(jax.tree.structure(shape), outs),
        )

    inner_update = replayed

    def by_cond() -> tuple[optax.Updates, optax.OptState]:
        return cast(tuple[optax.Updates, optax.OptState], jax.lax.cond(apply, applied, skipped))

    def by_select() -> tuple[optax.Updates, optax.OptState]:
        return _selected(apply, replayed, inner_state)

    # On a GPU a `cond` is a conditional thunk: the host reads the predicate and waits for the
    # device on every step. The selects fuse into the inner update's own kernels there.
    return cast(tuple[optax.Updates, optax.OptState], on_gpu(by_select, by_cond))


def _selected(
    apply: jax.Array,
    inner_update: Callable[[], tuple[optax.Updates, optax.OptState]],
    inner_state: optax.OptState,
) -> tuple[optax.Updates, optax.OptState]:
    """The skip as selects: the inner update runs on every step, and where `apply` is
    false its updates are -0.0 and its state the old one. XLA fuses the selects into the
    update and into `optax.apply_updates`, so nothing is written twice."""
    new_updates, new_inner_state = inner_update()
    updates_type, state_type = _branch_types(inner_state, new_updates, new_inner_state)
    updates = jax.tree.map(
        lambda new, type_: jnp.where(apply, new, _negative_zeros(type_)), new_updates, updates_type
    )
    kept = jax.tree.map(
        lambda new, old: jnp.where(apply, new, old),
        _as_types(new_inner_state, state_type),
        _as_types(inner_state, state_type),
    )
    return updates, kept


def skips_by_select(inner_state: optax.OptState, grads: PyTree) -> bool:
    """Whether to skip with selects rather than a `cond`: when the inner state's arrays
    (its scalars, such as step counts, aside) hold no more entries than the gradients:
    sgd with or without momentum, with a schedule or clipping, lion. Such an update is
    cheap, so computing it on a skipped step costs little, and selects fused into it keep
    the updates out of memory; a larger state (adam's two moments) is cheaper to leave
    untouched under a `cond` than to select."""
    state_size = sum(np.size(leaf) for leaf in jax.tree.leaves(inner_state) if np.ndim(leaf))
    return state_size <= sum(np.size(leaf) for leaf in jax.tree.leaves(grads))


def _branch_types(
    inner_state: PyTree, new_updates: PyTree, new_inner_state: PyTree
) -> tuple[PyTree, PyTree]:
    """The types of the updates, and those the inner state takes on both branches.

    A skipped step returns the old inner state, the applied one the new: each leaf
    takes the dtype that holds both exactly (bfloat16 moments that become float32
    stay float32 on a skip). A weakly typed leaf (one made from a Python number)
    takes the new leaf's dtype, as it would in any operation with it.
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


def _joined_type(path: Any, old: Any, new: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    old_type = jax.typeof(old)
    if old_type.weak_type:  # it takes the dtype the update gives it, as JAX's promotion does
        return new
    if old_type.dtype == new.dtype:  # (ShapeDtypeStruct.update has no annotations)
        return cast(jax.ShapeDtypeStruct, new.update(weak_type=False))
    candidates = [new.dtype, old_type.dtype]
    # As between 8-bit floats: jax's TypePromotionError, a ValueError (not in jax.dtypes
    # before jax 0.10.1).
    with contextlib.suppress(ValueError):
        candidates.append(jnp.promote_types(old_type.dtype, new.dtype))
    candidates.append(jnp.dtype(jnp.float32))
    for dtype in candidates:
        if holds_exactly(dtype, old_type.dtype) and holds_exactly(dtype, new.dtype):
            return cast(jax.ShapeDtypeStruct, new.update(dtype=dtype, weak_type=False))
    raise TypeError(
        f"loss_scaled.update: inner.update turns the state leaf at {path_name(path)} from "
        f"{old_type.dtype} into {new.dtype}, and no dtype holds the values of both exactly, "
        "so a skipped step could not keep it"
    )


def holds_exactly(dtype: Any, other: Any) -> bool:
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
    gradients vary per device (under `shard_map`); both branches must agree on that.
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


def _negative_zeros(shape: jax.ShapeDtypeStruct) -> jax.Array:
    # -0.0 is the additive identity for every float, +0.0 and -0.0 included.
    if jnp.issubdtype(shape.dtype, jnp.complexfloating):
        fill = complex(-0.0, -0.0)
    elif jnp.issubdtype(shape.dtype, jnp.floating):
        fill = -0.0
    else:
        fill = 0
    return jnp.full_like(shape, fill)  # like the update: dtype, shape and varying manual axes
