"""`Policy`, `get_policy`, `cast_tree` and the casts, `half_dtype` and `full_precision`.

Three parts:

- jmp's policy tests, ported from jmp 0.0.4's jmp/_src/policy_test.py (absltest
  parameterized -> pytest parametrize, the same parameters and expectations). Where a port
  differs, its docstring says how and why.
- mpx's cast tests, ported from mpx 0.1.8's tests/test_cast.py (the repository
  Data-Science-in-Mechanical-Engineering/mixed_precision_for_JAX), equinox modules kept.
  mpx's names map to ours as: `cast_tree` -> `cast_tree`, `cast_to_float32` and
  `cast_to_full_precision` -> `cast_to_full`, `cast_to_float16` / `cast_to_bfloat16` ->
  `cast_tree(x, jnp.float16 / jnp.bfloat16)`, `cast_to_half_precision` -> `cast_to_half`
  (`HALF_PRECISION_DATATYPE` -> `half_dtype()`), `force_full_precision` -> `full_precision`.
- Our own pins: what `cast_tree` leaves alone, the pytrees it works on, `Policy` under
  `jit`, the round trip of `str`, and every error message.
"""

import itertools
import re
from typing import NamedTuple

import chex
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_lossscale as jls

from helpers import device_array

# --- jmp's policy tests -----------------------------------------------------------------------

HALF_DTYPES = (np.float16, jnp.float16, jnp.bfloat16)
FULL_DTYPES = (np.float32, jnp.float32)
DTYPES = HALF_DTYPES + FULL_DTYPES
NUMPYS = (np, jnp)
DTYPE_IDS = ["np.float16", "jnp.float16", "jnp.bfloat16", "np.float32", "jnp.float32"]
DTYPES_AND_NUMPYS = pytest.mark.parametrize(
    ("dtype", "np_"),
    list(itertools.product(DTYPES, NUMPYS)),
    ids=[f"{d}-{n.__name__}" for d, n in itertools.product(DTYPE_IDS, NUMPYS)],
)


def get_dtype_name(dtype):
    return {np.float16: "float16", jnp.bfloat16: "bfloat16", np.float32: "float32"}[
        np.dtype(dtype).type
    ]


def assert_dtypes_equal(tree_a, tree_b):
    jax.tree.map(lambda a, b: _assert_equal(a.dtype, b.dtype), tree_a, tree_b)


def _assert_equal(a, b):
    assert a == b


@DTYPES_AND_NUMPYS
def test_policy_cast_to_param(dtype, np_):
    """jmp skips float16 on TPUs and bfloat16 on GPUs; on CPU nothing is skipped."""
    policy = jls.Policy(dtype, dtype, dtype)
    assert policy.param_dtype == dtype
    tree = {"a": np_.ones([])}
    assert_dtypes_equal(policy.cast_to_param(tree), {"a": np_.ones([], dtype)})


@DTYPES_AND_NUMPYS
def test_policy_cast_to_compute(dtype, np_):
    policy = jls.Policy(dtype, dtype, dtype)
    assert policy.compute_dtype == dtype
    tree = {"a": np_.ones([])}
    assert_dtypes_equal(policy.cast_to_compute(tree), {"a": np_.ones([], dtype)})


@DTYPES_AND_NUMPYS
def test_policy_cast_to_output(dtype, np_):
    policy = jls.Policy(dtype, dtype, dtype)
    assert policy.output_dtype == dtype
    tree = {"a": np_.ones([])}
    assert_dtypes_equal(policy.cast_to_output(tree), {"a": np_.ones([], dtype)})


@DTYPES_AND_NUMPYS
def test_policy_with_output_dtype(dtype, np_):
    policy = jls.Policy(np_.float32, np_.float32, np_.float32)
    policy = policy.with_output_dtype(dtype)
    assert policy.output_dtype == dtype


@pytest.mark.parametrize(
    ("dtype_name", "dtype"),
    [("float16", np.float16), ("float32", np.float32), ("bfloat16", jnp.bfloat16)],
)
def test_get_policy(dtype_name, dtype):
    policy = jls.get_policy(dtype_name)
    assert policy.param_dtype == dtype
    assert policy.compute_dtype == dtype
    assert policy.output_dtype == dtype


def test_get_policy_almost_dtype():
    """jmp's message starts "Unknown dtype"; ours "unknown dtype", after the call it names."""
    with pytest.raises(ValueError, match="unknown dtype 'compute_float16'"):
        jls.get_policy("compute_float16")


@DTYPES_AND_NUMPYS
def test_get_policy_mixed(dtype, np_):
    full = np_.float32
    policy = jls.get_policy(f"c={get_dtype_name(dtype)}")
    assert policy.param_dtype == full
    assert policy.compute_dtype == dtype
    assert policy.output_dtype == dtype


@DTYPES_AND_NUMPYS
def test_get_policy_compute(dtype, np_):
    full = np_.float32
    policy = jls.get_policy(f"c={get_dtype_name(dtype)},o=full")
    assert policy.param_dtype == full
    assert policy.compute_dtype == dtype
    assert policy.output_dtype == full


def test_half_dtype():
    """jmp asks the first local device's platform; `half_dtype` asks the default backend."""
    if jax.default_backend() == "tpu":
        assert jls.half_dtype() == jnp.bfloat16
    else:
        assert jls.half_dtype() == jnp.float16


def test_cast_to_full():
    """As jmp's, plus the dtypes: `==` alone holds for 1.0 in float16 and in float32."""
    half_tree = {
        "o": object(),
        "h": jnp.ones([], dtype=jls.half_dtype()),
        "f": jnp.ones([]),
        "i": jnp.ones([], dtype=jnp.int16),
    }
    full_tree = {
        "o": half_tree["o"],
        "h": half_tree["h"].astype(jnp.float32),
        "f": half_tree["f"],
        "i": half_tree["i"],
    }
    result = jls.cast_to_full(half_tree)
    assert result == full_tree
    assert_dtypes_equal({k: result[k] for k in "hfi"}, {k: full_tree[k] for k in "hfi"})


