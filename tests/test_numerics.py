"""The numerics (`_numerics`): `all_finite`, edge cases, leaf checks, agreement across devices."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_lossscale as jls
from jax_lossscale._axes import may_be_sharded
from jax_lossscale._numerics import (
    GROUP_LEAVES,
    SMALL_PART,
    finite_flag,
    floating_parts,
    reduction_groups,
    summarize_gradients,
)
from jax_lossscale._platforms import Form

from helpers import compiled_reductions, device_array

N_DEVICES = 8
FLOAT_DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16, jnp.complex64]
NON_FINITE = [np.nan, np.inf, -np.inf]


_jitted_all_finite = jax.jit(jls.all_finite)


def finite(tree) -> bool:
    result = _jitted_all_finite(tree)
    assert result.dtype == jnp.bool_
    assert result.shape == ()
    return bool(result)


def float0_zeros(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, dtype=jax.dtypes.float0)


# --- edge cases on one device ---------------------------------------------------------------


@pytest.mark.parametrize(
    "tree",
    [{}, [], (), None, {"a": None, "b": [None, (None,)]}, [{}, ()]],
    ids=["dict", "list", "tuple", "none", "nested-nones", "nested-empties"],
)
def test_empty_tree_and_tree_of_nones_are_finite(tree):
    assert finite(tree) is True


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_non_finite_value_in_any_floating_dtype_is_detected(dtype, value):
    good = device_array([1.0, -2.0, 3.0, 0.0], dtype)
    bad = device_array([1.0, -2.0, value, 0.0], dtype)
    ones = device_array(np.ones(3))
    assert finite({"ok": ones, "g": good}) is True
    assert finite({"ok": ones, "g": bad}) is False


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "+inf", "-inf"])
def test_non_finite_imaginary_part_is_detected(value):
    leaf = device_array([1 + 1j, complex(2.0, value)], jnp.complex64)
    assert finite([leaf]) is False


def test_integer_and_boolean_leaves_are_ignored_even_at_their_extremes():
    ints = {
        "i32": device_array([np.iinfo(np.int32).max, np.iinfo(np.int32).min], jnp.int32),
        "u8": device_array([255, 0], jnp.uint8),
        "bool": device_array([True, False], jnp.bool_),
        "np_i32": np.full((3,), np.iinfo(np.int32).max, np.int32),
    }
    assert finite(ints) is True
    assert finite({**ints, "f": device_array(np.ones(2))}) is True
    assert finite({**ints, "f": device_array([1.0, np.nan])}) is False


def test_float0_leaves_are_ignored():
    _, int_grad = jax.jit(jax.grad(lambda x, n: x * n, argnums=(0, 1), allow_int=True))(1.0, 3)
    assert int_grad.dtype == jax.dtypes.float0
    tree = {"from_grad": int_grad, "zeros": float0_zeros((2, 3))}
    assert finite(tree) is True
    assert finite({**tree, "f": jnp.full((2,), 0.5)}) is True
    assert finite({**tree, "f": device_array([0.5, -np.inf])}) is False


@pytest.mark.parametrize(
    ("leaf", "expected"),
    [
        # JAX scalars copied from NumPy: nothing compiles while the tests are collected.
        (device_array(1.0), True),
        (device_array(np.inf), False),
        (device_array(np.nan, jnp.float16), False),
        (np.float32(-np.inf), False),
        (np.float16(2.0), True),
        (device_array(7, jnp.int32), True),
    ],
    ids=["f32", "f32-inf", "f16-nan", "np-f32-neg-inf", "np-f16", "i32"],
)
def test_scalar_leaf(leaf, expected):
    assert finite(leaf) is expected
    assert finite({"s": leaf}) is expected


def test_one_bad_entry_deep_inside_a_nested_tree():
    def tree(deep):
        return {
            "a": [
                device_array(np.ones(2)),
                {
                    "b": (
                        device_array(np.zeros((2, 2))),
                        None,
                        {"c": [device_array(np.ones(1)), deep]},
                    )
                },
            ],
            "z": device_array(np.arange(3), jnp.int32),
        }

    ok = np.linspace(-1.0, 1.0, 5).astype(jnp.bfloat16)
    bad = ok.copy()
    bad[4] = np.nan
    assert finite(tree(jnp.asarray(ok))) is True
    assert finite(tree(jnp.asarray(bad))) is False


def test_numpy_arrays_as_leaves():
    good = {"f32": np.ones((2, 2), np.float32), "f16": np.full((3,), 0.25, np.float16)}
    assert finite(good) is True
    assert finite({**good, "bad": np.array([0.0, np.inf], np.float32)}) is False
    assert finite({**good, "bad": np.array([np.nan], np.float16)}) is False


def test_large_array_with_one_nan_at_the_end():
    leaf = np.ones((1 << 20,), np.float32)
    assert finite({"w": leaf}) is True
    leaf[-1] = np.nan
    assert finite({"w": leaf}) is False


# --- leaf checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (
            {"a": {"b": "oops"}},
            "all_finite: tree leaf at ['a']['b'] has type str ('oops'); "
            "every leaf must be a JAX or NumPy array (or None)",
        ),
        (
            [device_array(np.ones(2)), {"w": 1.5, "n": 10**5000}],
            "all_finite: tree leaf at [1]['n'] has type int (<int of 16610 bits>); "
            "every leaf must be a JAX or NumPy array (or None)",
        ),
        (
            {"s": np.array(["x"])},
            "all_finite: tree leaf at ['s'] has dtype <U1; "
            "expected a numeric, boolean or float0 array",
        ),
    ],
    ids=["str", "python-int-past-numpy", "str-array"],
)
def test_non_array_leaf_raises_type_error_naming_its_path(tree, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        jls.all_finite(tree)
    # Inside jit the check fires at trace time, on a closed-over tree.
    with pytest.raises(TypeError, match=re.escape(message)):
        jax.jit(lambda: jls.all_finite(tree))()


def test_python_numbers_are_taken_as_arrays_as_jmp_takes_them():
    """jmp's `all_finite` is `jnp.isfinite` over every leaf: a learning rate logged beside the
    gradients is checked, and an int or a bool is finite."""
    grads = {"g": device_array([1.0, 2.0])}
    assert bool(jls.all_finite({**grads, "learning_rate": 1e-3, "step": 7, "done": True}))
    assert not bool(jls.all_finite({**grads, "loss": float("inf")}))
    assert not bool(jls.all_finite({**grads, "z": complex(0.0, float("nan"))}))
    assert not bool(jax.jit(lambda g: jls.all_finite({**g, "x": float("-inf")}))(grads))


# --- several devices --------------------------------------------------------------------------

BAD_DEVICE_CASES = [(None, np.inf), (0, np.nan), (5, -np.inf), (7, np.inf)]


def per_device_grads(bad_device: int | None, value: float = np.inf) -> dict:
    """Gradients with a leading device axis; `bad_device` (if any) holds one `value`."""
    w = np.full((N_DEVICES, 4, 3), 0.5, np.float32)
    b = np.ones((N_DEVICES, 3), np.float16)
    if bad_device is not None:
        w[bad_device, 2, 1] = value
    return {"w": w, "b": b, "step": np.arange(N_DEVICES, dtype=np.int32)}


def replicated(tree):
    """`tree` stacked `N_DEVICES` times, on the host (for `pmap`, which copies it)."""
    return jax.tree.map(lambda x: np.broadcast_to(x, (N_DEVICES, *np.shape(x))), tree)


def device_rows(tree, i: int):
    return jax.tree.map(lambda x: np.asarray(x)[i], tree)


@pytest.mark.parametrize(("bad_device", "value"), BAD_DEVICE_CASES)
def test_pmap_all_finite_with_axis_name_agrees_on_every_device(bad_device, value):
    fn = jax.pmap(lambda g: jls.all_finite(g, axis_name="i"), axis_name="i")
    result = fn(per_device_grads(bad_device, value))
    assert result.dtype == jnp.bool_
    np.testing.assert_array_equal(result, np.full((N_DEVICES,), bad_device is None))


def test_pmap_all_finite_without_axis_name_answers_per_device():
    result = jax.pmap(jls.all_finite)(per_device_grads(bad_device=5))
    np.testing.assert_array_equal(result, np.arange(N_DEVICES) != 5)


def dynamic_loss_scale() -> jls.DynamicLossScale:
    return jls.DynamicLossScale(initial_loss_scale=2.0**15, increment_period=1)


def single_device_update(ls: jls.DynamicLossScale, grads: dict):
    """`update` on one device over all devices' gradients at once: the answer to agree with."""
    return ls.update(ls.init(), jax.tree.map(jnp.asarray, grads))


