"""Update semantics of `DynamicLossScale` and `FixedLossScale` (docs/update-rule.md)."""

import copy
import dataclasses
import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

from helpers import JIT_MODES as MODES
from helpers import device_array
from helpers import jit_mode as mode_context

F32_MAX = float(np.finfo(np.float32).max)
NONFINITE = [jnp.inf, jnp.nan, -jnp.inf]


def finite_grads():
    return {"w": device_array(np.ones(3))}


def nonfinite_grads(value=jnp.inf):
    return {"w": device_array([1.0, value, 1.0])}


def grads_for(flag: str, index: int):
    # The kind of non-finite value cycles so that every trajectory sees inf, NaN and -inf.
    if flag == "T":
        return finite_grads()
    assert flag == "F"
    return nonfinite_grads(NONFINITE[index % 3])


def run(ls: jls.LossScale, steps: str, mode: str = "jit"):
    """Runs `ls.update` over `steps`; returns the state and should_apply after each step."""
    update = jax.jit(ls.update) if mode == "jit" else ls.update
    state = ls.init()
    states, applies = [], []
    with mode_context(mode):
        for index, flag in enumerate(steps):
            state, should_apply = update(state, grads_for(flag, index))
            states.append(state)
            applies.append(should_apply)
    return states, applies


def scales_of(states) -> list[float]:
    return [float(np.asarray(state.loss_scale)) for state in states]


def full_states_of(states) -> list[tuple[float, int, int]]:
    return [
        (
            float(np.asarray(s.loss_scale)),
            int(np.asarray(s.good_steps)),
            int(np.asarray(s.overflows_until_backoff)),
        )
        for s in states
    ]


def check_trajectory(ls, steps, expected_scales):
    states, applies = run(ls, steps)
    assert scales_of(states) == [float(x) for x in expected_scales]
    assert [bool(a) for a in applies] == [flag == "T" for flag in steps]
    for should_apply in applies:
        assert should_apply.dtype == jnp.bool_
        assert should_apply.shape == ()


def f32(x) -> np.float32:
    return np.float32(x)


# The table of docs/update-rule.md, row for row.
_I = F32_MAX / 4
UPDATE_RULE_TABLE = [
    pytest.param((1, 2, 2), {}, "TTTTTT", [1, 2, 2, 4, 4, 8], id="grow"),
    pytest.param((_I, 2, 2), {}, "TTTTTT", [_I, 2 * _I, 2 * _I, 4 * _I, 4 * _I, 4 * _I], id="max"),
    pytest.param((1024, 2, 2), {}, "FFFFFF", [512, 256, 128, 64, 32, 16], id="backoff"),
    pytest.param((16, 2, 2), {}, "FFFFFF", [8, 4, 2, 1, 1, 1], id="floor"),
    pytest.param(
        (16, 2, 2), {"hysteresis": 2}, "FFFTTTFF", [16, 8, 4, 4, 8, 8, 8, 4], id="hysteresis"
    ),
]


@pytest.mark.parametrize(("args", "kwargs", "steps", "expected"), UPDATE_RULE_TABLE)
def test_design_table(args, kwargs, steps, expected):
    check_trajectory(jls.DynamicLossScale(*args, **kwargs), steps, expected)


_THIRD = f32(10) / f32(3)
_NINTH = _THIRD / f32(3)

