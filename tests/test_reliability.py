"""Reliability: the wrapper against a plain-Python model, counter limits, float64 and float16
extremes and the skip statistics (docs/reliability.md; the rule: docs/update-rule.md)."""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import textwrap
from typing import NamedTuple

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st

import jax_lossscale as jls

from helpers import ReferenceLossScale, assert_bits_equal, jitted, stats_dict

INT32_MAX = 2**31 - 1


def int32(value: int) -> jax.Array:
    return jnp.asarray(value, jnp.int32)


# --- 1. the wrapper against a plain-Python model --------------------------------------------

INNERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
}
PARAMS = {"b": np.zeros(2, np.float32), "w": np.ones(3, np.float32)}
BAD_VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@functools.cache
def reference_update(inner_name: str):
    return jax.jit(INNERS[inner_name]().update)


@functools.partial(jax.jit, static_argnums=(0, 1))
def wrapped_update(ls: jls.DynamicLossScale, inner_name: str, scaled_grads, opt_state, params):
    return jls.loss_scaled(INNERS[inner_name](), ls).update(scaled_grads, opt_state, params)


class Model:
    """The wrapper's statistics in plain Python, around the reference model of the update rule."""

    def __init__(self, config: dict):
        self.rule = ReferenceLossScale(**config)
        self.skipped = self.nan_skipped = self.inf_skipped = self.consecutive = 0

    @property
    def scale(self) -> np.float32:
        return self.rule.scale

    @property
    def good_steps(self) -> int:
        return self.rule.good_steps

    @property
    def overflows_until_backoff(self) -> int:
        return self.rule.overflows_until_backoff

    def step(self, kind: str) -> bool:
        self.last_kind = kind
        if self.rule.step(kind == "finite"):
            self.consecutive = 0
            return True
        self.skipped += 1
        self.consecutive += 1
        if kind == "nan":
            self.nan_skipped += 1
        else:
            self.inf_skipped += 1
        return False

    def stats(self, applied: bool, grads: dict) -> dict:
        entries = np.concatenate([np.ravel(grad).astype(np.float64) for grad in grads.values()])
        norm = np.linalg.norm(entries)
        return {
            "loss_scale": float(self.scale),
            # After an overflow: NaN where the gradients held a NaN, +inf where +-inf.
            "grad_norm": (
                pytest.approx(norm, rel=1e-6)
                if applied
                else ("nan" if self.last_kind == "nan" else math.inf)
            ),
            "skipped_steps": self.skipped,
            "nan_skipped_steps": self.nan_skipped,
            "inf_skipped_steps": self.inf_skipped,
            "spike_skipped_steps": 0,
            "consecutive_skipped_steps": self.consecutive,
            "last_step_applied": applied,
        }


@st.composite
def configs(draw) -> dict:
    exponent = draw(st.integers(-2, 20))
    max_exponent = draw(st.none() | st.integers(exponent, exponent + 6))
    return {
        "initial_loss_scale": 2.0**exponent,
        "increment_period": draw(st.integers(1, 5)),
        "multiplier": draw(st.sampled_from([2.0, 4.0])),
        "backoff_factor": draw(st.sampled_from([None, None, 0.5])),
        "min_loss_scale": 2.0 ** draw(st.integers(-4, exponent)),
        "max_loss_scale": None if max_exponent is None else 2.0**max_exponent,
        "hysteresis": draw(st.integers(1, 3)),
        "consecutive_hysteresis": draw(st.booleans()),
    }


