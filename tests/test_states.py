"""The state of `loss_scaled` (`jax_lossscale/_states.py`): its member types are public."""

import collections
import pickle

import chex
import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls


def test_the_state_s_member_types_are_exported_for_a_restore_template():
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(), skip_spike_sigmas=3.0)
    state = tx.init({"w": jnp.zeros(2)})
    assert type(state) is jls.LossScaledState
    assert type(state.loss_scale_state) is jls.DynamicLossScaleState
    assert type(state.stats) is jls.StepStats
    assert type(state.spike_windows) is jls.SpikeWindows
    assert type(state.spike_windows.recent_grad_norms) is jls.RecentValues
    assert jls.LossScaleStats._fields == ("loss_scale", *jls.StepStats._fields)


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


class _LoggedAdjust(jls.FixedLossScale):
    """A subclass that overrides `adjust` (to count its calls, and to skip every step)."""

    def adjust(self, state, grads_finite):
        _CALLS["adjust"] += 1
        new_state, _ = super().adjust(state, grads_finite)
        return new_state, jnp.array(False)


_CALLS = collections.Counter()


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
