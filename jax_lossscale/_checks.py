"""The generic checks of what callers pass in, and the messages that name what was wrong.

Here are the generic checks: of hyperparameters, trees, axis names and NamedTuple states. A
module's checks of its own types stay with it: the contract of a `LossScale` (what its
methods return, its state) with the protocol (`_base`), the wrapper's state and its `inner`
and `loss_scale` arguments (`_states`, `_loss_scaled`), the spike windows (`_spikes`), the
bfloat16 weights' states (`_bf16_weights`) and the relations between one loss scale's
hyperparameters (its `__post_init__`). The hints for users of other libraries are in
`_peer_hints`.

Hyperparameters are checked once, when a loss scale or a wrapper is constructed. Each
check returns the value as a plain Python `float`, `int` or `bool`, so that loss-scale
objects compare, hash and serialize the same however a number was written (`2**15`,
`32768.0`, `np.float32(32768)`, `jnp.asarray(2.0**15)`): a concrete scalar array, NumPy's or
JAX's, counts as the number it holds, while a traced one is refused, since hyperparameters are
static and fixed when the object is built; an initial scale, state rather than a
hyperparameter, may be traced (`traced_or_positive_real`). Real numbers are rounded to
float32, the precision the state computes in, so that the checks and the config see the very
values the update rule uses. Trees, axis names and states are checked at the public function
or method that takes them, on shapes and dtypes only, so that the checks pass for tracers.
"""

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale._types import PyTree

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


_STATIC = (
    "a static Python number (or a concrete NumPy or JAX scalar), not a value traced by jit, "
    "grad or vmap: hyperparameters are fixed when the object is built, so build it outside "
    "the traced function"
)


def held_number(
    owner: str,
    name: str,
    value: Any,
    requirement: str,
    kind: Callable[[Any], bool],
    traced: str = _STATIC,
) -> Any:
    """The Python number that a concrete scalar array (NumPy or JAX) holds, when `kind` accepts
    its dtype; any other value as it is, for the caller's own checks.

    An array of another shape or dtype is refused naming `requirement`; a traced array (the
    object built inside `jit`, `grad` or `vmap` from a traced value) with a message saying
    that hyperparameters are static Python numbers (or `traced`, what to say instead).
    """
    if isinstance(value, jax.core.Tracer):
        fail(owner, name, value, traced, TypeError)
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
    with np.errstate(over="ignore"):
        rounded = np.float32(number)  # numpy's printed maximum, 3.4028235e+38, rounds to it
    if not np.isfinite(rounded):
        fail(owner, name, value, f"at most the float32 maximum ({FLOAT32_MAX!r})")
    return float(rounded)


def positive_real(owner: str, name: str, value: Any) -> float:
    """A real number > 0 and not subnormal in float32: XLA on CPU flushes subnormals to zero."""
    number = real(owner, name, value)
    if number <= 0:
        fail(owner, name, value, "> 0")
    if number < FLOAT32_SMALLEST_NORMAL:
        fail(owner, name, value, f">= the smallest normal float32 ({FLOAT32_SMALLEST_NORMAL!r})")
    return number


def traced_or_positive_real(owner: str, name: str, value: Any) -> float | jax.Array:
    """A traced real scalar as a float32 array, for a value that only goes into a state (an
    initial scale built inside `jit`); any other value checked by `positive_real`."""
    if not isinstance(value, jax.core.Tracer):
        return positive_real(owner, name, value)
    if value.shape != () or not _is_real_dtype(value.dtype):
        fail(owner, name, value, f"a real number, got {describe_array(value)}", TypeError)
    return value.astype(jnp.float32)


def optional_positive_real(owner: str, name: str, value: Any) -> float | None:
    """None, or a real number > 0 rounded to float32."""
    if value is None:
        return None
    number = real(owner, name, value)
    if number <= 0:
        fail(owner, name, value, "None or a positive finite number")
    return number


def integer(owner: str, name: str, value: Any, minimum: int = 1, traced: str = _STATIC) -> int:
    """An integer in [minimum, 2**31 - 1], the range of the int32 counters in a state."""
    held = held_number(owner, name, value, f"an integer >= {minimum}", _is_integer_dtype, traced)
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


# --- arguments ------------------------------------------------------------------------


class _NotGiven:
    """The default of an argument that is required, so that its absence gets a message."""

    def __repr__(self) -> str:
        return "<required>"


NOT_GIVEN: Any = _NotGiven()


def checked_transformation(inner: Any, owner: str) -> optax.GradientTransformationExtraArgs:
    """`inner` (an optax transformation or `optax.MultiSteps`) taking extra arguments, or a
    TypeError naming `owner`'s `inner` (an optimizer not called yet: `optax.adam`)."""
    if isinstance(inner, optax.MultiSteps):
        # optax types MultiSteps.update's state as its MultiStepsState, narrower than the
        # OptState of the update protocol.
        inner = optax.GradientTransformationExtraArgs(inner.init, inner.update)  # type: ignore[arg-type]
    if not isinstance(inner, optax.GradientTransformation):
        hint = "; call it first, e.g. optax.adam(1e-3)" if callable(inner) else ""
        raise TypeError(
            f"{owner}(inner={describe(inner)}): inner must be an optax "
            f"GradientTransformation, got {type(inner).__name__}{hint}"
        )
    # A public optax function that optax's __init__ imports but leaves out of its __all__.
    return optax.with_extra_args_support(inner)  # type: ignore[attr-defined]
