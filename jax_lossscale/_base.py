"""The `LossScale` protocol: a subclass writes the rule, `adjust`; the rest is final here.

The checks of what a loss scale's methods return (the contract) live here too, beside the
protocol they check.
"""

import abc
import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING, Any, TypeVar, cast, final

import jax
import numpy as np

from jax_lossscale._checks import (
    NOT_GIVEN,
    check_array_leaves,
    check_axis_name,
    check_named_arrays,
    describe,
    describe_array,
    is_scalar_array,
)
from jax_lossscale._numerics import divide_floating, finite_flag, multiply_floating
from jax_lossscale._peer_hints import (
    check_no_peer_keywords,
    missing_tree_error,
    peer_attribute_error,
)
from jax_lossscale._types import AxisName, PyTree

_Self = TypeVar("_Self", bound="LossScale")

_FINAL = ("update", "scale", "unscale")  # what a subclass may call but not define


class LossScale(abc.ABC):
    """Base class of loss scales: hyperparameters here, values in a state pytree.

    A loss scale object is immutable and holds only hyperparameters. Everything
    that changes during training lives in the state returned by `init`, a pytree
    of arrays that is passed to and returned from `update`, so it works under
    `jit`, `pmap` and `shard_map` and checkpoints like any other pytree.

    Subclasses implement `init`, `__call__`, `adjust` (the rule, given whether a step's
    gradients are finite) and `get_config`; `update` (the finite test, then `adjust`),
    `scale`, `unscale` and `from_config` come with it. `update`, `scale` and `unscale` are
    final: a subclass that defines one is refused when the class is created, since
    `loss_scaled` makes its own finite check of the scaled gradients and calls `adjust`.
    The state holds the current scale as
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
        for name in _FINAL:
            if getattr(cls, name) is not LossScale.__dict__[name]:  # (a mixin's too)
                raise TypeError(
                    f"{cls.__name__} defines {name}, which LossScale keeps final: a loss scale "
                    "writes its rule as adjust(state, grads_finite), which update calls after "
                    "the finite test and loss_scaled calls after its own"
                )
        if "__call__" in cls.__dict__:
            cls.__call__ = _returning_the_field(cls.__dict__["__call__"])  # type: ignore[method-assign]
        jax.tree_util.register_static(cls)

    @abc.abstractmethod
    def init(self) -> PyTree:
        """Returns the initial state, a pytree of arrays."""

    def __call__(self, state: PyTree) -> jax.Array:
        """Returns the current loss scale held in `state`: its `loss_scale`, a float32 scalar
        array. A subclass that writes its own must return that same value (`loss_scaled`
        checks it on the initial state), since `get_loss_scale` and `value_and_grad` read the
        field, and the wrapper unscales by it.

        Examples:
          >>> import jax_lossscale as jls
          >>> ls = jls.DynamicLossScale(initial_loss_scale=8.0)
          >>> ls(ls.init())
          Array(8., dtype=float32)
        """
        return scale_of(self, state)

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

    @final
    def update(
        self, state: PyTree, grads: PyTree, axis_name: AxisName | None = None
    ) -> tuple[PyTree, jax.Array]:
        """Advances the state given this step's unscaled gradients: `adjust`, given whether
        they are all finite.

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
        new_state, should_apply = self.adjust(state, finite_flag(grads, axis_name))
        check_adjusted(self, new_state, should_apply, caller)
        return new_state, should_apply

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

    @final
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
        return multiply_floating(tree, scale_of(self, state))

    @final
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
        return divide_floating(grads, scale_of(self, state))

    if not TYPE_CHECKING:  # so that type checkers still flag unknown attributes

        def __new__(cls, *args, **kwargs):
            # Another library's keyword (jmp's `period=`) gets a message naming ours.
            check_no_peer_keywords(cls.__name__, kwargs)
            return super().__new__(cls)

        def __getattr__(self, name):
            # An attribute of another library (jmp's `.counter`) gets a message saying where
            # the value is here; a property that raised AttributeError, that error again.
            if any(name in cls.__dict__ for cls in type(self).__mro__):
                return object.__getattribute__(self, name)
            raise peer_attribute_error(self, name)


def scale_of(loss_scale: LossScale, state: PyTree) -> jax.Array:
    """The scale `state` holds: its `loss_scale` field (or property), once checked to be a
    float32 scalar array. The one reader of the scale: the wrapper unscales by it,
    `get_loss_scale` and `value_and_grad` read it, and `LossScale.__call__` returns it."""
    if _is_named_tuple(_initial_state_type(loss_scale)):
        check_loss_scale_state(loss_scale, state)
    try:
        scale = state.loss_scale
    except AttributeError:
        scale = None
    if not is_scalar_array(scale, np.float32):
        raise TypeError(
            f"{type(loss_scale).__name__}: the state must hold the current scale as a float32 "
            f"scalar array loss_scale, got {describe_array(scale)} in {type(state).__name__}"
        )
    return cast(jax.Array, scale)


