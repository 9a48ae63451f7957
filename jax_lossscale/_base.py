"""The `LossScale` protocol shared by every loss scale: the rule public, the checks at its edge."""

import abc
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import jax

from jax_lossscale._checks import (
    NOT_GIVEN,
    check_array_leaves,
    check_axis_name,
    check_no_peer_keywords,
    checked_scale,
    describe,
    missing_tree_error,
    peer_attribute_error,
)
from jax_lossscale._numerics import divide_floating, finite_flag, multiply_floating
from jax_lossscale._types import AxisName, PyTree

_Self = TypeVar("_Self", bound="LossScale")


class LossScale(abc.ABC):
    """Base class of loss scales: hyperparameters here, values in a state pytree.

    A loss scale object is immutable and holds only hyperparameters. Everything
    that changes during training lives in the state returned by `init`, a pytree
    of arrays that is passed to and returned from `update`, so it works under
    `jit`, `pmap` and `shard_map` and checkpoints like any other pytree.

    Subclasses implement `init`, `__call__`, `adjust` (the rule, given whether a step's
    gradients are finite) and `get_config`; `update` (the finite test, then `adjust`),
    `scale`, `unscale` and `from_config` come with it. A rule that reads more of the
    gradients overrides `update` instead of `adjust`. The state holds the current scale as
    `loss_scale`, a float32 scalar field (or a property computing it from the
    other fields), and `__call__` returns it: that is where `get_loss_scale` reads
    the scale of a `loss_scaled` state. Every subclass is registered with
    JAX as a static pytree (no leaves), so its instances can be passed to `jit`
    as ordinary arguments; they must therefore be hashable and immutable, as a
    frozen dataclass is. Decorate a subclass with `jax_lossscale.register` to
    make it known to `deserialize` and `get`.

    Examples:
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
        if "update" in cls.__dict__:
            if "reads_only_finiteness" not in cls.__dict__:
                cls.reads_only_finiteness = False
            if getattr(cls.adjust, "__isabstractmethod__", False):
                cls.adjust = _adjust_not_implemented  # type: ignore[method-assign]
        # A class that defines a public method has it called by `loss_scaled`: the private
        # core of that method, which takes values `loss_scaled` has checked, becomes a call
        # of the public method, unless the class defines the core too (as the built-in loss
        # scales do, whose public methods check, then run the core).
        for public, (core_name, by_public) in _CORES.items():
            if public in cls.__dict__ and core_name not in cls.__dict__:
                setattr(cls, core_name, by_public)

    @abc.abstractmethod
    def init(self) -> PyTree:
        """Returns the initial state, a pytree of arrays."""

    @abc.abstractmethod
    def __call__(self, state: PyTree) -> jax.Array:
        """Returns the current loss scale held in `state`, a float32 scalar array."""

    @abc.abstractmethod
    def adjust(self, state: PyTree, grads_finite: jax.Array) -> tuple[PyTree, jax.Array]:
        """The rule: advances the state given whether this step's gradients are finite.

        Args:
          state: the current state.
          grads_finite: a bool scalar array, whether every gradient of this step is
            finite (on every device of `axis_name`, where `update` was given one).

        Returns:
          `(new_state, should_apply)`, where `should_apply` is a bool scalar array:
          whether the gradients of this step should be applied.

        Examples:
          >>> import jax.numpy as jnp
          >>> import jax_lossscale as jls
          >>> ls = jls.DynamicLossScale(initial_loss_scale=8.0)
          >>> state, should_apply = ls.adjust(ls.init(), jnp.array(False))
          >>> should_apply, ls(state)
          (Array(False, dtype=bool), Array(4., dtype=float32))
        """

    def _adjust_checked(self, state: PyTree, grads_finite: jax.Array) -> tuple[PyTree, jax.Array]:
        """`adjust` of a state `__call__` has read and a flag `loss_scaled` computed.

        A built-in loss scale runs its rule without checking them again; any other runs
        its `adjust`."""
        return self.adjust(state, grads_finite)

    def update(
        self, state: PyTree, grads: PyTree, axis_name: AxisName | None = None
    ) -> tuple[PyTree, jax.Array]:
        """Advances the state given this step's unscaled gradients: `adjust`, given whether
        they are all finite.

        A loss scale whose rule reads more of the gradients than whether they are finite
        overrides `update` instead of `adjust`; `loss_scaled` then calls its `update` (see
        `reads_only_finiteness`).

        Args:
          state: the current state.
          grads: the gradients of this step, already unscaled; a pytree of arrays whose
            integer, boolean and `float0` leaves are ignored.
          axis_name: inside `pmap` or `shard_map`, the axis over which devices
            must agree on whether the step is finite; None elsewhere.

        Returns:
          `(new_state, should_apply)`, where `should_apply` is a boolean scalar
          array: whether the gradients of this step should be applied. With
          `axis_name`, both are the same on every device of that axis.

        Examples:
          >>> import jax.numpy as jnp
          >>> import jax_lossscale as jls
          >>> ls = jls.DynamicLossScale(initial_loss_scale=8.0)
          >>> state, should_apply = ls.update(ls.init(), {"w": jnp.array([1.0, jnp.nan])})
          >>> should_apply, ls(state)
          (Array(False, dtype=bool), Array(4., dtype=float32))
        """
        caller = f"{type(self).__name__}.update"
        check_array_leaves(grads, arg_name="grads", caller=caller)
        check_axis_name(axis_name, caller=caller)
        return self.adjust(state, finite_flag(grads, axis_name))

    def _update_checked(
        self, state: PyTree, grads: PyTree, axis_name: AxisName | None
    ) -> tuple[PyTree, jax.Array]:
        """`update` of checked arguments: `adjust`'s core, given whether they are all finite;
        the class's own `update` where it defines one."""
        return self._adjust_checked(state, finite_flag(grads, axis_name))

    reads_only_finiteness: ClassVar[bool] = True
    """Whether `update` reads nothing of the gradients but whether they are all finite, so
    that `loss_scaled` may test them in its own pass over the scaled gradients and call
    `adjust` (no unscaled copy is made). True unless the class, or a base of it below
    `LossScale`, defines `update`: `loss_scaled` then calls that `update` with the unscaled
    gradients. Both give the same numbers to a loss scale whose `update` is `adjust` of the
    finite flag; a subclass whose `update` only adds to the base's (a log) may set it back
    to True, and its `update` is then not called by `loss_scaled`."""

    @abc.abstractmethod
    def get_config(self) -> dict[str, Any]:
        """Returns the hyperparameters as a JSON-serializable dict."""

    @classmethod
    def from_config(cls: type[_Self], config: dict[str, Any]) -> _Self:
        """Builds a loss scale from the dict returned by `get_config`."""
        if not isinstance(config, dict):
            raise TypeError(
                f"{cls.__name__}.from_config(config={describe(config, limit=None)}): "
                "config must be a dict"
            )
        parameters = inspect.signature(cls).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            unknown = sorted(set(config) - set(parameters))
            if unknown:
                raise ValueError(
                    f"{cls.__name__}.from_config(config={describe(config, limit=None)}): "
                    f"unknown keys {unknown}; expected some of {list(parameters)}"
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
                    f"{cls.__name__}.from_config(config={describe(config, limit=None)}): "
                    f"missing the required keys {missing}"
                )
        return cls(**config)

    def scale(self, state: PyTree, tree: PyTree = NOT_GIVEN) -> PyTree:
        """Multiplies every floating leaf of `tree` (usually the loss) by the scale.

        Args:
          state: the loss scale's state.
          tree: a pytree of arrays. Integer, boolean and `float0` leaves pass
            through unchanged.

        Returns:
          `tree` with each floating leaf times the scale, computed in float32 (or
          wider) and cast back to the leaf's own dtype.
        """
        if tree is NOT_GIVEN:
            raise missing_tree_error(type(self).__name__, "scale", "tree")
        check_array_leaves(tree, arg_name="tree", caller=f"{type(self).__name__}.scale")
        return multiply_floating(tree, checked_scale(self, state))

    def unscale(self, state: PyTree, grads: PyTree = NOT_GIVEN) -> PyTree:
        """Divides every floating leaf of `grads` by the scale.

        Args:
          state: the loss scale's state.
          grads: a pytree of arrays, the gradients of the scaled loss. Integer,
            boolean and `float0` leaves pass through unchanged.

        Returns:
          `grads` with each floating leaf divided by the scale, computed in
          float32 (or wider): a float16 leaf comes back float32, since float16
          holds a scaled gradient but not always the unscaled one (a true
          gradient of 1e-6 is subnormal there); other leaves keep their dtype.

        Examples:
          >>> import jax.numpy as jnp
          >>> import jax_lossscale as jls
          >>> ls = jls.FixedLossScale(1024.0)
          >>> ls.unscale(ls.init(), {"w": jnp.array([2048.0], jnp.float16), "n": jnp.array(3)})
          {'n': Array(3, dtype=int32, weak_type=True), 'w': Array([2.], dtype=float32)}
        """
        if grads is NOT_GIVEN:
            raise missing_tree_error(type(self).__name__, "unscale", "grads")
        check_array_leaves(grads, arg_name="grads", caller=f"{type(self).__name__}.unscale")
        return divide_floating(grads, checked_scale(self, state))

    def _unscale_checked(self, state: PyTree, scale: jax.Array, grads: PyTree) -> PyTree:
        """`unscale` of checked arguments, `scale` being `checked_scale(self, state)`; the
        class's own `unscale` where it defines one."""
        return divide_floating(grads, scale)

    if not TYPE_CHECKING:  # so that type checkers still flag unknown attributes

        def __new__(cls, *args, **kwargs):
            # Another library's keyword (jmp's `period=`) gets a message naming ours.
            check_no_peer_keywords(cls.__name__, kwargs)
            return super().__new__(cls)

        def __getattr__(self, name):
            # Called only for attributes not found: another library's (jmp's `.loss_scale`,
            # `.counter`) gets a message saying where the value is here.
            raise peer_attribute_error(self, name)