TRAJECTORIES = [
    # Growth on exactly the increment_period-th finite step, never one late.
    pytest.param((1, 3, 2), {}, "TTTTTTT", [1, 1, 2, 2, 2, 4, 4], id="period3"),
    pytest.param((1, 1, 2), {}, "TTTT", [2, 4, 8, 16], id="period1"),
    pytest.param((1, 2000, 2), {}, "T" * 5, [1] * 5, id="default-period-no-growth"),
    # A non-finite step resets the count of finite steps.
    pytest.param((8, 3, 2), {}, "TTFTTT", [8, 8, 4, 4, 4, 8], id="reset"),
    pytest.param((8, 3, 2), {}, "TTFTTFTTT", [8, 8, 4, 4, 4, 2, 2, 2, 4], id="reset-twice"),
    pytest.param((8, 2, 2), {}, "TFTFTF", [8, 4, 4, 2, 2, 1], id="alternating"),
    # backoff_factor replaces the division by multiplier; growth still uses multiplier.
    pytest.param(
        (1024, 2, 2), {"backoff_factor": 0.25}, "FFFTT", [256, 64, 16, 16, 32], id="backoff0.25"
    ),
    pytest.param(
        (81, 1, 3), {"backoff_factor": 0.5}, "TFTF", [243, 121.5, 364.5, 182.25], id="backoff0.5x3"
    ),
    pytest.param(
        (1, 1, 2),
        {"backoff_factor": 0.1, "min_loss_scale": 0.25},
        "F",
        [0.25],
        id="backoff-floored",
    ),
    pytest.param(
        (1, 1, 2),
        {"backoff_factor": 0.75, "min_loss_scale": 0.25},
        "FFT",
        [0.75, f32(0.75) * f32(0.75), f32(0.75) * f32(0.75) * f32(2)],
        id="backoff0.75",
    ),
    # multiplier 3: float32 arithmetic.
    pytest.param((1, 1, 3), {}, "TTTF", [3, 9, 27, 9], id="mult3-exact"),
    pytest.param(
        (10, 1, 3),
        {"min_loss_scale": 0.5},
        "FFTT",
        [_THIRD, _NINTH, _NINTH * f32(3), _NINTH * f32(3) * f32(3)],
        id="mult3-float32",
    ),
    pytest.param((2, 1, 3), {}, "FF", [1, 1], id="mult3-floor"),
    pytest.param(
        (1, 1, 1.5),
        {"min_loss_scale": 0.1},
        "TTF",
        [1.5, 2.25, 1.5],
        id="mult1.5",
    ),
    # min_loss_scale below 1, and a floor that is not a power of two.
    pytest.param(
        (1, 2, 2), {"min_loss_scale": 0.25}, "FFFF", [0.5, 0.25, 0.25, 0.25], id="min0.25"
    ),
    pytest.param((10, 1, 2), {"min_loss_scale": 3}, "FFT", [5, 3, 6], id="min3"),
    pytest.param((1, 1, 2), {"min_loss_scale": 1}, "FFFT", [1, 1, 1, 2], id="at-floor"),
    # max_loss_scale: growth refused past it, allowed onto it exactly.
    pytest.param((1, 1, 2), {"max_loss_scale": 4}, "TTTT", [2, 4, 4, 4], id="max-equal"),
    pytest.param((1, 1, 2), {"max_loss_scale": 5}, "TTTT", [2, 4, 4, 4], id="max-between"),
    pytest.param((1, 1, 2), {"max_loss_scale": 7.999}, "TTT", [2, 4, 4], id="max-just-below"),
    pytest.param((1, 1, 3), {"max_loss_scale": 9}, "TTT", [3, 9, 9], id="max-mult3"),
    pytest.param((1, 2, 2), {"max_loss_scale": 2}, "TTTTTT", [1, 2, 2, 2, 2, 2], id="max-period2"),
    pytest.param((1, 1, 2), {"max_loss_scale": 1}, "TT", [1, 1], id="max-equals-initial"),
    pytest.param((1, 1, 2), {"max_loss_scale": 4}, "TTTFT", [2, 4, 4, 2, 4], id="max-then-back"),
    # Growth refused when the product is not finite.
    pytest.param(
        (F32_MAX / 2, 1, 2), {}, "TTTF", [F32_MAX, F32_MAX, F32_MAX, F32_MAX / 2], id="to-max"
    ),
    pytest.param((F32_MAX / 2, 1, 3), {}, "TT", [F32_MAX / 2, F32_MAX / 2], id="mult3-inf"),
    pytest.param((F32_MAX, 1, 2), {"max_loss_scale": F32_MAX}, "TT", [F32_MAX] * 2, id="at-max"),
    pytest.param((2.0**127, 1, 2), {}, "TTF", [2.0**127, 2.0**127, 2.0**126], id="pow2-127"),
    # Hysteresis.
    pytest.param(
        (16, 3, 2), {"hysteresis": 2}, "FTFTF", [16, 16, 8, 8, 4], id="hysteresis-not-consecutive"
    ),
    pytest.param(
        (16, 3, 2),
        {"hysteresis": 2, "consecutive_hysteresis": True},
        "FTFTF",
        [16, 16, 16, 16, 16],
        id="hysteresis-consecutive",
    ),
    pytest.param(
        (64, 2, 2),
        {"hysteresis": 3},
        "FFFFTTFFF",
        [64, 64, 32, 16, 16, 32, 32, 32, 16],
        id="hysteresis3",
    ),
    pytest.param(
        (64, 2, 2),
        {"hysteresis": 3, "backoff_factor": 0.25},
        "FFFF",
        [64, 64, 16, 4],
        id="hysteresis3-backoff",
    ),
    pytest.param(
        (4, 1, 2),
        {"hysteresis": 2, "max_loss_scale": 4},
        "FTFF",
        [4, 4, 4, 2],
        id="hysteresis-refilled-when-growth-refused",
    ),
    pytest.param(
        (4, 1, 2),
        {"hysteresis": 2, "min_loss_scale": 2},
        "FFFFT",
        [4, 2, 2, 2, 4],
        id="hysteresis-floor",
    ),
]


@pytest.mark.parametrize(("args", "kwargs", "steps", "expected"), TRAJECTORIES)
def test_trajectory(args, kwargs, steps, expected):
    check_trajectory(jls.DynamicLossScale(*args, **kwargs), steps, expected)


