"""Hyperparameters as JSON: get_config/from_config, serialize/deserialize, register and get.

Classes registered here stay in the library's registry for the rest of the session, so each
has a name used nowhere else.
"""

import dataclasses
import json
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls

F32_MAX = float(np.finfo(np.float32).max)

DEFAULT_DYNAMIC_CONFIG = {
    "initial_loss_scale": 32768.0,
    "increment_period": 2000,
    "multiplier": 2.0,
    "backoff_factor": None,
    "min_loss_scale": 1.0,
    "max_loss_scale": None,
    "hysteresis": 1,
    "consecutive_hysteresis": False,
}

_DYNAMIC_KWARGS = [
    {},
    {"initial_loss_scale": 1},
    {"initial_loss_scale": 2**24, "increment_period": 1, "multiplier": 4},
    {"initial_loss_scale": 1e-3, "min_loss_scale": 1e-3},
    {"initial_loss_scale": 0.75, "min_loss_scale": 0.5, "max_loss_scale": 0.75},
    {"backoff_factor": 0.25},
    {"backoff_factor": 0.5, "multiplier": 1.5},
    {"max_loss_scale": 2.0**16},
    {"max_loss_scale": F32_MAX, "initial_loss_scale": F32_MAX, "min_loss_scale": 1.0},
    {"hysteresis": 2},
    {"hysteresis": 2**31 - 1, "increment_period": 2**31 - 1},
    {"hysteresis": 3, "consecutive_hysteresis": True},
    {
        "initial_loss_scale": np.float32(512.0),
        "increment_period": np.int64(7),
        "multiplier": np.float64(3.0),
        "backoff_factor": np.float32(0.125),
        "min_loss_scale": np.float16(0.25),
        "max_loss_scale": np.int32(1 << 20),
        "hysteresis": np.int16(4),
        "consecutive_hysteresis": np.bool_(True),
    },
]

_FIXED_VALUES = [1, 1.0, 128, 2.0**15, 3.5, F32_MAX, np.float32(64.0), np.int64(5)]


def _json_round_trip(value):
    return json.loads(json.dumps(value, allow_nan=False))


def _assert_same_loss_scale(restored, original):
    assert type(restored) is type(original)
    assert restored == original
    assert hash(restored) == hash(original)
    assert restored.get_config() == original.get_config()
    chex.assert_trees_all_equal(restored.init(), original.init(), strict=True)


def _all_loss_scales():
    return [jls.DynamicLossScale(**kwargs) for kwargs in _DYNAMIC_KWARGS] + [
        jls.FixedLossScale(value) for value in _FIXED_VALUES
    ]


# --- get_config / from_config --------------------------------------------------------------


def test_default_dynamic_config_is_pinned():
    config = jls.DynamicLossScale().get_config()
    assert config == DEFAULT_DYNAMIC_CONFIG
    assert list(config) == list(DEFAULT_DYNAMIC_CONFIG)
    assert {k: type(v) for k, v in config.items()} == {
        k: type(v) for k, v in DEFAULT_DYNAMIC_CONFIG.items()
    }


def test_fixed_config_is_pinned():
    config = jls.FixedLossScale(128).get_config()
    assert config == {"loss_scale_value": 128.0}
    assert type(config["loss_scale_value"]) is float


@pytest.mark.parametrize("ls", _all_loss_scales(), ids=repr)
def test_config_round_trips_through_json(ls):
    config = ls.get_config()
    assert all(type(v) in (bool, int, float, type(None)) for v in config.values()), config
    restored = type(ls).from_config(_json_round_trip(config))
    _assert_same_loss_scale(restored, ls)


def test_config_is_a_fresh_dict():
    ls = jls.DynamicLossScale()
    config = ls.get_config()
    config["increment_period"] = 1
    assert ls.increment_period == 2000
    assert ls.get_config() == DEFAULT_DYNAMIC_CONFIG


def test_dynamic_from_partial_config_uses_defaults():
    ls = jls.DynamicLossScale.from_config({"increment_period": 10, "hysteresis": 2})
    assert ls == jls.DynamicLossScale(increment_period=10, hysteresis=2)
    assert ls.get_config() == {**DEFAULT_DYNAMIC_CONFIG, "increment_period": 10, "hysteresis": 2}