@pytest.mark.parametrize("bad_device", [None, 3])
def test_pmap_update_with_axis_name_gives_every_device_the_same_state(bad_device):
    ls = dynamic_loss_scale()
    grads = per_device_grads(bad_device)
    fn = jax.pmap(lambda s, g: ls.update(s, g, axis_name="i"), axis_name="i")
    state, should_apply = fn(replicated(ls.init()), grads)

    expected_scale = 2.0**16 if bad_device is None else 2.0**14
    expected_state = jls.DynamicLossScaleState(
        loss_scale=np.float32(expected_scale),
        good_steps=np.int32(0),
        overflows_until_backoff=np.int32(1),
    )
    chex.assert_trees_all_equal(
        single_device_update(ls, grads), (expected_state, bad_device is None)
    )
    np.testing.assert_array_equal(should_apply, np.full((N_DEVICES,), bad_device is None))
    for i in range(N_DEVICES):
        chex.assert_trees_all_equal(device_rows(state, i), expected_state, strict=True)


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((N_DEVICES,), ("d",))


def sharded_grads(mesh, bad_device: int | None, value: float = np.inf) -> dict:
    """`per_device_grads` laid out over `mesh`, device `k` holding row `k`."""
    return jax.device_put(per_device_grads(bad_device, value), NamedSharding(mesh, P("d")))