# (scale, good_steps, overflows_until_backoff) after each step.
FULL_STATES = [
    pytest.param(
        (1, 3, 2),
        {},
        "TTTTF",
        [(1, 1, 1), (1, 2, 1), (2, 0, 1), (2, 1, 1), (1, 0, 1)],
        id="period3",
    ),
    pytest.param(
        (8, 3, 2),
        {},
        "TTFTTT",
        [(8, 1, 1), (8, 2, 1), (4, 0, 1), (4, 1, 1), (4, 2, 1), (8, 0, 1)],
        id="reset",
    ),
    pytest.param(
        (64, 2, 2),
        {"hysteresis": 3},
        "FFFFTTFFF",
        [
            (64, 0, 2),
            (64, 0, 1),
            (32, 0, 1),
            (16, 0, 1),
            (16, 1, 1),
            (32, 0, 3),
            (32, 0, 2),
            (32, 0, 1),
            (16, 0, 1),
        ],
        id="hysteresis3",
    ),
    pytest.param(
        (16, 3, 2),
        {"hysteresis": 2},
        "FTFTF",
        [(16, 0, 1), (16, 1, 1), (8, 0, 1), (8, 1, 1), (4, 0, 1)],
        id="not-consecutive",
    ),
    pytest.param(
        (16, 3, 2),
        {"hysteresis": 2, "consecutive_hysteresis": True},
        "FTFTF",
        [(16, 0, 1), (16, 1, 2), (16, 0, 1), (16, 1, 2), (16, 0, 1)],
        id="consecutive",
    ),
    pytest.param(
        (4, 1, 2),
        {"hysteresis": 2, "max_loss_scale": 4},
        "FTFF",
        [(4, 0, 1), (4, 0, 2), (4, 0, 1), (2, 0, 1)],
        id="refill-when-growth-refused",
    ),
    pytest.param(
        (1, 2, 2),
        {"max_loss_scale": 2},
        "TTTT",
        [(1, 1, 1), (2, 0, 1), (2, 1, 1), (2, 0, 1)],
        id="good-steps-reset-when-growth-refused",
    ),
]


@pytest.mark.parametrize(("args", "kwargs", "steps", "expected"), FULL_STATES)
def test_full_state_trajectory(args, kwargs, steps, expected):
    states, applies = run(jls.DynamicLossScale(*args, **kwargs), steps)
    assert full_states_of(states) == expected
    assert [bool(a) for a in applies] == [flag == "T" for flag in steps]


def test_consecutive_hysteresis_changes_the_trajectory():
    steps = "FTFTFTF"
    plain = jls.DynamicLossScale(16, 3, 2, hysteresis=2)
    consecutive = jls.DynamicLossScale(16, 3, 2, hysteresis=2, consecutive_hysteresis=True)
    assert scales_of(run(plain, steps, "jit")[0]) == [16, 16, 8, 8, 4, 4, 2]
    assert scales_of(run(consecutive, steps, "jit")[0]) == [16] * 7


@pytest.mark.parametrize("value", NONFINITE, ids=["inf", "nan", "-inf"])
def test_each_nonfinite_value_detected(value):
    ls = jls.DynamicLossScale(8.0, 2, 2.0)
    state, should_apply = ls.update(ls.init(), {"w": jnp.full((2, 3), value)})
    single, single_apply = ls.update(ls.init(), {"w": jnp.array(value)})
    assert not bool(should_apply)
    assert not bool(single_apply)
    assert float(state.loss_scale) == 4.0
    assert float(single.loss_scale) == 4.0


@pytest.mark.parametrize("value", NONFINITE, ids=["inf", "nan", "-inf"])
def test_nonfinite_in_one_leaf_among_many(value):
    ls = jls.DynamicLossScale(8.0, 1, 2.0)
    host = {
        f"layer{i}": {"w": np.ones((4, 5), np.float32), "b": np.zeros(5, np.float32)}
        for i in range(6)
    }
    bad_host = copy.deepcopy(host)
    bad_host["layer4"]["w"][3, 2] = value
    leaves, bad = jax.tree.map(jnp.asarray, (host, bad_host))
    good_state, good_apply = jax.jit(ls.update)(ls.init(), leaves)
    bad_state, bad_apply = jax.jit(ls.update)(ls.init(), [leaves, (bad,)])
    assert bool(good_apply)
    assert float(good_state.loss_scale) == 16.0
    assert not bool(bad_apply)
    assert float(bad_state.loss_scale) == 4.0


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("value", NONFINITE, ids=["inf", "nan", "-inf"])
def test_low_precision_leaves(dtype, value):
    ls = jls.DynamicLossScale(8.0, 1, 2.0)
    ones = device_array(np.ones(2))
    finite = {"a": device_array(np.full(4, 3.0), dtype), "b": ones}
    nonfinite = {"a": device_array([1.0, value, 2.0], dtype), "b": ones}
    state, should_apply = ls.update(ls.init(), finite)
    assert bool(should_apply)
    assert float(state.loss_scale) == 16.0
    state, should_apply = ls.update(state, nonfinite)
    assert not bool(should_apply)
    assert float(state.loss_scale) == 8.0