def test_from_config_with_an_unknown_key_names_it():
    with pytest.raises(ValueError, match="unknown keys") as excinfo:
        jls.DynamicLossScale.from_config({"increment_period": 10, "foo": 1})
    assert str(excinfo.value) == (
        "DynamicLossScale.from_config(config={'increment_period': 10, 'foo': 1}): unknown keys "
        "['foo']; expected some of ['initial_loss_scale', 'increment_period', 'multiplier', "
        "'backoff_factor', 'min_loss_scale', 'max_loss_scale', 'hysteresis', "
        "'consecutive_hysteresis']"
    )
    with pytest.raises(ValueError, match=r"unknown keys \['_'\]"):
        jls.DynamicLossScale.from_config({"_": None})
    with pytest.raises(
        ValueError, match=r"^FixedLossScale\.from_config\(.*unknown keys \['scale'\]"
    ):
        jls.FixedLossScale.from_config({"loss_scale_value": 2.0, "scale": 2.0})


def test_from_config_errors():
    with pytest.raises(TypeError) as excinfo:
        jls.FixedLossScale.from_config([("loss_scale_value", 2.0)])
    assert str(excinfo.value) == (
        "FixedLossScale.from_config(config=[('loss_scale_value', 2.0)]): config must be a dict"
    )
    with pytest.raises(TypeError, match="loss_scale_value"):
        jls.FixedLossScale.from_config({})
    with pytest.raises(ValueError, match="increment_period") as excinfo:
        jls.DynamicLossScale.from_config({"increment_period": 0})
    assert str(excinfo.value).startswith(
        "DynamicLossScale(increment_period=0): increment_period must be an integer >= 1"
    )


# --- serialize / deserialize ---------------------------------------------------------------


def test_serialize_form_is_pinned():
    assert jls.serialize(jls.FixedLossScale(128)) == {
        "class_name": "FixedLossScale",
        "config": {"loss_scale_value": 128.0},
    }
    assert jls.serialize(jls.DynamicLossScale()) == {
        "class_name": "DynamicLossScale",
        "config": DEFAULT_DYNAMIC_CONFIG,
    }
    assert (
        json.dumps(jls.serialize(jls.FixedLossScale(128)), sort_keys=True)
        == '{"class_name": "FixedLossScale", "config": {"loss_scale_value": 128.0}}'
    )


@pytest.mark.parametrize("ls", _all_loss_scales(), ids=repr)
def test_serialize_round_trips_through_json(ls):
    serialized = jls.serialize(ls)
    assert set(serialized) == {"class_name", "config"}
    assert serialized["class_name"] == type(ls).__name__
    assert serialized["config"] == ls.get_config()
    _assert_same_loss_scale(jls.deserialize(_json_round_trip(serialized)), ls)
    _assert_same_loss_scale(jls.get(_json_round_trip(serialized)), ls)


@pytest.mark.parametrize(
    "config",
    [
        None,
        "FixedLossScale",
        ["FixedLossScale", {"loss_scale_value": 2.0}],
        3,
        jls.FixedLossScale(2),
    ],
    ids=repr,
)
def test_deserialize_rejects_a_non_dict(config):
    with pytest.raises(TypeError) as excinfo:
        jls.deserialize(config)
    assert str(excinfo.value) == f"deserialize(config={config!r}): config must be a dict"


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"class_name": "FixedLossScale"},
        {"config": {"loss_scale_value": 2.0}},
        {"class_name": "FixedLossScale", "config": {"loss_scale_value": 2.0}, "version": 1},
        {"class_name": "FixedLossScale", "loss_scale_value": 2.0},
    ],
    ids=repr,
)
def test_deserialize_rejects_missing_or_extra_keys(config):
    with pytest.raises(ValueError, match="exactly the keys") as excinfo:
        jls.deserialize(config)
    assert str(excinfo.value) == (
        f"deserialize(config={config!r}): config must have exactly the keys "
        "'class_name' and 'config'"
    )


@pytest.mark.parametrize(
    "class_name",
    ["NoSuchLossScale", "fixedlossscale", "LossScale", "", 3, None, ["FixedLossScale"]],
)
def test_deserialize_rejects_an_unknown_class_name(class_name):
    config = {"class_name": class_name, "config": {}}
    with pytest.raises(ValueError, match="unknown class_name") as excinfo:
        jls.deserialize(config)
    message = str(excinfo.value)
    assert message.startswith(
        f"deserialize(config={config!r}): unknown class_name {class_name!r}; known: ["
    )
    assert "'DynamicLossScale'" in message
    assert "'FixedLossScale'" in message
    assert message.endswith("(register a LossScale subclass with @jax_lossscale.register)")


