"""Apply or skip (`_skip`): a skip by `cond` or by selects, bit for bit alike; inner states
that change dtype across an update, joined into the dtype that holds the old and the new
values exactly, as bare optax accepts them, at init as on a skip."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._skip import (
    Operands,
    holds_exactly,
    skip_by_cond,
    skipped_by_selects,
    skips_by_select,
)

from helpers import assert_bits_equal, device_array

MIXED_INNERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "sgd_nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3),
}


def assert_close_in_dtype(actual, expected, eps):
    """Equal dtypes, and values within 4 `eps` (0 for integer leaves)."""
    chex.assert_trees_all_equal_dtypes(actual, expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        rtol = 4 * float(eps) if jnp.issubdtype(e.dtype, jnp.floating) else 0
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol)


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("make_inner", MIXED_INNERS.values(), ids=MIXED_INNERS.keys())
def test_half_precision_params_with_float32_grads_work_as_bare_optax(make_inner, param_dtype):
    inner = make_inner()
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(initial_loss_scale=2.0**8))
    params = {
        "w": device_array([1.0, -2.0, 0.5], param_dtype),
        "b": device_array(0.25, param_dtype),
    }
    true_grads = [
        {"w": device_array([0.5, -0.25, 2.0]), "b": jnp.float32(-1.0)},
        {"w": device_array([np.inf, 0.0, 1.0]), "b": jnp.float32(1.0)},  # skipped
        {"w": device_array([0.125, 0.75, -1.5]), "b": jnp.float32(0.5)},
    ]
    opt_state = tx.init(params)
    # float16 gradients are unscaled to float32: the inner state is made float32 for them.
    gradient_dtype = jnp.float32 if param_dtype == jnp.float16 else param_dtype
    inner_init = inner.init(jax.tree.map(lambda p: p.astype(gradient_dtype), params))
    chex.assert_trees_all_equal(opt_state.inner_state, inner_init, strict=True)
    for step, grads in enumerate(true_grads):
        scale = jls.get_loss_scale(opt_state)
        scaled = jax.tree.map(lambda g, scale=scale: g * scale, grads)
        before = opt_state
        updates, opt_state = tx.update(scaled, opt_state, params)
        if step == 1:
            # The skip returns the state as it was, in the dtype the inner update gives.
            assert_bits_equal(optax.apply_updates(params, updates), params)
            chex.assert_trees_all_equal(opt_state.inner_state, before.inner_state, strict=False)
            chex.assert_trees_all_equal_dtypes(opt_state.inner_state, before.inner_state)
            continue
        ref_updates, ref_state = inner.update(grads, before.inner_state, params)
        # The dtypes of bare optax, and its values to a few ulps of the params' dtype: the
        # wrapper's inner update is compiled inside a cond, where XLA computes half-precision
        # intermediates in float32 and rounds once, where bare optax eagerly rounds each.
        assert_close_in_dtype(
            (updates, opt_state.inner_state), (ref_updates, ref_state), jnp.finfo(param_dtype).eps
        )
        params = optax.apply_updates(params, updates)
    chex.assert_trees_all_equal_dtypes(params, {"w": param_dtype(0), "b": param_dtype(0)})
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 1


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16])
def test_first_step_skipped_keeps_the_half_precision_state_values_as_float32(param_dtype):
    """A running mean of the gradients started at the params: its dtype widens on update."""

    def init(params):
        return {"mean": jax.tree.map(jnp.copy, params)}

    def update(updates, state, params=None):
        mean = jax.tree.map(lambda m, g: 0.5 * m + 0.5 * g, state["mean"], updates)
        return updates, {"mean": mean}

    tx = jls.loss_scaled(optax.GradientTransformation(init, update), jls.DynamicLossScale())
    params = {"w": device_array([1.0, -3.5, 2.0**-10, -0.0], param_dtype)}
    step = jax.jit(tx.update, donate_argnums=(1,))
    updates, opt_state = step({"w": device_array([1.0, np.nan, 0.0, 0.0])}, tx.init(params), params)
    assert_bits_equal(opt_state.inner_state, {"mean": {"w": params["w"].astype(jnp.float32)}})
    assert_bits_equal(updates, {"w": jnp.full(4, -0.0)})
    scale = jls.get_loss_scale(opt_state)
    _, opt_state = step({"w": jnp.full(4, 2.0) * scale}, opt_state, params)
    expected = 0.5 * params["w"].astype(jnp.float32) + 1.0
    assert_bits_equal(opt_state.inner_state, {"mean": {"w": expected}})


def _narrowing_inner():
    """An inner whose float32 state comes back bfloat16 from each update."""

    def init(params):
        return {"last": jnp.full(2, 1 + 2.0**-20, jnp.float32)}

    def update(updates, state, params=None):
        return updates, {"last": updates["w"].astype(jnp.bfloat16)}

    return optax.GradientTransformation(init, update)


def test_a_state_that_narrows_is_kept_in_the_dtype_that_holds_both(jit_or_eager):
    tx = jls.loss_scaled(_narrowing_inner(), jls.FixedLossScale(1.0))
    dynamic = jls.loss_scaled(_narrowing_inner(), jls.DynamicLossScale(1.0))
    params = {"w": jnp.zeros(2)}
    _, state = jit_or_eager(tx.update, {"w": jnp.array([1.5, 3.0])}, tx.init(params), params)
    assert_bits_equal(state.inner_state, {"last": jnp.array([1.5, 3.0], jnp.float32)})
    initial = dynamic.init(params)
    _, skipped = jit_or_eager(dynamic.update, {"w": jnp.array([jnp.inf, 0.0])}, initial, params)
    assert_bits_equal(skipped.inner_state, initial.inner_state)  # 1 + 2**-20 kept in float32


def _summing_inner():
    """An inner whose state starts as a Python number and sums the gradients into it."""

    def init(params):
        return {"total": jnp.asarray(0.5)}  # weakly typed float32

    def update(updates, state, params=None):
        return updates, {"total": state["total"] + jnp.sum(updates["w"])}

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
def test_a_weakly_typed_inner_state_leaf_takes_the_dtype_bare_optax_gives_it(
    jit_or_eager, grad_dtype
):
    inner = _summing_inner()
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(1.0))
    params = {"w": jnp.zeros(2, grad_dtype)}
    state = tx.init(params)
    assert state.inner_state["total"].weak_type
    grads = {"w": jnp.array([1.0, 2.0], grad_dtype)}
    _, bare = jit_or_eager(inner.update, grads, inner.init(params), params)
    assert not bare["total"].weak_type
    assert bare["total"].dtype == grad_dtype
    _, applied = jit_or_eager(tx.update, grads, state, params)
    chex.assert_trees_all_equal(applied.inner_state, bare, strict=True)
    bad = {"w": jnp.array([jnp.nan, 1.0], grad_dtype)}
    _, skipped = jit_or_eager(tx.update, bad, state, params)
    chex.assert_trees_all_equal(skipped.inner_state, {"total": grad_dtype(0.5)}, strict=True)


def test_a_float8_state_widened_by_the_update_is_kept_exactly_on_a_skip(jit_or_eager):
    """An inner that keeps a float8 state and returns it as bfloat16 (no implicit promotion)."""

    def init(params):
        return {"last": jnp.array([448.0, -0.015625, 0.0], jnp.float8_e4m3fn)}

    def update(updates, state, params=None):
        return updates, {"last": updates["w"].astype(jnp.bfloat16)}

    tx = jls.loss_scaled(optax.GradientTransformation(init, update), jls.DynamicLossScale(1.0))
    params = {"w": jnp.zeros(3)}
    initial = tx.init(params)
    _, skipped = jit_or_eager(tx.update, {"w": jnp.array([jnp.nan, 0.0, 0.0])}, initial, params)
    expected = {"last": jnp.array([448.0, -0.015625, 0.0], jnp.bfloat16)}
    assert_bits_equal(skipped.inner_state, expected)
    _, applied = jit_or_eager(tx.update, {"w": jnp.array([1.5, 2.0, -3.0])}, initial, params)
    assert_bits_equal(applied.inner_state, {"last": jnp.array([1.5, 2.0, -3.0], jnp.bfloat16)})


@pytest.mark.parametrize(
    ("dtype", "other", "holds"),
    [
        (jnp.float32, jnp.bfloat16, True),
        (jnp.bfloat16, jnp.float32, False),
        (jnp.float16, jnp.bfloat16, False),  # fewer exponent bits
        (jnp.bfloat16, jnp.float16, False),  # fewer mantissa bits
        (jnp.bfloat16, jnp.float8_e4m3fn, True),
        (jnp.float16, jnp.float8_e5m2, True),
        (jnp.float8_e4m3fn, jnp.float8_e5m2, False),  # no infinity, smaller range
        (jnp.float8_e4m3fn, jnp.int8, False),  # 127 needs 7 significant bits
        (jnp.float32, jnp.int16, True),
        (jnp.float32, jnp.int32, False),
        (jnp.int32, jnp.int8, True),
        (jnp.float16, jnp.bool_, True),
        (jnp.complex64, jnp.float32, True),
        (jnp.float32, jnp.complex64, False),
    ],
)
def test_which_dtype_holds_another_exactly(dtype, other, holds):
    assert holds_exactly(dtype, other) is holds


def test_a_state_leaf_no_dtype_holds_exactly_is_refused_naming_it():
    def init(params):
        return {"total": jnp.zeros([], jnp.float32)}

    def update(updates, state, params=None):
        return updates, {"total": state["total"].astype(jnp.int32) + 1}

    tx = jls.loss_scaled(optax.GradientTransformation(init, update), jls.DynamicLossScale())
    params = {"w": jnp.zeros(2)}
    with pytest.raises(
        TypeError,
        match=re.escape(
            "loss_scaled.update: inner.update turns the state leaf at ['total'] from float32 "
            "into int32, and no dtype holds the values of both exactly, so a skipped step could "
            "not keep it"
        ),
    ):
        tx.update({"w": jnp.ones(2)}, tx.init(params), params)


def test_adam_on_integer_params_runs_as_bare_adam_does_and_skips():
    """optax.adam's moments of an integer param start as int32 zeros (`zeros_like`) and are
    float32 after a step: bare adam takes that, and loss_scaled refused it ("from int32 into
    float32 ... a skipped step could not keep it"). The state takes float32, as bare's does."""
    params = {"w": jnp.array([1.0, 2.0]), "i": jnp.array([3, 4])}
    grads = {"w": jnp.array([0.5, -1.0]), "i": jnp.zeros(2, jnp.int32)}
    bare = optax.adam(0.1)
    expected, bare_state = jax.jit(bare.update)(grads, bare.init(params), params)
    tx = jls.loss_scaled(optax.adam(0.1), jls.DynamicLossScale(2.0))
    step = jax.jit(tx.update, donate_argnums=1)
    scaled = {"w": grads["w"] * 2.0, "i": grads["i"]}
    updates, opt_state = step(scaled, tx.init(params), params)
    chex.assert_trees_all_equal(updates, expected)
    chex.assert_trees_all_equal(opt_state.inner_state, bare_state)
    before = jax.tree.map(np.array, opt_state.inner_state)
    bad = {"w": jnp.array([jnp.inf, 1.0]), "i": grads["i"]}
    updates, opt_state = step(bad, opt_state, params)
    assert_bits_equal(optax.apply_updates(params, updates), params)
    assert_bits_equal(opt_state.inner_state, before)
    assert float(jls.get_loss_scale(opt_state)) == 1.0


SKIP_FORMS = {
    "sgd": (lambda: optax.sgd(0.1), True),
    "sgd_momentum": (lambda: optax.sgd(0.1, momentum=0.9), True),
    "sgd_nesterov": (lambda: optax.sgd(0.1, momentum=0.9, nesterov=True), True),
    "clipped_sgd_momentum": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9)),
        True,
    ),
    "scheduled_sgd_nesterov": (
        lambda: optax.sgd(optax.cosine_decay_schedule(0.1, 100), momentum=0.9, nesterov=True),
        True,
    ),
    "lion": (lambda: optax.lion(1e-3), True),
    "adam": (lambda: optax.adam(1e-3), False),
    "adamw": (lambda: optax.adamw(1e-3), False),
    "multi_steps_sgd": (lambda: optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), True),
    "multi_steps_sgd_momentum": (
        lambda: optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=2),
        False,
    ),
}


