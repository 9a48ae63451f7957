"""bfloat16 and float16 weights without a float32 copy: `stochastic_rounding`, `kahan_summation`.

The rounding's probabilities are checked exactly on the rounding functions given every
random draw (bfloat16: all 2**16 of them; float16: the draws on either side of the
threshold), and statistically through the public transformation: over 4096 keys, the
count of upward roundings of each value lies within 5 standard deviations of a binomial
with the exact probability (the mean within 5 sigma of the float32 value).
"""

import functools
import re
from typing import Any

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_lossscale as jls
from jax_lossscale import _rounding

from helpers import assert_bits_equal, bits, device_array, with_excess_precision

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
KEYS = 4096


def f32_of_bits(pattern: int) -> float:
    return float(np.array([pattern], np.uint32).view(np.float32)[0])


# (x in float32, lower neighbour, upper neighbour, probability of the upper one)
BF16_CASES = [
    (1 + 3 * 2**-10, 1.0, 1 + 2**-7, 3 / 8),
    (-(1 + 3 * 2**-10), -(1 + 2**-7), -1.0, 5 / 8),  # lower is the larger magnitude
    (2 - 2**-10, 2 - 2**-7, 2.0, 7 / 8),  # just below a power of two
    (2 + 2**-9, 2.0, 2 + 2**-6, 1 / 8),  # just above it: a gap twice as wide
    (-(2 + 2**-9), -(2 + 2**-6), -2.0, 7 / 8),
    (4.0, 4.0, 4.0, 0.0),  # representable: always itself
    (1e-4, 1.0001659e-4 - 2**-21, 1.0001659e-4, None),  # probability computed below
]
F16_CASES = [
    (1.5 * 2**-24, 2**-24, 2**-23, 1 / 2),  # the smallest float16 subnormals
    (-1.25 * 2**-24, -(2**-23), -(2**-24), 3 / 4),
    (2**-14 - 2**-26, 1023 * 2**-24, 2**-14, 3 / 4),  # the top subnormal to the first normal
    (1 + 2**-12, 1.0, 1 + 2**-10, 1 / 4),
    (-(2 - 2**-13), -2.0, -(2 - 2**-10), 1 / 8),
    (0.25, 0.25, 0.25, 0.0),
]


def _bf16_case_7():
    x = np.float32(1e-4)
    pattern = int(np.array([x]).view(np.uint32)[0])
    lower, upper = f32_of_bits(pattern & 0xFFFF0000), f32_of_bits((pattern & 0xFFFF0000) + 2**16)
    return (float(x), lower, upper, (pattern & 0xFFFF) / 2**16)


BF16_CASES[-1] = _bf16_case_7()


def round_many(dtype, xs, params=None):
    """`xs` (float32) as `stochastic_rounding` rounds them from zero weights, once per key."""
    # Built by NumPy and copied to the device: no op compiled for the inputs.
    params = jnp.asarray(np.zeros(len(xs), dtype)) if params is None else params
    updates = jnp.asarray(np.asarray(xs, np.float32) - np.asarray(params, np.float32))

    def once(key):
        tx = jls.stochastic_rounding(key)
        new_updates, _ = tx.update(updates, tx.init(params), params)
        return optax.apply_updates(params, new_updates)

    keys = jax.random.split(jax.random.key(20240611), KEYS)
    return np.asarray(jax.jit(jax.vmap(once))(keys), F32)


# --- the rounding, exactly ----------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern",
    [
        0x3F806000,  # 1 + 3 * 2**-10
        0xBF806000,  # its negative
        0x3FFFE000,  # just below 2
        0x40000000,  # 2: representable
        0x00012345,  # a float32 subnormal between two bfloat16 subnormals
        0x007FFFFF,  # the largest subnormal, up to the smallest normal
        0x7F7FFFFF,  # the largest float32, between the largest bfloat16 and infinity
        0xFF7F8000,  # its negative half-way
    ],
)
def test_bfloat16_rounds_up_for_exactly_the_dropped_fraction_of_all_2_16_draws(pattern):
    x = jnp.asarray(np.full(2**16, f32_of_bits(pattern), np.float32))
    draws = jnp.asarray(np.arange(2**16, dtype=np.uint32))
    rounded = np.asarray(_rounding.bfloat16_pattern(x, draws)) >> 16
    toward_zero, away = pattern >> 16, (pattern >> 16) + 1
    values, counts = np.unique(rounded, return_counts=True)
    expected = {toward_zero: 2**16 - (pattern & 0xFFFF), away: pattern & 0xFFFF}
    assert dict(zip(values.tolist(), counts.tolist(), strict=True)) == {
        value: count for value, count in expected.items() if count
    }
    if pattern == 0x7F7FFFFF:
        assert f32_of_bits(away << 16) == np.inf


@pytest.mark.parametrize(
    ("x", "toward_zero", "away", "probability"),
    [
        (1 + 2**-12, 1.0, 1 + 2**-10, 0.25),
        (-(2 - 2**-13), -(2 - 2**-10), -2.0, 0.875),  # to -2, the lower neighbour, with 7/8
        (1.5 * 2**-24, 2**-24, 2**-23, 0.5),  # subnormal
        (2**-14 - 2**-26, 1023 * 2**-24, 2**-14, 0.75),
        (65504 + 8, 65504.0, np.inf, 0.25),  # beyond the largest float16
        (2**-30, 0.0, 2**-24, 2**-6),  # below the smallest subnormal
        (2**-33 * 1.5, 0.0, 2**-24, 1.5 * 2**-9),  # the last binade rounded exactly
        (3.0, 3.0, 3.0, 0.0),
    ],
)
def test_float16_rounds_away_from_zero_for_draws_below_exactly_the_probability_times_2_32(
    x, toward_zero, away, probability
):
    # A uniform 32-bit draw r rounds away from zero when r < p * 2**32: probability p, the
    # distance from the neighbour toward zero over the gap.
    threshold = int(probability * 2**32)
    assert threshold == probability * 2**32
    draws = device_array([0, max(threshold - 1, 0), threshold, 2**32 - 1], np.uint32)
    x = jnp.asarray(np.full(4, x, np.float32))
    rounded = np.asarray(_rounding.round_float16(x, draws)).astype(float)
    first = away if threshold else toward_zero
    np.testing.assert_array_equal(rounded, [first, first, toward_zero, toward_zero])


def test_infinities_and_nan_pass_through_either_rounding():
    x = np.array([np.inf, -np.inf, np.nan, f32_of_bits(0x7F800001)], np.float32)  # a NaN payload
    x = jnp.asarray(x)
    for draws in (np.zeros(4, np.uint32), np.full(4, 0xFFFF, np.uint32)):
        patterns = np.asarray(_rounding.bfloat16_pattern(x, jnp.asarray(draws)))
        assert patterns.tolist() == [0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00000]
    for draws in (np.zeros(4, np.uint32), np.full(4, 2**32 - 1, np.uint32)):
        draws = jnp.asarray(draws)
        f16 = np.asarray(_rounding.round_float16(x, draws)).astype(float)
        assert f16[:2].tolist() == [np.inf, -np.inf]
        assert np.isnan(f16[2:]).all()


