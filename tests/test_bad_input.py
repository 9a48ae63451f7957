"""The bad-input table: each public entry point refuses bad input clearly (docs/reliability.md).

Every row is one wrong call. The test checks that it raises the expected exception type,
that the message names the argument and the value received (and, where the library's
wording is stable, that it is exactly that message), and that the call mutated nothing:
not its arguments, not the loss scale objects, not the registry of `deserialize`.
Calls that can be traced also run inside `jax.jit`, with the array leaves of their
arguments traced, since the checks must fire at trace time.
"""

import dataclasses
import math
import pickle
import re
from collections import namedtuple
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

from helpers import device_array, jitted

NAN, INF = math.nan, math.inf
F32_MAX_TEXT = "at most the float32 maximum (3.4028234663852886e+38)"
INT_RANGE_TEXT = "an integer >= 1 and <= 2147483647"
BACKOFF_TEXT = "None or in the open interval (0, 1)"
LEAF_TEXT = "every leaf must be a JAX or NumPy array (or None)"
ARRAY = "@ARRAY@"  # in an expected message: the type of an array, concrete or traced


DYN = jls.DynamicLossScale(initial_loss_scale=8.0, increment_period=2)
DYN_STATE = DYN.init()
FIX = jls.FixedLossScale(4.0)
FIX_STATE = FIX.init()
PARAMS = {"w": device_array([1.0, 2.0])}
TX = jls.loss_scaled(optax.adam(1e-3), DYN)
TX_STATE = TX.init(PARAMS)
SGD_TX_STATE = jls.loss_scaled(optax.sgd(0.1), DYN).init(PARAMS)
OBJ = object()


@dataclasses.dataclass(frozen=True)
class _NonScalarScale(jls.FixedLossScale):
    """A user loss scale whose `__call__` breaks the protocol: its scale is a vector."""

    def __call__(self, state):
        return jnp.full(2, self.loss_scale_value, jnp.float32)


@dataclasses.dataclass(frozen=True)
class _PythonShouldApply(jls.FixedLossScale):
    """A user loss scale whose `adjust` returns a Python bool as `should_apply`."""

    def adjust(self, state, grads_finite):
        return state, True


class _HalfDone(jls.LossScale):
    def init(self):
        return jls.FixedLossScaleState(jnp.float32(1.0))


def _impostor() -> type[jls.LossScale]:
    @dataclasses.dataclass(frozen=True)
    class FixedLossScale(jls.FixedLossScale):
        pass

    return FixedLossScale


IMPOSTOR = _impostor()

# A state class of the right name that lacks a field, as a stale copy after a reload would be.
_ShortDynamicState = namedtuple("DynamicLossScaleState", ["loss_scale", "good_steps"])


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    call: Callable[..., Any]
    args: tuple
    error: type[Exception] | tuple[type[Exception], ...]
    arg: str  # the argument the message must name
    value: str  # how the message must show the value received
    message: str | None = None  # the whole message, where the library's wording is stable
    traced: bool = False  # also run under jax.jit with the args' array leaves traced


CASES: list[Case] = []


def add(id_, call, *args, error, arg, value, message=None, traced=False):
    CASES.append(Case(id_, call, args, error, arg, value, message, traced))


# --- hyperparameters -----------------------------------------------------------------------


def _construct(cls):
    return lambda kwargs: cls(**kwargs)


def add_hyperparameter(cls, kwargs, name, error, requirement):
    value = kwargs[name]
    others = "".join(f",{k}={v!r}" for k, v in kwargs.items() if k != name)
    add(
        f"{cls.__name__}({name}={value!r}{others})",
        _construct(cls),
        kwargs,
        error=error,
        arg=name,
        value=repr(value),
        message=f"{cls.__name__}({name}={value!r}): {name} must be {requirement}",
    )


_REAL_BAD_TYPES = ["2", [2.0], True, 2 + 0j]
# A concrete scalar array of a real dtype counts as its number; other arrays are refused
# naming what they are.
_REAL_BAD_ARRAYS = [
    (device_array([1.0]), "ArrayImpl of dtype float32 and shape (1,)"),
    (np.array([2.0, 4.0]), "ndarray of dtype float64 and shape (2,)"),
    (device_array(2 + 0j, np.complex64), "ArrayImpl of dtype complex64 and shape ()"),
    (jnp.bool_(True), "ArrayImpl of dtype bool and shape ()"),
]
_REAL_PARAMS = {
    # name: (whether None is allowed, the class, value errors specific to the argument)
    "initial_loss_scale": (
        False,
        jls.DynamicLossScale,
        [(0.0, "> 0"), (-2.0, "> 0"), (0.5, ">= min_loss_scale (1.0)")],
    ),
    "multiplier": (
        False,
        jls.DynamicLossScale,
        [
            (0, "> 1"),
            (-2.0, "> 1"),
            (1.0, "> 1"),
            (0.5, "> 1"),
            (1.00000001, "> 1 (it rounds to 1.0 in float32)"),
        ],
    ),
    "backoff_factor": (
        True,
        jls.DynamicLossScale,
        [
            (0, BACKOFF_TEXT),
            (-0.5, BACKOFF_TEXT),
            (1.0, BACKOFF_TEXT),
            (1.5, BACKOFF_TEXT),
            (1e-50, BACKOFF_TEXT + " (it rounds to 0.0 in float32)"),
        ],
    ),
    "min_loss_scale": (
        False,
        jls.DynamicLossScale,
        [
            (0, "> 0"),
            (-1.0, "> 0"),
            (1e-40, ">= the smallest normal float32 (1.1754943508222875e-38)"),
        ],
    ),
    "max_loss_scale": (
        True,
        jls.DynamicLossScale,
        [(0, "> 0"), (-1.0, "> 0"), (1024.0, "None or >= initial_loss_scale (32768.0)")],
    ),
    "loss_scale_value": (
        False,
        jls.FixedLossScale,
        [(0, ">= 1"), (-128.0, ">= 1"), (0.5, ">= 1")],
    ),
}