@pytest.mark.parametrize(("bad_device", "value"), BAD_DEVICE_CASES)
def test_shard_map_all_finite_with_axis_name(jit_or_eager, mesh, bad_device, value):
    grads = sharded_grads(mesh, bad_device, value)
    replicated_out = jax.shard_map(
        lambda g: jls.all_finite(g, axis_name="d"), mesh=mesh, in_specs=P("d"), out_specs=P()
    )
    per_device_out = jax.shard_map(
        lambda g: jls.all_finite(g, axis_name="d")[None],
        mesh=mesh,
        in_specs=P("d"),
        out_specs=P("d"),
    )
    result = jit_or_eager(replicated_out, grads)
    assert result.dtype == jnp.bool_
    assert result.shape == ()
    assert bool(result) is (bad_device is None)
    # Eager shard_map runs op by op on 8 devices (seconds); this layout is checked under jit only.
    np.testing.assert_array_equal(
        jax.jit(per_device_out)(grads), np.full((N_DEVICES,), bad_device is None)
    )


@pytest.mark.parametrize("bad_device", [None, 6])
def test_shard_map_update_with_axis_name_gives_every_device_the_same_state(
    jit_or_eager, mesh, bad_device
):
    ls = dynamic_loss_scale()
    grads = sharded_grads(mesh, bad_device)
    expected = single_device_update(ls, per_device_grads(bad_device))

    replicated_out = jax.shard_map(
        lambda s, g: ls.update(s, g, axis_name="d"),
        mesh=mesh,
        in_specs=(P(), P("d")),
        out_specs=P(),
    )
    chex.assert_trees_all_equal(jit_or_eager(replicated_out, ls.init(), grads), expected)

    per_device_out = jax.shard_map(
        lambda s, g: jax.tree.map(lambda x: x[None], ls.update(s, g, axis_name="d")),
        mesh=mesh,
        in_specs=(P(), P("d")),
        out_specs=P("d"),
    )
    # Eager shard_map runs op by op on 8 devices (seconds); this layout is checked under jit only.
    stacked = jax.jit(per_device_out)(ls.init(), grads)
    for i in range(N_DEVICES):
        chex.assert_trees_all_equal(device_rows(stacked, i), expected)