# --- stochastic_rounding, statistically -------------------------------------------------


@pytest.mark.parametrize(("dtype", "cases"), [(BF16, BF16_CASES), (F16, F16_CASES)])
def test_each_neighbour_comes_with_its_probability_and_the_mean_is_the_float32_value(dtype, cases):
    xs, lowers, uppers, probabilities = (
        np.array(column, float) for column in zip(*cases, strict=True)
    )
    rounded = round_many(dtype, xs)
    is_upper = rounded == uppers
    assert ((rounded == lowers) | is_upper).all()  # nothing but the two neighbours
    ups = np.where(lowers == uppers, 0, is_upper.sum(axis=0))
    sigma = np.sqrt(KEYS * probabilities * (1 - probabilities))
    assert (np.abs(ups - KEYS * probabilities) <= 5 * sigma).all(), (ups, KEYS * probabilities)
    # The same bound on the mean, in units of the value: unbiased.
    gap_sigma = (uppers - lowers) * sigma / KEYS
    assert (np.abs(rounded.mean(axis=0) - xs) <= 5 * gap_sigma + 1e-12 * np.abs(xs)).all()


def test_a_weight_plus_an_update_rounds_from_their_float32_sum():
    params = device_array([1.0, -3.0, 1024.0, 2.0**-100], BF16)
    updates = np.array([3 * 2**-10, -(2**-9), 1.0, -(2.0**-100) * 0.25], F32)
    sums = np.asarray(params, F32) + updates  # all exact in float32
    rounded = round_many(BF16, sums, params=params)
    lowers = np.array([1.0, -3.015625, 1024.0, 0.75 * 2.0**-100])
    uppers = np.array([1.0078125, -3.0, 1032.0, 0.75 * 2.0**-100])
    probabilities = np.array([3 / 8, 7 / 8, 1 / 8, 0.0])
    assert ((rounded == lowers) | (rounded == uppers)).all()
    ups = (rounded == uppers).sum(axis=0)[:3]
    sigma = np.sqrt(KEYS * probabilities * (1 - probabilities))[:3]
    assert (np.abs(ups - KEYS * probabilities[:3]) <= 5 * sigma).all(), ups


def test_the_new_weight_is_a_neighbour_of_the_sum_over_the_whole_range_of_magnitudes():
    """`optax.apply_updates` lands on the rounded value however far apart weight and update
    are: each new weight is one of the two bfloat16 (float16) values around the float32
    sum."""
    rng = np.random.default_rng(0)
    for dtype, low, high in [(BF16, -60, 60), (F16, -20, 14)]:
        size = 4096
        params = np.sign(rng.normal(size=size)) * 2.0 ** rng.uniform(low, high, size)
        updates = np.sign(rng.normal(size=size)) * 2.0 ** rng.uniform(low, high, size)
        params = jnp.asarray(params.astype(dtype))  # converted by NumPy, as jnp.asarray does
        updates = jnp.asarray(updates.astype(F32))
        tx = jls.stochastic_rounding(jax.random.key(1))
        new_updates, _ = jax.jit(tx.update)(updates, tx.init(params), params)
        new = np.asarray(optax.apply_updates(params, new_updates), float)
        sums = np.asarray(params, np.float32) + np.asarray(updates)  # on the host: no compile
        np_dtype = ml_dtypes.bfloat16 if dtype == BF16 else np.float16
        nearest = sums.astype(np_dtype)
        step = np.where(nearest.astype(np.float32) <= sums, 1, -1)
        other = np.nextafter(nearest, (step * np.inf).astype(np_dtype))
        ok = (new == nearest.astype(float)) | (new == other.astype(float))
        assert ok.all(), (sums[~ok][:4], new[~ok][:4])
        assert (new != nearest.astype(float)).any()  # some did round the other way


def test_non_finite_sums_and_overflow_come_through():
    params = device_array([1.0, np.inf, 1.0, 65504.0, -65504.0, 2.0], F16)
    updates = device_array([np.inf, 1.0, np.nan, 64.0, -0.0, -np.inf])
    tx = jls.stochastic_rounding(jax.random.key(0))
    new_updates, _ = tx.update(updates, tx.init(params), params)
    new = np.asarray(optax.apply_updates(params, new_updates), float)
    assert new[[0, 1, 3, 4, 5]].tolist() == [np.inf, np.inf, np.inf, -65504.0, -np.inf]
    assert np.isnan(new[2])


def test_wider_and_non_floating_leaves_pass_through_as_the_inner_updates():
    params = {"f32": np.ones(3, F32), "int": np.arange(3, dtype=np.int32), "bf16": np.ones(3, BF16)}
    updates = {"f32": np.full(3, 1e-3, F32), "int": np.ones(3, np.int32), "bf16": np.ones(3, F32)}
    params, updates = jax.tree.map(jnp.asarray, (params, updates))  # jax arrays, no op compiled
    for tx in (jls.stochastic_rounding(jax.random.key(0)), jls.kahan_summation()):
        new_updates, state = tx.update(updates, tx.init(params), params)
        assert new_updates["f32"] is updates["f32"]
        assert new_updates["int"] is updates["int"]
        assert optax.apply_updates(params, new_updates)["bf16"].tolist() == [2.0] * 3
    assert state.low_bits["f32"] is None
    assert state.compensation == {"f32": None, "int": None, "bf16": None}
    assert state.low_bits["bf16"].dtype == jnp.int16  # the 16 bits below bfloat16


def float32_samples() -> np.ndarray:
    """Float32 values of both signs: random bit patterns, every tie and neighbour of a tie
    between bfloat16 values in [1, 2), and the edges (subnormals, the largest values of
    each dtype and past them, infinities, NaN)."""
    patterns = np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64)
    ties = (np.uint64(0x3F800000) + np.arange(128, dtype=np.uint64) * 0x10000)[:, None]
    ties = (ties + np.array([0x7FFF, 0x8000, 0x8001], dtype=np.uint64)).ravel()
    values = np.concatenate(
        [patterns.astype(np.uint32).view(np.float32), ties.astype(np.uint32).view(np.float32)]
    )
    edges = np.array(
        [0.0, 1e-45, 3e-39, 6e-8, 2.0**-25, 3 * 2.0**-26, 65504, 65519.99, 65520, 3.3e38, 3.4e38,
         np.inf, np.nan], np.float32,
    )  # fmt: skip
    return np.concatenate([values, edges, -values, -edges])


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_round_to_nearest_is_the_cast_written_out_in_float32(dtype):
    """Kahan's rounding equals NumPy's cast (ml_dtypes for bfloat16, ties to even) on every
    sample, bit for bit, and is a value of the dtype, so casting it to the dtype is exact."""
    x = float32_samples()
    nearest = np.asarray(jax.jit(_rounding.round_to_nearest, static_argnums=1)(x, dtype))
    with np.errstate(over="ignore", invalid="ignore"):  # the edges overflow, NaN is NaN
        cast = x.astype(dtype)
        recast = nearest.astype(dtype).astype(np.float32)
    finite = np.isfinite(cast)
    np.testing.assert_array_equal(nearest[finite], cast[finite].astype(np.float32))
    np.testing.assert_array_equal(np.isnan(nearest), np.isnan(x))
    np.testing.assert_array_equal(nearest[np.isinf(cast)], cast[np.isinf(cast)].astype(F32))
    np.testing.assert_array_equal(recast[finite], nearest[finite])