for _name, (_optional, _cls, _specific) in _REAL_PARAMS.items():
    _base = {"loss_scale_value": 4.0} if _cls is jls.FixedLossScale else {}
    for _value in _REAL_BAD_TYPES + ([] if _optional else [None]):
        add_hyperparameter(_cls, {**_base, _name: _value}, _name, TypeError, "a real number")
    for _value, _what in _REAL_BAD_ARRAYS:
        add_hyperparameter(
            _cls, {**_base, _name: _value}, _name, TypeError, f"a real number, got {_what}"
        )
    for _value in [NAN, INF, -INF]:
        add_hyperparameter(_cls, {**_base, _name: _value}, _name, ValueError, "finite")
    add_hyperparameter(_cls, {**_base, _name: 1e39}, _name, ValueError, F32_MAX_TEXT)
    for _value, _requirement in _specific:
        add_hyperparameter(_cls, {**_base, _name: _value}, _name, ValueError, _requirement)

# jmp's float16 scale (`jmp.half_dtype()(2**15)`) is checked as the number it holds.
for _value, _requirement in [(jnp.float16(np.inf), "finite"), (np.float16(-2.0), "> 0")]:
    add_hyperparameter(
        jls.DynamicLossScale,
        {"initial_loss_scale": _value},
        "initial_loss_scale",
        ValueError,
        _requirement,
    )

# Numbers beyond every float (Python raises OverflowError converting them) and a repr too
# long to print whole: the message shows the value shortened in the middle.
_HUGE = 10**400
_HUGE_TEXT = "1" + "0" * 39 + "..." + "0" * 20
_HUGE_NUMBERS = [
    ("10**400", _HUGE, _HUGE_TEXT),
    ("-10**400", -_HUGE, "-" + "1" + "0" * 38 + "..." + "0" * 20),
    (
        "Fraction(10**400, 3)",
        Fraction(_HUGE, 3),
        "Fraction(" + "1" + "0" * 30 + "..." + "0" * 16 + ", 3)",
    ),
    ("10**5000", 10**5000, "<int of 16610 bits>"),  # beyond Python's limit for str(int)
    ("Fraction(10**5000, 3)", Fraction(10**5000, 3), "<Fraction too large to print>"),
]
for _name, (_optional, _cls, _specific) in _REAL_PARAMS.items():
    _base = {"loss_scale_value": 4.0} if _cls is jls.FixedLossScale else {}
    for _id, _value, _text in _HUGE_NUMBERS:
        add(
            f"{_cls.__name__}({_name}={_id})",
            _construct(_cls),
            {**_base, _name: _value},
            error=ValueError,
            arg=_name,
            value=_text,
            message=f"{_cls.__name__}({_name}={_text}): {_name} must be {F32_MAX_TEXT}",
        )
for _id, _value, _text in _HUGE_NUMBERS:
    _fixed_message = f"FixedLossScale(loss_scale_value={_text}): loss_scale_value must be "
    add(
        f"get(identifier={_id})",
        jls.get,
        _value,
        error=ValueError,
        arg="loss_scale_value",
        value=_text,
        message=_fixed_message + F32_MAX_TEXT,
    )
    add(
        f"deserialize(initial_loss_scale={_id})",
        jls.deserialize,
        {"class_name": "DynamicLossScale", "config": {"initial_loss_scale": _value}},
        error=ValueError,
        arg="initial_loss_scale",
        value=_text,
        message=f"DynamicLossScale(initial_loss_scale={_text}): initial_loss_scale must be "
        + F32_MAX_TEXT,
    )

# Values Python refuses to print, elsewhere in a message.
_UNPRINTABLE = {"a": 10**5000}
add(
    "deserialize-unknown_class_with_unprintable_config",
    jls.deserialize,
    {"class_name": "Nope", "config": _UNPRINTABLE},
    error=ValueError,
    arg="class_name",
    value="<dict too large to print>",
)
add(
    "DynamicLossScale.from_config-unknown_key_unprintable",
    jls.DynamicLossScale.from_config,
    _UNPRINTABLE,
    error=ValueError,
    arg="config",
    value="<dict too large to print>",
)
add(
    "all_finite-unprintable_leaf",
    jls.all_finite,
    _UNPRINTABLE,
    error=TypeError,
    arg="tree",
    value="<int of 16610 bits>",
    message=f"all_finite: tree leaf at ['a'] has type int (<int of 16610 bits>); {LEAF_TEXT}",
)

for _name in ["increment_period", "hysteresis"]:
    for _value in ["2", None, [2], True, 2.0, 2 + 0j, NAN, np.float32(2.0)]:
        add_hyperparameter(
            jls.DynamicLossScale, {_name: _value}, _name, TypeError, "an integer >= 1"
        )
    for _value in [0, -1, 2**31, np.int32(-1), jnp.asarray(0), np.array(2**31)]:
        add_hyperparameter(jls.DynamicLossScale, {_name: _value}, _name, ValueError, INT_RANGE_TEXT)
    for _value, _what in [
        (jnp.float32(2.0), "ArrayImpl of dtype float32 and shape ()"),
        (np.ones(2, np.int32), "ndarray of dtype int32 and shape (2,)"),
    ]:
        add_hyperparameter(
            jls.DynamicLossScale, {_name: _value}, _name, TypeError, f"an integer >= 1, got {_what}"
        )

for _value, _what in [
    (jnp.int32(1), "ArrayImpl of dtype int32 and shape ()"),
    (np.array([True]), "ndarray of dtype bool and shape (1,)"),
]:
    add_hyperparameter(
        jls.DynamicLossScale,
        {"consecutive_hysteresis": _value},
        "consecutive_hysteresis",
        TypeError,
        f"a bool, got {_what}",
    )
for _value in [1, 0, "yes", None]:
    add_hyperparameter(
        jls.DynamicLossScale,
        {"consecutive_hysteresis": _value},
        "consecutive_hysteresis",
        TypeError,
        "a bool",
    )

