"""The numerics: the exact finite test, the gradient summary of one pass, and scaling.

Every reduction over the gradients is formulated here (the parts that XLA:CPU and XLA:GPU
want differently in `_platforms`); docs/design.md says why each takes the form it has.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._axes import may_be_sharded, names_of, varying_axes, varying_like
from jax_lossscale._checks import check_array_leaves, check_axis_name, is_at_least_float32
from jax_lossscale._platforms import Form, ReciprocalFactors, reciprocal_factors, row_sums
from jax_lossscale._types import AxisName, PyTree


def is_floating(leaf: Any) -> bool:
    """Whether a leaf takes part in scaling and finiteness checks (real or complex floats)."""
    return jnp.issubdtype(leaf.dtype, jnp.inexact)


def all_finite(tree: PyTree, axis_name: AxisName | None = None) -> jax.Array:
    """Whether every floating leaf of `tree` is free of NaN, +inf and -inf.

    `None` leaves and integer, boolean and `float0` arrays are ignored, so an
    empty tree is finite; a Python number is taken as an array, as jmp takes it.
    With `axis_name` (inside `pmap` or `shard_map`) the answer is combined across
    that axis: it is true only when it is true on every device, and every device
    gets the same answer. The test is exact per entry: a finite entry of any size
    is finite (`loss_scaled`'s own check also counts gradients whose squared norm
    overflows float32, see `LossScaleStats`).

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
    tree = jax.tree.map(_python_number_as_array, tree)  # as jmp's all_finite takes them
    check_array_leaves(tree, arg_name="tree", caller="all_finite")
    check_axis_name(axis_name, caller="all_finite")
    return cast(jax.Array, finite_flag(tree, axis_name))  # jax.jit's wrapper returns Any


def _python_number_as_array(leaf: Any) -> Any:
    """A Python number (a float, say a learning rate logged beside the gradients) as a NumPy
    array; anything else, and an int past every NumPy integer, as it is."""
    if isinstance(leaf, bool | int | float | complex) and not isinstance(leaf, np.generic):
        array = np.asarray(leaf)
        if array.dtype != object:
            return array
    return leaf


@functools.partial(jax.jit, static_argnums=1)
def finite_flag(tree: PyTree, axis_name: AxisName | None) -> jax.Array:
    """`all_finite` without the leaf check, for callers that have made it already."""
    return exact_flags(tree, axis_name)[0]


def exact_flags(tree: PyTree, axis_name: AxisName | None) -> tuple[jax.Array, jax.Array]:
    """Whether every floating entry of `tree` is finite, and whether one is a NaN, exact per
    entry (a finite entry of any size is finite), each the same on every device of
    `axis_name`."""
    finite, has_nan = [], []
    for group in reduction_groups(floating_parts(tree)):
        finite.append(_combined([jnp.isfinite(part) for part in group], jnp.logical_and, 1).all())
        has_nan.append(_combined([jnp.isnan(part) for part in group], jnp.logical_or, 0).any())
    all_finite = jnp.stack(finite).all() if finite else jnp.array(True)
    any_nan = jnp.stack(has_nan).any() if has_nan else jnp.array(False)
    if axis_name is not None:
        flags = jax.lax.pmax(jnp.stack([~all_finite, any_nan]).astype(jnp.int32), axis_name)
        all_finite, any_nan = flags[0] == 0, flags[1] == 1
    return all_finite, any_nan


class GradientSummary(NamedTuple):
    """What the one pass over the gradients tells, the same on every device of `axis_name`.

    A step is finite when the squared L2 norm of its (unscaled) gradients is: a NaN, an
    infinity, or finite entries whose squares add up past the float32 maximum (a norm
    above about 1.8e19) make it not finite, on every platform and in every distribution.
    """

    norm: jax.Array  # float32 L2 norm: NaN for a NaN, +inf for an infinity or an overflow
    finite: jax.Array  # bool: the norm is finite
    has_nan: jax.Array  # bool: a NaN (on some device)


