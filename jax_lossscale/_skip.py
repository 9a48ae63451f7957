"""Apply or skip, and the dtypes of an inner state that a skip must keep.

A skipped step returns updates of -0.0, the additive identity of every float, so that
`optax.apply_updates` keeps the params' bits (signed zeros included), and the inner state as
it was. It takes one of two forms (`apply_or_skip`):

* selects: the inner update runs on every step and `jnp.where` picks its outputs or the
  skip's; XLA fuses the selects into the update and into `optax.apply_updates`;
* a `lax.cond` that runs the inner update only on an applied step.

The inner update is traced once; the skip's types are read from that trace. Each inner-state
leaf takes the dtype that holds its old and its new values exactly (`joined_dtype`), on a
skip, and already at init (`initial_inner_state`).
"""

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core.primitives import cond_p

from jax_lossscale._axes import explicit_sharding, on_meshes_of, varying_like
from jax_lossscale._checks import path_name
from jax_lossscale._numerics import in_unscaled_dtypes
from jax_lossscale._platforms import Form, ReciprocalFactors, chosen
from jax_lossscale._types import PyTree


class Operands(NamedTuple):
    """What the inner update reads: the operands of the `cond` around it."""

    scaled_grads: PyTree
    inner_state: optax.OptState
    params: optax.Params
    factors: ReciprocalFactors
    extra_args: dict[str, Any]


def skips_by_select(inner_state: optax.OptState, grads: PyTree) -> bool:
    """Whether the skip is made of selects on every platform: where the inner state's arrays
    (its scalars, such as step counts, aside) hold no more entries than the gradients (sgd
    with or without momentum, lion). Such an update is cheap to run on a skipped step, and
    selects fused into it keep its updates out of memory. A larger state (adam's two moments)
    is cheaper to leave untouched under a `cond`, except on a GPU (`_platforms`)."""
    state_size = sum(np.size(leaf) for leaf in jax.tree.leaves(inner_state) if np.ndim(leaf))
    return state_size <= sum(np.size(leaf) for leaf in jax.tree.leaves(grads))


def apply_or_skip(
    apply: jax.Array,
    inner_update: Callable[[Operands], tuple[optax.Updates, optax.OptState]],
    operands: Operands,
    form: Form,
) -> tuple[optax.Updates, optax.OptState]:
    """`(updates, inner_state)` of `inner_update(operands)` where `apply`, else of a skip.

    By selects where `skips_by_select` and in the GPU form; else by a `cond`, which
    `Form.LOWERED` keeps for the platforms other than a GPU, where the selects decide instead
    (`_platforms`). An `apply` known when traced (eagerly) takes its branch alone, as a
    `cond` would: a skip runs no update, which could make a NaN from an infinity.
    """
    inner_state = operands.inner_state
    if not isinstance(apply, jax.core.Tracer):
        new_updates, new_state = (
            inner_update(operands)
            if apply
            else on_meshes_of(operands, jax.eval_shape(inner_update, operands))
        )
        return skipped_by_selects(apply, new_updates, new_state, inner_state)
    if form is Form.GPU or skips_by_select(inner_state, operands.scaled_grads):
        return skipped_by_selects(apply, *inner_update(operands), inner_state)
    cond, types = skip_by_cond(inner_update, operands)
    if form is Form.CPU:
        return cond(apply)
    # Both forms from one trace: the platform's choice gives the two predicates alone. Lowered
    # for a GPU the cond's is true, elsewhere the selects'; XLA folds what a constant decides.
    true = varying_like(jnp.bool_(True), apply)
    run, keep = chosen(form, lambda: (true, apply), lambda: (apply, true))
    return skipped_by_selects(keep, *cond(run), inner_state, types)


