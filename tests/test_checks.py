"""The checks (`_checks`): hyperparameters, states and gradient leaves are refused loudly,
edge values accepted and normalised, nothing mutated (docs/reliability.md)."""

import copy
import dataclasses
import math
import re
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

from helpers import device_array

F32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2**31 - 1
NAN, INF = math.nan, math.inf

D, F = "DynamicLossScale", "FixedLossScale"

# (class name, constructor kwargs, argument the message must name, exception type)
_BAD_HYPERPARAMETERS = [
    # initial_loss_scale
    (D, {"initial_loss_scale": "1024"}, "initial_loss_scale", TypeError),
    (D, {"initial_loss_scale": None}, "initial_loss_scale", TypeError),
    (D, {"initial_loss_scale": True}, "initial_loss_scale", TypeError),
    (D, {"initial_loss_scale": [1024.0]}, "initial_loss_scale", TypeError),
    (D, {"initial_loss_scale": 1 + 0j}, "initial_loss_scale", TypeError),
    (D, {"initial_loss_scale": NAN}, "initial_loss_scale", ValueError),
    (D, {"initial_loss_scale": np.float32(NAN)}, "initial_loss_scale", ValueError),
    (D, {"initial_loss_scale": INF}, "initial_loss_scale", ValueError),
    (D, {"initial_loss_scale": -INF}, "initial_loss_scale", ValueError),
    (D, {"initial_loss_scale": 0.0}, "initial_loss_scale", ValueError),
    (D, {"initial_loss_scale": 0}, "initial_loss_scale", ValueError),
    (D, {"initial_loss_scale": -2.0}, "initial_loss_scale", ValueError),
    (D, {"initial_loss_scale": 1e39}, "initial_loss_scale", ValueError),
    (D, {"initial_loss_scale": 2**200}, "initial_loss_scale", ValueError),
    (D, {"initial_loss_scale": 0.5}, "initial_loss_scale", ValueError),  # below min 1.0
    # increment_period
    (D, {"increment_period": "2000"}, "increment_period", TypeError),
    (D, {"increment_period": None}, "increment_period", TypeError),
    (D, {"increment_period": True}, "increment_period", TypeError),
    (D, {"increment_period": 2.0}, "increment_period", TypeError),
    (D, {"increment_period": np.float32(2.0)}, "increment_period", TypeError),
    (D, {"increment_period": [2]}, "increment_period", TypeError),
    (D, {"increment_period": NAN}, "increment_period", TypeError),
    (D, {"increment_period": INF}, "increment_period", TypeError),
    (D, {"increment_period": -INF}, "increment_period", TypeError),
    (D, {"increment_period": 0}, "increment_period", ValueError),
    (D, {"increment_period": -5}, "increment_period", ValueError),
    (D, {"increment_period": 2**31}, "increment_period", ValueError),
    (D, {"increment_period": np.int64(2**40)}, "increment_period", ValueError),
    # multiplier
    (D, {"multiplier": "2"}, "multiplier", TypeError),
    (D, {"multiplier": None}, "multiplier", TypeError),
    (D, {"multiplier": True}, "multiplier", TypeError),
    (D, {"multiplier": [2.0]}, "multiplier", TypeError),
    (D, {"multiplier": NAN}, "multiplier", ValueError),
    (D, {"multiplier": INF}, "multiplier", ValueError),
    (D, {"multiplier": -INF}, "multiplier", ValueError),
    (D, {"multiplier": 0.0}, "multiplier", ValueError),
    (D, {"multiplier": -2.0}, "multiplier", ValueError),
    (D, {"multiplier": 1}, "multiplier", ValueError),
    (D, {"multiplier": 1.0}, "multiplier", ValueError),
    (D, {"multiplier": 0.5}, "multiplier", ValueError),
    (D, {"multiplier": 1e39}, "multiplier", ValueError),
    # backoff_factor (None is allowed)
    (D, {"backoff_factor": "0.5"}, "backoff_factor", TypeError),
    (D, {"backoff_factor": True}, "backoff_factor", TypeError),
    (D, {"backoff_factor": [0.5]}, "backoff_factor", TypeError),
    (D, {"backoff_factor": NAN}, "backoff_factor", ValueError),
    (D, {"backoff_factor": INF}, "backoff_factor", ValueError),
    (D, {"backoff_factor": -INF}, "backoff_factor", ValueError),
    (D, {"backoff_factor": 0}, "backoff_factor", ValueError),
    (D, {"backoff_factor": 0.0}, "backoff_factor", ValueError),
    (D, {"backoff_factor": -0.5}, "backoff_factor", ValueError),
    (D, {"backoff_factor": 1}, "backoff_factor", ValueError),
    (D, {"backoff_factor": 1.0}, "backoff_factor", ValueError),
    (D, {"backoff_factor": 1.5}, "backoff_factor", ValueError),
    (D, {"backoff_factor": 1e39}, "backoff_factor", ValueError),
    # min_loss_scale
    (D, {"min_loss_scale": "1"}, "min_loss_scale", TypeError),
    (D, {"min_loss_scale": None}, "min_loss_scale", TypeError),
    (D, {"min_loss_scale": False}, "min_loss_scale", TypeError),
    (D, {"min_loss_scale": [1.0]}, "min_loss_scale", TypeError),
    (D, {"min_loss_scale": NAN}, "min_loss_scale", ValueError),
    (D, {"min_loss_scale": INF}, "min_loss_scale", ValueError),
    (D, {"min_loss_scale": -INF}, "min_loss_scale", ValueError),
    (D, {"min_loss_scale": 0}, "min_loss_scale", ValueError),
    (D, {"min_loss_scale": 0.0}, "min_loss_scale", ValueError),
    (D, {"min_loss_scale": -1.0}, "min_loss_scale", ValueError),
    (D, {"min_loss_scale": 1e39}, "min_loss_scale", ValueError),
    # max_loss_scale (None is allowed)
    (D, {"max_loss_scale": "65536"}, "max_loss_scale", TypeError),
    (D, {"max_loss_scale": True}, "max_loss_scale", TypeError),
    (D, {"max_loss_scale": [65536.0]}, "max_loss_scale", TypeError),
    (D, {"max_loss_scale": NAN}, "max_loss_scale", ValueError),
    (D, {"max_loss_scale": INF}, "max_loss_scale", ValueError),
    (D, {"max_loss_scale": -INF}, "max_loss_scale", ValueError),
    (D, {"max_loss_scale": 0}, "max_loss_scale", ValueError),
    (D, {"max_loss_scale": -1.0}, "max_loss_scale", ValueError),
    (D, {"max_loss_scale": 1e39}, "max_loss_scale", ValueError),
    (D, {"max_loss_scale": 1024.0}, "max_loss_scale", ValueError),  # below initial 2**15
    # hysteresis
    (D, {"hysteresis": "2"}, "hysteresis", TypeError),
    (D, {"hysteresis": None}, "hysteresis", TypeError),
    (D, {"hysteresis": True}, "hysteresis", TypeError),
    (D, {"hysteresis": 2.0}, "hysteresis", TypeError),
    (D, {"hysteresis": [2]}, "hysteresis", TypeError),
    (D, {"hysteresis": NAN}, "hysteresis", TypeError),
    (D, {"hysteresis": INF}, "hysteresis", TypeError),
    (D, {"hysteresis": 0}, "hysteresis", ValueError),
    (D, {"hysteresis": -1}, "hysteresis", ValueError),
    (D, {"hysteresis": 2**31}, "hysteresis", ValueError),
    # consecutive_hysteresis
    (D, {"consecutive_hysteresis": 1}, "consecutive_hysteresis", TypeError),
    (D, {"consecutive_hysteresis": 0}, "consecutive_hysteresis", TypeError),
    (D, {"consecutive_hysteresis": 1.0}, "consecutive_hysteresis", TypeError),
    (D, {"consecutive_hysteresis": "yes"}, "consecutive_hysteresis", TypeError),
    (D, {"consecutive_hysteresis": None}, "consecutive_hysteresis", TypeError),
    (D, {"consecutive_hysteresis": [True]}, "consecutive_hysteresis", TypeError),
    # cross-argument violations
    (D, {"initial_loss_scale": 8.0, "max_loss_scale": 4.0}, "max_loss_scale", ValueError),
    (D, {"initial_loss_scale": 2.0, "min_loss_scale": 4.0}, "initial_loss_scale", ValueError),
    (D, {"initial_loss_scale": 1e-4, "min_loss_scale": 1e-3}, "initial_loss_scale", ValueError),
    # FixedLossScale
    (F, {"loss_scale_value": "128"}, "loss_scale_value", TypeError),
    (F, {"loss_scale_value": None}, "loss_scale_value", TypeError),
    (F, {"loss_scale_value": True}, "loss_scale_value", TypeError),
    (F, {"loss_scale_value": [128.0]}, "loss_scale_value", TypeError),
    (F, {"loss_scale_value": NAN}, "loss_scale_value", ValueError),
    (F, {"loss_scale_value": INF}, "loss_scale_value", ValueError),
    (F, {"loss_scale_value": -INF}, "loss_scale_value", ValueError),
    (F, {"loss_scale_value": 0}, "loss_scale_value", ValueError),
    (F, {"loss_scale_value": -128.0}, "loss_scale_value", ValueError),
    (F, {"loss_scale_value": 0.5}, "loss_scale_value", ValueError),
    (F, {"loss_scale_value": 1e39}, "loss_scale_value", ValueError),
]