def test_cast_to_half():
    """As jmp's, plus the dtypes (see below)."""
    dtype = jls.half_dtype()
    half_tree = {
        "o": object(),
        "h": jnp.ones([], dtype=dtype),
        "f": jnp.ones([]),
        "i": jnp.ones([], dtype=jnp.int16),
    }
    full_tree = {
        "o": half_tree["o"],
        "h": half_tree["h"],
        "f": half_tree["f"].astype(dtype),
        "i": half_tree["i"],
    }
    result = jls.cast_to_half(full_tree)
    assert result == half_tree
    # jmp's trees are named the wrong way round here (its "full" tree holds the half "f"), so
    # `==` holds on values only; the dtypes are checked on their own.
    assert [result["h"].dtype, result["f"].dtype, result["i"].dtype] == [dtype, dtype, jnp.int16]
    assert result["o"] is half_tree["o"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_str(dtype):
    """jmp writes each dtype's first name, "full" for float32; ours writes "f32". Ported as:
    the exact string, and `str` parses back to the same policy."""
    policy = jls.Policy(dtype, dtype, dtype)
    name = {np.float16: "f16", jnp.bfloat16: "bf16", np.float32: "f32"}[np.dtype(dtype).type]
    assert str(policy) == f"p={name},c={name},o={name}"
    assert jls.get_policy(str(policy)) == policy


# --- mpx's cast tests -------------------------------------------------------------------------


class EqxModuleBase(eqx.Module):
    a: jax.Array
    b: jax.Array

    def __init__(self):
        self.a = jnp.ones(10, dtype=jnp.float32)
        self.b = jnp.ones(10, dtype=jnp.float32)


class LeafClass:
    """Not a pytree: a leaf, left as it is, arrays inside included."""

    def __init__(self):
        self.a = jnp.ones(10, dtype=jnp.float32)
        self.b = jnp.ones(10, dtype=jnp.float32)


class EqxModule1(eqx.Module):
    a: list
    b: jax.Array
    c: LeafClass

    def __init__(self):
        self.a = [EqxModuleBase() for _ in range(10)]
        self.b = jnp.ones(10, dtype=jnp.float32)
        self.c = LeafClass()


# Built by numpy and copied to the device: nothing is compiled at import.
F32_ARRAY = device_array([1.0, 2.0, 3.0], dtype=np.float32)
F16_ARRAY = device_array([1.0, 2.0, 3.0], dtype=np.float16)
BF16_ARRAY = device_array([1.0, 2.0, 3.0], dtype=jnp.bfloat16)
NESTED = {"a": F32_ARRAY, "b": {"c": F16_ARRAY, "d": BF16_ARRAY}}


def nested_dtypes(tree):
    return [tree["a"].dtype, tree["b"]["c"].dtype, tree["b"]["d"].dtype]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_mpx_cast_eqx_module(dtype):
    module = EqxModule1()
    result = jls.cast_tree(module, dtype)
    for base in result.a:
        assert base.a.dtype == dtype
        assert base.b.dtype == dtype
    assert result.b.dtype == dtype
    assert result.c is module.c  # not a pytree: not looked into
    assert result.c.a.dtype == jnp.float32
    assert result.c.b.dtype == jnp.float32


def test_mpx_cast_tree():
    assert jls.cast_tree(F16_ARRAY, jnp.float32).dtype == jnp.float32
    assert nested_dtypes(jls.cast_tree(NESTED, jnp.float32)) == [jnp.float32] * 3


def test_mpx_cast_to_float32():
    """mpx's `cast_to_float32` is our `cast_to_full`."""
    assert jls.cast_to_full(F16_ARRAY).dtype == jnp.float32
    assert nested_dtypes(jls.cast_to_full(NESTED)) == [jnp.float32] * 3


def test_mpx_cast_to_float16():
    """mpx's `cast_to_float16` is `cast_tree(x, jnp.float16)`: we have no function of its own."""
    assert jls.cast_tree(F32_ARRAY, jnp.float16).dtype == jnp.float16
    assert nested_dtypes(jls.cast_tree(NESTED, jnp.float16)) == [jnp.float16] * 3


def test_mpx_cast_to_bfloat16():
    """mpx's `cast_to_bfloat16` is `cast_tree(x, jnp.bfloat16)`."""
    assert jls.cast_tree(F32_ARRAY, jnp.bfloat16).dtype == jnp.bfloat16
    assert nested_dtypes(jls.cast_tree(NESTED, jnp.bfloat16)) == [jnp.bfloat16] * 3


def test_mpx_cast_to_full_precision():
    assert jls.cast_to_full(F16_ARRAY).dtype == jnp.float32
    assert nested_dtypes(jls.cast_to_full(NESTED)) == [jnp.float32] * 3


def test_mpx_cast_to_half_precision():
    """mpx's half dtype is a global it sets (float16 by default); ours is `half_dtype()`, float16
    on CPU and GPU, bfloat16 on TPU."""
    assert jls.cast_to_half(F32_ARRAY).dtype == jls.half_dtype()
    assert nested_dtypes(jls.cast_to_half(NESTED)) == [jls.half_dtype()] * 3


def test_mpx_force_full_precision_decorator():
    """mpx's `force_full_precision` casts outputs to float16 by default; `full_precision` leaves
    them as `fn` returns them unless given `output_dtype`. Both are checked, and that `fn` sees
    float32 inputs."""
    seen = []

    def test_func(x, y):
        seen.append((x.dtype, y.dtype))
        return x + y, x * y

    x = jnp.array([1.0, 2.0], dtype=jnp.float16)
    y = jnp.array([3.0, 4.0], dtype=jnp.float16)
    result1, result2 = jls.full_precision(test_func, output_dtype=jnp.float16)(x, y)
    assert result1.dtype == jnp.float16
    assert result2.dtype == jnp.float16
    result1, result2 = jls.full_precision(test_func)(x, y)
    assert result1.dtype == jnp.float32
    assert result2.dtype == jnp.float32
    assert seen == [(jnp.float32, jnp.float32)] * 2


def test_mpx_mixed_tree_handling():
    mixed = {"array": F32_ARRAY, "scalar": 42, "nested": {"array": F16_ARRAY, "none": None}}
    result = jls.cast_to_full(mixed)
    assert result["array"].dtype == jnp.float32
    assert result["scalar"] == 42
    assert result["nested"]["none"] is None
    assert result["nested"]["array"].dtype == jnp.float32


def test_mpx_empty_structures():
    assert jls.cast_to_full({}) == {}
    assert jls.cast_to_full([]) == []


def test_mpx_non_float_arrays():
    int32_array = jnp.array([1, 2, 3], dtype=jnp.int32)
    bool_array = jnp.array([True, False], dtype=jnp.bool_)
    assert jls.cast_to_full(int32_array).dtype == jnp.int32
    assert jls.cast_to_full(bool_array).dtype == jnp.bool_
    mixed = {
        "float32": jnp.array([1.0, 2.0], dtype=jnp.float32),
        "int32": int32_array,
        "bool": bool_array,
        "nested": {"float16": jnp.array([1.0, 2.0], dtype=jnp.float16), "int32": int32_array},
    }
    result = jls.cast_to_full(mixed)
    assert result["float32"].dtype == jnp.float32
    assert result["nested"]["float16"].dtype == jnp.float32
    assert result["int32"].dtype == jnp.int32
    assert result["bool"].dtype == jnp.bool_
    assert result["nested"]["int32"].dtype == jnp.int32


# mpx's `cast_function(fn, dtype, return_dtype)` tests, for dtype float32: `full_precision(fn,
# output_dtype)`. Their float16 halves have no counterpart here (we widen, never narrow, inputs).


def test_mpx_cast_function_tuple_return_values():
    result1, result2 = jls.full_precision(lambda x, y: (x + y, x * y))(F32_ARRAY, F32_ARRAY)
    assert result1.dtype == jnp.float32
    assert result2.dtype == jnp.float32


def test_mpx_cast_function_different_input_output_dtypes():
    result = jls.full_precision(lambda x: x, output_dtype=jnp.float16)(F16_ARRAY)
    assert result.dtype == jnp.float16


def test_mpx_cast_function_args_and_kwargs():
    """Keyword arguments are widened too."""

    def complex_op(x, y, scale=1.0):
        assert scale.dtype == jnp.float32
        return x + y * scale

    result = jls.full_precision(complex_op)(F16_ARRAY, F16_ARRAY, scale=jnp.float16(2.0))
    assert result.dtype == jnp.float32
    np.testing.assert_array_equal(result, [3.0, 6.0, 9.0])


def test_mpx_cast_function_non_array_inputs_outputs():
    op = jls.full_precision(lambda x, y: (x + y, "string result", 42), output_dtype=jnp.float16)
    result1, result2, result3 = op(F32_ARRAY, F32_ARRAY)
    assert result1.dtype == jnp.float16
    assert result2 == "string result"
    assert result3 == 42


def test_mpx_cast_function_nested_structures():
    op = jls.full_precision(lambda x, y: {"sum": x + y, "product": x * y})
    result = op(F16_ARRAY, F16_ARRAY)
    assert result["sum"].dtype == jnp.float32
    assert result["product"].dtype == jnp.float32


# --- cast_tree: what it leaves alone, and where it works ---------------------------------------


class Pair(NamedTuple):
    weight: jax.Array
    step: jax.Array


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_cast_tree_leaves_everything_but_other_floating_arrays_untouched(dtype):
    untouched = {
        "int": jnp.arange(3, dtype=jnp.int32),
        "uint8": np.arange(3, dtype=np.uint8),
        "bool": jnp.array([True, False]),
        "complex": jnp.ones(2, jnp.complex64),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(0),  # uint32: not floating
        "python_float": 1.5,
        "python_int": 3,
        "none": None,
        "string": "dense",
        "function": jax.nn.relu,
        "same_dtype": jnp.ones(2, dtype),
        "same_dtype_numpy": np.ones(2, dtype),
    }
    other = jnp.float32 if dtype != jnp.float32 else jnp.float16
    tree = {**untouched, "other": jnp.ones(2, other)}
    result = jls.cast_tree(tree, dtype)
    for name, leaf in untouched.items():
        assert result[name] is leaf, name
    assert result["other"].dtype == dtype


def test_cast_tree_of_an_array_already_in_dtype_adds_no_equation():
    x = jnp.ones(3, jnp.float16)
    assert jls.cast_tree(x, jnp.float16) is x
    assert jax.make_jaxpr(lambda x: jls.cast_tree(x, jnp.float16))(x).eqns == []
    tree = {"h": x, "i": jnp.int32(1), "k": jax.random.key(1)}
    assert jax.make_jaxpr(lambda t: jls.cast_tree(t, jnp.float16))(tree).eqns == []
    # One equation per leaf that changes dtype, none for the others.
    mixed = {"h": x, "f": jnp.ones(3), "d": jnp.ones(3, jnp.bfloat16)}
    eqns = jax.make_jaxpr(lambda t: jls.cast_tree(t, jnp.float16))(mixed).eqns
    assert [e.primitive.name for e in eqns] == ["convert_element_type"] * 2


def test_cast_tree_keeps_numpy_arrays_numpy_and_numpy_scalars_as_they_are():
    """A NumPy scalar is left as it is, as jmp leaves it (np.float64 is a Python float)."""
    tree = {"a": np.ones(3, np.float32), "s": np.float32(2.0), "lr": np.float64(1e-5)}
    result = jls.cast_tree(tree, jnp.float16)
    assert type(result["a"]) is np.ndarray
    assert result["a"].dtype == np.float16
    assert result["s"] is tree["s"]
    assert result["lr"] is tree["lr"]
    result = jls.cast_tree(np.ones(2, np.float16), jnp.bfloat16)
    assert type(result) is np.ndarray
    assert result.dtype == jnp.bfloat16


def test_cast_tree_keeps_values_that_fit():
    x = jnp.array([0.5, -2.0, 1024.0, 65504.0], jnp.float32)
    np.testing.assert_array_equal(jls.cast_tree(x, jnp.float16), x)
    np.testing.assert_array_equal(jls.cast_tree(x.astype(jnp.float16), jnp.float32), x)


def test_cast_tree_on_namedtuples():
    pair = Pair(jnp.ones(2), jnp.int32(4))
    result = jls.cast_tree(pair, jnp.float16)
    assert type(result) is Pair
    assert result.weight.dtype == jnp.float16
    assert result.step is pair.step


def test_cast_tree_on_an_equinox_module_keeps_functions_and_static_fields():
    class Model(eqx.Module):
        mlp: eqx.nn.MLP
        name: str = eqx.field(static=True)

    model = Model(eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0)), "net")
    result = jls.cast_tree(model, jnp.float16)
    assert result.name == "net"
    assert result.mlp.activation is model.mlp.activation
    assert result.mlp.final_activation is model.mlp.final_activation
    assert {leaf.dtype for leaf in jax.tree.leaves(eqx.filter(result, eqx.is_array))} == {
        np.dtype(jnp.float16)
    }
    assert jax.tree.structure(result) == jax.tree.structure(model)
    out = result.mlp(jnp.ones(2, jnp.float16))
    assert out.dtype == jnp.float16