# Bounds that contradict each other: min above max, initial outside [min, max].
add_hyperparameter(
    jls.DynamicLossScale,
    {"initial_loss_scale": 4.0, "min_loss_scale": 8.0, "max_loss_scale": 2.0},
    "max_loss_scale",
    ValueError,
    "None or >= min_loss_scale (8.0)",
)
add_hyperparameter(
    jls.DynamicLossScale,
    {"initial_loss_scale": 2.0**15, "min_loss_scale": 2.0**20},
    "initial_loss_scale",
    ValueError,
    ">= min_loss_scale (1048576.0)",
)
add_hyperparameter(
    jls.DynamicLossScale,
    {"initial_loss_scale": 4.0, "max_loss_scale": 2.0},
    "max_loss_scale",
    ValueError,
    "None or >= initial_loss_scale (4.0)",
)

# --- states passed to the LossScale methods ------------------------------------------------


def _state_calls(ls):
    tree = {"w": device_array([16.0, 32.0])}
    return {
        "__call__": lambda ls, state: ls(state),
        "scale": lambda ls, state: ls.scale(state, tree),
        "unscale": lambda ls, state: ls.unscale(state, tree),
        "update": lambda ls, state: ls.update(state, tree),
    }


def _kind_message(ls, got):
    name = type(ls).__name__
    return f"{name}: state must be the {name}State returned by {name}.init(), got {got}"


def _dtype_message(ls, field, want, got):
    name = type(ls).__name__
    return (
        f"{name}: state.{field} must have dtype {want} (not weakly typed), got {got}; "
        f"build states with {name}.init()"
    )


def _shape_message(ls, field, shape):
    return (
        f"{type(ls).__name__}: state.{field} must have shape (), got shape {shape}; a state "
        "replicated for pmap has scalar leaves only inside the pmapped function"
    )


_DYN_BAD_STATES = [
    # (id, state, error, arg, value, message)
    (
        "fixed_state",
        FIX_STATE,
        TypeError,
        "state",
        "FixedLossScaleState",
        _kind_message(DYN, "FixedLossScaleState"),
    ),
    ("dict", DYN_STATE._asdict(), TypeError, "state", "dict", _kind_message(DYN, "dict")),
    ("none", None, TypeError, "state", "NoneType", _kind_message(DYN, "NoneType")),
    (
        "tuple_missing_field",
        tuple(DYN_STATE)[:2],
        TypeError,
        "state",
        "tuple",
        _kind_message(DYN, "tuple"),
    ),
    (
        "lookalike_missing_field",
        _ShortDynamicState(DYN_STATE.loss_scale, DYN_STATE.good_steps),
        TypeError,
        "state",
        "DynamicLossScaleState",
        None,
    ),
    ("bare_scale", DYN_STATE.loss_scale, TypeError, "state", ARRAY, _kind_message(DYN, ARRAY)),
    (
        "float16_scale",
        DYN_STATE._replace(loss_scale=device_array(8.0, np.float16)),
        TypeError,
        "state.loss_scale",
        "dtype float16",
        _dtype_message(DYN, "loss_scale", "float32", f"{ARRAY} of dtype float16 and shape ()"),
    ),
    (
        "float64_scale",
        DYN_STATE._replace(loss_scale=np.float64(8.0)),
        TypeError,
        "state.loss_scale",
        "dtype float64",
        _dtype_message(DYN, "loss_scale", "float32", "float64 of dtype float64 and shape ()"),
    ),
    (
        "weak_good_steps",
        DYN_STATE._replace(good_steps=jnp.asarray(0)),
        TypeError,
        "state.good_steps",
        "weakly typed",
        _dtype_message(
            DYN, "good_steps", "int32", f"{ARRAY} of dtype int32 and shape (), weakly typed"
        ),
    ),
    (
        "python_good_steps",
        DYN_STATE._replace(good_steps=0),
        TypeError,
        "state.good_steps",
        "int (0)",
        "DynamicLossScale: state.good_steps must be an array, got int (0)",
    ),
    (
        "float_overflows_until_backoff",
        DYN_STATE._replace(overflows_until_backoff=jnp.float32(1.0)),
        TypeError,
        "state.overflows_until_backoff",
        "dtype float32",
        _dtype_message(
            DYN, "overflows_until_backoff", "int32", f"{ARRAY} of dtype float32 and shape ()"
        ),
    ),
    (
        "vector_scale",
        DYN_STATE._replace(loss_scale=jnp.ones(2, jnp.float32)),
        ValueError,
        "state.loss_scale",
        "shape (2,)",
        _shape_message(DYN, "loss_scale", (2,)),
    ),
    (
        "stacked_for_pmap",
        jax.tree.map(lambda leaf: jnp.asarray(np.stack([leaf, leaf])), DYN_STATE),
        ValueError,
        "state.loss_scale",
        "shape (2,)",
        _shape_message(DYN, "loss_scale", (2,)),
    ),
]

_FIX_BAD_STATES = [
    (
        "dynamic_state",
        DYN_STATE,
        TypeError,
        "state",
        "DynamicLossScaleState",
        _kind_message(FIX, "DynamicLossScaleState"),
    ),
    ("dict", FIX_STATE._asdict(), TypeError, "state", "dict", _kind_message(FIX, "dict")),
    (
        "float16_scale",
        jls.FixedLossScaleState(device_array(4.0, np.float16)),
        TypeError,
        "state.loss_scale",
        "dtype float16",
        _dtype_message(FIX, "loss_scale", "float32", f"{ARRAY} of dtype float16 and shape ()"),
    ),
    (
        "python_scale",
        jls.FixedLossScaleState(4.0),
        TypeError,
        "state.loss_scale",
        "float (4.0)",
        "FixedLossScale: state.loss_scale must be an array, got float (4.0)",
    ),
    (
        "vector_scale",
        jls.FixedLossScaleState(device_array(np.ones(3))),
        ValueError,
        "state.loss_scale",
        "shape (3,)",
        _shape_message(FIX, "loss_scale", (3,)),
    ),
]

