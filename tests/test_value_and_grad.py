"""`jls.value_and_grad`: the loss as `fun` returns it, bit for bit, and the gradients of the loss
times the scale, the product taken in float32.

Also: two faults of mpx 0.1.8's `filter_value_and_grad` (Data-Science-in-Mechanical-
Engineering/mixed_precision_for_JAX, mpx/_loss_scaling.py and mpx/_grad_tools.py) shown not to
happen here: (a) mpx takes loss * scale with the scale cast to float16, so for a float16 loss of
10 at a scale of 2**15 the scaled loss is inf, and so is the value it returns (the scaled loss
unscaled); (b) mpx unscales the gradients by the scale after its update, so on a growth step
the gradients it returns are half the true ones.
"""

import functools
import re

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_lossscale as jls

from helpers import ReferenceLossScale, assert_bits_equal, bits, device_array

F16, F32 = jnp.float16, jnp.float32
POLICY = jls.get_policy("p=f32,c=f16,o=f32")


def exactly(message):
    """A `match` pattern for exactly `message`."""
    return f"^{re.escape(message)}$"


def small_params():
    return {
        "w": device_array([[0.5, -1.0, 0.25], [1.5, 0.75, -0.5]]),
        "b": device_array([0.125, -0.25, 0.5]),
    }


def small_batch():
    x = device_array([[1.0, -2.0], [0.5, 0.25], [-1.5, 3.0], [2.0, 1.0]])
    y = device_array([[0.5, 0.0, -1.0], [1.0, 1.0, 0.0], [0.0, -0.5, 0.5], [1.5, 0.0, 0.25]])
    return x, y


def loss_in(dtype):
    """A squared error computed in `dtype`: params and inputs cast to it."""

    def loss(params, x, y):
        params, x, y = jls.cast_tree((params, x, y), dtype)
        out = jnp.tanh(x @ params["w"] + params["b"])
        return jnp.mean((out - y) ** 2)

    return loss


def dynamic_tx(inner=None, **kwargs):
    loss_scale = jls.DynamicLossScale(**{"initial_loss_scale": 2.0**10, **kwargs})
    return jls.loss_scaled(inner or optax.sgd(0.1), loss_scale), loss_scale


# --- the value, bit for bit; the gradients, exactly -------------------------------------------