def test_cast_tree_on_a_flax_nnx_state():
    model = nnx.Sequential(
        nnx.Linear(2, 4, rngs=nnx.Rngs(0)),
        nnx.BatchNorm(4, rngs=nnx.Rngs(0)),
        nnx.Dropout(0.1, rngs=nnx.Rngs(1)),
    )
    state = nnx.state(model)
    result = jls.cast_tree(state, jnp.float16)
    assert type(result) is type(state)
    floating = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floating  # kernel, bias, scale, mean, var...
    for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(result), strict=True):
        if jnp.issubdtype(before.dtype, jnp.floating):
            assert after.dtype == jnp.float16
        else:  # the rng keys and counts
            assert after is before
    nnx.update(model, result)
    assert model.layers[0].kernel[...].dtype == jnp.float16
    assert model.layers[1].mean[...].dtype == jnp.float16


def test_cast_tree_on_flax_linen_variables():
    module = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=True)])
    variables = module.init(jax.random.key(0), jnp.ones((1, 2)))
    result = jls.cast_tree(variables, jnp.float16)
    assert jax.tree.structure(result) == jax.tree.structure(variables)
    assert {leaf.dtype for leaf in jax.tree.leaves(result)} == {np.dtype(jnp.float16)}
    assert set(result) == {"params", "batch_stats"}
    out = module.apply(result, jnp.ones((1, 2), jnp.float16))
    assert out.shape == (1, 4)


