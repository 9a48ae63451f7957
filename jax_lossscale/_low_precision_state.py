"""Optimizer state in low precision: `low_precision_state` wraps any optax transformation.

The wrapped state's floating leaves are stored in a narrower dtype between steps, widened to
float32 for the inner update, and rounded back: stochastically (unbiased, so that increments
below half a gap, such as adam's `(1 - b2) * g**2`, are kept in expectation) or to nearest.
"""

import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale._checks import checked_transformation, describe, is_array, path_name
from jax_lossscale._rounding import (
    checked_key,
    on_this_shard,
    round_stochastically,
    round_to_nearest,
)

_OWNER = "low_precision_state"
_STORED = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
_ROUNDINGS = ("stochastic", "nearest")


class LowPrecisionState(NamedTuple):
    """The state of `low_precision_state`: how many leaves each chosen dtype holds, by name
    (`{"bfloat16": 2}` for adam's moments), the data of the PRNG key of the next step, and
    the inner transformation's state, its floating leaves in the dtypes chosen at init.

    The dtypes' names are part of the state's structure, so that orbax refuses to restore a
    checkpoint into a state of other dtypes (a "Structure mismatch" naming `stored_in`)
    rather than cast it; the bfloat16-weights page shows how to change a run's state dtype.
    Where one dtype does not hold every floating leaf (a function chose two, or kept some
    leaves as inner made them), each name is followed by a fingerprint of its leaves'
    positions (`"float16_at_5d7a1c0e"`): a checkpoint whose leaves had other dtypes, two
    of them swapped, is refused too.
    """

    stored_in: dict[str, jax.Array]  # int32 scalars: leaves stored in each dtype
    key: jax.Array  # uint32, `jax.random.key_data` of a key
    inner_state: optax.OptState


