"""Low-precision weights without a float32 copy: `stochastic_rounding` and `kahan_summation`.

Both are optax transformations for the end of a chain. For each leaf of a floating dtype
narrower than float32 (bfloat16, float16) they take the new weight `params + u` in float32
(u the inner updates) and choose the low-precision value it becomes: a stochastic rounding,
or the nearest value plus a buffer that keeps what the rounding dropped. Their updates are
the difference from the old weight, written in float32, so that `optax.apply_updates`
lands on the chosen value exactly. Wider floating leaves and non-floating leaves pass
through as the inner updates.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jax_lossscale._checks import describe, describe_array, is_at_least_float32, path_name
from jax_lossscale._policy import floating_dtype

_BF16 = jnp.dtype(jnp.bfloat16)
_F16 = jnp.dtype(jnp.float16)
_ROUNDED = (_BF16, _F16)
_TWO_TO_32 = float(2**32)


class StochasticRoundingState(NamedTuple):
    """The state of `stochastic_rounding`: the data of the PRNG key of the next step."""

    key: jax.Array  # uint32, `jax.random.key_data` of a key


class KahanSummationState(NamedTuple):
    """The state of `kahan_summation`: a compensation buffer per low-precision leaf.

    `compensation` mirrors the params: an array of the compensation dtype where the leaf
    is bfloat16 or float16, None elsewhere.
    """

    compensation: optax.Params


def stochastic_rounding(key: jax.Array) -> optax.GradientTransformationExtraArgs:
    """Rounds each new bfloat16 or float16 weight stochastically: unbiased, no float32 copy.

    Put it last in the chain (the chain given to `loss_scaled`, or a plain one). For each
    leaf of dtype bfloat16 or float16, `optax.apply_updates(params, updates)` gives
    `params + u` (u the inner updates, summed in float32) rounded to the leaf's dtype
    stochastically: to the upper neighbour with probability (x - lower) / (upper - lower),
    exactly, so that the mean of the rounding is x. An update far below half a unit in the
    last place of the weight then moves it in expectation instead of being lost. Infinities
    and NaN come through as they are; a sum beyond the largest finite value rounds to
    infinity as if the next value up existed (2**128 for bfloat16, 65536 for float16).
    Other leaves pass through as the inner updates.

    The state holds the key; each step splits it and draws the bits of each leaf from its
    own key, the same on every device, so replicated params under `pmap` or `shard_map`
    round alike, and a sharded leaf under SPMD `jit` rounds as the unsharded leaf would. A
    step that `loss_scaled` skips does not reach it and consumes no randomness.

    Args:
      key: a PRNG key, `jax.random.key(seed)` (or a legacy `jax.random.PRNGKey(seed)`).
        A key made with `impl="rbg"` draws its bits faster on a GPU.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `StochasticRoundingState`. Its `update` needs `params`.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> params = jnp.ones(10000, jnp.bfloat16)
      >>> tx = jls.stochastic_rounding(jax.random.key(0))
      >>> opt_state = tx.init(params)
      >>> updates, opt_state = tx.update(jnp.full(10000, -1e-3), opt_state, params)
      >>> new_params = optax.apply_updates(params, updates)
      >>> sorted(set(new_params.tolist()))  # the two neighbours of 0.999
      [0.99609375, 1.0]
      >>> round(float(jnp.mean(new_params.astype(jnp.float32))), 4)
      0.999
      >>> optax.apply_updates(params, jnp.full(10000, -1e-3))[0]  # rounded to nearest: lost
      Array(1, dtype=bfloat16)
    """
    key_data, impl = _checked_key(key)

    def init_fn(params: optax.Params) -> StochasticRoundingState:
        del params
        return StochasticRoundingState(key_data)

    def update_fn(
        updates: optax.Updates,
        state: StochasticRoundingState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, StochasticRoundingState]:
        del extra_args
        _check_params(params, "stochastic_rounding")
        _check_state(state, StochasticRoundingState, "stochastic_rounding")
        next_key, step_key = jax.random.split(jax.random.wrap_key_data(state.key, impl=impl))
        flat_params, treedef = jax.tree_util.tree_flatten_with_path(params)
        flat_updates = _updates_like(treedef, updates, "stochastic_rounding")
        new_updates = []
        for index, ((path, param), update) in enumerate(
            zip(flat_params, flat_updates, strict=True)
        ):
            dtype = _rounded_dtype(param, path, "stochastic_rounding")
            if dtype is None:
                new_updates.append(update)
                continue
            total = _float32(param) + _float32(update)
            rounded = round_stochastically(total, dtype, jax.random.fold_in(step_key, index))
            new_updates.append(_difference(rounded, param))
        return (
            jax.tree_util.tree_unflatten(treedef, new_updates),
            StochasticRoundingState(jax.random.key_data(next_key)),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def kahan_summation(compensation_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
    """Keeps what rounding a bfloat16 or float16 weight dropped, and adds it back next step.

    Put it last in the chain (the chain given to `loss_scaled`, or a plain one). For each
    leaf of dtype bfloat16 or float16 it holds a compensation buffer c: the new weight is
    `params + (u + c)` (u the inner updates, summed in float32) rounded to the nearest value
    of the leaf's dtype, and c becomes what that rounding dropped. The weights then follow
    the float32 sum of the updates to within the rounding of the buffer, deterministically,
    for the memory of the buffer (2 bytes a parameter in bfloat16). Other leaves pass
    through as the inner updates and have no buffer. A step that `loss_scaled` skips leaves
    the buffer as it was, bit for bit.

    Args:
      compensation_dtype: the buffer's floating dtype; None (the default) is each leaf's
        own dtype. `jnp.float32` makes weight plus buffer a float32 value.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `KahanSummationState`.
      Its `update` needs `params`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> params = jnp.ones(3, jnp.bfloat16)
      >>> tx = jls.kahan_summation()
      >>> opt_state = tx.init(params)
      >>> for _ in range(1000):
      ...     updates, opt_state = tx.update(jnp.full(3, -1e-4), opt_state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params
      Array([0.902344, 0.902344, 0.902344], dtype=bfloat16)
      >>> optax.apply_updates(jnp.ones(3, jnp.bfloat16), jnp.full(3, -1e-4))  # nearest: lost
      Array([1, 1, 1], dtype=bfloat16)
    """
    buffer_dtype = (
        None
        if compensation_dtype is None
        else floating_dtype(compensation_dtype, "kahan_summation", "compensation_dtype")
    )

    def init_fn(params: optax.Params) -> KahanSummationState:
        def buffer(path: Any, param: Any) -> jax.Array | None:
            dtype = _rounded_dtype(param, path, "kahan_summation")
            if dtype is None:
                return None
            return jnp.zeros(jnp.shape(param), buffer_dtype or dtype)

        return KahanSummationState(jax.tree_util.tree_map_with_path(buffer, params))

    def update_fn(
        updates: optax.Updates,
        state: KahanSummationState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, KahanSummationState]:
        del extra_args
        _check_params(params, "kahan_summation")
        _check_state(state, KahanSummationState, "kahan_summation")
        flat_params, treedef = jax.tree_util.tree_flatten_with_path(params)
        flat_updates = _updates_like(treedef, updates, "kahan_summation")
        structure: Any = treedef
        try:
            flat_buffers = structure.flatten_up_to(state.compensation)
        except (ValueError, TypeError) as error:
            raise ValueError(
                "kahan_summation.update: the state's compensation buffers do not match the "
                f"params' structure; was the state made by tx.init(params)? ({error})"
            ) from None
        new_updates: list[Any] = []
        new_buffers: list[Any] = []
        for (path, param), update, buffer in zip(
            flat_params, flat_updates, flat_buffers, strict=True
        ):
            dtype = _rounded_dtype(param, path, "kahan_summation")
            if dtype is None:
                new_updates.append(update)
                new_buffers.append(None)
                continue
            total = _float32(param) + (_float32(update) + _float32(buffer))
            nearest = round_to_nearest(total, dtype)
            kept = jnp.where(jnp.isfinite(nearest), total - nearest, 0.0)
            new_updates.append(_difference(nearest.astype(dtype), param))
            new_buffers.append(kept.astype(buffer.dtype))
        return (
            jax.tree_util.tree_unflatten(treedef, new_updates),
            KahanSummationState(jax.tree_util.tree_unflatten(treedef, new_buffers)),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


# --- the rounding ---------------------------------------------------------------------------


def round_stochastically(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """The float32 array `x` rounded stochastically to bfloat16 or float16 with `key`."""
    dtype = jnp.dtype(dtype)
    if dtype == _BF16:
        bits = jax.random.bits(key, jnp.shape(x), jnp.uint16)
        return round_bfloat16(x, bits)
    bits = jax.random.bits(key, jnp.shape(x), jnp.uint32)
    return round_float16(x, bits)


def round_bfloat16(x: jax.Array, bits: jax.Array) -> jax.Array:
    """`x` (float32) to bfloat16, up in magnitude where `bits` (uint16) carry into bit 16.

    bfloat16 is float32 cut to its upper 16 bits, and the bit patterns of float32 count
    up with the magnitude, subnormals and powers of two included. Adding a uniform 16-bit
    integer r to the pattern and cutting carries the magnitude up exactly when r >= 2**16
    minus the 16 dropped bits: with probability (dropped bits) / 2**16, the distance
    from the neighbour toward zero over the gap, for either sign. The largest finite
    magnitude carries into the pattern of infinity; NaN is kept as it is.
    """
    pattern = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    carried = pattern + bits.astype(jnp.uint32)
    upper = (carried >> 16).astype(jnp.uint16)
    rounded = lax.bitcast_convert_type(upper, jnp.bfloat16)
    return jnp.where(jnp.isnan(x), x.astype(jnp.bfloat16), rounded)


def round_float16(x: jax.Array, bits: jax.Array) -> jax.Array:
    """`x` (float32) to float16, up in magnitude where `bits` (uint32) fall below the remainder.

    With g the float16 gap at |x| (2**-24 through the subnormals), |x| / g = n + f with n
    an integer and f in [0, 1), both exact in float32. The magnitude becomes (n + 1) * g
    when a uniform 32-bit r < ceil(f * 2**32): exactly probability f wherever f is a
    multiple of 2**-32, which is every float32 with |x| >= 2**-33; below that (9 binades
    under the smallest float16) the probability is f rounded up to a multiple of 2**-32.
    A magnitude of 65536 or more becomes infinity; infinities and NaN are kept.
    """
    x = x.astype(jnp.float32)
    magnitude = jnp.abs(x)
    gap, inverse_gap = _float16_gap(magnitude)
    scaled = magnitude * inverse_gap
    whole = jnp.floor(scaled)
    threshold = jnp.ceil((scaled - whole) * _TWO_TO_32).astype(jnp.uint32)
    up = (bits.astype(jnp.uint32) < threshold).astype(jnp.float32)
    rounded = jnp.copysign((whole + up) * gap, x).astype(jnp.float16)
    return jnp.where(jnp.isfinite(x), rounded, x.astype(jnp.float16))


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
        tie_to_even = (lax.bitcast_convert_type(x, jnp.uint32) >> 16) & jnp.uint32(1)
        bits = (jnp.uint32(0x7FFF) + tie_to_even).astype(jnp.uint16)
        return round_bfloat16(x, bits).astype(jnp.float32)
    gap, inverse_gap = _float16_gap(jnp.abs(x))
    nearest = jnp.round(jnp.abs(x) * inverse_gap) * gap  # jnp.round: ties to even
    largest = float(jnp.finfo(jnp.float16).max)
    nearest = jnp.where(nearest > largest, jnp.inf, nearest)
    return jnp.where(jnp.isfinite(x), jnp.copysign(nearest, x), x)


def _float16_gap(magnitude: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The gap between float16 values at `magnitude` (float32; 2**-24 through the
    subnormals) and its inverse, both powers of two."""
    exponent = (lax.bitcast_convert_type(magnitude, jnp.int32) >> 23) - 127
    gap_exponent = jnp.maximum(exponent, -14) - 10  # -24 ... 117
    gap = lax.bitcast_convert_type((gap_exponent + 127) << 23, jnp.float32)
    inverse_gap = lax.bitcast_convert_type((127 - gap_exponent) << 23, jnp.float32)
    return gap, inverse_gap


def _difference(rounded: jax.Array, param: jax.Array) -> jax.Array:
    """A float32 update u with `param + u` cast to `param`'s dtype equal to `rounded`.

    `rounded - param` is exact in float32 for two bfloat16 or float16 values near each
    other, and the sum lands on `rounded`. Where they are the same bits (an infinity kept,
    a weight unchanged), -0.0 keeps the weight as it is, its sign of zero included.
    """
    new, old = rounded.astype(jnp.float32), param.astype(jnp.float32)
    width = {1: jnp.uint8, 2: jnp.uint16}[rounded.dtype.itemsize]
    same = lax.bitcast_convert_type(rounded, width) == lax.bitcast_convert_type(
        param.astype(rounded.dtype), width
    )
    return jnp.where(same, jnp.float32(-0.0), new - old)


# --- checks ---------------------------------------------------------------------------------


def _checked_key(key: Any) -> tuple[jax.Array, Any]:
    """The key's data (uint32) and its implementation, or an error naming `key`."""
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(
                f"stochastic_rounding(key={describe(key)}): key must be a single PRNG key, "
                f"got a key array of shape {key.shape}"
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
        f"stochastic_rounding(key={describe(key)}): key must be a PRNG key such as "
        f"jax.random.key(0), got {describe_array(key)}"
    )


def _check_params(params: Any, owner: str) -> None:
    if params is None:
        raise ValueError(
            f"{owner}.update: params are required, as in tx.update(grads, opt_state, params); "
            "the new weights are rounded from params + updates"
        )


def _check_state(state: Any, kind: type, owner: str) -> None:
    if not isinstance(state, kind):
        raise TypeError(
            f"{owner}.update: the state must be the {kind.__name__} that {owner}'s init "
            f"made, got {type(state).__name__}"
        )


def _updates_like(treedef: Any, updates: Any, owner: str) -> list[Any]:
    try:
        flat: list[Any] = treedef.flatten_up_to(updates)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{owner}.update: the updates do not have the params' structure ({error})"
        ) from None
    return flat


def _rounded_dtype(param: Any, path: Any, owner: str) -> np.dtype[Any] | None:
    """bfloat16 or float16 where `param` is such an array; None for a leaf passed through."""
    given = getattr(param, "dtype", None)
    if given is None or not jnp.issubdtype(given, jnp.floating):
        return None
    dtype: np.dtype[Any] = np.dtype(given)
    if dtype in _ROUNDED:
        return dtype
    if not is_at_least_float32(dtype):
        raise TypeError(
            f"{owner}: the param {path_name(path)} is of dtype {dtype}; only bfloat16 and "
            "float16 weights are rounded here (and float32 or wider pass through)"
        )
    return None


def _float32(value: Any) -> jax.Array:
    return jnp.asarray(value).astype(jnp.float32)