def spmd_grads(bad: tuple[str, tuple[int, ...]] | None) -> dict:
    grads = {
        "w": np.linspace(-1.0, 1.0, 64 * 16, dtype=np.float32).reshape(64, 16),
        "v": np.full((8, 8), 0.125, np.float16),
        "b": np.ones((16,), np.float32),
        "n": np.arange(64, dtype=np.int32),
    }
    if bad is not None:
        name, index = bad
        grads[name][index] = np.inf
    return grads


SPMD_SPECS = {"w": P("d", None), "v": P(None, "d"), "b": P(), "n": P("d")}


@pytest.mark.parametrize(
    "bad",
    [None, ("w", (63, 15)), ("w", (0, 0)), ("v", (4, 7)), ("b", (3,))],
    ids=["finite", "w-last-shard", "w-first-shard", "v-column-shard", "replicated-b"],
)
def test_spmd_jit_update_without_axis_name_matches_one_device(jit_or_eager, mesh, bad):
    ls = dynamic_loss_scale()
    host = spmd_grads(bad)
    sharded = {
        name: jax.device_put(leaf, NamedSharding(mesh, SPMD_SPECS[name]))
        for name, leaf in host.items()
    }
    assert len(sharded["w"].addressable_shards) == N_DEVICES

    state, should_apply = jit_or_eager(ls.update, ls.init(), sharded)
    chex.assert_trees_all_equal((state, should_apply), single_device_update(ls, host))
    assert bool(should_apply) is (bad is None)
    assert float(ls(state)) == (2.0**16 if bad is None else 2.0**14)
    assert bool(jit_or_eager(jls.all_finite, sharded)) is (bad is None)


# --- the reductions behind the finite check and the NaN search --------------------------------

JOIN_DTYPES = [np.float32, jnp.bfloat16, np.float16, jnp.float8_e4m3fn, np.complex64]


def join_tree() -> dict[str, np.ndarray]:
    """40 small leaves of five dtypes, in more than one group, and two large ones."""
    rng = np.random.default_rng(0)
    tree = {
        f"s{i:03d}": rng.normal(size=(int(rng.integers(1, 600)),)).astype(JOIN_DTYPES[i % 5])
        for i in range(40)
    }
    tree["big"] = rng.normal(size=(70, 100)).astype(np.float32)
    tree["big16"] = rng.normal(size=(5000,)).astype(np.float16)
    return tree


def test_leaves_on_one_device_join_small_ones_and_still_find_each_nan_and_inf():
    """With the leaves committed to one device of the 8 this process has, small leaves are
    checked together, one reduction per group, as for host arrays; every bad entry is still
    found."""
    tree = join_tree()
    one_device = jax.devices()[5]
    check = jax.jit(lambda t: (jls.all_finite(t), summarize_gradients(t, None).has_nan))
    for key in ["s000", "s001", "s004", "s017", "s039", "big", "big16"]:
        for value in ["nan", "inf", "-inf", None]:
            t = dict(tree)
            if value is not None:
                leaf = np.array(t[key])
                leaf.reshape(-1)[leaf.size // 2] = float(value)
                t[key] = leaf
            finite_, has_nan = check(jax.device_put(t, one_device))
            assert bool(finite_) is (value is None), (key, value)
            assert bool(has_nan) is (value == "nan"), (key, value)
    # 42 leaves (8 of them complex, so 50 parts): two alone, and the 48 small ones in groups
    # of at most GROUP_LEAVES, whatever their dtypes: 2 + 2 reductions, and one of their flags.
    assert GROUP_LEAVES == 32
    for placed in (tree, jax.device_put(tree, one_device)):
        jaxpr = str(jax.make_jaxpr(lambda t: finite_flag(t, None))(placed))
        assert jaxpr.count("reduce_and[") == 2 + 2 + 1
    # A step of loss_scaled counts a NaN in a joined leaf as a NaN skip (ten small leaves of
    # the five dtypes, in groups, to compile quickly).
    few = {key: tree[key] for key in sorted(tree)[:10]}
    tx = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale(1.0))
    bad = jax.device_put(dict(few, s007=np.full_like(few["s007"], np.nan)), one_device)
    _, state = jax.jit(tx.update)(bad, tx.init(few), jax.device_put(few, one_device))
    assert int(jls.get_loss_scale_stats(state).nan_skipped_steps) == 1