def low_precision_state(
    inner: optax.GradientTransformation,
    dtype: Any = jnp.bfloat16,
    *,
    key: jax.Array | None = None,
    rounding: str = "stochastic",
) -> optax.GradientTransformationExtraArgs:
    """Stores `inner`'s floating state in `dtype` between steps, updated in float32.

    At init, each floating leaf of `inner.init(params)` is rounded to nearest in its chosen
    dtype; integer leaves (step counts) are kept as they are, and so are floating scalars
    (the hyperparameters of `optax.inject_hyperparams`) unless `dtype` is a function. Each
    update widens the state's bfloat16 and float16 leaves to float32, runs `inner.update`,
    and rounds each floating leaf of the new state back to the dtype it was stored in. The
    updates come in the dtypes inner gives from the state as stored (bfloat16 for bfloat16
    gradients, as `optax.apply_if_finite` needs; float32 for float32 gradients, weakly typed
    ones too), or, for an inner that cannot update the state as stored (`optax.MultiSteps`),
    as it gives them. `rounding="stochastic"` rounds up with probability
    (x - lower) / (upper - lower), as `stochastic_rounding` does, so that the state follows
    its float32 course in expectation: adam's `nu` under constant gradients of 1e-3
    (b2 = 0.999) reaches 9.98e-7 after 6,000 steps in float32; stored in bfloat16, its mean
    over 256 entries ends within 0.1% of that and each entry within 2.5%.
    `rounding="nearest"` loses every increment below half a gap: that `nu` stalls at 2**-22
    (2.4e-7), and the steps it scales are twice too large. A float32 state (`dtype=jnp.float32`)
    is also how to give adam float32 moments for bfloat16 params, which optax makes bfloat16.

    The key lives in the state: each step splits it and draws one 32-bit word for each leaf
    from its own key (folded under `shard_map` with the device's position along the mesh
    axes the leaf varies over), which a hash of each entry's position turns into the entry's
    bits, as `stochastic_rounding` does. A step that `loss_scaled` skips does not reach it
    and consumes no randomness.

    Args:
      inner: the optax transformation whose state is stored narrow (`optax.adam(...)`).
      dtype: jnp.bfloat16 (the default), jnp.float16 or jnp.float32 for every floating
        leaf but scalars; or a function `(path, leaf) -> dtype or None` of a leaf of
        `inner.init(params)` and its key path, None keeping the leaf as inner made it.
        float16 holds 6.1e-5 to 65504 (normal): adam's `nu` in it is inf for gradients
        above 256 (its entries' updates then -0.0 for good) and flushes toward zero below
        about 2.4e-4; keep `nu` in bfloat16 or float32 with a function.
      key: a PRNG key for the stochastic rounding (`jax.random.key(seed)`); None for
        `jax.random.key(0)`.
      rounding: "stochastic" (the default) or "nearest".

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `LowPrecisionState`.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> tx = jls.low_precision_state(optax.adam(1e-3))
      >>> opt_state = tx.init(jnp.zeros(3))
      >>> [leaf.dtype.name for leaf in jax.tree.leaves(opt_state.inner_state)]
      ['int32', 'bfloat16', 'bfloat16']
      >>> updates, opt_state = tx.update(jnp.ones(3), opt_state, jnp.zeros(3))
      >>> updates.dtype, round(float(updates[0]), 6)  # the inner's updates, as they were
      (dtype('float32'), -0.001)
      >>> opt_state.inner_state[0].nu.dtype  # the new state, rounded back
      dtype(bfloat16)
    """
    inner = checked_transformation(inner, _OWNER)
    dtype_of = _dtype_rule(dtype)
    if rounding not in _ROUNDINGS:
        raise ValueError(
            f"{_OWNER}(rounding={describe(rounding)}): rounding must be 'stochastic' or 'nearest'"
        )
    if key is not None and rounding == "nearest":
        raise ValueError(
            f'{_OWNER}(key=..., rounding="nearest"): a key is for rounding="stochastic" only'
        )
    key_data, impl = checked_key(jax.random.key(0) if key is None else key, _OWNER)

    def init_fn(params: optax.Params) -> LowPrecisionState:
        chosen: list[Any] = []  # for each floating leaf, its dtype, None where kept

        def store(path: Any, leaf: Any) -> Any:
            if not _is_floating(leaf):
                return leaf
            dtype = dtype_of(path, leaf)
            chosen.append(dtype)
            return leaf if dtype is None else _nearest(leaf.astype(jnp.float32), dtype)

        inner_state = jax.tree_util.tree_map_with_path(store, inner.init(params))
        # A copy: a donated state must not take the key this transformation starts from.
        return LowPrecisionState(_stored_in(chosen), jnp.array(key_data, copy=True), inner_state)

    def update_fn(
        updates: optax.Updates,
        state: LowPrecisionState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LowPrecisionState]:
        if not isinstance(state, LowPrecisionState):
            raise TypeError(
                f"{_OWNER}.update: the state must be the LowPrecisionState that "
                f"{_OWNER}'s init made, got {type(state).__name__}"
            )
        # The leaves stored narrow, widened; those the rule keeps (a scalar, a remedy's
        # record of its weights' dtype) reach inner as it made them.
        wide = jax.tree_util.tree_map_with_path(
            lambda path, leaf: _widened(leaf) if dtype_of(path, leaf) is not None else leaf,
            state.inner_state,
        )
        new_updates, new_inner = inner.update(updates, wide, params, **extra_args)
        stored = _update_types(inner, updates, state.inner_state, params, extra_args)
        if stored is not None:
            new_updates = jax.tree.map(_cast_like, new_updates, stored)
        if rounding == "nearest":
            return new_updates, state._replace(
                inner_state=jax.tree.map(_nearest_like, new_inner, state.inner_state)
            )
        next_key, step_key = jax.random.split(jax.random.wrap_key_data(state.key, impl=impl))
        flat_new, treedef = jax.tree_util.tree_flatten(new_inner)
        flat_old = jax.tree_util.tree_leaves(state.inner_state)
        rounded = [
            _stochastic_like(new, old, jax.random.fold_in(step_key, index))
            for index, (new, old) in enumerate(zip(flat_new, flat_old, strict=True))
        ]
        return new_updates, state._replace(
            key=jax.random.key_data(next_key), inner_state=jax.tree.unflatten(treedef, rounded)
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def _stored_in(chosen: list[Any]) -> dict[str, jax.Array]:
    """`LowPrecisionState.stored_in`, from the dtype chosen for each floating leaf (None
    where kept): how many leaves each dtype holds, by name (`{"bfloat16": 2}`); where one
    dtype does not hold them all, each name followed by a fingerprint of its leaves'
    positions (`"float16_at_5d7a1c0e"`), so that a checkpoint whose leaves were stored in
    other dtypes is refused too, two leaves' dtypes swapped or a kept leaf stored."""
    positions: dict[str, list[int]] = {}
    for index, dtype in enumerate(chosen):
        if dtype is not None:
            positions.setdefault(jnp.dtype(dtype).name, []).append(index)
    alone = len(positions) == 1 and None not in chosen

    def key(name: str, leaves: list[int]) -> str:
        return (
            name if alone else f"{name}_at_{hashlib.sha256(repr(leaves).encode()).hexdigest()[:8]}"
        )

    return {
        key(name, leaves): jnp.array(len(leaves), jnp.int32)
        for name, leaves in sorted(positions.items())
    }


def _update_types(
    inner: optax.GradientTransformationExtraArgs,
    updates: optax.Updates,
    stored_state: optax.OptState,
    params: optax.Params | None,
    extra_args: dict[str, Any],
) -> Any:
    """The types of the updates that `inner` gives from the state as stored (bfloat16 for
    bfloat16 gradients, as `optax.apply_if_finite`'s skip gives them), the gradients taken
    strongly typed (a weakly typed float32 gradient gives float32 updates, as bare optax's);
    or None where `inner` cannot update the state as stored, only widened (`optax.MultiSteps`
    and `optax.apply_if_finite`, whose `cond` keeps float32 accumulators of float32
    gradients apart from bfloat16 ones): then the updates keep the dtypes it gave."""
    strong = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf)), updates
    )
    try:
        return jax.eval_shape(
            lambda u, s, p: inner.update(u, s, p, **extra_args)[0], strong, stored_state, params
        )
    except TypeError:  # (the update of the widened state, just traced, raised nothing)
        return None