def skip_by_cond(
    inner_update: Callable[[Operands], tuple[optax.Updates, optax.OptState]],
    operands: Operands,
) -> tuple[Callable[[jax.Array], tuple[optax.Updates, optax.OptState]], tuple[PyTree, PyTree]]:
    """A function of a predicate: `inner_update(operands)` where it holds, else the skip's
    -0.0 updates and old state, by a `cond` whose branches are made from one trace of the
    inner update: its types are read off that trace, and the trace is the applied branch.
    And those types: of the updates, and of the state on both branches (`_branch_types`)."""
    leaves, structure = jax.tree.flatten(operands)
    arrays = [index for index, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

    def rebuilt(args: tuple[jax.Array, ...]) -> Operands:
        given = list(leaves)
        for index, arg in zip(arrays, args, strict=True):
            given[index] = arg
        rebuilt_operands: Operands = jax.tree.unflatten(structure, given)
        return rebuilt_operands

    types: list[tuple[PyTree, PyTree]] = []  # what the trace of the update gives

    def applied(*args: jax.Array) -> tuple[optax.Updates, optax.OptState]:
        new_updates, new_state = inner_update(rebuilt(args))
        types.append(_branch_types(operands.inner_state, new_updates, new_state))
        return new_updates, _as_types(new_state, types[0][1])

    def skipped(*args: jax.Array) -> tuple[optax.Updates, optax.OptState]:
        updates_types, state_types = types[0]
        old_state = _as_types(rebuilt(args).inner_state, state_types)
        return _negative_zeros(updates_types), old_state

    args = tuple(leaves[index] for index in arrays)
    applied_jaxpr, shapes = jax.make_jaxpr(applied, return_shape=True)(*args)
    outputs = jax.tree.structure(shapes)
    if applied_jaxpr.effects or any(isinstance(c, jax.core.Tracer) for c in applied_jaxpr.consts):
        # The update has effects, or closes over values of the traced step (an optimizer made
        # inside it from traced hyperparameters): a `lax.cond`, which takes both, replays it.
        def replayed() -> tuple[optax.Updates, optax.OptState]:
            out = jax.core.eval_jaxpr(applied_jaxpr.jaxpr, applied_jaxpr.consts, *args)
            return cast(tuple[optax.Updates, optax.OptState], jax.tree.unflatten(outputs, out))

        def replayed_cond(run: jax.Array) -> tuple[optax.Updates, optax.OptState]:
            return cast(
                tuple[optax.Updates, optax.OptState],
                jax.lax.cond(run, replayed, lambda: skipped(*args)),
            )

        return replayed_cond, types[0]
    branches = (jax.make_jaxpr(skipped)(*args), applied_jaxpr)

    def bound_cond(run: jax.Array) -> tuple[optax.Updates, optax.OptState]:
        index = jax.lax.convert_element_type(run, np.int32)
        out = cond_p.bind(index, *args, branches=branches)
        return cast(tuple[optax.Updates, optax.OptState], jax.tree.unflatten(outputs, out))

    return bound_cond, types[0]


def skipped_by_selects(
    apply: Any,
    new_updates: optax.Updates,
    new_state: optax.OptState,
    inner_state: optax.OptState,
    types: tuple[PyTree, PyTree] | None = None,
) -> tuple[optax.Updates, optax.OptState]:
    """The new updates and state where `apply`, else -0.0 updates and the old state, each
    state leaf in the dtype that holds both (`types`, where already read off a trace).
    (Where `apply` is known, and false, the new ones may be their types alone.)"""
    if types is None:
        types = _branch_types(inner_state, new_updates, new_state)
    updates_types, state_types = types
    old_state = _as_types(inner_state, state_types)
    if not isinstance(apply, jax.core.Tracer):  # known: no select
        if apply:
            return new_updates, _as_types(new_state, state_types)
        return _negative_zeros(updates_types), old_state
    new_state = _as_types(new_state, state_types)
    predicates: dict[tuple[Any, ...], jax.Array] = {}  # `apply` broadcast, by shape and sharding

    def select(new: jax.Array, old: jax.Array) -> jax.Array:
        shape, sharding = jnp.shape(new), explicit_sharding(new)
        if (shape, sharding) not in predicates:
            predicates[shape, sharding] = jax.lax.broadcast(apply, shape, out_sharding=sharding)
        return jax.lax.select(varying_like(predicates[shape, sharding], new), new, old)

    updates = jax.tree.map(select, new_updates, _negative_zeros(updates_types))
    return updates, jax.tree.map(select, new_state, old_state)


def _branch_types(
    inner_state: PyTree, new_updates: PyTree, new_inner_state: PyTree
) -> tuple[PyTree, PyTree]:
    """The types of the updates, and those the inner state takes on both branches: each leaf
    in the dtype that holds its old and its new values exactly (`joined_dtype`)."""
    updates_type = jax.tree.map(_type_of, new_updates)
    new_state_type = jax.tree.map(_type_of, new_inner_state)

    def joined(path: Any, old: Any, new: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        old_type = jax.typeof(old)
        if old_type.weak_type:  # it takes the dtype the update gives it, as JAX's promotion does
            return new
        dtype = joined_dtype(old_type.dtype, new.dtype, path, "loss_scaled.update")
        return cast(jax.ShapeDtypeStruct, new.update(dtype=dtype, weak_type=False))

    return updates_type, jax.tree_util.tree_map_with_path(joined, inner_state, new_state_type)


def joined_dtype(old: Any, new: Any, path: Any, caller: str) -> Any:
    """The dtype that holds every value of `old` and of `new` exactly, the first of: `new`,
    `old`, their promotion, float32 (bfloat16 moments that become float32 stay float32 on a
    skip; float32 between two 8-bit floats that do not promote); a `TypeError` naming the
    state leaf at `path` where none does (float32 into int32), since a skip could not keep
    it. An integer leaf that the update makes floating (adam's moments of integer params,
    made by `zeros_like`) takes the floating dtype, as bare optax's state does after a step.
    """
    if old == new:  # (a typed PRNG key's dtype too, which jnp.dtype does not take)
        return new
    if jnp.issubdtype(old, jnp.integer) and jnp.issubdtype(new, jnp.inexact):
        return jnp.dtype(new)
    candidates = [jnp.dtype(new), jnp.dtype(old)]
    # As between 8-bit floats: jax's TypePromotionError, a ValueError (not in jax.dtypes
    # before jax 0.10.1).
    with contextlib.suppress(ValueError):
        candidates.append(jnp.promote_types(old, new))
    candidates.append(jnp.dtype(jnp.float32))
    for dtype in candidates:
        if holds_exactly(dtype, old) and holds_exactly(dtype, new):
            return dtype
    raise TypeError(
        f"{caller}: inner.update turns the state leaf at {path_name(path)} from {old} into "
        f"{new}, and no dtype holds the values of both exactly, so a skipped step could not "
        "keep it"
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


def initial_inner_state(
    init: Callable[[optax.Params], optax.OptState], params: optax.Params
) -> optax.OptState:
    """The inner state a step keeps, from the start: `init(params)`, except that where the
    params hold float16 leaves, whose gradients `loss_scaled` unscales to float32, each leaf
    that `init` also makes for the params in float32 (adam's moments, a momentum, hyperparameters
    injected) is that one, when its dtype holds the other's exactly. Leaves made for float16
    params alone (the buffers of `kahan_summation`, the dtypes `stochastic_rounding` records)
    are kept as made: so float16 params train with a float32 optimizer state, as a float32
    master copy would, and a remedy still sees its weights' own dtype."""
    state = init(params)
    widened = in_unscaled_dtypes(params)
    if widened is params:
        return state
    for_float32 = dict(jax.tree_util.tree_flatten_with_path(init(widened))[0])

    def made_for_float32(path: Any, leaf: Any) -> Any:
        wide = for_float32.get(path)
        if (
            wide is None
            or jnp.shape(wide) != jnp.shape(leaf)
            or not hasattr(leaf, "dtype")
            or jnp.issubdtype(leaf.dtype, jax.dtypes.extended)  # a PRNG key
            or not holds_exactly(wide.dtype, leaf.dtype)
        ):
            return leaf
        return wide

    made: optax.OptState = jax.tree_util.tree_map_with_path(made_for_float32, state)
    return made


def _type_of(value: Any) -> jax.ShapeDtypeStruct:
    """The shape, dtype, weak type, varying manual axes and explicit sharding of `value` (a
    tracer or its type).

    (`jax.ShapeDtypeStruct.like` first asks a tracer for its sharding, which takes far
    longer than tracing.)
    """
    if isinstance(value, jax.ShapeDtypeStruct):
        return value
    aval: Any = value if isinstance(value, jax.core.AbstractValue) else jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is None or manual.empty:
        sharding = explicit_sharding(aval)
        return jax.ShapeDtypeStruct(
            aval.shape, aval.dtype, sharding=sharding, weak_type=aval.weak_type
        )
    return jax.ShapeDtypeStruct(  # inside shard_map: the axes over which it varies
        aval.shape,
        aval.dtype,
        sharding=aval.sharding,
        weak_type=aval.weak_type,
        manual_axis_type=manual,
    )


def _as_types(tree: PyTree, types: PyTree) -> PyTree:
    return jax.tree.map(_as_type, tree, types)


def _as_type(value: jax.Array, target: jax.ShapeDtypeStruct) -> jax.Array:
    """`value` with the dtype, weak type and varying manual axes of `target`."""
    value_type = jax.typeof(value)
    if value_type.dtype != target.dtype or value_type.weak_type != target.weak_type:
        value = jax.lax.convert_element_type(value, target.dtype)
    return varying_like(value, target)


def _negative_zeros(types: PyTree) -> PyTree:
    """Arrays of -0.0 of `types` (the updates' shapes, dtypes, varying manual axes and
    explicit shardings), one made per shape, dtype and explicit sharding: -0.0 is the
    additive identity of every float, +0.0 and -0.0 included."""
    made: dict[tuple[Any, ...], jax.Array] = {}

    def negative_zeros(type_: jax.ShapeDtypeStruct) -> jax.Array:
        sharding = explicit_sharding(type_)
        key = (type_.shape, type_.dtype, sharding)
        if key not in made:
            if jnp.issubdtype(type_.dtype, jnp.complexfloating):
                fill: Any = complex(-0.0, -0.0)
            elif jnp.issubdtype(type_.dtype, jnp.floating):
                fill = -0.0
            else:
                fill = 0
            made[key] = jax.lax.full(type_.shape, fill, type_.dtype, sharding=sharding)
        return varying_like(made[key], type_)

    return jax.tree.map(negative_zeros, types)