# Each step: its kind and the flat index (over b then w) of the entry that holds the bad value.
STEPS = st.lists(
    st.tuples(st.sampled_from(["finite"] * 3 + list(BAD_VALUES)), st.integers(0, 4)),
    min_size=1,
    max_size=16,
)


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
    config=configs(),
    inner_name=st.sampled_from(sorted(INNERS)),
    steps=STEPS,
    seed=st.integers(0, 2**16),
)
def test_wrapper_matches_the_model(config, inner_name, steps, seed):
    ls = jls.DynamicLossScale(**config)
    rng = np.random.default_rng(seed)
    opt_state = jls.loss_scaled(INNERS[inner_name](), ls).init(PARAMS)
    ref_state = INNERS[inner_name]().init(PARAMS)
    model = Model(config)
    for index, (kind, position) in enumerate(steps):
        assert float(jls.get_loss_scale(opt_state)) == model.scale
        true_grads = {
            "b": rng.standard_normal(2).astype(np.float32),
            "w": rng.standard_normal(3).astype(np.float32),
        }
        # Power-of-two scales: scaling and unscaling are exact.
        scaled_grads = {name: grad * model.scale for name, grad in true_grads.items()}
        if kind != "finite":
            name, entry = ("b", position) if position < 2 else ("w", position - 2)
            scaled_grads[name][entry] = BAD_VALUES[kind]
        before = opt_state
        updates, opt_state = wrapped_update(ls, inner_name, scaled_grads, opt_state, PARAMS)

        applied = model.step(kind)
        assert stats_dict(opt_state) == model.stats(applied, true_grads), (index, kind)
        ls_state = opt_state.loss_scale_state
        assert (ls_state.good_steps.item(), ls_state.overflows_until_backoff.item()) == (
            model.good_steps,
            model.overflows_until_backoff,
        ), index
        if applied:
            ref_updates, ref_state = reference_update(inner_name)(true_grads, ref_state, PARAMS)
            # Two programs: XLA may contract multiply-adds differently, so the last bits
            # may differ; the next step starts again from the same state.
            chex.assert_trees_all_close(updates, ref_updates, rtol=1e-6, atol=1e-6)
            chex.assert_trees_all_close(opt_state.inner_state, ref_state, rtol=1e-6, atol=1e-6)
            ref_state = opt_state.inner_state
        else:
            negative_zeros = {"b": np.full(2, -0.0, np.float32), "w": np.full(3, -0.0, np.float32)}
            assert_bits_equal(updates, negative_zeros)
            assert_bits_equal(opt_state.inner_state, before.inner_state)


# --- 2. counters never overflow -------------------------------------------------------------


def test_increment_period_int32_max():
    ls = jls.DynamicLossScale(initial_loss_scale=8.0, increment_period=INT32_MAX, hysteresis=2)
    assert ls.increment_period == INT32_MAX
    assert ls.get_config()["increment_period"] == INT32_MAX
    state = ls.init()
    grads = {"w": jnp.ones(2)}

    state, applied = jitted(ls.update, state, grads)
    assert (state.loss_scale.item(), state.good_steps.item(), applied.item()) == (8.0, 1, True)

    state = state._replace(good_steps=int32(INT32_MAX - 2), overflows_until_backoff=int32(1))
    state, _ = jitted(ls.update, state, grads)
    # One step short of the period: no growth, the tolerance is not refilled.
    assert tuple(leaf.item() for leaf in state) == (8.0, INT32_MAX - 1, 1)
    state, _ = jitted(ls.update, state, grads)
    assert tuple(leaf.item() for leaf in state) == (16.0, 0, 2)
    chex.assert_trees_all_equal_dtypes(state, ls.init())


def test_increment_period_int32_max_through_the_wrapper():
    ls = jls.DynamicLossScale(initial_loss_scale=8.0, increment_period=INT32_MAX)
    tx = jls.loss_scaled(optax.sgd(1.0), ls)
    params = {"w": jnp.zeros(2)}
    opt_state = tx.init(params)
    opt_state = opt_state._replace(
        loss_scale_state=opt_state.loss_scale_state._replace(good_steps=int32(INT32_MAX - 1))
    )
    updates, opt_state = jitted(tx.update, {"w": jnp.array([8.0, -16.0])}, opt_state, params)
    chex.assert_trees_all_equal(updates, {"w": jnp.array([-1.0, 2.0])})
    assert jls.get_loss_scale(opt_state).item() == 16.0
    assert opt_state.loss_scale_state.good_steps.item() == 0