@pytest.mark.parametrize("dtype", [F16, jnp.bfloat16, F32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("scale", [1.0, 2.0**10, 2.0**15, 3.0])
def test_value_is_funs_own_and_grads_those_of_value_times_scale_in_float32(
    dtype, scale, jit_or_eager
):
    tx, _ = dynamic_tx(initial_loss_scale=scale)
    params, (x, y) = small_params(), small_batch()
    opt_state = tx.init(params)
    fun = loss_in(dtype)

    # A float32 loss's backward pass starts from the scale; a half one's from the largest power
    # of two in it (3.0 = 2 * 1.5), and the gradients are times the rest in float32.
    power = scale if dtype == F32 else {3.0: 2.0}.get(scale, scale)

    # `power` an argument, not a constant: jitted, one program per dtype, not per scale.
    def both(params, opt_state, x, y, power):
        value, grads = jls.value_and_grad(fun, opt_state)(params, x, y)
        own = fun(params, x, y)
        s = jls.get_loss_scale(opt_state)
        expected = jax.grad(lambda p: fun(p, x, y).astype(F32) * power)(params)
        expected = jax.tree.map(lambda g: g * (s / power), expected)
        return value, own, grads, expected

    value, own, grads, expected = jit_or_eager(both, params, opt_state, x, y, power)
    assert value.dtype == dtype
    assert np.asarray(value).tobytes() == np.asarray(own).tobytes()
    assert_bits_equal(grads, expected)
    assert_bits_equal(grads, jax.tree.map(lambda g: g.astype(F32), grads))  # float32 params


def half_loss_steps(dtype, loss_scale, x=None):
    """sgd(1.0) on sum(w * x) in `dtype` (true gradients x): an overflow, then a step.
    Returns x, the scale of that step, its scaled gradients and its updates."""
    x = jnp.array([1.0, 0.5, 3.0, -2.0, 0.375], F32) if x is None else x
    fun = lambda w, x: jnp.sum(w.astype(dtype) * x.astype(dtype))  # noqa: E731
    tx = jls.loss_scaled(optax.sgd(1.0), loss_scale)
    params = jnp.zeros(5, F32)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x):
        _, grads = jls.value_and_grad(fun, opt_state)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads, updates

    params, opt_state, _, _ = step(params, opt_state, x.at[0].set(jnp.inf))
    scale = jls.get_loss_scale(opt_state)
    params, opt_state, grads, updates = step(params, opt_state, x)
    return x, scale, grads, updates


@pytest.mark.parametrize("dtype", [jnp.bfloat16, F16], ids=["bf16", "f16"])
def test_a_half_loss_and_a_scale_not_a_power_of_two_give_the_true_updates(dtype):
    """backoff_factor=0.7: after the overflow the scale is 22937.6. The backward pass started
    from the scale rounded to bfloat16 (22912) while loss_scaled unscaled by 22937.6: every
    update was 0.99888 of the true one. Now the gradients are those of loss * 22937.6."""
    loss_scale = jls.DynamicLossScale(2.0**15, backoff_factor=0.7)
    x, scale, grads, updates = half_loss_steps(dtype, loss_scale)
    assert float(scale) == float(np.float32(2.0**15 * 0.7)) == 22937.599609375
    assert float(jnp.bfloat16(scale)) == 22912.0  # where the backward pass started before
    assert_bits_equal(grads, x * scale)  # the float32 product, exactly
    chex.assert_trees_all_close(updates, -x, rtol=2e-7)  # was -x * 0.99888


@pytest.mark.parametrize("scale", [2.0**16, 3 * 2.0**15, 2.0**20 * 0.7])
def test_a_float16_loss_and_a_scale_beyond_float16_give_finite_gradients(scale):
    """A float16 loss with a scale of 2**16 or more: the backward pass started from the scale
    in float16, inf, and every gradient was inf. It starts from 2**15 now, times the rest."""
    assert jnp.isinf(jnp.float16(scale))
    x = jnp.array([1.0, 0.5, 1.5, -1.25, 0.375], F32)  # times 2**15, within float16
    fun = lambda w: jnp.sum(w.astype(F16) * x.astype(F16))  # noqa: E731
    value, grads = jls.value_and_grad(fun, jnp.float32(scale))(jnp.ones(5, F32))
    assert value.dtype == F16
    assert float(value) == 2.125
    assert_bits_equal(grads, x * jnp.float32(scale))
    # and through loss_scaled, with a scale held at it: the true updates
    held = jls.DynamicLossScale(scale, min_loss_scale=scale, max_loss_scale=scale)
    x, held_scale, grads, updates = half_loss_steps(F16, held, x)
    assert float(held_scale) == float(np.float32(scale))
    assert_bits_equal(grads, x * jnp.float32(scale))
    chex.assert_trees_all_close(updates, -x, rtol=2e-7)


@pytest.mark.parametrize("scale", [2.0**16, 3.0])
def test_a_complex_leaf_gets_the_rest_of_the_scale_as_a_real_one_does(scale):
    """A float16 loss at 2**16: the backward pass starts from 2**15 and the rest, 2, multiplies
    the gradients. A complex64 leaf was left at half its scaled gradient, and its update at
    half of optax's."""
    params = {"c": jnp.array([1 + 2j, -0.5 + 0.25j], jnp.complex64), "w": jnp.array([1.0], F32)}

    def fun(p):
        return (jnp.sum(jnp.abs(p["c"]) ** 2) + jnp.sum(p["w"] ** 2)).astype(F16)

    _, grads = jls.value_and_grad(fun, jnp.float32(scale))(params)
    true = jax.grad(lambda p: fun(p).astype(F32))(params)
    assert grads["c"].dtype == jnp.complex64
    assert_bits_equal(grads, jax.tree.map(lambda g: g * jnp.float32(scale), true))
    held = jls.DynamicLossScale(scale, min_loss_scale=scale, max_loss_scale=scale)
    tx = jls.loss_scaled(optax.sgd(0.1), held)
    opt_state = tx.init(params)
    _, grads = jls.value_and_grad(fun, opt_state)(params)
    updates, _ = jax.jit(tx.update)(grads, opt_state, params)
    expected, _ = optax.sgd(0.1).update(true, optax.sgd(0.1).init(params))
    chex.assert_trees_all_close(updates, expected, rtol=1e-6)  # "c" was half of it
    np.testing.assert_allclose(np.asarray(updates["c"]), [-0.2 + 0.4j, 0.1 + 0.05j], rtol=1e-6)


def test_value_of_a_float16_loss_stays_float16_and_is_not_rounded_through_the_scale():
    """The value is `fun`'s float16 value, not one recovered from the scaled float32 product."""
    fun = lambda p: jnp.sum(p.astype(F16))  # noqa: E731
    params = jnp.array([1.0, 2.0**-10], F32)
    value, grads = jls.value_and_grad(fun, jnp.float32(3.0))(params)
    assert value.dtype == F16
    assert np.asarray(value).tobytes() == np.asarray(jnp.float16(1.0 + 2.0**-10)).tobytes()
    assert_bits_equal(grads, jnp.array([3.0, 3.0], F32))


# --- mpx's two faults -------------------------------------------------------------------------


def test_a_float16_loss_of_10_at_scale_2_15_gives_finite_gradients():
    """mpx's fault (a): its loss * scale is taken in float16, where 10 * 2**15 is inf. Here the
    product is taken in float32: the value is 10, the scaled gradients 2**15, the update -1."""
    assert jnp.isinf(jnp.float16(10) * jnp.float16(2**15))  # the trap

    fun = lambda p: jnp.sum(p["w"].astype(F16))  # noqa: E731  true gradients: all 1
    params = {"w": jnp.array([1.0, 2.0, 3.0, 4.0], F32)}
    tx, _ = dynamic_tx(optax.sgd(1.0), initial_loss_scale=2.0**15)
    opt_state = tx.init(params)
    value, grads = jax.jit(lambda p, s: jls.value_and_grad(fun, s)(p))(params, opt_state)
    assert value.dtype == F16
    assert float(value) == 10.0
    chex.assert_tree_all_finite(grads)
    assert_bits_equal(grads, {"w": jnp.full(4, 2.0**15, F32)})
    updates, opt_state = tx.update(grads, opt_state, params)
    assert_bits_equal(updates, {"w": jnp.full(4, -1.0, F32)})
    assert bool(jls.get_loss_scale_stats(opt_state).last_step_applied)


def test_on_growth_steps_the_gradients_applied_are_the_true_ones():
    """mpx's fault (b): it unscales by the grown scale, applying half the true gradients. Here
    the scale doubles on every step and sgd(1.0)'s updates are -true_grad exactly each time."""
    x = jnp.array([0.75, -1.5, 3.0, 0.125], F32)
    fun = lambda p, x: jnp.sum(p["w"].astype(F16) * x.astype(F16))  # noqa: E731
    params = {"w": jnp.array([1.0, 0.5, -0.25, 2.0], F32)}
    true_grad = jax.grad(lambda p: fun(p, x).astype(F32))(params)
    assert_bits_equal(true_grad, {"w": x})
    tx, _ = dynamic_tx(optax.sgd(1.0), initial_loss_scale=2.0**4, increment_period=1)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        _, grads = jls.value_and_grad(fun, opt_state)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, updates

    scales = []
    for _ in range(8):
        params, opt_state, updates = step(params, opt_state)
        assert_bits_equal(updates, jax.tree.map(jnp.negative, true_grad))
        scales.append(float(jls.get_loss_scale(opt_state)))
    assert scales == [2.0**k for k in range(5, 13)]  # a growth on every step


# --- where the scale comes from ---------------------------------------------------------------


def test_opt_state_an_optax_state_with_loss_scaled_inside_a_chain():
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale(initial_loss_scale=64.0)),
    )
    params, (x, y) = small_params(), small_batch()
    opt_state = tx.init(params)
    fun = loss_in(F16)
    _, grads = jls.value_and_grad(fun, opt_state)(params, x, y)
    expected = jax.grad(lambda p: fun(p, x, y).astype(F32) * 64.0)(params)
    assert_bits_equal(grads, expected)