def test_kahan_and_stochastic_rounding_give_the_same_bits_when_half_casts_keep_float32():
    """XLA's GPU compiler may drop a float32 -> bfloat16 -> float32 pair of casts; a Kahan
    step that rounded through one then kept nothing in its buffer and stalled as nearest
    rounding does (found on an H100). Run with the casts dropped (`with_excess_precision`),
    both remedies give the bits of the CPU's run, the stall's cure included."""
    params = jnp.asarray(np.ones(3, BF16))
    minus_1e_3 = jnp.asarray(np.full(3, -1e-3, np.float32))
    for tx in (
        jls.kahan_summation(),
        jls.kahan_summation(F32),
        jls.stochastic_rounding(jax.random.key(0)),
    ):
        steps = {"cpu": params, "excess precision": params}
        states = dict.fromkeys(steps, tx.init(params))
        update = {"cpu": jax.jit(tx.update), "excess precision": with_excess_precision(tx.update)}
        for _ in range(12):
            for run in steps:
                updates, states[run] = update[run](minus_1e_3, states[run], steps[run])
                steps[run] = optax.apply_updates(steps[run], updates)
        assert_bits_equal(steps["excess precision"], steps["cpu"])
        assert_bits_equal(states["excess precision"], states["cpu"])
        assert float(np.asarray(steps["cpu"])[0]) < 1.0  # 12 * 1e-3 moved the weight: no stall
    old_rounding = with_excess_precision(
        lambda total: total.astype(BF16).astype(F32)  # what kahan_summation did
    )(jnp.asarray(np.full(3, 1 - 3e-3, np.float32)))
    assert old_rounding.tolist() == [np.float32(1 - 3e-3)] * 3  # not rounded: nothing kept


# --- the stall and its cure ---------------------------------------------------------------


def run_1000_steps(tx, params):
    def step(_, carry):
        params, state = carry
        updates, state = tx.update(jnp.full(params.shape, -1e-4, F32), state, params)
        return optax.apply_updates(params, updates), state

    return jax.lax.fori_loop(0, 1000, step, (params, tx.init(params)))


def test_1000_updates_of_minus_1e_4_stall_at_nearest_and_reach_0_9_with_either_remedy():
    ones_f32, ones_bf16 = jnp.asarray(np.ones(3, F32)), jnp.asarray(np.ones(3, BF16))
    float32 = jax.jit(run_1000_steps, static_argnums=0)(optax.identity(), ones_f32)[0]
    float32 = np.asarray(float32)  # the reference, compared on the host
    np.testing.assert_allclose(float32, 0.9, rtol=1e-4)  # 0.89998, float32 rounding
    nearest = jax.jit(run_1000_steps, static_argnums=0)(optax.identity(), ones_bf16)[0]
    assert nearest.tolist() == [1.0, 1.0, 1.0]

    kahan, state = jax.jit(run_1000_steps, static_argnums=0)(jls.kahan_summation(), ones_bf16)
    assert kahan.tolist() == [0.8984375] * 3  # the bfloat16 nearest to 0.9
    assert_bits_equal(float32_of(kahan, state.low_bits), float32)  # weight + low bits
    narrow, state = jax.jit(run_1000_steps, static_argnums=0)(jls.kahan_summation(BF16), ones_bf16)
    assert narrow.tolist() == [0.90234375] * 3  # within 0.3% of float32
    assert np.all(np.abs(np.asarray(narrow, F32) - float32) <= 0.01 * float32)
    wide, state = jax.jit(run_1000_steps, static_argnums=0)(
        jls.kahan_summation(jnp.float32), ones_bf16
    )
    assert wide.tolist() == [0.8984375] * 3  # the bfloat16 nearest to 0.9
    np.testing.assert_allclose(
        np.asarray(wide, F32) + np.asarray(state.compensation), float32, atol=1e-6
    )

    # One stochastic run moves by 2**-8 with probability 0.0256 per step: a standard
    # deviation of 0.0195 after 1000 steps. The mean of 256 runs has one of 0.0012.
    keys = jax.random.split(jax.random.key(7), 256)
    runs = jax.jit(
        jax.vmap(lambda key: run_1000_steps(jls.stochastic_rounding(key), jnp.ones(3, BF16))[0])
    )(keys)
    runs = np.asarray(runs, F32)  # checked on the host
    assert abs(float(np.mean(runs)) - float(float32[0])) <= 0.01 * 0.9
    assert float(np.max(np.abs(runs - float32))) <= 6 * 0.0195


def float32_of(weight, low):
    """The float32 value a bfloat16 weight and its int16 buffer (the bits below) make."""
    high = np.asarray(weight).view(np.uint16).astype(np.int64) << 16
    return jnp.asarray(((high + np.asarray(low, np.int64)) % 2**32).astype(np.uint32).view(F32))


# Each case: a start, an update and a number of steps (item 9 of issue 37). A bfloat16
# buffer loses updates below half its own spacing once it holds about half a gap.
SMALL_UPDATE_CASES = np.array(
    [(1.0, -3e-6, 10_000), (1.0, -1e-6, 20_000), (0.02, -1e-7, 20_000), (1.0, -1e-5, 10_000)]
)


@functools.cache
def small_updates_run(tx):
    """The cases as one vector: the weights, the state and the float32 sum after 20,000
    steps, each entry's updates zero once its steps are done."""
    start, update, steps = (jnp.asarray(column.astype(F32)) for column in SMALL_UPDATE_CASES.T)

    @jax.jit
    def run(start, update, steps):
        def step(carry, t):
            params, state, float32 = carry
            u = jnp.where(t < steps, update, 0.0)
            updates, state = tx.update(u, state, params)
            return (optax.apply_updates(params, updates), state, float32 + u), None

        params = start.astype(BF16)
        carry = (params, tx.init(params), params.astype(F32))
        return jax.lax.scan(step, carry, jnp.arange(20_000, dtype=jnp.int32))[0]

    return run(start, update, steps)


def test_the_default_buffer_keeps_the_float32_sum_of_updates_far_below_its_spacing():
    params, state, float32 = small_updates_run(jls.kahan_summation())
    np.testing.assert_allclose(float32, [0.97, 0.98, 0.018, 0.9], rtol=2e-3)
    assert_bits_equal(float32_of(params, state.low_bits), float32)  # bit for bit
    np.testing.assert_array_equal(params, np.asarray(float32).astype(ml_dtypes.bfloat16))