@pytest.mark.parametrize(
    ("serialized", "error", "prefix"),
    [
        (
            {"class_name": "DynamicLossScale", "config": {"increment_period": 0}},
            ValueError,
            "DynamicLossScale(increment_period=0): increment_period must be",
        ),
        (
            {"class_name": "DynamicLossScale", "config": {"multiplier": "2"}},
            TypeError,
            "DynamicLossScale(multiplier='2'): multiplier must be a real number",
        ),
        (
            {"class_name": "DynamicLossScale", "config": {"consecutive_hysteresis": 1}},
            TypeError,
            "DynamicLossScale(consecutive_hysteresis=1): consecutive_hysteresis must be a bool",
        ),
        (
            {"class_name": "DynamicLossScale", "config": {"max_loss_scale": 1.0}},
            ValueError,
            "DynamicLossScale(max_loss_scale=1.0): max_loss_scale must be None or >=",
        ),
        (
            {"class_name": "FixedLossScale", "config": {"loss_scale_value": 0.5}},
            ValueError,
            "FixedLossScale(loss_scale_value=0.5): loss_scale_value must be >= 1",
        ),
        (
            {"class_name": "FixedLossScale", "config": {"loss_scale_value": None}},
            TypeError,
            "FixedLossScale(loss_scale_value=None): loss_scale_value must be a real number",
        ),
        (
            {"class_name": "FixedLossScale", "config": None},
            TypeError,
            "FixedLossScale.from_config(config=None): config must be a dict",
        ),
        (
            {"class_name": "DynamicLossScale", "config": {"foo": 1}},
            ValueError,
            "DynamicLossScale.from_config(config={'foo': 1}): unknown keys ['foo']",
        ),
    ],
    ids=repr,
)
def test_deserialize_propagates_constructor_errors(serialized, error, prefix):
    with pytest.raises(error) as excinfo:
        jls.deserialize(serialized)
    assert str(excinfo.value).startswith(prefix), str(excinfo.value)
    with pytest.raises(error) as excinfo:
        jls.get(serialized)
    assert str(excinfo.value).startswith(prefix), str(excinfo.value)


# --- register ------------------------------------------------------------------------------


class _ScheduledState(NamedTuple):
    loss_scale: jax.Array  # float32
    step: jax.Array  # int32


@jls.register
@dataclasses.dataclass(frozen=True)
class SerializationTestScheduledLossScale(jls.LossScale):
    """Multiplies the scale by `factor` every `period` updates, whatever the gradients."""

    start: float
    period: int = 2
    factor: float = 2.0

    def __post_init__(self):
        object.__setattr__(self, "start", float(self.start))
        object.__setattr__(self, "period", int(self.period))
        object.__setattr__(self, "factor", float(self.factor))

    def init(self):
        return _ScheduledState(jnp.asarray(self.start, jnp.float32), jnp.asarray(0, jnp.int32))

    def __call__(self, state):
        return state.loss_scale

    def adjust(self, state, grads_finite):
        step = state.step + 1
        due = step % self.period == 0
        scale = jnp.where(due, state.loss_scale * np.float32(self.factor), state.loss_scale)
        return _ScheduledState(scale, step), grads_finite

    def get_config(self):
        return dataclasses.asdict(self)


def test_registered_user_class_round_trips_and_works():
    ls = SerializationTestScheduledLossScale(start=4, period=2, factor=3)
    serialized = jls.serialize(ls)
    assert serialized == {
        "class_name": "SerializationTestScheduledLossScale",
        "config": {"start": 4.0, "period": 2, "factor": 3.0},
    }
    restored = jls.deserialize(_json_round_trip(serialized))
    _assert_same_loss_scale(restored, ls)
    assert jls.get(serialized) == ls

    state = restored.init()
    scales, applied = [], []
    for grads in [{"w": jnp.ones(2)}, {"w": jnp.array([jnp.nan])}, {"w": None}, {"w": jnp.ones(1)}]:
        state, should_apply = restored.update(state, grads)
        scales.append(float(restored(state)))
        applied.append(bool(should_apply))
    assert scales == [4.0, 12.0, 12.0, 36.0]
    assert applied == [True, False, True, True]
    chex.assert_trees_all_equal(restored.scale(state, jnp.float16(0.5)), jnp.float16(18.0))
    chex.assert_trees_all_equal(
        restored.unscale(state, {"g": jnp.full(2, 72.0, jnp.bfloat16)}),
        {"g": jnp.full(2, 2.0, jnp.bfloat16)},
    )