def test_hysteresis_int32_max_counts_down_without_wrapping():
    ls = jls.DynamicLossScale(initial_loss_scale=8.0, increment_period=2, hysteresis=INT32_MAX)
    state = ls.init()
    assert state.overflows_until_backoff.item() == INT32_MAX
    bad = {"w": jnp.array([jnp.inf])}
    state, _ = jitted(ls.update, state, bad)
    state, _ = jitted(ls.update, state, bad)
    assert tuple(leaf.item() for leaf in state) == (8.0, 0, INT32_MAX - 2)
    for _ in range(2):
        state, _ = jitted(ls.update, state, {"w": jnp.ones(1)})
    assert tuple(leaf.item() for leaf in state) == (16.0, 0, INT32_MAX)


def test_overflows_until_backoff_stays_at_one():
    ls = jls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=3, hysteresis=3)
    state = ls.init()
    trajectory = []
    for _ in range(6):
        state, _ = jitted(ls.update, state, {"w": jnp.array([jnp.nan])})
        trajectory.append(tuple(leaf.item() for leaf in state))
    assert trajectory == [
        (1024.0, 0, 2),
        (1024.0, 0, 1),
        (512.0, 0, 1),
        (256.0, 0, 1),
        (128.0, 0, 1),
        (64.0, 0, 1),
    ]


@pytest.mark.parametrize(
    ("bad", "kind_counter"),
    [(jnp.nan, "nan_skipped_steps"), (jnp.inf, "inf_skipped_steps")],
    ids=["nan", "inf"],
)
def test_skip_counters_saturate_at_int32_max(bad, kind_counter):
    tx = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale(initial_loss_scale=2.0**10))
    params = {"w": jnp.ones(2)}
    opt_state = tx.init(params)
    near_max = int32(INT32_MAX - 1)
    counters = ["skipped_steps", kind_counter, "consecutive_skipped_steps"]
    opt_state = opt_state._replace(
        stats=opt_state.stats._replace(**dict.fromkeys(counters, near_max))
    )
    other_counter = ({"nan_skipped_steps", "inf_skipped_steps"} - {kind_counter}).pop()
    for _ in range(3):
        _, opt_state = jitted(tx.update, {"w": jnp.array([1.0, bad])}, opt_state, params)
        stats = opt_state.stats
        for counter in counters:
            chex.assert_trees_all_equal(getattr(stats, counter), int32(INT32_MAX), strict=True)
        assert getattr(stats, other_counter).item() == 0
    assert jls.get_loss_scale(opt_state).item() == 2.0**7

    _, opt_state = jitted(tx.update, {"w": jnp.ones(2)}, opt_state, params)
    assert stats_dict(opt_state) == {
        "loss_scale": 2.0**7,
        "grad_norm": np.float32(2**-6.5).item(),  # of [1, 1] / 2**7
        "skipped_steps": INT32_MAX,
        "nan_skipped_steps": INT32_MAX if kind_counter == "nan_skipped_steps" else 0,
        "inf_skipped_steps": INT32_MAX if kind_counter == "inf_skipped_steps" else 0,
        "spike_skipped_steps": 0,
        "consecutive_skipped_steps": 0,
        "last_step_applied": True,
    }


# --- 3. float64 gradients -------------------------------------------------------------------