def test_cast_tree_under_jit():
    @jax.jit
    def f(tree):
        return jls.cast_tree(tree, jnp.bfloat16)

    result = f({"w": jnp.ones(2), "i": jnp.int32(1)})
    assert result["w"].dtype == jnp.bfloat16
    assert result["i"].dtype == jnp.int32


# --- Policy: hashing, jit, equinox ------------------------------------------------------------


def test_policy_is_frozen_and_hashable_with_equal_policies_hashing_equal():
    a = jls.Policy(jnp.float32, jnp.float16, jnp.float32)
    b = jls.Policy(np.float32, "f16", "float32")
    c = jls.get_policy("mixed_float16")
    assert a == b == c
    assert hash(a) == hash(b) == hash(c)
    assert len({a, b, c, jls.get_policy("f16")}) == 2
    assert a.param_dtype == np.dtype(np.float32)  # dtypes are normalized
    assert b.param_dtype is jnp.float32  # to JAX's scalar types, as jmp holds them
    assert b.compute_dtype is c.compute_dtype is jnp.float16
    with pytest.raises(AttributeError):
        a.param_dtype = jnp.float16


def test_policy_with_output_dtype_keeps_the_rest():
    policy = jls.get_policy("p=f32,c=bf16,o=f32").with_output_dtype("f16")
    assert str(policy) == "p=f32,c=bf16,o=f16"


def test_policy_casts():
    policy = jls.Policy(jnp.float32, jnp.bfloat16, jnp.float16)
    tree = {"x": jnp.ones(2, jnp.float16), "i": jnp.int32(0)}
    assert policy.cast_to_param(tree)["x"].dtype == jnp.float32
    assert policy.cast_to_compute(tree)["x"].dtype == jnp.bfloat16
    assert policy.cast_to_output(tree)["x"] is tree["x"]
    assert policy.cast_to_compute(tree)["i"] is tree["i"]


def test_policy_as_a_jit_static_argument_traces_once_per_distinct_policy():
    traces = []

    @jax.jit
    def apply(x, policy):
        traces.append(str(policy))
        return policy.cast_to_compute(x)

    apply_static = jax.jit(apply.__wrapped__, static_argnums=1)
    x = jnp.ones(2)
    for fn in (apply_static, apply):  # a static argument, and an ordinary one (no leaves)
        traces.clear()
        assert fn(x, jls.Policy(jnp.float32, jnp.float16, jnp.float32)).dtype == jnp.float16
        assert fn(x, jls.get_policy("mixed_float16")).dtype == jnp.float16
        assert fn(x, jls.get_policy("c=bf16")).dtype == jnp.bfloat16
        assert traces == ["p=f32,c=f16,o=f32", "p=f32,c=bf16,o=bf16"]
    assert jax.tree.leaves(jls.get_policy("mixed_float16")) == []


