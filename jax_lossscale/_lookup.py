"""Finding the `loss_scaled` state in any optax state: `get_loss_scale`, `get_loss_scale_stats`.

The state may sit anywhere: inside `optax.chain`, `optax.inject_hyperparams`,
`optax.MultiSteps`, a flax `nnx.Optimizer` (whose `nnx.state` turns NamedTuples into
mappings and wraps arrays), or stacked by `vmap` and replicated by `pmap`.
"""

from collections.abc import Mapping
from typing import Any, cast

import jax
import numpy as np

from jax_lossscale._checks import path_name
from jax_lossscale._states import LossScaledState, LossScaleStats, StepStats, stats_with_scale
from jax_lossscale._types import PyTree


def get_loss_scale(opt_state: Any) -> jax.Array:
    """Returns the current loss scale held in an optax state built by `loss_scaled`.

    The `LossScaledState` may sit anywhere in `opt_state`: inside `optax.chain`,
    `optax.inject_hyperparams`, `optax.MultiSteps` or any other nesting, in a flax
    `nnx.Optimizer` (pass the optimizer, its `opt_state` or `nnx.state(optimizer)`, a
    mapping of the state's fields, which holds no `loss_scale` that a custom loss scale's
    state gives as a property) or in any pytree that holds it. Multiply the loss by this
    scale before differentiating.

    Raises:
      LookupError: if `opt_state` holds no `LossScaledState`.
      ValueError: if it holds more than one; pass the part that holds the one you mean.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> tx = optax.chain(
      ...     optax.clip(1.0), jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale())
      ... )
      >>> jls.get_loss_scale(tx.init({"w": jnp.zeros(3)}))
      Array(32768., dtype=float32)
    """
    return _read_scale(_find_state(opt_state, "get_loss_scale"), "get_loss_scale")


def get_loss_scale_stats(opt_state: Any) -> LossScaleStats:
    """Returns the `LossScaleStats` of the `loss_scaled` state inside `opt_state`.

    The state is found as by `get_loss_scale`.

    Returns:
      A `LossScaleStats` of scalar arrays, ready to log (`._asdict()` for a dict): the
      current scale, the last step's gradient norm (`grad_norm`, of the unscaled
      gradients), the steps skipped so far (in all, for NaN, for inf, as spikes, and in a
      row up to now) and whether the last step was applied; `LossScaleStats` says what
      each counts.

    Raises:
      LookupError: if `opt_state` holds no `LossScaledState`.
      ValueError: if it holds more than one.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale())
      >>> params = {"w": jnp.zeros(2)}
      >>> opt_state = tx.init(params)
      >>> _, opt_state = tx.update({"w": jnp.array([jnp.nan, 0.0])}, opt_state, params)
      >>> stats = jls.get_loss_scale_stats(opt_state)
      >>> int(stats.skipped_steps), bool(stats.last_step_applied)
      (1, False)
    """
    state = _find_state(opt_state, "get_loss_scale_stats")
    stats = _unwrapped(_field(state, "stats"))
    recorded = StepStats(**{field: _field(stats, field) for field in StepStats._fields})
    return stats_with_scale(_read_scale(state, "get_loss_scale_stats"), recorded)


def _is_wrapper_state(node: Any) -> bool:
    # flax nnx's `nnx.state` turns the NamedTuple into a mapping of its fields, and leaves out
    # an inner state that holds no arrays (plain sgd's).
    if isinstance(node, Mapping):
        fields = set(LossScaledState._fields)
        return {"loss_scale_state", "stats"} <= set(node) <= fields
    return isinstance(node, LossScaledState)


def wrapper_states(tree: PyTree) -> list[tuple[Any, Any]]:
    nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_wrapper_state)[0]
    return [(path, node) for path, node in nodes if _is_wrapper_state(node)]


def _find_state(opt_state: Any, caller: str) -> Any:
    found = wrapper_states(opt_state)
    if not found:
        raise LookupError(
            f"{caller}: opt_state ({type(opt_state).__name__}) holds no LossScaledState; "
            "build the optimizer with jax_lossscale.loss_scaled(inner, loss_scale)"
        )
    if len(found) > 1:
        paths = ", ".join(path_name(path) for path, _ in found)
        raise ValueError(
            f"{caller}: opt_state holds {len(found)} LossScaledStates (at {paths}); "
            "pass the part of the state that holds the one you mean"
        )
    return found[0][1]


def _read_scale(state: Any, caller: str) -> jax.Array:
    """The `loss_scale` of the loss scale's state inside a `LossScaledState` (or its mapping).

    With leading axes where the state was stacked by `vmap` or replicated for `pmap`.
    """
    loss_scale_state = _unwrapped(_field(state, "loss_scale_state"))
    try:
        scale = _field(loss_scale_state, "loss_scale")
    except (AttributeError, KeyError, TypeError):
        scale = None
    if getattr(scale, "dtype", None) != np.float32:
        hint = (
            "; a mapping of its fields (nnx.state(optimizer) gives one) has no loss_scale "
            "property: pass the Optimizer or its opt_state"
            if isinstance(loss_scale_state, Mapping) and scale is None
            else ""
        )
        raise LookupError(
            f"{caller}: the loss scale's state in opt_state ({type(loss_scale_state).__name__}) "
            f"holds no float32 loss_scale{hint}"
        )
    return cast(jax.Array, scale)  # a float32 array, as just checked


def _field(node: Any, name: str) -> Any:
    return node[name] if isinstance(node, Mapping) else getattr(node, name)


def _unwrapped(tree: PyTree) -> PyTree:
    """`tree` with array wrappers, such as flax nnx's `OptArray`, replaced by their arrays."""

    def is_wrapper(node: Any) -> bool:
        return hasattr(node, "__jax_array__") and not isinstance(node, jax.Array)

    def unwrap(node: Any) -> Any:
        return node.__jax_array__() if is_wrapper(node) else node

    return jax.tree.map(unwrap, tree, is_leaf=is_wrapper)