def test_register_returns_the_class_and_is_idempotent():
    assert jls.register(SerializationTestScheduledLossScale) is SerializationTestScheduledLossScale
    assert jls.register(jls.DynamicLossScale) is jls.DynamicLossScale
    assert jls.register(jls.FixedLossScale) is jls.FixedLossScale
    assert type(jls.deserialize(jls.serialize(jls.FixedLossScale(2)))) is jls.FixedLossScale


def test_registered_subclass_of_a_builtin_loss_scale():
    @jls.register
    @dataclasses.dataclass(frozen=True)
    class SerializationTestFixedChild(jls.FixedLossScale):
        pass

    ls = SerializationTestFixedChild(8)
    restored = jls.deserialize(_json_round_trip(jls.serialize(ls)))
    _assert_same_loss_scale(restored, ls)
    assert type(jls.deserialize(jls.serialize(jls.FixedLossScale(8)))) is jls.FixedLossScale


@pytest.mark.parametrize(
    "cls", [int, object, dict, jls.FixedLossScale(2.0), "FixedLossScale", None, jls.all_finite]
)
def test_register_rejects_what_is_not_a_loss_scale_class(cls):
    with pytest.raises(TypeError) as excinfo:
        jls.register(cls)
    assert str(excinfo.value) == f"register(cls={cls!r}): cls must be a subclass of LossScale"


def test_register_rejects_a_different_class_under_a_taken_name():
    @dataclasses.dataclass(frozen=True)
    class FixedLossScale(jls.FixedLossScale):
        pass

    with pytest.raises(ValueError, match="already registered") as excinfo:
        jls.register(FixedLossScale)
    assert str(excinfo.value) == (
        f"register(cls={FixedLossScale!r}): the name 'FixedLossScale' is already registered "
        "for jax_lossscale._fixed.FixedLossScale"
    )
    # The registry is unchanged, and the shadowing class cannot be serialized.
    assert type(jls.deserialize(jls.serialize(jls.FixedLossScale(2)))) is jls.FixedLossScale
    with pytest.raises(ValueError, match="FixedLossScale is not registered"):
        jls.serialize(FixedLossScale(2))


def _make_clashing_class():
    @dataclasses.dataclass(frozen=True)
    class SerializationTestClash(jls.FixedLossScale):
        pass

    return SerializationTestClash


def test_register_rejects_a_user_class_clashing_with_another_user_class():
    @jls.register
    @dataclasses.dataclass(frozen=True)
    class SerializationTestClash(jls.FixedLossScale):
        pass

    other = _make_clashing_class()
    with pytest.raises(ValueError, match="'SerializationTestClash' is already registered for "):
        jls.register(other)
    assert type(jls.deserialize(jls.serialize(SerializationTestClash(2)))) is (
        SerializationTestClash
    )


def test_serialize_rejects_an_unregistered_subclass():
    @dataclasses.dataclass(frozen=True)
    class SerializationTestUnregistered(jls.FixedLossScale):
        pass

    ls = SerializationTestUnregistered(4)
    with pytest.raises(ValueError, match="is not registered") as excinfo:
        jls.serialize(ls)
    assert str(excinfo.value) == (
        f"serialize(loss_scale={ls!r}): "
        "SerializationTestUnregistered is not registered, so it could not be deserialized; "
        "decorate the class with @jax_lossscale.register"
    )


@pytest.mark.parametrize("value", [None, 2.0, "dynamic", {"class_name": "FixedLossScale"}])
def test_serialize_rejects_what_is_not_a_loss_scale(value):
    with pytest.raises(TypeError) as excinfo:
        jls.serialize(value)
    assert str(excinfo.value) == (
        f"serialize(loss_scale={value!r}): loss_scale must be a LossScale instance"
    )


# --- get -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("identifier", "expected"),
    [
        (1024, jls.FixedLossScale(1024.0)),
        (1, jls.FixedLossScale(1.0)),
        (2.5, jls.FixedLossScale(2.5)),
        (2**15, jls.FixedLossScale(32768.0)),
        (np.float32(4.0), jls.FixedLossScale(4.0)),
        (np.int64(5), jls.FixedLossScale(5.0)),
        ("dynamic", jls.DynamicLossScale()),
        (
            {"class_name": "DynamicLossScale", "config": {"increment_period": 10}},
            jls.DynamicLossScale(increment_period=10),
        ),
        (
            {"class_name": "FixedLossScale", "config": {"loss_scale_value": 8}},
            jls.FixedLossScale(8),
        ),
    ],
    ids=repr,
)
def test_get(identifier, expected):
    ls = jls.get(identifier)
    _assert_same_loss_scale(ls, expected)


