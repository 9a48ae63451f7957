"""Rounding float32 values to bfloat16 or float16: stochastically, to nearest with the
remainder kept, and the float32 update that lands a weight on the value chosen.

The rounding is written out in integer and float32 operations rather than left to casts:
XLA may drop a float32 -> bfloat16 -> float32 pair of casts and keep the float32 value (its
GPU compiler does, with `xla_allow_excess_precision` on by default). A rounded value is
kept as the float32 it equals until it is stored: XLA:CPU counts a cast between float32 and
bfloat16 as expensive and writes one that several operations read out to memory, which
splits a remedy's update into several passes and copies of the donated buffers.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_lossscale._axes import varying_axes
from jax_lossscale._checks import describe, describe_array

_BF16 = jnp.dtype(jnp.bfloat16)
_TWO_TO_32 = float(2**32)
_MAGNITUDE = np.uint32(0x7FFFFFFF)
_INFINITY = np.uint32(0x7F800000)
_UPPER_HALF = np.uint32(0xFFFF0000)


def widened(x: jax.Array) -> jax.Array:
    """`x` as float32: a weight, buffer or update, exactly where it is bfloat16 or float16."""
    return jnp.asarray(x).astype(jnp.float32)


def _pattern(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def _value(pattern: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(pattern, jnp.float32)


def add_in_float32(
    param: jax.Array, low: jax.Array, update: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The float32 sum `(param, low) + update` and the bfloat16 nearest to it (as float32).

    `param`'s 16 bits followed by `low` as an offset of the bit pattern are the float32
    value x they were cut from; x + update is rounded to the nearest bfloat16 with ties
    away from zero (a carry of half a gap), so that the pattern offset `low_bits` leaves
    lies in [-2**15, 2**15) and fits int16 exactly. A weight that is zero keeps no negative
    offset (it was set from outside: zero is where the offset from a rounding is
    non-negative), and a non-finite weight adds none.
    """
    high = _pattern(widened(param))
    offset = low.astype(jnp.int32)
    magnitude = high & _MAGNITUDE
    kept = (magnitude < _INFINITY) & ((offset >= 0) | (magnitude != 0))
    total = _value(high + lax.bitcast_convert_type(jnp.where(kept, offset, 0), jnp.uint32))
    total = total + update
    return total, _value(bfloat16_pattern(total, np.uint32(0x8000)))


def low_bits(total: jax.Array, weight: jax.Array) -> jax.Array:
    """The int16 offset of `total`'s float32 pattern from the bfloat16 value `weight`'s (a
    float32), none where either is not finite. Clipped to int16: only a weight that is not
    `total` rounded (one that a bfloat16 update moved by about its own size, see
    `narrowed`) can be further."""
    kept = lax.bitcast_convert_type(_pattern(total) - _pattern(weight), jnp.int32)
    kept = jnp.where(jnp.isfinite(weight) & jnp.isfinite(total), kept, 0)
    return jnp.clip(kept, -(2**15), 2**15 - 1).astype(jnp.int16)


def add_compensated(
    param: jax.Array, buffer: jax.Array, update: jax.Array, dtype: Any
) -> tuple[jax.Array, jax.Array]:
    """The float32 sum param + (update + buffer) and the value of `dtype` nearest to it (as
    float32). An empty buffer (zero) adds nothing, not even a sign: a -0.0 update keeps a
    -0.0 weight as `optax.apply_updates` does."""
    compensation = widened(buffer)
    corrected = jnp.where(compensation == 0, update, update + compensation)
    total = widened(param) + corrected
    return total, round_to_nearest(total, dtype)


def saturated(rounded: jax.Array, total: jax.Array, dtype: Any) -> jax.Array:
    """`rounded` (a float32 value of `dtype`), but the largest finite value of `dtype`, with
    `total`'s sign, where the float32 `total` is finite and `rounded` is not: a sum past the
    dtype's range (by less than float32's) leaves the weight finite and the rest to the
    buffer."""
    largest = float(jnp.finfo(dtype).max)
    overflowed = jnp.isfinite(total) & ~jnp.isfinite(rounded)
    return jnp.where(overflowed, jnp.where(total < 0, -largest, largest), rounded)


def dropped(total: jax.Array, weight: jax.Array, dtype: Any) -> jax.Array:
    """What `weight` (float32) lacks of the float32 `total`, in `dtype`; nothing where it is
    not finite."""
    return jnp.where(jnp.isfinite(weight), total - weight, 0.0).astype(dtype)