@pytest.mark.parametrize(("make_inner", "by_select"), SKIP_FORMS.values(), ids=SKIP_FORMS.keys())
def test_inner_states_no_larger_than_the_gradients_skip_by_selects(make_inner, by_select):
    """sgd's momentum (and lion's) is one entry per gradient entry, step counts aside:
    selects; adam's two moments, MultiSteps' accumulator beside a momentum, are more: a `cond`."""
    grads = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
    assert skips_by_select(make_inner().init(grads), grads) is by_select


@pytest.mark.parametrize("make_inner", [v[0] for v in SKIP_FORMS.values()], ids=SKIP_FORMS.keys())
def test_a_skip_by_selects_gives_the_bits_of_a_skip_by_cond(make_inner):
    """The two forms of the skip, selects and a `cond`, jitted, on an applied step, a NaN step
    and an inf step: the same updates (-0.0 on a skip) and the same inner state (the old one,
    bit for bit, on a skip)."""
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.full((3,), 0.5)}
    inner = make_inner()
    state = inner.update(params, inner.init(params), params)[1]  # momentum already nonzero

    @jax.jit
    def both(grads, apply):
        operands = Operands(grads, state, params, (jnp.float32(1), jnp.float32(1)), {})

        def update(given):
            return inner.update(given.scaled_grads, given.inner_state, given.params)

        by_selects = skipped_by_selects(apply, *update(operands), state)
        return by_selects, skip_by_cond(update, operands)[0](apply)

    finite = {"w": jnp.full((4, 3), 0.25), "b": jnp.full((3,), -2.0)}
    nan = {"w": finite["w"].at[1, 2].set(jnp.nan), "b": finite["b"]}
    inf = {"w": finite["w"], "b": finite["b"].at[0].set(jnp.inf)}
    for grads, apply in ((finite, True), (nan, False), (inf, False)):
        by_select, by_cond = both(grads, jnp.asarray(apply))
        assert_bits_equal(by_select, by_cond)
        if not apply:
            assert_bits_equal(by_select[1], state)
            assert all(
                np.all(np.signbit(u)) and not np.any(u) for u in jax.tree.leaves(by_select[0])
            )


