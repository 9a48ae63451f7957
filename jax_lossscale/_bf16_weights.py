"""Low-precision weights without a float32 copy: `stochastic_rounding` and `kahan_summation`.

Both are optax transformations for the end of a chain. For each leaf of a floating dtype
narrower than float32 (bfloat16, float16) they take the new weight `params + u` in float32
(u the inner updates) and choose the low-precision value it becomes: a stochastic rounding,
or the nearest value plus a buffer that keeps what the rounding dropped. Their updates are
the difference from the old weight, in the inner updates' dtype (what `optax.apply_if_finite`
gives on a skip), so that `optax.apply_updates` lands on the chosen value. Wider floating
leaves and non-floating leaves pass through as the inner updates.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale._checks import describe, describe_array, is_at_least_float32, path_name
from jax_lossscale._policy import floating_dtype
from jax_lossscale._rounding import (
    add_compensated,
    add_in_float32,
    checked_key,
    dropped,
    dtype_counts,
    low_bits,
    narrowed,
    on_this_shard,
    round_stochastically,
    saturated,
    update_to,
    widened,
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

    Both fields mirror the params, None where a leaf has no buffer of that kind.
    `low_bits`: by default, for a bfloat16 leaf, an int16 array of the 16 bits the float32
    sum has below the weight (the weight and it together are that float32 value).
    `compensation`: what the rounding dropped, as a float32 array for a float16 leaf by
    default, or for every leaf as an array of the `compensation_dtype` given.
    `stored_in`: how many buffers each dtype holds, by name (`{"int16": 1}`). The kinds,
    and the dtypes, are part of the structure, so that a checkpoint restored into a target
    of another kind or buffer dtype is an orbax "Structure mismatch" error rather than cast.
    """

    stored_in: dict[str, jax.Array]
    low_bits: optax.Params
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
    Other leaves pass through as the inner updates. The updates keep the inner updates'
    dtype (bfloat16 for bfloat16 gradients, as `optax.apply_if_finite` needs); a bfloat16
    update lands exactly unless it moves the weight by about its own size or across zero,
    where it lands within half a gap of the update. Apply the updates with
    `optax.apply_updates`: a weight it rounded that comes back in another dtype (float32
    after `eqx.apply_updates`) is an error.

    The state holds the key; each step splits it and draws one 32-bit word for each leaf
    from its own key, which a hash of each entry's position turns into the entry's bits
    (16 for bfloat16, 32 for float16), the same on every device, so
    replicated params under `pmap` or `shard_map` round alike, and a sharded leaf under SPMD
    `jit` rounds as the unsharded leaf would. Under `shard_map`, a leaf that varies over
    mesh axes (a shard of a weight: its `in_specs` name them) also folds the device's
    position along those axes into its bits, so that the shards round independently. A step
    that `loss_scaled` skips does not reach it and consumes no randomness.

    Args:
      key: a PRNG key, `jax.random.key(seed)` (or a legacy `jax.random.PRNGKey(seed)`).
        The bits depend on the key and the leaf's position in the params only: two
        transformations given the same key (the groups of an `optax.multi_transform`,
        say) round the leaves at the same positions with the same bits. Give each its own key
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
    key_data, impl = checked_key(key, "stochastic_rounding")

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
            total = widened(param) + widened(update)
            leaf_key = on_this_shard(jax.random.fold_in(step_key, index), total)
            rounded = round_stochastically(total, dtype, leaf_key)
            new_updates.append(update_to(rounded, param, _update_dtype(update)))
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
    `loss_scaled` skips leaves the buffer as it was, bit for bit. The updates keep the inner
    updates' dtype, and the buffer is reckoned from the weight they land on (a bfloat16
    update that moves a weight by about its own size or across zero can miss the rounded
    sum; a default buffer then keeps at most 2**15 of the pattern). Apply the updates with
    `optax.apply_updates`: a weight with a buffer that comes back in another dtype (float32
    after `eqx.apply_updates`) is an error.

    By default a bfloat16 weight's buffer (the state's `low_bits`) is an int16 array of the
    16 bits that float32 has below bfloat16 (2 bytes a parameter): weight and buffer
    together are the float32 sum of the updates, bit for bit, however small each update is;
    the weight is that sum rounded to nearest (ties away from zero). A float16 weight's
    buffer is float32 (4 bytes), and weight plus buffer follow the float32 sum to within
    float32 rounding. A finite sum past the dtype's largest value (for bfloat16, within
    float32's range: above 3.3961e38) leaves the weight at that value, not infinite, and the
    rest in the buffer (a default buffer keeps up to half a gap of it), so the weight comes
    back as the sum does.

    A buffer of bfloat16 (or float16) keeps only updates above about half its own spacing:
    smaller ones are lost, as nearest rounding loses them without a buffer, once the
    buffer has grown toward half the weight's gap. For bfloat16 that is an update below
    about 2**-18 of the power of two above the weight (3.8e-6 for weights in [0.5, 1],
    1.2e-7 at 0.02), which the tail of a decaying schedule reaches.

    A checkpoint restores into the same kind of buffer only: orbax refuses `low_bits` saved
    by the default into the `compensation` of a `compensation_dtype` (and the other way)
    with a "Structure mismatch" error, where it would cast the bits into wrong values. To
    change kinds, restore with the transformation that saved, then convert the buffers
    (the page "bfloat16 weights without a float32 copy" shows how).

    Args:
      compensation_dtype: None (the default) for the buffers above; a floating dtype for
        a buffer of that dtype holding what the rounding dropped (`jnp.float32`: 4 bytes a
        parameter, weight plus buffer a float32 value; `jnp.bfloat16`: 2 bytes, with the
        threshold above). A buffer narrower than float32 must be the weight's own dtype:
        init refuses a float16 one for a bfloat16 weight (too small a range) and the other
        way (too few bits).

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
        def buffer(path: Any, param: Any, bits: bool) -> jax.Array | None:
            dtype = _rounded_dtype(param, path, "kahan_summation")
            if dtype is None or bits != (buffer_dtype is None and dtype == _BF16):
                return None
            kind = jnp.int16 if bits else jnp.float32 if buffer_dtype is None else buffer_dtype
            if not bits and kind != dtype and not is_at_least_float32(kind):
                raise ValueError(
                    f"kahan_summation(compensation_dtype={jnp.dtype(kind).name}): a "
                    f"{jnp.dtype(kind).name} buffer cannot hold what rounding the {dtype} "
                    f"param {path_name(path)} drops (its range or precision is too small); "
                    "give the weight's dtype, jnp.float32, or None for the default"
                )
            return jnp.zeros_like(param, kind)  # where the weight is (its sharding)

        bits = jax.tree_util.tree_map_with_path(lambda path, p: buffer(path, p, True), params)
        floats = jax.tree_util.tree_map_with_path(lambda path, p: buffer(path, p, False), params)
        return KahanSummationState(dtype_counts((bits, floats)), bits, floats)

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
        flat_bits = _state_like(treedef, state.low_bits, "kahan_summation", "low_bits")
        flat_floats = _state_like(treedef, state.compensation, "kahan_summation", "compensation")
        new_updates: list[Any] = []
        new_bits: list[Any] = []
        new_floats: list[Any] = []
        for (path, param), update, bits, floats in zip(
            flat_params, flat_updates, flat_bits, flat_floats, strict=True
        ):
            dtype = _rounded_dtype(param, path, "kahan_summation")
            buffer = floats if bits is None else bits
            if (dtype is None) != (buffer is None) or (bits is not None and dtype != _BF16):
                raise TypeError(
                    f"kahan_summation.update: the param {path_name(path)} is of dtype "
                    f"{getattr(param, 'dtype', type(param).__name__)}, and the state "
                    + ("has no buffer for it" if buffer is None else "holds a buffer for it")
                    + f" (made for a {'wider' if buffer is None else 'bfloat16 or float16'} "
                    f"weight); {_APPLY_WITH}. A new model needs a new tx.init(params)"
                )
            if dtype is None:
                new_updates.append(update)
                new_bits.append(None)
                new_floats.append(None)
                continue
            if jnp.shape(buffer) != jnp.shape(param):
                raise ValueError(
                    f"kahan_summation.update: the param {path_name(path)} has shape "
                    f"{jnp.shape(param)}, but the state's buffer for it {jnp.shape(buffer)}; "
                    "a new model needs a new tx.init(params)"
                )
            if bits is not None:
                total, rounded = add_in_float32(param, bits, widened(update))
            else:
                total, rounded = add_compensated(param, floats, widened(update), dtype)
            rounded = saturated(rounded, total, dtype)
            new_update, weight = narrowed(rounded, param, _update_dtype(update))
            new_updates.append(new_update)
            new_bits.append(None if bits is None else low_bits(total, weight))
            new_floats.append(None if floats is None else dropped(total, weight, floats.dtype))
        return (
            jax.tree_util.tree_unflatten(treedef, new_updates),
            state._replace(
                low_bits=jax.tree_util.tree_unflatten(treedef, new_bits),
                compensation=jax.tree_util.tree_unflatten(treedef, new_floats),
            ),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


# --- checks ---------------------------------------------------------------------------------


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
    except (ValueError, TypeError):
        raise ValueError(
            f"{owner}.update: the updates do not have the params' structure: updates "
            f"{_outline(updates)}, params {_outline(treedef)}"
        ) from None
    return flat


def _state_like(treedef: Any, tree: Any, owner: str, field: str) -> list[Any]:
    try:
        flat: list[Any] = treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        raise ValueError(
            f"{owner}.update: the state's {field} does not match the params' structure; was "
            f"the state made by tx.init(params)? {field} {_outline(tree)}, params "
            f"{_outline(treedef)}"
        ) from None
    return flat


def _outline(tree: Any) -> str:
    """A tree (or a treedef) for a message: dtypes and shapes, not values, shortened."""
    if isinstance(tree, jax.tree_util.PyTreeDef):
        return describe(tree, 300)
    shapes = jax.tree.map(lambda leaf: describe_array(leaf), tree)
    return describe(shapes, 300)


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


def _update_dtype(update: Any) -> Any:
    """The dtype of the updates given back for a leaf: the inner update's if floating (what
    `optax.apply_if_finite`'s skip gives), else float32."""
    dtype = jnp.result_type(update)
    return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
