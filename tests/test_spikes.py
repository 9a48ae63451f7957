"""The gradient norm in the stats and spike skipping (docs/spikes.md)."""

import collections
import functools
import math
import re

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_lossscale as jls
from jax_lossscale import _loss_scaled
from jax_lossscale._platforms import Form

from helpers import ReferenceLossScale, assert_bits_equal, compiled_reductions, device_array, jitted

NUM_DEVICES = 8
AXIS = "d"


def exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def norm64(tree) -> float:
    entries = [np.ravel(np.asarray(leaf, np.float64)) for leaf in jax.tree.leaves(tree)]
    return float(np.linalg.norm(np.concatenate(entries)))


def scaled(grads, scale: float):
    return jax.tree.map(lambda g: (np.asarray(g, np.float32) * scale).astype(g.dtype), grads)


# optax's global norm, jitted: one program per tree structure, not one per operation.
tree_norm = jax.jit(optax.tree.norm)


# --- 1. the norm ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtypes",
    [
        {"w": jnp.float32, "b": jnp.float32},
        {"w": jnp.float16, "b": jnp.float16},
        {"w": jnp.bfloat16, "b": jnp.bfloat16},
        {"w": jnp.float16, "b": jnp.bfloat16},
    ],
    ids=["float32", "float16", "bfloat16", "mixed"],
)
def test_grad_norm_is_the_global_norm_of_the_unscaled_gradients(dtypes):
    rng = np.random.default_rng(0)
    true_grads = {
        "w": rng.normal(size=(64, 16)).astype(dtypes["w"]) * 1e-3,
        "b": rng.normal(size=(300,)).astype(dtypes["b"]),
    }
    params = jax.tree.map(lambda g: device_array(np.zeros(g.shape)), true_grads)
    tx = jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale(initial_loss_scale=2.0**10))
    _, opt_state = jitted(tx.update, scaled(true_grads, 2.0**10), tx.init(params), params)

    grad_norm = jls.get_loss_scale_stats(opt_state).grad_norm
    assert grad_norm.dtype == jnp.float32
    np.testing.assert_allclose(grad_norm, norm64(true_grads), rtol=1e-6)
    as_float32 = jax.tree.map(lambda g: np.asarray(g, np.float32), true_grads)
    np.testing.assert_allclose(grad_norm, tree_norm(as_float32), rtol=1e-6)


def test_grad_norm_is_zero_before_the_first_step_inf_after_an_overflow_nan_after_a_nan():
    tx = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale(initial_loss_scale=4.0))
    params = {"w": jnp.zeros(2)}
    opt_state = tx.init(params)
    assert_bits_equal(jls.get_loss_scale_stats(opt_state).grad_norm, np.float32(0.0))
    norms = []
    for grads in ([12.0, 16.0], [jnp.inf, 1.0], [-jnp.inf, 1.0], [jnp.nan, 1.0], [3.0, 4.0]):
        _, opt_state = jax.jit(tx.update)({"w": jnp.array(grads)}, opt_state, params)
        norms.append(float(jls.get_loss_scale_stats(opt_state).grad_norm))
    # Scales 4, 4 -> 2 (inf), 2 -> 1, 1 -> 1 (floor): [3, 4], then [3, 4] at scale 1.
    np.testing.assert_array_equal(norms, [5.0, np.inf, np.inf, np.nan, 5.0])


@pytest.mark.parametrize(("entry", "norm"), [(2.0**-60, 2.0**-55), (2.0**-80, 0.0)])
def test_entries_too_small_to_square_in_float32_add_nothing_as_in_optax(entry, norm):
    """The squares are float32, as `optax.tree.norm` takes them (LossScaleStats): 1,024
    entries of 2**-60 give 2**-55, of 2**-80 (squares of 2**-160, below every float32) 0."""
    tx = jls.loss_scaled(optax.sgd(1.0), jls.FixedLossScale(1.0))
    params = {"w": jnp.zeros(1024)}
    grads = {"w": jnp.full(1024, entry, jnp.float32)}
    _, opt_state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert float(jls.get_loss_scale_stats(opt_state).grad_norm) == norm
    assert float(optax.tree.norm(grads)) == norm


def test_finite_gradients_whose_squared_norm_overflows_are_an_overflow():
    """DESIGN 3.1: a squared norm above the float32 maximum (a norm above about 1.8e19) is
    counted as an overflow: `grad_norm` inf, the step skipped as an inf skip, the scale
    backing off; `all_finite` stays exact."""
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(initial_loss_scale=2.0))
    params = {"w": jnp.zeros(2)}
    grads = {"w": jnp.array([3e38, 1.0])}
    updates, opt_state = tx.update(grads, tx.init(params), params)
    stats = jls.get_loss_scale_stats(opt_state)
    assert not bool(stats.last_step_applied)
    assert float(stats.grad_norm) == np.inf
    assert (int(stats.inf_skipped_steps), float(stats.loss_scale)) == (1, 1.0)
    assert np.all(np.signbit(updates["w"]))
    assert not np.any(updates["w"])
    assert bool(jls.all_finite(grads))


def _global_gradient():
    """A gradient of 8 rows, one per device, of integer values: sums are exact."""
    rng = np.random.default_rng(3)
    return {
        "w": rng.integers(-4, 5, size=(NUM_DEVICES, 6)).astype(np.float32),
        "b": rng.integers(-4, 5, size=(NUM_DEVICES,)).astype(np.float32),
    }


def _per_device_gradients(grads):
    """Per-device data-parallel gradients whose mean over the devices is `grads`."""
    offsets = np.arange(NUM_DEVICES, dtype=np.float32) - (NUM_DEVICES - 1) / 2
    return jax.tree.map(
        lambda g: np.stack([g + 2.0 * offset for offset in offsets]).astype(np.float32), grads
    )


def _norm_of(opt_state) -> np.ndarray:
    return np.asarray(jax.device_get(jls.get_loss_scale_stats(opt_state).grad_norm))