@pytest.mark.parametrize(
    "identifier",
    [
        jnp.asarray(2.0**15),
        jnp.float32(2.0**15),
        np.array(2.0**15),
        np.float64(2.0**15),
        np.int32(32768),
    ],
    ids=repr,
)
def test_get_takes_a_concrete_scalar_array_as_the_number_it_holds(identifier):
    """jmp writes its scales as arrays (`jnp.asarray(2.**15)`); `get` reads them as numbers."""
    _assert_same_loss_scale(jls.get(identifier), jls.FixedLossScale(32768.0))


def test_get_of_a_traced_scalar_says_hyperparameters_are_static():
    with pytest.raises(TypeError, match="static Python number") as excinfo:
        jax.jit(jls.get)(jnp.float32(4.0))
    assert str(excinfo.value).startswith("FixedLossScale(loss_scale_value=")


def test_get_passes_none_and_loss_scales_through():
    assert jls.get(None) is None
    for ls in [
        jls.DynamicLossScale(hysteresis=3),
        jls.FixedLossScale(2),
        SerializationTestScheduledLossScale(1.0),
    ]:
        assert jls.get(ls) is ls


@pytest.mark.parametrize(
    "identifier",
    [
        "static",
        "Dynamic",
        "DynamicLossScale",
        "",
        True,
        False,
        np.bool_(True),
        [1024],
        (1024,),
        {1024},
        object(),
        jnp.ones(2),
        np.array([4.0]),
        1 + 0j,
        jls.DynamicLossScale,
    ],
    ids=lambda value: "object()" if type(value) is object else repr(value),
)
def test_get_rejects_other_identifiers(identifier):
    with pytest.raises(ValueError, match=r"^get\(identifier=") as excinfo:
        jls.get(identifier)
    assert str(excinfo.value) == (
        f"get(identifier={identifier!r}): identifier must be None, a number, 'dynamic', "
        "a dict from serialize() or a LossScale"
    )


@pytest.mark.parametrize(
    ("identifier", "message"),
    [
        (0.5, "FixedLossScale(loss_scale_value=0.5): loss_scale_value must be >= 1"),
        (0, "FixedLossScale(loss_scale_value=0): loss_scale_value must be >= 1"),
        (-4, "FixedLossScale(loss_scale_value=-4): loss_scale_value must be >= 1"),
        (float("nan"), "FixedLossScale(loss_scale_value=nan): loss_scale_value must be finite"),
        (float("inf"), "FixedLossScale(loss_scale_value=inf): loss_scale_value must be finite"),
        (
            1e39,
            "FixedLossScale(loss_scale_value=1e+39): loss_scale_value must be at most the "
            "float32 maximum (3.4028234663852886e+38)",
        ),
    ],
)
def test_get_of_a_bad_number_raises_the_fixed_loss_scale_error(identifier, message):
    with pytest.raises(ValueError, match=r"^FixedLossScale\(loss_scale_value=") as excinfo:
        jls.get(identifier)
    assert str(excinfo.value) == message


# --- TensorFlow parity of properties -------------------------------------------------------


def test_tf_properties():
    ls = jls.DynamicLossScale()
    assert (ls.initial_loss_scale, ls.increment_period, ls.multiplier) == (32768.0, 2000, 2.0)
    assert (type(ls.initial_loss_scale), type(ls.increment_period), type(ls.multiplier)) == (
        float,
        int,
        float,
    )
    ls = jls.DynamicLossScale(1024, 50, 4)
    assert (ls.initial_loss_scale, ls.increment_period, ls.multiplier) == (1024.0, 50, 4.0)
    restored = jls.deserialize(_json_round_trip(jls.serialize(ls)))
    assert (restored.initial_loss_scale, restored.increment_period, restored.multiplier) == (
        1024.0,
        50,
        4.0,
    )
    assert float(ls(ls.init())) == ls.initial_loss_scale


def test_register_refuses_an_abstract_class():
    with pytest.raises(TypeError) as excinfo:
        jls.register(jls.LossScale)
    assert str(excinfo.value) == (
        "register(cls=<class 'jax_lossscale._base.LossScale'>): cls must be concrete; "
        "it leaves abstract ['adjust', 'get_config', 'init']"
    )
