"""The numerics: one pass of sums for the finite check and the norm, the NaN search, scaling.

Every reduction over the gradients is formulated here; docs/design.md says why each
takes the form it has.
"""

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._checks import check_array_leaves, check_axis_name
from jax_lossscale._types import AxisName, PyTree


def is_floating(leaf: Any) -> bool:
    """Whether a leaf takes part in scaling and finiteness checks (real or complex floats)."""
    return jnp.issubdtype(leaf.dtype, jnp.inexact)


def all_finite(tree: PyTree, axis_name: AxisName | None = None) -> jax.Array:
    """Whether every floating leaf of `tree` is free of NaN, +inf and -inf.

    `None` leaves and integer, boolean and `float0` arrays are ignored, so an
    empty tree is finite. With `axis_name` (inside `pmap` or `shard_map`) the
    answer is combined across that axis: it is true only when it is true on
    every device, and every device gets the same answer.

    Args:
      tree: a pytree of arrays, typically gradients.
      axis_name: a mapped axis name (or tuple of names) to reduce over, or None.

    Returns:
      A boolean scalar array.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> jls.all_finite({"w": jnp.ones(3), "b": None})
      Array(True, dtype=bool)
      >>> jls.all_finite({"w": jnp.array([1.0, jnp.inf])})
      Array(False, dtype=bool)
    """
    check_array_leaves(tree, arg_name="tree", caller="all_finite")
    check_axis_name(axis_name, caller="all_finite")
    return cast(jax.Array, finite_flag(tree, axis_name))  # jax.jit's wrapper returns Any


@functools.partial(jax.jit, static_argnums=1)
def finite_flag(tree: PyTree, axis_name: AxisName | None) -> jax.Array:
    """`all_finite` without the leaf check, for callers that have made it already."""
    return _finite(square_sums(floating_parts(tree)), axis_name)


def _finite(totals: list[jax.Array], axis_name: AxisName | None) -> jax.Array:
    """Whether no sum of `square_sums` is NaN, combined over `axis_name`."""
    flags = [~jnp.isnan(total) for total in totals]
    finite = jnp.stack(flags).all() if flags else jnp.array(True)
    if axis_name is not None:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return finite


def square_sums(parts: list[jax.Array]) -> list[jax.Array]:
    """Per part, the sum of `x * (x + (x - x))` over its entries, in float32 or wider.

    The one pass over the gradients that both the finite check and the gradient norm
    read: `x - x` is 0 for a finite `x` and NaN for +-inf and NaN, so a sum is NaN
    exactly when its part holds a non-finite entry (its other terms are >= 0, and
    squares too large for the dtype only make it +inf). Otherwise it is the part's
    squared L2 norm. XLA fuses the arithmetic into the reduction, which writes nothing.
    (Written so, not as `x**2 + (x - x)`, so that XLA does not share the square with an
    optimizer's own `g**2` and keep it in memory for both.)
    """
    totals = []
    for part in parts:
        wide = jnp.asarray(part, wide_dtype(part.dtype))
        totals.append(jnp.sum(wide * (wide + jnp.subtract(wide, wide))))
    return totals