def summarize_gradients(
    tree: PyTree,
    axis_name: AxisName | None,
    factors: ReciprocalFactors | None = None,
    form: Form = Form.LOWERED,
) -> GradientSummary:
    """The float32 L2 norm of the floating leaves of `tree`, from one pass over them.

    With `factors` (the `reciprocal_factors` of a scale), it is that of the floating leaves
    times both, as `unscaled` multiplies them: the unscaled gradients are summarized, though
    never written out. Each
    part's squares are summed over rows (`_platforms.row_sums`), then all the rows'
    sums together, so the norm is within about 1e-7 of the exact one whatever the size.

    With `axis_name`, under `shard_map` a leaf that varies over the axis is a shard of the
    global gradient, so its squares are summed over the axis before the norm is taken, and a
    leaf the same on every device is counted once. `pmap` (and `shard_map` with
    `check_vma=False`) does not say which leaves vary: each device's leaves are taken as the
    whole gradient, as after the `pmean` of data-parallel training, and the devices agree on
    the largest norm (a NaN on any device wins, then an infinity).
    """
    parts = floating_parts(tree)
    names = names_of(axis_name)
    groups: dict[tuple[Any, ...], list[jax.Array]] = {}  # the parts by the axes they vary over
    for part in parts:
        axes = tuple(name for name in names if name in varying_axes(part))
        groups.setdefault(axes, []).append(part)
    total = jnp.zeros([], jnp.float32)
    for axes, group in groups.items():
        group_total = _square_sum(group, factors, form)
        total = total + (jax.lax.psum(group_total, axes) if axes else group_total)
    if axis_name is not None:
        total = _largest_over(total, axis_name)
    # The flags read the norm, not the total: a square root is an operation XLA computes once
    # rather than copy it into each of the many kernels that read the flags (the skip's
    # selects), and with it the sums before it, which then grow with the number of leaves.
    norm = jnp.sqrt(total)
    return GradientSummary(norm, jnp.isfinite(norm), jnp.isnan(norm))


def _square_sum(parts: list[jax.Array], factors: ReciprocalFactors | None, form: Form) -> jax.Array:
    """The float32 sum of the squares of every entry of `parts` (times `factors`).

    The entries are multiplied by the first factor only, and the sum by the square of the
    second (1 unless the scale is above 2**126, and at least 1/4): above that scale a finite
    scaled entry times the first factor is at most 4, so the squares overflow in neither
    order, and each entry takes one multiplication fewer.
    """
    reciprocal = None if factors is None else Broadcasts(factors[0])
    sums = []
    for group in reduction_groups(parts):
        # (The entries are multiplied by the reciprocal, not by the correction first as the
        # unscaling multiplies them, so that XLA shares no product with the update and keeps
        # none in memory for both; an optimizer's own squares are of unscaled gradients.)
        squares = _combined([_squares(part, reciprocal) for part in group], jax.lax.add, 0)
        if may_be_sharded(group[0]):  # a plain sum, which the partitioner all-reduces
            sums.append(jnp.sum(squares).reshape(1))
        else:
            sums.append(row_sums(squares.reshape(-1), form))
    # All the rows' sums in one more sum, in float32 (float64 gradients' too, under x64),
    # added up as vectors of one length, which the last sum reads in one kernel (XLA would
    # take a concatenation apart into a sum per part). The barrier keeps XLA:GPU from joining
    # each part's two sums into one, which it would split in two again.
    sums = jax.lax.optimization_barrier([part_sums.astype(jnp.float32) for part_sums in sums])
    total = jnp.sum(_combined(sums, jax.lax.add, 0))
    return total if factors is None else total * factors[1] * factors[1]


def _combined(arrays: list[jax.Array], combine: Any, padding: Any) -> jax.Array:
    """`arrays` combined entry by entry (`jnp.add`, `jnp.logical_and`): one array as it is,
    several flattened and padded with `padding` to the longest, where their shapes differ."""
    if len(arrays) == 1:
        return arrays[0]
    if len({array.shape for array in arrays}) > 1:
        length = max(array.size for array in arrays)
        arrays = [
            jnp.pad(array.reshape(-1), (0, length - array.size), constant_values=padding)
            for array in arrays
        ]
    return functools.reduce(combine, arrays)


