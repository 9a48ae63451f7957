"""The formulations that XLA:CPU and XLA:GPU want differently, and the one choice between them.

Both forms compute the same values and decide the same steps; they differ in the operations
XLA gets, measured on each (docs/design.md):

* the sums of squares of the gradient check: a reduction of two results (the sum and an
  infinity flag) on the CPU, where XLA compiles it into one loop over the entries while it
  rewrites a plain float sum into a tree of smaller reductions with the squares written out
  first (3x to 8x slower); plain sums on a GPU, where XLA splits a reduction of two results
  into two kernels that fuse with nothing;
* the skip of a step whose inner state is larger than the gradients (adam's): a `lax.cond` on
  the CPU and on TPUs, which runs the update only when it is applied, and selects on a GPU,
  where a conditional makes the host wait for the device at every step;
* the reciprocal factors of the scale, from one division of a pair on a GPU;
* the step's scalars, read out of one vector on a GPU, where each small computation of a
  scalar would otherwise be a kernel of its own (`scalars_read_together`).

`Form.LOWERED`, what `loss_scaled` uses, takes the form of the platform the step is lowered
for (`jax.lax.platform_dependent`: the platform's branch is chosen by a constant that XLA folds,
so the compiled program has the chosen form alone). Both branches are traced: only small values
go through the choice. Tests pass `Form.CPU` or `Form.GPU` to run either form on any platform.
"""

import enum
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._axes import varying_axes


class Form(enum.Enum):
    """Which formulations a step takes: those of the platform it is lowered for, or one
    platform's whatever the platform."""

    LOWERED = "lowered"
    CPU = "cpu"  # and TPU: every platform but a GPU
    GPU = "gpu"


def chosen(form: Form, gpu: Callable[..., Any], other: Callable[..., Any], *args: Any) -> Any:
    """`gpu(*args)` in the GPU form, `other(*args)` in the CPU form, and for `Form.LOWERED`
    the one of the platform lowered for (CUDA and ROCm take `gpu`)."""
    if form is Form.GPU:
        return gpu(*args)
    if form is Form.CPU:
        return other(*args)
    return jax.lax.platform_dependent(*args, cuda=gpu, rocm=gpu, default=other)


class ReciprocalFactors(NamedTuple):
    """`1 / divisor` as two float32 factors, and the divisor itself (float32), by which a
    gradient wider than float32 is divided in its own dtype."""

    first: jax.Array
    second: jax.Array
    divisor: jax.Array


def reciprocal_factors(divisor: jax.Array, form: Form) -> ReciprocalFactors:
    """Two float32 factors whose product is `1 / divisor`, neither of them subnormal (which
    XLA flushes to zero on some backends): the first is `1 / min(divisor, 2**126)`, the
    second 1.0 unless `divisor` exceeds 2**126.

    On a GPU both come from one division of pairs: the kernels that read them (every leaf's
    unscaling and check) then share an operand of two entries, and XLA:GPU merges kernels
    that share one, where it merges none that share scalars only. Elsewhere each kernel
    would only slice them out again.
    """
    divisor = divisor.astype(jnp.float32)
    bounded = jnp.minimum(divisor, np.float32(2.0**126))

    def paired() -> tuple[jax.Array, jax.Array]:
        factors = jnp.stack([jnp.ones_like(bounded), bounded]) / jnp.stack([bounded, divisor])
        return factors[0], factors[1]

    def apart() -> tuple[jax.Array, jax.Array]:
        return 1 / bounded, bounded / divisor

    first, second = chosen(form, paired, apart)
    return ReciprocalFactors(first, second, divisor)


ROW = 512  # entries: squares are summed over rows of this many first


def row_sums(squares: jax.Array, form: Form) -> jax.Array:
    """The sums of `squares` (a flat float32 or wider vector, >= 0, +inf or NaN) over rows of
    `ROW` entries, the last row of fewer: a vector of one sum for `ROW` entries or fewer.

    Summed over rows and then over the rows' sums, the squared norm of a leaf of any size is
    within about 1e-7 of the exact one, where one long float32 accumulation drifts by 1e-4 at
    2e7 entries on a CPU. On a GPU the last row is padded with zeros and every row summed by a
    plain sum: XLA:GPU merges the kernels of many leaves' rows then, and splits a reduction of
    two results into two kernels that fuse with nothing. Elsewhere the whole rows are summed
    by a reduction of two results, the sum and an infinity flag, which XLA:CPU compiles into
    one loop, where it rewrites a plain float sum into a tree of smaller ones with the squares
    written out first; and the last, partial row apart, as padded a large leaf is read by a
    slow loop there (2.7x the sgd step).
    """
    if squares.size <= ROW:
        return jnp.sum(squares).reshape(1)
    sums: jax.Array = chosen(form, _padded_row_sums, _row_sums_and_infinities, squares)
    return sums