def check_holds_scale(loss_scale: LossScale, caller: str) -> None:
    """Raises unless the loss scale's state holds its scale as a float32 scalar `loss_scale`,
    where `get_loss_scale` reads it, and `loss_scale(state)` returns that value (and that
    it can be hashed, as `jax.jit` does with it)."""
    _initial_state_type(loss_scale)
    try:
        scale = jax.eval_shape(lambda: loss_scale.init().loss_scale)
    except AttributeError:
        found = "none"
    else:
        if scale.shape == () and scale.dtype == np.float32 and not scale.weak_type:
            _check_call_returns_the_field(loss_scale, caller)
            return
        found = f"dtype {scale.dtype} and shape {scale.shape}"
        if scale.weak_type:  # jnp.asarray(8.0): the first step would give a strong one back
            found += ", weakly typed (make it with jnp.float32(...))"
    state_type = type(jax.eval_shape(loss_scale.init)).__name__
    raise TypeError(
        f"{caller}(loss_scale={describe(loss_scale)}): the state of a LossScale must hold "
        "its current scale as a float32 scalar loss_scale (a field or a property), where "
        f"get_loss_scale reads it; {type(loss_scale).__name__}.init() returns {state_type} "
        f"with loss_scale of {found}"
    )


def _returning_the_field(call: Any) -> Any:
    """A subclass's own `__call__`, made to return the state's `loss_scale`, by which the
    wrapper unscales: a value of `call` that differs is an error where both are known, and
    traced, the field is what the loss is scaled by, whatever `call` computes."""

    @functools.wraps(call)
    def returning_the_field(self: LossScale, state: PyTree) -> jax.Array:
        called, held = call(self, state), scale_of(self, state)
        name = type(self).__name__
        if not is_scalar_array(called, np.float32):
            raise TypeError(
                f"{name}.__call__ must return a float32 scalar array, got {describe_array(called)}"
            )
        known = not isinstance(called, jax.core.Tracer) and not isinstance(held, jax.core.Tracer)
        if known and np.asarray(called).tobytes() != np.asarray(held).tobytes():
            raise TypeError(
                f"{name}.__call__ returns {float(called)!r} for a state whose loss_scale is "
                f"{float(held)!r}; the loss is multiplied by loss_scale (get_loss_scale, "
                "value_and_grad) and the gradients divided by it, so __call__ must return "
                "state.loss_scale (or be left to LossScale)"
            )
        return held

    return returning_the_field


def _check_call_returns_the_field(loss_scale: LossScale, caller: str) -> None:
    """Raises when a subclass's own `__call__` gives another scale than the state's field
    (on the initial state, computed here even inside a traced function)."""
    if type(loss_scale).__call__ is LossScale.__call__:
        return
    call = type(loss_scale).__call__.__wrapped__  # type: ignore[attr-defined]  # its own
    with jax.ensure_compile_time_eval():
        state = loss_scale.init()
        called, held = call(loss_scale, state), state.loss_scale
    if not is_scalar_array(called, np.float32):
        raise TypeError(
            f"{type(loss_scale).__name__}.__call__ must return a float32 scalar array, got "
            f"{describe_array(called)}"
        )
    if np.asarray(called).tobytes() != np.asarray(held).tobytes():
        raise TypeError(
            f"{caller}(loss_scale={describe(loss_scale)}): {type(loss_scale).__name__}.__call__ "
            f"returns {float(called)!r} for the initial state, whose loss_scale is "
            f"{float(held)!r}; the loss is multiplied by loss_scale (get_loss_scale, "
            "value_and_grad) and the gradients divided by it, so __call__ must return "
            "state.loss_scale (or be left to LossScale)"
        )


def _is_named_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def check_adjusted(loss_scale: LossScale, new_state: Any, should_apply: Any, caller: str) -> None:
    """Raises unless `adjust` returned a state like `init`'s (its types, dtypes and shapes: a
    float16 scale never appears) and `should_apply` as a bool scalar array."""
    name = type(loss_scale).__name__
    source = f"{name}.init() (adjust must keep its fields' dtypes and shapes)"
    where = f"{caller}: {name}.adjust"
    template = _initial_state_type(loss_scale)
    check_named_arrays(new_state, template, where=where, label="its new state", source=source)
    if not is_scalar_array(should_apply, np.bool_):
        raise TypeError(
            f"{caller}: {name}.adjust must return should_apply as a bool scalar array, got "
            f"{describe(should_apply)}"
        )


def check_loss_scale_state(loss_scale: LossScale, state: Any) -> None:
    """Raises unless `state` is a NamedTuple of arrays like those `loss_scale.init()` returns."""
    name = type(loss_scale).__name__
    check_named_arrays(
        state, _initial_state_type(loss_scale), where=name, label="state", source=f"{name}.init()"
    )


def _initial_state_type(loss_scale: LossScale) -> Any:
    try:
        hash(loss_scale)
    except TypeError:
        traced = [k for k, v in vars(loss_scale).items() if isinstance(v, jax.core.Tracer)]
        if traced:
            raise TypeError(
                f"{type(loss_scale).__name__} holds a traced {traced[0]}, and a dataclass's own "
                "__hash__ and __eq__ cannot take it (jax.jit hashes a loss scale as a static "
                "value); keep those of DynamicLossScale, which leave traced values out: "
                "@dataclasses.dataclass(frozen=True, eq=False)"
            ) from None
        raise TypeError(
            f"{type(loss_scale).__name__} is not hashable: a LossScale holds hyperparameters "
            "only, and is hashed where jax.jit takes it as a static value; make it a frozen "
            "dataclass (@dataclasses.dataclass(frozen=True)) or define __hash__ and __eq__"
        ) from None
    return _cached_initial_state_type(loss_scale)


@functools.lru_cache(maxsize=128)
def _cached_initial_state_type(loss_scale: LossScale) -> Any:
    return jax.eval_shape(loss_scale.init)


def init_fields(loss_scale: Any) -> dict[str, Any]:
    """A dataclass loss scale's config: the fields its constructor takes, a subclass's too."""
    return {f.name: getattr(loss_scale, f.name) for f in dataclasses.fields(loss_scale) if f.init}