def test_leaves_that_may_be_sharded_are_checked_apart():
    """Leaves placed on the 8 devices (replicated over a mesh whose axis XLA may split them
    along): no small leaf is joined, one reduction per part; a NaN in a small leaf is still
    found."""
    tree = {
        "a": np.ones(7, np.float32),
        "b": np.ones(9, np.float32),
        "c": np.ones(5, jnp.bfloat16),
        "z": np.ones(2, np.complex64),
    }
    placed = jax.device_put(tree, NamedSharding(auto_mesh(), P()))
    jaxpr = str(jax.make_jaxpr(lambda t: finite_flag(t, None))(placed))
    assert jaxpr.count("reduce_and[") == 5 + 1  # each of the 5 parts, then their flags
    assert bool(jls.all_finite(placed)) is True
    bad = dict(tree, b=np.array([1.0] * 8 + [np.nan], np.float32))
    assert bool(jls.all_finite(jax.device_put(bad, NamedSharding(auto_mesh(), P())))) is False


# Parts, each with its expected squared norm and finite flag: the squared norm is NaN for a
# NaN entry and +inf for an infinity or finite squares that overflow float32, which the
# wrapper's check counts as not finite. Sums are in float32 (float16, bfloat16 and float8
# parts widened).
CHECKED_PARTS = {
    "finite": (np.array([3.0, -4.0], np.float32), 25.0, True),
    "nan": (np.array([1.0, np.nan], np.float32), np.nan, False),
    "inf": (np.array([1.0, np.inf], np.float32), np.inf, False),
    "-inf": (np.array([[1.0], [-np.inf]], np.float32), np.inf, False),
    "nan and inf": (np.array([np.inf, np.nan, 2.0], np.float32), np.nan, False),
    "squares overflow": (np.array([2e19, 1.0], np.float32), np.inf, False),
    "float16": (np.array([256.0, 2.0], np.float16), 65540.0, True),
    "float16 inf": (np.array([65504.0, np.inf], np.float16), np.inf, False),
    "bfloat16 nan": (np.array([0.5, np.nan], jnp.bfloat16), np.nan, False),
    "float8 nan": (np.array([448.0, np.nan], jnp.float8_e4m3fn), np.nan, False),
    "float8 max": (np.array([448.0, 2.0], jnp.float8_e4m3fn), 200708.0, True),
}


@pytest.mark.parametrize("form", [Form.CPU, Form.GPU], ids=lambda form: form.value)
@pytest.mark.parametrize("name", CHECKED_PARTS)
def test_the_summary_tells_a_nan_from_an_infinity_or_an_overflow(name, form):
    """Both forms, jitted, over a part alone and among others: the squared norm (NaN for a
    NaN entry, +inf for an infinity or squares that overflow), not finite for either, and a
    NaN flagged as such."""
    part, total, finite = CHECKED_PARTS[name]
    others = [device_array([1.0, 2.0]), device_array(np.ones((3, 2)), jnp.bfloat16)]
    for tree in ([part], [part, *others]):
        summary = jax.jit(lambda t: summarize_gradients(t, None, form=form))(tree)
        extra = 0.0 if len(tree) == 1 else 11.0
        assert summary.norm.dtype == jnp.float32
        np.testing.assert_allclose(summary.norm**2, np.float32(total + extra), rtol=2e-7)
        assert bool(summary.finite) is finite
        assert bool(summary.has_nan) is bool(np.isnan(total))