def nnx_forms(inner):
    """A model, and its optimizer as the three forms `get_loss_scale` takes."""
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(initial_loss_scale=128.0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    forms = {
        "optimizer": optimizer,
        "opt_state": optimizer.opt_state,
        "nnx.state": nnx.state(optimizer),
    }
    return model, forms


def check_nnx_form(model, opt_state):
    x, y = small_batch()
    fun = lambda m, x, y: jnp.mean((m(x.astype(F16)) - y) ** 2)  # noqa: E731
    value, grads = jls.value_and_grad(fun, opt_state, using=nnx.value_and_grad)(model, x, y)
    expected_value, expected = nnx.value_and_grad(lambda m: fun(m, x, y) * 128.0)(model)
    assert value == fun(model, x, y)
    assert expected_value == value * 128.0
    assert_bits_equal(nnx.to_pure_dict(grads), nnx.to_pure_dict(expected))


@pytest.mark.parametrize("form", ["optimizer", "opt_state", "nnx.state"])
def test_opt_state_a_flax_nnx_optimizer(form):
    model, forms = nnx_forms(optax.adam(1e-3))
    check_nnx_form(model, forms[form])


@pytest.mark.parametrize("form", ["optimizer", "opt_state", "nnx.state"])
def test_opt_state_a_flax_nnx_optimizer_whose_inner_state_is_empty(form):
    """With optax.sgd (no momentum) inside, `nnx.state(optimizer)` holds no `inner_state`: nnx
    drops the leafless EmptyState. The nnx.state form fails (library bug, reported): the lookup
    wants inner_state, loss_scale_state and stats all present."""
    model, forms = nnx_forms(optax.sgd(0.1))
    check_nnx_form(model, forms[form])


@pytest.mark.parametrize(
    "scale", [jnp.float32(8.0), np.float32(8.0), np.array(8.0, np.float32)], ids=type
)
def test_opt_state_the_scale_itself(scale):
    params, (x, y) = small_params(), small_batch()
    fun = loss_in(F16)
    value, grads = jls.value_and_grad(fun, scale)(params, x, y)
    assert value == fun(params, x, y)
    assert_bits_equal(grads, jax.grad(lambda p: fun(p, x, y).astype(F32) * 8.0)(params))


def test_fun_not_callable_is_a_type_error():
    with pytest.raises(TypeError, match=exactly("value_and_grad(fun=3): fun must be callable")):
        jls.value_and_grad(3, jnp.float32(1.0))


def test_using_not_callable_is_a_type_error():
    message = (
        "value_and_grad(using='jax'): using must be a value-and-grad transformation such as "
        "jax.value_and_grad or eqx.filter_value_and_grad"
    )
    with pytest.raises(TypeError, match=exactly(message)):
        jls.value_and_grad(jnp.sum, jnp.float32(1.0), using="jax")


@pytest.mark.parametrize(
    ("opt_state", "kind"),
    [
        ((optax.EmptyState(), optax.ScaleByAdamState(0, {}, {})), "tuple"),
        ({"w": jnp.zeros(2)}, "dict"),
        (None, "NoneType"),
    ],
    ids=["optax_state", "dict", "none"],
)
def test_opt_state_without_loss_scaled_state_is_a_lookup_error(opt_state, kind):
    message = (
        f"value_and_grad: get_loss_scale: opt_state ({kind}) holds no LossScaledState; build the "
        "optimizer with jax_lossscale.loss_scaled(inner, loss_scale); or pass the scale itself, "
        "a float32 scalar array"
    )
    with pytest.raises(LookupError, match=exactly(message)):
        jls.value_and_grad(jnp.sum, opt_state)


def test_opt_state_from_plain_optax_is_a_lookup_error():
    opt_state = optax.adam(1e-3).init(small_params())
    with pytest.raises(LookupError, match="holds no LossScaledState"):
        jls.value_and_grad(jnp.sum, opt_state)


@pytest.mark.parametrize(
    ("scale", "shown"),
    [
        (jnp.float16(8.0), "Array(8., dtype=float16)"),
        (jnp.bfloat16(8.0), "Array(8, dtype=bfloat16)"),
        (jnp.ones(2, F32), "Array([1., 1.], dtype=float32)"),
        (jnp.int32(8), "Array(8, dtype=int32)"),
    ],
    ids=["float16", "bfloat16", "vector", "int32"],
)
def test_a_scale_of_the_wrong_dtype_or_shape_is_a_type_error(scale, shown):
    message = (
        f"value_and_grad(opt_state={shown}): a scale given directly must be a float32 scalar array"
    )
    with pytest.raises(TypeError, match=exactly(message)):
        jls.value_and_grad(jnp.sum, scale)


@pytest.mark.parametrize("scale", [8.0, 1024])
def test_a_python_number_as_the_scale_is_a_type_error_that_shows_the_array_to_pass(scale):
    """A Python number was looked up as an opt_state: a LookupError "(float) holds no
    LossScaledState", where a scale of the wrong type is a TypeError that says what to pass."""
    message = (
        f"value_and_grad(opt_state={scale!r}): a scale given directly must be a float32 scalar "
        f"array, such as jnp.float32({scale!r})"
    )
    with pytest.raises(TypeError, match=exactly(message)):
        jls.value_and_grad(jnp.sum, scale)


def test_an_opt_state_replicated_for_pmap_names_the_scales_shape():
    """Outside the pmapped step, a replicated (stacked) state holds a scale of shape (8,): jax's
    "Gradient only defined for scalar-output functions ... (8,)" named neither."""
    tx, _ = dynamic_tx()
    stacked = jax.tree.map(lambda a: jnp.asarray(np.stack([a] * 8)), tx.init(small_params()))
    message = (
        "value_and_grad: the loss scale in opt_state has shape (8,), not (): a state replicated "
        "by pmap or stacked by vmap; call value_and_grad inside the pmapped (or vmapped) step, "
        "with the step's own opt_state, where the scale is a scalar"
    )
    with pytest.raises(ValueError, match=exactly(message)):
        jls.value_and_grad(loss_in(F16), stacked)
    # inside a vmap over the stack, the scale is a scalar again
    x, y = small_batch()
    _, grads = jax.vmap(lambda s: jls.value_and_grad(loss_in(F32), s)(small_params(), x, y))(
        stacked
    )
    expected = jax.grad(lambda p: loss_in(F32)(p, x, y) * 2.0**10)(small_params())
    chex.assert_trees_all_close(
        jax.tree.map(lambda g: np.asarray(g)[3], grads), expected, rtol=1e-6
    )


def test_fun_returning_a_non_scalar_is_a_type_error():
    params = jnp.array([1.0, 2.0], F32)
    with pytest.raises(TypeError) as info:
        jls.value_and_grad(lambda p: p * 2, jnp.float32(1.0))(params)
    assert str(info.value) == (
        "value_and_grad: fun must return a real floating scalar, got "
        "GradTracer(primal=[2. 4.], typeof(tangent)=f32[2])"
    )
    with pytest.raises(TypeError) as info:
        jls.value_and_grad(lambda p: (p * 2, None), jnp.float32(1.0), has_aux=True)(params)
    assert str(info.value).startswith(
        "value_and_grad: fun must return a real floating scalar as the first element of "
        "(value, aux), got GradTracer("
    )


@pytest.mark.parametrize(
    ("fun", "shown"),
    [
        (lambda p: jnp.sum(p).astype(jnp.int32), "Array(3, dtype=int32)"),
        (lambda p: 1, "1"),
        (
            lambda p: jnp.sum(p).astype(jnp.complex64),
            "GradTracer(primal=(3+0j), typeof(tangent)=c64[])",
        ),
    ],
    ids=["int32", "python_int", "complex"],
)
def test_fun_returning_a_non_floating_value_is_a_type_error(fun, shown):
    with pytest.raises(TypeError) as info:
        jls.value_and_grad(fun, jnp.float32(1.0))(jnp.array([1.0, 2.0], F32))
    assert str(info.value) == f"value_and_grad: fun must return a real floating scalar, got {shown}"


def test_a_loss_returned_as_a_python_float_is_accepted_as_jax_accepts_it():
    """jax.value_and_grad gives (1.0, zeros) for a constant Python float loss; so does this."""
    params = jnp.array([1.0, 2.0], F32)
    expected_value, expected_grads = jax.value_and_grad(lambda p: 1.0)(params)
    value, grads = jls.value_and_grad(lambda p: 1.0, jnp.float32(8.0))(params)
    assert type(value) is type(expected_value) is float
    assert value == expected_value == 1.0
    assert_bits_equal(grads, expected_grads)
    assert_bits_equal(grads, jnp.zeros(2, F32))
    (value, aux), grads = jls.value_and_grad(
        lambda p: (2.5, "aux"), jnp.float32(8.0), has_aux=True
    )(params)
    assert (value, aux) == (2.5, "aux")
    assert_bits_equal(grads, jnp.zeros(2, F32))


# --- argnums, has_aux, using ------------------------------------------------------------------


def test_argnums_an_int_and_a_tuple():
    fun = lambda a, b, c: jnp.sum(a.astype(F16) * b.astype(F16) * c.astype(F16))  # noqa: E731
    a, b, c = jnp.float32(1.5), jnp.float32(2.0), jnp.float32(-3.0)
    scale = jnp.float32(16.0)
    value, grad_b = jls.value_and_grad(fun, scale, argnums=1)(a, b, c)
    assert value == fun(a, b, c)
    assert_bits_equal(grad_b, jnp.float32(1.5 * -3.0 * 16.0))
    value, grads = jls.value_and_grad(fun, scale, argnums=(0, 2))(a, b, c)
    assert value == fun(a, b, c)
    assert_bits_equal(grads, (jnp.float32(2.0 * -3.0 * 16.0), jnp.float32(1.5 * 2.0 * 16.0)))
    _, grads = jls.value_and_grad(fun, scale, argnums=(0,))(a, b, c)
    assert_bits_equal(grads, (jnp.float32(2.0 * -3.0 * 16.0),))


def test_has_aux_returns_value_and_aux_untouched():
    params, (x, y) = small_params(), small_batch()

    def fun(params, x, y):
        loss = loss_in(F16)(params, x, y)
        return loss, {"loss": loss, "count": jnp.int32(4), "name": "mse"}

    (value, aux), grads = jls.value_and_grad(fun, jnp.float32(32.0), has_aux=True)(params, x, y)
    assert np.asarray(value).tobytes() == np.asarray(fun(params, x, y)[0]).tobytes()
    assert np.asarray(aux["loss"]).tobytes() == np.asarray(value).tobytes()
    assert aux["count"] == 4
    assert aux["name"] == "mse"
    expected = jax.grad(lambda p: fun(p, x, y)[0].astype(F32) * 32.0)(params)
    assert_bits_equal(grads, expected)


@pytest.mark.parametrize(
    ("output", "shown"),
    [
        (
            lambda p: p * 2,
            "type <class 'jax._src.interpreters.ad.LinearizeTracer'> with value "
            "GradTracer(primal=[2. 4.], typeof(tangent)=f32[2])",
        ),
        (
            lambda p: jnp.sum(p),
            "type <class 'jax._src.interpreters.ad.LinearizeTracer'> with value "
            "GradTracer(primal=3.0, typeof(tangent)=f32[])",
        ),
        (
            lambda p: (jnp.float32(1.0), 2, 3),
            "type <class 'tuple'> with value (Array(1., dtype=float32), 2, 3)",
        ),
        (lambda p: {"loss": 1.0}, "type <class 'dict'> with value {'loss': 1.0}"),
    ],
    ids=["length_2_array", "scalar", "3_tuple", "dict"],
)
def test_has_aux_output_is_checked_as_jax_checks_it(output, shown):
    """A length-2 array was unpacked as (value, aux): the gradients of its first element. A
    scalar, a 3-tuple or a dict gave Python's unpacking errors. jax.value_and_grad raises a
    TypeError for each, and so does this, with jax's message, naming has_aux."""
    params = jnp.array([1.0, 2.0], F32)
    with pytest.raises(TypeError, match="two-element tuple"):
        jax.value_and_grad(output, has_aux=True)(params)
    message = (
        "value_and_grad(has_aux=True): expected function with aux output to return a "
        f"two-element tuple, but got {shown}"
    )
    with pytest.raises(TypeError) as info:
        jls.value_and_grad(output, jnp.float32(8.0), has_aux=True)(params)
    assert str(info.value) == message  # jax adds a note on its frames


def test_has_aux_accepts_a_list_of_two_as_jax_does():
    params = jnp.array([1.0, 2.0], F32)
    (value, aux), grads = jls.value_and_grad(
        lambda p: [jnp.sum(p), "aux"], jnp.float32(8.0), has_aux=True
    )(params)
    assert (float(value), aux) == (3.0, "aux")
    assert_bits_equal(grads, jnp.full(2, 8.0, F32))


def test_using_eqx_filter_value_and_grad_on_an_equinox_model():
    model = eqx.nn.MLP(2, 3, 8, 1, key=jax.random.key(0))
    x, y = small_batch()

    def fun(model, x, y):
        half = POLICY.cast_to_compute(model)
        out = jax.vmap(half)(POLICY.cast_to_compute(x))
        return jls.full_precision(lambda o, y: jnp.mean((o - y) ** 2))(out, y)

    (value, aux), grads = jls.value_and_grad(
        lambda m, x, y: (fun(m, x, y), 7),
        jnp.float32(256.0),
        has_aux=True,
        using=eqx.filter_value_and_grad,
    )(model, x, y)
    assert aux == 7
    assert value.dtype == F32
    assert value == fun(model, x, y)
    expected = eqx.filter_grad(lambda m: fun(m, x, y) * 256.0)(model)
    assert type(grads) is type(model)
    assert grads.activation is None  # equinox's filtered gradients: None for non-arrays
    assert_bits_equal(eqx.filter(grads, eqx.is_array), eqx.filter(expected, eqx.is_array))


def test_using_nnx_value_and_grad_on_an_nnx_model_with_argnums():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    x, y = small_batch()
    fun = lambda x, m, y: jnp.mean((m(x.astype(F16)).astype(F32) - y) ** 2)  # noqa: E731
    value, grads = jls.value_and_grad(fun, jnp.float32(64.0), argnums=1, using=nnx.value_and_grad)(
        x, model, y
    )
    assert value == fun(x, model, y)
    expected = nnx.grad(lambda m: fun(x, m, y) * 64.0)(model)
    assert isinstance(grads, nnx.State)
    assert_bits_equal(nnx.to_pure_dict(grads), nnx.to_pure_dict(expected))


# --- one trace for every step -----------------------------------------------------------------

OVERFLOWS = {3, 4, 11, 17}  # steps whose targets hold an inf


def poisoned_batches(steps, overflows, value=np.inf):
    x, y = small_batch()
    for step in range(steps):
        yield x, (y.at[1, 0].set(value) if step in overflows else y)


def test_a_jitted_donating_train_step_is_traced_once_over_20_steps():
    tx, loss_scale = dynamic_tx(optax.adam(1e-2), increment_period=2)
    params = small_params()
    opt_state = tx.init(params)
    fun = loss_in(F16)
    traces = []

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    @chex.assert_max_traces(n=1)
    def train_step(params, opt_state, x, y):
        traces.append(None)
        value, grads = jls.value_and_grad(fun, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    scales, values = [], []
    for step, (x, y) in enumerate(poisoned_batches(20, OVERFLOWS)):
        before = bits(params)
        params, opt_state, value = train_step(params, opt_state, x, y)
        scales.append(float(jls.get_loss_scale(opt_state)))
        values.append(float(value))
        if step in OVERFLOWS:
            chex.assert_trees_all_equal(bits(params), before)
    assert len(traces) == 1
    finite = [step not in OVERFLOWS for step in range(20)]
    assert scales == ReferenceLossScale.of(loss_scale).scales(finite)
    assert len(set(scales)) > 2  # the scale moved both ways
    assert [np.isfinite(v) for v in values] == finite
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == len(OVERFLOWS)


AXIS, DEVICES = "d", 8
DIST_OVERFLOWS = {1: 3, 4: 0}  # step: the device whose shard of the targets holds an inf


def device_batches(steps):
    """(steps, devices, 2, 2) inputs and (steps, devices, 2, 3) targets, as NumPy arrays (for
    the jitted steps only: indexed on the host, they compile nothing)."""
    key = jax.random.key(7)
    x = np.asarray(jax.random.normal(key, (steps, DEVICES, 2, 2)))
    y = np.array(jax.random.normal(jax.random.fold_in(key, 1), (steps, DEVICES, 2, 3)))
    for step, device in DIST_OVERFLOWS.items():
        y[step, device, 0, 1] = np.inf
    return x, y


def reference_run(steps, fun):
    """The same steps on one device: the mean of the 8 devices' gradients, taken with vmap."""
    xs, ys = device_batches(steps)
    results = []
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(2.0**10, increment_period=2))

    @jax.jit
    def step(params, opt_state, x, y):
        scale = jls.get_loss_scale(opt_state)
        grads = jax.vmap(jax.grad(lambda p, x, y: fun(p, x, y).astype(F32) * scale), (None, 0, 0))(
            params, x, y
        )
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = small_params(), tx.init(small_params())
    for s in range(steps):
        params, opt_state = step(params, opt_state, xs[s], ys[s])
        results.append((params, float(jls.get_loss_scale(opt_state))))
    return results


def distributed_tx():
    loss_scale = jls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=2)
    return jls.loss_scaled(optax.sgd(0.1), loss_scale, axis_name=AXIS), loss_scale