FLOAT64_SCRIPT = textwrap.dedent(
    """
    import json

    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import optax

    import jax_lossscale as jls

    inner = optax.sgd(0.5, momentum=0.9)
    ls = jls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=2)
    tx = jls.loss_scaled(inner, ls)
    params = {"b": jnp.array(0.5), "w": jnp.array([1.0, 2.0, 3.0])}
    true_grads = {"b": jnp.array(1.0 + 2.0**-40), "w": jnp.array([0.1, 1e-300, 1e15])}
    opt_state, ref_state = tx.init(params), inner.init(params)
    update = jax.jit(tx.update)
    steps = []
    for kind in ["finite", "finite", "nan", "inf", "finite", "overflow"]:
        scale = jls.get_loss_scale(opt_state)
        scaled = jax.tree.map(lambda g: g * scale.astype(g.dtype), true_grads)
        if kind == "overflow":  # finite, but its square overflows float32 (DESIGN 3.1)
            scaled["w"] = scaled["w"].at[1].set(1e100)
        elif kind != "finite":
            scaled["w"] = scaled["w"].at[1].set(float(kind))
        updates, opt_state = update(scaled, opt_state, params)
        stats = jls.get_loss_scale_stats(opt_state)
        if kind == "finite":
            ref_updates, ref_state = inner.update(true_grads, ref_state, params)
        else:
            ref_updates = None
        steps.append({
            "scaled_dtypes": sorted({str(g.dtype) for g in jax.tree.leaves(scaled)}),
            "updates": {k: v.tolist() for k, v in updates.items()},
            "ref_updates": ref_updates and {k: v.tolist() for k, v in ref_updates.items()},
            "update_dtypes": {k: str(v.dtype) for k, v in updates.items()},
            "stats": {k: v.item() for k, v in stats._asdict().items()},
            "stats_dtypes": {k: str(v.dtype) for k, v in stats._asdict().items()},
            "ls_state_dtypes": [str(v.dtype) for v in opt_state.loss_scale_state],
            "inner_dtypes": sorted({str(v.dtype) for v in jax.tree.leaves(opt_state.inner_state)}),
        })
    print(json.dumps(steps))
    """
)


def test_float64_gradients_with_x64_in_a_subprocess():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", FLOAT64_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    steps = json.loads(result.stdout.strip().splitlines()[-1])

    stats_dtypes = {
        "loss_scale": "float32",
        "grad_norm": "float32",
        "skipped_steps": "int32",
        "nan_skipped_steps": "int32",
        "inf_skipped_steps": "int32",
        "spike_skipped_steps": "int32",
        "consecutive_skipped_steps": "int32",
        "last_step_applied": "bool",
    }
    for step in steps:
        assert step["scaled_dtypes"] == ["float64"]
        assert step["update_dtypes"] == {"b": "float64", "w": "float64"}
        assert step["stats_dtypes"] == stats_dtypes
        assert step["ls_state_dtypes"] == ["float32", "int32", "int32"]
        assert step["inner_dtypes"] == ["float64"]
    # (scale, grad_norm, skipped, nan, inf, spike, consecutive, applied); the norm is a
    # float32: 1e15 here, and +inf for a finite float64 gradient of 1e100, whose square
    # overflows float32, which counts as an overflow.
    norm = str(float(np.float32(1e15)))
    expected_stats = [
        (1024.0, norm, 0, 0, 0, 0, 0, True),
        (2048.0, norm, 0, 0, 0, 0, 0, True),
        (1024.0, "nan", 1, 1, 0, 0, 1, False),
        (512.0, "inf", 2, 1, 1, 0, 2, False),
        (512.0, norm, 2, 1, 1, 0, 0, True),
        (256.0, "inf", 3, 1, 2, 0, 1, False),
    ]
    assert [
        tuple(str(value) if name == "grad_norm" else value for name, value in step["stats"].items())
        for step in steps
    ] == expected_stats

    # The first update is -0.5 * grads, exact in float64 only: 1e-300 and 2**-41 would
    # vanish in float32.
    assert steps[0]["updates"] == {"b": -(0.5 + 2.0**-41), "w": [-0.05, -5e-301, -5e14]}
    for step in steps:
        if step["ref_updates"] is None:
            assert all(
                value == 0.0 and math.copysign(1.0, value) == -1.0
                for value in [step["updates"]["b"], *step["updates"]["w"]]
            )
        else:
            np.testing.assert_allclose(step["updates"]["w"], step["ref_updates"]["w"], rtol=1e-14)
            assert step["updates"]["b"] == pytest.approx(step["ref_updates"]["b"], rel=1e-14)