@pytest.mark.parametrize("jit_or_eager", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_sgd_with_momentum_skips_nan_and_inf_batches_keeping_every_bit(jit_or_eager):
    """Through `loss_scaled` (which skips sgd by selects), donated under jit: the params and
    the momentum after a NaN and an inf batch are those before them, bit for bit, the counters
    say which was which, and the scale halves twice."""
    tx = jls.loss_scaled(
        optax.sgd(0.1, momentum=0.9, nesterov=True), jls.DynamicLossScale(initial_loss_scale=8.0)
    )
    traces = []

    def step(params, opt_state, grads):
        traces.append(None)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(step, donate_argnums=(0, 1)) if jit_or_eager is jax.jit else step
    # Float16 gradients come back float32, so a float16 param's momentum would become float32
    # after the first step (as bare optax makes it from float32 gradients) and retrace.
    params = {"w": device_array([1.0, -2.0, 0.0]), "h": device_array([0.5, -0.5])}
    opt_state = tx.init(params)
    finite = {"w": device_array([8.0, 4.0, -8.0]), "h": device_array([2.0, 8.0], np.float16)}
    params, opt_state = step(params, opt_state, finite)
    before = jax.tree.map(np.asarray, (params, opt_state.inner_state))
    bad_batches = (
        {"w": finite["w"].at[0].set(jnp.nan), "h": finite["h"]},
        {"w": finite["w"], "h": finite["h"].at[1].set(jnp.inf)},
    )
    for grads in bad_batches:
        params, opt_state = step(params, opt_state, grads)
    assert_bits_equal((params, opt_state.inner_state), before)
    stats = jls.get_loss_scale_stats(opt_state)
    assert float(stats.loss_scale) == 2.0
    assert (int(stats.skipped_steps), int(stats.nan_skipped_steps)) == (2, 1)
    assert int(stats.inf_skipped_steps) == 1
    if jit_or_eager is jax.jit:
        assert len(traces) == 1