def test_under_pmap_one_trace_and_the_scale_agrees_on_every_device():
    tx, loss_scale = distributed_tx()
    fun = loss_in(F16)
    traces = []

    @functools.partial(jax.pmap, axis_name=AXIS, donate_argnums=(0, 1))
    @chex.assert_max_traces(n=1)
    def train_step(params, opt_state, x, y):
        traces.append(None)
        value, grads = jls.value_and_grad(fun, opt_state)(params, x, y)
        grads = jax.lax.pmean(grads, AXIS)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    # Placed as pmap places its outputs: jax.pmap traces again when an argument's placement
    # changes (from uncommitted to its output's sharding), with or without this library.
    stack = lambda tree: jax.tree.map(lambda a: np.stack([a] * DEVICES), tree)  # noqa: E731
    sharding = NamedSharding(Mesh(np.array(jax.devices()), (AXIS,)), PartitionSpec(AXIS))
    params, opt_state = jax.device_put(stack((small_params(), tx.init(small_params()))), sharding)
    xs, ys = device_batches(6)
    reference = reference_run(6, fun)
    scales = []
    for step in range(6):
        params, opt_state, values = train_step(params, opt_state, xs[step], ys[step])
        scale = np.asarray(jls.get_loss_scale(opt_state))
        assert (scale == scale[0]).all()
        scales.append(float(scale[0]))
        for leaf in jax.tree.leaves(params):
            assert (np.asarray(leaf) == np.asarray(leaf)[0]).all()  # every device the same
        chex.assert_trees_all_close(
            jax.tree.map(lambda a: np.asarray(a)[0], params), reference[step][0], rtol=1e-4
        )
        if step in DIST_OVERFLOWS:
            assert not np.isfinite(np.asarray(values)[DIST_OVERFLOWS[step]])
    assert len(traces) == 1
    finite = [step not in DIST_OVERFLOWS for step in range(6)]
    assert scales == ReferenceLossScale.of(loss_scale).scales(finite)
    assert scales == [r[1] for r in reference]


