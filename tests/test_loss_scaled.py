"""The optax wrapper `loss_scaled`, `get_loss_scale` and `get_loss_scale_stats`
(docs/optax-wrapper.md)."""

import dataclasses
import re
from pathlib import Path
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_lossscale as jls
from jax_lossscale._numerics import summarize_gradients

from helpers import assert_bits_equal, device_array, stats_tuple

NONFINITE = [jnp.nan, jnp.inf, -jnp.inf]
HALF_DTYPES = [jnp.float16, jnp.bfloat16]


# The tests' inputs are made by NumPy and copied to the device: no op is compiled for them.
def scaled(grads, scale):
    """`grads` times `scale` (a power of two: exact), as jax arrays."""
    return jax.tree.map(lambda g: jnp.asarray(np.asarray(g) * np.asarray(scale, g.dtype)), grads)


def with_bad_value(grads, bad):
    w = np.array(grads["w"])
    w[1] = bad
    return {**grads, "w": jnp.asarray(w)}


def exact(message: str) -> str:
    """A regex for exactly `message`; under jit JAX may add a note after a newline."""
    return "^" + re.escape(message) + r"(?:$|\n)"


def is_jit(request) -> bool:
    return request.node.callspec.params["jit_or_eager"] == "jit"


# --- 1. data flow ---------------------------------------------------------------------------


def test_finite_steps_equal_inner_on_true_grads_and_scale_trajectory(jit_or_eager, request):
    inner = optax.adam(0.1)
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(initial_loss_scale=4.0, increment_period=2))
    params = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array(0.25)}
    true_grads = {"w": jnp.array([0.1, -2.5, 3e-3]), "b": jnp.array(-7.0)}
    opt_state = tx.init(params)
    ref_state = inner.init(params)
    chex.assert_trees_all_equal(opt_state.inner_state, ref_state)
    assert stats_tuple(opt_state) == (4.0, 0, True)

    steps = "TTFTTTTFF"
    expected_scales = [4.0, 8.0, 4.0, 4.0, 8.0, 8.0, 16.0, 8.0, 4.0]
    expected_skipped = [0, 0, 1, 1, 1, 1, 1, 2, 3]
    bad_values = iter(NONFINITE)
    for index, flag in enumerate(steps):
        scale = jls.get_loss_scale(opt_state)
        grads = scaled(true_grads, scale)
        if flag == "F":
            grads = with_bad_value(grads, next(bad_values))
        before = opt_state
        updates, opt_state = jit_or_eager(tx.update, grads, opt_state, params)
        if flag == "T":
            ref_updates, ref_state = jit_or_eager(inner.update, true_grads, ref_state, params)
            if is_jit(request):
                # Two programs: XLA fuses the unscaling into adam's loops and may contract
                # multiply-adds differently, so the last bit may differ.
                chex.assert_trees_all_close(updates, ref_updates, rtol=2.5e-7, atol=0)
                chex.assert_trees_all_close(opt_state.inner_state, ref_state, rtol=2.5e-7, atol=0)
                ref_state = opt_state.inner_state  # compare the next step from the same state
            else:
                assert_bits_equal(updates, ref_updates)
                assert_bits_equal(opt_state.inner_state, ref_state)
            params = optax.apply_updates(params, updates)
        else:
            assert_bits_equal(opt_state.inner_state, before.inner_state)
            assert_bits_equal(optax.apply_updates(params, updates), params)
        assert stats_tuple(opt_state) == (
            expected_scales[index],
            expected_skipped[index],
            flag == "T",
        ), index
        # One source of truth: the scale read is the one the loss scale's state holds.
        assert jls.get_loss_scale(opt_state) is opt_state.loss_scale_state.loss_scale
    # Six finite steps reached the inner optimizer, three were skipped.
    assert int(opt_state.inner_state[0].count) == 6


def test_fixed_loss_scale_never_skips(jit_or_eager):
    tx = jls.loss_scaled(optax.sgd(1.0), jls.FixedLossScale(8.0))
    params = {"w": jnp.array([1.0, 2.0, 3.0])}
    opt_state = tx.init(params)
    grads = {"w": jnp.array([8.0, 16.0, 4.0])}
    updates, opt_state = jit_or_eager(tx.update, grads, opt_state, params)
    chex.assert_trees_all_equal(updates, {"w": jnp.array([-1.0, -2.0, -0.5])})
    assert stats_tuple(opt_state) == (8.0, 0, True)
    for bad in NONFINITE:
        bad_grads = {"w": jnp.array([8.0, bad, 4.0])}
        updates, opt_state = jit_or_eager(tx.update, bad_grads, opt_state, params)
        # The non-finite gradient reaches sgd: the update is -bad, not a skip.
        chex.assert_trees_all_equal(updates, {"w": jnp.array([-1.0, -bad, -0.5])})
        assert stats_tuple(opt_state) == (8.0, 0, True)


def test_a_scale_below_one_unscales_float16_to_a_finite_float32(jit_or_eager):
    """At a scale of 0.5, a float16 gradient of 40000 is 80000 unscaled: beyond float16,
    but it comes back float32, finite, and the step is applied."""
    tx = jls.loss_scaled(
        optax.sgd(1.0), jls.DynamicLossScale(initial_loss_scale=0.5, min_loss_scale=0.25)
    )
    params = {"w": jnp.array([1.0, 2.0], jnp.float32)}
    opt_state = tx.init(params)
    grads = {"w": jnp.array([40000.0, 1.0], jnp.float16)}
    updates, opt_state = jit_or_eager(tx.update, grads, opt_state, params)
    assert_bits_equal(updates, {"w": jnp.array([-80000.0, -2.0], jnp.float32)})
    stats = jls.get_loss_scale_stats(opt_state)
    assert (float(stats.loss_scale), int(stats.skipped_steps)) == (0.5, 0)
    assert stats.grad_norm == np.float32(np.hypot(80000.0, 2.0))


ONE_PASS_INNERS = {
    "sgd": lambda: optax.sgd(1e-3),
    "momentum": lambda: optax.sgd(1e-3, momentum=0.9),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "MultiSteps(sgd)": lambda: optax.MultiSteps(optax.sgd(1e-3), 2),
    "adam": lambda: optax.adam(1e-3),
}


@pytest.mark.parametrize("make_inner", ONE_PASS_INNERS.values(), ids=ONE_PASS_INNERS.keys())
def test_grad_norm_does_not_overflow_at_a_scale_of_2_pow_70(jit_or_eager, make_inner):
    """A true norm of 1.0 at a scale of 2**70: the scaled gradients' squares overflow
    float32 (2**140), the unscaled ones' do not. grad_norm is 1.0 for every optimizer,
    and with `skip_grad_norm_above=10` the step is applied, not taken for a spike."""
    tx = jls.loss_scaled(make_inner(), jls.DynamicLossScale(2.0**70), skip_grad_norm_above=10.0)
    params = {"w": jnp.asarray(np.zeros((2, 2), np.float32))}
    grads = {"w": jnp.asarray(np.array([[0.6, 0.0], [0.0, 0.8]], np.float32) * np.float32(2.0**70))}
    _, opt_state = jit_or_eager(tx.update, grads, tx.init(params), params)
    stats = jls.get_loss_scale_stats(opt_state)
    assert (float(stats.grad_norm), int(stats.skipped_steps)) == (1.0, 0)


