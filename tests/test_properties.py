"""Property tests: `DynamicLossScale.update` against the plain-Python reference model of the
update rule (`helpers.ReferenceLossScale`, docs/update-rule.md)."""

import functools
import math

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import jax_lossscale as jls

from helpers import F32_MAX, ReferenceLossScale

LENGTH = 40
SETTINGS = hypothesis.settings(max_examples=150, deadline=None)


_I = F32_MAX / 4


@pytest.mark.parametrize(
    ("args", "hysteresis", "steps", "expected"),
    [
        ((1, 2, 2), 1, "TTTTTT", [1, 2, 2, 4, 4, 8]),
        ((_I, 2, 2), 1, "TTTTTT", [_I, 2 * _I, 2 * _I, 4 * _I, 4 * _I, 4 * _I]),
        ((1024, 2, 2), 1, "FFFFFF", [512, 256, 128, 64, 32, 16]),
        ((16, 2, 2), 1, "FFFFFF", [8, 4, 2, 1, 1, 1]),
        ((16, 2, 2), 2, "FFFTTTFF", [16, 8, 4, 4, 8, 8, 8, 4]),
    ],
)
def test_model_reproduces_the_table_of_the_update_rule_page(args, hysteresis, steps, expected):
    model = ReferenceLossScale(*args, hysteresis=hysteresis)
    scales = []
    for flag in steps:
        model.step(flag == "T")
        scales.append(float(model.scale))
    assert scales == expected


INITIAL_SCALES = [
    0.3,
    0.5,
    1.0,
    2.0,
    3.0,
    10.0,
    12345.678,
    2.0**15,
    1e5,
    2.0**120,
    F32_MAX / 4,
    F32_MAX / 2,
    F32_MAX,
]
MIN_SCALES = [1e-3, 1 / 1024, 0.25, 0.3, 0.5, 1.0, 3.0, 100.0]


@st.composite
def hyperparameters(draw) -> dict:
    initial = draw(st.sampled_from(INITIAL_SCALES))
    max_factor = draw(
        st.none() | st.sampled_from([1.0, 1.5, 2.0, 3.0, 4.0, 10.0, 1000.0, math.inf])
    )
    return {
        "initial_loss_scale": initial,
        "increment_period": draw(st.integers(1, 5)),
        "multiplier": draw(st.sampled_from([2.0, 3.0, 1.5, 1.25, 1.1, 4.0, 10.0, 1.0000001])),
        "backoff_factor": draw(st.none() | st.sampled_from([0.5, 0.25, 0.75, 0.1, 0.3, 0.9999999])),
        "min_loss_scale": draw(
            st.sampled_from([m for m in [*MIN_SCALES, initial] if m <= initial])
        ),
        "max_loss_scale": None if max_factor is None else min(initial * max_factor, F32_MAX),
        "hysteresis": draw(st.integers(1, 4)),
        "consecutive_hysteresis": draw(st.booleans()),
    }


@st.composite
def gradient_values(draw) -> list[float]:
    """One value per step, placed inside the gradients: 1.0 for a finite step."""
    finite_weight = draw(st.integers(1, 8))
    choices = [1.0] * finite_weight + [math.inf, math.nan, -math.inf]
    return draw(st.lists(st.sampled_from(choices), min_size=1, max_size=LENGTH))


@functools.partial(jax.jit, static_argnums=0)
def run_scan(ls: jls.DynamicLossScale, values: jax.Array):
    def body(state, value):
        grads = {"w": jnp.stack([jnp.float32(0.5), value]), "h": jnp.ones(2, jnp.float16)}
        state, should_apply = ls.update(state, grads)
        return state, (state, should_apply)

    _, (states, should_apply) = jax.lax.scan(body, ls.init(), values)
    return states, should_apply


def run_library(kwargs: dict, values: list[float]):
    padded = np.ones(LENGTH, np.float32)
    padded[: len(values)] = values
    states, should_apply = run_scan(jls.DynamicLossScale(**kwargs), padded)
    n = len(values)
    return (
        np.asarray(states.loss_scale)[:n],
        np.asarray(states.good_steps)[:n],
        np.asarray(states.overflows_until_backoff)[:n],
        np.asarray(should_apply)[:n],
    )


@SETTINGS
@hypothesis.given(kwargs=hyperparameters(), values=gradient_values())
def test_update_matches_the_model_and_keeps_the_scale_within_bounds(kwargs, values):
    """One compile per example (the hyperparameters are static), both properties checked."""
    scales, good_steps, overflows_until_backoff, should_apply = run_library(kwargs, values)
    assert scales.dtype == np.float32
    model = ReferenceLossScale(**kwargs)
    expected = []
    for value in values:
        applied = model.step(math.isfinite(value))
        expected.append((model.scale, model.good_steps, model.overflows_until_backoff, applied))
    expected_scales = np.array([e[0] for e in expected], np.float32)
    np.testing.assert_array_equal(scales, expected_scales)
    assert scales.view(np.uint32).tolist() == expected_scales.view(np.uint32).tolist()
    assert good_steps.tolist() == [e[1] for e in expected]
    assert overflows_until_backoff.tolist() == [e[2] for e in expected]
    assert should_apply.tolist() == [e[3] for e in expected]
    # The bounds as the loss scale stores them: the float32 values it checks and uses.
    ls = jls.DynamicLossScale(**kwargs)
    ceiling = F32_MAX if ls.max_loss_scale is None else ls.max_loss_scale
    assert np.isfinite(scales).all()
    assert all(ls.min_loss_scale <= float(scale) <= ceiling for scale in scales)