for _ls, _states in [(DYN, _DYN_BAD_STATES), (FIX, _FIX_BAD_STATES)]:
    for _method, _call in _state_calls(_ls).items():
        for _id, _state, _error, _arg, _value, _message in _states:
            add(
                f"{type(_ls).__name__}.{_method}-state={_id}",
                _call,
                _ls,
                _state,
                error=_error,
                arg=_arg,
                value=_value,
                message=_message,
                traced=True,
            )

# --- trees with leaves that are not numeric arrays -----------------------------------------

_BAD_TREES = [
    # (id, tree, path, what the message says of the leaf)
    ("str_leaf", {"a": jnp.ones(2), "w": "abc"}, "['w']", "has type str ('abc')"),
    ("object_leaf", {"a": jnp.ones(2), "w": OBJ}, "['w']", f"has type object ({OBJ!r})"),
    ("list_of_str", ["x", "y"], "[0]", "has type str ('x')"),
    ("float_leaf", {"a": jnp.ones(2), "w": 1.5}, "['w']", "has type float (1.5)"),
    ("str_root", "loss", "<root>", "has type str ('loss')"),
]
_BAD_DTYPE_TREES = [
    ("str_array", {"a": jnp.ones(2), "w": np.array(["s"])}, "['w']", "has dtype <U1"),
    ("object_array", {"w": np.array([OBJ])}, "['w']", "has dtype object"),
]

_TREE_CALLS = {
    # id: (call, the caller named in the message, the argument named in the message)
    "DynamicLossScale.scale": (lambda tree: DYN.scale(DYN_STATE, tree), "tree"),
    "DynamicLossScale.unscale": (lambda tree: DYN.unscale(DYN_STATE, tree), "grads"),
    "DynamicLossScale.update": (lambda tree: DYN.update(DYN_STATE, tree), "grads"),
    "FixedLossScale.unscale": (lambda tree: FIX.unscale(FIX_STATE, tree), "grads"),
    "FixedLossScale.update": (lambda tree: FIX.update(FIX_STATE, tree), "grads"),
    "all_finite": (jls.all_finite, "tree"),
    "count_non_finite": (jls.count_non_finite, "tree"),
    "loss_scaled.update": (lambda tree: TX.update(tree, TX_STATE, PARAMS), "updates"),
}

for _caller, (_call, _arg) in _TREE_CALLS.items():
    for _id, _tree, _path, _leaf in _BAD_TREES:
        if (_caller, _id) == ("all_finite", "float_leaf"):  # taken, as jmp takes it
            continue
        add(
            f"{_caller}-{_id}",
            _call,
            _tree,
            error=TypeError,
            arg=_arg,
            value=_leaf,
            message=f"{_caller}: {_arg} leaf at {_path} {_leaf}; {LEAF_TEXT}",
            traced=True,
        )
    for _id, _tree, _path, _leaf in _BAD_DTYPE_TREES:
        add(
            f"{_caller}-{_id}",
            _call,
            _tree,
            error=TypeError,
            arg=_arg,
            value=_leaf,
            message=(
                f"{_caller}: {_arg} leaf at {_path} {_leaf}; "
                "expected a numeric, boolean or float0 array"
            ),
            traced=True,
        )

# --- axis_name -----------------------------------------------------------------------------

_GRADS = {"w": device_array([1.0, 2.0])}
add(
    "DynamicLossScale.update-axis_name=list",
    lambda state, grads: DYN.update(state, grads, axis_name=["batch"]),
    DYN_STATE,
    _GRADS,
    error=TypeError,
    arg="axis_name",
    value="['batch']",
    traced=True,
)
add(
    "DynamicLossScale.update-axis_name=unbound",
    lambda state, grads: DYN.update(state, grads, axis_name="batch"),
    DYN_STATE,
    _GRADS,
    error=ValueError,
    arg="axis_name",
    value="'batch'",
    traced=True,
)
add(
    "all_finite-axis_name=list",
    lambda grads: jls.all_finite(grads, axis_name=["batch"]),
    _GRADS,
    error=TypeError,
    arg="axis_name",
    value="['batch']",
    traced=True,
)
add(
    "all_finite-axis_name=int",
    lambda grads: jls.all_finite(grads, axis_name=3),
    _GRADS,
    error=TypeError,
    arg="axis_name",
    value="3",
    traced=True,
)
add(
    "all_finite-axis_name=unbound",
    lambda grads: jls.all_finite(grads, axis_name="batch"),
    _GRADS,
    error=ValueError,
    arg="axis_name",
    value="'batch'",
    traced=True,
)
for _id, _axis_name in [("repeated", ("batch", "batch")), ("repeated_of_three", ("a", "b", "a"))]:
    _repeated = f"axis_name={_axis_name!r} names an axis more than once; each axis may appear once"
    add(
        f"loss_scaled-axis_name={_id}",
        lambda inner, ls, axis_name=_axis_name: jls.loss_scaled(inner, ls, axis_name=axis_name),
        optax.sgd(0.1),
        DYN,
        error=ValueError,
        arg="axis_name",
        value=repr(_axis_name),
        message=f"loss_scaled: {_repeated}",
    )
    for _caller, _call in [
        ("all_finite", lambda grads, a=_axis_name: jls.all_finite(grads, axis_name=a)),
        ("DynamicLossScale.update", lambda grads, a=_axis_name: DYN.update(DYN_STATE, grads, a)),
        ("FixedLossScale.update", lambda grads, a=_axis_name: FIX.update(FIX_STATE, grads, a)),
    ]:
        add(
            f"{_caller}-axis_name={_id}",
            _call,
            _GRADS,
            error=ValueError,
            arg="axis_name",
            value=repr(_axis_name),
            message=f"{_caller}: {_repeated}",
            traced=True,
        )