def test_a_resumed_scale_below_one_checks_what_the_state_holds(jit_or_eager):
    """A state saved at a scale of 0.5 (`min_loss_scale=0.25`), resumed under the default
    `min_loss_scale=1`: the check follows the scale the state holds. A float32 gradient of
    3e38 is finite scaled and inf unscaled: the step is skipped, as under the settings it
    was saved with, and the params stay finite. A float16 gradient of 40000 is 80000
    unscaled, a finite float32: applied under both."""
    saved = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale(0.5, min_loss_scale=0.25))
    resumed = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale())
    params = {"w": jnp.array([1.0, 2.0])}
    opt_state = saved.init(params)
    outcomes = {}
    for dtype, big in [(jnp.float32, 3e38), (jnp.float16, 40000.0)]:
        grads = {"w": jnp.array([big, 1.0], dtype)}
        for name, tx in [("saved", saved), ("resumed", resumed)]:
            updates, new_state = jit_or_eager(tx.update, grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            stats = jls.get_loss_scale_stats(new_state)
            outcomes[jnp.dtype(dtype).name, name] = (
                new_params["w"].tolist(),
                int(stats.skipped_steps),
                float(stats.loss_scale),
            )
    assert outcomes == {
        ("float32", "saved"): ([1.0, 2.0], 1, 0.25),
        ("float32", "resumed"): ([1.0, 2.0], 1, 1.0),
        ("float16", "saved"): ([-79999.0, 0.0], 0, 0.5),
        ("float16", "resumed"): ([-79999.0, 0.0], 0, 1.0),
    }


@pytest.fixture
def debug_nans():
    jax.config.update("jax_debug_nans", True)
    try:
        yield
    finally:
        jax.config.update("jax_debug_nans", False)


def test_the_readme_quick_start_runs_under_jax_debug_nans(debug_nans):
    """`jax_debug_nans` raises where an op makes a NaN: an ordinary overflow (the quick
    start's first step, gradients holding -inf and no NaN) must not make one."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start = readme.index("<!-- --8<-- [start:quickstart] -->")
    code = readme[start:].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    opt_state = namespace["opt_state"]
    assert float(jls.get_loss_scale(opt_state)) == 16384.0
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 1


@pytest.mark.parametrize("make_inner", [optax.sgd, optax.adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("spikes", [False, True], ids=["no spike option", "spike option"])
def test_an_infinite_gradient_gives_an_infinite_norm_and_no_nan(
    jit_or_eager, debug_nans, make_inner, spikes
):
    """Under `jax_debug_nans`, a gradient holding +-inf (no NaN) is skipped as an inf step,
    its grad_norm +inf, not NaN, for the sgd-type pass and adam's."""
    options = {"skip_grad_norm_above": 1e6} if spikes else {}
    tx = jls.loss_scaled(make_inner(0.1), jls.DynamicLossScale(2.0**15), **options)
    params = {"w": jnp.ones(3), "b": jnp.ones((2, 2))}
    grads = {"w": jnp.array([1.0, -jnp.inf, jnp.inf]), "b": jnp.ones((2, 2))}
    updates, opt_state = jit_or_eager(tx.update, grads, tx.init(params), params)
    stats = jls.get_loss_scale_stats(opt_state)
    assert float(stats.grad_norm) == np.inf
    assert (int(stats.inf_skipped_steps), int(stats.nan_skipped_steps)) == (1, 0)
    assert_bits_equal(optax.apply_updates(params, updates), params)


def _on_a_mesh(tree):
    """`tree` placed on the 8 devices, on a mesh axis that XLA may split it along."""
    mesh = Mesh(np.array(jax.devices()), ("d",))
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


@pytest.mark.parametrize("placement", ["one device", "a mesh of 8 devices"])
def test_grad_norm_of_the_scaled_check_is_the_unscaled_gradients_norm(jit_or_eager, placement):
    """The default DynamicLossScale and a FixedLossScale check the scaled gradients and
    divide their norm by the scale: bit for bit the norm of the unscaled gradients, as the
    same check takes it (`all_finite`'s reductions, which join small leaves on one device),
    and, where the leaves may be sharded and each is reduced apart, as optax takes it."""
    place = _on_a_mesh if placement == "a mesh of 8 devices" else (lambda tree: tree)
    host = {"w": np.array([0.1, -2.5, 3e-3], np.float32), "b": np.array([7.0, 1e-20], np.float32)}
    unscaled = place(jax.tree.map(jnp.asarray, host))
    params = place(jax.tree.map(lambda x: jnp.asarray(np.zeros_like(x)), host))
    expected = jit_or_eager(lambda g: summarize_gradients(g, None).norm, unscaled)
    for loss_scale in [jls.DynamicLossScale(2.0**15), jls.FixedLossScale(2.0**60)]:
        tx = jls.loss_scaled(optax.sgd(1.0), loss_scale)
        scale = float(loss_scale(loss_scale.init()))
        grads = place(scaled(host, scale))
        _, opt_state = jit_or_eager(tx.update, grads, tx.init(params), params)
        norm = jls.get_loss_scale_stats(opt_state).grad_norm
        assert norm == expected, loss_scale
        if placement == "a mesh of 8 devices":
            assert norm == optax.tree.norm(unscaled), loss_scale
        np.testing.assert_allclose(norm, optax.tree.norm(unscaled), rtol=2e-7)


# --- 2. skipped steps -----------------------------------------------------------------------


def array_of(dtype, real, imag):
    """`real + imag * 1j` for a complex dtype, else `real`, as a NumPy array; signed zeros and
    NaN kept."""
    if not jnp.issubdtype(dtype, jnp.complexfloating):
        return np.asarray(real, dtype)
    array = np.empty(np.shape(real), dtype)
    array.real, array.imag = real, imag
    return array


@pytest.mark.parametrize("dtype", [jnp.float32, *HALF_DTYPES, jnp.complex64])
def test_skipped_step_leaves_params_and_inner_state_bit_identical(jit_or_eager, dtype):
    inner = optax.adam(optax.linear_schedule(0.1, 0.0, transition_steps=10))
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(initial_loss_scale=64.0))
    special = [0.0, -0.0, jnp.nan, jnp.inf, -jnp.inf, 1.5, -2.0]
    # Complex parts pair each special value with another: (0, -2), (-0, 1.5), (nan, -inf)...
    params = {"w": array_of(dtype, special, special[::-1]), "b": array_of(dtype, -0.0, 0.0)}
    grads = {"w": array_of(dtype, [64.0] * 7, [-64.0] * 7), "b": array_of(dtype, -32.0, 16.0)}
    params, grads = jax.tree.map(jnp.asarray, (params, grads))  # the update gets jax arrays
    is_complex = jnp.issubdtype(dtype, jnp.complexfloating)
    _, opt_state = jit_or_eager(tx.update, grads, tx.init(params), params)
    assert int(opt_state.inner_state[0].count) == 1
    assert int(opt_state.inner_state[1].count) == 1

    expected_scale = 64.0
    for skipped, bad in enumerate(NONFINITE, start=1):
        # A complex gradient overflows in its imaginary part.
        bad_w = np.array(grads["w"])
        bad_w[3] = array_of(dtype, 64.0, bad) if is_complex else bad
        bad_grads = {"w": jnp.asarray(bad_w), "b": grads["b"]}
        updates, new_state = jit_or_eager(tx.update, bad_grads, opt_state, params)
        expected_scale /= 2
        assert stats_tuple(new_state) == (expected_scale, skipped, False)
        updates_dtype = jnp.float32 if dtype == jnp.float16 else dtype  # unscaled to float32
        negative_zero = {
            "w": array_of(updates_dtype, [-0.0] * 7, [-0.0] * 7),
            "b": array_of(updates_dtype, -0.0, -0.0),
        }
        assert_bits_equal(updates, negative_zero)
        assert_bits_equal(optax.apply_updates(params, updates), params)
        assert_bits_equal(new_state.inner_state, opt_state.inner_state)
        # The schedule's count stays at 1 after every skip.
        assert int(new_state.inner_state[1].count) == 1
        opt_state = new_state


@pytest.mark.parametrize("bad", NONFINITE, ids=["nan", "+inf", "-inf"])
def test_each_nonfinite_value_triggers_a_skip(jit_or_eager, bad):
    tx = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale(initial_loss_scale=16.0))
    params = {"a": np.ones(2, np.float32), "b": np.ones((2, 2), jnp.bfloat16)}
    grads = {"a": np.ones(2, np.float32), "b": np.ones((2, 2), jnp.bfloat16)}
    grads["b"][1, 0] = bad
    params, grads = jax.tree.map(jnp.asarray, (params, grads))  # made by NumPy: no op compiled
    updates, opt_state = jit_or_eager(tx.update, grads, tx.init(params), params)
    assert stats_tuple(opt_state) == (8.0, 1, False)
    assert_bits_equal(optax.apply_updates(params, updates), params)


def test_skipped_steps_saturates_at_int32_max(jit_or_eager):
    tx = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale(initial_loss_scale=16.0))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    int32_max = jnp.array(2**31 - 1, jnp.int32)
    state = state._replace(stats=state.stats._replace(skipped_steps=int32_max))
    _, skipped = jit_or_eager(tx.update, {"w": jnp.array([jnp.inf, 1.0])}, state, params)
    chex.assert_trees_all_equal(skipped.stats.skipped_steps, int32_max, strict=True)
    assert stats_tuple(skipped) == (8.0, 2**31 - 1, False)
    _, applied = jit_or_eager(tx.update, {"w": jnp.array([8.0, 8.0])}, skipped, params)
    chex.assert_trees_all_equal(applied.stats.skipped_steps, int32_max, strict=True)
    assert stats_tuple(applied) == (8.0, 2**31 - 1, True)


