"""The forms a GPU program takes (`_numerics.on_gpu`), run on the CPU.

On a GPU the check is a plain sum of squares over rows, then over the rows' sums
(`_numerics.square_sum`), and every skip is made by selects; elsewhere the program is the one
it was. `jax.lax.platform_dependent` lowers only the form of the platform it lowers for, so
here the GPU forms are taken by replacing `on_gpu` with a choice of the GPU form: the steps
below then run on this CPU what an H100 runs (its program: tests/test_gpu_program.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale import _branches, _loss_scaled, _numerics

from helpers import assert_bits_equal, compiled_reductions, device_array


def _gpu_form(gpu, other, *args):
    del other
    return gpu(*args)


def _take_the_gpu_form(patch: pytest.MonkeyPatch) -> None:
    for module in (_numerics, _branches, _loss_scaled):
        patch.setattr(module, "on_gpu", _gpu_form)


def in_the_gpu_form(run, *args):
    """`run(*args)` with every choice of form taking the GPU's."""
    with pytest.MonkeyPatch.context() as patch:
        _take_the_gpu_form(patch)
        return run(*args)


@pytest.fixture
def on_a_gpu(monkeypatch):
    _take_the_gpu_form(monkeypatch)


def test_square_sum_is_the_squared_norm_and_keeps_nan_and_inf():
    rng = np.random.default_rng(0)
    large = rng.standard_normal(5000).astype(np.float32)  # 10 rows of 512, the last padded
    small = np.array([3.0, 4.0], np.float32)
    total = _numerics.square_sum([jnp.asarray(large), jnp.asarray(small)])
    expected = np.sum(large.astype(np.float64) ** 2) + 25.0
    np.testing.assert_allclose(float(total), expected, rtol=1e-6)
    factor = jnp.float32(0.5)
    assert float(_numerics.square_sum([jnp.asarray(small)], factor)) == 6.25
    for values, expected_kind in [
        ([1.0, np.nan], "nan"),
        ([np.inf, np.nan], "nan"),  # an infinity never hides a NaN
        ([-np.inf, 1.0], "inf"),
        ([2e19, 1.0], "inf"),  # a square that overflows float32: counted as an overflow
        ([1e19, 0.0], "finite"),  # its square, 1e38, is below 3.4e38
    ]:
        leaf = device_array(values + [0.0] * 600)  # over a row
        total = float(_numerics.square_sum([leaf, jnp.ones(3)]))
        kind = "nan" if np.isnan(total) else "inf" if np.isinf(total) else "finite"
        assert kind == expected_kind, values


def test_the_gpu_check_agrees_with_the_exact_one_except_on_an_overflowing_square(on_a_gpu):
    rng = np.random.default_rng(1)
    tree = {
        "w": jnp.asarray(rng.standard_normal((40, 30)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(7), jnp.float16),
    }
    scale = jnp.float32(2.0**10)
    scaled = jax.tree.map(lambda x: x * scale.astype(x.dtype), tree)
    check = jax.jit(_numerics.check_gradients, static_argnums=1)(scaled, None, scale)
    exact = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in tree.values()))
    np.testing.assert_allclose(float(check.norm), exact, rtol=1e-5)
    assert bool(check.finite)
    assert not bool(check.has_nan)
    for value, finite, has_nan in [(np.nan, False, True), (np.inf, False, False)]:
        bad = {**tree, "w": tree["w"].at[3, 4].set(value)}
        check = _numerics.check_gradients(bad, None)
        assert (bool(check.finite), bool(check.has_nan)) == (finite, has_nan), value
    # 2e19 is finite: all_finite says so, exactly; the GPU check counts its square's overflow.
    overflowing = {**tree, "w": tree["w"].at[0, 0].set(2e19)}
    assert not bool(_numerics.check_gradients(overflowing, None).finite)
    assert bool(jls.all_finite(overflowing))