def test_pmap_shard_map_and_spmd_jit_agree_on_the_norm():
    grads = _global_gradient()
    expected = norm64(grads)
    assert expected == pytest.approx(float(tree_norm(grads)), rel=1e-7)
    scale = 2.0**6
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    rows = PartitionSpec(AXIS)

    def step(tx):
        def update(params, opt_state, scaled_grads):
            _, opt_state = tx.update(scaled_grads, opt_state, params)
            return opt_state

        return update

    loss_scale = jls.DynamicLossScale(initial_loss_scale=scale)
    params = jax.tree.map(np.zeros_like, grads)
    norms = {}

    # SPMD jit: the gradient sharded by rows, no axis_name.
    tx = jls.loss_scaled(optax.adam(1e-3), loss_scale)
    placed = jax.device_put((params, scaled(grads, scale)), NamedSharding(mesh, rows))
    norms["spmd jit"] = _norm_of(jax.jit(step(tx))(placed[0], tx.init(placed[0]), placed[1]))

    # shard_map: each device holds its rows of the gradient (FSDP-like).
    tx = jls.loss_scaled(optax.adam(1e-3), loss_scale, axis_name=AXIS)
    state_specs = jax.tree.map(lambda x: rows if np.ndim(x) else PartitionSpec(), tx.init(params))
    sharded = jax.jit(
        jax.shard_map(
            step(tx), mesh=mesh, in_specs=(rows, state_specs, rows), out_specs=state_specs
        )
    )
    norms["shard_map, sharded"] = _norm_of(sharded(params, tx.init(params), scaled(grads, scale)))

    # Data parallel: per-device gradients, pmean'ed, under pmap and under shard_map.
    device_grads = scaled(_per_device_gradients(grads), scale)

    def data_parallel(params, opt_state, scaled_grads):
        return step(tx)(params, opt_state, jax.lax.pmean(scaled_grads, AXIS))

    replicate = lambda tree: jax.tree.map(lambda x: np.stack([x] * NUM_DEVICES), tree)  # noqa: E731
    pmapped = jax.pmap(data_parallel, axis_name=AXIS)
    norms["pmap, pmean"] = _norm_of(
        pmapped(replicate(params), replicate(tx.init(params)), device_grads)
    )
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
    mapped = jax.jit(
        jax.shard_map(
            lambda p, s, g: data_parallel(p, s, first(g)),
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec(), rows),
            out_specs=PartitionSpec(),
        )
    )
    norms["shard_map, pmean"] = _norm_of(mapped(params, tx.init(params), device_grads))

    for name, norm in norms.items():
        np.testing.assert_allclose(norm, expected, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("form", [Form.CPU, Form.GPU], ids=lambda form: form.value)
def test_a_squared_norm_that_overflows_only_summed_over_devices_is_an_overflow_everywhere(form):
    """DESIGN 3.1: one rule in every distribution mode and in both platforms' forms. A
    gradient of one entry of 7e18 per device: each device's squares sum to 4.9e37, finite,
    but the 8 devices' to 3.9e38, past the float32 maximum. On one device, under SPMD `jit`
    with the rows sharded, under `shard_map` with each device holding its rows, and under
    `pmap` with the per-device gradients averaged (each device then holds it whole): the
    step is skipped as an overflow, `grad_norm` is inf and the scale halves."""
    grads = {"w": np.zeros((NUM_DEVICES, 3), np.float32)}
    grads["w"][:, 1] = 7e18
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    rows = PartitionSpec(AXIS)
    params = jax.tree.map(np.zeros_like, grads)

    def step(tx):
        def update(params, opt_state, grads):
            return tx.update(grads, opt_state, params)[1]

        return update

    def build(axis_name=None):
        ls = jls.DynamicLossScale(initial_loss_scale=1.0, min_loss_scale=0.25)
        return _loss_scaled.in_form(form, optax.adam(1e-3), ls, axis_name)

    tx = build()
    states = {"one device": jax.jit(step(tx))(params, tx.init(params), grads)}
    placed = jax.device_put((params, grads), NamedSharding(mesh, rows))
    states["spmd jit"] = jax.jit(step(tx))(placed[0], tx.init(placed[0]), placed[1])
    tx = build(AXIS)
    state_specs = jax.tree.map(lambda x: rows if np.ndim(x) else PartitionSpec(), tx.init(params))
    sharded = jax.shard_map(
        step(tx), mesh=mesh, in_specs=(rows, state_specs, rows), out_specs=state_specs
    )
    states["shard_map, sharded"] = jax.jit(sharded)(params, tx.init(params), grads)
    replicate = lambda tree: jax.tree.map(lambda x: np.stack([x] * NUM_DEVICES), tree)  # noqa: E731
    device_grads = {
        "w": np.stack([grads["w"] * 2 * (i + 1) / (NUM_DEVICES + 1) for i in range(NUM_DEVICES)])
    }
    pmapped = jax.pmap(lambda p, s, g: step(tx)(p, s, jax.lax.pmean(g, AXIS)), axis_name=AXIS)
    states["pmap, pmean"] = pmapped(replicate(params), replicate(tx.init(params)), device_grads)
    for name, state in states.items():
        stats = jls.get_loss_scale_stats(state)
        assert np.all(np.asarray(stats.last_step_applied) == False), name  # noqa: E712
        assert np.all(np.asarray(stats.inf_skipped_steps) == 1), name
        assert np.all(np.isposinf(np.asarray(stats.grad_norm))), name
        assert np.all(np.asarray(stats.loss_scale) == 0.5), name
    assert bool(jls.all_finite(grads))  # exact per entry: finite
    # docs/distributed.md: where nothing says which leaves are shards (`pmap` of each device's
    # rows, `shard_map` with check_vma=False), each device's rows are judged alone, as the
    # whole gradient: their squares sum to 4.9e37, and the step is applied.
    unchecked = jax.shard_map(
        step(tx), mesh=mesh, in_specs=(rows, state_specs, rows), out_specs=state_specs,
        check_vma=False,
    )  # fmt: skip
    alone = {
        "shard_map, check_vma=False": jax.jit(unchecked)(params, tx.init(params), grads),
        "pmap of rows": jax.pmap(step(tx), axis_name=AXIS)(
            params, jax.pmap(tx.init)(params), grads
        ),
    }
    for name, state in alone.items():
        stats = jls.get_loss_scale_stats(state)
        assert np.all(np.asarray(stats.last_step_applied)), name
        np.testing.assert_allclose(np.asarray(stats.grad_norm), 7e18, rtol=1e-6, err_msg=name)


# --- 2. skipping spikes ---------------------------------------------------------------------


def _state_parts(opt_state):
    return jls.get_loss_scale_stats(opt_state), opt_state.loss_scale_state


def test_an_absolute_bound_skips_finite_steps_above_it_and_the_scale_sees_them_finite():
    ls = jls.DynamicLossScale(initial_loss_scale=2.0**4, increment_period=2)
    tx = jls.loss_scaled(optax.adam(0.1), ls, skip_grad_norm_above=1.0)
    params = {"w": jnp.array([1.0, 2.0])}
    opt_state = tx.init(params)
    step = jax.jit(tx.update)
    trajectory = []
    for true_grad in ([0.0, 1.0], [3.0, 4.0], [0.375, 0.5], [jnp.inf, 0.0], [0.0, 0.5]):
        scale = float(jls.get_loss_scale(opt_state))
        before = (params, opt_state.inner_state)
        updates, opt_state = step({"w": jnp.array(true_grad) * scale}, opt_state, params)
        params = optax.apply_updates(params, updates)
        stats = jls.get_loss_scale_stats(opt_state)
        if not stats.last_step_applied:
            assert_bits_equal((params, opt_state.inner_state), before)
        trajectory.append(
            (
                float(stats.loss_scale),
                str(float(stats.grad_norm)),
                int(stats.skipped_steps),
                int(stats.spike_skipped_steps),
                int(stats.inf_skipped_steps),
                int(stats.consecutive_skipped_steps),
                bool(stats.last_step_applied),
            )
        )
    assert trajectory == [
        (16.0, "1.0", 0, 0, 0, 0, True),  # the bound itself is not above it
        (32.0, "5.0", 1, 1, 0, 1, False),  # a spike, and the second finite step: growth
        (32.0, "0.625", 1, 1, 0, 0, True),
        (16.0, "inf", 2, 1, 1, 1, False),
        (16.0, "0.5", 2, 1, 1, 0, True),
    ]
    assert int(opt_state.inner_state[0].count) == 3  # adam counted the applied steps only


def _norm_steps(tx, norms, values=None, params=None):
    """Runs steps whose unscaled gradient is `[norm, 0]`; returns the last state and
    `(grad_norm, applied)` per step."""
    params = {"w": jnp.zeros(2)} if params is None else params
    opt_state = tx.init(params)
    step = jax.jit(tx.update)
    record = []
    for index, norm in enumerate(norms):
        scale = float(jls.get_loss_scale(opt_state))
        grads = {"w": jnp.array([norm, 0.0], jnp.float32) * scale}
        extra = {} if values is None else {"value": values[index]}
        updates, opt_state = step(grads, opt_state, params, **extra)
        params = optax.apply_updates(params, updates)
        stats = jls.get_loss_scale_stats(opt_state)
        record.append((float(stats.grad_norm), bool(stats.last_step_applied)))
    return opt_state, record


def _window_in_order(window: jls.RecentValues) -> list[float]:
    """The values of a window, oldest first."""
    values, filled, start = np.asarray(window.values), int(window.filled), int(window.next_index)
    if filled < len(values):
        return values[:filled].tolist()
    return np.roll(values, -start).tolist()


def test_a_norm_spike_against_a_full_window_is_skipped():
    ls = jls.FixedLossScale(8.0)
    tx = jls.loss_scaled(optax.sgd(1.0), ls, skip_spike_sigmas=2.0, spike_window=4)
    # 100 comes before the window is full: applied. Against [2, 100, 2, 2] (mean 26.5, std
    # 42.4) 100 is within 2 sigmas; against [100, 2, 2, 100] (mean 51, std 49) 200 is not.
    norms = [2.0, 100.0, 2.0, 2.0, 100.0, 200.0, 4.0]
    opt_state, record = _norm_steps(tx, norms)
    assert [applied for _, applied in record] == [True, True, True, True, True, False, True]
    assert [norm for norm, _ in record] == norms
    stats = jls.get_loss_scale_stats(opt_state)
    assert (int(stats.skipped_steps), int(stats.spike_skipped_steps)) == (1, 1)
    assert _window_in_order(opt_state.spike_windows.recent_grad_norms) == [2.0, 2.0, 100.0, 4.0]
    assert int(opt_state.spike_windows.recent_losses.filled) == 0  # no value= given


def test_the_window_fills_with_applied_steps_only():
    ls = jls.DynamicLossScale(initial_loss_scale=2.0**4)
    tx = jls.loss_scaled(
        optax.sgd(1.0), ls, skip_grad_norm_above=50.0, skip_spike_sigmas=2.0, spike_window=3
    )
    norms = [1.0, np.inf, 2.0, 60.0, np.nan, 3.0, 3.0, 9.0, 2.5]
    opt_state, record = _norm_steps(tx, norms)
    applied = [applied for _, applied in record]
    # inf and NaN overflow, 60 is above the bound; against [1, 2, 3] (mean 2, std 0.82)
    # 3 is within 2 sigmas, against [2, 3, 3] (mean 2.67, std 0.47) 9 is not.
    assert applied == [True, False, True, False, False, True, True, False, True]
    assert _window_in_order(opt_state.spike_windows.recent_grad_norms) == [3.0, 3.0, 2.5]
    stats = jls.get_loss_scale_stats(opt_state)
    counts = (
        stats.skipped_steps,
        stats.nan_skipped_steps,
        stats.inf_skipped_steps,
        stats.spike_skipped_steps,
        stats.consecutive_skipped_steps,
    )
    assert tuple(map(int, counts)) == (4, 1, 1, 2, 0)


def _applied(record) -> list[bool]:
    return [applied for _, applied in record]


def test_a_lasting_rise_of_the_norm_re_baselines_the_window_and_training_goes_on():
    """A new data mix: the norm moves from 1.0 to 1.5 and stays. Four spikes in a row
    (a quarter of the window) are skipped, then the window follows the new level."""
    tx = jls.loss_scaled(
        optax.sgd(0.1), jls.DynamicLossScale(2.0**4), skip_spike_sigmas=4.0, spike_window=16
    )
    opt_state, record = _norm_steps(tx, [1.0] * 16 + [1.5] * 150)
    applied = _applied(record)[16:]
    assert sum(applied) == 146  # was 0: every later step a spike
    assert applied[:5] == [False, False, False, False, True]
    stats = jls.get_loss_scale_stats(opt_state)
    assert (int(stats.spike_skipped_steps), int(stats.consecutive_skipped_steps)) == (4, 0)
    assert _window_in_order(opt_state.spike_windows.recent_grad_norms) == [1.5] * 16
    assert int(opt_state.spike_windows.spikes_in_a_row) == 0
    # Re-baselining: the fifth step was applied though above [1.0] * 16 (it enters the
    # window), the sixth is within [1.0] * 15 + [1.5] (mean 1.03, std 0.12) and ends it.
    _, record = _norm_steps(tx, [1.0] * 16 + [1.5] * 6)
    assert _applied(record)[16:] == [False, False, False, False, True, True]


def test_after_a_window_of_zero_gradients_training_goes_on():
    """A loss term switched on after warm-up: a window of zeros has a standard deviation
    of 0, and every nonzero norm is above it, until it re-baselines."""
    tx = jls.loss_scaled(
        optax.sgd(0.1), jls.FixedLossScale(1.0), skip_spike_sigmas=4.0, spike_window=16
    )
    opt_state, record = _norm_steps(tx, [0.0] * 16 + [1.0] * 32)
    applied = _applied(record)
    assert all(applied[:16])
    assert sum(applied[16:]) == 28  # was 0 of 32
    assert applied[16:22] == [False, False, False, False, True, True]
    assert _window_in_order(opt_state.spike_windows.recent_grad_norms) == [1.0] * 16
    assert int(jls.get_loss_scale_stats(opt_state).spike_skipped_steps) == 4


@functools.cache
def _applied_over_series():
    """A jitted run of a 16-step window with 3 sigmas: `(norms, losses) -> applied`."""
    tx = jls.loss_scaled(
        optax.sgd(1.0), jls.FixedLossScale(1.0), skip_spike_sigmas=3.0, spike_window=16
    )
    params = {"w": jnp.zeros(1)}

    @jax.jit
    def run(norms, losses):
        def step(opt_state, norm_and_loss):
            norm, loss = norm_and_loss
            _, opt_state = tx.update({"w": norm[None]}, opt_state, params, value=loss)
            return opt_state, jls.get_loss_scale_stats(opt_state).last_step_applied

        return jax.lax.scan(step, tx.init(params), (norms, losses))[1]

    return run


@pytest.mark.parametrize(
    ("tested", "level"),
    [("norm", 1.0), ("norm", 1e-18), ("norm", 1e18), ("loss", 1.0), ("loss", 1e-24),
     ("loss", 1e22), ("loss", 1e37)],
)  # fmt: skip
def test_a_series_decides_alike_at_every_level_a_float32_holds(tested, level):
    """The same series with 1% noise and one spike of 1.5x at step 150, at any level: only
    the spike is skipped. (Its squared deviations from the mean in plain float32 were zeros
    near 1e-18 (98 of 184 steps skipped) and infinities near 1e22 (the spike applied).)"""
    rng = np.random.default_rng(0)
    series = (level * (1 + 0.01 * rng.standard_normal(200))).astype(np.float32)
    series[150] = np.float32(level * 1.5)
    steady = np.full(200, 0.5, np.float32)
    norms, losses = (series, steady) if tested == "norm" else (steady, series)
    applied = np.asarray(_applied_over_series()(jnp.asarray(norms), jnp.asarray(losses)))
    assert np.flatnonzero(~applied).tolist() == [150]


def test_an_isolated_spike_is_still_skipped_before_and_after_a_re_baseline():
    tx = jls.loss_scaled(
        optax.sgd(0.1), jls.FixedLossScale(1.0), skip_spike_sigmas=4.0, spike_window=16
    )
    norms = [1.0, 1.25] * 8 + [5.0, 1.0] + [2.0, 2.5] * 12 + [10.0, 2.0]
    opt_state, record = _norm_steps(tx, norms)
    skipped = [index for index, applied in enumerate(_applied(record)) if not applied]
    # 5 against [1, 1.25] * 8 (mean 1.125, std 0.125): skipped, and 1.0 ends the run of one.
    # 2 and 2.5 are a new level: steps 18 to 21 skipped, then the window follows;
    # against [2, 2.5] * 8 the 10 is an isolated spike again.
    assert skipped == [16, 18, 19, 20, 21, 42]
    assert int(jls.get_loss_scale_stats(opt_state).spike_skipped_steps) == 6


def test_re_baselining_never_lets_a_non_finite_value_or_a_norm_above_the_bound_in():
    tx = jls.loss_scaled(
        optax.sgd(0.1), jls.FixedLossScale(1.0), skip_grad_norm_above=4.0,
        skip_spike_sigmas=4.0, spike_window=4,
    )  # fmt: skip
    # After [1] * 4, 3 is a spike (one in a row: the window would follow the next one),
    # inf leaves the count as it is, 5 is above the bound, then 3 is applied.
    norms = [1.0] * 4 + [3.0, np.inf, 5.0, 3.0]
    losses = [1.0] * 4 + [1.0, 1.0, 1.0, np.nan]
    opt_state, record = _norm_steps(tx, norms, values=losses)
    assert _applied(record)[4:] == [False, False, False, False]  # the NaN loss: a spike
    assert int(opt_state.spike_windows.spikes_in_a_row) == 2
    _, record = _norm_steps(tx, norms, values=[*losses[:-1], 1.0])
    assert _applied(record)[4:] == [False, False, False, True]


def test_a_loss_spike_given_as_value_is_skipped_and_a_nan_loss_too():
    tx = jls.loss_scaled(
        optax.sgd(1.0), jls.FixedLossScale(1.0), skip_spike_sigmas=3.0, spike_window=2
    )
    norms = [1.0] * 7
    losses = [2.0, 2.5, 10.0, 2.25, np.nan, jnp.float32(2.5), 2]
    opt_state, record = _norm_steps(tx, norms, values=losses)
    # [2, 2.5]: mean 2.25, std 0.25, bound 3: 10 is a spike; [2.5, 2.25] then: NaN is one too.
    assert [applied for _, applied in record] == [True, True, False, True, False, True, True]
    assert _window_in_order(opt_state.spike_windows.recent_losses) == [2.5, 2.0]
    assert _window_in_order(opt_state.spike_windows.recent_grad_norms) == [1.0, 1.0]
    assert int(jls.get_loss_scale_stats(opt_state).spike_skipped_steps) == 2


def test_value_reaches_the_inner_transformation_too():
    def make_inner():
        return optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1))

    tx = jls.loss_scaled(make_inner(), jls.FixedLossScale(1.0), skip_spike_sigmas=3.0)
    bare = make_inner()
    params = {"w": jnp.zeros(2)}
    opt_state, bare_state = tx.init(params), bare.init(params)
    for _ in range(3):
        grads, loss = {"w": jnp.ones(2)}, jnp.float32(5.0)
        _, opt_state = tx.update(grads, opt_state, params, value=loss)
        _, bare_state = bare.update(grads, bare_state, params, value=loss)
    assert bare_state[1].scale == np.float32(0.1) * np.float32(0.1)  # no improvement: cut twice
    chex.assert_trees_all_equal(opt_state.inner_state, bare_state)
    assert int(opt_state.spike_windows.recent_losses.filled) == 3