def _padded_row_sums(squares: jax.Array) -> jax.Array:
    return jnp.sum(jnp.pad(squares, (0, -squares.size % ROW)).reshape(-1, ROW), axis=1)


def _row_sums_and_infinities(squares: jax.Array) -> jax.Array:
    whole = squares.size - squares.size % ROW
    rows = jax.lax.stop_gradient(squares[:whole]).reshape(-1, ROW)  # (no derivative rule)
    # The flag adds nothing (an infinity makes its row's sum infinite, a NaN NaN), but read,
    # it keeps the reduction of two results that XLA:CPU compiles into one loop.
    sums, infinite = jax.lax.reduce(
        (rows, rows == np.inf), (np.zeros((), rows.dtype), np.bool_(False)), _add_and_or, (1,)
    )
    row_sums: jax.Array = sums + jnp.where(infinite, np.asarray(np.inf, sums.dtype), 0)
    if whole == squares.size:
        return row_sums
    return jnp.concatenate([row_sums, jnp.sum(squares[whole:]).reshape(1)])


def _add_and_or(
    left: tuple[jax.Array, jax.Array], right: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    return left[0] + right[0], left[1] | right[1]


def scalars_read_together(tree: Any, form: Form) -> Any:
    """`tree`, whose scalar leaves (32-bit ones and booleans) a GPU reads out of one vector
    (elsewhere, `tree`).

    XLA:GPU launches a kernel for each small computation of a scalar (a counter, the scale, a
    select between old and new, adam's bias corrections) that no larger kernel takes in, since
    it merges kernels that share an operand larger than a scalar, and none that share scalars
    only. So the step's scalar inputs (the state's, and the flags and norm of the gradients)
    are stacked as bits into one vector, in the kernel that computes the flags, and a barrier
    keeps XLA from taking it apart again. Each is read back out with `max(b, b >> 1)`, which is
    `b` for unsigned bits (a boolean's 0 or 1 included) but an elementwise operation, so that
    every computation of the step's scalars reads that vector and XLA merges them into one
    kernel or two. Every old value is read then, so `jit` keeps each donated scalar's buffer
    for its new value. Weakly typed leaves stay out, since their bits come back strong, and so
    do PRNG keys. Other platforms gain nothing from it and compile it: there `tree` comes back
    as it is.
    """
    leaves, structure = jax.tree.flatten(tree)
    scalars = [index for index, leaf in enumerate(leaves) if _is_read_together(leaf)]
    if len(scalars) < 2:
        return tree
    # Only the scalars go through the choice: its branches are traced for every leaf given.
    read = chosen(form, _read_together, lambda given: given, [leaves[i] for i in scalars])
    for index, leaf in zip(scalars, read, strict=True):
        leaves[index] = leaf
    return jax.tree.unflatten(structure, leaves)


def _is_read_together(leaf: Any) -> bool:
    aval = jax.typeof(leaf) if isinstance(leaf, jax.Array) else None
    return (
        aval is not None
        and aval.ndim == 0
        and (aval.dtype.itemsize == 4 or aval.dtype == np.bool_)
        and not jnp.issubdtype(aval.dtype, jax.dtypes.extended)  # a PRNG key
        and not aval.weak_type
    )


def _read_together(scalars: list[jax.Array]) -> list[jax.Array]:
    groups: dict[Any, list[int]] = {}  # by the mapped axes a value varies over (shard_map)
    for index, scalar in enumerate(scalars):
        groups.setdefault(varying_axes(scalar), []).append(index)
    read = list(scalars)
    for group in groups.values():
        if len(group) < 2:
            continue
        bits = jax.lax.optimization_barrier(
            jax.lax.concatenate([_as_bits(scalars[i]).reshape(1) for i in group], 0)
        )
        for position, index in enumerate(group):
            value = jax.lax.index_in_dim(bits, position, keepdims=False)
            value = jax.lax.max(value, jax.lax.shift_right_logical(value, np.uint32(1)))
            read[index] = _from_bits(value, scalars[index].dtype)
    return read


def _as_bits(scalar: jax.Array) -> jax.Array:
    if scalar.dtype == np.bool_:
        return jax.lax.convert_element_type(scalar, np.uint32)
    return jax.lax.bitcast_convert_type(scalar, np.uint32)


def _from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
    if dtype == np.bool_:
        return jax.lax.ne(bits, np.uint32(0))
    return jax.lax.bitcast_convert_type(bits, dtype)