# The reductions of the summary of four parts, in each form: the three small ones (a float32
# matrix of 2048 entries, 7 bfloat16 and 9 float32 entries) combined entry by entry and summed
# over rows of 512 (4 rows); the float16 vector of 5000, in the CPU form over its 9 whole rows
# and its last 392 entries apart, in the GPU form over 10 rows, the last padded; then all the
# rows' sums in one more sum. In the CPU form the rows are summed by reductions of two results
# (the sum and an infinity flag), in the GPU form by plain sums.
ROW_REDUCTIONS = {
    Form.CPU: ["(f32[4]{0}, pred[4]{0})", "(f32[9]{0}, pred[9]{0})", "f32[]", "f32[]"],
    Form.GPU: ["f32[10]{0}", "f32[4]{0}", "f32[]"],
}


@pytest.mark.parametrize("form", [Form.CPU, Form.GPU], ids=lambda form: form.value)
def test_one_reduction_per_part_over_whole_rows_then_one_over_the_rows(form):
    """Compiled for a CPU: each part summed over rows of 512, small parts together, then one
    sum over the rows' sums; the norm the exact one."""
    parts = [
        device_array(np.ones((64, 32))),
        device_array(np.ones(5000), jnp.float16),
        device_array(np.ones(7), jnp.bfloat16),
        device_array(np.ones(9)),
    ]
    text = jax.jit(lambda p: summarize_gradients(p, None, form=form)).lower(parts).compile()
    assert sorted(compiled_reductions(text.as_text())) == ROW_REDUCTIONS[form]
    norm = jax.jit(lambda p: summarize_gradients(p, None, form=form).norm)(parts)
    np.testing.assert_allclose(float(norm), np.sqrt(2048 + 5000 + 7 + 9), rtol=1e-7)


def test_the_norm_of_a_large_leaf_is_within_1e_6_of_the_exact_one():
    """DESIGN 3.1: row sums, not one long float32 accumulation (which drifted by 1e-4 at this
    size on the CPU), in both forms."""
    rng = np.random.default_rng(5)
    leaf = (rng.standard_normal(2**24 + 3) * 3).astype(np.float32)
    exact = np.sqrt(np.sum(leaf.astype(np.float64) ** 2))
    for form in (Form.CPU, Form.GPU):
        norm = jax.jit(lambda x, form=form: summarize_gradients([x], None, form=form).norm)(leaf)
        np.testing.assert_allclose(float(norm), exact, rtol=1e-6)


def _in_jit(leaf) -> bool:
    """`may_be_sharded` of `leaf` as `jit` traces it."""
    found = []
    jax.jit(lambda x: found.append(may_be_sharded(x)) or x)(leaf)
    return found[0]


def auto_mesh() -> Mesh:
    """The 8 devices on an axis whose splits XLA's partitioner chooses (`jax.make_mesh`, as
    the `mesh` fixture, makes explicit axes)."""
    return Mesh(np.array(jax.devices()), ("d",))


def _explicit_mesh() -> Mesh:
    return jax.make_mesh((N_DEVICES,), ("e",), axis_types=(AxisType.Explicit,))