def test_under_shard_map_one_trace_and_the_scale_agrees():
    """Params and state replicated, the batch sharded; `fun` means the loss over the axis (in
    float32), so that the value is the global loss and the gradients (of replicated params,
    summed by shard_map's transpose) the global gradients."""
    tx, loss_scale = distributed_tx()
    local = loss_in(F16)
    fun = lambda p, x, y: jax.lax.pmean(local(p, x, y).astype(F32), AXIS)  # noqa: E731
    traces = []
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    replicated, sharded = PartitionSpec(), PartitionSpec(AXIS)

    @chex.assert_max_traces(n=1)
    def per_device(params, opt_state, x, y):
        traces.append(None)
        value, grads = jls.value_and_grad(fun, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    train_step = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(replicated, replicated, sharded, sharded),
            out_specs=replicated,
        ),
        donate_argnums=(0, 1),
    )
    # Placed as the step places its outputs: jax.jit traces again when that changes.
    params, opt_state = jax.device_put(
        (small_params(), tx.init(small_params())), NamedSharding(mesh, replicated)
    )
    xs, ys = device_batches(6)
    reference = reference_run(6, local)
    scales, values = [], []
    for step in range(6):
        x, y = xs[step].reshape(-1, 2), ys[step].reshape(-1, 3)
        params, opt_state, value = train_step(params, opt_state, x, y)
        scales.append(float(jls.get_loss_scale(opt_state)))
        values.append(float(value))
        # The params are cast to float16 before they meet the sharded batch, so shard_map's
        # transpose sums the 8 devices' gradients in float16: close to the reference, not equal.
        chex.assert_trees_all_close(params, reference[step][0], rtol=2e-3)
    assert len(traces) == 1
    finite = [step not in DIST_OVERFLOWS for step in range(6)]
    assert scales == ReferenceLossScale.of(loss_scale).scales(finite)
    assert [np.isfinite(v) for v in values] == finite