def _spike_run(inner, steps):
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(2.0**3), skip_grad_norm_above=10.0)
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    opt_state = tx.init(params)
    step = jax.jit(tx.update)
    for grad in steps:
        scale = float(jls.get_loss_scale(opt_state))
        updates, opt_state = step({"w": jnp.asarray(grad, jnp.float32) * scale}, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: optax.adam(0.1),
        lambda: optax.adamw(optax.linear_schedule(0.1, 0.0, 10), weight_decay=0.1),
        lambda: optax.MultiSteps(optax.adam(0.1), every_k_schedule=3),
    ],
    ids=["adam", "adamw_schedule", "multisteps"],
)
def test_a_spike_skip_leaves_params_and_every_inner_state_bit_identical(make_inner):
    good = [[0.5, -1.0, 0.25], [1.0, 1.0, -1.0]]
    before_params, before_state = _spike_run(make_inner(), good)
    after_params, after_state = _spike_run(make_inner(), [*good, [30.0, 0.0, 0.0]])
    assert_bits_equal(after_params, before_params)
    assert_bits_equal(after_state.inner_state, before_state.inner_state)
    stats = jls.get_loss_scale_stats(after_state)
    assert (int(stats.spike_skipped_steps), bool(stats.last_step_applied)) == (1, False)
    assert float(stats.grad_norm) == 30.0
    # ... and the run goes on as if the spike never came.
    more = [[0.1, 0.2, 0.3]]
    resumed_params, _ = _spike_run(make_inner(), [*good, [30.0, 0.0, 0.0], *more])
    direct_params, _ = _spike_run(make_inner(), [*good, *more])
    chex.assert_trees_all_close(resumed_params, direct_params, rtol=1e-6)