def _squares(part: jax.Array, reciprocal: "Broadcasts | None") -> jax.Array:
    """The squares of the entries of `part` (times `reciprocal`), in float32 or wider. Nothing
    makes a NaN from a value that is not one."""
    wide = in_dtype(part, wide_dtype(part.dtype))
    if reciprocal is not None:
        wide = jax.lax.mul(wide, reciprocal.like(wide))
    return jax.lax.mul(wide, wide)


class Broadcasts:
    """A scalar and its broadcasts to the shapes and dtypes asked, each made once.

    Every leaf of a step is multiplied by the scale's reciprocal; written `leaf * scalar`,
    each multiplication traces, lowers and compiles a broadcast of its own, and a step with
    many leaves takes time in proportion to its operations. Leaves mostly share shapes.
    """

    def __init__(self, scalar: jax.Array) -> None:
        self.scalar = scalar
        self._made: dict[tuple[tuple[int, ...], Any], jax.Array] = {}

    def like(self, leaf: jax.Array) -> jax.Array:
        key = (leaf.shape, leaf.dtype)
        if key not in self._made:
            self._made[key] = jax.lax.broadcast(self.scalar.astype(leaf.dtype), leaf.shape)
        return varying_like(self._made[key], leaf)


def _largest_over(total: jax.Array, axis_name: AxisName) -> jax.Array:
    """The largest of `total` over the devices of `axis_name`, NaN if any is NaN: one
    all-reduce (a maximum may drop a NaN, XLA's on a CPU does, so NaN goes as a code)."""
    code = jnp.where(jnp.isnan(total), np.float32(np.inf), np.float32(0))
    value = jnp.where(jnp.isnan(total), np.float32(0), total)
    largest = jax.lax.pmax(jnp.stack([value, code]), axis_name)
    return jnp.where(largest[1] > 0, np.float32(np.nan), largest[0])


def in_dtype(array: jax.Array, dtype: Any) -> jax.Array:
    """`array.astype(dtype)`, by the primitive: elementwise operations here call `jax.lax`,
    which takes a fraction of the time `jax.numpy`'s promotion does to trace, once per leaf."""
    if array.dtype == dtype and not jax.typeof(array).weak_type:
        return array
    return jax.lax.convert_element_type(array, dtype)


def wide_dtype(dtype: Any) -> Any:
    """`dtype` if it has 32 bits or more, else float32: the precision to compute in (a NumPy
    float64 leaf's is float32 where JAX has no float64, as bare optax computes it)."""
    dtype = jax.dtypes.canonicalize_dtype(dtype)
    return dtype if is_at_least_float32(dtype) else jnp.float32


SMALL_PART = 2**12  # entries: leaves this small are reduced together
GROUP_LEAVES = 32  # leaves at most in a group reduced together


def floating_parts(tree: PyTree) -> list[jax.Array]:
    """The floating leaves of `tree`; a complex leaf gives its real and imaginary parts."""
    parts: list[jax.Array] = []
    for leaf in jax.tree.leaves(tree):
        if is_floating(leaf):
            parts.extend([leaf.real, leaf.imag] if jnp.iscomplexobj(leaf) else [leaf])
    return parts


def reduction_groups(parts: list[jax.Array]) -> list[list[jax.Array]]:
    """`parts` in the groups they are reduced in: each alone, but that parts of at most
    `SMALL_PART` entries, `GROUP_LEAVES` at most, are reduced together, combined entry by
    entry (`_combined`), where `may_be_sharded` says they are not split over devices (on one
    device, or inside `pmap` or `shard_map`, by the `shard_map` axes they vary over, and by
    the dtype their squares are taken in: float64 parts apart, under x64).

    XLA then compiles one reduction per group instead of one per leaf, and writes nothing
    out (a concatenation of many leaves would compile slowly). A sharded leaf stays alone,
    as combining it with another would gather it.
    """
    groups: list[list[jax.Array]] = []
    open_groups: dict[Any, list[jax.Array]] = {}  # by the axes they vary over, and dtype
    for part in parts:
        if part.size > SMALL_PART or may_be_sharded(part):
            groups.append([part])
            continue
        key = (varying_axes(part), jnp.dtype(wide_dtype(part.dtype)))
        group = open_groups.get(key)
        if group is None or len(group) == GROUP_LEAVES:
            group = open_groups[key] = []
            groups.append(group)
        group.append(part)
    return groups