def test_float16_overflow_is_detected():
    ls = jls.DynamicLossScale(8.0, 1, 2.0)
    overflowed = jnp.array([60000.0], jnp.float16) * jnp.array([2.0], jnp.float16)
    assert jnp.isinf(overflowed).all()
    state, should_apply = ls.update(ls.init(), {"w": overflowed})
    assert not bool(should_apply)
    assert float(state.loss_scale) == 4.0


def float0_zeros(shape):
    return np.zeros(shape, dtype=jax.dtypes.float0)


def test_non_floating_leaves_are_ignored():
    ls = jls.DynamicLossScale(8.0, 1, 2.0)
    extra = {
        "int": device_array([np.iinfo(np.int32).max, np.iinfo(np.int32).min], jnp.int32),
        "uint8": device_array([255], jnp.uint8),
        "bool": device_array([True, False], jnp.bool_),
        "none": None,
        "float0": float0_zeros((3,)),
    }
    update = jax.jit(ls.update)
    state, should_apply = update(ls.init(), {**extra, "w": device_array(np.ones(3))})
    assert bool(should_apply)
    assert float(state.loss_scale) == 16.0
    state, should_apply = update(state, {**extra, "w": device_array([jnp.nan])})
    assert not bool(should_apply)
    assert float(state.loss_scale) == 8.0
    state, should_apply = update(state, extra)
    assert bool(should_apply)
    assert float(state.loss_scale) == 16.0


@pytest.mark.parametrize("tree", [{}, None, [], (None, {"a": None})], ids=repr)
def test_empty_gradients_are_finite(tree):
    ls = jls.DynamicLossScale(8.0, 1, 2.0)
    state, should_apply = ls.update(ls.init(), tree)
    assert bool(should_apply)
    assert float(state.loss_scale) == 16.0


@pytest.mark.parametrize("value", [1.0, *NONFINITE], ids=["finite", "inf", "nan", "-inf"])
def test_fixed_loss_scale_always_applies_and_never_changes(value):
    ls = jls.FixedLossScale(2.0**10)
    state = ls.init()
    before = np.asarray(state.loss_scale).copy()
    update = jax.jit(ls.update)
    new_state = state
    for _ in range(3):
        new_state, should_apply = update(new_state, {"w": device_array([1.0, value])})
        assert bool(should_apply)
        assert should_apply.dtype == jnp.bool_
        assert should_apply.shape == ()
    assert isinstance(new_state, jls.FixedLossScaleState)
    after = np.asarray(new_state.loss_scale)
    assert after.dtype == np.float32
    assert after.tobytes() == before.tobytes()
    assert float(ls(new_state)) == 1024.0


@pytest.mark.parametrize("value", [1, 1.5, 2**24 + 1, 3.3])
def test_fixed_loss_scale_is_float32(value):
    ls = jls.FixedLossScale(value)
    state = ls.init()
    assert state.loss_scale.dtype == jnp.float32
    assert state.loss_scale.shape == ()
    assert not state.loss_scale.weak_type
    assert ls(state).dtype == jnp.float32
    assert float(ls(state)) == float(np.float32(value))
    aval = jax.eval_shape(ls.init).loss_scale
    assert (aval.shape, aval.dtype, aval.weak_type) == ((), jnp.float32, False)


DYNAMIC_DTYPES = (jnp.float32, jnp.int32, jnp.int32)


def check_state_avals(state):
    assert isinstance(state, jls.DynamicLossScaleState)
    for leaf, dtype in zip(state, DYNAMIC_DTYPES, strict=True):
        assert leaf.shape == ()
        assert leaf.dtype == dtype
        assert leaf.weak_type is False


STATE_CONFIGS = [
    jls.DynamicLossScale(),
    jls.DynamicLossScale(1, 1, 3),
    jls.DynamicLossScale(
        2**15,
        2,
        2.0,
        backoff_factor=0.5,
        min_loss_scale=0.25,
        max_loss_scale=2.0**17,
        hysteresis=3,
        consecutive_hysteresis=True,
    ),
]


@pytest.mark.parametrize("ls", STATE_CONFIGS, ids=["default", "mult3", "all-options"])
def test_state_dtypes_from_init(ls):
    check_state_avals(ls.init())
    check_state_avals(jax.eval_shape(ls.init))
    check_state_avals(jax.jit(ls.init)())


@pytest.mark.parametrize("ls", STATE_CONFIGS, ids=["default", "mult3", "all-options"])
def test_state_dtypes_after_update(ls):
    states, applies = run(ls, "TTFTFFTTTT")
    for state in states:
        check_state_avals(state)
    for should_apply in applies:
        assert (should_apply.shape, should_apply.dtype) == ((), jnp.bool_)
    out_state, out_apply = jax.eval_shape(ls.update, ls.init(), finite_grads())
    check_state_avals(out_state)
    assert (out_apply.shape, out_apply.dtype, out_apply.weak_type) == ((), jnp.bool_, False)
    jaxpr = jax.make_jaxpr(ls.update)(ls.init(), nonfinite_grads())
    assert [(a.shape, a.dtype, a.weak_type) for a in jaxpr.out_avals] == [
        ((), jnp.float32, False),
        ((), jnp.int32, False),
        ((), jnp.int32, False),
        ((), jnp.bool_, False),
    ]


