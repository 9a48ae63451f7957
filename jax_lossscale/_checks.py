"""The generic checks of what callers pass in, and the messages that name what was wrong.

Here are the checks of hyperparameters, trees, axis names, a loss scale's state and the
contract of a `LossScale` (what `__call__`, `init`, `update` and `adjust` return). A
module's checks of its own types stay with it: the wrapper's state and its `inner` and
`loss_scale` arguments (`_states`, `_loss_scaled`), the spike windows (`_spikes`), the
bfloat16 weights' states (`_bf16_weights`) and the relations between one loss scale's
hyperparameters (its `__post_init__`).

Hyperparameters are checked once, when a loss scale or a wrapper is constructed. Each
check returns the value as a plain Python `float`, `int` or `bool`, so that loss-scale
objects compare, hash and serialize the same however a number was written (`2**15`,
`32768.0`, `np.float32(32768)`, `jnp.asarray(2.0**15)`): a concrete scalar array, NumPy's or
JAX's, counts as the number it holds, while a traced one is refused, since hyperparameters are
static and fixed when the object is built. Real numbers are rounded to float32, the precision the
state computes in, so that the checks and the config see the very values the update rule
uses. Trees, axis names and states are checked once, at the public function or method that
takes them, on shapes and dtypes only, so that the checks pass for tracers.
"""

import functools
import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._types import PyTree

if TYPE_CHECKING:  # _base imports this module: the type alone, for type checkers
    from jax_lossscale._base import LossScale

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)
INT32_MAX = int(np.iinfo(np.int32).max)


# --- messages -----------------------------------------------------------------------------


def is_array(value: Any) -> bool:
    """Whether `value` is an array: JAX's (a tracer included), NumPy's, or a NumPy scalar."""
    return isinstance(value, jax.Array | np.ndarray | np.generic)


def is_at_least_float32(dtype: Any) -> bool:
    """Whether a floating `dtype` has 32 bits or more: float32, float64 (and complex64 or
    wider), which hold an unscaled gradient; float16 and bfloat16 do not."""
    return bool(jnp.finfo(dtype).bits >= 32)


def describe(value: Any, limit: int | None = 80) -> str:
    """`repr(value)` for a message: shortened in the middle when longer than `limit`
    characters (None: never), and described where Python refuses to print it."""
    try:
        text = repr(value)
    except ValueError:  # it holds an int beyond Python's limit on digits for str()
        if isinstance(value, int):
            return f"<int of {value.bit_length()} bits>"
        return f"<{type(value).__name__} too large to print>"
    if limit is None or len(text) <= limit:
        return text
    return f"{text[: limit // 2]}...{text[-(limit // 4) :]}"


def describe_array(value: Any) -> str:
    """What an array is (type, dtype, shape, weak type), or what a non-array is."""
    if is_array(value):
        weak = ", weakly typed" if getattr(value, "weak_type", False) else ""
        return f"{type(value).__name__} of dtype {value.dtype} and shape {value.shape}{weak}"
    return f"{type(value).__name__} ({describe(value)})"


def path_name(path: tuple[Any, ...]) -> str:
    """A pytree path as `jax.tree_util.keystr` writes it, `<root>` for the root itself."""
    return jax.tree_util.keystr(path) or "<root>"


def fail(
    owner: str, name: str, value: Any, requirement: str, error: type[Exception] = ValueError
) -> NoReturn:
    """Raises `error` with a message that names the argument and the value received."""
    raise error(f"{owner}({name}={describe(value)}): {name} must be {requirement}")


# --- hyperparameters ----------------------------------------------------------------------


def held_number(
    owner: str, name: str, value: Any, requirement: str, kind: Callable[[Any], bool]
) -> Any:
    """The Python number that a concrete scalar array (NumPy or JAX) holds, when `kind` accepts
    its dtype; any other value as it is, for the caller's own checks.

    An array of another shape or dtype is refused naming `requirement`; a traced array (the
    object built inside `jit`, `grad` or `vmap` from a traced value) with a message saying
    that hyperparameters are static Python numbers.
    """
    if isinstance(value, jax.core.Tracer):
        fail(
            owner,
            name,
            value,
            "a static Python number (or a concrete NumPy or JAX scalar), not a value traced by "
            "jit, grad or vmap: hyperparameters are fixed when the object is built, so build "
            "it outside the traced function",
            TypeError,
        )
    if not isinstance(value, jax.Array | np.ndarray):
        return value
    if value.shape != () or not kind(value.dtype):
        fail(owner, name, value, f"{requirement}, got {describe_array(value)}", TypeError)
    if jnp.issubdtype(value.dtype, jnp.bool_):
        return bool(value)
    if jnp.issubdtype(value.dtype, jnp.integer):
        return int(value)
    return float(value)