# --- scaling --------------------------------------------------------------------------------


@jax.jit
def multiply_floating(tree: PyTree, factor: jax.Array) -> PyTree:
    """`leaf * factor` for each floating leaf, computed in float32 or wider, in the leaf's dtype."""
    return _map_floating(lambda leaf, wide: leaf.astype(wide) * factor.astype(wide), tree)


@jax.jit
def divide_floating(tree: PyTree, divisor: jax.Array) -> PyTree:
    """`leaf / divisor` for each floating leaf, computed in float32 or wider, in the leaf's
    `unscaled_dtype` (float32 for float16, the leaf's own dtype otherwise).

    Each leaf is multiplied by the reciprocal factors of `divisor` (`reciprocal_factors`)
    rather than divided by it: a multiplication is cheap enough for XLA to fuse it into
    every consumer, where a division would be computed once and kept in memory. The result
    is exact when `divisor` is a power of two, as every scale of a `DynamicLossScale` with a
    power-of-two `multiplier` is.
    """
    return unscaled(tree, reciprocal_factors(divisor, Form.CPU))


def unscaled(tree: PyTree, factors: ReciprocalFactors) -> PyTree:
    """`divide_floating` given the reciprocal factors of the divisor: a leaf wider than
    float32 (float64 under x64) is divided by the divisor in its own dtype, whose precision
    the float32 reciprocal would not keep."""
    reciprocal, correction = Broadcasts(factors.first), Broadcasts(factors.second)
    divisor = Broadcasts(factors.divisor)

    def unscale(leaf: jax.Array, wide: Any) -> jax.Array:
        leaf = in_dtype(leaf, wide)
        if jnp.finfo(wide).bits > 32:
            return jax.lax.div(leaf, divisor.like(leaf))
        # (The correction first: the check multiplies by the reciprocal alone, and XLA
        # would share that product with it and keep it in memory for both.)
        return jax.lax.mul(jax.lax.mul(leaf, correction.like(leaf)), reciprocal.like(leaf))

    return _map_floating(unscale, tree, unscaled_dtype)


def unscaled_dtype(dtype: Any) -> Any:
    """The dtype of an unscaled gradient of dtype `dtype`: float32 for float16, which holds
    a scaled gradient but not always the unscaled one (a true gradient of 1e-6 is subnormal
    there), the gradient's own dtype otherwise."""
    dtype = jax.dtypes.canonicalize_dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype == jnp.float16 else dtype


def in_unscaled_dtypes(params: PyTree) -> PyTree:
    """`params` with each float16 leaf as float32, the dtype its unscaled gradients take
    (`params` itself when it holds none)."""
    leaves, structure = jax.tree.flatten(params)
    if not any(getattr(leaf, "dtype", None) == jnp.float16 for leaf in leaves):
        return params
    return jax.tree.unflatten(
        structure,
        [
            jnp.asarray(leaf, jnp.float32) if getattr(leaf, "dtype", None) == jnp.float16 else leaf
            for leaf in leaves
        ],
    )


def unscaled_gradients(scaled_grads: PyTree, factors: ReciprocalFactors, params: PyTree) -> PyTree:
    """The gradients as the inner optimizer takes them: `scaled_grads` unscaled by the
    reciprocal `factors`, each float16 leaf in its param's dtype where that is wider than
    float32 (float64 under x64), when `params` has the gradients' structure."""
    grads = unscaled(scaled_grads, factors)
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
    return jax.dtypes.canonicalize_dtype(dtype)


def _map_floating(
    fn: Callable[[jax.Array, Any], jax.Array],
    tree: PyTree,
    out_dtype: Callable[[Any], Any] = _same_dtype,
) -> PyTree:
    def apply(leaf: jax.Array) -> jax.Array:
        if not is_floating(leaf):
            return leaf
        return in_dtype(fn(leaf, wide_dtype(leaf.dtype)), out_dtype(leaf.dtype))

    return jax.tree.map(apply, tree)