def test_policy_as_a_field_of_an_equinox_module_under_filter_jit():
    class Model(eqx.Module):
        weight: jax.Array
        policy: jls.Policy

        def __call__(self, x):
            w, x = self.policy.cast_to_compute((self.weight, x))
            return self.policy.cast_to_output(w * x)

    traces = []

    @eqx.filter_jit
    def forward(model, x):
        traces.append(str(model.policy))
        return model(x)

    x = jnp.ones(3)
    assert forward(Model(jnp.ones(3), jls.get_policy("mixed_float16")), x).dtype == jnp.float32
    assert forward(Model(jnp.ones(3) * 2, jls.get_policy("mixed_float16")), x).dtype == jnp.float32
    assert forward(Model(jnp.ones(3), jls.get_policy("c=f16")), x).dtype == jnp.float16
    assert traces == ["p=f32,c=f16,o=f32", "p=f32,c=f16,o=f16"]
    model = Model(jnp.ones(3), jls.get_policy("mixed_float16"))
    assert eqx.filter(model, eqx.is_array).policy == model.policy  # no leaves to filter out


# --- get_policy: the grammar ------------------------------------------------------------------

NAMES = {jnp.float16: "f16", jnp.bfloat16: "bf16", jnp.float32: "f32", jnp.float64: "f64"}


@pytest.mark.parametrize(("param", "compute", "output"), list(itertools.product(NAMES, repeat=3)))
def test_str_round_trips_through_get_policy(param, compute, output):
    policy = jls.Policy(param, compute, output)
    text = str(policy)
    assert text == f"p={NAMES[param]},c={NAMES[compute]},o={NAMES[output]}"
    assert jls.get_policy(text) == policy
    long = text.replace("p=", "params=").replace("c=", "compute=").replace("o=", "output=")
    assert jls.get_policy(long) == policy


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("f16", "p=f16,c=f16,o=f16"),
        ("float16", "p=f16,c=f16,o=f16"),
        ("bf16", "p=bf16,c=bf16,o=bf16"),
        ("bfloat16", "p=bf16,c=bf16,o=bf16"),
        ("f32", "p=f32,c=f32,o=f32"),
        ("float32", "p=f32,c=f32,o=f32"),
        ("full", "p=f32,c=f32,o=f32"),
        ("f64", "p=f64,c=f64,o=f64"),
        ("float64", "p=f64,c=f64,o=f64"),
        ("half", "p=f16,c=f16,o=f16"),  # on CPU
        ("c=half", "p=f32,c=f16,o=f16"),
        ("mixed_float16", "p=f32,c=f16,o=f32"),
        ("mixed_bfloat16", "p=f32,c=bf16,o=f32"),
        ("p=f16", "p=f16,c=f16,o=f16"),
        ("p=bf16,c=f32", "p=bf16,c=f32,o=f32"),
        ("o=f16", "p=f32,c=f32,o=f16"),
        ("c=f16,o=full", "p=f32,c=f16,o=f32"),
        ("c=bf16,o=full", "p=f32,c=bf16,o=f32"),
        ("output=f32,compute=bfloat16,params=float32", "p=f32,c=bf16,o=f32"),
        ("params=float32,compute=float16,output=float32", "p=f32,c=f16,o=f32"),
        (" p = f16 , c = bf16 ", "p=f16,c=bf16,o=bf16"),
        ("\tmixed_float16\n", "p=f32,c=f16,o=f32"),
        (" f16 ", "p=f16,c=f16,o=f16"),
    ],
)
def test_get_policy_grammar(text, expected):
    assert str(jls.get_policy(text)) == expected


JMP_NAMES = ["f16", "float16", "bf16", "bfloat16", "f32", "float32", "full", "half"]


def jmp_strings():
    """Strings of jmp's grammar: a single dtype, or one to three distinct keys with dtypes."""
    yield from JMP_NAMES
    keys = [("p", "params"), ("c", "compute"), ("o", "output")]
    for count in (1, 2, 3):
        for chosen in itertools.permutations(keys, count):
            for long in (False, True):
                for names in itertools.product(["f16", "bfloat16", "full", "half"], repeat=count):
                    yield ",".join(
                        f"{key[long]}={name}" for key, name in zip(chosen, names, strict=True)
                    )