def test_a_float32_buffer_follows_the_float32_sum_and_a_bfloat16_one_stalls():
    params, state, float32 = small_updates_run(jls.kahan_summation(F32))
    np.testing.assert_array_equal(params, np.asarray(float32).astype(ml_dtypes.bfloat16))
    params = np.asarray(params, F32)  # checked on the host
    np.testing.assert_allclose(params + np.asarray(state.compensation), float32, rtol=1e-6)
    stalled, _, _ = small_updates_run(jls.kahan_summation(BF16))
    stalled = np.asarray(stalled, F32)
    # 1.0 and 0.02 never move, 0.9 ends 3 gaps off: the threshold the docs state
    assert stalled.tolist() == [1.0, 1.0, 0.02001953125, 0.91015625]
    assert float(stalled[3]) - float(params[3]) == 3 * 2**-8  # params: the nearest to 0.89986


def test_the_default_buffer_holds_the_float32_sum_over_the_whole_range_and_at_the_edges():
    """One step from a weight with low bits: the new weight and its low bits are the float32
    sum bit for bit, the weight its nearest bfloat16 (ties away from zero), for magnitudes
    from 2**-60 to 2**60 and either sign; non-finite sums keep no bits, and a zero weight
    set from outside drops a negative offset (which would cut a NaN)."""
    rng = np.random.default_rng(1)
    start = np.sign(rng.normal(size=4096)) * 2.0 ** rng.uniform(-60, 60, 4096)
    start = start.astype(np.float32)
    updates = (start * rng.uniform(-3e-2, 3e-2, 4096)).astype(np.float32)
    weight = start.astype(ml_dtypes.bfloat16)
    low = start.view(np.uint32).astype(np.int64) - (weight.view(np.uint16).astype(np.int64) << 16)
    assert (np.abs(low) <= 2**15).all()
    low = low.clip(-(2**15), 2**15 - 1).astype(np.int16)  # a tie cut the other way: still exact
    start = np.asarray(float32_of(weight, low))
    tx = jls.kahan_summation()
    new_updates, state = jax.jit(tx.update)(
        jnp.asarray(updates),
        tx.init(jnp.asarray(weight))._replace(low_bits=jnp.asarray(low)),
        weight,
    )
    new = optax.apply_updates(jnp.asarray(weight), new_updates)
    total = start + updates
    assert_bits_equal(float32_of(new, state.low_bits), jnp.asarray(total))
    tie = (total.view(np.uint32) & 0xFFFF) == 0x8000  # rounded away from zero, not to even
    nearest = np.where(tie, np.nextafter(total, np.sign(total) * np.inf), total)
    np.testing.assert_array_equal(np.asarray(new), nearest.astype(ml_dtypes.bfloat16))

    edges = device_array([3.3e38, 1.0, 1.0, 0.0, -0.0], BF16)
    low = device_array([0, 0, 0, -5, -5], np.int16)
    edge_updates = device_array([1e38, np.nan, np.inf, 1.0, -0.0])
    new_updates, state = tx.update(edge_updates, tx.init(edges)._replace(low_bits=low), edges)
    new = np.asarray(optax.apply_updates(edges, new_updates), np.float32)
    assert new[[0, 2, 3]].tolist() == [np.inf, np.inf, 1.0]
    assert np.isnan(new[1])
    assert bits(new[4:].astype(ml_dtypes.bfloat16)).tolist() == [0x8000]  # -0.0 kept
    assert state.low_bits.tolist() == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("compensation_dtype", [None, F32])
def test_kahan_gives_float16_weights_their_buffers_inside_loss_scaled(compensation_dtype):
    """loss_scaled's init gives inner.init the float16 params widened to float32; the
    buffers are made for float16 weights all the same, and each step is the plain chain's
    on the unscaled gradients."""
    params = {"b": jnp.asarray(np.full(3, 0.5, F16)), "w": jnp.asarray(np.ones((2, 3), F16))}
    inner = optax.chain(optax.sgd(1e-4), jls.kahan_summation(compensation_dtype))
    tx = jls.loss_scaled(inner, jls.FixedLossScale(2.0**8))
    opt_state = tx.init(params)
    buffers = last_state(opt_state).compensation
    assert jax.tree.map(lambda b: (b.shape, b.dtype), buffers) == {
        "b": ((3,), F32),
        "w": ((2, 3), F32),
    }
    grads = jax.tree.map(lambda p: np.full(p.shape, 0.3, np.float32), params)
    scaled = jax.tree.map(lambda g: jnp.asarray((g * np.float32(2.0**8)).astype(F16)), grads)
    grads = jax.tree.map(jnp.asarray, grads)

    def ten_steps(tx, grads, params, opt_state):
        for _ in range(10):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state

    plain_params, plain = jax.jit(ten_steps, static_argnums=0)(
        inner, grads, params, inner.init(params)
    )
    params, opt_state = jax.jit(ten_steps, static_argnums=0)(tx, scaled, params, opt_state)
    assert_bits_equal(params, plain_params)
    assert_bits_equal(last_state(opt_state), plain[-1])
    # 3e-5 a step, below half a gap at 0.5 (2.4e-4); ten of them move the weight
    assert params["b"].tolist() == [0.5 - 2**-12] * 3  # the float16 below 0.5


def test_stochastic_rounding_marks_float16_weights_inside_loss_scaled():
    params = {"w": jnp.asarray(np.ones(3, F16)), "f": jnp.asarray(np.ones(2, F32))}
    inner = optax.chain(optax.sgd(1e-4), jls.stochastic_rounding(jax.random.key(0)))
    opt_state = jls.loss_scaled(inner, jls.FixedLossScale(2.0**8)).init(params)
    rounded = last_state(opt_state).rounded
    assert rounded["f"] is None
    assert rounded["w"].dtype == F16


@pytest.mark.parametrize("inside", [False, True], ids=["alone", "inside_loss_scaled"])
@pytest.mark.parametrize("remedy", ["sr", "kahan", "kahan f32"])
def test_a_rounded_weight_that_comes_back_float32_is_an_error_naming_apply_updates(remedy, inside):
    """eqx.apply_updates (or params + updates) makes the bfloat16 weights float32; the
    next step would drop Kahan's buffers or pass everything through. Inside loss_scaled
    the message was replaced by "state.inner_state has the structure ..., pass the state
    returned by this transformation's init()", which it was."""
    tx = {
        "sr": jls.stochastic_rounding(jax.random.key(0)),
        "kahan": jls.kahan_summation(),
        "kahan f32": jls.kahan_summation(F32),
    }[remedy]
    if inside:
        tx = jls.loss_scaled(tx, jls.DynamicLossScale(1.0))
    params = {"w": np.ones(4, BF16), "f": np.ones(2, F32)}
    grads = {"w": np.full(4, 1e-3, F32), "f": np.ones(2, F32)}
    params, grads = jax.tree.map(jnp.asarray, (params, grads))  # jax arrays, no op compiled
    update = jax.jit(tx.update)
    updates, state = update(grads, tx.init(params), params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)  # what eqx.apply_updates does
    assert params["w"].dtype == F32
    with pytest.raises(TypeError, match=r"param \['w'\] is of dtype float32.*optax\.apply_upd"):
        update(grads, state, params)