def _row_id(row):
    cls_name, kwargs, _, _ = row
    return f"{cls_name}-" + "-".join(f"{k}={v!r}" for k, v in kwargs.items())


@pytest.mark.parametrize(
    ("cls_name", "kwargs", "arg", "error"),
    _BAD_HYPERPARAMETERS,
    ids=[_row_id(row) for row in _BAD_HYPERPARAMETERS],
)
def test_bad_hyperparameter_is_rejected_naming_argument_and_value(cls_name, kwargs, arg, error):
    cls = getattr(jls, cls_name)
    with pytest.raises(error) as excinfo:
        cls(**kwargs)
    assert type(excinfo.value) is error
    message = str(excinfo.value)
    assert message.startswith(f"{cls_name}({arg}={kwargs[arg]!r}): {arg} must be "), message


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: jls.DynamicLossScale(increment_period=0),
            ValueError,
            "DynamicLossScale(increment_period=0): increment_period must be an integer >= 1 "
            "and <= 2147483647",
        ),
        (
            lambda: jls.DynamicLossScale(increment_period=2.0),
            TypeError,
            "DynamicLossScale(increment_period=2.0): increment_period must be an integer >= 1",
        ),
        (
            lambda: jls.DynamicLossScale(multiplier=1),
            ValueError,
            "DynamicLossScale(multiplier=1): multiplier must be > 1",
        ),
        (
            lambda: jls.DynamicLossScale(backoff_factor=1.5),
            ValueError,
            "DynamicLossScale(backoff_factor=1.5): backoff_factor must be None or in the open "
            "interval (0, 1)",
        ),
        (
            lambda: jls.DynamicLossScale(min_loss_scale=0),
            ValueError,
            "DynamicLossScale(min_loss_scale=0): min_loss_scale must be > 0",
        ),
        (
            lambda: jls.DynamicLossScale(initial_loss_scale=1e39),
            ValueError,
            "DynamicLossScale(initial_loss_scale=1e+39): initial_loss_scale must be at most the "
            "float32 maximum (3.4028234663852886e+38)",
        ),
        (
            lambda: jls.DynamicLossScale(initial_loss_scale=NAN),
            ValueError,
            "DynamicLossScale(initial_loss_scale=nan): initial_loss_scale must be finite",
        ),
        (
            lambda: jls.DynamicLossScale(consecutive_hysteresis="yes"),
            TypeError,
            "DynamicLossScale(consecutive_hysteresis='yes'): consecutive_hysteresis must be a bool",
        ),
        (
            lambda: jls.DynamicLossScale(initial_loss_scale=2**15, max_loss_scale=1024),
            ValueError,
            "DynamicLossScale(max_loss_scale=1024): max_loss_scale must be None or "
            ">= initial_loss_scale (32768.0)",
        ),
        (
            lambda: jls.DynamicLossScale(initial_loss_scale=2, min_loss_scale=4),
            ValueError,
            "DynamicLossScale(initial_loss_scale=2): initial_loss_scale must be "
            ">= min_loss_scale (4.0)",
        ),
        (
            lambda: jls.DynamicLossScale(hysteresis="2"),
            TypeError,
            "DynamicLossScale(hysteresis='2'): hysteresis must be an integer >= 1",
        ),
        (
            lambda: jls.FixedLossScale(0.5),
            ValueError,
            "FixedLossScale(loss_scale_value=0.5): loss_scale_value must be >= 1",
        ),
        (
            lambda: jls.FixedLossScale(None),
            TypeError,
            "FixedLossScale(loss_scale_value=None): loss_scale_value must be a real number",
        ),
    ],
)
def test_bad_hyperparameter_full_message(make, error, message):
    with pytest.raises(error) as excinfo:
        make()
    assert str(excinfo.value) == message


