"""The state of `loss_scaled` (`jax_lossscale/_states.py`): its member types are public, and
the wrapper checks its arguments once, at its edge."""

import collections
import pickle

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale import _checks


def test_the_state_s_member_types_are_exported_for_a_restore_template():
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(), skip_spike_sigmas=3.0)
    state = tx.init({"w": jnp.zeros(2)})
    assert type(state) is jls.LossScaledState
    assert type(state.loss_scale_state) is jls.DynamicLossScaleState
    assert type(state.stats) is jls.StepStats
    assert type(state.spike_windows) is jls.SpikeWindows
    assert type(state.spike_windows.recent_grad_norms) is jls.RecentValues
    assert jls.LossScaleStats._fields == ("loss_scale", *jls.StepStats._fields)


CHECKS = ("check_array_leaves", "check_loss_scale_state")


@pytest.mark.parametrize(
    ("optimizer", "loss_scale", "expected"),
    [
        ("adam", jls.DynamicLossScale(), {"check_array_leaves": 4, "check_loss_scale_state": 3}),
        ("adam", jls.FixedLossScale(8.0), {"check_array_leaves": 4, "check_loss_scale_state": 3}),
        ("sgd", jls.DynamicLossScale(), {"check_array_leaves": 2, "check_loss_scale_state": 3}),
        ("sgd", jls.FixedLossScale(8.0), {"check_array_leaves": 2, "check_loss_scale_state": 3}),
    ],
    ids=["adam-dynamic", "adam-fixed", "sgd-dynamic", "sgd-fixed"],
)
def test_one_traced_update_runs_each_check_this_many_times(
    monkeypatch, optimizer, loss_scale, expected
):
    """On the `cond` path (adam) the leaves are checked by the wrapper, by `unscale`, by the
    base class's `update` and by the applied branch's `unscale`; the loss-scale state by
    `unscale` (through `__call__`), by `adjust` and by the applied branch's `unscale`. On the
    select path (sgd) the wrapper's check and the applied branch's `unscale` read the leaves,
    and the state is read by `__call__`, `adjust` and the branch's `unscale`."""
    counts = collections.Counter()
    modules = [m for n, m in __import__("sys").modules.items() if n.startswith("jax_lossscale")]
    for name in CHECKS:
        original = getattr(_checks, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        for module in modules:
            if getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)
    tx = jls.loss_scaled(getattr(optax, optimizer)(1e-3), loss_scale)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    counts.clear()
    jax.jit(tx.update).lower(params, state, params)
    assert dict(counts) == expected


def test_the_logged_stats_are_the_scale_in_front_of_the_step_stats_and_pickle():
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(initial_loss_scale=8.0))
    params = {"w": jnp.ones(2)}
    _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, tx.init(params), params)
    stats = jls.get_loss_scale_stats(state)
    assert type(stats) is jls.LossScaleStats
    assert tuple(stats) == (stats.loss_scale, *state.stats)
    assert float(stats.loss_scale) == 4.0
    assert (int(stats.skipped_steps), int(stats.nan_skipped_steps)) == (1, 1)
    restored = pickle.loads(pickle.dumps(stats))
    assert type(restored) is jls.LossScaleStats
    chex.assert_trees_all_equal(restored, stats)