# --- 3. composition -------------------------------------------------------------------------


def test_inside_chain_first(jit_or_eager):
    ls = jls.DynamicLossScale(initial_loss_scale=8.0, increment_period=1)
    tx = optax.chain(jls.loss_scaled(optax.sgd(1.0), ls), optax.scale(0.5))
    params = {"w": jnp.array([1.0, -0.0])}
    opt_state = tx.init(params)
    assert jls.get_loss_scale(opt_state) == 8.0
    updates, opt_state = jit_or_eager(tx.update, {"w": jnp.array([8.0, 16.0])}, opt_state, params)
    chex.assert_trees_all_equal(updates, {"w": jnp.array([-0.5, -1.0])})
    assert stats_tuple(opt_state) == (16.0, 0, True)
    bad = {"w": jnp.array([jnp.nan, 16.0])}
    updates, opt_state = jit_or_eager(tx.update, bad, opt_state, params)
    assert_bits_equal(optax.apply_updates(params, updates), params)
    assert stats_tuple(opt_state) == (8.0, 1, False)
    assert stats_tuple(opt_state[0]) == (8.0, 1, False)


def test_inside_chain_last(jit_or_eager):
    ls = jls.DynamicLossScale(initial_loss_scale=4.0, increment_period=1)
    # A linear transformation before the wrapper commutes with the scale.
    tx = optax.chain(optax.scale(2.0), jls.loss_scaled(optax.sgd(0.5), ls))
    params = {"w": jnp.array([1.0, 2.0])}
    opt_state = tx.init(params)
    assert jls.get_loss_scale(opt_state) == 4.0
    updates, opt_state = jit_or_eager(tx.update, {"w": jnp.array([4.0, -12.0])}, opt_state, params)
    chex.assert_trees_all_equal(updates, {"w": jnp.array([-1.0, 3.0])})
    assert stats_tuple(opt_state) == (8.0, 0, True)
    updates, opt_state = jit_or_eager(
        tx.update, {"w": jnp.array([jnp.inf, 1.0])}, opt_state, params
    )
    assert_bits_equal(optax.apply_updates(params, updates), params)
    assert stats_tuple(opt_state) == (4.0, 1, False)
    assert stats_tuple(opt_state[1]) == (4.0, 1, False)


def set_lr(opt_state, lr):
    """`opt_state` of `optax.inject_hyperparams` with its learning rate set to `lr`."""
    hyperparams = {**opt_state.hyperparams, "learning_rate": jnp.asarray(lr, jnp.float32)}
    return opt_state._replace(hyperparams=hyperparams)


def set_wrapped_lr(opt_state, lr):
    """`set_lr` on the inner state of `loss_scaled(optax.inject_hyperparams(...), ls)`."""
    return opt_state._replace(inner_state=set_lr(opt_state.inner_state, lr))


def run_with_learning_rates(tx, set_lr, params, grads, scale, learning_rates, call):
    """Runs `tx` over `grads * scale`, setting the injected learning rate before each step."""
    opt_state = tx.init(params)
    all_updates = []
    for lr in learning_rates:
        opt_state = set_lr(opt_state, lr)
        updates, opt_state = call(tx.update, scaled(grads, scale), opt_state, params)
        all_updates.append(updates)
    return all_updates, opt_state


def test_built_inside_inject_hyperparams(jit_or_eager):
    ls = jls.FixedLossScale(16.0)
    tx = optax.inject_hyperparams(
        lambda learning_rate: jls.loss_scaled(optax.adam(learning_rate), ls)
    )(learning_rate=0.1)
    # The same injection without the wrapper (b1, b2 and eps stay Python floats, as above).
    reference = optax.inject_hyperparams(lambda learning_rate: optax.adam(learning_rate))(
        learning_rate=0.1
    )
    params = {"w": jnp.array([1.0, 2.0])}
    grads = {"w": jnp.array([0.5, -0.25])}
    learning_rates = [0.1, 0.01, 0.001]
    updates, opt_state = run_with_learning_rates(
        tx, set_lr, params, grads, 16.0, learning_rates, jit_or_eager
    )
    ref_updates, ref_state = run_with_learning_rates(
        reference, set_lr, params, grads, 1.0, learning_rates, jit_or_eager
    )
    assert_bits_equal(updates, ref_updates)
    assert_bits_equal(opt_state.inner_state.inner_state, ref_state.inner_state)
    assert jls.get_loss_scale(opt_state) == 16.0
    # Adam's steps with a constant gradient are -lr * sign(grad), up to rounding in the
    # float32 bias correction 1 - 0.999**t.
    for update, lr in zip(updates, learning_rates, strict=True):
        chex.assert_trees_all_close(update, {"w": jnp.array([-lr, lr])}, rtol=1e-4)


def test_wrapping_inject_hyperparams(jit_or_eager):
    tx = jls.loss_scaled(
        optax.inject_hyperparams(optax.adam)(learning_rate=0.1), jls.FixedLossScale(16.0)
    )
    reference = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    params = {"w": jnp.array([1.0, 2.0])}
    grads = {"w": jnp.array([0.5, -0.25])}
    learning_rates = [0.1, 0.01, 0.001]
    updates, opt_state = run_with_learning_rates(
        tx, set_wrapped_lr, params, grads, 16.0, learning_rates, jit_or_eager
    )
    ref_updates, ref_state = run_with_learning_rates(
        reference, set_lr, params, grads, 1.0, learning_rates, jit_or_eager
    )
    assert_bits_equal(updates, ref_updates)
    assert_bits_equal(opt_state.inner_state, ref_state)
    for update, lr in zip(updates, learning_rates, strict=True):
        chex.assert_trees_all_close(update, {"w": jnp.array([-lr, lr])}, rtol=1e-5)
    # A skip leaves the injected hyperparameters and the inner count alone.
    tx_dynamic = jls.loss_scaled(
        optax.inject_hyperparams(optax.adam)(learning_rate=0.1), jls.DynamicLossScale(16.0)
    )
    state = tx_dynamic.init(params)
    state = set_wrapped_lr(state, 0.02)
    _, skipped_state = jit_or_eager(
        tx_dynamic.update, {"w": jnp.array([jnp.nan, 1.0])}, state, params
    )
    assert_bits_equal(skipped_state.inner_state, state.inner_state)
    assert float(skipped_state.inner_state.hyperparams["learning_rate"]) == np.float32(0.02)


def test_gradient_clipping_inside_sees_true_gradients(jit_or_eager):
    ls = jls.FixedLossScale(8.0)
    clip_then_sgd = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    params = {"w": jnp.array([1.0, 1.0])}
    for true_grads, expected in [
        ({"w": jnp.array([0.3, 0.4])}, [-0.3, -0.4]),  # norm 0.5: not clipped
        ({"w": jnp.array([3.0, 4.0])}, [-0.6, -0.8]),  # norm 5: clipped to norm 1
    ]:
        tx = jls.loss_scaled(clip_then_sgd, ls)
        updates, _ = jit_or_eager(tx.update, scaled(true_grads, 8.0), tx.init(params), params)
        ref_updates, _ = jit_or_eager(
            clip_then_sgd.update, true_grads, clip_then_sgd.init(params), params
        )
        assert_bits_equal(updates, ref_updates)
        chex.assert_trees_all_close(updates, {"w": jnp.array(expected)}, rtol=1e-6)

        # Clipping outside the wrapper clips the scaled gradients (norm 4 and 40): wrong.
        wrong = optax.chain(optax.clip_by_global_norm(1.0), jls.loss_scaled(optax.sgd(1.0), ls))
        wrong_updates, _ = jit_or_eager(
            wrong.update, scaled(true_grads, 8.0), wrong.init(params), params
        )
        chex.assert_trees_all_close(wrong_updates, {"w": jnp.array([-0.075, -0.1])}, rtol=1e-6)