# --- bit-identical to the hand-written steps it replaces ---------------------------------------

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 32, 32, 4, 1, 8, 4
STEPS, POISONED_STEP = 10, 4  # the step whose loss weights hold an inf: skipped


def gpt_batches():
    """Tokens, next tokens and per-sequence loss weights (the same batch every step, to be
    learned by heart); an inf weight on POISONED_STEP."""
    tokens = jax.random.randint(jax.random.key(3), (BATCH, SEQ + 1), 0, VOCAB)
    for step in range(STEPS):
        weights = jnp.ones(BATCH, F32)
        if step == POISONED_STEP:
            weights = weights.at[2].set(jnp.inf)
        yield tokens[:, :-1], tokens[:, 1:], weights


class Block(nnx.Module):
    """A pre-LayerNorm decoder block; its params are float32, its compute that of its inputs."""

    def __init__(self, rngs):
        self.norm1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.qkv = nnx.Linear(DIM, 3 * DIM, rngs=rngs)
        self.out = nnx.Linear(DIM, DIM, rngs=rngs)
        self.norm2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)

    def __call__(self, x, softmax32):
        qkv = self.qkv(self.norm1(x))
        q, k, v = jnp.split(qkv.reshape(*qkv.shape[:-1], 3 * HEADS, DIM // HEADS), 3, axis=-2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(DIM // HEADS).astype(x.dtype)
        weights = softmax32(scores, jnp.tril(jnp.ones((SEQ, SEQ), bool)))
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)
        x = x + self.out(attended)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class GPT(nnx.Module):
    def __init__(self, rngs):
        # nnx.Embed fixes its compute dtype when built (its table's, float32, unless given):
        # a float16 copy of its params would still look up float32 rows.
        self.embed = nnx.Embed(VOCAB, DIM, dtype=POLICY.compute_dtype, rngs=rngs)
        self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, DIM)))
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens, softmax32):
        x = self.embed(tokens) + self.positions[...]
        for block in self.blocks:
            x = block(x, softmax32)
        return self.head(self.norm(x))


def weighted_cross_entropy(logits, targets, weights):
    per_sequence = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)
    return jnp.sum(weights * per_sequence) / BATCH


def masked_softmax(scores, mask):
    return jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)


def gpt_loss_with_policy(model, tokens, targets, weights):
    """The float16 forward pass through a Policy, its float32 islands through full_precision."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    half = nnx.merge(graphdef, POLICY.cast_to_compute(params), rest)
    softmax32 = jls.full_precision(masked_softmax, output_dtype=POLICY.compute_dtype)
    logits = half(tokens, softmax32)
    return jls.full_precision(weighted_cross_entropy)(logits, targets, weights)


def gpt_loss_by_hand(model, tokens, targets, weights):
    """The same, written with .astype."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    half = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(F16), params), rest)
    softmax32 = lambda s, m: masked_softmax(s.astype(F32), m).astype(F16)  # noqa: E731
    logits = half(tokens, softmax32)
    return weighted_cross_entropy(logits.astype(F32), targets, weights)


@nnx.jit(donate_argnums=(0, 1))
def gpt_step_with_value_and_grad(model, optimizer, tokens, targets, weights):
    loss, grads = jls.value_and_grad(gpt_loss_with_policy, optimizer, using=nnx.value_and_grad)(
        model, tokens, targets, weights
    )
    optimizer.update(model, grads)
    return loss


@nnx.jit(donate_argnums=(0, 1))
def gpt_step_by_hand(model, optimizer, tokens, targets, weights):
    scale = jls.get_loss_scale(optimizer)

    def scaled_loss(model):
        loss = gpt_loss_by_hand(model, tokens, targets, weights)
        return loss.astype(F32) * scale, loss

    grads, loss = nnx.grad(scaled_loss, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss


def gpt_run(step):
    model = GPT(nnx.Rngs(0))
    loss_scale = jls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=2)
    tx = jls.loss_scaled(optax.adamw(3e-3, weight_decay=1e-2), loss_scale)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    losses, scales = [], []
    for tokens, targets, weights in gpt_batches():
        losses.append(step(model, optimizer, tokens, targets, weights))
        scales.append(float(jls.get_loss_scale(optimizer)))
    return model, optimizer, losses, scales, loss_scale


def test_nnx_gpt_steps_bit_identical_to_the_hand_written_ones():
    model, optimizer, losses, scales, loss_scale = gpt_run(gpt_step_with_value_and_grad)
    hand_model, hand_optimizer, hand_losses, hand_scales, _ = gpt_run(gpt_step_by_hand)
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {np.dtype(F32)}
    assert_bits_equal(losses, hand_losses)
    assert scales == hand_scales
    finite = [step != POISONED_STEP for step in range(STEPS)]
    assert scales == ReferenceLossScale.of(loss_scale).scales(finite)
    assert [bool(np.isfinite(loss)) for loss in losses] == finite
    assert int(jls.get_loss_scale_stats(optimizer).skipped_steps) == 1
    assert int(jls.get_loss_scale_stats(hand_optimizer).skipped_steps) == 1
    assert float(losses[-1]) < float(losses[0])
    assert_bits_equal(nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(hand_model)))
    assert_bits_equal(
        nnx.to_pure_dict(nnx.state(optimizer)), nnx.to_pure_dict(nnx.state(hand_optimizer))
    )