def test_a_state_without_a_buffer_for_a_bfloat16_weight_is_an_error():
    tx = jls.kahan_summation()
    state = tx.init({"w": jnp.asarray(np.ones(2, F32))})
    with pytest.raises(TypeError, match=r"the state has no buffer for it"):
        tx.update({"w": jnp.asarray(np.ones(2, F32))}, state, {"w": jnp.asarray(np.ones(2, BF16))})


@pytest.mark.parametrize("compensation_dtype", [None, F32, BF16])
def test_kahan_keeps_a_negative_zero_weight_on_a_negative_zero_update(compensation_dtype):
    params = device_array([-0.0, -0.0, 0.0, 1.0], BF16)
    zeros = device_array([-0.0, 0.0, -0.0, -0.0])
    tx = jls.kahan_summation(compensation_dtype)
    updates, _ = tx.update(zeros, tx.init(params), params)
    assert_bits_equal(optax.apply_updates(params, updates), optax.apply_updates(params, zeros))
    assert bits(np.asarray(optax.apply_updates(params, updates)))[0] == 0x8000


def test_stochastic_rounding_draws_one_word_a_leaf_from_its_key_whatever_the_leaf_size():
    tx = jls.stochastic_rounding(jax.random.key(0))
    params = {"b": jnp.asarray(np.ones((4, 1001), BF16)), "h": jnp.asarray(np.ones(10, F16))}
    updates = jax.tree.map(lambda p: jnp.asarray(np.ones(p.shape, F32)), params)
    jaxpr = str(jax.make_jaxpr(tx.update)(updates, tx.init(params), params))
    draws = re.findall(r"random_bits\[bit_width=(\d+) shape=\(([\d, ]*)\)\]", jaxpr)
    assert sorted(draws) == [("32", ""), ("32", "")]


def test_uniform_bits_are_uniform_in_each_entry_across_keys_and_across_entries():
    keys = jax.random.split(jax.random.key(4), 4096)
    shape = (3, 2**15 + 1)
    draws = np.asarray(jax.vmap(lambda key: _rounding.uniform_bits(key, shape))(keys[:2]))
    assert draws.shape == (2, *shape)
    assert draws.dtype == np.uint32
    high = draws[0] >> 16  # the 16 bits a bfloat16 rounding reads
    assert 2**15 - 3 * 2**8 < high.mean() < 2**15 + 3 * 2**8
    assert len(np.unique(high)) > 0.6 * 2**16
    assert len(np.unique(draws[0])) == draws[0].size  # a bijection of the positions
    assert (draws[0] != draws[1]).mean() > 0.999  # another key, other draws
    # One entry over many keys (steps): uniform, and not tied to its neighbour's draws.
    corner = np.asarray(jax.vmap(lambda key: _rounding.uniform_bits(key, (3, 5))[2, -2:])(keys))
    for entry in corner.T.astype(np.float64) / 2**32:
        assert abs(entry.mean() - 0.5) < 4 * (1 / 12 / len(keys)) ** 0.5
        counts = np.histogram(entry, bins=16, range=(0, 1))[0]
        assert ((counts - len(keys) / 16) ** 2 / (len(keys) / 16)).sum() < 40  # chi2(15)
    assert abs(np.corrcoef(corner.T.astype(np.float64))[0, 1]) < 0.07
    assert _rounding.uniform_bits(keys[0], ()).shape == ()
    assert _rounding.uniform_bits(keys[0], (0, 5)).shape == (0, 5)


def test_one_key_given_to_two_transformations_rounds_matching_leaves_alike():
    """As the key's documentation says; split keys round independently."""
    params = {"a": jnp.asarray(np.ones(256, BF16)), "b": jnp.asarray(np.ones(256, BF16))}
    updates = jax.tree.map(lambda p: jnp.asarray(np.full(p.shape, 1e-3, F32)), params)

    def grouped(key_a, key_b):
        tx = optax.multi_transform(
            {"a": jls.stochastic_rounding(key_a), "b": jls.stochastic_rounding(key_b)},
            {"a": "a", "b": "b"},
        )
        new, _ = tx.update(updates, tx.init(params), params)
        return optax.apply_updates(params, new)

    same = grouped(jax.random.key(0), jax.random.key(0))
    assert_bits_equal(same["a"], same["b"])
    split = grouped(*jax.random.split(jax.random.key(0)))
    assert (np.asarray(split["a"]) != np.asarray(split["b"])).any()


# --- inside loss_scaled ---------------------------------------------------------------------


def make_tx(remedy):
    last = jls.stochastic_rounding(jax.random.key(3)) if remedy == "sr" else jls.kahan_summation()
    inner = optax.chain(optax.adamw(1e-2, weight_decay=1e-2), last)
    return jls.loss_scaled(inner, jls.DynamicLossScale(initial_loss_scale=2.0**10))


def initial_params():
    # NumPy's float32 linspace differs from jnp's in last bits, not once rounded to bfloat16.
    return {"w": jnp.asarray(np.linspace(-1, 1, 32, dtype=F32).reshape(4, 8).astype(BF16))}


def loss_fn(params, x):
    return jnp.mean((x @ params["w"].astype(F32)) ** 2)


def train_step(tx, params, opt_state, x):
    scale = jls.get_loss_scale(opt_state)
    grads = jax.grad(lambda p: loss_fn(p, x) * scale)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def batch(seed, nan=False):
    x = np.random.default_rng(seed).normal(size=(2, 4)).astype(np.float32)
    if nan:
        x[1, 2] = np.nan
    return jnp.asarray(x)


def last_state(opt_state):
    return opt_state.inner_state[-1]


@pytest.mark.parametrize("remedy", ["sr", "kahan"])
def test_a_nan_batch_leaves_params_buffer_and_key_bit_for_bit(remedy):
    tx = make_tx(remedy)
    step = jax.jit(lambda p, s, x: train_step(tx, p, s, x))
    params = initial_params()
    params, opt_state = step(params, tx.init(params), batch(0))
    before = (params, opt_state.inner_state)  # adamw's state and the last transformation's
    params, opt_state = step(params, opt_state, batch(1, nan=True))
    assert not bool(jls.get_loss_scale_stats(opt_state).last_step_applied)
    assert float(jls.get_loss_scale(opt_state)) == 2.0**9
    assert_bits_equal((params, opt_state.inner_state), before)
    if remedy == "kahan":
        assert (np.asarray(last_state(opt_state).low_bits["w"]) != 0).any()
    else:  # the next applied step draws from the key the skipped one left
        assert last_state(opt_state).key.tolist() == before[1][-1].key.tolist()
        _, next_state = step(params, opt_state, batch(2))
        assert last_state(next_state).key.tolist() != before[1][-1].key.tolist()