def test_get_policy_agrees_with_jmp_on_its_grammar_and_strings():
    """jmp 0.0.4 itself as the reference: every string of its grammar gives the same dtypes,
    and each library parses the other's `str`."""
    import jmp

    def dtypes(policy):
        return tuple(
            np.dtype(d) for d in (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
        )

    strings = list(jmp_strings())
    assert len(strings) > 500
    for text in strings:
        ours, theirs = jls.get_policy(text), jmp.get_policy(text)
        assert dtypes(ours) == dtypes(theirs), text
        assert dtypes(jls.get_policy(str(theirs))) == dtypes(theirs), text
        assert dtypes(jmp.get_policy(str(ours))) == dtypes(ours), text
    assert np.dtype(jmp.half_dtype()) == jls.half_dtype()


def test_half_follows_half_dtype():
    half = jls.half_dtype()
    assert jls.get_policy("half") == jls.Policy(half, half, half)
    assert jls.Policy("half", "half", "half") == jls.Policy(half, half, half)
    assert jls.cast_to_half(jnp.ones(1)).dtype == half


def exactly(message):
    """A `match` pattern for exactly `message`."""
    return f"^{re.escape(message)}$"


DTYPE_LIST = "f16, float16, bf16, bfloat16, f32, float32, full, f64, float64, half"
KEYS = "expected p or params, c or compute, o or output"


def unknown_dtype(text, name):
    return (
        f"get_policy({text!r}): unknown dtype {name!r}; expected one of {DTYPE_LIST} (or "
        "another floating dtype's full name, such as float8_e4m3fn), or keys and dtypes as "
        "'p=f32,c=f16,o=f32'"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus=f16", f"get_policy('bogus=f16'): unknown key 'bogus' in 'bogus=f16'; {KEYS}"),
        ("P=f16", f"get_policy('P=f16'): unknown key 'P' in 'P=f16'; {KEYS}"),
        ("=f16", f"get_policy('=f16'): unknown key '' in '=f16'; {KEYS}"),
        ("f16,c=f32", f"get_policy('f16,c=f32'): unknown key 'f16' in 'f16'; {KEYS}"),
        ("p=f16,", f"get_policy('p=f16,'): unknown key '' in ''; {KEYS}"),
        ("p=f8", unknown_dtype("p=f8", "f8")),
        ("c=float8", unknown_dtype("c=float8", "float8")),
        ("p=f16=f32", unknown_dtype("p=f16=f32", "f16=f32")),
        ("p=", unknown_dtype("p=", "")),
        ("", unknown_dtype("", "")),
        ("   ", unknown_dtype("   ", "")),
        ("compute_float16", unknown_dtype("compute_float16", "compute_float16")),
        ("mixed_float32", unknown_dtype("mixed_float32", "mixed_float32")),
        ("Mixed_float16", unknown_dtype("Mixed_float16", "Mixed_float16")),
        ("F16", unknown_dtype("F16", "F16")),
        (
            "p=f16,params=f32",
            "get_policy('p=f16,params=f32'): the param dtype is given twice, again in 'params=f32'",
        ),
        (
            "c=f16,o=f32,compute=f16",
            "get_policy('c=f16,o=f32,compute=f16'): the compute dtype is given twice, "
            "again in 'compute=f16'",
        ),
        (
            "o=f16, o=f16",
            "get_policy('o=f16, o=f16'): the output dtype is given twice, again in 'o=f16'",
        ),
    ],
)
def test_get_policy_refuses_malformed_strings(text, message):
    with pytest.raises(ValueError, match=exactly(message)):
        jls.get_policy(text)


@pytest.mark.parametrize(
    ("value", "shown"), [(None, "None"), (3, "3"), (b"p=f16", "b'p=f16'"), (jnp.float16, None)]
)
def test_get_policy_of_a_non_string_is_a_type_error(value, shown):
    with pytest.raises(TypeError) as info:
        jls.get_policy(value)
    message = str(info.value)
    assert message.endswith(
        "): policy_name must be a string such as 'params=float32,compute=float16,output=float32'"
    )
    if shown is not None:
        assert message.startswith(f"get_policy(policy_name={shown})")


FLOATING = "must be a floating-point dtype such as jnp.float16, jnp.bfloat16 or jnp.float32"


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype", "output_dtype"])
@pytest.mark.parametrize(
    ("dtype", "shown", "error"),
    [
        (jnp.int32, "<class 'jax.numpy.int32'>", ValueError),
        ("int32", "'int32'", ValueError),
        (np.bool_, "<class 'numpy.bool'>", ValueError),
        (jnp.complex64, "<class 'jax.numpy.complex64'>", ValueError),
        (None, "None", TypeError),
        ("nonsense", "'nonsense'", TypeError),
    ],
)
def test_policy_with_a_non_floating_dtype_names_the_argument(field, dtype, shown, error):
    dtypes = {"param_dtype": jnp.float32, "compute_dtype": jnp.float16, "output_dtype": "f32"}
    with pytest.raises(error) as info:
        jls.Policy(**{**dtypes, field: dtype})
    assert str(info.value) == f"Policy({field}={shown}): {field} {FLOATING}"


def test_with_output_dtype_checks_the_dtype():
    message = f"Policy(output_dtype=<class 'jax.numpy.int32'>): output_dtype {FLOATING}"
    with pytest.raises(ValueError, match=exactly(message)):
        jls.get_policy("f32").with_output_dtype(jnp.int32)


@pytest.mark.parametrize(
    ("dtype", "shown", "error"),
    [
        (jnp.int32, "<class 'jax.numpy.int32'>", ValueError),
        ("bool", "'bool'", ValueError),
        (None, "None", TypeError),
    ],
)
def test_cast_tree_with_a_non_floating_dtype(dtype, shown, error):
    with pytest.raises(error) as info:
        jls.cast_tree({"w": jnp.ones(2)}, dtype)
    assert str(info.value) == f"cast_tree(dtype={shown}): dtype {FLOATING}"


def test_full_precision_refuses_what_is_not_callable_and_non_floating_output_dtypes():
    with pytest.raises(TypeError) as info:
        jls.full_precision(3)
    assert str(info.value) == "full_precision(fn=3): fn must be callable"
    message = f"full_precision(output_dtype=<class 'jax.numpy.int32'>): output_dtype {FLOATING}"
    with pytest.raises(ValueError, match=exactly(message)):
        jls.full_precision(jnp.sum, output_dtype=jnp.int32)


# --- full_precision ---------------------------------------------------------------------------


def test_full_precision_keeps_a_float16_sum_of_squares_finite():
    x = jnp.full(4, 200.0, jnp.float16)
    sum_of_squares = lambda x: jnp.sum(x * x)  # noqa: E731
    assert jnp.isinf(sum_of_squares(x))  # 160000 is beyond float16's 65504
    result = jls.full_precision(sum_of_squares)(x)
    assert result.dtype == jnp.float32
    assert result == 160000.0
    jitted = jax.jit(jls.full_precision(sum_of_squares))(x)
    assert jitted.dtype == jnp.float32
    assert jitted == 160000.0