def round_stochastically(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """The float32 array `x` rounded stochastically to bfloat16 or float16 with `key`, as
    the float32 values chosen."""
    bits = uniform_bits(key, jnp.shape(x))
    if jnp.dtype(dtype) == _BF16:
        return _value(bfloat16_pattern(x, bits >> np.uint32(16)))
    return round_float16(x, bits)


def uniform_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A uint32 array of `shape`, each entry uniform on [0, 2**32) and independent of the
    same entry's draws under other keys: a bijective integer hash of the entry's position
    plus one 32-bit word drawn from `key`.

    A hash of a uniform word is uniform, so each entry's draw is exactly uniform and a new
    key gives it a new, independent one; entries of one draw share the word and are mixed
    by the hash (xor-shifts and multiplications by odd constants, each a bijection of
    32-bit words). It costs a few integer operations an entry, where drawing every entry
    from the key (threefry) costs about a hundred.
    """
    word = jax.random.bits(key, (), jnp.uint32)
    position = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        position = position + lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(
            stride % 2**32
        )
        stride *= shape[axis]
    mixed = position + word
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        mixed = (mixed ^ (mixed >> np.uint32(shift))) * np.uint32(multiplier)
    return mixed ^ (mixed >> np.uint32(16))


def bfloat16_pattern(x: jax.Array, bits: jax.Array | np.uint32) -> jax.Array:
    """The float32 pattern of `x` (float32) cut to bfloat16, up in magnitude where `bits`
    (below 2**16, uint32) carry into bit 16.

    bfloat16 is float32 cut to its upper 16 bits, and the bit patterns of float32 count
    up with the magnitude, subnormals and powers of two included. Adding a uniform 16-bit
    integer r to the pattern and cutting carries the magnitude up exactly when r >= 2**16
    minus the 16 dropped bits: with probability (dropped bits) / 2**16, the distance
    from the neighbour toward zero over the gap, for either sign. The largest finite
    magnitude carries into the pattern of infinity; NaN stays NaN (quiet, its sign and
    upper payload kept).
    """
    pattern = _pattern(x)
    nan = (pattern & _MAGNITUDE) > _INFINITY
    carried = jnp.where(nan, pattern | np.uint32(0x00400000), pattern + bits)
    return carried & _UPPER_HALF


def round_float16(x: jax.Array, bits: jax.Array) -> jax.Array:
    """`x` (float32) to a float16 value (as float32), up in magnitude where `bits` (uint32)
    fall below the remainder.

    With g the float16 gap at |x| (2**-24 through the subnormals), |x| / g = n + f with n
    an integer and f in [0, 1), both exact in float32. The magnitude becomes (n + 1) * g
    when a uniform 32-bit r < ceil(f * 2**32): exactly probability f wherever f is a
    multiple of 2**-32, which is every float32 with |x| >= 2**-33; below that (9 binades
    under the smallest float16) the probability is f rounded up to a multiple of 2**-32.
    A magnitude past float16's largest (65504) becomes infinity; infinities and NaN are
    kept.
    """
    magnitude = jnp.abs(x)
    gap, inverse_gap = _float16_gap(magnitude)
    scaled = magnitude * inverse_gap
    whole = jnp.floor(scaled)
    threshold = jnp.ceil((scaled - whole) * _TWO_TO_32).astype(jnp.uint32)
    up = (bits < threshold).astype(jnp.float32)
    return _float16_signed((whole + up) * gap, x)


def round_to_nearest(x: jax.Array, dtype: Any) -> jax.Array:
    """The float32 `x` rounded to the nearest bfloat16 or float16 value, ties to even, in float32.

    The rounding is written out in float32 rather than left to a cast and back: XLA may
    drop a float32 -> bfloat16 -> float32 pair of casts and keep the float32 value (its GPU
    compiler does, with `xla_allow_excess_precision` on by default), which would leave
    nothing for the compensation to keep. The result is a value of `dtype` (infinity past
    its largest finite value), so casting it to `dtype` is exact, kept or dropped.
    """
    if jnp.dtype(dtype) == _BF16:
        # Carrying 2**15 - 1 into the 16 dropped bits, plus their neighbour's last bit, carries
        # exactly past half a gap, and at half a gap toward the even neighbour.
        tie_to_even = (_pattern(x) >> np.uint32(16)) & np.uint32(1)
        return _value(bfloat16_pattern(x, np.uint32(0x7FFF) + tie_to_even))
    gap, inverse_gap = _float16_gap(jnp.abs(x))
    return _float16_signed(jnp.round(jnp.abs(x) * inverse_gap) * gap, x)  # ties to even


def _float16_signed(magnitude: jax.Array, x: jax.Array) -> jax.Array:
    """A rounded float16 `magnitude` (float32) with `x`'s sign: infinity past float16's
    largest value, and `x` itself where it is not finite."""
    magnitude = jnp.where(magnitude > float(jnp.finfo(jnp.float16).max), jnp.inf, magnitude)
    return jnp.where(jnp.isfinite(x), jnp.copysign(magnitude, x), x)


def _float16_gap(magnitude: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The gap between float16 values at `magnitude` (float32; 2**-24 through the
    subnormals) and its inverse, both powers of two."""
    exponent = (lax.bitcast_convert_type(magnitude, jnp.int32) >> 23) - 127
    gap_exponent = jnp.maximum(exponent, -14) - 10  # -24 ... 117
    gap = lax.bitcast_convert_type((gap_exponent + 127) << 23, jnp.float32)
    inverse_gap = lax.bitcast_convert_type((127 - gap_exponent) << 23, jnp.float32)
    return gap, inverse_gap


def update_to(rounded: jax.Array, param: jax.Array, dtype: Any) -> jax.Array:
    """An update u of `dtype` with `param + u` cast to `param`'s dtype equal to `rounded` (a
    float32 value of that dtype).

    `rounded - param` is exact in float32 for two bfloat16 or float16 values near each
    other, and the sum lands on `rounded`. Where they are the same bits (an infinity kept,
    a weight unchanged) or both NaN, -0.0 keeps the weight as it is, its sign of zero
    included. In a `dtype` narrower than float32 the difference is exact unless it is about
    as large as the weight (a step across zero, or by the weight's own size); `narrowed`
    tells where such an update lands.
    """
    return _difference(rounded, widened(param)).astype(dtype)


def narrowed(rounded: jax.Array, param: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """`update_to(rounded, param, dtype)` and the weight `optax.apply_updates` makes of it,
    as float32: `rounded` for a float32 (or wider) update, else the sum rounded to nearest
    in `param`'s dtype, as the cast in `optax.apply_updates` rounds it."""
    # Cast once, where XLA:CPU keeps the cast value in memory for all that read it, rather
    # than recompute the rounding in each.
    rounded = widened(rounded.astype(param.dtype))
    old = widened(param)
    difference = _difference(rounded, old)
    dtype = jnp.dtype(dtype)
    if dtype.itemsize >= 4:
        return difference.astype(dtype), rounded
    if dtype in (_BF16, jnp.dtype(jnp.float16)):
        step = round_to_nearest(difference, dtype)
    else:
        step = widened(difference.astype(dtype))
    return step.astype(dtype), round_to_nearest(old + step, param.dtype)


def _difference(rounded: jax.Array, old: jax.Array) -> jax.Array:
    same = (_pattern(rounded) == _pattern(old)) | (jnp.isnan(rounded) & jnp.isnan(old))
    return jnp.where(same, jnp.float32(-0.0), rounded - old)


def checked_key(key: Any, owner: str) -> tuple[jax.Array, Any]:
    """The key's data (uint32) and its implementation, or an error naming `key`."""
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(
                f"{owner}(key=<{describe_array(key)}>): key must be a single PRNG key, got "
                f"a key array of shape {key.shape}; split keys give one each to several "
                "transformations"
            )
        return jax.random.key_data(key), jax.random.key_impl(key)
    if isinstance(key, jax.Array | np.ndarray) and key.dtype == jnp.uint32:
        try:
            typed = jax.random.wrap_key_data(jnp.asarray(key))
        except (TypeError, ValueError):
            typed = None
        if typed is not None and typed.shape == ():
            return jax.random.key_data(typed), jax.random.key_impl(typed)
    raise TypeError(
        f"{owner}(key={describe(key)}): key must be a PRNG key such as jax.random.key(0), "
        f"got {describe_array(key)}"
    )


def on_this_shard(key: jax.Array, value: jax.Array) -> jax.Array:
    """`key` folded with the device's position along each mesh axis that `value` varies
    over under `shard_map` (its shard of a sharded leaf); `key` itself elsewhere."""
    for axis in sorted(varying_axes(value), key=str):
        key = jax.random.fold_in(key, lax.axis_index(axis))
    return key


def dtype_counts(arrays: Any) -> dict[str, jax.Array]:
    """How many of `arrays` (a pytree) each dtype holds, by name, as int32 scalars: a state
    field that puts its buffers' dtypes into its structure, so that orbax refuses to restore
    a checkpoint into a state of other dtypes ("Structure mismatch") rather than cast it."""
    counts: dict[str, int] = {}
    for array in jax.tree.leaves(arrays):
        counts[array.dtype.name] = counts.get(array.dtype.name, 0) + 1
    return {name: jnp.array(count, jnp.int32) for name, count in sorted(counts.items())}
