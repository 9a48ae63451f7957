"""Dtypes (docs/reliability.md): a float32 scale, float32 arithmetic, every leaf keeps its dtype
but a float16 gradient, which comes back float32 from the unscale."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

from helpers import jitted

F16_MAX = float(np.finfo(np.float16).max)  # 65504
VALUES = [1.0, -3.5, 0.1, 1e-3, 6e-5, 255.0, 60000.0, 0.0, -0.0]
HALF_AND_SINGLE = [jnp.float16, jnp.bfloat16, jnp.float32]


# Powers of two: XLA turns `x / scale` into `x * (1 / scale)`, exact only for these.
LOSS_SCALES = {
    "fixed-1": jls.FixedLossScale(1.0),
    "dynamic-0.5": jls.DynamicLossScale(0.5, min_loss_scale=0.5),
    "dynamic-2**15": jls.DynamicLossScale(2.0**15),
    "dynamic-2**20": jls.DynamicLossScale(2.0**20),
}


def scale_of(ls: jls.LossScale) -> float:
    return ls.loss_scale_value if isinstance(ls, jls.FixedLossScale) else ls.initial_loss_scale


def with_state(ls: jls.LossScale):
    return ls, ls.init()


# The state is an argument of the jitted function, so the scale is traced, not a constant.
def unscale(ls: jls.LossScale, state, tree):
    return ls.unscale(state, tree)


def scale(ls: jls.LossScale, state, tree):
    return ls.scale(state, tree)


def unscaled(dtype):
    """The dtype of an unscaled gradient: float32 for float16, its own otherwise."""
    return np.float32 if jnp.dtype(dtype) == jnp.float16 else dtype


def assert_scale_is_float32(ls: jls.LossScale, state) -> None:
    assert ls(state).dtype == jnp.float32
    assert ls(state).shape == ()


# --- unscale ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ls", LOSS_SCALES.values(), ids=LOSS_SCALES.keys())
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=lambda d: jnp.dtype(d).name)
def test_unscale_computes_in_float32_and_widens_only_float16(ls, dtype):
    x = np.array(VALUES, np.float32).astype(dtype)
    expected = (x.astype(np.float32) / np.float32(scale_of(ls))).astype(unscaled(dtype))

    out = jitted(unscale, ls, ls.init(), {"g": x, "s": x[3]})

    chex.assert_trees_all_equal(out, {"g": expected, "s": expected[3]}, strict=True)
    assert_scale_is_float32(ls, ls.init())


@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=lambda d: jnp.dtype(d).name)
def test_unscale_by_a_scale_that_is_not_a_power_of_two_is_close(dtype):
    x = np.array(VALUES, np.float32).astype(dtype)
    expected = (x.astype(np.float32) / np.float32(3.0)).astype(unscaled(dtype))
    out = jitted(unscale, *with_state(jls.FixedLossScale(3.0)), x)
    assert out.dtype == unscaled(dtype)
    rtol = float(jnp.finfo(unscaled(dtype)).eps)
    chex.assert_trees_all_close(out, expected, rtol=rtol, atol=0.0)


def test_unscale_float64_under_x64_computes_in_float64_and_keeps_a_float32_scale():
    ls = jls.DynamicLossScale(2.0**15, increment_period=1)
    # Each of these would be rounded, overflow or underflow on a trip through float32.
    x = np.array([1.0 / 3.0, 1e300, -(2.0**-1000), 7.0], np.float64)
    with jax.enable_x64(True):
        state = ls.init()
        assert_scale_is_float32(ls, state)
        assert state.good_steps.dtype == jnp.int32

        out = jitted(ls.unscale, state, {"f64": x, "f32": x[:1].astype(np.float32)})
        chex.assert_trees_all_equal(
            out,
            {
                "f64": np.array([1.0 / 3.0 / 2**15, 1e300 / 2**15, -(2.0**-1015), 7.0 / 2**15]),
                "f32": np.array([1.0 / 3.0], np.float32) / np.float32(2**15),
            },
            strict=True,
        )

        state, should_apply = jitted(ls.update, state, out)
        assert bool(should_apply)
        assert_scale_is_float32(ls, state)
        chex.assert_trees_all_equal_dtypes(state, ls.init())
        assert float(ls(state)) == 2.0**16


@pytest.mark.parametrize(
    ("loss_scale", "expected"),
    [
        (2.0**15, 1.8310546875),
        (2.0**16, 0.91552734375),  # 2**16 is inf in float16
        (2.0**17, 0.457763671875),
        (2.0**24, 1875 / 2**19),
    ],
    ids=["2**15", "2**16", "2**17", "2**24"],
)
def test_unscale_float16_near_its_maximum_is_exact(loss_scale, expected):
    ls = jls.DynamicLossScale(loss_scale)
    out = jitted(unscale, ls, ls.init(), {"g": jnp.array([60000.0, -60000.0], jnp.float16)})
    chex.assert_trees_all_equal(
        out, {"g": np.array([expected, -expected], np.float32)}, strict=True
    )
    assert float(np.float32(expected)) == expected


def test_unscale_float16_maximum_by_2_pow_16_is_exact():
    out = jitted(unscale, *with_state(jls.FixedLossScale(2.0**16)), jnp.array(F16_MAX, jnp.float16))
    chex.assert_trees_all_equal(out, np.float32(0.99951171875), strict=True)


def test_unscale_float16_below_a_scale_of_one_is_float32_and_finite():
    # Unscaled in float16, 60000 / 0.5 would be inf; in float32 it is 120000.
    ls = jls.DynamicLossScale(0.5, increment_period=2, min_loss_scale=0.25)
    state = ls.init()
    grads = {"w": jnp.array([60000.0, -60000.0, 30000.0, 1.0], jnp.float16)}

    out = jitted(ls.unscale, state, grads)
    chex.assert_trees_all_equal(
        out, {"w": np.array([120000.0, -120000.0, 60000.0, 2.0], np.float32)}, strict=True
    )

    new_state, should_apply = jitted(ls.update, state, out)
    assert should_apply.dtype == jnp.bool_
    assert bool(should_apply)
    chex.assert_trees_all_equal(
        new_state,
        jls.DynamicLossScaleState(
            loss_scale=np.float32(0.5), good_steps=np.int32(1), overflows_until_backoff=np.int32(1)
        ),
        strict=True,
    )


def test_unscale_float32_overflow_below_a_scale_of_one_is_inf_and_skips_the_step():
    ls = jls.DynamicLossScale(0.5, increment_period=2, min_loss_scale=0.25)
    state = ls.init()
    grads = {"w": jnp.array([3e38, -3e38, 1e38, 1.0], jnp.float32)}

    out = jitted(ls.unscale, state, grads)
    chex.assert_trees_all_equal(
        out, {"w": np.array([np.inf, -np.inf, 2e38, 2.0], np.float32)}, strict=True
    )

    new_state, should_apply = jitted(ls.update, state, out)
    assert should_apply.dtype == jnp.bool_
    assert not bool(should_apply)
    chex.assert_trees_all_equal(
        new_state,
        jls.DynamicLossScaleState(
            loss_scale=np.float32(0.25), good_steps=np.int32(0), overflows_until_backoff=np.int32(1)
        ),
        strict=True,
    )


# --- scale ------------------------------------------------------------------------------------


def test_scale_float32_loss_is_the_exact_float32_product():
    loss = np.float32(0.1)
    for ls in [*LOSS_SCALES.values(), jls.FixedLossScale(3.0)]:
        out = jitted(scale, ls, ls.init(), jnp.asarray(loss))
        chex.assert_trees_all_equal(out, loss * np.float32(scale_of(ls)), strict=True)


@pytest.mark.parametrize(
    ("loss_scale", "loss", "expected"),
    [
        (2.0**15, 1.0, 32768.0),
        (2.0**15, -1.0, -32768.0),
        (2.0**20, 2.0**-10, 1024.0),  # 2**20 is inf in float16
        (2.0**15, 2.0**-24, 2.0**-9),  # the smallest float16 subnormal
    ],
    ids=["one", "minus-one", "scale-beyond-f16", "subnormal"],
)
def test_scale_float16_computes_in_float32(loss_scale, loss, expected):
    out = jitted(scale, *with_state(jls.DynamicLossScale(loss_scale)), jnp.float16(loss))
    chex.assert_trees_all_equal(out, np.float16(expected), strict=True)


@pytest.mark.parametrize(
    ("loss", "expected"),
    [(3.0, np.inf), (-3.0, -np.inf), (2.0, np.inf), (1.99, 65216.0)],
    ids=["3", "-3", "2", "1.99"],
)
def test_scale_float16_loss_overflow_is_visible_as_inf(loss, expected):
    # 3 * 2**15 = 98304 and 2 * 2**15 = 65536 are past the float16 maximum 65504.
    out = jitted(scale, *with_state(jls.DynamicLossScale(2.0**15)), jnp.float16(loss))
    chex.assert_trees_all_equal(out, np.float16(expected), strict=True)


def test_scale_bfloat16_loss_does_not_overflow_where_float16_would():
    out = jitted(scale, *with_state(jls.DynamicLossScale(2.0**15)), jnp.bfloat16(3.0))
    chex.assert_trees_all_equal(out, jnp.bfloat16(98304.0), strict=True)


def test_scale_leaves_integer_and_boolean_leaves_unchanged():
    tree = {
        "loss": jnp.float32(0.75),
        "count": jnp.array([1, 2, np.iinfo(np.int32).max], jnp.int32),
        "u8": jnp.array([255], jnp.uint8),
        "mask": jnp.array([True, False]),
    }
    out = jitted(scale, *with_state(jls.FixedLossScale(8.0)), tree)
    chex.assert_trees_all_equal(out, {**tree, "loss": jnp.float32(6.0)}, strict=True)


def test_complex64_leaves_keep_their_dtype_through_scale_and_unscale():
    ls = jls.DynamicLossScale(2.0**15)
    z = jnp.array([1 + 2j, -0.5j], jnp.complex64)

    scaled = jitted(scale, ls, ls.init(), z)
    chex.assert_trees_all_equal(
        scaled, np.array([32768 + 65536j, -16384j], np.complex64), strict=True
    )
    chex.assert_trees_all_equal(jitted(unscale, ls, ls.init(), scaled), np.asarray(z), strict=True)


# --- mixed trees ------------------------------------------------------------------------------


def mixed_tree() -> dict:
    return {
        "f16": jnp.array([1.5, -60000.0], jnp.float16),
        "bf16": jnp.array([[0.25, 3.0e37]], jnp.bfloat16),
        "f32": jnp.float32(1e-30),
        "i32": jnp.array([7, -7], jnp.int32),
        "none": None,
        "nested": [jnp.array([2.0], jnp.float16), (jnp.array(4.0, jnp.bfloat16), None)],
    }


@pytest.mark.parametrize("method", ["scale", "unscale"])
def test_mixed_tree_keeps_every_leaf_dtype_and_structure(method):
    ls = jls.FixedLossScale(4.0)
    tree = mixed_tree()
    out = jitted(scale if method == "scale" else unscale, ls, ls.init(), tree)

    chex.assert_trees_all_equal_structs(out, tree)
    chex.assert_trees_all_equal_shapes(out, tree)
    out_dtypes = jax.tree.map(lambda x: np.dtype(x.dtype), out)
    widen = unscaled if method == "unscale" else (lambda dtype: dtype)
    assert out_dtypes == jax.tree.map(lambda x: np.dtype(widen(x.dtype)), tree)
    chex.assert_trees_all_equal(out["i32"], tree["i32"], strict=True)

    wide = jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
    op = np.multiply if method == "scale" else np.divide
    with np.errstate(over="ignore"):  # -60000 * 4 is -inf in float16, in both computations
        expected = jax.tree.map(
            lambda w, x: (
                op(w, np.float32(4.0)).astype(widen(x.dtype)) if x.dtype != np.int32 else x
            ),
            wide,
            tree,
        )
    chex.assert_trees_all_equal(out, expected, strict=True)


def test_update_with_half_precision_gradients_keeps_the_state_dtypes():
    ls = jls.DynamicLossScale(2.0**15, increment_period=1)
    state = ls.init()
    unscaled = jitted(ls.unscale, state, mixed_tree())

    state, should_apply = jitted(ls.update, state, unscaled)
    chex.assert_trees_all_equal_dtypes(state, ls.init())
    assert_scale_is_float32(ls, state)
    assert bool(should_apply)
    assert float(ls(state)) == 2.0**16


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=str)
def test_float8_leaves_compute_in_float32_and_keep_their_dtype(dtype):
    x = jnp.array([2.0, -0.5, 0.0], dtype)
    out = jitted(unscale, *with_state(jls.FixedLossScale(4.0)), {"g": x})
    chex.assert_trees_all_equal(out, {"g": jnp.array([0.5, -0.125, 0.0], dtype)}, strict=True)


@pytest.mark.parametrize("scale", [2.0**126, 2.0**127, 3.0 * 2.0**126])
def test_unscale_by_a_scale_whose_reciprocal_is_subnormal(scale):
    # 1 / scale is below the smallest normal float32, which XLA on CPU flushes to zero.
    ls = jls.FixedLossScale(scale)
    grads = {"w": jnp.array([0.5, -1.0, 0.0], jnp.float32) * np.float32(scale)}
    unscaled = jitted(ls.unscale, ls.init(), grads)
    np.testing.assert_allclose(unscaled["w"], [0.5, -1.0, 0.0], rtol=2e-7)
    if scale != 3.0 * 2.0**126:  # powers of two unscale exactly
        np.testing.assert_array_equal(unscaled["w"], np.array([0.5, -1.0, 0.0], np.float32))


@pytest.mark.parametrize(
    "inner",
    [optax.adam(1e-3), optax.MultiSteps(optax.sgd(0.1, momentum=0.9), 2)],
    ids=["adam", "MultiSteps(momentum)"],
)
def test_float16_params_keep_the_state_types_from_init_on_so_a_scan_carries_them(inner):
    """Unscaled float16 gradients are float32, and the inner state is made float32 for them
    at init: a `lax.scan` over steps (whose carry must keep its types) runs, as bare optax's
    does, and a skip and an applied step give the state the same types."""
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(2.0**10))
    params = {"w": jnp.ones(3, jnp.float16), "b": jnp.zeros(2, jnp.float32)}
    opt_state = tx.init(params)
    moments = [leaf for leaf in jax.tree.leaves(opt_state.inner_state) if jnp.ndim(leaf) == 1]
    assert sorted(str(leaf.dtype) for leaf in moments) == ["float32"] * len(moments)

    def step(carry, x):
        params, opt_state = carry
        scale = jls.get_loss_scale(opt_state).astype(jnp.float16)
        grads = jax.grad(lambda p: (jnp.sum(p["w"] * x) + jnp.sum(p["b"])) * scale)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None

    xs = jnp.array([[1.0, 2.0, 3.0], [jnp.inf, 1.0, 1.0], [1.0, 2.0, 3.0]], jnp.float16)
    (new_params, new_state), _ = jax.lax.scan(step, (params, opt_state), xs)
    assert jax.tree.map(lambda a: a.dtype, new_state) == jax.tree.map(lambda a: a.dtype, opt_state)
    assert new_params["w"].dtype == jnp.float16
    assert float(jls.get_loss_scale(new_state)) == 512.0  # the inf batch backed off once
    assert int(jls.get_loss_scale_stats(new_state).inf_skipped_steps) == 1


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_numpy_float64_params_and_gradients_update_as_bare_optax_without_warnings(jit):
    """NumPy-initialised params are float64, which JAX computes in float32 (x64 off): bare
    adam updates them silently, and so does the wrapper (before: three "float64 is not
    available" warnings an update, from its casts to the leaves' float64)."""
    params = {"w": np.linspace(-1.0, 1.0, 5)}
    grads = {"w": np.linspace(0.5, 2.5, 5)}
    bare = optax.adam(0.1)
    tx = jls.loss_scaled(optax.adam(0.1), jls.DynamicLossScale(initial_loss_scale=4.0))
    update = jax.jit(tx.update) if jit else tx.update
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaled = jax.tree.map(lambda g: g * 4.0, grads)
        updates, _ = update(scaled, tx.init(params), params)
    expected, _ = (jax.jit(bare.update) if jit else bare.update)(grads, bare.init(params), params)
    assert updates["w"].dtype == jnp.float32
    np.testing.assert_array_equal(updates["w"], expected["w"])