def test_gradient_accumulation_drops_overflowing_microbatch(jit_or_eager):
    k = 3
    ls = jls.DynamicLossScale(initial_loss_scale=8.0, increment_period=100)
    tx = jls.loss_scaled(optax.MultiSteps(optax.adam(0.1), k), ls)
    reference = optax.MultiSteps(optax.adam(0.1), k)
    params = {"w": jnp.array([1.0, -1.0, 0.5])}
    finite = [jnp.array([0.5, -0.25, 2.0]) * i for i in (1.0, 3.0, -2.0, 0.75, 1.5, -0.5)]
    # Microbatches: g0, overflow, g1, g2 | g3, g4, overflow, g5
    plan = [0, None, 1, 2, 3, 4, None, 5]
    expected_scales = [8.0, 4.0, 4.0, 4.0, 4.0, 4.0, 2.0, 2.0]
    opt_state = tx.init(params)
    ref_params, ref_state = params, reference.init(params)
    for index, microbatch in enumerate(plan):
        scale = jls.get_loss_scale(opt_state)
        if microbatch is None:
            grads = {"w": jnp.array([1.0, jnp.inf, 1.0])}
        else:
            grads = {"w": finite[microbatch] * scale}
        before, params_before = opt_state, params
        updates, opt_state = jit_or_eager(tx.update, grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if microbatch is None:
            # Accumulator, mini_step and gradient_step untouched; the scale backs off at once.
            assert_bits_equal(opt_state.inner_state, before.inner_state)
            assert_bits_equal(params, params_before)
        else:
            ref_updates, ref_state = jit_or_eager(
                reference.update, {"w": finite[microbatch]}, ref_state, ref_params
            )
            ref_params = optax.apply_updates(ref_params, ref_updates)
            assert_bits_equal(updates, ref_updates)
            assert_bits_equal(opt_state.inner_state, ref_state)
        assert float(jls.get_loss_scale(opt_state)) == expected_scales[index], index
    assert_bits_equal(params, ref_params)
    assert int(opt_state.inner_state.gradient_step) == 2
    assert int(opt_state.inner_state.mini_step) == 0
    assert stats_tuple(opt_state) == (2.0, 2, True)
    # Both windows applied an update.
    assert not np.array_equal(np.asarray(params["w"]), np.array([1.0, -1.0, 0.5], np.float32))


def test_multisteps_outside_the_wrapper_is_a_trap(jit_or_eager):
    k = 2
    ls = jls.DynamicLossScale(initial_loss_scale=8.0, increment_period=100)
    tx = optax.MultiSteps(jls.loss_scaled(optax.sgd(1.0), ls), k)
    params = {"w": jnp.array([1.0, -1.0])}
    opt_state = tx.init(params)
    assert jls.get_loss_scale(opt_state) == 8.0

    def step(grads, opt_state, params):
        return tx.update(grads, opt_state, params)

    initial_params = params
    # Window 0: one overflowing microbatch, then a finite one; then only finite microbatches.
    windows = [[jnp.inf, 1.0]] + [[1.0, 1.0]] * 4
    expected_scales = [4.0, 2.0, 1.0, 1.0, 1.0]
    for window, values in enumerate(windows):
        for value in values:
            grads = {"w": jnp.array([value, 0.5]) * jls.get_loss_scale(opt_state)}
            updates, opt_state = jit_or_eager(step, grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        assert_bits_equal(params, initial_params)
        # The reset multiplies the accumulator by zero: 0 * inf is NaN, and NaN stays.
        assert np.isnan(np.asarray(opt_state.acc_grads["w"])[0])
        assert stats_tuple(opt_state) == (expected_scales[window], window + 1, False)


def test_multisteps_around_apply_if_finite_has_the_same_fault(jit_or_eager):
    inner = optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=100)
    tx = optax.MultiSteps(inner, 2)
    params = {"w": jnp.array([1.0, -1.0])}
    opt_state = tx.init(params)
    initial_params = params
    windows = [[jnp.inf, 1.0]] + [[1.0, 1.0]] * 3
    for window, values in enumerate(windows, start=1):
        for value in values:
            grads = {"w": jnp.array([value, 0.5])}
            updates, opt_state = jit_or_eager(tx.update, grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        assert_bits_equal(params, initial_params)
        assert np.isnan(np.asarray(opt_state.acc_grads["w"])[0])
        # Every window is refused, not only the one with the overflow.
        assert int(opt_state.inner_opt_state.total_notfinite) == window
        assert int(opt_state.inner_opt_state.notfinite_count) == window


@pytest.mark.parametrize("place", ["outside", "inside"])
def test_schedule_outside_the_wrapper_counts_skipped_steps(jit_or_eager, place):
    ls = jls.DynamicLossScale(initial_loss_scale=4.0, increment_period=100)
    schedule = optax.piecewise_constant_schedule(1.0, {1: 0.5, 2: 0.5})  # 1, 0.5, 0.25, ...
    if place == "outside":
        tx = optax.inject_hyperparams(
            lambda learning_rate: jls.loss_scaled(optax.sgd(learning_rate), ls)
        )(learning_rate=schedule)
    else:
        tx = jls.loss_scaled(optax.sgd(schedule), ls)
    params = {"w": jnp.array([1.0, 2.0])}
    opt_state = tx.init(params)
    true_grads = {"w": jnp.array([1.0, -2.0])}
    all_updates = []
    for bad in [False, True, False]:
        grads = scaled(true_grads, jls.get_loss_scale(opt_state))
        if bad:
            grads = with_bad_value(grads, jnp.nan)
        updates, opt_state = jit_or_eager(tx.update, grads, opt_state, params)
        all_updates.append(updates)
    assert stats_tuple(opt_state) == (2.0, 1, True)
    assert_bits_equal(all_updates[0], {"w": jnp.array([-1.0, 2.0])})
    assert_bits_equal(all_updates[1], {"w": jnp.array([-0.0, -0.0])})
    if place == "outside":
        # The third step reads the schedule at count 2: the skipped step was counted.
        assert int(opt_state.count) == 3
        assert_bits_equal(all_updates[2], {"w": jnp.array([-0.25, 0.5])})
    else:
        assert int(opt_state.inner_state[-1].count) == 2
        assert_bits_equal(all_updates[2], {"w": jnp.array([-0.5, 1.0])})


# --- 4. dtypes ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("make_inner", [optax.sgd, optax.adam], ids=["sgd", "adam"])
def test_half_precision_dtypes(jit_or_eager, dtype, make_inner):
    """bfloat16 gradients reach the inner optimizer as bfloat16; float16 ones as float32
    (float16 holds a scaled gradient but not always the unscaled one), so that its
    updates and any state it computes from them are float32, as bare optax makes them
    from float32 gradients."""
    inner = make_inner(0.125)
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(initial_loss_scale=256.0))
    # Inputs made by NumPy (exact: powers of two) and copied to the device: no op compiled.
    host_params = {"w": np.array([1.0, -2.0, 4.0], dtype), "b": np.array(0.5, dtype)}
    params = jax.tree.map(jnp.asarray, host_params)
    init_state = tx.init(params)
    unscaled_dtype = jnp.float32 if dtype == jnp.float16 else dtype
    # The inner state is made for the gradients it will get: float32 for float16 params.
    inner_init = inner.init(
        jax.tree.map(lambda p: jnp.asarray(p.astype(unscaled_dtype)), host_params)
    )
    chex.assert_trees_all_equal(init_state.inner_state, inner_init, strict=True)
    host_grads = {"w": np.array([256.0, -512.0, 128.0], dtype), "b": np.array(64.0, dtype)}
    grads = jax.tree.map(jnp.asarray, host_grads)
    true_grads = jax.tree.map(
        lambda g: jnp.asarray((g.astype(np.float32) / 256).astype(unscaled_dtype)), host_grads
    )
    updates, opt_state = jit_or_eager(tx.update, grads, init_state, params)
    ref_updates, ref_state = jit_or_eager(inner.update, true_grads, inner_init, params)
    chex.assert_trees_all_equal_dtypes(updates, true_grads)
    assert_bits_equal(updates, ref_updates)
    assert_bits_equal(opt_state.inner_state, ref_state)

    bad_w = host_grads["w"].copy()
    bad_w[0] = np.inf
    bad = {"w": jnp.asarray(bad_w), "b": grads["b"]}
    updates, skipped_state = jit_or_eager(tx.update, bad, opt_state, params)
    chex.assert_trees_all_equal_dtypes(updates, true_grads)
    chex.assert_trees_all_equal_dtypes(skipped_state, opt_state)
    assert jls.get_loss_scale(skipped_state).dtype == jnp.float32
    assert stats_tuple(skipped_state) == (128.0, 1, False)


def test_float16_gradients_of_float32_params_are_unscaled_to_float32(jit_or_eager):
    """True gradients of 1e-6 to 1e-3, scaled by 2**15 into float16: unscaled in float16
    they flush or lose their bits (adam's updates were -0.12, -0.18, -2.98, -100); unscaled
    to float32 adam's updates are about -1e-3 each, those of bare adam on the true values."""
    true = np.array([1e-6, 2e-6, 3e-5, 1e-3], np.float32)
    grads = {"w": jnp.asarray((true * 2**15).astype(np.float16))}
    params = {"w": jnp.asarray(np.zeros(4, np.float32))}
    tx = jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale(2.0**15))
    updates, opt_state = jit_or_eager(tx.update, grads, tx.init(params), params)

    assert updates["w"].dtype == jnp.float32
    np.testing.assert_allclose(
        updates["w"], [-0.00099009, -0.00099502, -0.00099966, -0.00099998], rtol=1e-5
    )
    unscaled = {"w": jnp.asarray(np.asarray(grads["w"], np.float32) / np.float32(2**15))}
    ref_updates, ref_state = optax.adam(1e-3).update(unscaled, optax.adam(1e-3).init(params))
    assert_bits_equal(updates, ref_updates)
    assert_bits_equal(opt_state.inner_state, ref_state)
    chex.assert_trees_all_equal_dtypes(opt_state.inner_state, optax.adam(1e-3).init(params))