def test_one_trace_over_100_steps():
    ls = jls.DynamicLossScale(4.0, 3, 2.0, hysteresis=2)
    traces = 0

    @chex.assert_max_traces(n=1)
    def step(state, grads):
        nonlocal traces
        traces += 1
        return ls.update(state, grads)

    jitted = jax.jit(step)
    state = ls.init()
    scales, applies = [float(state.loss_scale)], []
    for i in range(100):
        flag = "F" if i % 11 in (7, 8) else "T"
        state, should_apply = jitted(state, grads_for(flag, i))
        scales.append(float(state.loss_scale))
        applies.append(bool(should_apply))
    assert traces == 1
    assert not all(applies)
    assert any(b > a for a, b in itertools.pairwise(scales))
    assert any(b < a for a, b in itertools.pairwise(scales))
    # Each window of 11 steps: 7 finite steps grow twice, two overflows back off once.
    assert scales[:12] == [4, 4, 4, 8, 8, 8, 16, 16, 16, 8, 8, 8]


def check_min_floor_trajectory(update, ls):
    state = ls.init()
    scales = []
    for flag in "FFFTTF":
        state, _ = update(ls, state, grads_for(flag, 0))
        scales.append(float(state.loss_scale))
    return scales


HYPER_LS = jls.DynamicLossScale(1.0, 2, 2.0, min_loss_scale=0.25, max_loss_scale=1.0, hysteresis=2)
HYPER_EXPECTED = [1.0, 0.5, 0.25, 0.25, 0.5, 0.5]


def test_loss_scale_closed_over_in_jit():
    closed = jax.jit(lambda state, grads: HYPER_LS.update(state, grads))
    scales = check_min_floor_trajectory(lambda ls, s, g: closed(s, g), HYPER_LS)
    assert scales == HYPER_EXPECTED


def test_loss_scale_as_static_argument():
    static = jax.jit(lambda ls, state, grads: ls.update(state, grads), static_argnums=0)
    assert check_min_floor_trajectory(static, HYPER_LS) == HYPER_EXPECTED


def test_loss_scale_as_regular_jit_argument():
    assert jax.tree.leaves(HYPER_LS) == []
    assert jax.tree.leaves(jls.FixedLossScale(4.0)) == []
    regular = jax.jit(lambda ls, state, grads: ls.update(state, grads))
    assert check_min_floor_trajectory(regular, HYPER_LS) == HYPER_EXPECTED
    fixed = jls.FixedLossScale(4.0)
    state, should_apply = regular(fixed, fixed.init(), nonfinite_grads())
    assert bool(should_apply)
    assert float(state.loss_scale) == 4.0


def test_loss_scale_returned_from_jit_keeps_hyperparameters():
    out = jax.jit(lambda ls: ls)(HYPER_LS)
    assert out == HYPER_LS
    assert out.min_loss_scale == 0.25
    assert out.max_loss_scale == 1.0


def test_equal_loss_scales_share_one_trace():
    traces = 0

    def step(ls, state, grads):
        nonlocal traces
        traces += 1
        return ls.update(state, grads)

    jitted = jax.jit(step, static_argnums=0)
    for ls in [jls.DynamicLossScale(2**15), jls.DynamicLossScale(32768.0)]:
        jitted(ls, ls.init(), finite_grads())
    assert traces == 1
    other = jls.DynamicLossScale(2**14)
    jitted(other, other.init(), finite_grads())
    assert traces == 2


def test_equality_and_hashing():
    a, b = jls.DynamicLossScale(2**15), jls.DynamicLossScale(32768.0)
    assert a == b
    assert hash(a) == hash(b)
    assert jls.DynamicLossScale() == a
    assert jls.DynamicLossScale(np.float32(32768), np.int64(2000), 2) == a
    assert jls.FixedLossScale(2) == jls.FixedLossScale(2.0)
    assert hash(jls.FixedLossScale(2)) == hash(jls.FixedLossScale(2.0))
    assert jls.FixedLossScale(2.0) != jls.DynamicLossScale(2.0)
    assert jls.DynamicLossScale(2.0) != jls.FixedLossScale(2.0)
    assert jls.FixedLossScale(2.0) != jls.FixedLossScale(4.0)
    assert len({a, b, jls.FixedLossScale(2.0), jls.FixedLossScale(2)}) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_loss_scale": 2.0**14},
        {"increment_period": 1999},
        {"multiplier": 3.0},
        {"backoff_factor": 0.5},
        {"min_loss_scale": 0.5},
        {"max_loss_scale": 2.0**20},
        {"hysteresis": 2},
        {"consecutive_hysteresis": True},
    ],
    ids=lambda kwargs: next(iter(kwargs)),
)
def test_different_hyperparameters_are_unequal(kwargs):
    assert jls.DynamicLossScale(**kwargs) != jls.DynamicLossScale()
    assert jls.DynamicLossScale(**kwargs) == jls.DynamicLossScale(**kwargs)
    assert hash(jls.DynamicLossScale(**kwargs)) == hash(jls.DynamicLossScale(**kwargs))