@pytest.mark.parametrize("output_dtype", [jnp.float16, jnp.bfloat16, jnp.float32, "f16"])
def test_full_precision_casts_outputs_to_output_dtype(output_dtype):
    def island(x, n):
        return {"mean": jnp.mean(x), "count": n, "name": "stats"}

    result = jls.full_precision(island, output_dtype=output_dtype)(
        jnp.ones(3, jnp.float16), jnp.int32(3)
    )
    expected = jnp.float16 if output_dtype == "f16" else output_dtype
    assert result["mean"].dtype == expected
    assert result["mean"] == 1.0
    assert result["count"].dtype == jnp.int32
    assert result["name"] == "stats"


def test_full_precision_leaves_non_floating_and_wide_inputs_alone_and_keeps_the_name():
    seen = {}

    def softmax_island(logits, mask, key, bias=None):
        """Softmax in float32."""
        seen.update(logits=logits.dtype, mask=mask.dtype, key=key, bias=bias)
        return jax.nn.softmax(jnp.where(mask, logits, -jnp.inf))

    key = jax.random.key(0)
    island = jls.full_precision(softmax_island, output_dtype=jnp.float16)
    out = island(jnp.zeros(4, jnp.bfloat16), jnp.array([True, True, False, False]), key)
    assert seen == {"logits": jnp.float32, "mask": jnp.bool_, "key": key, "bias": None}
    np.testing.assert_array_equal(out, np.array([0.5, 0.5, 0.0, 0.0], np.float16))
    assert out.dtype == jnp.float16
    assert island.__name__ == "softmax_island"
    assert island.__doc__ == "Softmax in float32."


def test_full_precision_widens_nested_arguments():
    seen = []

    def fn(tree, *, scale):
        seen.append(jax.tree.map(lambda a: a.dtype, (tree, scale)))
        return tree["a"] * scale[0]

    tree = {"a": jnp.ones(2, jnp.float16), "b": [jnp.ones(1, jnp.bfloat16), jnp.int8(1)]}
    out = jls.full_precision(fn)(tree, scale=(jnp.float16(2.0),))
    assert out.dtype == jnp.float32
    f32 = np.dtype(jnp.float32)
    assert seen == [({"a": f32, "b": [f32, np.dtype(jnp.int8)]}, (f32,))]


def test_full_precision_keeps_float64_inputs_float64_under_x64():
    with jax.enable_x64(True):
        seen = []
        fn = jls.full_precision(lambda x, h: seen.append((x.dtype, h.dtype)) or x * 2)
        out = fn(jnp.ones(2, jnp.float64), jnp.ones(2, jnp.float16))
        assert out.dtype == jnp.float64
        assert seen == [(jnp.float64, jnp.float32)]


def test_full_precision_gradients_flow_back_in_the_input_dtype():
    x = jnp.array([200.0, 100.0], jnp.float16)
    grad = jax.grad(lambda x: jls.full_precision(lambda x: jnp.sum(x * x) / 1e5)(x))(x)
    assert grad.dtype == jnp.float16
    np.testing.assert_array_equal(grad, np.array([0.004, 0.002], np.float16))
    chex.assert_tree_all_finite(grad)


# --- casts return strongly typed arrays ---------------------------------------------------------

H16 = jnp.asarray(np.full(3, 300.0, np.float16))  # copied to the device: no compile


def cast_to_full_scaled_by_1000(cast):
    """jmp's case: a Python float passed to a jitted function is a weakly typed float32; cast to
    float32 it must be strongly typed, or the float16 product overflows."""
    return jax.jit(lambda h, s: h * cast(s) * 1000)(H16, 0.5)


@pytest.mark.parametrize(
    "cast",
    [
        jls.cast_to_full,
        lambda s: jls.cast_tree(s, jnp.float32),
        jls.Policy(jnp.float32, jnp.float16, jnp.float16).cast_to_param,
        jls.Policy(jnp.float16, jnp.float32, jnp.float16).cast_to_compute,
        jls.Policy(jnp.float16, jnp.float16, jnp.float32).cast_to_output,
    ],
    ids=["cast_to_full", "cast_tree", "cast_to_param", "cast_to_compute", "cast_to_output"],
)
def test_a_weakly_typed_float32_cast_to_float32_is_strongly_typed(cast):
    assert jnp.isinf(jax.jit(lambda h, s: h * s * 1000)(H16, 0.5)).all()  # the trap
    result = cast_to_full_scaled_by_1000(cast)
    assert result.dtype == jnp.float32
    chex.assert_trees_all_equal(result, jnp.full(3, 150000.0, jnp.float32))


def test_casts_return_strong_arrays_and_keep_a_strong_array_of_the_dtype_as_it_is():
    weak = jnp.asarray(0.5)
    assert weak.weak_type
    strong32, strong16 = jnp.float32(0.5), jnp.ones(2, jnp.float16)
    tree = {"weak": weak, "strong32": strong32, "strong16": strong16, "python": 0.5}
    out = jls.cast_to_full(tree)
    assert not out["weak"].weak_type
    assert out["weak"].dtype == jnp.float32
    assert out["strong32"] is strong32  # already strong and float32: the same object
    assert not out["strong16"].weak_type
    assert out["python"] == 0.5
    assert isinstance(out["python"], float)  # Python scalars are left as they are
    half = jls.cast_to_half({"weak": weak})["weak"]
    assert (half.dtype, half.weak_type) == (jnp.float16, False)

    @jax.jit
    def weak_types(s):
        outs = (jls.cast_to_full(s), jls.cast_to_half(s), jls.get_policy("f32").cast_to_param(s))
        return [jnp.asarray(o.weak_type) for o in outs]

    assert [bool(w) for w in weak_types(0.5)] == [False, False, False]


# --- full_precision passes what needs no widening as itself -------------------------------

X16 = jnp.asarray(np.arange(8, dtype=np.float16).reshape(4, 2))  # batch means [3, 4]


def through_full_precision(module, h):
    return jls.full_precision(lambda m, h: m(h))(module, h)