def test_spike_skipping_under_pmap_every_device_agrees():
    tx = jls.loss_scaled(
        optax.sgd(1.0), jls.FixedLossScale(1.0), axis_name=AXIS, skip_spike_sigmas=1.0,
        spike_window=2,
    )  # fmt: skip

    def step(params, opt_state, grads, loss):
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        return optax.apply_updates(params, updates), opt_state

    pmapped = jax.pmap(step, axis_name=AXIS)
    replicate = lambda tree: jax.tree.map(lambda x: np.stack([x] * NUM_DEVICES), tree)  # noqa: E731
    params = replicate({"w": np.zeros(2, np.float32)})
    opt_state = replicate(tx.init({"w": jnp.zeros(2)}))
    applied = []
    # Every device's loss is its own; their mean is tested: 1, 1.25, then 4 (a spike).
    for mean_loss in (1.0, 1.25, 4.0, 1.0):
        losses = np.float32(mean_loss) + np.linspace(-0.5, 0.5, NUM_DEVICES, dtype=np.float32)
        grads = replicate({"w": np.array([0.5, 0.0], np.float32)})
        params, opt_state = pmapped(params, opt_state, grads, losses)
        flags = np.asarray(opt_state.stats.last_step_applied)
        assert len(set(flags.tolist())) == 1  # all devices agree
        applied.append(bool(flags[0]))
    assert applied == [True, True, False, True]
    window = jax.tree.map(lambda x: np.asarray(x)[3], opt_state.spike_windows.recent_losses)
    np.testing.assert_allclose(_window_in_order(window), [1.25, 1.0], rtol=1e-6)