def test_loss_scale_args_are_keyword_only_after_multiplier():
    with pytest.raises(TypeError):
        jls.DynamicLossScale(2.0**15, 2000, 2.0, 0.5)


# --- good edge values ----------------------------------------------------------------------


def _assert_field(obj, name, value, kind):
    got = getattr(obj, name)
    assert type(got) is kind, (name, type(got))
    assert got == value


def test_numpy_scalars_are_accepted_and_normalised_to_python_numbers():
    ls = jls.DynamicLossScale(
        initial_loss_scale=np.float32(1024.0),
        increment_period=np.int64(5),
        multiplier=np.float32(2.0),
        backoff_factor=np.float64(0.25),
        min_loss_scale=np.float16(0.5),
        max_loss_scale=np.int32(4096),
        hysteresis=np.int8(3),
        consecutive_hysteresis=np.bool_(True),
    )
    _assert_field(ls, "initial_loss_scale", 1024.0, float)
    _assert_field(ls, "increment_period", 5, int)
    _assert_field(ls, "multiplier", 2.0, float)
    _assert_field(ls, "backoff_factor", 0.25, float)
    _assert_field(ls, "min_loss_scale", 0.5, float)
    _assert_field(ls, "max_loss_scale", 4096.0, float)
    _assert_field(ls, "hysteresis", 3, int)
    _assert_field(ls, "consecutive_hysteresis", True, bool)
    assert ls == jls.DynamicLossScale(
        1024.0,
        5,
        2.0,
        backoff_factor=0.25,
        min_loss_scale=0.5,
        max_loss_scale=4096.0,
        hysteresis=3,
        consecutive_hysteresis=True,
    )
    _assert_field(jls.FixedLossScale(np.float32(2.0)), "loss_scale_value", 2.0, float)
    _assert_field(jls.FixedLossScale(np.int64(5)), "loss_scale_value", 5.0, float)