add(
    "loss_scaled-axis_name=list",
    lambda inner, ls: jls.loss_scaled(inner, ls, axis_name=["batch"]),
    optax.sgd(0.1),
    DYN,
    error=TypeError,
    arg="axis_name",
    value="['batch']",
)

# --- loss_scaled and its transformation ----------------------------------------------------


def _inner_message(value, got, hint=""):
    return (
        f"loss_scaled(inner={value}): inner must be an optax GradientTransformation, "
        f"got {got}{hint}"
    )


def _loss_scale_message(value, got):
    return (
        f"loss_scaled(loss_scale={value}): loss_scale must be a jax_lossscale.LossScale "
        f"such as DynamicLossScale(), got {got}"
    )


_CALL_IT = "; call it first, e.g. optax.adam(1e-3)"
for _id, _inner, _got, _hint in [
    ("factory", optax.adam, "function", _CALL_IT),
    ("MultiSteps_class", optax.MultiSteps, "type", _CALL_IT),
    ("str", "adam", "str", ""),
    ("none", None, "NoneType", ""),
    ("bare_function", optax.identity().update, "function", _CALL_IT),
]:
    add(
        f"loss_scaled-inner={_id}",
        jls.loss_scaled,
        _inner,
        DYN,
        error=TypeError,
        arg="inner",
        value=repr(_inner),
        message=_inner_message(repr(_inner), _got, _hint),
    )
add(
    "loss_scaled-inner=loss_scale_swapped",
    jls.loss_scaled,
    DYN,
    optax.adam(1e-3),
    error=TypeError,
    arg="inner",
    value="DynamicLossScale(",
)

for _id, _ls, _got in [
    ("class", jls.DynamicLossScale, "the class DynamicLossScale; instantiate it first"),
    ("str", "dynamic", "str"),
    ("number", 128, "int"),
    ("none", None, "NoneType"),
    ("state", FIX_STATE, "FixedLossScaleState"),
]:
    _value = repr(_ls)
    assert len(_value) <= 80  # shown whole
    add(
        f"loss_scaled-loss_scale={_id}",
        jls.loss_scaled,
        optax.adam(1e-3),
        _ls,
        error=TypeError,
        arg="loss_scale",
        value=_value,
        message=_loss_scale_message(_value, _got),
    )

add(
    "loss_scaled.init-inner_holds_loss_scaled",
    lambda params: jls.loss_scaled(TX, DYN).init(params),
    PARAMS,
    error=ValueError,
    arg="inner",
    value="loss_scaled",
    message=(
        "loss_scaled: inner already holds a loss_scaled transformation; the gradients would be "
        "unscaled twice. Use one loss_scaled around the whole optimizer"
    ),
    traced=True,
)
add(
    "loss_scaled.init-non_scalar_user_scale",
    lambda params: jls.loss_scaled(optax.sgd(0.1), _NonScalarScale(2.0)).init(params),
    PARAMS,
    error=TypeError,
    arg="__call__",
    value="shape (2,)",
    message=(
        f"_NonScalarScale.__call__ must return a float32 scalar array, got {ARRAY} of dtype "
        "float32 and shape (2,)"
    ),
    traced=True,
)

_PY_APPLY_TX = jls.loss_scaled(optax.sgd(0.1), _PythonShouldApply(2.0))
add(
    "loss_scaled.update-python_should_apply",
    lambda grads, state: _PY_APPLY_TX.update(grads, state),
    _GRADS,
    _PY_APPLY_TX.init(PARAMS),
    error=TypeError,
    arg="should_apply",
    value="True",
    message=(
        "loss_scaled: _PythonShouldApply.adjust must return should_apply as a bool scalar "
        "array, got True"
    ),
    traced=True,
)


def _tx_state_message(got):
    return f"loss_scaled.update: state must be the LossScaledState returned by init(), got {got}"


for _id, _state, _error, _arg, _value, _message in [
    (
        "inner_state_only",
        TX_STATE.inner_state,
        TypeError,
        "state",
        "tuple",
        _tx_state_message("tuple"),
    ),
    ("dict", TX_STATE._asdict(), TypeError, "state", "dict", _tx_state_message("dict")),
    ("none", None, TypeError, "state", "NoneType", _tx_state_message("NoneType")),
    (
        "loss_scale_state",
        DYN_STATE,
        TypeError,
        "state",
        "DynamicLossScaleState",
        _tx_state_message("DynamicLossScaleState"),
    ),
    (
        "stats_dict",
        TX_STATE._replace(stats=TX_STATE.stats._asdict()),
        TypeError,
        "state.stats",
        "dict",
        "loss_scaled.update: state.stats must be the StepStats returned by init(), got dict",
    ),
    (
        "weak_skipped_steps",
        TX_STATE._replace(stats=TX_STATE.stats._replace(skipped_steps=jnp.asarray(0))),
        TypeError,
        "state.stats.skipped_steps",
        "weakly typed",
        "loss_scaled.update: state.stats.skipped_steps must have dtype int32 (not weakly "
        f"typed), got {ARRAY} of dtype int32 and shape (), weakly typed; build states with "
        "init()",
    ),
    (
        "wrong_loss_scale_state",
        TX_STATE._replace(loss_scale_state=FIX_STATE),
        TypeError,
        "state",
        "FixedLossScaleState",
        _kind_message(DYN, "FixedLossScaleState"),
    ),
    (
        "vector_loss_scale",
        TX_STATE._replace(loss_scale_state=DYN_STATE._replace(loss_scale=jnp.ones(2, jnp.float32))),
        ValueError,
        "state.loss_scale",
        "shape (2,)",
        _shape_message(DYN, "loss_scale", (2,)),
    ),
    (
        "inner_state_of_another_optimizer",
        SGD_TX_STATE,
        (TypeError, ValueError),
        "inner_state",
        "EmptyState",
        None,
    ),
]:
    add(
        f"loss_scaled.update-state={_id}",
        lambda grads, state: TX.update(grads, state, PARAMS),
        _GRADS,
        _state,
        error=_error,
        arg=_arg,
        value=_value,
        message=_message,
        traced=True,
    )