# --- 3. state, checkpoints, cost ------------------------------------------------------------


def test_without_spike_skipping_the_state_holds_no_window():
    params = {"w": jnp.zeros(3)}
    for options in ({}, {"skip_grad_norm_above": 2.0}):
        tx = jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale(), **options)
        opt_state = tx.init(params)
        assert opt_state.spike_windows is None
        compiled = jax.jit(tx.update).lower(params, opt_state, params).compile().as_text()
        assert "f32[128]" not in compiled
    tx = jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale(), skip_spike_sigmas=4.0)
    windows = tx.init(params).spike_windows
    empty = jls.RecentValues(
        values=np.zeros(128, np.float32), filled=np.int32(0), next_index=np.int32(0)
    )
    expected = jls.SpikeWindows(
        recent_grad_norms=empty, recent_losses=empty, spikes_in_a_row=np.int32(0)
    )
    chex.assert_trees_all_equal(windows, expected, strict=True)


def _reductions(compiled_text: str) -> int:
    return len(compiled_reductions(compiled_text))


# Where the gradients are, and the reductions per leaf and besides: on one device (of the 8
# this process has), each leaf is summed over its whole rows and its last, partial row apart
# (the CPU form), then all the rows' sums in one more sum; where the leaves may be sharded
# (placed on a mesh of the 8 devices whose axis XLA's partitioner may split them along), each
# in one plain sum, which the partitioner all-reduces, and the six sums are added up.
NORM_PLACEMENTS = {
    "one device": (lambda tree: jax.device_put(tree, jax.devices()[5]), 2, 1),
    "on a mesh of 8 devices": (
        lambda tree: jax.device_put(
            tree, NamedSharding(Mesh(np.array(jax.devices()), (AXIS,)), PartitionSpec())
        ),
        1,
        0,
    ),
}


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
def test_the_norm_comes_from_the_finite_check_s_reductions(placement):
    """The reductions that sum each leaf's squares, and one over their sums, check the
    gradients and give their norm and whether they hold a NaN, wherever they are (under
    `pmap` too: tests/test_lowering.py); there is no other. The windows' statistics add
    six: each window's largest magnitude, mean and spread."""
    place, per_leaf, extra = NORM_PLACEMENTS[placement]
    leaves = 6
    params = place({f"l{i}": np.ones((5000 + i,), np.float32) for i in range(leaves)})
    counts = {}
    for name, options in [
        ("off", {}),
        ("bound", {"skip_grad_norm_above": 1.0}),
        ("window", {"skip_spike_sigmas": 3.0}),
    ]:
        tx = jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale(), **options)
        lowered = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p, value=1.0))
        text = lowered.lower(params, tx.init(params), params).compile().as_text()
        counts[name] = _reductions(text)
    n = per_leaf * leaves + extra
    assert counts == {"off": n, "bound": n, "window": n + 6}


