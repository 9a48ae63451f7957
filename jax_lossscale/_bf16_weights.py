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

from jax_lossscale._axes import varying_axes
from jax_lossscale._checks import describe, describe_array, is_at_least_float32, path_name
from jax_lossscale._policy import floating_dtype
from jax_lossscale._rounding import (
    add_compensated,
    add_in_float32,
    round_stochastically,
    update_to,
)

_BF16 = jnp.dtype(jnp.bfloat16)
_F16 = jnp.dtype(jnp.float16)
_ROUNDED = (_BF16, _F16)
_APPLY_WITH = (
    "apply the updates with optax.apply_updates, which keeps each weight's dtype "
    "(eqx.apply_updates, or params + updates, turns bfloat16 and float16 weights float32)"
)


class StochasticRoundingState(NamedTuple):
    """The state of `stochastic_rounding`: the data of the PRNG key of the next step, and
    the dtype each rounded leaf had at init.

    `rounded` mirrors the params: a zero scalar of the leaf's dtype where the leaf is
    bfloat16 or float16 (2 bytes a leaf), None elsewhere.
    """

    key: jax.Array  # uint32, `jax.random.key_data` of a key
    rounded: optax.Params


class KahanSummationState(NamedTuple):
    """The state of `kahan_summation`: a compensation buffer per low-precision leaf.

    `compensation` mirrors the params: an array where the leaf is bfloat16 or float16,
    None elsewhere. By default that is, for a bfloat16 leaf, an int16 array of the 16 bits
    the float32 sum has below the weight (the weight and it together are that float32
    value), and for a float16 leaf a float32 array of what the rounding dropped; with a
    `compensation_dtype`, an array of that dtype holding what the rounding dropped.
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
    Other leaves pass through as the inner updates. Apply the updates with
    `optax.apply_updates`: a weight it rounded that comes back in another dtype (float32
    after `eqx.apply_updates`) is an error.

    The state holds the key; each step splits it and draws the bits of each leaf from its
    own key (16 bits an entry for bfloat16, 32 for float16), the same on every device, so
    replicated params under `pmap` or `shard_map` round alike, and a sharded leaf under SPMD
    `jit` rounds as the unsharded leaf would. Under `shard_map`, a leaf that varies over
    mesh axes (a shard of a weight: its `in_specs` name them) also folds the device's
    position along those axes into its bits, so that the shards round independently. A step
    that `loss_scaled` skips does not reach it and consumes no randomness.

    Args:
      key: a PRNG key, `jax.random.key(seed)` (or a legacy `jax.random.PRNGKey(seed)`).
        A key made with `impl="rbg"` draws its bits faster on a GPU. The bits depend on
        the key and the leaf's position in the params only: two transformations given the
        same key (the groups of an `optax.multi_transform`, say) round the leaves at the
        same positions with the same bits. Give each its own key
        (`jax.random.split(key)`).

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
        def marker(path: Any, param: Any) -> jax.Array | None:
            dtype = _rounded_dtype(param, path, "stochastic_rounding")
            return None if dtype is None else jnp.zeros((), dtype)

        # A copy: a donated state must not take the key this transformation starts from.
        key = jnp.array(key_data, copy=True)
        return StochasticRoundingState(key, jax.tree_util.tree_map_with_path(marker, params))

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
        flat_markers = _state_like(treedef, state.rounded, "stochastic_rounding", "rounded")
        new_updates = []
        for index, ((path, param), update, marker) in enumerate(
            zip(flat_params, flat_updates, flat_markers, strict=True)
        ):
            dtype = _rounded_dtype(param, path, "stochastic_rounding")
            if marker is not None and dtype != marker.dtype:
                raise TypeError(
                    f"stochastic_rounding.update: the param {path_name(path)} is of dtype "
                    f"{getattr(param, 'dtype', type(param).__name__)}, but was {marker.dtype} "
                    f"when the state was made; {_APPLY_WITH}"
                )
            if dtype is None:
                new_updates.append(update)
                continue
            total = _float32(param) + _float32(update)
            leaf_key = _on_this_shard(jax.random.fold_in(step_key, index), total)
            rounded = round_stochastically(total, dtype, leaf_key)
            new_updates.append(update_to(rounded, param))
        return (
            jax.tree_util.tree_unflatten(treedef, new_updates),
            StochasticRoundingState(jax.random.key_data(next_key), state.rounded),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def kahan_summation(compensation_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
    """Keeps what rounding a bfloat16 or float16 weight dropped, and adds it back next step.

    Put it last in the chain (the chain given to `loss_scaled`, or a plain one). For each
    leaf of dtype bfloat16 or float16 it holds a compensation buffer: the new weight is the
    float32 sum of the weight, the inner updates u and what the buffer holds, rounded to
    the nearest value of the leaf's dtype, and the buffer keeps what that rounding dropped.
    Other leaves pass through as the inner updates and have no buffer. A step that
    `loss_scaled` skips leaves the buffer as it was, bit for bit. Apply the updates with
    `optax.apply_updates`: a weight with a buffer that comes back in another dtype (float32
    after `eqx.apply_updates`) is an error.

    By default a bfloat16 weight's buffer is an int16 array of the 16 bits that float32 has
    below bfloat16 (2 bytes a parameter): weight and buffer together are the float32 sum of
    the updates, bit for bit, however small each update is; the weight is that sum rounded
    to nearest (ties away from zero). A float16 weight's buffer is float32 (4 bytes), and
    weight plus buffer follow the float32 sum to within float32 rounding.

    A buffer of bfloat16 (or float16) keeps only updates above about half its own spacing:
    smaller ones are lost, as nearest rounding loses them without a buffer, once the
    buffer has grown toward half the weight's gap. For bfloat16 that is an update below
    about 2**-18 of the power of two above the weight (3.8e-6 for weights in [0.5, 1],
    1.2e-7 at 0.02), which the tail of a decaying schedule reaches.

    Args:
      compensation_dtype: None (the default) for the buffers above; a floating dtype for
        a buffer of that dtype holding what the rounding dropped (`jnp.float32`: 4 bytes a
        parameter, weight plus buffer a float32 value; `jnp.bfloat16`: 2 bytes, with the
        threshold above).

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
      >>> params  # the bfloat16 nearest to 0.9
      Array([0.898438, 0.898438, 0.898438], dtype=bfloat16)
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
            if buffer_dtype is not None:
                return jnp.zeros(jnp.shape(param), buffer_dtype)
            return jnp.zeros(jnp.shape(param), jnp.int16 if dtype == _BF16 else jnp.float32)

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
        flat_buffers = _state_like(treedef, state.compensation, "kahan_summation", "compensation")
        new_updates: list[Any] = []
        new_buffers: list[Any] = []
        for (path, param), update, buffer in zip(
            flat_params, flat_updates, flat_buffers, strict=True
        ):
            dtype = _rounded_dtype(param, path, "kahan_summation")
            if (dtype is None) != (buffer is None) or (
                buffer is not None and buffer.dtype == jnp.int16 and dtype != _BF16
            ):
                raise TypeError(
                    f"kahan_summation.update: the param {path_name(path)} is of dtype "
                    f"{getattr(param, 'dtype', type(param).__name__)}, and the state "
                    + ("has no buffer for it" if buffer is None else "holds a buffer for it")
                    + f" (made for a {'wider' if buffer is None else 'bfloat16 or float16'} "
                    f"weight); {_APPLY_WITH}. A new model needs a new tx.init(params)"
                )
            if dtype is None:
                new_updates.append(update)
                new_buffers.append(None)
                continue
            if buffer.dtype == jnp.int16:
                rounded, kept = add_in_float32(param, buffer, _float32(update))
            else:
                rounded, kept = add_compensated(param, buffer, _float32(update), dtype)
            new_updates.append(update_to(rounded, param))
            new_buffers.append(kept)
        return (
            jax.tree_util.tree_unflatten(treedef, new_updates),
            KahanSummationState(jax.tree_util.tree_unflatten(treedef, new_buffers)),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def _on_this_shard(key: jax.Array, value: jax.Array) -> jax.Array:
    """`key` folded with the device's position along each mesh axis that `value` varies
    over under `shard_map` (its shard of a sharded leaf); `key` itself elsewhere."""
    for axis in sorted(varying_axes(value), key=str):
        key = jax.random.fold_in(key, lax.axis_index(axis))
    return key


# --- checks ---------------------------------------------------------------------------------


def _checked_key(key: Any) -> tuple[jax.Array, Any]:
    """The key's data (uint32) and its implementation, or an error naming `key`."""
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(
                f"stochastic_rounding(key=<{describe_array(key)}>): key must be a single "
                f"PRNG key, got a key array of shape {key.shape}; split keys give one each "
                "to several transformations"
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


def _state_like(treedef: Any, tree: Any, owner: str, field: str) -> list[Any]:
    try:
        flat: list[Any] = treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{owner}.update: the state's {field} does not match the params' structure; was "
            f"the state made by tx.init(params)? ({error})"
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