def test_ints_for_float_args_are_stored_as_float():
    ls = jls.DynamicLossScale(
        initial_loss_scale=1024, multiplier=4, min_loss_scale=2, max_loss_scale=8192
    )
    config = ls.get_config()
    for name, value in [
        ("initial_loss_scale", 1024.0),
        ("multiplier", 4.0),
        ("min_loss_scale", 2.0),
        ("max_loss_scale", 8192.0),
    ]:
        _assert_field(ls, name, value, float)
        assert type(config[name]) is float
        assert config[name] == value
    assert ls == jls.DynamicLossScale(
        initial_loss_scale=1024.0, multiplier=4.0, min_loss_scale=2.0, max_loss_scale=8192.0
    )
    assert hash(ls) == hash(
        jls.DynamicLossScale(
            initial_loss_scale=1024.0, multiplier=4.0, min_loss_scale=2.0, max_loss_scale=8192.0
        )
    )
    fixed = jls.FixedLossScale(128)
    _assert_field(fixed, "loss_scale_value", 128.0, float)
    assert fixed.get_config() == {"loss_scale_value": 128.0}
    assert type(fixed.get_config()["loss_scale_value"]) is float


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_loss_scale": 1e-3, "initial_loss_scale": 1e-3},
        {"min_loss_scale": 1e-3},
        {"initial_loss_scale": 1024.0, "max_loss_scale": 1024.0},
        {"initial_loss_scale": 1.0, "max_loss_scale": 1.0, "min_loss_scale": 1.0},
        {"increment_period": INT32_MAX},
        {"increment_period": 1},
        {"hysteresis": INT32_MAX},
        {"multiplier": 1.0001},
        {"multiplier": F32_MAX},
        {"initial_loss_scale": F32_MAX},
        {"initial_loss_scale": F32_MAX, "max_loss_scale": F32_MAX, "min_loss_scale": F32_MAX},
        {"backoff_factor": 1e-30},
        {"backoff_factor": 0.999999},
        {"backoff_factor": None, "max_loss_scale": None},
        {"consecutive_hysteresis": True},
    ],
)
def test_good_edge_values_are_accepted_and_init_holds_them(kwargs):
    ls = jls.DynamicLossScale(**kwargs)
    state = ls.init()
    expected_scale = np.float32(kwargs.get("initial_loss_scale", 2.0**15))
    expected_tolerance = np.int32(kwargs.get("hysteresis", 1))
    chex.assert_trees_all_equal(
        state,
        jls.DynamicLossScaleState(
            loss_scale=jnp.asarray(expected_scale, jnp.float32),
            good_steps=jnp.asarray(0, jnp.int32),
            overflows_until_backoff=jnp.asarray(expected_tolerance, jnp.int32),
        ),
        strict=True,
    )
    for name, value in kwargs.items():
        # Real hyperparameters are stored as the float32 values the update rule uses.
        expected = float(np.float32(value)) if isinstance(value, float) else value
        assert getattr(ls, name) == expected


def test_concrete_scalar_arrays_are_accepted_as_the_numbers_they_hold():
    """jmp's docstring writes the scale as `jnp.asarray(2.**15)`, mpx's README as
    `mpx.FLOAT16_MAX` and `jnp.ones(())`: each is the Python number it holds."""
    # mpx.FLOAT16_MAX, `jnp.ones([], jnp.float32) * (2 - 2**-10) * 2**15`: the same float32
    # array, computed on the host (not at import, in every test process).
    float16_max = jnp.asarray(np.ones([], np.float32) * (2 - 2**-10) * 2**15)
    ls = jls.DynamicLossScale(
        initial_loss_scale=jnp.asarray(2.0**15),
        increment_period=jnp.asarray(5),
        multiplier=np.asarray(4.0),
        backoff_factor=jnp.asarray(0.25, jnp.bfloat16),
        min_loss_scale=jnp.ones(()),
        max_loss_scale=float16_max,
        hysteresis=np.array(3, np.int8),
        consecutive_hysteresis=jnp.bool_(True),
    )
    _assert_field(ls, "initial_loss_scale", 32768.0, float)
    _assert_field(ls, "increment_period", 5, int)
    _assert_field(ls, "multiplier", 4.0, float)
    _assert_field(ls, "backoff_factor", 0.25, float)
    _assert_field(ls, "min_loss_scale", 1.0, float)
    _assert_field(ls, "max_loss_scale", 65504.0, float)
    _assert_field(ls, "hysteresis", 3, int)
    _assert_field(ls, "consecutive_hysteresis", True, bool)
    same = jls.DynamicLossScale(
        2.0**15,
        5,
        4.0,
        backoff_factor=0.25,
        max_loss_scale=65504.0,
        hysteresis=3,
        consecutive_hysteresis=True,
    )
    assert ls == same
    assert hash(ls) == hash(same)
    assert jls.deserialize(jls.serialize(ls)) == same
    _assert_field(jls.FixedLossScale(jnp.asarray(2.0**15)), "loss_scale_value", 32768.0, float)
    _assert_field(jls.FixedLossScale(np.array(8)), "loss_scale_value", 8.0, float)
    rule = jls.loss_scaled(
        optax.sgd(1.0),
        jls.FixedLossScale(1.0),
        skip_grad_norm_above=jnp.asarray(10.0),
        skip_spike_sigmas=jnp.asarray(4.0),
        spike_window=jnp.asarray(16),
    )
    assert isinstance(rule, optax.GradientTransformationExtraArgs)


@pytest.mark.parametrize("transform", ["jit", "vmap", "grad"])
def test_traced_hyperparameter_is_refused_saying_hyperparameters_are_static(transform):
    def build(multiplier):
        return jls.DynamicLossScale(multiplier=multiplier).init().loss_scale

    run = {"jit": jax.jit(build), "vmap": jax.vmap(build), "grad": jax.grad(build)}[transform]
    with pytest.raises(TypeError) as excinfo:
        run(jnp.ones(2) if transform == "vmap" else jnp.float32(1024.0))
    message = str(excinfo.value)
    assert re.fullmatch(
        r"DynamicLossScale\(multiplier=.*Tracer.*\): multiplier must be a "
        r"static Python number \(or a concrete NumPy or JAX scalar\), not a value traced by "
        r"jit, grad or vmap: hyperparameters are fixed when the object is built, so build it "
        r"outside the traced function",
        message,
    ), message


def test_traced_integer_and_bool_hyperparameters_are_refused_too():
    for kwargs in (
        lambda x: {"increment_period": x.astype(jnp.int32)},
        lambda x: {"consecutive_hysteresis": x > 0},
    ):
        with pytest.raises(TypeError, match="must be a static Python number"):
            jax.jit(lambda x, kwargs=kwargs: jls.DynamicLossScale(**kwargs(x)).init())(
                jnp.float32(3.0)
            )
    with pytest.raises(TypeError, match=r"^FixedLossScale\(loss_scale_value=.*static Python"):
        jax.jit(lambda x: jls.FixedLossScale(x).init())(jnp.float32(3.0))