def test_a_state_read_back_as_numpy_arrays_updates_eagerly_as_it_does_jitted():
    """`jax.device_get(opt_state)` (or `flax.serialization.from_bytes`) gives NumPy leaves,
    which bare optax takes eagerly; the spike windows' update raised AttributeError ('at')."""
    tx = jls.loss_scaled(
        optax.adam(1e-2), jls.DynamicLossScale(256.0), skip_spike_sigmas=3.0, spike_window=4
    )
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.array([1.0, 2.0, 3.0]) * 256.0}
    opt_state = tx.init(params)
    for _ in range(2):
        _, opt_state = tx.update(grads, opt_state, params, value=1.0)
    on_host = jax.device_get(opt_state)
    assert isinstance(on_host.spike_windows.recent_grad_norms.values, np.ndarray)
    from_host = tx.update(grads, on_host, params, value=1.0)
    assert_bits_equal(from_host, tx.update(grads, opt_state, params, value=1.0))
    norms = _window_in_order(from_host[1].spike_windows.recent_grad_norms)
    assert norms == [pytest.approx(math.sqrt(14.0))] * 3
    jitted = jax.jit(tx.update)(grads, on_host, params, value=1.0)
    assert_bits_equal(from_host[1].spike_windows, jitted[1].spike_windows)


def test_a_run_resumed_mid_window_continues_bit_identically(tmp_path):
    tx = jls.loss_scaled(
        optax.adam(0.1), jls.DynamicLossScale(2.0**5, increment_period=3),
        skip_grad_norm_above=20.0, skip_spike_sigmas=2.0, spike_window=3,
    )  # fmt: skip
    rng = np.random.default_rng(5)
    directions = [rng.normal(size=4) for _ in range(12)]
    steps = [  # norms 1, 1.1, 1.2, 1, ...: within 2 sigmas of each other
        (d / np.linalg.norm(d) * (1.0 + 0.1 * (i % 3))).astype(np.float32)
        for i, d in enumerate(directions)
    ]
    steps[4][1] = np.inf
    steps[6] = steps[6] * 50  # a spike above the bound
    steps[9] = steps[9] * 6  # a spike against the window
    params = {"w": jnp.ones(4)}

    @jax.jit
    def train_step(params, opt_state, grad, loss):
        scale = jls.get_loss_scale(opt_state)
        updates, opt_state = tx.update({"w": grad * scale}, opt_state, params, value=loss)
        return optax.apply_updates(params, updates), opt_state

    def run(params, opt_state, indices):
        for index in indices:
            loss = np.float32(1.0 + 0.125 * (index % 3))
            params, opt_state = train_step(params, opt_state, steps[index], loss)
        return params, opt_state

    final = run(params, tx.init(params), range(12))
    saved = run(params, tx.init(params), range(5))
    assert int(saved[1].spike_windows.recent_grad_norms.filled) == 3
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", saved)
        checkpointer.wait_until_finished()
        target = jax.eval_shape(lambda: (params, tx.init(params)))
        restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert_bits_equal(restored, saved)
    resumed = run(*restored, range(5, 12))
    assert_bits_equal(resumed, final)
    stats = jls.get_loss_scale_stats(final[1])
    assert (int(stats.inf_skipped_steps), int(stats.spike_skipped_steps)) == (1, 2)


# --- 4. the whole rule, against a model -----------------------------------------------------


class SpikeModel:
    """Spike skipping (docs/spikes.md) in plain Python: which steps are skipped, what the
    windows hold, and how many steps in a row were above them (re-baselining)."""

    def __init__(self, bound, sigmas, window):
        self.bound, self.sigmas = bound, sigmas
        self.norms = collections.deque(maxlen=window)
        self.losses = collections.deque(maxlen=window)
        self.counts = {"nan": 0, "inf": 0, "spike": 0}
        self.rebaseline_after = max(1, window // 4)
        self.in_a_row = 0

    def _above(self, history, value) -> bool:
        if len(history) < history.maxlen:
            return False
        mean = np.mean(np.array(history, np.float64))
        std = np.std(np.array(history, np.float64))
        return value > mean + self.sigmas * std

    def step(self, kind: str, norm: float, loss: float | None) -> bool:
        if kind != "finite":
            self.counts[kind] += 1
            return False
        spike = self.bound is not None and norm > self.bound
        if self.sigmas is not None:
            tested = [(self.norms, norm)] + ([] if loss is None else [(self.losses, loss)])
            finite = all(math.isfinite(value) for _, value in tested)
            above = finite and any(self._above(history, value) for history, value in tested)
            spike |= not finite or (above and self.in_a_row < self.rebaseline_after)
            if finite:
                self.in_a_row = self.in_a_row + 1 if above else 0
        if spike:
            self.counts["spike"] += 1
            return False
        self.norms.append(norm)
        if loss is not None:
            self.losses.append(loss)
        return True


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.example(  # three spikes in a row against a window of 4: the third re-baselines it
    bound=None, sigmas=0.5, window=4, with_loss=False,
    steps=[("finite", 1.0, 1.0)] * 4 + [("finite", 16.0, 1.0)] * 3 + [("finite", 2.0, 1.0)],
)  # fmt: skip
@hypothesis.given(
    bound=st.none() | st.sampled_from([3.0, 8.0]),
    sigmas=st.none() | st.sampled_from([0.5, 1.0, 2.0]),
    window=st.integers(2, 8),
    with_loss=st.booleans(),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["finite"] * 4 + ["nan", "inf"]),
            st.sampled_from([1.0, 2.0, 3.0, 4.0, 16.0]),
            st.sampled_from([1.0, 2.0, 5.0, 30.0, math.nan]),
        ),
        min_size=1,
        max_size=20,
    ),
)
def test_the_wrapper_follows_the_model(bound, sigmas, window, with_loss, steps):
    if bound is None and sigmas is None:
        bound = 1e30
    tx = jls.loss_scaled(
        optax.sgd(1.0), jls.DynamicLossScale(2.0**4, increment_period=2),
        skip_grad_norm_above=bound, skip_spike_sigmas=sigmas, spike_window=window,
    )  # fmt: skip
    model = SpikeModel(bound, sigmas, window)
    params = {"w": jnp.zeros(2), "b": jnp.zeros(1)}
    opt_state = tx.init(params)
    update = _jitted_update(tx)
    finite_steps = 0
    for kind, norm, loss in steps:
        scale = float(jls.get_loss_scale(opt_state))
        first = {"finite": norm, "nan": math.nan, "inf": math.inf}[kind]
        grads = {"w": jnp.array([first * scale, 0.0]), "b": jnp.zeros(1)}
        loss = loss if with_loss else None
        opt_state = update(grads, opt_state, params, loss)
        applied = model.step(kind, norm, loss)
        finite_steps += kind == "finite"
        stats = jls.get_loss_scale_stats(opt_state)
        assert bool(stats.last_step_applied) == applied
        counts = (stats.nan_skipped_steps, stats.inf_skipped_steps, stats.spike_skipped_steps)
        assert tuple(map(int, counts)) == tuple(model.counts.values())
        if kind == "finite":
            assert float(stats.grad_norm) == norm
        if sigmas is not None:
            assert _window_in_order(opt_state.spike_windows.recent_grad_norms) == list(model.norms)
            assert _window_in_order(opt_state.spike_windows.recent_losses) == list(model.losses)
            assert int(opt_state.spike_windows.spikes_in_a_row) == model.in_a_row
    # The loss scale counts spikes as finite steps: it grew every second finite step.
    kinds = [kind == "finite" for kind, _, _ in steps]
    assert float(jls.get_loss_scale(opt_state)) == ReferenceLossScale(2.0**4, 2).scales(kinds)[-1]