def _dtype_rule(dtype: Any) -> Callable[[Any, Any], np.dtype[Any] | None]:
    """`dtype` as a function of a leaf's path and value giving a stored dtype or None."""
    try:
        fixed = None if dtype is None or is_array(dtype) else jnp.dtype(dtype)
    except (TypeError, ValueError):  # (a PRNG key given as the dtype: ValueError)
        fixed = None
    if fixed is None and callable(dtype):

        def chosen(path: Any, leaf: Any) -> np.dtype[Any] | None:
            result = dtype(path, leaf)
            return None if result is None else _stored(result, f"dtype(...) for {path_name(path)}")

        return chosen
    checked = _stored(dtype, "dtype")
    return lambda path, leaf: checked if jnp.ndim(leaf) > 0 else None


def _stored(dtype: Any, what: str) -> np.dtype[Any]:
    try:
        result: np.dtype[Any] | None = None if is_array(dtype) else jnp.dtype(dtype)
    except (TypeError, ValueError):
        result = None
    if result is None or result not in _STORED:
        raise (TypeError if result is None else ValueError)(
            f"{_OWNER}({what}={describe(dtype)}): the state is stored in jnp.bfloat16, "
            "jnp.float16 or jnp.float32 (or dtype is a function of a leaf's path and value "
            "giving one of them, or None)"
        )
    return result


def _is_floating(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray) and jnp.issubdtype(leaf.dtype, jnp.floating)


def _is_narrow(leaf: Any) -> bool:
    return _is_floating(leaf) and jnp.dtype(leaf.dtype).itemsize < 4


def _widened(leaf: Any) -> Any:
    return leaf.astype(jnp.float32) if _is_narrow(leaf) else leaf


def _nearest(value: jax.Array, dtype: Any) -> jax.Array:
    if jnp.dtype(dtype).itemsize >= 4:
        return value.astype(dtype)
    return round_to_nearest(value.astype(jnp.float32), dtype).astype(dtype)


def _cast_like(update: Any, stored: Any) -> Any:
    dtype = getattr(stored, "dtype", None)
    if dtype is None or getattr(update, "dtype", dtype) == dtype:
        return update
    return jnp.asarray(update).astype(dtype)


def _nearest_like(new: Any, old: Any) -> Any:
    """`new` in `old`'s dtype where `old` is a floating leaf, rounded to nearest."""
    return _nearest(jnp.asarray(new), old.dtype) if _is_floating(old) else new


def _stochastic_like(new: Any, old: Any, key: jax.Array) -> Any:
    """`new` in `old`'s dtype, rounded stochastically where that is narrower than float32."""
    if not _is_narrow(old):
        return _nearest_like(new, old)
    value = jnp.asarray(new).astype(jnp.float32)
    return round_stochastically(value, old.dtype, on_this_shard(key, value)).astype(old.dtype)