def test_float16_gradients_of_float64_params_come_back_float64(jit_or_eager):
    with jax.enable_x64(True):
        params = {"w": np.zeros(2, np.float64), "v": np.zeros(2, np.float32)}
        grads = {"w": np.array([3.0, 1e-3], np.float16), "v": np.array([3.0, 1.0], np.float16)}
        params, grads = jax.tree.map(jnp.asarray, (params, grads))  # made by NumPy: no compile
        tx = jls.loss_scaled(optax.sgd(1.0), jls.FixedLossScale(4.0))
        updates, _ = jit_or_eager(tx.update, grads, tx.init(params), params)
        expected_w = np.array([-0.75, -np.float16(1e-3) / 4], np.float64)
        chex.assert_trees_all_equal(
            updates, {"w": expected_w, "v": np.array([-0.75, -0.25], np.float32)}, strict=True
        )


@pytest.mark.parametrize(
    "loss_scale",
    [jls.FixedLossScale(3.0), jls.DynamicLossScale(3.0**10, multiplier=3.0)],
    ids=["fixed_3", "dynamic_3**10"],
)
def test_float64_gradients_are_unscaled_in_float64(jit_or_eager, loss_scale):
    """Under x64 a float64 gradient was multiplied by the float32 reciprocal of the scale:
    off by up to 3e-8 (a float32 rounding) for a scale of 3, where float64 division is exact
    to 1e-16. Now it is divided by the scale in float64: within 2 ulps of the division by
    hand (newer XLA:CPU divides by a float64 reciprocal, 1 ulp off at 59049)."""
    with jax.enable_x64(True):
        true = np.array([1.0, 7.0, 1e-3, -2.5e-7], np.float64)
        scale = np.float64(np.float32(3.0 if isinstance(loss_scale, jls.FixedLossScale) else 3**10))
        grads = {"w": jnp.asarray(true * scale), "v": jnp.asarray(np.float32([6.0]))}
        params = {"w": jnp.asarray(np.zeros(4)), "v": jnp.asarray(np.float32([0.0]))}
        tx = jls.loss_scaled(optax.sgd(1.0), loss_scale)
        updates, _ = jit_or_eager(tx.update, grads, tx.init(params), params)
        assert updates["w"].dtype == jnp.float64
        by_hand = (true * scale) / scale
        np.testing.assert_allclose(np.asarray(updates["w"]), -by_hand, rtol=4.5e-16, atol=0)
        np.testing.assert_allclose(np.asarray(updates["w"]), -true, rtol=1e-15, atol=0)
        unscaled = loss_scale.unscale(loss_scale.init(), grads)
        np.testing.assert_allclose(np.asarray(unscaled["w"]), by_hand, rtol=4.5e-16, atol=0)


def test_float64_and_float32_gradients_together_are_checked_as_bare_optax_takes_them(
    jit_or_eager,
):
    """Under x64, small float64 and float32 leaves were reduced in one group, and their
    squares added by `lax.add`: a TypeError where bare optax updates both."""
    with jax.enable_x64(True):
        params = {"w": np.zeros(2, np.float64), "v": np.zeros(2, np.float32)}
        grads = {"w": np.array([16.0, 8.0], np.float64), "v": np.array([8.0, 4.0], np.float32)}
        params, grads = jax.tree.map(jnp.asarray, (params, grads))
        tx = jls.loss_scaled(optax.sgd(0.5), jls.DynamicLossScale(4.0, increment_period=1))
        opt_state = tx.init(params)
        updates, opt_state = jit_or_eager(tx.update, grads, opt_state, params)
        expected = {"w": np.array([-2.0, -1.0], np.float64), "v": np.array([-1.0, -0.5])}
        chex.assert_trees_all_equal(
            updates, {**expected, "v": expected["v"].astype(np.float32)}, strict=True
        )
        stats = jls.get_loss_scale_stats(opt_state)
        assert float(stats.grad_norm) == 5.0  # sqrt(16 + 4 + 4 + 1)
        assert float(stats.loss_scale) == 8.0
        bad = {**grads, "w": grads["w"].at[1].set(np.inf)}
        updates, opt_state = jit_or_eager(tx.update, bad, opt_state, params)
        chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params), strict=True)
        assert float(jls.get_loss_scale(opt_state)) == 4.0


# --- 6. errors ------------------------------------------------------------------------------


def test_inner_factory_is_refused():
    ls = jls.DynamicLossScale()
    config = ls.get_config()
    with pytest.raises(
        TypeError,
        match=r"^loss_scaled\(inner=<function adam at 0x[0-9a-f]+>\): inner must be an optax "
        r"GradientTransformation, got function; call it first, e\.g\. optax\.adam\(1e-3\)$",
    ):
        jls.loss_scaled(optax.adam, ls)
    with pytest.raises(TypeError, match=r"inner must be an optax GradientTransformation, got str$"):
        jls.loss_scaled("adam", ls)
    assert ls.get_config() == config


def test_loss_scale_class_or_number_is_refused():
    inner = optax.adam(1e-3)
    with pytest.raises(
        TypeError,
        match=r"^loss_scaled\(loss_scale=<class 'jax_lossscale\.[_a-z]+\.DynamicLossScale'>\): "
        r"loss_scale must be a jax_lossscale\.LossScale such as DynamicLossScale\(\), got the "
        r"class DynamicLossScale; instantiate it first$",
    ):
        jls.loss_scaled(inner, jls.DynamicLossScale)
    with pytest.raises(
        TypeError,
        match=r"^loss_scaled\(loss_scale=128\.0\): loss_scale must be a jax_lossscale\.LossScale "
        r"such as DynamicLossScale\(\), got float$",
    ):
        jls.loss_scaled(inner, 128.0)
    with pytest.raises(TypeError, match=r"got str$"):
        jls.loss_scaled(inner, "dynamic")


def snapshot(tree):
    return jax.tree_util.tree_structure(tree), [np.array(x) for x in jax.tree.leaves(tree)]


def assert_unchanged(tree, before):
    structure, leaves = snapshot(tree)
    assert structure == before[0]
    for leaf, old in zip(leaves, before[1], strict=True):
        np.testing.assert_array_equal(leaf, old)