def _adjust_by_public(
    self: LossScale, state: PyTree, grads_finite: jax.Array
) -> tuple[PyTree, jax.Array]:
    return self.adjust(state, grads_finite)


def _update_by_public(
    self: LossScale, state: PyTree, grads: PyTree, axis_name: AxisName | None
) -> tuple[PyTree, jax.Array]:
    return self.update(state, grads, axis_name)


def _unscale_by_public(self: LossScale, state: PyTree, scale: jax.Array, grads: PyTree) -> PyTree:
    return self.unscale(state, grads)


# Each public method a subclass may define, its core's name, and the core that calls it.
_CORES: dict[str, tuple[str, Callable[..., Any]]] = {
    "adjust": ("_adjust_checked", _adjust_by_public),
    "update": ("_update_checked", _update_by_public),
    "unscale": ("_unscale_checked", _unscale_by_public),
}


def _adjust_not_implemented(
    self: LossScale, state: PyTree, grads_finite: jax.Array
) -> tuple[PyTree, jax.Array]:
    """The `adjust` of a loss scale that defines `update` alone: its rule reads more of the
    gradients than whether they are finite."""
    raise NotImplementedError(
        f"{type(self).__name__} defines update, not adjust: its rule reads the unscaled "
        "gradients; call update"
    )