def _adam_run(grads_per_step):
    tx = jls.loss_scaled(optax.adam(1e-2), jls.DynamicLossScale(initial_loss_scale=2.0**4))

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    params = {"w": jnp.linspace(-1.0, 1.0, 1200, dtype=jnp.float32), "b": jnp.zeros(3)}
    state = tx.init(params)
    history = []
    for grads in grads_per_step:
        params, state, updates = step(params, state, grads)
        history.append((params, state, updates))
    return history, step


def _adam_grads():
    grads = {"w": jnp.full(1200, 0.25, jnp.float32) * 2.0**4, "b": jnp.ones(3) * 2.0**4}
    bad = {"w": grads["w"].at[7].set(jnp.inf), "b": grads["b"].at[1].set(jnp.nan)}
    return [grads, bad, grads]


def test_adam_on_a_gpu_skips_by_selects_bit_for_bit_as_the_cond_does(on_a_gpu):
    """The GPU form of the adam step: no `conditional` and no variadic reduction in its
    program, and the same params, inner state, scale and counts, bit for bit, as the CPU's
    `cond` on a finite, a non-finite (inf and NaN) and a finite step; the skipped step's
    updates are -0.0."""
    gpu_history, step = _adam_run(_adam_grads())
    args = (*jax.tree.map(jnp.asarray, gpu_history[0][:2]), _adam_grads()[0])
    text = step.lower(*args).compile().as_text()
    assert "conditional(" not in text
    assert all(not kind.startswith("(") for kind in compiled_reductions(text))
    skipped_updates = gpu_history[1][2]
    assert_bits_equal(
        skipped_updates, jax.tree.map(lambda x: jnp.full_like(x, -0.0), skipped_updates)
    )
    assert_bits_equal(gpu_history[1][0], gpu_history[0][0])  # the params kept
    assert_bits_equal(gpu_history[1][1].inner_state, gpu_history[0][1].inner_state)
    assert int(gpu_history[1][1].stats.nan_skipped_steps) == 1


def test_adam_on_a_gpu_gives_what_the_cpu_form_gives():
    """The same steps on the CPU's own form (a `cond`, in its program): the same decisions,
    scale and counts exactly, and the same params and moments to float32 rounding (the two
    programs are fused differently)."""
    cpu_history, step = _adam_run(_adam_grads())
    args = (*jax.tree.map(jnp.asarray, cpu_history[0][:2]), _adam_grads()[0])
    assert "conditional(" in step.lower(*args).compile().as_text()
    gpu_history, _ = in_the_gpu_form(_adam_run, _adam_grads())
    for cpu, gpu in zip(cpu_history, gpu_history, strict=True):
        assert_bits_equal(gpu[1].loss_scale_state, cpu[1].loss_scale_state)
        assert_bits_equal(gpu[1].stats[1:], cpu[1].stats[1:])  # after grad_norm
        for gpu_leaf, cpu_leaf in zip(jax.tree.leaves(gpu), jax.tree.leaves(cpu), strict=True):
            np.testing.assert_allclose(gpu_leaf, cpu_leaf, rtol=1e-6, atol=1e-9)


def test_the_reciprocal_factors_on_a_gpu_are_the_cpu_ones_bit_for_bit(on_a_gpu):
    divisors = np.array([1.0, 3.0, 0.7, 2.0**-10, 2.0**15, 1e38, 2.0**127, 3.4e38], np.float32)
    cpu = [(1 / np.minimum(d, np.float32(2.0**126)), np.minimum(d, 2.0**126) / d) for d in divisors]
    gpu = jax.jit(jax.vmap(_numerics.reciprocal_factors))(jnp.asarray(divisors))
    assert_bits_equal(gpu[0], np.array([r for r, _ in cpu], np.float32))
    assert_bits_equal(gpu[1], np.array([c for _, c in cpu], np.float32))
    assert float(gpu[1][-2]) == 0.5  # 2**127: bounded at 2**126, then corrected by a half