# jmp's README writes its scale `jmp.half_dtype()(2**15)`, a float16 scalar; its docstring
# `jnp.asarray(2.**15)`; the state holds the scale in float32 either way.
@pytest.mark.parametrize(
    "scale",
    [jnp.float16(2**15), np.float16(2**15), jnp.asarray(2.0**15), jnp.float32(2**15)],
    ids=["jnp.float16", "np.float16", "jnp.asarray", "jnp.float32"],
)
def test_a_scalar_array_initial_scale_outside_jit_is_the_number_it_holds(scale):
    ls = jls.DynamicLossScale(initial_loss_scale=scale)
    assert ls == jls.DynamicLossScale(2.0**15)
    assert ls.get_config()["initial_loss_scale"] == 32768.0
    chex.assert_trees_all_equal(ls.init(), jls.DynamicLossScale().init())


def _steps_of_a_loss_scale_built_inside(transform, write_scale, steps, axis_name=None):
    """The optimizer built inside the traced function, as a train state's init and a step
    written for jmp build it; returns the scale after each step and the applied flags."""

    def build():
        ls = jls.DynamicLossScale(initial_loss_scale=write_scale(), increment_period=2)
        return jls.loss_scaled(optax.sgd(1.0), ls, axis_name=axis_name)

    def init(params):
        return build().init(params)

    def step(params, opt_state, grads):
        updates, opt_state = build().update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = {"w": device_array([1.0, 2.0, 3.0])}
    opt_state = transform(init)(params)
    scales = [float(jls.get_loss_scale(opt_state))]
    for index, flag in enumerate(steps):
        scale = jls.get_loss_scale(opt_state)
        scaled = jax.tree.map(lambda g, scale=scale: g * scale, grads_for(flag, index))
        params, opt_state = transform(step)(params, opt_state, scaled)
        scales.append(float(jls.get_loss_scale(opt_state)))
    return scales, params


@pytest.mark.parametrize(
    "write_scale",
    [lambda: jnp.float32(2**15), lambda: jnp.float16(2**15), lambda: jnp.asarray(2**15)],
    ids=["jnp.float32", "jnp.float16", "jnp.asarray-int"],
)
def test_a_loss_scale_built_inside_jit_from_a_traced_scale_runs_as_one_built_outside(
    write_scale,
):
    expected = _steps_of_a_loss_scale_built_inside(jax.jit, lambda: 2.0**15, "TFTTF")
    assert expected[0] == [32768.0, 32768.0, 16384.0, 16384.0, 32768.0, 16384.0]
    got = _steps_of_a_loss_scale_built_inside(jax.jit, write_scale, "TFTTF")
    assert got[0] == expected[0]
    chex.assert_trees_all_equal(got[1], expected[1])


def test_a_loss_scale_built_inside_pmap_from_a_traced_scale():
    def pmapped(fn):
        def replicated(*args):
            args = jax.tree.map(lambda x: np.stack([x, x]), args)
            out = jax.pmap(fn, axis_name="i", devices=jax.devices()[:2])(*args)
            return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)[0]), out)

        return replicated

    scales, _ = _steps_of_a_loss_scale_built_inside(
        pmapped, lambda: jnp.float32(2**15), "FTT", axis_name="i"
    )
    assert scales == [32768.0, 16384.0, 16384.0, 32768.0]


def test_a_loss_scale_built_from_a_traced_scale_leaves_no_tracer_behind():
    """What is cached by loss scale (its jitted rule, its state's shapes) outlives the trace:
    it is cached by an equal loss scale that holds no tracer."""

    def make_tx():
        ls = jls.DynamicLossScale(jnp.float32(2**13), increment_period=1, multiplier=4.0)
        return jls.loss_scaled(optax.sgd(1.0), ls)

    @jax.jit
    def step(params, opt_state, grads):
        return make_tx().update(grads, opt_state, params)[1]

    params, scales = {"w": device_array([1.0, 2.0])}, []
    with jax.checking_leaks():
        opt_state = jax.jit(lambda p: make_tx().init(p))(params)
        for flag in "TF":
            opt_state = step(params, opt_state, grads_for(flag, 0))
            scales.append(float(jls.get_loss_scale(opt_state)))
    assert scales == [32768.0, 8192.0]


@pytest.mark.parametrize(
    ("value", "expected"),
    [(4.0, 4.0), (0.0, 2.0), (-8.0, 2.0), (2.0**20, 1024.0), (np.inf, 1024.0), (np.nan, 2.0)],
)
def test_a_traced_initial_scale_is_brought_within_the_bounds_by_init(value, expected):
    def init(scale):
        ls = jls.DynamicLossScale(scale, min_loss_scale=2.0, max_loss_scale=1024.0)
        return ls.init()

    state = jax.jit(init)(np.float32(value))
    chex.assert_trees_all_equal(
        state, jls.DynamicLossScaleState(jnp.float32(expected), jnp.int32(0), jnp.int32(1))
    )