@nnx.jit
def through_full_precision_under_nnx_jit(module, h):
    return jls.full_precision(lambda m, h: m(h))(module, h)


@pytest.mark.parametrize(
    "call", [through_full_precision, through_full_precision_under_nnx_jit], ids=["eager", "nnx.jit"]
)
def test_full_precision_keeps_a_batchnorms_running_mean_update(call):
    """A float32 island around a norm layer: the running mean moved in a copy and was lost (it
    stayed [0, 0]); called directly it moves to 0.99 * 0 + 0.01 * [3, 4]."""
    direct = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    direct(X16.astype(jnp.float32))
    np.testing.assert_allclose(direct.mean[...], [0.03, 0.04], rtol=1e-6)
    bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    out = call(bn, X16)
    assert out.dtype == jnp.float32
    chex.assert_trees_all_equal(bn.mean[...], direct.mean[...])
    chex.assert_trees_all_equal(bn.var[...], direct.var[...])


@pytest.mark.parametrize(
    "call", [through_full_precision, through_full_precision_under_nnx_jit], ids=["eager", "nnx.jit"]
)
def test_full_precision_advances_a_dropouts_rng_counter(call):
    """The Rngs counter advanced in a copy: every call drew the same mask. Now each call draws
    the next one, as calling the layer directly does."""
    direct = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
    expected = [direct(jnp.ones(8, jnp.float32)) for _ in range(2)]
    assert not (expected[0] == expected[1]).all()
    dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
    masks = [call(dropout, jnp.ones(8, jnp.float16)) for _ in range(2)]
    assert [m.dtype for m in masks] == [jnp.float32, jnp.float32]
    chex.assert_trees_all_equal(masks, expected)
    np.testing.assert_array_equal(masks[0], [2, 0, 2, 0, 2, 2, 2, 0])
    np.testing.assert_array_equal(masks[1], [2, 2, 2, 0, 2, 0, 0, 2])


def test_full_precision_passes_what_needs_no_widening_as_the_same_objects():
    seen = []
    bn, rngs = nnx.BatchNorm(2, rngs=nnx.Rngs(0)), nnx.Rngs(3)
    wide = {"w": jnp.ones(2, jnp.float32), "n": jnp.int32(2)}
    mixed = {"keep": wide, "h": jnp.ones(2, jnp.float16)}
    fn = jls.full_precision(lambda *args, **kwargs: seen.append((args, kwargs)))
    fn(bn, wide, mixed, rngs=rngs)
    ((args, kwargs),) = seen
    assert args[0] is bn
    assert args[1] is wide
    assert args[2] is not mixed  # it held a float16 array: rebuilt, its float32 part kept
    assert args[2]["keep"] is wide
    assert args[2]["h"].dtype == jnp.float32
    assert kwargs["rngs"] is rngs


def test_full_precision_widens_an_nnx_modules_half_variables_in_place_and_casts_them_back():
    """A BatchNorm with float16 params and statistics: passed as itself, computed in float32,
    its updated statistics stored back in float16."""
    bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0), param_dtype=jnp.float16)
    for stat in (bn.mean, bn.var):  # nnx keeps them float32: made float16 here
        stat.set_value(stat.get_value().astype(jnp.float16))
    dtypes = []
    out = jls.full_precision(lambda m, h: dtypes.append(m.scale[...].dtype) or m(h))(bn, X16)
    assert dtypes == [jnp.float32]
    assert out.dtype == jnp.float32
    assert bn.scale[...].dtype == bn.mean[...].dtype == jnp.float16
    np.testing.assert_array_equal(bn.mean[...], np.array([0.03, 0.04], np.float16))
    np.testing.assert_array_equal(bn.scale[...], np.ones(2, np.float16))


# --- errors that name the fix, and what works ---------------------------------------------------


@pytest.mark.parametrize("text", ["p=f32,c=f16,o=f32", "params=float32", "mixed_float16"])
def test_policy_given_a_policy_string_says_to_use_get_policy(text):
    """NumPy's "format number 1 of 'p=f32,c=f16,o=f32' is not recognized" named nothing."""
    message = (
        f"Policy(param_dtype={text!r}): param_dtype is a dtype, not a policy string; parse a "
        f"policy string with jls.get_policy({text!r})"
    )
    with pytest.raises(ValueError, match=exactly(message)):
        jls.Policy(text, jnp.float16, jnp.float32)
    assert jls.get_policy(text).param_dtype == jnp.float32


FLOAT8S = [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3b11fnuz, jnp.float8_e5m2fnuz]


@pytest.mark.parametrize("float8", FLOAT8S, ids=lambda d: np.dtype(d).name)
def test_a_float8_policys_str_parses_back(float8):
    policy = jls.Policy(jnp.float32, float8, jnp.bfloat16)
    name = np.dtype(float8).name
    assert str(policy) == f"p=f32,c={name},o=bf16"
    assert jls.get_policy(str(policy)) == policy
    assert jls.get_policy(name) == jls.Policy(float8, float8, float8)


def test_get_policy_takes_only_full_dtype_names_beyond_its_own():
    for text in ["e", "f4", "float", "float8"]:  # numpy's codes and aliases are not names
        with pytest.raises(ValueError, match=exactly(unknown_dtype(text, text))):
            jls.get_policy(text)


def test_half_dtype_is_the_scalar_type_callable_like_jnp_float16():
    """jmp's `half_dtype()` is `jnp.float16` (off TPU), which users call to make scalars."""
    half = jls.half_dtype()
    assert half is jnp.float16
    scalar = half(0.5)
    assert (scalar.dtype, float(scalar)) == (jnp.float16, 0.5)
    assert np.dtype(half) == np.dtype("float16")
    assert jnp.ones(2, half).dtype == jnp.float16
    assert jls.cast_to_half(jnp.ones(2)).dtype == half
    assert jls.Policy(half, half, half) == jls.get_policy("half")