# Where a leaf is, and whether it may be sharded: split over more than one device by an
# explicit spec, or on a mesh whose axes XLA's partitioner splits as it chooses (Auto).
PLACED_LEAVES = {
    "numpy array": (lambda: np.ones(16, np.float32), False),
    "jax array, default device": (lambda: device_array(np.ones(16)), False),
    "committed to device 3 of 8": (
        lambda: jax.device_put(device_array(np.ones(16)), jax.devices()[3]),
        False,
    ),
    "auto mesh, split": (
        lambda: jax.device_put(device_array(np.ones(16)), NamedSharding(auto_mesh(), P("d"))),
        True,
    ),
    "auto mesh, replicated": (
        lambda: jax.device_put(device_array(np.ones(16)), NamedSharding(auto_mesh(), P())),
        True,
    ),
    "explicit mesh, split": (
        lambda: jax.device_put(device_array(np.ones(16)), NamedSharding(_explicit_mesh(), P("e"))),
        True,
    ),
    "explicit mesh, replicated": (
        lambda: jax.device_put(device_array(np.ones(16)), NamedSharding(_explicit_mesh(), P())),
        False,
    ),
    "explicit mesh, split over an axis of one device": (
        lambda: jax.device_put(
            device_array(np.ones((2, 8))),
            NamedSharding(
                jax.make_mesh((8, 1), ("e", "one"), axis_types=(AxisType.Explicit,) * 2),
                P(None, "one"),
            ),
        ),
        True,  # its type is split: JAX refuses to reshape it without an output sharding
    ),
    "auto mesh of one device": (
        lambda: jax.device_put(
            device_array(np.ones(16)),
            NamedSharding(Mesh(np.array(jax.devices()[2:3]), ("d",)), P("d")),
        ),
        False,
    ),
}


@pytest.mark.parametrize("where", PLACED_LEAVES)
def test_may_be_sharded_reads_where_the_leaf_is_not_the_device_count(where):
    """The form of the check follows the leaf, eagerly and as `jit` traces it; this process
    has 8 devices, and a leaf on one of them is not sharded."""
    make, expected = PLACED_LEAVES[where]
    assert jax.device_count() == N_DEVICES
    assert may_be_sharded(make()) is expected
    assert _in_jit(make()) is expected


def test_may_be_sharded_inside_pmap_and_shard_map_and_under_a_mesh(mesh):
    """Inside `pmap` and `shard_map` (manual axes) each device's values are its own: not
    sharded, unless an axis is left to the partitioner (`shard_map` over some axes of the
    mesh). A mesh entered with `jax.sharding.set_mesh` makes an unplaced leaf one that may be
    sharded; `jit` given `in_shardings` alone says nothing, and the leaf counts as unsharded
    (the one-pass form then gathers a pair of scalars per device; tests/test_lowering.py)."""
    found = []

    def record(x):
        found.append(may_be_sharded(x))
        return x

    jax.pmap(record, axis_name="d")(device_array(np.ones((N_DEVICES, 3))))
    rows = jax.device_put(device_array(np.ones(16)), NamedSharding(mesh, P("d")))
    jax.shard_map(record, mesh=mesh, in_specs=P("d"), out_specs=P("d"))(rows)
    grid = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    jax.shard_map(record, mesh=grid, in_specs=P("a"), out_specs=P("a"), axis_names={"a"})(
        device_array(np.ones(16))
    )
    split = NamedSharding(auto_mesh(), P("d"))
    with jax.sharding.set_mesh(auto_mesh()):
        jax.jit(record)(device_array(np.ones(16)))
    jax.jit(record, in_shardings=split, out_shardings=split)(device_array(np.ones(16)))
    assert found == [False, False, True, True, False]


def test_under_shard_map_small_leaves_join_by_the_axes_they_vary_over(mesh):
    """Inside `shard_map` small leaves are joined, but a leaf that varies over the axis (a
    shard of the gradient, summed over the axis) never with one the same on every device
    (counted once): two parts, and the norm of the whole gradient."""
    rows = np.arange(16, dtype=np.float32)  # 2 entries per device
    same = np.array([3.0, 4.0, 12.0], np.float32)

    def check(shard, whole):
        parts = floating_parts({"rows": shard, "same": whole})
        return len(parts), summarize_gradients({"rows": shard, "same": whole}, "d").norm

    sharded = jax.device_put(rows, NamedSharding(mesh, P("d")))
    count, norm = jax.shard_map(check, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())(
        sharded, jax.device_put(same, NamedSharding(mesh, P()))
    )
    assert int(count) == 2
    np.testing.assert_allclose(norm, np.sqrt(np.sum(rows**2) + 169.0), rtol=1e-6)


