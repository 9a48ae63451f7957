"""The two forms of `_platforms`, run on the CPU: the GPU's decides and computes what the
CPU's does.

`jax.lax.platform_dependent` lowers only the form of the platform lowered for; here each form
is passed (`Form.CPU`, `Form.GPU`) to `_loss_scaled.in_form` or to the numerics, so the steps
below run on this CPU what an H100 runs (its program: tests/test_gpu_program.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale import _loss_scaled, _numerics, _platforms
from jax_lossscale._platforms import Form

from helpers import assert_bits_equal, compiled_reductions, device_array

FORMS = (Form.CPU, Form.GPU)


@pytest.mark.parametrize("form", FORMS, ids=lambda form: form.value)
def test_row_sums_are_the_sums_of_the_rows_in_both_forms(form):
    rng = np.random.default_rng(0)
    squares = rng.standard_normal(5000).astype(np.float32) ** 2  # 10 rows of 512, one padded
    sums = jax.jit(_platforms.row_sums, static_argnums=1)(jnp.asarray(squares), form)
    expected = np.add.reduceat(np.pad(squares, (0, 120)).astype(np.float64), range(0, 5120, 512))
    np.testing.assert_allclose(np.asarray(sums), expected, rtol=1e-6)
    for values, kind in [([1.0, np.nan], "nan"), ([np.inf, np.nan], "nan"), ([np.inf, 1.0], "inf")]:
        row = jax.jit(_platforms.row_sums, static_argnums=1)(
            device_array(values + [0.0] * 600), form
        )
        got = "nan" if np.isnan(row[0]) else "inf" if np.isinf(row[0]) else "finite"
        assert got == kind, values


@pytest.mark.parametrize("form", FORMS, ids=lambda form: form.value)
def test_the_check_decides_alike_in_both_forms_an_overflowing_square_included(form):
    """NaN, an infinity, and a finite entry whose square overflows float32 (2e19): not finite
    in both forms (DESIGN 3.1: the wrapper's check counts a squared norm that overflows); a
    1e19 entry, whose square 1e38 does not, finite. `all_finite` stays exact."""
    rng = np.random.default_rng(1)
    tree = {
        "w": jnp.asarray(rng.standard_normal((40, 30)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(7), jnp.float16),
    }
    scale = jnp.float32(2.0**10)
    scaled = jax.tree.map(lambda x: x * scale.astype(x.dtype), tree)

    @jax.jit
    def summary(tree):
        factors = _platforms.reciprocal_factors(scale, form)
        return _numerics.summarize_gradients(tree, None, factors, form)

    exact = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in tree.values()))
    np.testing.assert_allclose(float(summary(scaled).norm), exact, rtol=1e-6)
    for value, finite, has_nan in [
        (np.nan, False, True),
        (np.inf, False, False),
        (2e19 * 2.0**10, False, False),
        (1e19 * 2.0**10, True, False),
    ]:
        bad = {**scaled, "w": scaled["w"].at[3, 4].set(value)}
        check = summary(bad)
        assert (bool(check.finite), bool(check.has_nan)) == (finite, has_nan), value
    overflowing = {**tree, "w": tree["w"].at[0, 0].set(2e19)}
    assert bool(jls.all_finite(overflowing))


def _adam_run(form, grads_per_step):
    tx = _loss_scaled.in_form(
        form, optax.adam(1e-2), jls.DynamicLossScale(initial_loss_scale=2.0**4)
    )

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


def test_adam_on_a_gpu_skips_by_selects_bit_for_bit_as_the_cond_does():
    """The GPU form of the adam step: no `conditional` and no variadic reduction in its
    program, and the same params, inner state, scale and counts, bit for bit, as the CPU's
    `cond` on a finite, a non-finite (inf and NaN) and a finite step; the skipped step's
    updates are -0.0."""
    gpu_history, step = _adam_run(Form.GPU, _adam_grads())
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
    cpu_history, step = _adam_run(Form.CPU, _adam_grads())
    args = (*jax.tree.map(jnp.asarray, cpu_history[0][:2]), _adam_grads()[0])
    assert "conditional(" in step.lower(*args).compile().as_text()
    gpu_history, _ = _adam_run(Form.GPU, _adam_grads())
    for cpu, gpu in zip(cpu_history, gpu_history, strict=True):
        assert_bits_equal(gpu[1].loss_scale_state, cpu[1].loss_scale_state)
        assert_bits_equal(gpu[1].stats[1:], cpu[1].stats[1:])  # after grad_norm
        for gpu_leaf, cpu_leaf in zip(jax.tree.leaves(gpu), jax.tree.leaves(cpu), strict=True):
            np.testing.assert_allclose(gpu_leaf, cpu_leaf, rtol=1e-6, atol=1e-9)


def test_the_reciprocal_factors_on_a_gpu_are_the_cpu_ones_bit_for_bit():
    divisors = np.array([1.0, 3.0, 0.7, 2.0**-10, 2.0**15, 1e38, 2.0**127, 3.4e38], np.float32)
    cpu = [(1 / np.minimum(d, np.float32(2.0**126)), np.minimum(d, 2.0**126) / d) for d in divisors]
    gpu = jax.jit(jax.vmap(lambda d: _platforms.reciprocal_factors(d, Form.GPU)))(
        jnp.asarray(divisors)
    )
    apart = jax.jit(jax.vmap(lambda d: _platforms.reciprocal_factors(d, Form.CPU)))(
        jnp.asarray(divisors)
    )
    assert_bits_equal(gpu, apart)
    assert_bits_equal(gpu[0], np.array([r for r, _ in cpu], np.float32))
    assert_bits_equal(gpu[1], np.array([c for _, c in cpu], np.float32))
    assert float(gpu[1][-2]) == 0.5  # 2**127: bounded at 2**126, then corrected by a half


def test_the_scalars_read_together_on_a_gpu_keep_their_bits_and_types():
    """Every 32-bit scalar and boolean goes through the stacked bits and comes back bit for
    bit (a NaN's payload, -0.0, a subnormal, a negative count, true and false); everything
    else is left as it was."""
    nan_with_payload = np.array(0x7FC01234, np.uint32).view(np.float32)
    tree = {
        "scale": jnp.float32(-0.0),
        "nan": jnp.asarray(nan_with_payload),
        "tiny": jnp.float32(1e-45),
        "count": jnp.int32(-7),
        "bits": jnp.uint32(0xFFFFFFFF),
        "half": jnp.float16(3.0),
        "flag": jnp.bool_(True),
        "unset": jnp.bool_(False),
        "vector": jnp.arange(3.0),
        "weak": jnp.asarray(2.0),  # weakly typed: left out, its type would come back strong
        "key": jax.random.key(0),
        "none": None,
    }
    read_together = jax.jit(lambda tree: _platforms.scalars_read_together(tree, Form.GPU))
    out = read_together(tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for name, leaf in tree.items():
        if leaf is not None:
            assert jax.typeof(out[name]) == jax.typeof(leaf), name
            got, expected = out[name], leaf
            if name == "key":
                got, expected = jax.random.key_data(got), jax.random.key_data(expected)
            assert_bits_equal(got, expected)
    jaxpr = jax.make_jaxpr(lambda tree: _platforms.scalars_read_together(tree, Form.GPU))(tree)
    [stacked] = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "optimization_barrier"]
    assert stacked.outvars[0].aval.shape == (7,)  # scale, nan, tiny, count, bits, flag, unset


def test_the_scalars_read_together_under_shard_map_keep_their_varying_axes():
    """Inside `shard_map`, a scalar that varies over the devices and one that does not are
    stacked apart, and each comes back with its own type."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))

    def body(x):
        varying = jnp.sum(x).astype(jnp.int32)
        tree = {"a": jnp.float32(1.5), "b": jnp.int32(4), "c": varying, "d": varying * 2}
        out = _platforms.scalars_read_together(tree, Form.GPU)
        for name in tree:
            assert jax.typeof(out[name]) == jax.typeof(tree[name]), name
        return jnp.stack([out["a"].astype(jnp.int32), out["b"], out["c"], out["d"]])[None]

    spec = jax.sharding.PartitionSpec("d")
    result = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(jnp.arange(4.0))
    np.testing.assert_array_equal(result, [[1, 4, 1, 2], [1, 4, 5, 10]])


def _pmapped_spike_run(form):
    """A pmap'ed adamw step over 2 devices, with spike skipping (the loss passed as `value`):
    finite steps, a NaN on one device, more finite steps (the windows fill), then a finite
    spike of 100x the norm and the loss."""
    tx = _loss_scaled.in_form(
        form,
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
    cpu = _pmapped_spike_run(Form.CPU)
    gpu = _pmapped_spike_run(Form.GPU)
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


def _bf16_kahan_run(form, steps=200, state_dtype=None):
    """bfloat16 params under `loss_scaled(chain(adamw, kahan_summation()))`, adamw's state
    stored in `state_dtype` by `low_precision_state` where given, the step jitted with params
    and state donated, the scale given as a jnp array; a NaN batch every 50th step. Returns
    the params and state after the last step, each step's decision and scale, and whether
    each NaN step kept the params and the inner state bit for bit."""
    adamw = optax.adamw(1e-3)
    if state_dtype is not None:
        adamw = jls.low_precision_state(adamw, state_dtype, key=jax.random.key(3))
    tx = _loss_scaled.in_form(
        form,
        optax.chain(adamw, jls.kahan_summation()),
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
            before = jax.tree.map(np.array, (params, state.inner_state))
        params, state = stepped(params, state, batch)
        decisions.append(bool(state.stats.last_step_applied))
        scales.append(float(jls.get_loss_scale(state)))
        if index % 50 == 49:
            after = jax.tree.map(np.array, (params, state.inner_state))
            kept.append(
                all(
                    np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
                    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
                )
            )
    assert stepped._cache_size() == 1  # the state comes back with the types it went in
    return params, state, decisions, scales, kept


def test_bfloat16_weights_with_kahan_summation_on_a_gpu_over_200_donated_steps():
    """The GPU form with bfloat16 weights inside `loss_scaled`: every NaN batch skipped with
    the weights kept bit for bit, and the CPU form's decisions, scales and counts exactly;
    the weights and their float32 buffers to within one bfloat16 rounding."""
    cpu = _bf16_kahan_run(Form.CPU)
    gpu = _bf16_kahan_run(Form.GPU)
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


def test_bfloat16_weights_with_kahan_and_a_bfloat16_adamw_state_on_a_gpu_over_300_steps():
    """Both bfloat16 remedies inside `loss_scaled` in the GPU form, whose step reads the
    inner state's scalars (adamw's count, the stored dtypes' counts) out of one vector: 300
    donated steps, every NaN batch skipped with the params, the bfloat16 moments, the
    rounding key and the Kahan buffers kept bit for bit, and the CPU form's decisions,
    scales and counts exactly."""
    cpu = _bf16_kahan_run(Form.CPU, steps=300, state_dtype=jnp.bfloat16)
    params, state, decisions, scales, kept = _bf16_kahan_run(
        Form.GPU, steps=300, state_dtype=jnp.bfloat16
    )
    assert decisions == cpu[2]
    skipped = [index for index, applied in enumerate(decisions) if not applied]
    assert skipped == [49, 99, 149, 199, 249, 299]
    assert scales == cpu[3]
    assert scales[-1] == 2.0**10 * 2.0**-6 * 2.0**12  # six back-offs, a growth per 20 applied
    assert kept == [True] * 6
    low_precision, kahan = state.inner_state
    assert {k: int(v) for k, v in low_precision.stored_in.items()} == {"bfloat16": 2}
    assert int(low_precision.inner_state[0].count) == 300 - 6
    assert {k: int(v) for k, v in kahan.stored_in.items()} == {"int16": 1}  # the low bits
    assert_bits_equal(state.loss_scale_state, cpu[1].loss_scale_state)
    assert_bits_equal(state.stats[1:], cpu[1].stats[1:])
    np.testing.assert_allclose(
        np.asarray(params["w"], np.float32), np.asarray(cpu[0]["w"], np.float32), rtol=2**-7
    )


def _nnx_run(form, steps=120):
    """A flax nnx model under `nnx.Optimizer(model, loss_scaled(adam))` in `form`, the step
    built once with `nnx.jit(donate_argnums=(0, 1))`, its gradients from `jls.value_and_grad`
    of a float16 loss; a NaN batch every 40th step. Returns each step's decision and scale,
    whether each NaN step kept the params and the inner state bit for bit, the final state,
    and the step's trace count."""
    from flax import nnx

    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    scale = jls.DynamicLossScale(initial_loss_scale=2.0**12, increment_period=25)
    tx = _loss_scaled.in_form(form, optax.adam(1e-2), scale)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    traces = []

    @nnx.jit(donate_argnums=(0, 1))
    def step(model, optimizer, x, y):
        traces.append(None)

        def loss_fn(model):
            return jnp.mean((model(x).astype(jnp.float16) - y) ** 2)

        loss, grads = jls.value_and_grad(loss_fn, optimizer)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    decisions, scales, kept = [], [], []
    for index in range(steps):
        x = rng.standard_normal((8, 4)).astype(np.float32)
        if index % 40 == 39:
            x[index % 8, 1] = np.nan
            before = jax.tree.map(np.array, nnx.state((model, optimizer)))
        step(model, optimizer, x, jnp.ones((8, 2), jnp.float16))
        state = nnx.as_pure(optimizer.opt_state)
        decisions.append(bool(state.stats.last_step_applied))
        scales.append(float(jls.get_loss_scale(optimizer)))
        if index % 40 == 39:
            after = jax.tree.map(np.array, nnx.state((model, optimizer)))
            params_and_moments = [
                np.array_equal(a, b)
                for a, b in zip(
                    jax.tree.leaves((before[0], before[1]["opt_state"]["inner_state"])),
                    jax.tree.leaves((after[0], after[1]["opt_state"]["inner_state"])),
                    strict=True,
                )
            ]
            kept.append(all(params_and_moments))
    return decisions, scales, kept, nnx.as_pure(optimizer.opt_state), len(traces)


def test_a_flax_nnx_optimizer_with_donation_on_a_gpu_decides_as_the_cpu_form():
    """The GPU form, whose step reads the state's scalars out of one vector, through flax nnx:
    one trace over 120 donated steps, each NaN batch skipped with the params and adam's
    moments kept bit for bit, and the CPU form's decisions, scales and counts exactly."""
    cpu = _nnx_run(Form.CPU)
    decisions, scales, kept, state, traces = _nnx_run(Form.GPU)
    assert traces == 1
    assert decisions == cpu[0]
    assert [index for index, applied in enumerate(decisions) if not applied] == [39, 79, 119]
    assert scales == cpu[1]
    assert (scales[24], scales[39], scales[64], scales[-1]) == (2.0**13, 2.0**12, 2.0**13, 2.0**12)
    assert kept == [True, True, True]
    assert int(state.inner_state[0].count) == 117
    assert_bits_equal(state.loss_scale_state, cpu[3].loss_scale_state)
    assert_bits_equal(state.stats[1:], cpu[3].stats[1:])