def test_fixed_loss_scale_edge_values():
    assert jls.FixedLossScale(1).loss_scale_value == 1.0
    assert jls.FixedLossScale(F32_MAX).loss_scale_value == F32_MAX
    state = jls.FixedLossScale(F32_MAX).init()
    np.testing.assert_array_equal(state.loss_scale, np.float32(F32_MAX))


# --- bad states ----------------------------------------------------------------------------


def _state_calls(ls):
    """The methods that take a state, each as `fn(state)`."""
    return {
        "update": lambda state: ls.update(state, {"w": jnp.ones(2)}),
        "__call__": lambda state: ls(state),
        "scale": lambda state: ls.scale(state, jnp.float32(1.0)),
        "unscale": lambda state: ls.unscale(state, {"w": jnp.ones(2)}),
    }


def _run(mode, fn, arg):
    """Calls `fn(arg)` under `jax.jit` or with jit disabled.

    Under jit, an `arg` of JAX arrays only is passed as an argument (the library sees tracers);
    anything else is closed over, since jit would reject a string argument and turn a Python or
    64-bit NumPy scalar argument into a float32/int32 array before the library could see it.
    """
    if mode == "nojit":
        with jax.disable_jit():
            return fn(arg)
    leaves = jax.tree.leaves(arg)
    if leaves and all(isinstance(leaf, jax.Array) for leaf in leaves):
        return jax.jit(fn)(arg)
    return jax.jit(lambda: fn(arg))()


_METHODS = ["update", "__call__", "scale", "unscale"]


def _good_dynamic_state():
    return jls.DynamicLossScaleState(
        loss_scale=jnp.float32(8.0),
        good_steps=jnp.int32(0),
        overflows_until_backoff=jnp.int32(1),
    )


_BAD_KIND_STATES = {
    "fixed_state": (
        lambda: jls.FixedLossScaleState(jnp.float32(8.0)),
        "FixedLossScaleState",
    ),
    "tuple": (lambda: (jnp.float32(8.0), jnp.int32(0), jnp.int32(1)), "tuple"),
    "dict": (
        lambda: {
            "loss_scale": jnp.float32(8.0),
            "good_steps": jnp.int32(0),
            "overflows_until_backoff": jnp.int32(1),
        },
        "dict",
    ),
    "list": (lambda: [jnp.float32(8.0), jnp.int32(0), jnp.int32(1)], "list"),
    "array": (lambda: jnp.float32(8.0), "ArrayImpl"),
    "none": (lambda: None, "NoneType"),
}


@pytest.mark.parametrize("method", _METHODS)
@pytest.mark.parametrize("kind", list(_BAD_KIND_STATES))
@pytest.mark.parametrize("mode", ["jit", "nojit"])
def test_dynamic_rejects_a_state_of_the_wrong_kind(method, kind, mode):
    ls = jls.DynamicLossScale(8.0, 2)
    make_state, type_name = _BAD_KIND_STATES[kind]
    state = make_state()
    call = _state_calls(ls)[method]
    with pytest.raises(TypeError) as excinfo:
        _run(mode, call, state)
    prefix = (
        "DynamicLossScale: state must be the DynamicLossScaleState returned by "
        "DynamicLossScale.init(), got "
    )
    if kind == "array" and mode == "jit":
        assert re.fullmatch(re.escape(prefix) + r"\w*Tracer", str(excinfo.value))
    else:
        assert str(excinfo.value) == prefix + type_name


@pytest.mark.parametrize("method", _METHODS)
@pytest.mark.parametrize("mode", ["jit", "nojit"])
def test_fixed_rejects_a_dynamic_state(method, mode):
    ls = jls.FixedLossScale(8.0)
    call = _state_calls(ls)[method]
    with pytest.raises(TypeError) as excinfo:
        _run(mode, call, _good_dynamic_state())
    assert str(excinfo.value) == (
        "FixedLossScale: state must be the FixedLossScaleState returned by "
        "FixedLossScale.init(), got DynamicLossScaleState"
    )


# (field, bad value, expected dtype, expected shape) for leaves that are arrays of the wrong kind
_BAD_LEAVES = [
    ("loss_scale", lambda: jnp.ones(2, jnp.float32), "float32", (2,)),
    ("loss_scale", lambda: jnp.ones((1,), jnp.float32), "float32", (1,)),
    ("loss_scale", lambda: jnp.float16(8.0), "float16", ()),
    ("loss_scale", lambda: jnp.bfloat16(8.0), "bfloat16", ()),
    ("loss_scale", lambda: np.float64(8.0), "float64", ()),
    ("loss_scale", lambda: jnp.int32(8), "int32", ()),
    ("good_steps", lambda: np.int64(0), "int64", ()),
    ("good_steps", lambda: jnp.float32(0.0), "float32", ()),
    ("good_steps", lambda: jnp.zeros(8, jnp.int32), "int32", (8,)),
    ("overflows_until_backoff", lambda: np.int64(1), "int64", ()),
    ("overflows_until_backoff", lambda: jnp.float32(1.0), "float32", ()),
    ("overflows_until_backoff", lambda: jnp.uint32(1), "uint32", ()),
]

_EXPECTED = {"loss_scale": "float32", "good_steps": "int32", "overflows_until_backoff": "int32"}


