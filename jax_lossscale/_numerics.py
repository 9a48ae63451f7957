"""The numerics: one pass over the gradients for the finite check, the norm and NaNs; scaling.

Every reduction over the gradients is formulated here; docs/design.md says why each
takes the form it has.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from jax_lossscale._checks import check_array_leaves, check_axis_name, is_at_least_float32
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

    Examples:
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
    return finite_and_nan_flags(tree, axis_name)[0]


def finite_and_nan_flags(tree: PyTree, axis_name: AxisName | None) -> tuple[jax.Array, jax.Array]:
    """Whether the floating leaves of `tree` are all finite, and whether one holds a NaN, exact
    per entry on every platform (`all_finite`'s pass), each the same on every device of
    `axis_name`."""
    totals, infs = square_sums_and_infs(floating_parts(tree))
    nans = [jnp.isnan(total) for total in totals]
    has_nan = jnp.stack(nans).any() if nans else jnp.array(False)
    if axis_name is not None:
        has_nan = jax.lax.pmax(has_nan.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return _finite(totals, infs, axis_name), has_nan


def may_be_sharded(leaf: Any) -> bool:
    """Whether XLA may split `leaf` over more than one device, as its type says.

    The type of an array (`jax.typeof(leaf).sharding`) names the mesh it is placed on, or
    none for an array on one device and for a NumPy array; then the mesh entered with
    `jax.sharding.set_mesh`, if any, is read instead. Over a mesh axis of more than one
    device, an `Explicit` axis splits the leaf where its spec names the axis, an `Auto`
    axis (of a `Mesh` built directly) lets XLA's partitioner split it as it chooses, and a
    `Manual` axis (inside `pmap` or `shard_map`) holds each device's own values, which
    are not split. Nothing here reads how many devices the process has: a leaf on one
    device of eight is not sharded. Under `jit` given `in_shardings` alone, the type of an
    argument names no mesh; the leaf is then taken as unsharded, and the one-pass form
    stays correct if XLA splits it after all (the partitioner then gathers each part's
    per-device results, a scalar pair per device, and the joined small leaves).
    """
    sharding = jax.typeof(leaf).sharding
    mesh = sharding.mesh
    split: set[Any] = set()
    if mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    else:
        for entry in sharding.spec:
            split.update(entry if isinstance(entry, tuple) else [entry])
    for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True):
        if size > 1 and (kind == AxisType.Auto or (kind == AxisType.Explicit and name in split)):
            return True
    return False


def _varying_axes(part: jax.Array) -> frozenset[Any]:
    """The `shard_map` axes over which `part` varies (none outside `shard_map`)."""
    axis_type = getattr(jax.typeof(part), "manual_axis_type", None)
    return cast(frozenset[Any], getattr(axis_type, "varying", frozenset()))


def _finite(
    totals: list[jax.Array], infs: list[jax.Array], axis_name: AxisName | None
) -> jax.Array:
    """Whether no part of `square_sums_and_infs` holds a NaN or an infinity, combined over
    `axis_name`."""
    flags = [~jnp.isnan(total) & ~inf for total, inf in zip(totals, infs, strict=True)]
    finite = jnp.stack(flags).all() if flags else jnp.array(True)
    if axis_name is not None:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return finite


def square_sums_and_infs(
    parts: list[jax.Array], one_pass: bool | None = None, factor: jax.Array | None = None
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per part, the sum of `|x| * |x|` over its entries `x` (each times `factor`, a
    positive float32 scalar, if given), in float32 or wider, and whether an entry is
    +-inf.

    The pass over the gradients that the finite check, the gradient norm and the NaN count
    of skipped steps read. A sum is NaN exactly when its part holds a NaN (its terms are
    >= 0 or +inf, so no infinity cancels another), +inf when it holds an infinity or
    finite squares too large for the dtype, and otherwise the part's squared L2 norm.
    The flag tells an infinity from squares that overflow, which the sum cannot. Nothing
    here makes a NaN from a value that is not one (no `x - x`, no `inf * 0`), so
    `jax_debug_nans` finds the op that made it. (The square is written with `|x|`, which
    the flag reads too, not as `x * x`, so that XLA does not share it with an optimizer's
    own `g**2` and keep it in memory for both.)

    With `factor`, the entries are multiplied by it first: with the reciprocal of the
    loss scale, the sums and the flags are those of the unscaled gradients, which then
    need not exist in memory, and the norm is right at every scale.

    With `one_pass`, both come from one variadic reduction, which writes nothing and, on
    a CPU, takes as long as the sum alone; but XLA's SPMD partitioner gathers the partial
    results of a variadic reduction where it all-reduces a sum. Where a part may be
    sharded across devices, `one_pass=False` gives two sums, the flag's a count. By
    default each part takes one pass unless `may_be_sharded` says it may be split.
    """
    totals, infs = [], []
    for part in parts:
        part_one_pass = not may_be_sharded(part) if one_pass is None else one_pass
        # No gradient flows through a check; a variadic reduction has no derivative rule.
        wide = jax.lax.stop_gradient(jnp.asarray(part, wide_dtype(part.dtype)))
        if factor is not None:
            wide = wide * factor.astype(wide.dtype)
        magnitude = jnp.abs(wide)
        terms = magnitude * magnitude
        if part_one_pass:
            total, has_inf = jax.lax.reduce(
                (terms, magnitude == np.inf),
                (np.zeros((), wide.dtype), np.bool_(False)),
                _add_and_or,
                tuple(range(wide.ndim)),
            )
        else:
            # A count of infinities, a float sum as the partitioner all-reduces the total.
            infinities = jnp.sum((magnitude == np.inf).astype(wide.dtype))
            total, has_inf = jnp.sum(terms), infinities > 0
        totals.append(total)
        infs.append(has_inf)
    return totals, infs


def on_gpu(gpu: Callable[..., Any], other: Callable[..., Any], *args: Any) -> Any:
    """`gpu(*args)` where the program is lowered for a GPU (CUDA or ROCm), else `other(*args)`.

    Both are traced (`jax.lax.platform_dependent`), and the lowering keeps the chosen one
    alone, so the program of any other platform is the one `other` alone would give.
    """
    return jax.lax.platform_dependent(*args, cuda=gpu, rocm=gpu, default=other)


ROW = 512  # entries: the sums of squares on a GPU are first taken over rows of this many


def square_sum(parts: list[jax.Array], factor: jax.Array | None = None) -> jax.Array:
    """The sum of `|x| * |x|` over the entries `x` of all `parts` (each times `factor`, if
    given), in float32 or wider: the form of the check for a GPU.

    There a variadic reduction is split into two kernels that fuse into nothing, and so is a
    plain sum over a large part: each part that may not be sharded is summed over rows of
    `ROW` entries (one kernel), and the rows' sums of all parts over one more. Where the sum
    is finite, it is the squared L2 norm; NaN exactly when an entry is NaN (the terms are
    >= 0 or +inf, so no infinity cancels another, and nothing makes a NaN from a value that
    is not one); +inf for an infinity, and for squares that overflow float32 (an unscaled
    entry above about 1.8e19, or a squared norm above 3.4e38), which the wrapper's check may
    count as an overflow (DESIGN 3.1; `all_finite` stays exact).
    """
    sums = []
    for part in parts:
        wide = jax.lax.stop_gradient(jnp.asarray(part, wide_dtype(part.dtype)))
        if factor is not None:
            wide = wide * factor.astype(wide.dtype)
        magnitude = jnp.abs(wide)
        squares = magnitude * magnitude
        if may_be_sharded(part) or squares.size <= ROW:
            sums.append(jnp.sum(squares).reshape(1))  # (the partitioner all-reduces a sum)
        else:
            rows = jnp.pad(squares.reshape(-1), (0, -squares.size % ROW)).reshape(-1, ROW)
            sums.append(jnp.sum(rows, axis=1))
    # The rows' sums of all parts are added up as vectors of one length, which the last sum
    # reads in its one kernel; the barrier keeps XLA from joining each part's two sums into one,
    # which it would split in two again. The last sum gives two halves: its consumers (the
    # state's scalars) then share a vector, not a scalar, and XLA:GPU merges some of them.
    sums = jax.lax.optimization_barrier(sums)
    length = 2 * -(-max(part_sums.size for part_sums in sums) // 2)
    padded = sum(jnp.pad(part_sums, (0, length - part_sums.size)) for part_sums in sums)
    halves = jax.lax.optimization_barrier(jnp.sum(jnp.reshape(padded, (2, -1)), axis=1))
    total: jax.Array = halves[0] + halves[1]
    return total


def _add_and_or(
    left: tuple[jax.Array, jax.Array], right: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    return left[0] + right[0], left[1] | right[1]


class GradientCheck(NamedTuple):
    """What one pass over the gradients tells, the same on every device of `axis_name`."""

    norm: jax.Array  # float32 L2 norm: NaN for a NaN, +inf for an infinity or an overflow
    finite: jax.Array  # bool: no NaN, +inf or -inf
    has_nan: jax.Array  # bool: a NaN (on some device)


def check_gradients(
    tree: PyTree, axis_name: AxisName | None, divisor: jax.Array | None = None
) -> GradientCheck:
    """The float32 L2 norm of the floating leaves of `tree`, whether they are finite and
    whether one holds a NaN.

    With `divisor` (a positive float32 scalar), all three are those of `tree / divisor`,
    each entry multiplied by the reciprocal of `divisor` inside the pass (in two factors,
    as `divide_floating` takes it, the second applied to the norm): at any scale, the
    flags are those of the unscaled gradients and the norm is right wherever the
    unscaled gradients' is, though `tree / divisor` is never written out.

    From `square_sums_and_infs`, the same reductions as `finite_flag`'s, which XLA
    computes once for both. With `axis_name`, under `shard_map` a leaf that varies over
    the axis is a shard of the global gradient, so its squares are summed over the axis,
    and a leaf the same on every device is counted once. `pmap` (and `shard_map` with
    `check_vma=False`) does not say which leaves vary: each device's leaves are taken as
    the whole gradient, as after the `pmean` of data-parallel training. The devices then
    agree on the largest norm, on the finite flag as `finite_flag` does, and on a NaN
    held by any of them.
    """
    parts = floating_parts(tree)
    factor, correction = (None, None) if divisor is None else reciprocal_factors(divisor)
    names = () if axis_name is None else axis_name if isinstance(axis_name, tuple) else (axis_name,)
    groups: dict[tuple[Any, ...], list[int]] = {}  # the parts by the axes they vary over
    for index, part in enumerate(parts):
        varying = _varying_axes(part)
        groups.setdefault(tuple(name for name in names if name in varying), []).append(index)

    def per_part(
        parts: list[jax.Array], factor: jax.Array | None
    ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
        totals, infs = square_sums_and_infs(parts, factor=factor)
        finite = _finite(totals, infs, None)
        nans = [jnp.isnan(total) for total in totals]
        has_nan = jnp.stack(nans).any() if nans else jnp.array(False)
        # (A Python sum, from 0, as the norm always took it.)
        sums = [cast(jax.Array, sum(totals[i] for i in group)) for group in groups.values()]
        return sums, finite, has_nan

    def per_group(
        parts: list[jax.Array], factor: jax.Array | None
    ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
        sums = [square_sum([parts[i] for i in group], factor) for group in groups.values()]
        finite = jnp.stack([jnp.isfinite(total) for total in sums]).all()
        has_nan = jnp.stack([jnp.isnan(total) for total in sums]).any()
        return sums, finite, has_nan

    if not parts:
        sums, finite, has_nan = [], jnp.array(True), jnp.array(False)
    else:
        sums, finite, has_nan = on_gpu(per_group, per_part, parts, factor)
    if axis_name is not None:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
        has_nan = jax.lax.pmax(has_nan.astype(jnp.int32), axis_name).astype(jnp.bool_)
    if not sums:
        return GradientCheck(jnp.zeros([], jnp.float32), finite, has_nan)
    if axis_name is None:
        norm = jnp.sqrt(sums[0]).astype(jnp.float32)
        return GradientCheck(_corrected(norm, correction), finite, has_nan)
    combined = [
        jax.lax.psum(total, axes) if axes else total
        for axes, total in zip(groups, sums, strict=True)
    ]
    norm = jax.lax.pmax(jnp.sqrt(sum(combined)).astype(jnp.float32), axis_name)
    # A maximum may drop a NaN (XLA's on a CPU does); the flag, combined, restores it.
    norm = jnp.where(has_nan, np.float32(np.nan), _corrected(norm, correction))
    return GradientCheck(norm, finite, has_nan)


def _corrected(norm: jax.Array, correction: jax.Array | None) -> jax.Array:
    return norm if correction is None else norm * correction


def wide_dtype(dtype: Any) -> Any:
    """`dtype` if it has 32 bits or more, else float32: the precision to compute in."""
    return dtype if is_at_least_float32(dtype) else jnp.float32


SMALL_PART = 2**12  # entries: a leaf this small is checked together with others
GROUP_SIZE = 2**16  # entries: at most this many of them are joined into one part


def floating_parts(tree: PyTree, join_small: bool | None = None) -> list[jax.Array]:
    """The floating leaves of `tree` as parts to reduce, few of them for many leaves.

    Complex leaves give their real and imaginary parts. With `join_small` (by default
    for each leaf that `may_be_sharded` says is not split over devices: on one device, or
    inside `pmap` or `shard_map`), leaves of at most `SMALL_PART` entries are joined, by
    dtype (and, under `shard_map`, by the axes they vary over), into parts of at most
    `GROUP_SIZE` entries: XLA compiles one reduction per group instead of one per leaf,
    and the joined copies, at most `GROUP_SIZE` entries each, are all the memory it
    takes. A joined part would gather a sharded leaf, so such a leaf stays apart.
    """
    parts: list[jax.Array] = []
    small: dict[Any, list[jax.Array]] = {}
    for leaf in jax.tree.leaves(tree):
        if not is_floating(leaf):
            continue
        joins = not may_be_sharded(leaf) if join_small is None else join_small
        for part in [leaf.real, leaf.imag] if jnp.iscomplexobj(leaf) else [leaf]:
            if joins and part.size <= SMALL_PART:
                key = (part.dtype, _varying_axes(part))
                small.setdefault(key, []).append(part.reshape(-1))
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
    """`leaf / divisor` for each floating leaf, computed in float32 or wider, in the leaf's
    `unscaled_dtype` (float32 for float16, the leaf's own dtype otherwise).

    Each leaf is multiplied by the reciprocal of `divisor` rather than divided by it:
    a multiplication is cheap enough for XLA to fuse it into every consumer, where a
    division would be computed once and kept in memory. The result is exact when
    `divisor` is a power of two, as every scale of a `DynamicLossScale` with a
    power-of-two `multiplier` is. The reciprocal is taken in two factors, the second
    1.0 unless `divisor` exceeds 2**126, so that it never becomes a subnormal number
    (which XLA flushes to zero on some backends).
    """
    reciprocal, correction = reciprocal_factors(divisor)

    def unscale(leaf: jax.Array, wide: Any) -> jax.Array:
        return leaf.astype(wide) * reciprocal.astype(wide) * correction.astype(wide)

    return _map_floating(unscale, tree, unscaled_dtype)


def reciprocal_factors(divisor: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two float32 factors whose product is `1 / divisor`, neither of them subnormal.

    On a GPU both come from one division of pairs, the same two quotients: the kernels that
    read them (every leaf's unscaling and check) then share an operand of two entries, and
    XLA:GPU merges kernels that share one, where it merges none that share scalars only.
    """
    divisor = divisor.astype(jnp.float32)
    bounded = jnp.minimum(divisor, np.float32(2.0**126))

    def paired(bounded: jax.Array, divisor: jax.Array) -> tuple[jax.Array, jax.Array]:
        factors = jnp.stack([jnp.ones_like(bounded), bounded]) / jnp.stack([bounded, divisor])
        return factors[0], factors[1]

    def apart(bounded: jax.Array, divisor: jax.Array) -> tuple[jax.Array, jax.Array]:
        return 1 / bounded, bounded / divisor

    return cast(tuple[jax.Array, jax.Array], on_gpu(paired, apart, bounded, divisor))


def scalars_written_together(tree: PyTree) -> PyTree:
    """`tree`, whose 32-bit scalar leaves, on a GPU, are written by one kernel.

    XLA:GPU launches a kernel for each small computation of a scalar (a counter, the
    scale, a select between old and new) that no larger kernel takes in, since it merges no
    kernels over scalar operands. So there the scalars' bits are stacked into one vector
    (one kernel computes them all), which a barrier keeps XLA from taking apart again, and
    each is read back out with `max(b, b >> 1)`, which is `b` for unsigned bits but is an
    elementwise operation, so that XLA writes them all in one more kernel. Other platforms
    get `tree` as it is; weakly typed leaves stay out, since the bits come back strong, and so
    do PRNG keys.
    """
    return on_gpu(_written_together, lambda tree: tree, tree)


def _written_together(tree: PyTree) -> PyTree:
    leaves, structure = jax.tree.flatten(tree)
    groups: dict[Any, list[int]] = {}  # by the mapped axes a value varies over (shard_map)
    for index, leaf in enumerate(leaves):
        aval = jax.typeof(leaf) if isinstance(leaf, jax.Array) else None
        if (
            aval is not None
            and aval.ndim == 0
            and aval.dtype.itemsize == 4
            and not jnp.issubdtype(aval.dtype, jax.dtypes.extended)  # a PRNG key
            and not aval.weak_type
        ):
            groups.setdefault(getattr(aval, "manual_axis_type", None), []).append(index)
    for chosen in groups.values():
        if len(chosen) < 2:
            continue
        bits = jax.lax.optimization_barrier(
            jnp.stack([jax.lax.bitcast_convert_type(leaves[i], jnp.uint32) for i in chosen])
        )
        for position, index in enumerate(chosen):
            read = jnp.maximum(bits[position], bits[position] >> np.uint32(1))
            leaves[index] = jax.lax.bitcast_convert_type(read, leaves[index].dtype)
    return jax.tree.unflatten(structure, leaves)


def unscaled_dtype(dtype: Any) -> Any:
    """The dtype of an unscaled gradient of dtype `dtype`: float32 for float16, which holds
    a scaled gradient but not always the unscaled one (a true gradient of 1e-6 is subnormal
    there), the gradient's own dtype otherwise."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float16 else dtype


def in_unscaled_dtypes(params: PyTree) -> PyTree:
    """`params` with each float16 leaf as float32, the dtype its unscaled gradients take:
    an inner optimizer's state made from them (adam's moments, MultiSteps' sums) keeps its
    types through a step (a `lax.scan` carry, a donated buffer)."""

    def in_unscaled_dtype(param: Any) -> Any:
        if getattr(param, "dtype", None) == jnp.float16:
            return jnp.asarray(param, unscaled_dtype(param.dtype))
        return param

    return jax.tree.map(in_unscaled_dtype, params)


def unscaled_gradients(scaled_grads: PyTree, scale: jax.Array, params: PyTree) -> PyTree:
    """`divide_floating(scaled_grads, scale)`, each float16 leaf in its param's dtype where
    that is wider than float32 (float64 under x64), when `params` has the gradients'
    structure: the gradients as the inner optimizer takes them."""
    grads = divide_floating(scaled_grads, scale)
    # jaxlib's PyTreeDef has no stubs: annotated, it is Any to mypy, and `!=` type-checks.
    structure: jax.tree_util.PyTreeDef = jax.tree.structure(scaled_grads)
    if params is None or jax.tree.structure(params) != structure:
        return grads

    def widened(grad: jax.Array, scaled: jax.Array, param: Any) -> jax.Array:
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

    return jax.tree.map(widened, grads, scaled_grads, params)


def _same_dtype(dtype: Any) -> Any:
    return dtype


def _map_floating(
    fn: Callable[[jax.Array, Any], jax.Array],
    tree: PyTree,
    out_dtype: Callable[[Any], Any] = _same_dtype,
) -> PyTree:
    def apply(leaf: jax.Array) -> jax.Array:
        if not is_floating(leaf):
            return leaf
        return fn(leaf, wide_dtype(leaf.dtype)).astype(out_dtype(leaf.dtype))

    return jax.tree.map(apply, tree)