def test_the_scalars_written_together_on_a_gpu_keep_their_bits_and_types(on_a_gpu):
    """Every 32-bit scalar goes through the stacked bits and comes back bit for bit (a NaN's
    payload, -0.0, a subnormal, a negative count); everything else is left as it was."""
    nan_with_payload = np.array(0x7FC01234, np.uint32).view(np.float32)
    tree = {
        "scale": jnp.float32(-0.0),
        "nan": jnp.asarray(nan_with_payload),
        "tiny": jnp.float32(1e-45),
        "count": jnp.int32(-7),
        "bits": jnp.uint32(0xFFFFFFFF),
        "half": jnp.float16(3.0),
        "flag": jnp.bool_(True),
        "vector": jnp.arange(3.0),
        "weak": jnp.asarray(2.0),  # weakly typed: left out, its type would come back strong
        "key": jax.random.key(0),
        "none": None,
    }
    out = jax.jit(_numerics.scalars_written_together)(tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for name, leaf in tree.items():
        if leaf is not None:
            assert jax.typeof(out[name]) == jax.typeof(leaf), name
            got, expected = out[name], leaf
            if name == "key":
                got, expected = jax.random.key_data(got), jax.random.key_data(expected)
            assert_bits_equal(got, expected)
    jaxpr = jax.make_jaxpr(_numerics.scalars_written_together)(tree)
    [stacked] = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "optimization_barrier"]
    assert stacked.outvars[0].aval.shape == (5,)  # scale, nan, tiny, count, bits