def _is_real_dtype(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))


def _is_integer_dtype(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.integer))


def _is_bool_dtype(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.bool_))


def real(owner: str, name: str, value: Any) -> float:
    """A finite real number that float32 can hold, rounded to float32."""
    held = held_number(owner, name, value, "a real number", _is_real_dtype)
    if isinstance(held, bool) or not isinstance(held, numbers.Real):
        fail(owner, name, value, "a real number", TypeError)
    try:
        number = float(held)
    except OverflowError:  # an int or Fraction beyond every float
        fail(owner, name, value, f"at most the float32 maximum ({FLOAT32_MAX!r})")
    if not math.isfinite(number):
        fail(owner, name, value, "finite")
    if abs(number) > FLOAT32_MAX:
        fail(owner, name, value, f"at most the float32 maximum ({FLOAT32_MAX!r})")
    return float(np.float32(number))


def positive_real(owner: str, name: str, value: Any) -> float:
    """A real number > 0 and not subnormal in float32: XLA on CPU flushes subnormals to zero."""
    number = real(owner, name, value)
    if number <= 0:
        fail(owner, name, value, "> 0")
    if number < FLOAT32_SMALLEST_NORMAL:
        fail(owner, name, value, f">= the smallest normal float32 ({FLOAT32_SMALLEST_NORMAL!r})")
    return number


def optional_positive_real(owner: str, name: str, value: Any) -> float | None:
    """None, or a real number > 0 rounded to float32."""
    if value is None:
        return None
    number = real(owner, name, value)
    if number <= 0:
        fail(owner, name, value, "None or a positive finite number")
    return number


def integer(owner: str, name: str, value: Any, minimum: int = 1) -> int:
    """An integer in [minimum, 2**31 - 1], the range of the int32 counters in a state."""
    held = held_number(owner, name, value, f"an integer >= {minimum}", _is_integer_dtype)
    if isinstance(held, bool) or not isinstance(held, numbers.Integral):
        fail(owner, name, value, f"an integer >= {minimum}", TypeError)
    number = int(held)
    if not minimum <= number <= INT32_MAX:
        fail(owner, name, value, f"an integer >= {minimum} and <= {INT32_MAX}")
    return number


def boolean(owner: str, name: str, value: Any) -> bool:
    held = held_number(owner, name, value, "a bool", _is_bool_dtype)
    if not isinstance(held, bool | np.bool_):
        fail(owner, name, value, "a bool", TypeError)
    return bool(held)


# --- trees and axis names -----------------------------------------------------------------