@pytest.mark.parametrize("method", _METHODS)
@pytest.mark.parametrize(("field", "make_leaf", "dtype", "shape"), _BAD_LEAVES)
@pytest.mark.parametrize("mode", ["jit", "nojit"])
def test_dynamic_rejects_state_leaves_of_wrong_shape_or_dtype(
    method, field, make_leaf, dtype, shape, mode
):
    ls = jls.DynamicLossScale(8.0, 2)
    leaf = make_leaf()
    state = _good_dynamic_state()._replace(**{field: leaf})
    call = _state_calls(ls)[method]
    wrong_dtype = dtype != _EXPECTED[field]
    with pytest.raises(
        TypeError if wrong_dtype else ValueError, match=rf"^DynamicLossScale: state\.{field} "
    ) as excinfo:
        _run(mode, call, state)
    if wrong_dtype:
        # Under jit the leaf is a tracer; eagerly it is the array itself.
        assert str(excinfo.value).startswith(
            f"DynamicLossScale: state.{field} must have dtype {_EXPECTED[field]} "
            "(not weakly typed), got "
        )
        assert f"of dtype {dtype} and shape {shape}; build states with" in str(excinfo.value)
    else:
        assert str(excinfo.value) == (
            f"DynamicLossScale: state.{field} must have shape (), got shape {shape}; a state "
            "replicated for pmap has scalar leaves only inside the pmapped function"
        )


def test_weakly_typed_state_leaves_are_refused_since_they_would_retrace():
    ls = jls.DynamicLossScale(8.0, 2)
    state = _good_dynamic_state()._replace(loss_scale=jnp.asarray(8.0))
    assert state.loss_scale.weak_type
    with pytest.raises(TypeError) as excinfo:
        ls.update(state, {"w": jnp.ones(2)})
    assert str(excinfo.value) == (
        "DynamicLossScale: state.loss_scale must have dtype float32 (not weakly typed), got "
        "ArrayImpl of dtype float32 and shape (), weakly typed; build states with "
        "DynamicLossScale.init()"
    )


@pytest.mark.parametrize("method", _METHODS)
def test_fixed_rejects_non_scalar_or_float16_scale(method):
    ls = jls.FixedLossScale(8.0)
    calls = _state_calls(ls)
    with pytest.raises(
        ValueError, match=r"^FixedLossScale: state\.loss_scale must have shape \(\)"
    ):
        calls[method](jls.FixedLossScaleState(jnp.full(3, 8.0, jnp.float32)))
    with pytest.raises(TypeError, match=r"of dtype float16 and shape \(\);"):
        calls[method](jls.FixedLossScaleState(jnp.float16(8.0)))


def test_pmap_replicated_state_outside_pmap_is_rejected_with_a_hint():
    ls = jls.DynamicLossScale(8.0, 2)
    replicated = jax.pmap(lambda _: ls.init())(jnp.arange(jax.local_device_count()))
    assert replicated.loss_scale.shape == (8,)
    with pytest.raises(ValueError, match="replicated for pmap") as excinfo:
        ls.update(replicated, {"w": jnp.ones(2)})
    assert str(excinfo.value) == (
        "DynamicLossScale: state.loss_scale must have shape (), got shape (8,); a state "
        "replicated for pmap has scalar leaves only inside the pmapped function"
    )


@pytest.mark.parametrize("method", _METHODS)
@pytest.mark.parametrize(
    ("field", "value", "type_name"),
    [
        ("loss_scale", 8.0, "float"),
        ("loss_scale", 8, "int"),
        ("good_steps", 0, "int"),
        ("overflows_until_backoff", 1, "int"),
        ("loss_scale", None, "NoneType"),
        ("loss_scale", [8.0], "list"),
    ],
)
@pytest.mark.parametrize("mode", ["jit", "nojit"])
def test_dynamic_rejects_python_values_as_state_fields(method, field, value, type_name, mode):
    ls = jls.DynamicLossScale(8.0, 2)
    state = _good_dynamic_state()._replace(**{field: value})
    with pytest.raises(TypeError) as excinfo:
        _run(mode, _state_calls(ls)[method], state)
    assert str(excinfo.value) == (
        f"DynamicLossScale: state.{field} must be an array, got {type_name} ({value!r})"
    )


def test_fixed_rejects_python_float_as_scale():
    ls = jls.FixedLossScale(8.0)
    with pytest.raises(TypeError) as excinfo:
        ls(jls.FixedLossScaleState(8.0))
    assert str(excinfo.value) == (
        "FixedLossScale: state.loss_scale must be an array, got float (8.0)"
    )


def test_numpy_state_of_right_dtypes_is_accepted():
    ls = jls.DynamicLossScale(8.0, 2)
    state = jls.DynamicLossScaleState(np.float32(8.0), np.int32(0), np.int32(1))
    new_state, should_apply = ls.update(state, {"w": np.ones(2, np.float32)})
    assert bool(should_apply)
    assert float(ls(new_state)) == 8.0
    assert int(new_state.good_steps) == 1


# --- bad gradient leaves -------------------------------------------------------------------


# (tree, path in the message, type name in the message)
_BAD_TREES = [
    ({"a": "x"}, "['a']", "str"),
    ({"a": device_array(np.ones(2)), "b": object()}, "['b']", "object"),
    ({"a": 1.5}, "['a']", "float"),
    ({"a": 3}, "['a']", "int"),
    ({"a": True}, "['a']", "bool"),
    ({"a": ["x", "y"]}, "['a'][0]", "str"),
    ([device_array(np.ones(2)), {"k": b"bytes"}], "[1]['k']", "bytes"),
    ((device_array(np.ones(2)), None, "x"), "[2]", "str"),
    ("loss", "<root>", "str"),
    (1.0, "<root>", "float"),
]