def test_the_scalars_written_together_under_shard_map_keep_their_varying_axes(on_a_gpu):
    """Inside `shard_map`, a scalar that varies over the devices and one that does not are
    stacked apart, and each comes back with its own type."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))

    def body(x):
        varying = jnp.sum(x).astype(jnp.int32)
        tree = {"a": jnp.float32(1.5), "b": jnp.int32(4), "c": varying, "d": varying * 2}
        out = _numerics.scalars_written_together(tree)
        for name in tree:
            assert jax.typeof(out[name]) == jax.typeof(tree[name]), name
        return jnp.stack([out["a"].astype(jnp.int32), out["b"], out["c"], out["d"]])[None]

    spec = jax.sharding.PartitionSpec("d")
    result = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(jnp.arange(4.0))
    np.testing.assert_array_equal(result, [[1, 4, 1, 2], [1, 4, 5, 10]])


def _pmapped_spike_run():
    """A pmap'ed adamw step over 2 devices, with spike skipping (the loss passed as `value`):
    finite steps, a NaN on one device, more finite steps (the windows fill), then a finite
    spike of 100x the norm and the loss."""
    tx = jls.loss_scaled(
        optax.adamw(1e-2),
        jls.DynamicLossScale(initial_loss_scale=2.0**4, increment_period=3),
        axis_name="d",
        skip_spike_sigmas=3.0,
        spike_window=8,
    )

    def step(params, state, grads, loss):
        updates, state = tx.update(grads, state, params, value=loss)
        return optax.apply_updates(params, updates), state

    stepped = jax.pmap(step, axis_name="d", devices=jax.devices()[:2])
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.standard_normal((2, 700)), jnp.float32), "b": jnp.zeros((2, 3))}
    state = jax.pmap(tx.init, devices=jax.devices()[:2])(params)
    history = []
    for index in range(12):
        noise = rng.standard_normal((2, 700)).astype(np.float32)
        grads = {"w": noise * 2.0**4, "b": np.ones((2, 3), np.float32) * 2.0**4}
        if index == 5:
            grads["w"][1, 9] = np.nan  # on the second device only
        if index == 11:
            grads = jax.tree.map(lambda g: g * 100.0, grads)
        loss = np.full(2, 1.0 + 0.01 * index + (99.0 if index == 11 else 0.0), np.float32)
        params, state = stepped(params, state, grads, loss)
        history.append((params, state))
    return history


def test_a_pmapped_spike_skipping_step_on_a_gpu_decides_and_counts_as_the_cpu_form():
    """The GPU form under `pmap` with spike skipping and adamw: the same decisions, scales,
    counts and window positions as the CPU form on every step, both devices agreeing; the
    norms, windows and params to float32 rounding (the norm is summed in another order)."""
    cpu = _pmapped_spike_run()
    gpu = in_the_gpu_form(_pmapped_spike_run)
    applied = [bool(state.stats.last_step_applied[0]) for _, state in gpu]
    assert applied == [True] * 5 + [False] + [True] * 5 + [False]
    last = gpu[-1][1].stats
    assert (int(last.nan_skipped_steps[1]), int(last.spike_skipped_steps[1])) == (1, 1)
    for (gpu_params, gpu_state), (cpu_params, cpu_state) in zip(gpu, cpu, strict=True):
        assert_bits_equal(gpu_state.loss_scale_state, cpu_state.loss_scale_state)
        assert_bits_equal(gpu_state.stats[1:], cpu_state.stats[1:])  # after grad_norm
        assert_bits_equal(gpu_state.inner_state[0].count, cpu_state.inner_state[0].count)
        for gpu_leaf, cpu_leaf in zip(
            jax.tree.leaves((gpu_params, gpu_state)),
            jax.tree.leaves((cpu_params, cpu_state)),
            strict=True,
        ):
            np.testing.assert_allclose(gpu_leaf, cpu_leaf, rtol=1e-5, atol=1e-7)


def _bf16_kahan_run(steps=200):
    """bfloat16 params under `loss_scaled(chain(adamw, kahan_summation()))`, the step jitted
    with params and state donated, the scale given as a jnp array; a NaN batch every 50th
    step. Returns the params and state after each step, and the params before each NaN step."""
    tx = jls.loss_scaled(
        optax.chain(optax.adamw(1e-3), jls.kahan_summation()),
        jls.DynamicLossScale(initial_loss_scale=jnp.float32(2.0**10), increment_period=20),
    )

    def step(params, state, batch):
        scale = jls.get_loss_scale(state)
        grads = jax.grad(lambda p: jnp.sum((p["w"].astype(jnp.float32) * batch) ** 2) * scale)(
            params
        )
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    stepped = jax.jit(step, donate_argnums=(0, 1))
    params = {"w": jnp.linspace(-1.0, 1.0, 600, dtype=jnp.bfloat16)}
    state = tx.init(params)
    rng = np.random.default_rng(7)
    decisions, scales, kept = [], [], []
    for index in range(steps):
        batch = rng.standard_normal(600).astype(np.float32)
        if index % 50 == 49:
            batch[index % 600] = np.nan
            before = np.array(params["w"])
        params, state = stepped(params, state, batch)
        decisions.append(bool(state.stats.last_step_applied))
        scales.append(float(jls.get_loss_scale(state)))
        if index % 50 == 49:
            kept.append(
                np.array_equal(np.array(params["w"]).view(np.uint16), before.view(np.uint16))
            )
    assert stepped._cache_size() == 1  # the state comes back with the types it went in
    return params, state, decisions, scales, kept


def test_bfloat16_weights_with_kahan_summation_on_a_gpu_over_200_donated_steps():
    """The GPU form with bfloat16 weights inside `loss_scaled`: every NaN batch skipped with
    the weights kept bit for bit, and the CPU form's decisions, scales and counts exactly;
    the weights and their float32 buffers to within one bfloat16 rounding."""
    cpu = _bf16_kahan_run()
    gpu = in_the_gpu_form(_bf16_kahan_run)
    params, state, decisions, scales, kept = gpu
    assert decisions == cpu[2]
    assert [index for index, applied in enumerate(decisions) if not applied] == [49, 99, 149, 199]
    assert scales == cpu[3]
    assert kept == [True] * 4
    assert params["w"].dtype == jnp.bfloat16
    assert_bits_equal(state.loss_scale_state, cpu[1].loss_scale_state)
    assert_bits_equal(state.stats[1:], cpu[1].stats[1:])
    np.testing.assert_allclose(
        np.asarray(params["w"], np.float32), np.asarray(cpu[0]["w"], np.float32), rtol=2**-7
    )