# --- 4. float16 near its maximum ------------------------------------------------------------


@pytest.mark.parametrize(
    ("scale", "scaled_value", "true_value"),
    [
        (1.0, 65504.0, 65504.0),
        (1.0, -60000.0, -60000.0),
        (0.5, 30000.0, 60000.0),
        (0.25, 16376.0, 65504.0),
        (2.0**15, 65504.0, 65504.0 / 2**15),
    ],
)
def test_float16_near_its_maximum_unscales_without_overflow(scale, scaled_value, true_value):
    ls = jls.DynamicLossScale(initial_loss_scale=scale, min_loss_scale=2.0**-4)
    tx = jls.loss_scaled(optax.sgd(1.0), ls)
    params = {"w": jnp.zeros(2, jnp.float16)}
    grads = {"w": jnp.array([scaled_value, 1.0], jnp.float16)}
    updates, opt_state = jitted(tx.update, grads, tx.init(params), params)
    # float16 gradients are unscaled to float32, where sgd's updates are made.
    expected = {"w": jnp.array([-true_value, -1.0 / scale], jnp.float32)}
    assert_bits_equal(updates, expected)
    assert stats_dict(opt_state)["last_step_applied"] is True
    assert jls.get_loss_scale(opt_state).item() == scale


def test_min_loss_scale_below_one_cannot_overflow_unscaling_silently(jit_or_eager):
    # 1e38 / 0.25 = 4e38 exceeds the float32 maximum: the unscaled gradient is inf. (A float16
    # gradient is unscaled to float32, where 30000 / 0.25 is 120000, finite: test_dtypes.py.)
    ls = jls.DynamicLossScale(initial_loss_scale=0.25, min_loss_scale=2.0**-4)
    tx = jls.loss_scaled(optax.sgd(1.0), ls)
    params = {"w": jnp.array([1.0, -2.0], jnp.float32)}
    grads = {"w": jnp.array([1e38, 1.0], jnp.float32)}
    unscaled = ls.unscale(ls.init(), grads)
    assert_bits_equal(unscaled, {"w": jnp.array([jnp.inf, 4.0], jnp.float32)})

    opt_state = tx.init(params)
    scales = []
    for _ in range(3):
        updates, opt_state = jit_or_eager(tx.update, grads, opt_state, params)
        assert_bits_equal(optax.apply_updates(params, updates), params)
        assert_bits_equal(updates, {"w": jnp.full(2, -0.0, jnp.float32)})
        scales.append(jls.get_loss_scale(opt_state).item())
    # Stuck at the floor, where the gradient still overflows: the run is visibly stalled.
    assert scales == [0.125, 0.0625, 0.0625]
    assert stats_dict(opt_state) == {
        "loss_scale": 0.0625,
        "grad_norm": math.inf,
        "skipped_steps": 3,
        "nan_skipped_steps": 0,
        "inf_skipped_steps": 3,
        "spike_skipped_steps": 0,
        "consecutive_skipped_steps": 3,
        "last_step_applied": False,
    }


# --- 5. statistics --------------------------------------------------------------------------


class CountingState(NamedTuple):
    loss_scale: jax.Array
    steps: jax.Array


@dataclasses.dataclass(frozen=True)
class SkipFirstSteps(jls.LossScale):
    """A scale of 1 that skips the first `n` steps whatever the gradients hold."""

    n: int = 2

    def init(self) -> CountingState:
        return CountingState(jnp.ones([], jnp.float32), jnp.zeros([], jnp.int32))

    def __call__(self, state: CountingState) -> jax.Array:
        return state.loss_scale

    def adjust(self, state, grads_finite):
        should_apply = grads_finite & (state.steps >= self.n)
        return state._replace(steps=state.steps + 1), should_apply

    def get_config(self) -> dict:
        return {"n": self.n}


