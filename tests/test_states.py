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
        ("adam", jls.DynamicLossScale(), {"check_array_leaves": 1, "check_loss_scale_state": 1}),
        ("adam", jls.FixedLossScale(8.0), {"check_array_leaves": 1, "check_loss_scale_state": 1}),
        ("sgd", jls.DynamicLossScale(), {"check_array_leaves": 1, "check_loss_scale_state": 1}),
        ("sgd", jls.FixedLossScale(8.0), {"check_array_leaves": 1, "check_loss_scale_state": 1}),
    ],
    ids=["adam-dynamic", "adam-fixed", "sgd-dynamic", "sgd-fixed"],
)
def test_one_traced_update_runs_each_check_this_many_times(
    monkeypatch, optimizer, loss_scale, expected
):
    """On both paths, the `cond` one (adam) and the select one (sgd), the wrapper checks the
    gradients' leaves once and the loss-scale state once (through `__call__`); the built-in
    loss scales' private cores (`_unscale_checked`, `_update_checked`, `_adjust_checked`)
    take the checked values without checking them again."""
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


class _LoggedUnscale(jls.DynamicLossScale):
    """A subclass that overrides `unscale` (to count its calls, and to halve what it gives)."""

    def unscale(self, state, grads=None):
        _CALLS["unscale"] += 1
        return jax.tree.map(lambda g: g / 2, super().unscale(state, grads))


class _LoggedAdjust(jls.FixedLossScale):
    """A subclass that overrides `adjust` (to count its calls, and to skip every step)."""

    def adjust(self, state, grads_finite):
        _CALLS["adjust"] += 1
        new_state, _ = super().adjust(state, grads_finite)
        return new_state, jnp.array(False)


_CALLS = collections.Counter()


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_loss_scaled_calls_a_subclass_s_own_unscale(optimizer):
    """The wrapper unscales (for the inner update, and for `update` on the `cond` path)
    through the subclass's `unscale`, not the base class's core: its halving shows."""
    _CALLS.clear()
    tx = jls.loss_scaled(getattr(optax, optimizer)(1.0), _LoggedUnscale(initial_loss_scale=4.0))
    params = {"w": jnp.zeros(2)}
    updates, _ = tx.update({"w": jnp.array([8.0, -4.0])}, tx.init(params), params)
    if optimizer == "sgd":
        chex.assert_trees_all_equal(updates, {"w": jnp.array([-1.0, 0.5])})
        assert _CALLS["unscale"] == 1  # the applied step's; the check reads the scaled ones
    else:
        assert _CALLS["unscale"] == 2  # the one `update` is given, and the applied step's
        chex.assert_trees_all_close(updates, {"w": jnp.array([-1.0, 1.0])}, atol=1e-4)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_loss_scaled_calls_a_subclass_s_own_adjust(optimizer):
    """A subclass of a built-in loss scale that overrides `adjust` has it called: here it
    skips every step, so the updates are negative zeros and one step counts as skipped."""
    _CALLS.clear()
    tx = jls.loss_scaled(getattr(optax, optimizer)(1.0), _LoggedAdjust(8.0))
    params = {"w": jnp.zeros(2)}
    updates, state = tx.update({"w": jnp.array([8.0, -4.0])}, tx.init(params), params)
    assert _CALLS["adjust"] == 1
    chex.assert_trees_all_equal(updates, {"w": jnp.array([-0.0, -0.0])})
    assert int(jls.get_loss_scale_stats(state).skipped_steps) == 1