def check_array_leaves(tree: PyTree, *, arg_name: str, caller: str) -> None:
    """Raises `TypeError` when a leaf of `tree` is not an array of a numeric dtype.

    `None` leaves are empty subtrees to JAX and never reach this check. Arrays of
    `float0` (the tangent type of integer inputs) and of integer or boolean dtype
    are allowed; callers ignore them.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not is_array(leaf):
            raise TypeError(
                f"{caller}: {arg_name} leaf at {path_name(path)} has type {type(leaf).__name__} "
                f"({describe(leaf)}); every leaf must be a JAX or NumPy array (or None)"
            )
        dtype = leaf.dtype
        if dtype != jax.dtypes.float0 and not (
            jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)
        ):
            raise TypeError(
                f"{caller}: {arg_name} leaf at {path_name(path)} has dtype {dtype}; "
                "expected a numeric, boolean or float0 array"
            )


def check_axis_name(axis_name: Any, *, caller: str, require_bound: bool = True) -> None:
    """Raises unless `axis_name` is None, a name, or a tuple of names bound where it is used.

    A name is any hashable but an integer (JAX reads integers as positional axes).
    It is bound inside `pmap`, `shard_map` or `vmap` over it; JAX's own error for an
    unbound one does not say which argument was wrong.
    """
    if axis_name is None:
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(_is_axis_name(name) for name in names):
        raise TypeError(
            f"{caller}: axis_name={axis_name!r} must be None, an axis name (a string or "
            "other hashable, not an integer) or a tuple of axis names"
        )
    if len(set(names)) != len(names):
        raise ValueError(
            f"{caller}: axis_name={axis_name!r} names an axis more than once; each axis "
            "may appear once"
        )
    if require_bound:
        try:
            jax.lax.axis_size(axis_name)
        except NameError:
            raise ValueError(
                f"{caller}: axis_name={axis_name!r} is not bound here; call it inside "
                "pmap, shard_map or vmap over that axis, or pass axis_name=None (under SPMD "
                "jit none is needed)"
            ) from None


def _is_axis_name(name: Any) -> bool:
    if isinstance(name, int | np.integer | tuple):
        return False
    try:
        hash(name)
    except TypeError:
        return False
    return True


# --- states -------------------------------------------------------------------------------


def is_scalar_array(value: Any, dtype: Any) -> bool:
    """Whether `value` is a scalar array (or tracer) of exactly `dtype`."""
    return is_array(value) and value.shape == () and value.dtype == dtype


def check_grads_finite(grads_finite: Any, *, caller: str) -> None:
    """Raises unless `grads_finite` is a bool scalar array (or a Python bool)."""
    if not (isinstance(grads_finite, bool) or is_scalar_array(grads_finite, np.bool_)):
        raise TypeError(
            f"{caller}(grads_finite={describe(grads_finite)}): grads_finite must be a bool "
            f"scalar array, such as all_finite(grads), got {describe_array(grads_finite)}"
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
        if not is_array(leaf):
            raise TypeError(
                f"{where}: {label}.{field} must be an array, got {describe_array(leaf)}"
            )
        if leaf.dtype != expected.dtype or getattr(leaf, "weak_type", False):
            raise TypeError(
                f"{where}: {label}.{field} must have dtype {expected.dtype} (not weakly typed), "
                f"got {describe_array(leaf)}; build states with {source}"
            )
        if leaf.shape != expected.shape:
            raise ValueError(
                f"{where}: {label}.{field} must have shape {expected.shape}, got shape "
                f"{leaf.shape}; a state replicated for pmap has scalar leaves only inside "
                "the pmapped function"
            )


# --- the contract of a LossScale: what its methods return ------------------------------


def checked_scale(loss_scale: "LossScale", state: PyTree) -> jax.Array:
    """The scale `loss_scale(state)` returns, once checked to be a float32 scalar array."""
    scale = loss_scale(state)
    if not is_scalar_array(scale, np.float32):
        raise TypeError(
            f"{type(loss_scale).__name__}.__call__ must return a float32 scalar array, got "
            f"{describe_array(scale)}"
        )
    return scale


def check_holds_scale(loss_scale: "LossScale", caller: str) -> None:
    """Raises unless the loss scale's state holds its scale as a float32 scalar `loss_scale`,
    where `get_loss_scale` reads it."""
    try:
        scale = jax.eval_shape(lambda: loss_scale.init().loss_scale)
    except AttributeError:
        found = "none"
    else:
        if scale.shape == () and scale.dtype == np.float32:
            return
        found = f"dtype {scale.dtype} and shape {scale.shape}"
    state_type = type(jax.eval_shape(loss_scale.init)).__name__
    raise TypeError(
        f"{caller}(loss_scale={describe(loss_scale)}): the state of a LossScale must hold "
        "its current scale as a float32 scalar loss_scale (a field or a property), where "
        f"get_loss_scale reads it; {type(loss_scale).__name__}.init() returns {state_type} "
        f"with loss_scale of {found}"
    )


def check_should_apply(
    loss_scale: "LossScale", should_apply: Any, caller: str, method: str = "update"
) -> None:
    """Raises unless `update` (or `adjust`) returned `should_apply` as a bool scalar array."""
    if not is_scalar_array(should_apply, np.bool_):
        raise TypeError(
            f"{caller}: {type(loss_scale).__name__}.{method} must return should_apply as a "
            f"bool scalar array, got {describe(should_apply)}"
        )


def check_loss_scale_state(loss_scale: Any, state: Any) -> None:
    """Raises unless `state` is a NamedTuple of arrays like those `loss_scale.init()` returns."""
    name = type(loss_scale).__name__
    check_named_arrays(
        state, _initial_state_type(loss_scale), where=name, label="state", source=f"{name}.init()"
    )


@functools.lru_cache(maxsize=128)
def _initial_state_type(loss_scale: Any) -> Any:
    return jax.eval_shape(loss_scale.init)


# --- habits from other loss scalers -------------------------------------------------------

# Keyword arguments of other libraries' loss scales, and what to write here instead.
_PEER_KEYWORDS = {
    "DynamicLossScale": {
        "loss_scale": ("initial_loss_scale", "jmp's loss_scale"),
        "period": ("increment_period", "jmp's and mpx's period"),
        "factor": ("multiplier", "jmp's and mpx's factor"),
        "loss_scaling": ("initial_loss_scale", "mpx's loss_scaling"),
        "min_loss_scaling": ("min_loss_scale", "mpx's min_loss_scaling"),
        "scale": ("initial_loss_scale", "flax's scale"),
        "growth_interval": (
            "increment_period",
            "flax's growth_interval + 1 reproduces flax's, PyTorch's growth_interval",
        ),
        "growth_factor": ("multiplier", "flax's and PyTorch's growth_factor"),
        "minimum_scale": ("min_loss_scale", "flax's minimum_scale"),
        "init_scale": ("initial_loss_scale", "PyTorch's init_scale"),
        "initial_scale": ("initial_loss_scale", "Keras's initial_scale"),
        "dynamic_growth_steps": ("increment_period", "Keras's dynamic_growth_steps"),
    },
    "FixedLossScale": {
        "loss_scale": ("loss_scale_value", "jmp's StaticLossScale(loss_scale)"),
    },
}

_COUNTER = (
    "the count of finite steps lives in the state, not in the loss scale: resume it by "
    "setting the state's good_steps (docs/migrating.md, 'Resuming a jmp or flax checkpoint')"
)


def check_no_peer_keywords(owner: str, kwargs: dict[str, Any]) -> None:
    """Raises `TypeError` naming the argument to write for another library's keyword
    (jmp's `period=`, `factor=`, mpx's `loss_scaling=`, ...) given to `owner`."""
    known = _PEER_KEYWORDS.get(owner, {})
    for name, value in kwargs.items():
        if name in known:
            ours, theirs = known[name]
            raise TypeError(
                f"{owner}({name}={describe(value)}): {owner} takes no argument {name}; write "
                f"{ours}={describe(value)} ({theirs})"
            )
        if name == "counter" and known:
            raise TypeError(
                f"{owner}(counter={describe(value)}): {owner} takes no counter; " + _COUNTER
            )


# Attributes of other libraries' loss-scale objects, and where the value is here.
_CURRENT_SCALE = (
    "the current scale lives in the state, not in the loss scale: read it with "
    "jls.get_loss_scale(opt_state) under loss_scaled, or loss_scale(state); the scale it "
    "starts from is .{initial}"
)
_PEER_ATTRIBUTES = {
    "loss_scale": _CURRENT_SCALE,
    "loss_scaling": _CURRENT_SCALE,
    "counter": "the count of finite steps lives in the state: "
    "jls.get_loss_scale_stats(opt_state) and opt_state.loss_scale_state.good_steps",
    "period": "write .increment_period",
    "factor": "write .multiplier",
    "min_loss_scaling": "write .min_loss_scale",
    "adjust": "loss_scaled(optimizer, loss_scale).update unscales, checks and adjusts; alone, "
    "state, should_apply = loss_scale.update(state, grads) takes the unscaled gradients",
}


def peer_attribute_error(owner: Any, name: str) -> AttributeError:
    """The `AttributeError` for `owner.name`: for another library's attribute (jmp's
    `loss_scale.loss_scale`, `.counter`, ...) it says where the value is here."""
    message = f"{type(owner).__name__!r} object has no attribute {name!r}"
    if name not in _PEER_ATTRIBUTES:
        return AttributeError(message, name=name, obj=owner)  # Python's "Did you mean"
    initial = "loss_scale_value" if hasattr(owner, "loss_scale_value") else "initial_loss_scale"
    message += "; " + _PEER_ATTRIBUTES[name].format(initial=initial)
    return AttributeError(message, name=None, obj=None)  # no "Did you mean" max_loss_scale


class _NotGiven:
    """The default of an argument that is required, so that its absence gets a message."""

    def __repr__(self) -> str:
        return "<required>"


NOT_GIVEN: Any = _NotGiven()


def missing_tree_error(owner: str, method: str, what: str) -> TypeError:
    """The `TypeError` for jmp's `loss_scale.scale(loss)`: the state argument is missing."""
    return TypeError(
        f"{owner}.{method}(state, {what}) takes the loss scale's state first, the current one: "
        "opt_state.loss_scale_state under loss_scaled, since tx.update unscales by the current "
        "scale (loss_scale.init() holds the initial one). jmp's loss_scale.scale(loss) is "
        "loss * jls.get_loss_scale(opt_state), or jls.value_and_grad(loss_fn, opt_state); its "
        "loss_scale.unscale(grads) happens inside tx.update"
    )