def _tree_calls(ls, state):
    return {
        "update": lambda tree: ls.update(state, tree),
        "unscale": lambda tree: ls.unscale(state, tree),
        "scale": lambda tree: ls.scale(state, tree),
        "all_finite": jls.all_finite,
    }


_CALLERS = {
    "update": ("{cls}.update", "grads"),
    "unscale": ("{cls}.unscale", "grads"),
    "scale": ("{cls}.scale", "tree"),
    "all_finite": ("all_finite", "tree"),
}


# all_finite takes Python numbers, as jmp's does (tests/test_numerics.py).
_REJECTED = [
    (method, *case)
    for method in _CALLERS
    for case in _BAD_TREES
    if not (method == "all_finite" and case[2] in ("float", "int", "bool"))
]


@pytest.mark.parametrize("cls_name", [D, F])
@pytest.mark.parametrize(("method", "tree", "path", "type_name"), _REJECTED)
@pytest.mark.parametrize("mode", ["jit", "nojit"])
def test_non_array_leaves_are_rejected_with_path_and_type(
    cls_name, method, tree, path, type_name, mode
):
    ls = getattr(jls, cls_name)(8.0)
    state = ls.init()
    call = _tree_calls(ls, state)[method]
    caller, arg_name = _CALLERS[method]
    with pytest.raises(TypeError) as excinfo:
        _run(mode, call, tree)
    message = str(excinfo.value)
    assert message.startswith(
        f"{caller.format(cls=cls_name)}: {arg_name} leaf at {path} has type {type_name} ("
    ), message
    assert message.endswith("every leaf must be a JAX or NumPy array (or None)"), message


@pytest.mark.parametrize("method", list(_CALLERS))
def test_non_numeric_array_leaves_are_rejected(method):
    ls = jls.DynamicLossScale(8.0)
    call = _tree_calls(ls, ls.init())[method]
    caller, arg_name = _CALLERS[method]
    with pytest.raises(TypeError) as excinfo:
        call({"a": [jnp.ones(2), np.array(["s", "t"])]})
    assert str(excinfo.value) == (
        f"{caller.format(cls=D)}: {arg_name} leaf at ['a'][1] has dtype <U1; "
        "expected a numeric, boolean or float0 array"
    )
    with pytest.raises(TypeError, match=r"leaf at \['o'\] has dtype object"):
        call({"o": np.array([object()])})


def test_long_leaf_repr_is_shortened():
    with pytest.raises(TypeError) as excinfo:
        jls.all_finite({"a": "x" * 200})
    message = str(excinfo.value)
    assert message.startswith("all_finite: tree leaf at ['a'] has type str ('xxxx")
    assert "x" * 100 not in message
    assert "('" + "x" * 39 + "..." + "x" * 19 + "')" in message  # the middle left out


@pytest.mark.parametrize("cls_name", [D, F])
@pytest.mark.parametrize("mode", ["jit", "nojit"])
def test_none_leaves_are_accepted(cls_name, mode):
    ls = getattr(jls, cls_name)(8.0)
    state = ls.init()
    grads = {"a": None, "b": jnp.full(2, 16.0), "c": (None, jnp.int32(3))}

    def run(state):
        new_state, should_apply = ls.update(state, grads)
        return (
            new_state,
            should_apply,
            ls.unscale(state, grads),
            ls.scale(state, grads),
            jls.all_finite(grads),
        )

    if mode == "jit":
        new_state, should_apply, unscaled, scaled, finite = jax.jit(run)(state)
    else:
        with jax.disable_jit():
            new_state, should_apply, unscaled, scaled, finite = run(state)
    assert bool(should_apply)
    assert bool(finite)
    assert float(ls(new_state)) == 8.0
    chex.assert_trees_all_equal(
        unscaled, {"a": None, "b": jnp.full(2, 2.0), "c": (None, jnp.int32(3))}
    )
    chex.assert_trees_all_equal(
        scaled, {"a": None, "b": jnp.full(2, 128.0), "c": (None, jnp.int32(3))}
    )
    assert bool(jls.all_finite({"only": None}))
    assert bool(jls.all_finite(None))


# --- nothing is mutated --------------------------------------------------------------------


def _failing_calls(ls, state):
    return [
        lambda: ls.update(state, {"a": "x"}),
        lambda: ls.update(jls.FixedLossScaleState(jnp.float32(2.0)), {"a": jnp.ones(2)}),
        lambda: ls.update(state._replace(loss_scale=jnp.ones(3)), {"a": jnp.ones(2)}),
        lambda: ls.unscale(state, {"a": object()}),
        lambda: ls.scale(state, ["loss"]),
        lambda: ls(state._replace(good_steps=1)),
    ]


def test_failed_calls_mutate_nothing_and_later_calls_still_work():
    ls = jls.DynamicLossScale(16.0, 2, hysteresis=2, min_loss_scale=0.5)
    state, _ = ls.update(ls.init(), {"a": jnp.array([1.0, jnp.inf])})
    ls_before = copy.deepcopy(ls)
    fields_before = dataclasses.asdict(ls)
    state_before = jax.tree.map(np.array, state)
    grads = {"a": jnp.ones(2), "b": [jnp.float16(1.0)]}
    grads_before = jax.tree.map(np.array, grads)

    for call in _failing_calls(ls, state):
        with pytest.raises((TypeError, ValueError)):
            call()
        assert ls == ls_before
        assert dataclasses.asdict(ls) == fields_before
        chex.assert_trees_all_equal(state, state_before)

    new_state, should_apply = ls.update(state, grads)
    chex.assert_trees_all_equal(grads, grads_before)
    assert bool(should_apply)
    chex.assert_trees_all_equal(
        new_state,
        jls.DynamicLossScaleState(jnp.float32(16.0), jnp.int32(1), jnp.int32(1)),
    )