def dot_dtypes(fun, *args):
    """The operand and result dtypes of every matrix product in `fun`'s jaxpr."""
    eqns = jax.make_jaxpr(fun)(*args).jaxpr.eqns
    return {
        (*(str(var.aval.dtype) for var in eqn.invars), str(eqn.outvars[0].aval.dtype))
        for eqn in eqns
        if eqn.primitive.name == "dot_general"
    }


def test_the_nnx_gpt_under_the_policy_multiplies_in_float16_only():
    model = GPT(nnx.Rngs(0))
    tokens, targets, weights = next(gpt_batches())
    loss = lambda model: gpt_loss_with_policy(model, tokens, targets, weights)  # noqa: E731
    assert dot_dtypes(loss, model) == {("float16", "float16", "float16")}
    # Built as the docs once showed it, nnx.Embed's float32 rows promote every product after it.
    model.embed.dtype = F32
    assert dot_dtypes(loss, model) == {
        ("float32", "float32", "float32"), ("float32", "float16", "float32"),
    }  # fmt: skip


class MLP(eqx.Module):
    layers: tuple

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.layers = (
            eqx.nn.Linear(8, 32, key=keys[0]),
            eqx.nn.Linear(32, 32, key=keys[1]),
            eqx.nn.Linear(32, 4, key=keys[2]),
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)


def mlp_batches():
    key = jax.random.key(5)
    for step in range(STEPS):
        x = jax.random.normal(jax.random.fold_in(key, step), (16, 8))
        y = jnp.sin(x[:, :4] * 2.0)
        if step == POISONED_STEP:
            x = x.at[3, 5].set(jnp.nan)
        yield x, y


def mlp_loss_with_policy(model, x, y):
    out = jax.vmap(POLICY.cast_to_compute(model))(POLICY.cast_to_compute(x))
    return jls.full_precision(lambda o, y: jnp.mean((o - y) ** 2))(out, y)


def mlp_loss_by_hand(model, x, y):
    half = jax.tree.map(lambda a: a.astype(F16) if eqx.is_inexact_array(a) else a, model)
    out = jax.vmap(half)(x.astype(F16))
    return jnp.mean((out.astype(F32) - y) ** 2)