def global_norm_and_finite(
    tree: PyTree, axis_name: AxisName | None, divisor: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The float32 L2 norm of the floating leaves of `tree`, and whether they are finite.

    With `divisor`, the norm of `tree / divisor`, the sums taken over `tree` itself and
    their root divided: exact for a power-of-two `divisor`, and no pass over `tree` has
    to multiply (on a CPU, XLA's fastest reductions take no scaled input).

    From `square_sums`, the same reductions as `finite_flag`'s, which XLA computes
    once for both. With `axis_name`, under `shard_map` a leaf that varies over the
    axis is a shard of the global gradient, so its squares are summed over the axis,
    and a leaf the same on every device is counted once. `pmap` (and `shard_map`
    with `check_vma=False`) does not say which leaves vary: each device's leaves are
    taken as the whole gradient, as after the `pmean` of data-parallel training. The
    devices then agree on the largest norm, and on the finite flag as `finite_flag` does.
    The norm is NaN when a leaf is not finite, and +inf when finite squares overflow.
    """
    parts = floating_parts(tree)
    totals = square_sums(parts)
    finite = _finite(totals, axis_name)
    if not totals:
        return jnp.zeros([], jnp.float32), finite
    if axis_name is None:
        return _divided(jnp.sqrt(sum(totals)).astype(jnp.float32), divisor), finite
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    by_axes: dict[tuple[Any, ...], list[jax.Array]] = {}
    for part, total in zip(parts, totals, strict=True):
        axis_type = getattr(jax.typeof(part), "manual_axis_type", None)
        varying: frozenset[Any] = getattr(axis_type, "varying", frozenset())
        by_axes.setdefault(tuple(name for name in names if name in varying), []).append(total)
    combined = [
        jax.lax.psum(sum(group), axes) if axes else sum(group) for axes, group in by_axes.items()
    ]
    norm = jax.lax.pmax(jnp.sqrt(sum(combined)).astype(jnp.float32), axis_name)
    norm = _divided(norm, divisor)
    return jnp.where(finite, norm, np.float32(np.nan)), finite  # NaN on every device


def _divided(norm: jax.Array, divisor: jax.Array | None) -> jax.Array:
    return norm if divisor is None else cast(jax.Array, divide_floating(norm, divisor))


def any_nan(tree: PyTree) -> jax.Array:
    """Whether a floating leaf of `tree` holds a NaN.

    A part holds a NaN when its sum of squares is NaN: infinities square to +inf,
    and a sum of non-negative terms is NaN only if a term is. The squares are taken
    in float32 or wider, where an 8-bit float without an infinity would overflow to NaN.
    """
    flags = [
        jnp.isnan(jnp.sum(jnp.square(jnp.asarray(part, wide_dtype(part.dtype)))))
        for part in floating_parts(tree)
    ]
    return jnp.stack(flags).any() if flags else jnp.array(False)


def wide_dtype(dtype: Any) -> Any:
    """`dtype` if it has 32 bits or more, else float32: the precision to compute in."""
    return dtype if jnp.finfo(dtype).bits >= 32 else jnp.float32


SMALL_PART = 2**12  # entries: a leaf this small is checked together with others
GROUP_SIZE = 2**16  # entries: at most this many of them are joined into one part


def floating_parts(tree: PyTree, join_small: bool | None = None) -> list[jax.Array]:
    """The floating leaves of `tree` as parts to reduce, few of them for many leaves.

    Complex leaves give their real and imaginary parts. With `join_small` (by default
    when the process has one device, so that no leaf can be sharded), leaves of at most
    `SMALL_PART` entries are joined, by dtype, into parts of at most `GROUP_SIZE`
    entries: XLA compiles one reduction per group instead of one per leaf, and the
    joined copies, at most `GROUP_SIZE` entries each, are all the memory it takes.
    Across devices a joined part would gather sharded leaves, so each leaf stays apart.
    """
    if join_small is None:
        join_small = jax.device_count() == 1
    parts: list[jax.Array] = []
    small: dict[Any, list[jax.Array]] = {}
    for leaf in jax.tree.leaves(tree):
        if not is_floating(leaf):
            continue
        for part in [leaf.real, leaf.imag] if jnp.iscomplexobj(leaf) else [leaf]:
            if join_small and part.size <= SMALL_PART:
                small.setdefault(part.dtype, []).append(part.reshape(-1))
            else:
                parts.append(part)
    for same_dtype in small.values():
        group: list[jax.Array] = []
        size = 0
        for part in same_dtype:
            if group and size + part.size > GROUP_SIZE:
                parts.append(jnp.concatenate(group))
                group, size = [], 0
            group.append(part)
            size += part.size
        parts.append(jnp.concatenate(group) if len(group) > 1 else group[0])
    return parts


@jax.jit
def multiply_floating(tree: PyTree, factor: jax.Array) -> PyTree:
    """`leaf * factor` for each floating leaf, computed in float32 or wider, in the leaf's dtype."""
    return _map_floating(lambda leaf, wide: leaf.astype(wide) * factor.astype(wide), tree)


@jax.jit
def divide_floating(tree: PyTree, divisor: jax.Array) -> PyTree:
    """`leaf / divisor` for each floating leaf, computed in float32 or wider, in the leaf's dtype.

    Each leaf is multiplied by the reciprocal of `divisor` rather than divided by it:
    a multiplication is cheap enough for XLA to fuse it into every consumer, where a
    division would be computed once and kept in memory. The result is exact when
    `divisor` is a power of two, as every scale of a `DynamicLossScale` with a
    power-of-two `multiplier` is. The reciprocal is taken in two factors, the second
    1.0 unless `divisor` exceeds 2**126, so that it never becomes a subnormal number
    (which XLA flushes to zero on some backends).
    """
    divisor = divisor.astype(jnp.float32)
    bounded = jnp.minimum(divisor, np.float32(2.0**126))
    reciprocal, correction = 1 / bounded, bounded / divisor

    def unscale(leaf: jax.Array, wide: Any) -> jax.Array:
        return leaf.astype(wide) * reciprocal.astype(wide) * correction.astype(wide)

    return _map_floating(unscale, tree)


def _map_floating(fn: Callable[[jax.Array, Any], jax.Array], tree: PyTree) -> PyTree:
    def apply(leaf: jax.Array) -> jax.Array:
        if not is_floating(leaf):
            return leaf
        return fn(leaf, wide_dtype(leaf.dtype)).astype(leaf.dtype)

    return jax.tree.map(apply, tree)