def _jitted_update(tx):
    def update(grads, opt_state, params, loss):
        extra = {} if loss is None else {"value": loss}
        return tx.update(grads, opt_state, params, **extra)[1]

    return jax.jit(update)


# --- 5. bad arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"skip_grad_norm_above": 0.0},
            ValueError,
            "loss_scaled(skip_grad_norm_above=0.0): skip_grad_norm_above must be None or a "
            "positive finite number",
        ),
        (
            {"skip_grad_norm_above": -1},
            ValueError,
            "loss_scaled(skip_grad_norm_above=-1): skip_grad_norm_above must be None or a "
            "positive finite number",
        ),
        (
            {"skip_grad_norm_above": math.inf},
            ValueError,
            "loss_scaled(skip_grad_norm_above=inf): skip_grad_norm_above must be finite",
        ),
        (
            {"skip_grad_norm_above": "1.0"},
            TypeError,
            "loss_scaled(skip_grad_norm_above='1.0'): skip_grad_norm_above must be a real number",
        ),
        (
            {"skip_spike_sigmas": math.nan},
            ValueError,
            "loss_scaled(skip_spike_sigmas=nan): skip_spike_sigmas must be finite",
        ),
        (
            {"skip_spike_sigmas": True},
            TypeError,
            "loss_scaled(skip_spike_sigmas=True): skip_spike_sigmas must be a real number",
        ),
        (
            {"skip_spike_sigmas": -3.0},
            ValueError,
            "loss_scaled(skip_spike_sigmas=-3.0): skip_spike_sigmas must be None or a positive "
            "finite number",
        ),
        (
            {"spike_window": 1},
            ValueError,
            "loss_scaled(spike_window=1): spike_window must be an integer >= 2 and <= 2147483647",
        ),
        (
            {"spike_window": 8.0},
            TypeError,
            "loss_scaled(spike_window=8.0): spike_window must be an integer >= 2",
        ),
        (
            {"spike_window": None},
            TypeError,
            "loss_scaled(spike_window=None): spike_window must be an integer >= 2",
        ),
    ],
)
def test_bad_spike_arguments_are_refused_naming_them(kwargs, error, message):
    with pytest.raises(error, match=exact(message)):
        jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(), **kwargs)


@pytest.mark.parametrize(
    "value",
    [device_array([1.0, 1.0]), "1.0", True, jnp.array(1 + 2j), device_array(True, np.bool_), [1.0]],
    ids=["vector", "str", "bool", "complex", "bool_array", "list"],
)
def test_a_value_that_is_not_a_real_scalar_is_refused(value):
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(), skip_spike_sigmas=3.0)
    params = {"w": jnp.ones(2)}
    with pytest.raises(TypeError, match=r"^loss_scaled\.update: value must be the step's loss"):
        tx.update(params, tx.init(params), params, value=value)


def test_a_state_without_windows_or_with_other_windows_is_refused():
    params = {"w": jnp.ones(2)}
    plain = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale())
    spiky = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(), skip_spike_sigmas=3.0)
    with pytest.raises(
        TypeError,
        match=exact(
            "loss_scaled.update: state.spike_windows must be the SpikeWindows that init() makes "
            "when skip_spike_sigmas is set, got None"
        ),
    ):
        spiky.update(params, plain.init(params), params)
    with pytest.raises(
        TypeError,
        match=exact(
            "loss_scaled.update: state.spike_windows holds spike windows, but this loss_scaled "
            "has skip_spike_sigmas=None; pass the state returned by this transformation's init()"
        ),
    ):
        plain.update(params, spiky.init(params), params)
    short = jls.loss_scaled(
        optax.sgd(0.1), jls.DynamicLossScale(), skip_spike_sigmas=3.0, spike_window=16
    )
    with pytest.raises(
        ValueError,
        match=exact(
            "loss_scaled.update: state.spike_windows.recent_grad_norms.values has shape (16,), "
            "but this loss_scaled has spike_window=128; pass the state returned by this "
            "transformation's init()"
        ),
    ):
        spiky.update(params, short.init(params), params)


# --- 6. in the train steps users write ------------------------------------------------------