def mlp_step(tx, by_hand):
    @eqx.filter_jit(donate="all")
    def step(model, opt_state, x, y):
        if by_hand:
            scale = jls.get_loss_scale(opt_state)

            def scaled_loss(model):
                loss = mlp_loss_by_hand(model, x, y)
                return loss.astype(F32) * scale, loss

            grads, loss = eqx.filter_grad(scaled_loss, has_aux=True)(model)
        else:
            loss, grads = jls.value_and_grad(
                mlp_loss_with_policy, opt_state, using=eqx.filter_value_and_grad
            )(model, x, y)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def mlp_run(by_hand):
    loss_scale = jls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=2)
    tx = jls.loss_scaled(optax.adamw(3e-3, weight_decay=1e-2), loss_scale)
    model = MLP(jax.random.key(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    step = mlp_step(tx, by_hand)
    losses, scales = [], []
    for x, y in mlp_batches():
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(loss)
        scales.append(float(jls.get_loss_scale(opt_state)))
    return model, opt_state, losses, scales, loss_scale


def test_equinox_mlp_steps_bit_identical_to_the_hand_written_ones():
    model, opt_state, losses, scales, loss_scale = mlp_run(by_hand=False)
    hand_model, hand_opt_state, hand_losses, hand_scales, _ = mlp_run(by_hand=True)
    assert_bits_equal(losses, hand_losses)
    assert scales == hand_scales
    finite = [step != POISONED_STEP for step in range(STEPS)]
    assert scales == ReferenceLossScale.of(loss_scale).scales(finite)
    assert [bool(np.isfinite(loss)) for loss in losses] == finite
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 1
    assert float(losses[-1]) < float(losses[0])
    assert_bits_equal(eqx.filter(model, eqx.is_array), eqx.filter(hand_model, eqx.is_array))
    assert_bits_equal(opt_state, hand_opt_state)


# --- built once outside the step ----------------------------------------------------------------


def one_overflow_then_a_step(make_step):
    """Two steps of sgd(1.0) on sum(w * x) from w = [0, 0]: an overflow (skipped, the scale
    2**15 -> 2**14), then x = [1, 1], whose true update is -1 each."""
    fun = lambda w, x: jnp.sum(w.astype(F16) * x.astype(F16))  # noqa: E731
    tx, _ = dynamic_tx(optax.sgd(1.0), initial_loss_scale=2.0**15)
    params = jnp.zeros(2, F32)
    opt_state = tx.init(params)
    step = make_step(fun, tx, opt_state)
    for x in (jnp.array([jnp.inf, 1.0], F32), jnp.ones(2, F32)):
        params, opt_state = step(params, opt_state, x)
    return params, opt_state


def test_the_documented_form_built_inside_the_step_reads_the_steps_scale():
    def make_step(fun, tx, _):
        @jax.jit
        def step(params, opt_state, x):
            _, grads = jls.value_and_grad(fun, opt_state)(params, x)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step

    params, opt_state = one_overflow_then_a_step(make_step)
    assert float(jls.get_loss_scale(opt_state)) == 2.0**14
    assert_bits_equal(params, jnp.array([-1.0, -1.0], F32))


def test_built_outside_a_jitted_step_and_called_inside_it_raises_at_the_call():
    """The `grad_fn = jax.value_and_grad(f)` habit: the scale it holds would be compiled in as
    2**15, and after the overflow `loss_scaled` unscales by 2**14: params [-2, -2] where
    [-1, -1] is right. It raises instead, saying to build it inside the step."""

    def make_step(fun, tx, opt_state):
        grad_fn = jls.value_and_grad(fun, opt_state)  # once, outside the step

        @jax.jit
        def step(params, opt_state, x):
            _, grads = grad_fn(params, x)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step

    with pytest.raises(ValueError, match=f"^{re.escape(STAGED_MESSAGE)}"):  # jit adds a note
        one_overflow_then_a_step(make_step)


STAGED_MESSAGE = (
    "value_and_grad: the loss scale (32768.0) is a constant of the computation being traced, "
    "not one of its arguments: the opt_state it is read from did not go into that computation "
    "(grad_fn = value_and_grad(loss_fn, opt_state) built once outside a jitted step, or called "
    "in the body of a lax.scan or fori_loop that closes over opt_state), so the first scale "
    "would be compiled in and go stale after the scale changes. Pass opt_state in (an argument "
    "of the jitted step, or the loop's carry) and build it there: "
    "jls.value_and_grad(loss_fn, opt_state)(params, ...)"
)


def test_in_an_eager_scan_closing_over_opt_state_the_message_names_the_loop():
    """Gradient accumulation over microbatches in a `lax.scan` outside `jit`, the body closing
    over a concrete opt_state: scan traces the body and would keep that scale. It raises with
    the message for loops; with opt_state in the carry the same body runs."""
    fun = lambda w, x: jnp.sum(w * x) ** 2  # noqa: E731
    tx, _ = dynamic_tx(optax.sgd(0.1), initial_loss_scale=2.0**15)
    params = jnp.ones(3, F32)
    opt_state = tx.init(params)

    def closing_over(total, x):
        _, grads = jls.value_and_grad(fun, opt_state)(params, x)
        return total + grads, None

    with pytest.raises(ValueError, match=f"^{re.escape(STAGED_MESSAGE)}"):  # and a note
        jax.lax.scan(closing_over, jnp.zeros(3, F32), jnp.ones((4, 3), F32))

    def carrying(carry, x):
        total, state = carry
        _, grads = jls.value_and_grad(fun, state)(params, x)
        return (total + grads, state), None

    (total, _), _ = jax.lax.scan(carrying, (jnp.zeros(3, F32), opt_state), jnp.ones((4, 3), F32))
    assert_bits_equal(total, jnp.full(3, 4 * 6.0 * 2.0**15, F32))


def test_built_outside_with_the_scale_read_by_hand_raises_too():
    fun = lambda w: jnp.sum(w.astype(F16))  # noqa: E731
    tx, _ = dynamic_tx(optax.sgd(1.0), initial_loss_scale=2.0**15)
    grad_fn = jls.value_and_grad(fun, jls.get_loss_scale(tx.init(jnp.zeros(2))))
    with pytest.raises(ValueError, match=r"^value_and_grad: the loss scale \(32768\.0\) is a"):
        jax.jit(grad_fn)(jnp.zeros(2, F32))
    # Eagerly, a scale given directly is the scale used.
    _, grads = grad_fn(jnp.zeros(2, F32))
    assert_bits_equal(grads, jnp.full(2, 2.0**15, F32))


def test_built_once_from_an_nnx_optimizer_follows_its_scale_in_an_eager_loop():
    """An nnx Optimizer is updated in place, and the scale is read at each call: the habit
    gives the right steps here, [-1, -1] after the overflow."""
    model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.zeros((2, 1), F32)
    tx, _ = dynamic_tx(optax.sgd(1.0), initial_loss_scale=2.0**15)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    fun = lambda m, x: jnp.sum(m(x.astype(F16)))  # noqa: E731
    grad_fn = jls.value_and_grad(fun, optimizer, using=nnx.value_and_grad)  # once
    for x in (jnp.array([[jnp.inf, 1.0]], F32), jnp.ones((1, 2), F32)):
        _, grads = grad_fn(model, x)
        optimizer.update(model, grads)
    assert float(jls.get_loss_scale(optimizer)) == 2.0**14
    assert_bits_equal(model.kernel[...], jnp.full((2, 1), -1.0, F32))


# --- fp8 meta leaves ---------------------------------------------------------------------------


@jax.custom_vjp
def _meta_layer(x, scale, history):
    """A toy fp8 layer as flax writes one: identity on `x`; the cotangents of its meta leaves
    are their new values, the kernel's scale a constant, the output gradient's history rolled
    with the newest amax of the cotangent first."""
    return x


def _meta_layer_fwd(x, scale, history):
    return x, history


def _meta_layer_bwd(history, g):
    new_history = jnp.roll(history, -1).at[0].set(jnp.max(jnp.abs(g)).astype(history.dtype))
    return g, jnp.float32(0.375), new_history


_meta_layer.defvjp(_meta_layer_fwd, _meta_layer_bwd)

_META_PARAMS = {
    "params": {"w": jnp.array([1.0, -2.0])},
    "meta": {
        "kernel_scale": jnp.float32(1.0),
        "output_grad_amax_history": jnp.array([0.0, 8.0, 24.0], jnp.float32),
    },
}


def _meta_loss(dtype):
    def loss(p):
        out = _meta_layer(
            p["params"]["w"], p["meta"]["kernel_scale"], p["meta"]["output_grad_amax_history"]
        )
        return (jnp.sum(out * jnp.array([0.5, 3.0]))).astype(dtype)

    return loss


@pytest.mark.parametrize(
    "fp8_meta",
    [
        {"params": False, "meta": True},
        lambda path, leaf: path[0].key == "meta",
    ],
    ids=["mask", "predicate"],
)
@pytest.mark.parametrize(
    ("dtype", "scale", "newest"),
    [
        (jnp.float32, 2.0**17, 3.0 * 2**17),  # no split: the cotangent is 3 * 2**17
        (jnp.float16, 2.0**17, 3.0 * 2**17),  # 2**15 carried, the history run at a quarter
        # 512 carried, the history run divided by the rest (1.953125) and multiplied back
        (jnp.float16, 1000.0, 3.0 * 1000),
        (jnp.bfloat16, 1000.0, 3.0 * 1000),
    ],
)
def test_meta_leaves_come_back_as_the_layer_gives_them(fp8_meta, dtype, scale, newest):
    # Before: a float16 or bfloat16 loss multiplied them by the rest of the scale. And at a
    # scale that is no power of two (1000), the history came back at the part carried (3 * 512
    # where the scale makes 3 * 1000), which loss_scaled's rescaling then mismatched.
    grad = jax.jit(lambda p, s: jls.value_and_grad(_meta_loss(dtype), s, fp8_meta=fp8_meta)(p)[1])
    grads = grad(_META_PARAMS, jnp.float32(scale))
    expected_w = jnp.array([0.5, 3.0]) * np.float32(scale)
    np.testing.assert_allclose(grads["params"]["w"], expected_w, rtol=2**-10)
    assert_bits_equal(grads["meta"]["kernel_scale"], jnp.float32(0.375))
    assert_bits_equal(
        grads["meta"]["output_grad_amax_history"], jnp.array([newest, 24.0, 0.0], jnp.float32)
    )
    # Not named as meta state, the leaves are gradients: multiplied by the rest.
    if dtype == jnp.float16 and scale == 2.0**17:
        plain = jax.jit(lambda p, s: jls.value_and_grad(_meta_loss(dtype), s)(p)[1])
        got = plain(_META_PARAMS, jnp.float32(scale))["meta"]
        assert float(got["kernel_scale"]) == 0.375 * 4
        np.testing.assert_array_equal(got["output_grad_amax_history"], [newest, 96.0, 0.0])