@pytest.mark.parametrize(
    ("ls", "field", "value"),
    [
        (jls.DynamicLossScale(), "initial_loss_scale", 1.0),
        (jls.DynamicLossScale(), "increment_period", 0),
        (jls.DynamicLossScale(), "min_loss_scale", 4.0),
        (jls.DynamicLossScale(), "new_attribute", 1),
        (jls.FixedLossScale(4.0), "loss_scale_value", 8.0),
        (jls.FixedLossScale(4.0), "loss_scale_value", 0.5),
    ],
)
def test_loss_scales_are_frozen(ls, field, value):
    before = copy.deepcopy(ls)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(ls, field, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        delattr(ls, field)
    assert ls == before
    assert not hasattr(ls, "new_attribute")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"multiplier": 1.00000001},
            "DynamicLossScale(multiplier=1.00000001): multiplier must be > 1 "
            "(it rounds to 1.0 in float32)",
        ),
        (
            {"backoff_factor": 0.99999999},
            "DynamicLossScale(backoff_factor=0.99999999): backoff_factor must be None or in "
            "the open interval (0, 1) (it rounds to 1.0 in float32)",
        ),
        (
            {"initial_loss_scale": 0.1, "min_loss_scale": 0.2},
            "DynamicLossScale(initial_loss_scale=0.1): initial_loss_scale must be >= "
            "min_loss_scale (0.20000000298023224) (it rounds to 0.10000000149011612 in float32)",
        ),
    ],
)
def test_hyperparameters_are_checked_as_the_float32_values_the_update_uses(kwargs, message):
    with pytest.raises(ValueError, match="in float32") as excinfo:
        jls.DynamicLossScale(**kwargs)
    assert str(excinfo.value) == message


def test_max_loss_scale_is_stored_as_the_float32_ceiling_the_update_uses():
    ls = jls.DynamicLossScale(2.0**19, 1, 2.0, max_loss_scale=2.0**20 - 0.01)
    assert ls.max_loss_scale == 2.0**20
    assert ls.get_config()["max_loss_scale"] == 2.0**20
    state, _ = ls.update(ls.init(), {"w": jnp.ones(3)})
    assert float(ls(state)) == 2.0**20
    state, _ = ls.update(state, {"w": jnp.ones(3)})
    assert float(ls(state)) == 2.0**20


class _ScaleState(NamedTuple):
    loss_scale: object


@dataclasses.dataclass(frozen=True)
class _UserLossScale(jls.LossScale):
    """A user loss scale holding its scale in a NamedTuple state."""

    def init(self):
        return _ScaleState(jnp.float32(2.0))

    def adjust(self, state, grads_finite):
        return state, jnp.array(True)

    def get_config(self):
        return {}


@pytest.mark.parametrize("method", ["scale", "unscale", "__call__"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (2.0, "must be an array, got float (2.0)"),
        (np.array([2.0, 4.0], np.float32), "must have shape (), got shape (2,)"),
        (np.float16(2.0), "must have dtype float32 (not weakly typed), got float16 of dtype"),
    ],
)
def test_scale_that_is_not_a_float32_scalar_is_refused(method, value, message):
    """A state whose scale is not a float32 scalar array, given to any reader of the scale
    (`scale`, `unscale`, `ls(state)`)."""
    ls = _UserLossScale()
    with pytest.raises((TypeError, ValueError)) as excinfo:
        getattr(ls, method)(
            _ScaleState(value), *([{"w": jnp.ones(2)}] if method != "__call__" else [])
        )
    assert str(excinfo.value).startswith(f"_UserLossScale: state.loss_scale {message}")


@dataclasses.dataclass(frozen=True)
class _TwiceTheScale(jls.LossScale):
    """A user loss scale whose `__call__` is not the scale its state holds."""

    def init(self):
        return jls.FixedLossScaleState(jnp.float32(4.0))

    def __call__(self, state):
        return state.loss_scale * 2

    def adjust(self, state, grads_finite):
        return state, jnp.array(True)

    def get_config(self):
        return {}


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "inside jit"])
def test_a_call_that_is_not_the_held_scale_is_refused_by_loss_scaled(traced):
    """`loss_scaled` multiplies the loss by the state's `loss_scale` (`get_loss_scale`,
    `value_and_grad`) and divides the gradients by it: a `__call__` that gives another value
    is refused when the wrapper is built, inside a traced function too."""

    def build():
        return jls.loss_scaled(optax.sgd(0.1), _TwiceTheScale())

    with pytest.raises(TypeError) as excinfo:
        jax.jit(lambda: build() and 0)() if traced else build()
    assert str(excinfo.value) == (
        "loss_scaled(loss_scale=_TwiceTheScale()): _TwiceTheScale.__call__ returns 8.0 for "
        "the initial state, whose loss_scale is 4.0; the loss is multiplied by loss_scale "
        "(get_loss_scale, value_and_grad) and the gradients divided by it, so __call__ must "
        "return state.loss_scale (or be left to LossScale)"
    )


def test_get_of_an_array_gives_the_get_error():
    with pytest.raises(ValueError, match=r"^get\(identifier=array\(\[1\., 2\.\]\)\): identifier"):
        jls.get(np.array([1.0, 2.0]))