def test_a_donated_nnx_step_with_bfloat16_params_skips_a_spike_and_keeps_every_bit():
    from flax import nnx

    class Model(nnx.Module):  # bfloat16 params, float32 gradients of a float32 loss
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 1, param_dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, x):
            return self.dense(x).astype(jnp.float32)

    model = Model(nnx.Rngs(0))
    tx = jls.loss_scaled(
        optax.adam(1e-2), jls.FixedLossScale(1.0), skip_grad_norm_above=50.0,
        skip_spike_sigmas=3.0, spike_window=2,
    )  # fmt: skip
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads, value=loss)
        return loss

    x = jnp.ones((8, 4))
    for target in (1.0, 1.1, 1.0):
        train_step(model, optimizer, x, jnp.full((8, 1), target))
    before = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    train_step(model, optimizer, x, jnp.full((8, 1), 1000.0))  # a corrupt batch
    stats = jls.get_loss_scale_stats(optimizer)
    assert (int(stats.spike_skipped_steps), bool(stats.last_step_applied)) == (1, False)
    assert float(stats.grad_norm) > 50.0
    after = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    assert model.dense.kernel.dtype == jnp.bfloat16
    # Params and adam's state keep every bit; the counters (the spike windows' count of
    # spikes in a row too) and nnx's call count move.
    flat_before = dict(jax.tree_util.tree_leaves_with_path(before))
    flat_after = dict(jax.tree_util.tree_leaves_with_path(after))
    compared = []
    for path, old in flat_before.items():
        name = jax.tree_util.keystr(path)
        moving = ("stats", "['step']", "loss_scale_state", "spikes_in_a_row")
        if any(part in name for part in moving):
            continue
        assert old.tobytes() == flat_after[path].tobytes(), name
        compared.append(name)
    assert sum("kernel" in name for name in compared) == 3  # the param, adam's mu and nu
    assert any("count" in name for name in compared)


def test_a_donated_equinox_step_reports_the_norm_of_the_true_gradients():
    import equinox as eqx

    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(2.0**8), skip_spike_sigmas=3.0)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    x = jnp.array([1.0, -2.0, 0.5])

    def loss_fn(model):
        return jnp.sum(model(x) ** 2)

    @eqx.filter_jit(donate="all")
    def train_step(model, opt_state):
        scale = jls.get_loss_scale(opt_state)
        grads = eqx.filter_grad(lambda m: loss_fn(m) * scale)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state

    true_grads = eqx.filter_grad(loss_fn)(model)
    expected = norm64(eqx.filter(true_grads, eqx.is_inexact_array))
    model, opt_state = train_step(model, opt_state)
    np.testing.assert_allclose(jls.get_loss_scale_stats(opt_state).grad_norm, expected, rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    "options",
    [{"skip_grad_norm_above": 10.0}, {"skip_spike_sigmas": 4.0, "spike_window": 2}],
    ids=["bound", "window"],
)
def test_spike_options_skip_non_finite_steps_under_a_fixed_loss_scale(options, bad, jit):
    tx = jls.loss_scaled(optax.adam(0.1), jls.FixedLossScale(1.0), **options)
    update = jax.jit(tx.update) if jit else tx.update
    params = {"w": jnp.array([1.0, 2.0])}
    updates, opt_state = update({"w": jnp.array([0.5, 0.5])}, tx.init(params), params)
    params = optax.apply_updates(params, updates)
    before = jax.tree.map(np.array, (params, opt_state.inner_state))
    updates, opt_state = update({"w": jnp.array([bad, 0.5])}, opt_state, params)
    after = (optax.apply_updates(params, updates), opt_state.inner_state)
    assert_bits_equal(after, before)
    stats = jls.get_loss_scale_stats(opt_state)
    nan = bool(np.isnan(bad))
    assert (int(stats.nan_skipped_steps), int(stats.inf_skipped_steps)) == (nan, not nan)
    assert (int(stats.skipped_steps), int(stats.spike_skipped_steps)) == (1, 0)
    assert float(stats.loss_scale) == 1.0


def test_a_fixed_loss_scale_without_spike_options_applies_non_finite_steps():
    """TensorFlow's rule: a fixed scale cannot react, so the NaN reaches the params."""
    tx = jls.loss_scaled(optax.sgd(0.1), jls.FixedLossScale(1.0))
    params = {"w": jnp.array([1.0, 1.0])}
    updates, opt_state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, tx.init(params), params)
    np.testing.assert_array_equal(
        optax.apply_updates(params, updates)["w"], np.array([np.nan, 0.9], np.float32)
    )
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 0


def test_the_bfloat16_recipe_skips_a_nan_batch_in_a_donated_step():
    """A DynamicLossScale held at 1: no scaling, and a NaN batch leaves everything as it was."""
    loss_scale = jls.DynamicLossScale(
        initial_loss_scale=1.0, increment_period=2, max_loss_scale=1.0
    )
    tx = jls.loss_scaled(optax.adamw(1e-2), loss_scale)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum((x @ p["w"]).astype(jnp.float32) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = {"w": jnp.full((4, 2), 0.5, jnp.bfloat16)}
    opt_state = tx.init(params)
    scales = []
    for step in range(8):
        x = jnp.full((3, 4), jnp.nan if step == 5 else 1.0, jnp.bfloat16)
        if step == 5:
            before = jax.tree.map(np.array, (params, opt_state.inner_state))
        params, opt_state = train_step(params, opt_state, x)
        if step == 5:
            assert_bits_equal((params, opt_state.inner_state), before)
        scales.append(float(jls.get_loss_scale(opt_state)))
    assert scales == [1.0] * 8  # never grows past max_loss_scale, never backs off below 1
    stats = jls.get_loss_scale_stats(opt_state)
    assert (int(stats.skipped_steps), int(stats.nan_skipped_steps)) == (1, 1)
    assert params["w"].dtype == jnp.bfloat16


def test_a_scaled_loss_given_as_value_makes_the_growth_of_the_scale_a_spike():
    """Why `value=` must be the true loss: the scaled one jumps when the scale grows."""

    def skipped_steps(value_is_scaled):
        loss_scale = jls.DynamicLossScale(initial_loss_scale=8.0, increment_period=5)
        tx = jls.loss_scaled(optax.sgd(0.1), loss_scale, skip_spike_sigmas=3.0, spike_window=4)
        params = {"w": jnp.zeros(2)}
        opt_state = tx.init(params)
        skipped = []
        for step in range(8):
            scale = jls.get_loss_scale(opt_state)
            loss = jnp.float32(1.0)  # the same true loss every step
            value = loss * scale if value_is_scaled else loss
            _, opt_state = tx.update({"w": jnp.ones(2) * scale}, opt_state, params, value=value)
            if not jls.get_loss_scale_stats(opt_state).last_step_applied:
                skipped.append(step)
        return skipped

    # 16 > mean 8 + 3 * std 0; the window of 4 then re-baselines after one spike (step 6,
    # applied, enters it: [8, 8, 8, 16] has room for 16 at step 7).
    assert skipped_steps(value_is_scaled=True) == [5]
    assert skipped_steps(value_is_scaled=False) == []