add(
    "loss_scaled.update-axis_name=unbound",
    lambda grads, state: jls.loss_scaled(optax.sgd(0.1), DYN, "batch").update(grads, state),
    _GRADS,
    SGD_TX_STATE,
    error=ValueError,
    arg="axis_name",
    value="'batch'",
    traced=True,
)

# --- get_loss_scale and get_loss_scale_stats -----------------------------------------------

for _fn in [jls.get_loss_scale, jls.get_loss_scale_stats]:
    _name = _fn.__name__
    for _id, _opt_state, _got in [
        ("adam_state", optax.adam(1e-3).init(PARAMS), "tuple"),
        ("none", None, "NoneType"),
        ("loss_scale_state", DYN_STATE, "DynamicLossScaleState"),
        ("transformation", TX, "GradientTransformationExtraArgs"),
    ]:
        add(
            f"{_name}-opt_state={_id}",
            _fn,
            _opt_state,
            error=LookupError,
            arg="opt_state",
            value=f"({_got})",
            message=(
                f"{_name}: opt_state ({_got}) holds no LossScaledState; build the optimizer "
                "with jax_lossscale.loss_scaled(inner, loss_scale)"
            ),
        )
    add(
        f"{_name}-opt_state=two_wrappers",
        _fn,
        {"a": TX_STATE, "b": (SGD_TX_STATE,)},
        error=ValueError,
        arg="opt_state",
        value="2 LossScaledStates (at ['a'], ['b'][0])",
        message=(
            f"{_name}: opt_state holds 2 LossScaledStates (at ['a'], ['b'][0]); pass the part "
            "of the state that holds the one you mean"
        ),
    )

# --- serialize, deserialize, from_config, get, register ------------------------------------

for _id, _value in [
    ("int", 1),
    ("none", None),
    ("class", jls.DynamicLossScale),
    ("state", FIX_STATE),
    ("config", {"class_name": "FixedLossScale", "config": {"loss_scale_value": 2.0}}),
]:
    add(
        f"serialize-loss_scale={_id}",
        jls.serialize,
        _value,
        error=TypeError,
        arg="loss_scale",
        value=repr(_value),
        message=f"serialize(loss_scale={_value!r}): loss_scale must be a LossScale instance",
    )
add(
    "serialize-loss_scale=unregistered",
    jls.serialize,
    _PythonShouldApply(2.0),
    error=ValueError,
    arg="loss_scale",
    value="_PythonShouldApply(loss_scale_value=2.0)",
    message=(
        "serialize(loss_scale=_PythonShouldApply(loss_scale_value=2.0)): _PythonShouldApply is "
        "not registered, so it could not be deserialized; decorate the class with "
        "@jax_lossscale.register"
    ),
)


def _deserialize_message(config, requirement):
    return f"deserialize(config={config!r}): {requirement}"


_EXACT_KEYS = "config must have exactly the keys 'class_name' and 'config'"
for _id, _config, _error, _requirement in [
    ("json_text", '{"class_name": "FixedLossScale", "config": {}}', TypeError, None),
    ("malformed_json", '{"class_name":', TypeError, None),
    ("list", [["class_name", "FixedLossScale"]], TypeError, None),
    ("none", None, TypeError, None),
    ("missing_config", {"class_name": "FixedLossScale"}, ValueError, _EXACT_KEYS),
    ("missing_class_name", {"config": {"loss_scale_value": 2.0}}, ValueError, _EXACT_KEYS),
    (
        "extra_key",
        {"class_name": "FixedLossScale", "config": {}, "version": 1},
        ValueError,
        _EXACT_KEYS,
    ),
]:
    add(
        f"deserialize-config={_id}",
        jls.deserialize,
        _config,
        error=_error,
        arg="config",
        value=repr(_config),
        message=_deserialize_message(_config, _requirement or "config must be a dict"),
    )

for _id, _class_name in [
    ("unknown", "AdaptiveLossScale"),
    ("base_class", "LossScale"),
    ("lower_case", "dynamiclossscale"),
    ("int", 5),
    ("list", ["FixedLossScale"]),
]:
    _config = {"class_name": _class_name, "config": {}}
    add(
        f"deserialize-class_name={_id}",
        jls.deserialize,
        _config,
        error=ValueError,
        arg="class_name",
        value=repr(_class_name),
        # The list of known names grows with every class other tests register.
        message=None,
    )

for _id, _inner_config, _error, _arg, _value, _message in [
    (
        "list",
        [2.0],
        TypeError,
        "config",
        "[2.0]",
        "FixedLossScale.from_config(config=[2.0]): config must be a dict",
    ),
    (
        "none",
        None,
        TypeError,
        "config",
        "None",
        "FixedLossScale.from_config(config=None): config must be a dict",
    ),
    (
        "unknown_key",
        {"loss_scale_value": 2.0, "scale": 2.0},
        ValueError,
        "scale",
        "{'loss_scale_value': 2.0, 'scale': 2.0}",
        "FixedLossScale.from_config(config={'loss_scale_value': 2.0, 'scale': 2.0}): unknown "
        "keys ['scale']; expected some of ['loss_scale_value']",
    ),
    (
        "bad_value",
        {"loss_scale_value": "2"},
        TypeError,
        "loss_scale_value",
        "'2'",
        "FixedLossScale(loss_scale_value='2'): loss_scale_value must be a real number",
    ),
    (
        "value_out_of_range",
        {"loss_scale_value": 0.5},
        ValueError,
        "loss_scale_value",
        "0.5",
        "FixedLossScale(loss_scale_value=0.5): loss_scale_value must be >= 1",
    ),
    ("missing_required_key", {}, TypeError, "loss_scale_value", "from_config(config={})", None),
]:
    add(
        f"deserialize-config.config={_id}",
        jls.deserialize,
        {"class_name": "FixedLossScale", "config": _inner_config},
        error=_error,
        arg=_arg,
        value=_value,
        message=_message,
    )