def test_state_of_the_wrong_kind(jit_or_eager, request):
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale())
    params = {"w": jnp.ones(2)}
    grads = {"w": jnp.ones(2)}
    good_state = tx.init(params)
    stats = good_state.stats
    array_type = "DynamicJaxprTracer" if is_jit(request) else "ArrayImpl"
    cases = [
        (
            optax.sgd(0.1).init(params),
            TypeError,
            "loss_scaled.update: state must be the LossScaledState returned by init(), got tuple",
        ),
        (
            good_state._replace(loss_scale_state=jls.FixedLossScale(2.0).init()),
            TypeError,
            "DynamicLossScale: state must be the DynamicLossScaleState returned by "
            "DynamicLossScale.init(), got FixedLossScaleState",
        ),
        (
            good_state._replace(stats=tuple(stats)),
            TypeError,
            "loss_scaled.update: state.stats must be the StepStats returned by init(), got tuple",
        ),
        (
            good_state._replace(stats=stats._replace(skipped_steps=jnp.zeros([], jnp.float32))),
            TypeError,
            "loss_scaled.update: state.stats.skipped_steps must have dtype int32 (not weakly "
            f"typed), got {array_type} of dtype float32 and shape (); build states with init()",
        ),
        (
            # jnp.asarray(0) is a weakly typed int32: a jitted step would trace twice.
            good_state._replace(stats=stats._replace(skipped_steps=jnp.asarray(0))),
            TypeError,
            "loss_scaled.update: state.stats.skipped_steps must have dtype int32 (not weakly "
            f"typed), got {array_type} of dtype int32 and shape (), weakly typed; build states "
            "with init()",
        ),
        (
            # The whole state replicated over 8 devices for pmap, passed outside pmap.
            jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (8,)), good_state),
            ValueError,
            "loss_scaled.update: state.stats.grad_norm must have shape (), got shape (8,); "
            "a state replicated for pmap has scalar leaves only inside the pmapped function",
        ),
    ]
    for state, error, message in cases:
        before = snapshot((grads, state, params))
        with pytest.raises(error, match=exact(message)):
            jit_or_eager(tx.update, grads, state, params)
        assert_unchanged((grads, state, params), before)


def test_non_array_gradient_leaf_names_the_path():
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale())
    params = {"w": jnp.ones(2), "layer": {"b": jnp.ones(1)}}
    state = tx.init(params)
    grads = {"w": jnp.ones(2), "layer": {"b": "oops"}}
    before = snapshot((state, params))
    with pytest.raises(
        TypeError,
        match=r"^loss_scaled\.update: updates leaf at \['layer'\]\['b'\] has type str \('oops'\); "
        r"every leaf must be a JAX or NumPy array \(or None\)$",
    ):
        tx.update(grads, state, params)
    assert grads == {"w": grads["w"], "layer": {"b": "oops"}}
    assert_unchanged((state, params), before)


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda ls: jls.loss_scaled(optax.sgd(0.1), ls),
        lambda ls: optax.chain(optax.clip(1.0), jls.loss_scaled(optax.sgd(0.1), ls)),
        lambda ls: optax.MultiSteps(jls.loss_scaled(optax.sgd(0.1), ls), 2),
    ],
    ids=["direct", "in-chain", "in-multisteps"],
)
def test_nested_loss_scaled_is_refused_at_init(make_inner):
    ls = jls.DynamicLossScale()
    tx = jls.loss_scaled(make_inner(ls), ls)
    message = (
        "loss_scaled: inner already holds a loss_scaled transformation; the gradients would be "
        "unscaled twice. Use one loss_scaled around the whole optimizer"
    )
    with pytest.raises(ValueError, match=exact(message)):
        tx.init({"w": jnp.ones(2)})


class HalvingState(NamedTuple):
    loss_scale: jax.Array
    overflows: jax.Array


@dataclasses.dataclass(frozen=True)
class HalvingLossScale(jls.LossScale):
    """A user's loss scale: halves on every overflow and never grows."""

    initial: float = 8.0

    def init(self) -> HalvingState:
        return HalvingState(jnp.asarray(self.initial, jnp.float32), jnp.zeros([], jnp.int32))

    def __call__(self, state: HalvingState) -> jax.Array:
        return state.loss_scale

    def adjust(self, state, grads_finite):
        finite = grads_finite
        new_state = HalvingState(
            jnp.where(finite, state.loss_scale, state.loss_scale / 2),
            state.overflows + jnp.logical_not(finite).astype(jnp.int32),
        )
        return new_state, finite

    def get_config(self) -> dict:
        return {"initial": self.initial}


@jls.register
@dataclasses.dataclass(frozen=True)
class RegisteredHalvingLossScale(HalvingLossScale):
    pass


@dataclasses.dataclass(frozen=True)
class BadShouldApplyLossScale(HalvingLossScale):
    """Returns `should_apply` in the form named by `returns`, never a bool scalar array."""

    returns: str = "python-bool"

    def adjust(self, state, grads_finite):
        state, finite = super().adjust(state, grads_finite)
        should_apply = {
            "python-bool": True,
            "float32-scalar": finite.astype(jnp.float32),
            "bool-vector": jnp.stack([finite, finite]),
        }[self.returns]
        return state, should_apply


@pytest.mark.parametrize("cls", [HalvingLossScale, RegisteredHalvingLossScale])
def test_user_loss_scale_subclass(jit_or_eager, cls):
    ls = cls(initial=8.0)
    tx = jls.loss_scaled(optax.sgd(1.0), ls)
    params = {"w": jnp.array([1.0, 2.0])}
    opt_state = tx.init(params)
    assert isinstance(opt_state.loss_scale_state, HalvingState)
    true_grads = {"w": jnp.array([0.5, -0.25])}
    expected = [(8.0, 0, True), (4.0, 1, False), (4.0, 1, True), (4.0, 1, True)]
    for index, bad in enumerate([False, True, False, False]):
        grads = scaled(true_grads, jls.get_loss_scale(opt_state))
        if bad:
            grads = with_bad_value(grads, jnp.inf)
        updates, opt_state = jit_or_eager(tx.update, grads, opt_state, params)
        if bad:
            assert_bits_equal(updates, {"w": jnp.array([-0.0, -0.0])})
        else:
            assert_bits_equal(updates, {"w": jnp.array([-0.5, 0.25])})
        assert stats_tuple(opt_state) == expected[index], index
    assert int(opt_state.loss_scale_state.overflows) == 1
    if cls is RegisteredHalvingLossScale:
        assert jls.deserialize(jls.serialize(ls)) == ls


@pytest.mark.parametrize(
    ("returns", "eager_repr", "jit_repr"),
    [
        ("python-bool", "True", "True"),
        ("float32-scalar", "Array(1., dtype=float32)", "JitTracer(float32[])"),
        ("bool-vector", "Array([ True,  True], dtype=bool)", "JitTracer(bool[2])"),
    ],
    ids=["python-bool", "float32-scalar", "bool-vector"],
)
def test_should_apply_must_be_a_bool_scalar_array(
    jit_or_eager, request, returns, eager_repr, jit_repr
):
    tx = jls.loss_scaled(optax.sgd(1.0), BadShouldApplyLossScale(returns=returns))
    params = {"w": jnp.ones(2)}
    opt_state = tx.init(params)
    received = jit_repr if is_jit(request) else eager_repr
    message = (
        "loss_scaled: BadShouldApplyLossScale.adjust must return should_apply as a bool scalar "
        f"array, got {received}"
    )
    # The first update raises, with finite gradients.
    with pytest.raises(TypeError, match=exact(message)):
        jit_or_eager(tx.update, {"w": jnp.ones(2)}, opt_state, params)


# --- 7. extra arguments and params=None -----------------------------------------------------


class CountState(NamedTuple):
    count: jax.Array


def scale_by_factor_kwarg() -> optax.GradientTransformationExtraArgs:
    """Multiplies the updates by the extra argument `factor` and counts its calls."""

    def init_fn(params):
        del params
        return CountState(jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, *, factor, **extra_args):
        del params, extra_args
        return jax.tree.map(lambda u: u * factor, updates), CountState(state.count + 1)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def test_extra_args_reach_the_inner_transformation(jit_or_eager):
    tx = jls.loss_scaled(
        optax.chain(scale_by_factor_kwarg(), optax.scale(-1.0)), jls.DynamicLossScale(4.0)
    )
    opt_state = tx.init({"w": jnp.zeros(2)})

    def step(grads, opt_state, factor):
        return tx.update(grads, opt_state, factor=factor)

    updates, opt_state = jit_or_eager(step, {"w": jnp.array([4.0, -8.0])}, opt_state, 3.0)
    chex.assert_trees_all_equal(updates, {"w": jnp.array([-3.0, 6.0])})
    assert int(opt_state.inner_state[0].count) == 1
    updates, skipped = jit_or_eager(step, {"w": jnp.array([jnp.nan, 1.0])}, opt_state, 5.0)
    assert_bits_equal(updates, {"w": jnp.array([-0.0, -0.0])})
    assert_bits_equal(skipped.inner_state, opt_state.inner_state)
    with pytest.raises(TypeError, match="factor"):
        tx.update({"w": jnp.ones(2)}, opt_state)