@pytest.mark.parametrize(
    ("value", "steps", "expected"),
    [
        (0.0, "TTT", [4.0, 8.0, 16.0]),  # from the minimum, 2, grown at every step (period 1)
        (np.nan, "TTT", [4.0, 8.0, 16.0]),
        (np.inf, "FTT", [512.0, 1024.0, 1024.0]),  # from the maximum, backed off, grown back
    ],
)
def test_a_state_whose_scale_is_out_of_bounds_or_nan_is_brought_back_as_init_does(
    value, steps, expected
):
    """A state's scale of 0 or inf came back within the bounds on the next update, but a
    NaN one stayed NaN (jnp.clip keeps it), and loss_scaled skipped every step for good.
    NaN is the minimum now, as `init` takes a NaN initial scale."""
    ls = jls.DynamicLossScale(8.0, increment_period=1, min_loss_scale=2.0, max_loss_scale=1024.0)
    state = ls.init()._replace(loss_scale=jnp.float32(value))
    scales = []
    for flag in steps:
        state, _ = jax.jit(ls.adjust)(state, jnp.array(flag == "T"))
        scales.append(float(state.loss_scale))
    assert scales == expected


def test_max_below_min_is_named_before_a_traced_initial_scale_is_checked():
    """The traced initial scale is checked as min_loss_scale: max_loss_scale < min_loss_scale
    was reported as "max_loss_scale must be None or >= initial_loss_scale (10.0)", a value
    never passed as the initial scale."""
    message = (
        "DynamicLossScale(max_loss_scale=5.0): max_loss_scale must be None or >= "
        "min_loss_scale (10.0)"
    )

    def build(scale):
        return jls.DynamicLossScale(scale, min_loss_scale=10.0, max_loss_scale=5.0).init()

    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):  # (jax adds a note)
        jax.jit(build)(jnp.float32(8.0))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build(8.0)


def test_a_traced_initial_scale_compares_by_the_other_fields_and_has_no_config():
    seen = {}

    def build(a, b):
        seen["a"] = jls.DynamicLossScale(a, increment_period=10)
        seen["b"] = jls.DynamicLossScale(b, increment_period=10)
        seen["c"] = jls.DynamicLossScale(b, increment_period=20)
        seen["equal"] = seen["a"] == seen["b"] and hash(seen["a"]) == hash(seen["b"])
        seen["unequal"] = seen["a"] != seen["c"] and seen["a"] != jls.DynamicLossScale(a.size)
        with pytest.raises(TypeError) as excinfo:
            seen["a"].get_config()
        seen["message"] = str(excinfo.value)
        return a

    jax.jit(build)(np.float32(8.0), np.float32(16.0))
    assert seen["equal"]
    assert seen["unequal"]
    assert seen["message"] == (
        "DynamicLossScale.get_config: initial_loss_scale is traced, and a config holds "
        "numbers; build the loss scale with a number outside the traced function to "
        "serialize it"
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("flag", ["T", "F"])
def test_inputs_are_not_mutated(flag, mode):
    ls = jls.DynamicLossScale(8.0, 1, 2.0, hysteresis=2)
    # NumPy arrays are mutable, so an in-place write would show.
    state = jls.DynamicLossScaleState(
        loss_scale=np.array(8.0, np.float32),
        good_steps=np.array(0, np.int32),
        overflows_until_backoff=np.array(1, np.int32),
    )
    grads = {"w": np.array([1.0, np.inf if flag == "F" else 2.0], np.float32), "n": None}
    state_copy = jax.tree.map(np.array, state)
    grads_copy = jax.tree.map(np.array, grads)
    # Eagerly, the library's code holds these arrays themselves; under jit, copies.
    update = jax.jit(ls.update) if mode == "jit" else ls.update
    with mode_context(mode):
        new_state, _ = update(state, grads)
    chex.assert_trees_all_equal(state, state_copy)
    chex.assert_trees_all_equal(grads, grads_copy)
    assert float(new_state.loss_scale) == (16.0 if flag == "T" else 4.0)


def test_vmap_over_states():
    ls = jls.DynamicLossScale(8.0, 2, 2.0, hysteresis=2)
    states = [
        jls.DynamicLossScaleState(jnp.float32(8), jnp.int32(0), jnp.int32(2)),
        jls.DynamicLossScaleState(jnp.float32(16), jnp.int32(1), jnp.int32(2)),
        jls.DynamicLossScaleState(jnp.float32(4), jnp.int32(0), jnp.int32(1)),
        jls.DynamicLossScaleState(jnp.float32(4), jnp.int32(1), jnp.int32(2)),
    ]
    batch = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *states)
    host_w = np.array([[1.0, 2.0], [3.0, 4.0], [np.inf, 1.0], [1.0, np.nan]], np.float32)
    grads = {"w": jnp.asarray(host_w)}
    vmapped = jax.jit(jax.vmap(ls.update))
    new_batch, should_apply = vmapped(batch, grads)
    assert [bool(x) for x in should_apply] == [True, True, False, False]
    check_state_avals(jax.tree.map(lambda x: x[0], new_batch))
    expected = [(8.0, 1, 2), (32.0, 0, 2), (2.0, 0, 1), (4.0, 0, 1)]
    assert full_states_of([jax.tree.map(lambda x, i=i: x[i], new_batch) for i in range(4)]) == (
        expected
    )
    for i, state in enumerate(states):
        single, single_apply = ls.update(state, {"w": jnp.asarray(host_w[i])})
        chex.assert_trees_all_equal(single, jax.tree.map(lambda x, i=i: x[i], new_batch))
        assert bool(single_apply) == bool(should_apply[i])