add(
    "DynamicLossScale.from_config-int_key",
    jls.DynamicLossScale.from_config,
    {1: 2},
    error=ValueError,
    arg="config",
    value="{1: 2}",
)
add(
    "DynamicLossScale.from_config-bad_value",
    jls.DynamicLossScale.from_config,
    {"increment_period": "10"},
    error=TypeError,
    arg="increment_period",
    value="'10'",
    message="DynamicLossScale(increment_period='10'): increment_period must be an integer >= 1",
)
add(
    "DynamicLossScale.from_config-str",
    jls.DynamicLossScale.from_config,
    '{"increment_period": 10}',
    error=TypeError,
    arg="config",
    value="'{\"increment_period\": 10}'",
    message=(
        "DynamicLossScale.from_config(config='{\"increment_period\": 10}'): config must be a dict"
    ),
)

_GET_TEXT = "identifier must be None, a number, 'dynamic', a dict from serialize() or a LossScale"
for _id, _identifier in [
    ("unknown_str", "static"),
    ("capitalised", "Dynamic"),
    ("bool", True),
    ("complex", 2j),
    ("list", [1024]),
    ("class", jls.DynamicLossScale),
    ("jax_vector", jnp.full(2, 1024.0)),
]:
    add(
        f"get-identifier={_id}",
        jls.get,
        _identifier,
        error=ValueError,
        arg="identifier",
        value=repr(_identifier),
        message=f"get(identifier={_identifier!r}): {_GET_TEXT}",
    )
for _id, _identifier, _requirement in [
    ("zero", 0, ">= 1"),
    ("nan", NAN, "finite"),
    ("below_one", 0.5, ">= 1"),
]:
    add(
        f"get-identifier={_id}",
        jls.get,
        _identifier,
        error=ValueError,
        arg="loss_scale_value",
        value=repr(_identifier),
        message=(
            f"FixedLossScale(loss_scale_value={_identifier!r}): loss_scale_value must be "
            f"{_requirement}"
        ),
    )
add(
    "get-identifier=malformed_dict",
    jls.get,
    {"class_name": "FixedLossScale"},
    error=ValueError,
    arg="config",
    value="{'class_name': 'FixedLossScale'}",
    message=_deserialize_message({"class_name": "FixedLossScale"}, _EXACT_KEYS),
)

for _id, _cls in [
    ("int", int),
    ("instance", FIX),
    ("str", "FixedLossScale"),
    ("none", None),
    ("state_class", jls.FixedLossScaleState),
]:
    add(
        f"register-cls={_id}",
        jls.register,
        _cls,
        error=TypeError,
        arg="cls",
        value=repr(_cls),
        message=f"register(cls={_cls!r}): cls must be a subclass of LossScale",
    )
add(
    "register-cls=abstract_base",
    jls.register,
    jls.LossScale,
    error=TypeError,
    arg="cls",
    value=repr(jls.LossScale),
    message=(
        f"register(cls={jls.LossScale!r}): cls must be concrete; it leaves abstract "
        "['adjust', 'get_config', 'init']"
    ),
)
add(
    "register-cls=abstract_subclass",
    jls.register,
    _HalfDone,
    error=TypeError,
    arg="cls",
    value=repr(_HalfDone),
    message=(
        f"register(cls={_HalfDone!r}): cls must be concrete; it leaves abstract "
        "['adjust', 'get_config']"
    ),
)
add(
    "register-cls=name_taken",
    jls.register,
    IMPOSTOR,
    error=ValueError,
    arg="cls",
    value=repr(IMPOSTOR),
)

# --- non_finite_paths ----------------------------------------------------------------------

for _id, _counts, _path, _shown in [
    ("str", {"a": "x"}, "['a']", "'x'"),
    ("object", {"a": OBJ}, "['a']", repr(OBJ)),
    ("float", {"a": 1.0}, "['a']", "1.0"),
    ("bool", [True], "[0]", "True"),
    ("gradients", {"a": device_array([1.0, np.nan])}, "['a']", "array([ 1., nan], dtype=float32)"),
]:
    add(
        f"non_finite_paths-counts={_id}",
        jls.non_finite_paths,
        _counts,
        error=TypeError,
        arg="counts",
        value=_shown,
        message=(
            f"non_finite_paths: counts leaf at {_path} is {_shown}; pass the tree returned by "
            "count_non_finite"
        ),
    )


# --- the test ------------------------------------------------------------------------------


def _params():
    for case in CASES:
        yield pytest.param(case, "eager", id=case.id)
        if case.traced:
            yield pytest.param(case, "jit", id=f"{case.id}-jit")


def _run(case: Case, mode: str):
    if mode == "eager":
        return case.call(*case.args)
    # Arrays become traced arguments of jit; everything else is closed over as it is.
    leaves, treedef = jax.tree.flatten(case.args)
    traced = [isinstance(leaf, jax.Array) for leaf in leaves]

    def call(arrays):
        arrays = iter(arrays)
        filled = [next(arrays) if t else leaf for leaf, t in zip(leaves, traced, strict=True)]
        return case.call(*jax.tree.unflatten(treedef, filled))

    return jax.jit(call)([leaf for leaf, t in zip(leaves, traced, strict=True) if t])


def _fingerprint(tree: Any) -> tuple:
    """Everything observable about `tree`: structure, dtypes, weak types, shapes and bytes."""

    def describe(leaf):
        if isinstance(leaf, jax.Array | np.ndarray | np.generic):
            host = np.asarray(jax.device_get(leaf))
            weak = getattr(leaf, "weak_type", False)
            return type(leaf), host.dtype, host.shape, weak, host.tobytes()
        try:
            return type(leaf), repr(leaf)
        except ValueError:  # an int beyond Python's limit on digits for str(), or holding one
            return type(leaf), pickle.dumps(leaf)

    # Loss scales are static pytrees (no leaves); their repr shows every hyperparameter.
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, jls.LossScale))
    return treedef, [describe(leaf) for leaf in leaves]