NESTINGS = {
    "bare": lambda make: make(0.1),
    "chain": lambda make: optax.chain(optax.identity(), make(0.1), optax.scale(1.0)),
    "inject_hyperparams": lambda make: optax.inject_hyperparams(make)(learning_rate=0.1),
}
STATS_FIELDS = (
    "skipped_steps",
    "nan_skipped_steps",
    "inf_skipped_steps",
    "consecutive_skipped_steps",
    "last_step_applied",
)


def run_steps(tx, params, grads_list):
    """The stats after each step, all steps traced as one program under jit."""

    def run(opt_state, grads_list):
        history = []
        for grads in grads_list:
            _, opt_state = tx.update(grads, opt_state, params)
            history.append(jls.get_loss_scale_stats(opt_state))
        return history

    history = jitted(run, tx.init(params), grads_list)
    return [tuple(getattr(stats, name).item() for name in STATS_FIELDS) for stats in history]


@pytest.mark.parametrize("nesting", sorted(NESTINGS))
def test_stats_classify_nan_and_inf_and_count_consecutive_skips(nesting):
    ls = jls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=100)
    tx = NESTINGS[nesting](lambda learning_rate: jls.loss_scaled(optax.sgd(learning_rate), ls))
    params = {"a": jnp.zeros(3), "b": [jnp.zeros(2, jnp.bfloat16), None]}

    def grads(a, b):
        return {"a": jnp.array(a), "b": [jnp.array(b, jnp.bfloat16), None]}

    nan, inf = jnp.nan, jnp.inf
    grads_list = [
        grads([1.0, nan, 2.0], [0.0, 1.0]),
        grads([1.0, 1.0, 2.0], [inf, 1.0]),
        grads([-inf, 1.0, 2.0], [0.0, 1.0]),
        grads([1.0, 1.0, 2.0], [0.0, 1.0]),
        grads([inf, 1.0, -inf], [nan, 1.0]),  # NaN and inf in one step: a NaN skip
        grads([1.0, 1.0, 2.0], [0.0, 1.0]),
        grads([1.0, 1.0, 2.0], [0.0, -inf]),
    ]
    history = run_steps(tx, params, grads_list)
    # (skipped, nan, inf, consecutive, last applied)
    assert history == [
        (1, 1, 0, 1, False),
        (2, 1, 1, 2, False),
        (3, 1, 2, 3, False),
        (3, 1, 2, 0, True),
        (4, 2, 2, 1, False),
        (4, 2, 2, 0, True),
        (5, 2, 3, 1, False),
    ]


@pytest.mark.parametrize("nesting", sorted(NESTINGS))
def test_user_loss_scale_skipping_finite_grads_is_neither_nan_nor_inf(nesting):
    tx = NESTINGS[nesting](
        lambda learning_rate: jls.loss_scaled(optax.sgd(learning_rate), SkipFirstSteps(2))
    )
    params = {"w": jnp.zeros(2)}
    grads_list = [
        {"w": jnp.array(values)}
        for values in [[1.0, 2.0], [1.0, 2.0], [jnp.nan, 2.0], [1.0, jnp.inf], [1.0, 2.0]]
    ]
    history = run_steps(tx, params, grads_list)
    assert history == [
        (1, 0, 0, 1, False),
        (2, 0, 0, 2, False),
        (3, 1, 0, 3, False),
        (4, 1, 1, 4, False),
        (4, 1, 1, 0, True),
    ]


def test_applied_non_finite_steps_count_as_no_skip():
    # A fixed scale never skips: non-finite gradients reach the inner optimizer.
    tx = jls.loss_scaled(optax.sgd(0.1), jls.FixedLossScale(4.0))
    params = {"w": jnp.zeros(2)}
    grads_list = [
        {"w": jnp.array(values)}
        for values in [[jnp.nan, 2.0], [1.0, jnp.inf], [-jnp.inf, jnp.nan], [1.0, 2.0]]
    ]
    history = run_steps(tx, params, grads_list)
    assert history == [(0, 0, 0, 0, True)] * 4