def test_vmap_over_states_with_shared_grads():
    ls = jls.DynamicLossScale(8.0, 1, 2.0, min_loss_scale=2.0)
    batch = jls.DynamicLossScaleState(
        device_array([2.0, 8.0, 64.0]),
        device_array(np.zeros(3), jnp.int32),
        device_array(np.ones(3), jnp.int32),
    )
    new_batch, should_apply = jax.vmap(ls.update, in_axes=(0, None))(batch, nonfinite_grads())
    assert np.asarray(should_apply).tolist() == [False, False, False]
    assert np.asarray(new_batch.loss_scale).tolist() == [2.0, 4.0, 32.0]
    new_batch, should_apply = jax.vmap(ls.update, in_axes=(0, None))(batch, finite_grads())
    assert np.asarray(should_apply).tolist() == [True, True, True]
    assert np.asarray(new_batch.loss_scale).tolist() == [4.0, 16.0, 128.0]


@pytest.mark.parametrize(
    ("kwargs", "name", "value"),
    [
        ({"min_loss_scale": 1e-42}, "min_loss_scale", "1e-42"),
        (
            {"initial_loss_scale": 1.0, "min_loss_scale": 2.0**-130},
            "min_loss_scale",
            "7.346839692639297e-40",
        ),
        (
            {"initial_loss_scale": 2.0**-128, "min_loss_scale": 2.0**-126},
            "initial_loss_scale",
            "2.938735877055719e-39",
        ),
    ],
)
def test_subnormal_scales_are_refused_because_xla_flushes_them_to_zero(kwargs, name, value):
    with pytest.raises(ValueError, match="smallest normal float32") as excinfo:
        jls.DynamicLossScale(**kwargs)
    assert str(excinfo.value) == (
        f"DynamicLossScale({name}={value}): {name} must be >= the smallest normal float32 "
        "(1.1754943508222875e-38)"
    )


@pytest.mark.parametrize("mode", MODES)
def test_the_smallest_normal_floor_holds(mode):
    tiny = float(np.finfo(np.float32).tiny)
    ls = jls.DynamicLossScale(tiny * 4, 1, 2.0, min_loss_scale=tiny)
    # Op by op, each intermediate below the floor is rounded and flushed on its own.
    states, _ = run(ls, "FFFF", mode)
    assert scales_of(states) == [tiny * 2, tiny, tiny, tiny]


@pytest.mark.parametrize("multiplier", [3.0, 1.5, 1.1, 7.0])
def test_backoff_division_is_the_same_with_and_without_jit(multiplier):
    ls = jls.DynamicLossScale(1000.0, 1, multiplier, min_loss_scale=1e-3)
    steps = "FFFFTFF"
    expected, scale = [], np.float32(1000)
    for flag in steps:
        scale = scale * np.float32(multiplier) if flag == "T" else scale / np.float32(multiplier)
        expected.append(float(scale))
    assert scales_of(run(ls, steps, "nojit")[0]) == expected
    assert scales_of(run(ls, steps, "jit")[0]) == expected


@dataclasses.dataclass(frozen=True)
class _SubclassedDynamicLossScale(jls.DynamicLossScale):
    pass


@dataclasses.dataclass(frozen=True)
class _UserLossScale(jls.LossScale):
    value: float

    def init(self):
        return jls.FixedLossScaleState(jnp.asarray(self.value, jnp.float32))

    def __call__(self, state):
        return state.loss_scale

    def adjust(self, state, grads_finite):
        return state, grads_finite

    def get_config(self):
        return {"value": self.value}


@pytest.mark.parametrize(
    "ls", [_SubclassedDynamicLossScale(8.0, 1), _UserLossScale(8.0)], ids=["dynamic", "user"]
)
def test_user_subclasses_pass_through_jit_as_ordinary_arguments(ls):
    assert jax.tree.leaves(ls) == []
    assert jax.tree.leaves({"ls": ls, "x": jnp.ones(1)}) == [jnp.ones(1)]

    @jax.jit
    def step(loss_scale, state, grads):
        return loss_scale.update(state, loss_scale.unscale(state, grads))

    state, should_apply = step(ls, ls.init(), {"w": jnp.full(2, 16.0)})
    assert bool(should_apply)
    assert float(ls(state)) == (16.0 if isinstance(ls, jls.DynamicLossScale) else 8.0)