def test_pmap_replicas_round_alike():
    devices = jax.local_devices()[:8]
    tx = make_tx("sr")

    def step(params, opt_state, x):
        scale = jls.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: loss_fn(p, x) * scale)(params)
        grads = jax.lax.pmean(grads, "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    pstep = jax.pmap(step, axis_name="batch", devices=devices)
    params = jax.tree.map(lambda leaf: jnp.asarray(np.stack([leaf] * 8)), initial_params())
    opt_state = jax.pmap(tx.init, devices=devices)(params)
    xs = jnp.asarray(np.random.default_rng(0).normal(size=(8, 2, 4)).astype(F32))  # per device
    for _ in range(3):
        params, opt_state = pstep(params, opt_state, xs)
    for leaf in jax.tree.leaves((params, opt_state)):
        leaf_bits = bits(np.asarray(leaf))
        assert (leaf_bits == leaf_bits[:1]).all()
    assert (np.asarray(params["w"])[0] != np.asarray(initial_params()["w"])).any()


def test_a_sharded_leaf_under_spmd_jit_rounds_as_the_unsharded_leaf():
    mesh = Mesh(np.array(jax.local_devices()[:8]), ("data",))
    params = jnp.asarray(np.linspace(1, 2, 64 * 8, dtype=F32).reshape(64, 8).astype(BF16))
    updates = jnp.asarray(np.full((64, 8), 1e-3, F32))
    tx = jls.stochastic_rounding(jax.random.key(5))
    update = jax.jit(tx.update)
    unsharded, _ = update(updates, tx.init(params), params)
    sharding = NamedSharding(mesh, P("data"))
    sharded, _ = update(
        jax.device_put(updates, sharding), tx.init(params), jax.device_put(params, sharding)
    )
    assert sharded.sharding.is_equivalent_to(sharding, 2)
    assert_bits_equal(sharded, unsharded)


def test_under_shard_map_the_shards_of_a_sharded_leaf_draw_their_own_bits():
    """8 shards of a 4,096-vector round independently (the same bits on every shard made
    their errors perfectly correlated), each still unbiased; a replicated leaf draws the
    bits of the unsharded leaf on every device."""
    mesh = Mesh(np.array(jax.local_devices()[:8]), ("data",))
    tx = jls.stochastic_rounding(jax.random.key(11))
    params = jnp.asarray(np.ones(4096, BF16))
    updates = jnp.asarray(np.full(4096, 3 * 2**-10, F32))  # up to 1 + 2**-7 with probability 3/8
    state = tx.init(params)

    def rounded(spec):
        def per_device(updates, state, params):
            new_updates, _ = tx.update(updates, state, params)
            return optax.apply_updates(params, new_updates)

        mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(spec, P(), spec), out_specs=spec)
        return np.asarray(jax.jit(mapped)(updates, state, params), F32)

    ups = (rounded(P("data")) > 1).reshape(8, 512)
    assert len({row.tobytes() for row in ups}) == 8  # every shard its own pattern
    sigma = np.sqrt(512 * 3 / 8 * 5 / 8)
    assert (np.abs(ups.sum(axis=1) - 512 * 3 / 8) <= 5 * sigma).all(), ups.sum(axis=1)
    unsharded, _ = jax.jit(tx.update)(updates, state, params)
    expected = np.asarray(optax.apply_updates(params, unsharded), F32)
    np.testing.assert_array_equal(rounded(P()), expected)  # replicated: the unsharded bits


@pytest.mark.parametrize("remedy", ["sr", "kahan"])
def test_one_trace_for_many_steps(remedy):
    tx = make_tx(remedy)
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, opt_state, x):
        return train_step(tx, params, opt_state, x)

    params = initial_params()
    opt_state = tx.init(params)
    for seed in range(4):
        params, opt_state = step(params, opt_state, batch(seed, nan=seed == 2))


@pytest.mark.parametrize("remedy", ["sr", "kahan"])
def test_an_orbax_checkpoint_continues_bit_for_bit(tmp_path, remedy):
    tx = make_tx(remedy)
    step = jax.jit(lambda p, s, x: train_step(tx, p, s, x))
    params = initial_params()
    opt_state = tx.init(params)
    for seed in range(3):
        params, opt_state = step(params, opt_state, batch(seed))
    target = jax.eval_shape(lambda: {"params": params, "opt_state": opt_state})
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert_bits_equal(restored, {"params": params, "opt_state": opt_state})
    expected = step(params, opt_state, batch(3))
    resumed = step(restored["params"], restored["opt_state"], batch(3))
    assert_bits_equal(resumed, expected)


def test_the_same_rounding_with_and_without_jit(jit_or_eager):
    params = jnp.asarray(np.linspace(1, 2, 16, dtype=F32).astype(BF16))
    tx = jls.stochastic_rounding(jax.random.key(9))
    expected, _ = jax.jit(tx.update)(jnp.full(16, 1e-3), tx.init(params), params)
    got, state = jit_or_eager(tx.update, jnp.full(16, 1e-3), tx.init(params), params)
    assert_bits_equal(got, expected)
    assert state.key.dtype == jnp.uint32


# --- bad input ------------------------------------------------------------------------------


def split_key_0(num):
    return jax.random.split(jax.random.key(0), num)


# The split keys are made in the test: at collection, every worker would compile them. A
# partial has no __name__, so its id is the parameter's name and index, as an array's.
@pytest.mark.parametrize(
    ("key", "error", "message"),
    [
        (0, TypeError, "stochastic_rounding(key=0): key must be a PRNG key such as"),
        (
            jnp.asarray(np.zeros(2, F32)),
            TypeError,
            "key must be a PRNG key such as jax.random.key(0), got",
        ),
        (jnp.asarray(np.zeros(3, np.uint32)), TypeError, "key must be a PRNG key"),
        (functools.partial(split_key_0, 3), ValueError, "got a key array of shape (3,)"),
        (functools.partial(split_key_0, 300), ValueError, "dtype key<fry> and shape (300,)"),
    ],
)
def test_a_key_that_is_not_one_prng_key_is_an_error_naming_key(key, error, message):
    if isinstance(key, functools.partial):
        key = key()
    with pytest.raises(error) as raised:
        jls.stochastic_rounding(key)
    assert message in str(raised.value)
    assert len(str(raised.value)) < 300  # the shape and dtype, not the array


def test_init_after_a_donated_step_still_has_its_key():
    params = jnp.asarray(np.ones(4, BF16))
    tx = jls.stochastic_rounding(jax.random.key(0))
    step = jax.jit(lambda u, s, p: tx.update(u, s, p)[1], donate_argnums=1)
    first = tx.init(params)
    step(jnp.asarray(np.ones(4, F32)), first, params)
    assert first.key.is_deleted()  # donated
    assert tx.init(params).key.tolist() == jax.random.key_data(jax.random.key(0)).tolist()