@pytest.mark.parametrize(
    ("wrap", "plateau_of"),
    [
        (lambda inner: inner, lambda inner_state: inner_state[1]),
        # MultiSteps is not a GradientTransformation: the wrapper forwards `value` to it.
        (
            lambda inner: optax.MultiSteps(inner, 1),
            lambda inner_state: inner_state.inner_opt_state[1],
        ),
    ],
    ids=["chain", "multisteps"],
)
def test_reduce_on_plateau_receives_the_loss_value(jit_or_eager, wrap, plateau_of):
    inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(factor=0.5, patience=2))
    tx = jls.loss_scaled(wrap(inner), jls.DynamicLossScale(8.0, increment_period=100))
    params = {"w": jnp.zeros(2)}
    opt_state = tx.init(params)

    def step(grads, opt_state, params, value):
        return tx.update(grads, opt_state, params, value=value)

    grads = {"w": jnp.array([8.0, -8.0])}
    values = [3.0, 3.0, 3.0, 1.0]
    lr_scales = [1.0, 1.0, 0.5, 0.5]
    for value, lr_scale in zip(values, lr_scales, strict=True):
        updates, opt_state = jit_or_eager(step, grads, opt_state, params, value)
        chex.assert_trees_all_equal(updates, {"w": jnp.array([-lr_scale, lr_scale])})
    plateau = plateau_of(opt_state.inner_state)
    assert float(plateau.best_value) == 1.0
    assert float(plateau.scale) == 0.5
    # A skipped step does not feed its value to the plateau detector.
    _, skipped = jit_or_eager(step, {"w": jnp.array([jnp.inf, 0.0])}, opt_state, params, 0.25)
    assert_bits_equal(skipped.inner_state, opt_state.inner_state)


@pytest.mark.parametrize("make_inner", [optax.sgd, optax.adam], ids=["sgd", "adam"])
def test_params_none(jit_or_eager, make_inner):
    inner = make_inner(0.5)
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(16.0))
    opt_state = tx.init({"w": jnp.zeros(2)})

    def step(grads, opt_state):
        return tx.update(grads, opt_state)

    updates, opt_state = jit_or_eager(step, {"w": jnp.array([16.0, -32.0])}, opt_state)
    ref_updates, _ = inner.update({"w": jnp.array([1.0, -2.0])}, inner.init({"w": jnp.zeros(2)}))
    chex.assert_trees_all_close(updates, ref_updates)
    updates, opt_state = jit_or_eager(step, {"w": jnp.array([jnp.nan, 0.0])}, opt_state)
    assert_bits_equal(updates, {"w": jnp.array([-0.0, -0.0])})
    assert stats_tuple(opt_state) == (8.0, 1, False)


def passthrough_integers() -> optax.GradientTransformation:
    """sgd(1.0) on floating leaves; integer leaves come out as they came in."""

    def negate_floating(update):
        return -update if jnp.issubdtype(update.dtype, jnp.inexact) else update

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(negate_floating, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


@pytest.mark.parametrize(
    ("inner", "params", "grads", "applied", "bad_grads", "skipped"),
    [
        (
            optax.sgd(1.0),
            {"w": device_array([1.0, 2.0]), "frozen": None},
            {"w": device_array([4.0, -8.0]), "frozen": None},
            {"w": device_array([-1.0, 2.0]), "frozen": None},
            {"w": device_array([jnp.nan, 0.0]), "frozen": None},
            {"w": device_array([-0.0, -0.0]), "frozen": None},
        ),
        (
            passthrough_integers(),
            {"w": device_array([1.0, 2.0]), "n": device_array([3, 4], np.int32)},
            # Integer leaves are not unscaled: 12 stays 12 at scale 4.
            {"w": device_array([4.0, -8.0]), "n": device_array([12, -5], np.int32)},
            {"w": device_array([-1.0, 2.0]), "n": device_array([12, -5], np.int32)},
            {"w": device_array([jnp.inf, 0.0]), "n": device_array([12, -5], np.int32)},
            {"w": device_array([-0.0, -0.0]), "n": device_array([0, 0], np.int32)},
        ),
        (optax.adam(0.1), {}, {}, {}, None, None),
    ],
    ids=["none-leaves", "integer-leaves", "empty-tree"],
)
def test_tree_edge_cases(jit_or_eager, inner, params, grads, applied, bad_grads, skipped):
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(4.0, increment_period=1))
    opt_state = tx.init(params)
    updates, opt_state = jit_or_eager(tx.update, grads, opt_state, params)
    assert_bits_equal(updates, applied)
    assert stats_tuple(opt_state) == (8.0, 0, True)
    if bad_grads is None:
        return
    updates, skipped_state = jit_or_eager(tx.update, bad_grads, opt_state, params)
    assert_bits_equal(updates, skipped)
    assert_bits_equal(optax.apply_updates(params, updates), params)
    assert_bits_equal(skipped_state.inner_state, opt_state.inner_state)
    assert stats_tuple(skipped_state) == (4.0, 1, False)


def test_vmap_over_update_skips_per_member(jit_or_eager):
    tx = jls.loss_scaled(
        optax.sgd(1.0, momentum=0.5), jls.DynamicLossScale(8.0, increment_period=1)
    )
    params = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])}
    opt_state = jax.vmap(tx.init)(params)
    grads = {"w": jnp.array([[8.0, -16.0], [jnp.inf, 8.0], [4.0, 0.0]])}
    updates, opt_state = jit_or_eager(jax.vmap(tx.update), grads, opt_state, params)
    expected = {"w": jnp.array([[-1.0, 2.0], [-0.0, -0.0], [-0.5, -0.0]])}
    assert_bits_equal(updates, expected)
    # The momentum of the member that skipped stays at its initial zeros.
    trace = {"w": jnp.array([[1.0, -2.0], [0.0, 0.0], [0.5, 0.0]])}
    assert_bits_equal(opt_state.inner_state[0].trace, trace)
    chex.assert_trees_all_equal(
        jls.get_loss_scale_stats(opt_state),  # each member's, read across the vmapped axis
        jls.LossScaleStats(
            loss_scale=jnp.array([16.0, 4.0, 16.0]),
            grad_norm=jnp.array(
                [np.sqrt(5.0), np.inf, 0.5], jnp.float32
            ),  # of [8, -16] / 8, ..., [4, 0] / 8
            skipped_steps=jnp.array([0, 1, 0], jnp.int32),
            nan_skipped_steps=jnp.array([0, 0, 0], jnp.int32),
            inf_skipped_steps=jnp.array([0, 1, 0], jnp.int32),
            spike_skipped_steps=jnp.array([0, 0, 0], jnp.int32),
            consecutive_skipped_steps=jnp.array([0, 1, 0], jnp.int32),
            last_step_applied=jnp.array([True, False, True]),
        ),
        strict=True,
    )


# --- 8. a jitted train step -----------------------------------------------------------------


def test_jitted_train_step_traces_once():
    key_x, key_w = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (16, 4), jnp.float32)
    true_w = jnp.array([1.0, -2.0, 0.5, 3.0])
    y = x @ true_w
    params = {"w": 0.1 * jax.random.normal(key_w, (4,)), "b": jnp.zeros([])}
    ls = jls.DynamicLossScale(initial_loss_scale=2.0**8, increment_period=10)
    tx = jls.loss_scaled(optax.adam(1e-2), ls)

    def loss_fn(params, x, y):
        p16 = jax.tree.map(lambda p: p.astype(jnp.float16), params)
        pred = x.astype(jnp.float16) @ p16["w"] + p16["b"]
        return jnp.mean((pred - y.astype(jnp.float16)) ** 2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def train_step(params, opt_state, factor):
        scale = jls.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: loss_fn(p, x, y).astype(jnp.float32) * scale * factor)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    overflow_steps = {25, 26, 60}
    opt_state = tx.init(params)
    loss_of = jax.jit(loss_fn)  # the check's loss: one program, not one per op
    initial_loss = float(loss_of(params, x, y))
    scales = []
    for step in range(100):
        factor = jnp.float32(jnp.inf if step in overflow_steps else 1.0)
        new_params, opt_state = train_step(params, opt_state, factor)
        if step in overflow_steps:
            assert_bits_equal(new_params, params)
            assert not bool(opt_state.stats.last_step_applied)
        else:
            assert bool(opt_state.stats.last_step_applied), step
        params = new_params
        scales.append(float(jls.get_loss_scale(opt_state)))
        chex.assert_trees_all_equal_dtypes(params, {"w": true_w, "b": jnp.zeros([])})

    # 20 finite steps: 2**10; overflows at 25, 26: 2**8; growth at steps 36, 46, 56: 2**11;
    # overflow at 60: 2**10; growth at steps 70, 80, 90: 2**13.
    assert scales[9] == 2.0**9
    assert scales[24] == 2.0**10
    assert scales[25] == 2.0**9
    assert scales[26] == 2.0**8
    assert scales[59] == 2.0**11
    assert scales[60] == 2.0**10
    assert scales[-1] == 2.0**13
    assert max(scales) == 2.0**13
    assert int(opt_state.stats.skipped_steps) == 3
    assert float(loss_of(params, x, y)) < initial_loss