@pytest.mark.parametrize("bad", [None, np.nan, np.inf], ids=["finite", "nan", "inf"])
def test_summary_flags_agree_sharded_and_under_pmap(bad):
    """A NaN or inf in one shard of a gradient split over 8 devices: SPMD `jit` (two passes)
    and `pmap` over the same shards (one pass, combined over the axis) agree with one
    device on the finite flag and the NaN flag, and on the norm of finite gradients."""
    host = np.arange(64, dtype=np.float32).reshape(8, 8) / 8
    if bad is not None:
        host[5, 3] = bad
    expected = summarize_gradients({"g": jnp.asarray(host)}, None)
    mesh = jax.make_mesh((N_DEVICES,), ("d",))
    sharded = jax.device_put(host, NamedSharding(mesh, P("d")))
    spmd = jax.jit(lambda g: summarize_gradients({"g": g}, None))(sharded)
    pmapped = jax.pmap(lambda g: summarize_gradients({"g": g}, "d"), axis_name="d")(host)
    has_nan = bad is not None and bool(np.isnan(bad))
    for result in (expected, spmd, *(jax.tree.map(lambda x, i=i: x[i], pmapped) for i in range(8))):
        assert bool(result.finite) is (bad is None)
        assert bool(result.has_nan) is has_nan
    np.testing.assert_array_equal(spmd.norm, expected.norm)  # NaN, or the same finite norm
    if bad is None:
        np.testing.assert_allclose(spmd.norm, np.linalg.norm(host), rtol=1e-6)


def test_small_leaves_are_reduced_in_groups_whatever_their_dtypes():
    tree = {
        "a": device_array(np.ones(3000)),
        "b": device_array(np.ones(3000)),
        "c": device_array(np.ones((40, 10)), jnp.bfloat16),
        "d": device_array(np.ones(5000)),  # above SMALL_PART: a part of its own
        "e": device_array(np.ones(2), jnp.complex64),  # its real and imaginary parts, as float32
        "i": device_array(np.ones(3), jnp.int32),  # not floating: left out
    }
    assert SMALL_PART == 4096
    parts = floating_parts(tree)
    assert [part.shape for part in parts] == [(3000,), (3000,), (40, 10), (5000,), (2,), (2,)]
    groups = reduction_groups(parts)
    assert [[part.shape for part in group] for group in groups] == [
        [(3000,), (3000,), (40, 10), (2,), (2,)],
        [(5000,)],
    ]


def test_a_group_holds_at_most_group_leaves_leaves():
    tree = [device_array(np.ones(40)) for _ in range(70)]
    assert [len(group) for group in reduction_groups(floating_parts(tree))] == [32, 32, 6]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_a_bad_entry_in_any_leaf_of_a_group_is_found(dtype):
    """Leaves of 1, 7, 4096 and 5000 entries (the first three in one group, combined entry by
    entry after padding): a NaN or an infinity in any of them is found by `all_finite` and by
    the summary, and told apart."""
    rng = np.random.default_rng(1)
    leaves = [rng.normal(size=n).astype(np.float32) * 100 for n in (1, 7, 4096, 5000)]
    check = jax.jit(lambda t: (jls.all_finite(t), summarize_gradients(t, None)))
    for index in range(len(leaves)):
        for value in (np.nan, np.inf, -np.inf):
            bad = [leaf.copy() for leaf in leaves]
            bad[index][-1] = value
            finite_, summary = check([device_array(x, dtype) for x in bad])
            assert not bool(finite_), (index, value)
            assert not bool(summary.finite), (index, value)
            has_nan = bool(np.isnan(np.asarray(value, dtype)))  # e4m3fn has no inf: NaN
            assert bool(summary.has_nan) is has_nan
    finite_, summary = check([device_array(x, dtype) for x in leaves])
    assert bool(finite_)
    assert bool(summary.finite)