def test_a_legacy_uint32_key_is_accepted():
    tx = jls.stochastic_rounding(jax.random.PRNGKey(0))
    assert tx.init({}).key.tolist() == [0, 0]


@pytest.mark.parametrize(
    ("dtype", "error"), [(jnp.int32, ValueError), ("nope", TypeError), (object(), TypeError)]
)
def test_a_non_floating_compensation_dtype_is_an_error_naming_it(dtype, error):
    with pytest.raises(
        error, match=r"kahan_summation\(compensation_dtype=.*\): compensation_dtype"
    ):
        jls.kahan_summation(dtype)


@pytest.mark.parametrize(
    "tx",  # made in the test, as the split keys above (the ids stay tx0, tx1)
    [
        functools.partial(lambda: jls.stochastic_rounding(jax.random.key(0))),
        functools.partial(jls.kahan_summation),
    ],
)
@pytest.mark.parametrize("inside", [False, True], ids=["alone", "inside_loss_scaled"])
def test_update_without_params_is_an_error(tx, inside):
    tx = jls.loss_scaled(tx(), jls.FixedLossScale(1.0)) if inside else tx()
    params = jnp.asarray(np.ones(2, BF16))
    with pytest.raises(ValueError, match=r"\.update: params are required"):
        tx.update(jnp.asarray(np.ones(2, F32)), tx.init(params))


def test_a_float8_weight_is_an_error_naming_its_path():
    params = {"w": jnp.asarray(np.ones(2, jnp.float8_e4m3fn))}
    tx = jls.stochastic_rounding(jax.random.key(0))
    with pytest.raises(TypeError, match=r"the param \['w'\] is of dtype float8_e4m3fn"):
        tx.update({"w": jnp.asarray(np.ones(2, F32))}, tx.init(params), params)


# --- issue 46: empty leaves, bfloat16 updates under apply_if_finite --------------------------


@pytest.mark.parametrize("shape", [(0, 5), (3, 0, 4), (5, 0)])
def test_a_bfloat16_leaf_with_a_zero_size_axis_passes_through(shape, jit_or_eager):
    params = {"e": jnp.zeros(shape, BF16), "w": jnp.asarray(np.ones(3, BF16))}
    grads = {"e": jnp.zeros(shape, F32), "w": jnp.asarray(np.full(3, -0.25, F32))}
    for tx in (jls.stochastic_rounding(jax.random.key(0)), jls.kahan_summation()):
        updates, _ = jit_or_eager(tx.update, grads, tx.init(params), params)
        assert updates["e"].shape == shape
        assert optax.apply_updates(params, updates)["w"].tolist() == [0.75] * 3


def apply_if_finite_steps(remedy, grads, wrap):
    """`optax.apply_if_finite(optax.chain(sgd(1), remedy))` (inside `loss_scaled` when
    `wrap`) given `grads` at every step from a bfloat16 1.0; the last step's are NaN."""
    inner = optax.apply_if_finite(optax.chain(optax.sgd(1.0), remedy), 3)
    tx = jls.loss_scaled(inner, jls.FixedLossScale(1.0)) if wrap else inner

    def run(params, grads):
        def step(carry, g):
            params, state = carry
            updates, state = tx.update(g, state, params)
            return (optax.apply_updates(params, updates), state), updates.dtype == g.dtype

        steps = jnp.broadcast_to(grads, (1000, *grads.shape))
        carry, same_dtype = jax.lax.scan(step, (params, tx.init(params)), steps)
        before = carry
        nan_updates, state = tx.update(jnp.full_like(grads, jnp.nan), carry[1], carry[0])
        return before, (nan_updates, state), same_dtype

    return jax.jit(run)(jnp.asarray(np.ones(3, BF16)), grads)


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "loss_scaled"])
@pytest.mark.parametrize("remedy", ["sr", "kahan"])
def test_apply_if_finite_takes_bfloat16_updates_as_bare_optax_gives_them(remedy, wrap):
    make = lambda: (  # noqa: E731
        jls.stochastic_rounding(jax.random.key(1)) if remedy == "sr" else jls.kahan_summation()
    )
    grads = jnp.asarray(np.full(3, 1e-4, BF16))  # 1.0001659e-4
    (params, state), (nan_updates, nan_state), same_dtype = apply_if_finite_steps(
        make(), grads, wrap
    )
    chain_state = lambda state: (state.inner_state if wrap else state).inner_state  # noqa: E731
    assert bool(same_dtype.all())
    assert nan_updates.dtype == BF16
    assert nan_updates.tolist() == [0.0] * 3
    assert_bits_equal(chain_state(nan_state), chain_state(state))
    # the same steps given float32 gradients of the same value land on the same bits
    (wide, wide_state), _, _ = apply_if_finite_steps(make(), grads.astype(F32), wrap)
    assert_bits_equal(params, wide)
    assert_bits_equal(chain_state(state), chain_state(wide_state))
    if remedy == "kahan":
        assert params.tolist() == [0.8984375] * 3  # nearest to 1 - 0.10001659
        last = chain_state(state)[-1]
        float32 = np.float32(1) - np.float32(1000) * np.float32(grads[0])
        np.testing.assert_allclose(float32_of(params, last.low_bits), float32, rtol=1e-6)
    else:
        assert abs(float(np.mean(np.asarray(params, F32))) - 0.9) < 0.02


def test_a_bfloat16_update_across_zero_lands_within_half_a_gap_and_kahan_keeps_the_rest():
    """A difference as large as the weight is not a bfloat16 value (3 of 20,000 steps of
    sgd across zero on weights and gradients of about 1e-3): its update misses the rounded
    sum by a gap, and a float32 buffer keeps what the weight it lands on lacks."""
    params = jnp.asarray(np.array([3.6716461181640625e-05, 0.5], BF16))
    grads = jnp.asarray(np.array([0.00015926361083984375, 0.75], BF16))
    total = np.asarray(params, F32) - np.asarray(grads, F32)
    tx = optax.chain(optax.sgd(1.0), jls.kahan_summation(F32))
    updates, state = tx.update(grads, tx.init(params), params)
    assert updates.dtype == BF16
    new = np.asarray(optax.apply_updates(params, updates), F32)
    assert new.tolist() == [-0.000121593475341796875, -0.25]
    assert total.astype(BF16).astype(F32).tolist() == [-0.0001220703125, -0.25]  # nearest
    np.testing.assert_array_equal(new + np.asarray(state[1].compensation), total)
    updates, state = tx.update(grads.astype(F32), tx.init(params), params)  # float32: exact
    assert optax.apply_updates(params, updates).tolist() == [-0.0001220703125, -0.25]


