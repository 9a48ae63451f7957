"""The `LossScale` protocol shared by every loss scale."""

import abc
import functools
import inspect
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

from jax_lossscale._tree import (
    AxisName,
    PyTree,
    check_array_leaves,
    divide_floating,
    multiply_floating,
    safe_repr,
)

_Self = TypeVar("_Self", bound="LossScale")


class LossScale(abc.ABC):
    """Base class of loss scales: hyperparameters here, values in a state pytree.

    A loss scale object is immutable and holds only hyperparameters. Everything
    that changes during training lives in the state returned by `init`, a pytree
    of arrays that is passed to and returned from `update`, so it works under
    `jit`, `pmap` and `shard_map` and checkpoints like any other pytree.

    Subclasses implement `init`, `__call__`, `update` and `get_config`; `scale`,
    `unscale` and `from_config` come with it. The state holds the current scale as
    `loss_scale`, a float32 scalar field (or a property computing it from the
    other fields), and `__call__` returns it: that is where `get_loss_scale` reads
    the scale of a `loss_scaled` state. Every subclass is registered with
    JAX as a static pytree (no leaves), so its instances can be passed to `jit`
    as ordinary arguments; they must therefore be hashable and immutable, as a
    frozen dataclass is. Decorate a subclass with `jax_lossscale.register` to
    make it known to `deserialize` and `get`.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> ls = jls.FixedLossScale(128.0)
      >>> state = ls.init()
      >>> ls.scale(state, jnp.float32(0.5))
      Array(64., dtype=float32)
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_static(cls)

    @abc.abstractmethod
    def init(self) -> PyTree:
        """Returns the initial state, a pytree of arrays."""

    @abc.abstractmethod
    def __call__(self, state: PyTree) -> jax.Array:
        """Returns the current loss scale held in `state`, a float32 scalar array."""

    @abc.abstractmethod
    def update(
        self, state: PyTree, grads: PyTree, axis_name: AxisName | None = None
    ) -> tuple[PyTree, jax.Array]:
        """Advances the state given this step's unscaled gradients.

        Args:
          state: the current state.
          grads: the gradients of this step, already unscaled.
          axis_name: inside `pmap` or `shard_map`, the axis over which devices
            must agree on whether the step is finite.

        Returns:
          `(new_state, should_apply)`, where `should_apply` is a boolean scalar
          array: whether the gradients of this step should be applied. With
          `axis_name`, both must be the same on every device of that axis.
        """

    @abc.abstractmethod
    def get_config(self) -> dict[str, Any]:
        """Returns the hyperparameters as a JSON-serializable dict."""

    @classmethod
    def from_config(cls: type[_Self], config: dict[str, Any]) -> _Self:
        """Builds a loss scale from the dict returned by `get_config`."""
        if not isinstance(config, dict):
            raise TypeError(
                f"{cls.__name__}.from_config(config={safe_repr(config)}): config must be a dict"
            )
        parameters = inspect.signature(cls).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            unknown = sorted(set(config) - set(parameters))
            if unknown:
                raise ValueError(
                    f"{cls.__name__}.from_config(config={safe_repr(config)}): unknown keys "
                    f"{unknown}; expected some of {list(parameters)}"
                )
            missing = [
                name
                for name, parameter in parameters.items()
                if parameter.default is inspect.Parameter.empty
                and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
                and name not in config
            ]
            if missing:
                raise TypeError(
                    f"{cls.__name__}.from_config(config={safe_repr(config)}): missing the required "
                    f"keys {missing}"
                )
        return cls(**config)

    def scale(self, state: PyTree, tree: PyTree) -> PyTree:
        """Multiplies every floating leaf of `tree` (usually the loss) by the scale.

        Args:
          state: the loss scale's state.
          tree: a pytree of arrays. Integer, boolean and `float0` leaves pass
            through unchanged.

        Returns:
          `tree` with each floating leaf times the scale, computed in float32 (or
          wider) and cast back to the leaf's own dtype.
        """
        check_array_leaves(tree, arg_name="tree", caller=f"{type(self).__name__}.scale")
        return multiply_floating(tree, self._checked_scale(state))

    def unscale(self, state: PyTree, grads: PyTree) -> PyTree:
        """Divides every floating leaf of `grads` by the scale.

        Args:
          state: the loss scale's state.
          grads: a pytree of arrays, the gradients of the scaled loss. Integer,
            boolean and `float0` leaves pass through unchanged.

        Returns:
          `grads` with each floating leaf divided by the scale, computed in
          float32 (or wider) and cast back to the leaf's own dtype.

        Example:
          >>> import jax.numpy as jnp
          >>> import jax_lossscale as jls
          >>> ls = jls.FixedLossScale(1024.0)
          >>> ls.unscale(ls.init(), {"w": jnp.array([2048.0], jnp.float16), "n": jnp.array(3)})
          {'n': Array(3, dtype=int32, weak_type=True), 'w': Array([2.], dtype=float16)}
        """
        check_array_leaves(grads, arg_name="grads", caller=f"{type(self).__name__}.unscale")
        return divide_floating(grads, self._checked_scale(state))

    def _checked_scale(self, state: PyTree) -> jax.Array:
        loss_scale = self(state)
        if not is_scalar_array(loss_scale, np.float32):
            raise TypeError(
                f"{type(self).__name__}.__call__ must return a float32 scalar array, got "
                f"{_describe(loss_scale)}"
            )
        return loss_scale


def is_scalar_array(value: Any, dtype: Any) -> bool:
    """Whether `value` is a scalar array (or tracer) of exactly `dtype`."""
    return (
        isinstance(value, jax.Array | np.ndarray | np.generic)
        and value.shape == ()
        and value.dtype == dtype
    )


def check_state(owner: LossScale, state: Any, state_type: type[NamedTuple]) -> None:
    """Raises unless `state` is a `state_type` of arrays like those `owner.init()` returns.

    The check runs on shapes and dtypes only, so it passes for tracers at trace time.
    """
    name = type(owner).__name__
    check_named_arrays(
        state,
        _state_template(owner),
        where=name,
        label="state",
        source=f"{name}.init()",
    )


def check_named_arrays(
    value: Any, template: NamedTuple, *, where: str, label: str, source: str
) -> None:
    """Raises unless `value` is a NamedTuple of the template's type, shapes and dtypes.

    Weakly typed leaves are refused: a jitted step would trace again once they come
    back strongly typed from an update.
    """
    expected_type = type(template)
    if not isinstance(value, expected_type):
        raise TypeError(
            f"{where}: {label} must be the {expected_type.__name__} returned by {source}, "
            f"got {type(value).__name__}"
        )
    for field, leaf, expected in zip(value._fields, value, template, strict=True):
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic):
            raise TypeError(f"{where}: {label}.{field} must be an array, got {_describe(leaf)}")
        if leaf.dtype != expected.dtype or getattr(leaf, "weak_type", False):
            raise TypeError(
                f"{where}: {label}.{field} must have dtype {expected.dtype} (not weakly typed), "
                f"got {_describe(leaf)}; build states with {source}"
            )
        if leaf.shape != expected.shape:
            raise ValueError(
                f"{where}: {label}.{field} must have shape {expected.shape}, got shape "
                f"{leaf.shape}; a state replicated for pmap has scalar leaves only inside "
                "the pmapped function"
            )


def _describe(value: Any) -> str:
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        weak = ", weakly typed" if getattr(value, "weak_type", False) else ""
        return f"{type(value).__name__} of dtype {value.dtype} and shape {value.shape}{weak}"
    return f"{type(value).__name__} ({safe_repr(value)})"


@functools.lru_cache(maxsize=128)
def _state_template(owner: LossScale) -> Any:
    return jax.eval_shape(owner.init)