def _pattern(text: str) -> str:
    return re.escape(text).replace(re.escape(ARRAY), r"(ArrayImpl|DynamicJaxprTracer)")


def _registry() -> dict:
    return dict(jls._serialization._REGISTRY)


def test_case_ids_are_unique():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


@pytest.mark.parametrize(("case", "mode"), list(_params()))
def test_bad_input_is_refused_naming_argument_and_value(case: Case, mode: str):
    before = _fingerprint(case.args), _registry(), repr(DYN), repr(FIX)
    try:
        _run(case, mode)
    except Exception as error:  # the type is checked below, with the message in view
        raised = error
    else:
        pytest.fail(f"no exception: {case.id}")

    message = str(raised)
    expected = case.error if isinstance(case.error, tuple) else (case.error,)
    assert type(raised) in expected, f"{type(raised).__name__}: {message}"
    assert case.arg in message, message
    assert re.search(_pattern(case.value), message), message
    if case.message is not None:
        assert re.fullmatch(_pattern(case.message), message), f"\n{message}\n!=\n{case.message}"
    assert (_fingerprint(case.args), _registry(), repr(DYN), repr(FIX)) == before


@pytest.mark.parametrize(
    ("value", "what"),
    [
        (device_array([1.0]), "float32 and shape (1,)"),
        (device_array(2 + 0j, np.complex64), "complex64 and shape ()"),
        (jnp.bool_(True), "bool and shape ()"),
    ],
    ids=["vector", "complex", "bool"],
)
def test_a_traced_initial_scale_is_taken_only_as_a_real_scalar(value, what):
    """A traced initial scale is taken (it only goes into the state); one of another shape or
    dtype is refused at trace time, as a concrete one is."""
    with pytest.raises(TypeError) as excinfo:
        jax.jit(lambda v: jls.DynamicLossScale(initial_loss_scale=v).init())(value)
    assert re.fullmatch(
        r"DynamicLossScale\(initial_loss_scale=.*Tracer.*\): initial_loss_scale must be a real "
        rf"number, got DynamicJaxprTracer of dtype {re.escape(what)}",
        str(excinfo.value),
    ), str(excinfo.value)


@pytest.mark.parametrize(
    ("make", "held"),
    [
        (lambda value: jls.FixedLossScale(value), lambda made: made.loss_scale_value),
        (
            lambda value: jls.DynamicLossScale(initial_loss_scale=value),
            lambda made: made.initial_loss_scale,
        ),
        (
            lambda value: jls.DynamicLossScale(max_loss_scale=value),
            lambda made: made.max_loss_scale,
        ),
    ],
    ids=["FixedLossScale", "initial_loss_scale", "max_loss_scale"],
)
def test_numpys_printed_float32_maximum_is_taken_as_the_float32_maximum(make, held):
    """3.4028235e+38, as numpy prints the float32 maximum, rounds to it in float32 and is
    taken as it, as small values are taken rounded; the next value rounds to inf."""
    assert held(make(3.4028235e38)) == float(np.finfo(np.float32).max)
    with pytest.raises(ValueError, match=re.escape(F32_MAX_TEXT)):
        make(3.4028236e38)


def test_a_bound_on_the_norm_at_numpys_printed_float32_maximum_is_taken():
    tx = jls.loss_scaled(optax.sgd(0.1), FIX, skip_grad_norm_above=3.4028235e38)
    updates, _ = tx.update({"w": device_array([4.0, 8.0])}, tx.init(PARAMS), PARAMS)
    np.testing.assert_array_equal(updates["w"], np.float32([-0.1, -0.2]))


# --- None leaves are not bad input: they are ignored (docs/optax-wrapper.md) ----------------

NONE_GRADS = {"b": None, "w": device_array([8.0, np.inf]), "z": (None, device_array([16.0]))}


def test_none_leaves_are_ignored_by_all_finite_and_count_non_finite():
    finite, counts = jitted(lambda g: (jls.all_finite(g), jls.count_non_finite(g)), NONE_GRADS)
    assert not bool(finite)
    chex.assert_trees_all_equal(counts, {"b": None, "w": jnp.int32(1), "z": (None, jnp.int32(0))})
    assert jls.non_finite_paths(counts) == {"w": 1}
    assert bool(jitted(jls.all_finite, {"b": None, "z": (None,)}))
    assert bool(jitted(jls.all_finite, None))


def test_none_leaves_pass_through_scale_unscale_and_update():
    def run(state, grads):
        return DYN.scale(state, grads), DYN.unscale(state, grads), DYN.update(state, grads)

    scaled, unscaled, (state, should_apply) = jitted(run, DYN_STATE, NONE_GRADS)
    chex.assert_trees_all_equal(
        scaled, {"b": None, "w": jnp.array([64.0, jnp.inf]), "z": (None, jnp.array([128.0]))}
    )
    chex.assert_trees_all_equal(
        unscaled, {"b": None, "w": jnp.array([1.0, jnp.inf]), "z": (None, jnp.array([2.0]))}
    )
    assert not bool(should_apply)
    chex.assert_trees_all_equal(
        state, jls.DynamicLossScaleState(jnp.float32(4.0), jnp.int32(0), jnp.int32(1))
    )

    state, should_apply = jitted(DYN.update, DYN_STATE, {"b": None})
    assert bool(should_apply)
    chex.assert_trees_all_equal(state, DYN_STATE._replace(good_steps=jnp.int32(1)))


def test_none_leaves_pass_through_loss_scaled_update(jit_or_eager):
    tx = jls.loss_scaled(optax.sgd(0.5), DYN)
    params = {"b": None, "w": jnp.array([1.0, 2.0])}
    opt_state = tx.init(params)
    scaled_grads = {"b": None, "w": jnp.array([8.0, 16.0])}
    updates, opt_state = jit_or_eager(tx.update, scaled_grads, opt_state, params)
    chex.assert_trees_all_equal(updates, {"b": None, "w": jnp.array([-0.5, -1.0])})
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 0