def test_a_float16_buffer_for_a_bfloat16_weight_is_an_error_naming_it():
    """A float16 buffer stalls small bfloat16 weights (0.001 - 1e-9 x 20,000 stayed 0.000999)
    and overflows for large ones (3e8 became inf): issue 46, item 9."""
    params = {"w": jnp.asarray(np.ones(3, BF16)), "h": jnp.asarray(np.ones(3, F16))}
    with pytest.raises(ValueError, match=r"float16 buffer cannot hold .* bfloat16 param \['w'\]"):
        jls.kahan_summation(F16).init(params)
    assert jls.kahan_summation(F16).init({"h": params["h"]}).compensation["h"].dtype == F16
    with pytest.raises(ValueError, match=r"bfloat16 buffer cannot hold .* float16 param \['h'\]"):
        jls.kahan_summation(BF16).init(params)
    assert jls.kahan_summation(F32).init(params).compensation["w"].dtype == F32


@pytest.mark.parametrize("remedy", ["sr", "kahan"])
def test_updates_of_another_structure_are_an_error_with_shapes_not_values(remedy):
    tx = jls.stochastic_rounding(jax.random.key(0)) if remedy == "sr" else jls.kahan_summation()
    params = {"w": jnp.asarray(np.ones(300, BF16))}
    with pytest.raises(ValueError, match="the updates do not have the params' structure") as e:
        tx.update(jnp.asarray(np.ones(300, F32)), tx.init(params), params)
    message = str(e.value)
    assert "dtype float32 and shape (300,)" in message
    assert len(message) < 250  # 1.4k characters with the values printed


@pytest.mark.parametrize("compensation_dtype", [None, F32])
def test_a_sum_past_the_largest_bfloat16_stays_finite_and_comes_back(compensation_dtype):
    """Updates that carry the float32 sum past bfloat16's largest value plus half a gap
    (finite in float32) leave the weight at the largest value, and it follows the sum back
    down, where it once became infinite for good."""
    largest = np.float32(jnp.finfo(jnp.bfloat16).max)  # 3.3895e38; half a gap more: 3.3961e38
    updates = [np.float32(1e35)] * 10 + [np.float32(-1e35)] * 100
    params = device_array([largest], BF16)
    tx = jls.kahan_summation(compensation_dtype)
    state = tx.init(params)
    step = jax.jit(tx.update)
    weights = []
    for update in updates:
        new_updates, state = step(jnp.full(1, update), state, params)
        params = optax.apply_updates(params, new_updates)
        weights.append(np.asarray(params, F32)[0])
    # The float32 sum, which the int16 buffer caps at half a gap above the largest value
    # (the pattern 0x7F7F7FFF) and a float32 buffer keeps whole.
    cap = np.array([0x7F7F7FFF], np.uint32).view(np.float32)[0]
    total = largest
    for update in updates:
        total = np.float32(total + update)
        total = min(total, cap) if compensation_dtype is None else total
    assert np.float32(largest + 10 * np.float32(1e35)) > 3.3961e38  # past half a gap
    assert np.isfinite(weights).all()
    assert weights[:10] == [largest] * 10
    assert weights[-1] == np.float32(total).astype(ml_dtypes.bfloat16).astype(F32)
    assert 3.2e38 < weights[-1] < 3.3e38
    nearest = optax.apply_updates(device_array([largest], BF16), jnp.full(1, np.float32(1e35)))
    assert np.asarray(nearest, F32)[0] == largest  # nearest rounding stays finite too


# --- the compiled program -----------------------------------------------------------------


def _cpu_step_ops(remedies: list[optax.GradientTransformation], grad_dtype: Any) -> tuple[int, int]:
    """Passes over the leaf (loop fusions) and copies of it in XLA:CPU's program of a donated
    adamw step on one bfloat16 leaf."""
    params = jnp.full((64, 128), 0.5, BF16)
    grads = jnp.full((64, 128), 1e-3, grad_dtype)
    tx = optax.chain(optax.adamw(1e-3, weight_decay=1e-4), *remedies)

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = jax.eval_shape(step, params, tx.init(params), grads)[1]  # after one step
    text = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, grads).compile()
    entry = text.as_text().split("ENTRY", 1)[1]
    lines = [line for line in entry.splitlines() if "[64,128]" in line]
    return sum("kind=kLoop" in line for line in lines), sum(" copy(" in line for line in lines)


@pytest.mark.parametrize("grad_dtype", [BF16, F32])
def test_kahan_adds_one_copy_and_three_passes_to_the_cpu_step_whatever_the_gradients(
    grad_dtype,
):
    # XLA:CPU keeps a float32 -> bfloat16 cast that several operations read in memory. With
    # float32 gradients each rounding written as such a cast split Kahan's update into five
    # passes and copied both the donated weight and buffer (19 ms against 8 ms with bfloat16
    # gradients at 4M params).
    fusions, copies = _cpu_step_ops([], grad_dtype)
    kahan_fusions, kahan_copies = _cpu_step_ops([jls.kahan_summation()], grad_dtype)
    assert (kahan_fusions - fusions, kahan_copies - copies) == (3, 1)
    rounded_fusions, rounded_copies = _cpu_step_ops(
        [jls.stochastic_rounding(jax.random.key(0))], grad_dtype
    )
    assert (rounded_fusions, rounded_copies) == (fusions, copies)


def test_kahan_buffers_are_placed_as_their_weights():
    """Each buffer takes its weight's sharding, as optax's moments do (`zeros_like`): over
    an explicit mesh axis a weight split 8 ways had its buffer whole on every device."""
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Explicit,))
    sharding = NamedSharding(mesh, P("model"))
    params = {
        "bf16": jax.device_put(jnp.ones(16, BF16), sharding),
        "f16": jax.device_put(jnp.ones(16, F16), sharding),
    }
    for tx in (jls.kahan_summation(), jls.kahan_summation(jnp.float32)):
        state = tx.init(params)
        buffers = jax.tree.leaves((state.low_bits, state.compensation))
        assert len(buffers) == 2
        for buffer in buffers:
            assert buffer.sharding.is_equivalent_to(sharding, 1), buffer.sharding


def test_kahan_state_of_another_shape_is_an_error_naming_the_param():
    """A resized layer, its state not made again: the shapes differ where the structure and
    dtypes agree (before: jax's own broadcasting error, naming neither)."""
    tx = jls.kahan_summation()
    state = tx.init({"w": jnp.ones(3, BF16)})
    with pytest.raises(ValueError, match=r"^kahan_summation\.update: the param") as raised:
        tx.update({"w": jnp.ones(4, BF16)}, state, {"w": jnp.ones(4, BF16)})
    assert str(raised.value) == (
        "kahan_summation.update: the param ['w'] has shape (4,), but the state's buffer for it "
        "(3,); a new model needs a new tx.init(params)"
    )


def test_an_array_as_the_compensation_dtype_is_an_error_naming_it():
    with pytest.raises(TypeError, match=r"^kahan_summation\(compensation_dtype=Array\(\[0\., "):
        jls.kahan_summation(jnp.zeros(2))