def test_the_inner_update_is_traced_once_per_trace_of_the_step():
    """Both branches of the skip get their types from one trace of the inner update."""
    calls = []
    adam = optax.adam(1e-2)

    def update(updates, state, params=None):
        calls.append(None)
        return adam.update(updates, state, params)

    tx = jls.loss_scaled(optax.GradientTransformation(adam.init, update), jls.DynamicLossScale())
    params = {"w": jnp.ones(3), "b": jnp.zeros([])}
    jax.jit(tx.update).trace(params, tx.init(params), params)
    assert len(calls) == 1
    with jax.disable_jit():  # a skip traced alone still finds its types
        _, state = tx.update(
            {"w": jnp.full(3, jnp.nan), "b": jnp.zeros([])}, tx.init(params), params
        )
    assert int(jls.get_loss_scale_stats(state).nan_skipped_steps) == 1


def test_under_multisteps_the_scale_counts_microbatches():
    loss_scale = jls.DynamicLossScale(initial_loss_scale=8.0, increment_period=8)
    tx = jls.loss_scaled(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4), loss_scale)
    params = {"w": jnp.zeros(2)}
    opt_state = tx.init(params)
    scales = []
    for _ in range(8):  # 8 microbatches: 2 optimizer steps
        grads = {"w": jnp.ones(2) * jls.get_loss_scale(opt_state)}
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        scales.append(float(jls.get_loss_scale(opt_state)))
    assert scales == [8.0] * 7 + [16.0]
    assert int(opt_state.inner_state.gradient_step) == 2
    np.testing.assert_allclose(params["w"], [-0.2, -0.2])


def test_a_weakly_typed_gradient_is_taken_as_its_strong_twin():
    """A gradient leaf made from Python scalars (`jnp.asarray(2.0)`, weakly typed), which bare
    optax accepts: the updates and the state are those of the strongly typed gradient, bit for
    bit and type for type, on an applied step and on a skipped one."""
    tx = jls.loss_scaled(optax.adam(0.1), jls.DynamicLossScale(initial_loss_scale=4.0))
    params = {"w": jnp.ones(3), "b": jnp.float32(0.5)}
    update = jax.jit(tx.update)

    def two_steps(bias_grads):
        state, outputs = tx.init(params), []
        for bias_grad in bias_grads:
            grads = {"w": jnp.full(3, 8.0), "b": bias_grad}
            updates, state = update(grads, state, params)
            outputs.append((updates, state))
        return outputs

    weak = two_steps([jnp.asarray(2.0), jnp.asarray(float("inf"))])
    strong = two_steps([jnp.float32(2.0), jnp.float32(np.inf)])
    assert jax.typeof(jnp.asarray(2.0)).weak_type
    for (weak_updates, weak_state), (strong_updates, strong_state) in zip(
        weak, strong, strict=True
    ):
        assert_bits_equal((weak_updates, weak_state), (strong_updates, strong_state))
        for a, b in zip(
            jax.tree.leaves((weak_updates, weak_state)),
            jax.tree.leaves((strong_updates, strong_state)),
            strict=True,
        ):
            assert jax.typeof(a) == jax.typeof(b)
    # the applied step is bare adam's on the gradients unscaled by 4
    bare = optax.adam(0.1)
    bare_updates, _ = jax.jit(bare.update)(
        {"w": jnp.full(3, 2.0), "b": jnp.float32(0.5)}, bare.init(params), params
    )
    assert_bits_equal(weak[0][0], bare_updates)
    assert float(weak[1][0]["b"]) == 0.0  # skipped: -0.0
    assert np.signbit(weak[1][0]["b"])
    assert float(jls.get_loss_scale(weak[1][1])) == 2.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_an_inner_state_holding_a_typed_prng_key_is_kept_on_a_skip(dtype):
    """`optax.noisy_sgd` keeps a typed key (`jax.random.key`) in its state, which bare optax
    accepts (float16 params too, whose state loss_scaled makes for float32): an applied step
    adds bare noisy_sgd's noise to the unscaled gradients and advances its key, and a skipped
    one keeps the key, the count and the params bit for bit."""

    def noisy():
        return optax.noisy_sgd(0.01, key=jax.random.key(0))

    tx = jls.loss_scaled(noisy(), jls.DynamicLossScale(initial_loss_scale=4.0))
    params = {"w": jnp.ones((3, 4), dtype)}
    update = jax.jit(tx.update, donate_argnums=1)
    applied_updates, applied = update({"w": jnp.full((3, 4), 0.4, dtype)}, tx.init(params), params)
    bare = noisy()
    bare_updates, bare_state = jax.jit(bare.update)(
        {"w": jnp.full((3, 4), 0.4, dtype).astype(jnp.float32) / 4}, bare.init(params), params
    )
    # (XLA fuses the noise's sampling into another program: equal to float32 rounding)
    np.testing.assert_allclose(
        np.asarray(applied_updates["w"], np.float32), bare_updates["w"], rtol=1e-6, atol=1e-9
    )
    noise = applied.inner_state[0]
    assert int(noise.count) == int(bare_state[0].count) == 1
    assert jax.random.key_data(noise.rng_key).tolist() == (
        jax.random.key_data(bare_state[0].rng_key).tolist()
    )
    assert jax.dtypes.issubdtype(noise.rng_key.dtype, jax.dtypes.prng_key)
    expected_key = jax.random.key_data(noise.rng_key).tolist()
    skipped_updates, skipped = update({"w": jnp.full((3, 4), jnp.inf, dtype)}, applied, params)
    assert_bits_equal(optax.apply_updates(params, skipped_updates), params)
    assert jax.random.key_data(skipped.inner_state[0].rng_key).tolist() == expected_key
    assert int(skipped.inner_state[0].count) == 1
    assert float(jls.get_loss_scale(skipped)) == 2.0


def test_a_failure_of_labels_chosen_by_dtype_on_float16_params_says_why():
    """optax calls a `param_labels` function on the updates: the unscaled gradients of float16
    params come in float32, so labels chosen by dtype differ from init's, and optax fails
    deep inside (bare optax, given float16 gradients, runs). The error notes the cause."""
    params = {"w16": jnp.ones(3, jnp.float16), "w32": jnp.ones(3, jnp.float32)}

    def labels(tree):
        return jax.tree.map(lambda leaf: "low" if leaf.dtype == jnp.float16 else "high", tree)

    inner = optax.multi_transform({"low": optax.sgd(0.1), "high": optax.adam(0.1)}, labels)
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(1024.0))
    grads = {"w16": jnp.full(3, 512.0, jnp.float16), "w32": jnp.full(3, 512.0)}
    with pytest.raises(TypeError) as raised:
        tx.update(grads, tx.init(params), params)
    assert any(
        "unscaled gradients of float16 leaves in float32" in note
        and "optax.multi_transform's param_labels" in note
        for note in getattr(raised.value, "__notes__", [])
    )
    # Labels given as a tree (or chosen by path) run, as bare optax's.
    by_tree = optax.multi_transform(
        {"low": optax.sgd(0.1), "high": optax.adam(0.1)}, {"w16": "low", "w32": "high"}
    )
    tx = jls.loss_scaled(by_tree, jls.DynamicLossScale(1024.0))
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w16"], -0.05, rtol=1e-6)
    np.testing.assert_allclose(updates["w32"], -0.1, rtol=1e-5)
