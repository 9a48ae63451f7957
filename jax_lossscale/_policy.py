"""Mixed-precision casting: `Policy`, `get_policy` and the casts of floating leaves."""

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._checks import describe, is_array, is_at_least_float32
from jax_lossscale._types import PyTree

_F = TypeVar("_F", bound=Callable[..., Any])

# Each dtype's names; `str(policy)` writes the first.
_NAMES = {
    jnp.dtype(jnp.float16): ("f16", "float16"),
    jnp.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    jnp.dtype(jnp.float32): ("f32", "float32", "full"),
    jnp.dtype(jnp.float64): ("f64", "float64"),
}
_BY_NAME: dict[str, np.dtype[Any]] = {
    name: dtype for dtype, names in _NAMES.items() for name in names
}
_KEYS = {"p": "param", "params": "param", "c": "compute", "compute": "compute"}
_KEYS |= {"o": "output", "output": "output"}
_KERAS = {"mixed_float16": jnp.float16, "mixed_bfloat16": jnp.bfloat16}


def half_dtype() -> Any:
    """The half-precision type to compute in: `jnp.bfloat16` on TPUs, `jnp.float16` elsewhere.

    The scalar type, as jmp's `half_dtype` returns it: it is accepted wherever a dtype is
    (`jnp.ones(2, half_dtype())`, `x.astype(half_dtype())`), compares equal to its
    `jnp.dtype`, and is called like `jnp.float16` to make a scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> jls.half_dtype() is jnp.float16  # on a CPU or a GPU
      True
      >>> jls.half_dtype()(0.5)
      Array(0.5, dtype=float16)
    """
    return jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16


def cast_tree(tree: PyTree, dtype: Any) -> PyTree:
    """`tree` with each floating-point array cast to `dtype`, and nothing else changed.

    Integer, boolean and complex arrays, typed PRNG keys, Python and NumPy scalars, None
    and leaves that are not arrays (an equinox module's functions) come back as they
    were, and so does a strongly typed array already of `dtype`: the same object, no
    op in a jitted graph. The floating arrays returned are strongly typed, as jmp's
    casts return them: a weakly typed float32 scalar (a Python float passed to a
    jitted function) cast to float32 no longer takes a float16 operand's dtype.
    NumPy arrays stay NumPy arrays. Any pytree: dicts, NamedTuples,
    equinox modules, flax nnx `State`s, linen variable dicts.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> tree = {"w": jnp.ones(2), "step": jnp.int32(3), "name": "dense"}
      >>> jls.cast_tree(tree, jnp.float16)
      {'name': 'dense', 'step': Array(3, dtype=int32), 'w': Array([1., 1.], dtype=float16)}
    """
    target = floating_dtype(dtype, "cast_tree", "dtype")

    def cast(leaf: Any) -> Any:
        # A weakly typed float32 array (a Python scalar passed to a jitted function) becomes
        # strongly typed, as jmp's `astype` makes it: weak, it would take the dtype of a
        # float16 array it meets, and `h16 * cast_to_full(0.5) * 1000` would overflow.
        if (
            is_array(leaf)
            and not isinstance(leaf, np.generic)  # a NumPy scalar is left as jmp leaves it
            and jnp.issubdtype(leaf.dtype, jnp.floating)
            and (leaf.dtype != target or getattr(leaf, "weak_type", False))
        ):
            return leaf.astype(target)
        return leaf

    return jax.tree.map(cast, tree)


def cast_to_full(tree: PyTree) -> PyTree:
    """`cast_tree(tree, jnp.float32)`, as jmp's `cast_to_full`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> jls.cast_to_full({"h": jnp.ones(2, jnp.float16)})
      {'h': Array([1., 1.], dtype=float32)}
    """
    return cast_tree(tree, jnp.float32)


def cast_to_half(tree: PyTree) -> PyTree:
    """`cast_tree(tree, half_dtype())`, as jmp's `cast_to_half`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> jls.cast_to_half({"w": jnp.ones(2)})  # on a CPU or a GPU
      {'w': Array([1., 1.], dtype=float16)}
    """
    return cast_tree(tree, half_dtype())


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes of a mixed-precision model: its params, its compute and its outputs.

    Frozen and hashable, so it can be a static argument of `jit` or a field of an
    equinox module. The dtypes are given as NumPy or JAX dtypes or their names
    (`"float16"`, `"bf16"`, `"half"`, ...) and held as JAX's scalar types, as jmp holds
    them (`policy.compute_dtype is jnp.float16`, and `policy.compute_dtype(0.5)` makes a
    scalar); `get_policy` parses a whole policy from a string, and `str(policy)` writes one
    it parses back.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> policy = jls.Policy(jnp.float32, jnp.float16, jnp.float32)
      >>> str(policy)
      'p=f32,c=f16,o=f32'
      >>> policy.cast_to_compute({"w": jnp.ones(2)})
      {'w': Array([1., 1.], dtype=float16)}
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            dtype = floating_dtype(getattr(self, field), "Policy", field)
            object.__setattr__(self, field, _scalar_type(dtype))

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """`tree`'s floating arrays cast to the param dtype."""
        return cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """`tree`'s floating arrays cast to the compute dtype."""
        return cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """`tree`'s floating arrays cast to the output dtype."""
        return cast_tree(tree, self.output_dtype)

    def with_output_dtype(self, output_dtype: Any) -> "Policy":
        """The same policy with another output dtype."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        return ",".join(
            f"{key}={_NAMES.get(jnp.dtype(dtype), (jnp.dtype(dtype).name,))[0]}"
            for key, dtype in zip(
                "pco", (self.param_dtype, self.compute_dtype, self.output_dtype), strict=True
            )
        )


jax.tree_util.register_static(Policy)


def get_policy(policy_name: str) -> Policy:
    """Parses a policy from a string, as jmp's `get_policy` does, and more.

    `"params=float32,compute=float16,output=float32"`, or with the short keys
    `"p=f32,c=f16,o=f32"`; the dtype names are `f16`/`float16`, `bf16`/`bfloat16`,
    `f32`/`float32`/`full`, `f64`/`float64` and `half` (`half_dtype()`), and other
    floating dtypes by their full names (`float8_e4m3fn`, as `str` writes them). Unnamed parts
    default as jmp's do: params to float32, compute to params, output to compute. A
    single dtype name is all three; Keras' `"mixed_float16"` and `"mixed_bfloat16"`
    are float32 params and outputs with half compute.

    Raises:
      ValueError: naming the string and the part of it that is wrong.

    Examples:
      >>> import jax_lossscale as jls
      >>> str(jls.get_policy("c=f16"))
      'p=f32,c=f16,o=f16'
      >>> str(jls.get_policy("mixed_bfloat16"))
      'p=f32,c=bf16,o=f32'
    """
    if not isinstance(policy_name, str):
        raise TypeError(
            f"get_policy(policy_name={describe(policy_name)}): policy_name must be a string "
            "such as 'params=float32,compute=float16,output=float32'"
        )
    name = policy_name.strip()
    if name in _KERAS:
        return Policy(jnp.float32, _KERAS[name], jnp.float32)
    if "=" not in name:
        dtype = _parse_dtype(policy_name, name)
        return Policy(dtype, dtype, dtype)
    given: dict[str, Any] = {}
    for part in name.split(","):
        key, _, value = (piece.strip() for piece in part.partition("="))
        if key not in _KEYS:
            raise ValueError(
                f"get_policy({policy_name!r}): unknown key {key!r} in {part.strip()!r}; "
                "expected p or params, c or compute, o or output"
            )
        if _KEYS[key] in given:
            raise ValueError(
                f"get_policy({policy_name!r}): the {_KEYS[key]} dtype is given twice, "
                f"again in {part.strip()!r}"
            )
        given[_KEYS[key]] = _parse_dtype(policy_name, value)
    param = given.get("param", jnp.dtype(jnp.float32))
    compute = given.get("compute", param)
    return Policy(param, compute, given.get("output", compute))


def full_precision(fn: _F, output_dtype: Any = None) -> _F:
    """`fn` run on float32 copies of its floating inputs: the float32 island of a model.

    For the parts of a half-precision model that must compute in float32: softmax,
    norms, losses. Floating array arguments narrower than float32 are cast to
    float32 (float64 ones stay float64), nested or not; the outputs are cast to
    `output_dtype`, or left as `fn` returns them when it is None. An argument (or
    part of one) that holds nothing to widen reaches `fn` as the same object: a flax
    nnx module or `Rngs` that `fn` updates (a BatchNorm's running statistics, a
    Dropout's RNG counter) keeps the update. An nnx module holding float16 or
    bfloat16 variables is passed as itself too, those variables widened in place for
    the call and cast back to their dtypes after it, updates included.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> x = jnp.full(4, 200.0, jnp.float16)
      >>> jnp.sum(x * x)  # beyond float16's 65504
      Array(inf, dtype=float16)
      >>> jls.full_precision(lambda x: jnp.sum(x * x))(x)
      Array(160000., dtype=float32)
    """
    if not callable(fn):
        raise TypeError(f"full_precision(fn={describe(fn)}): fn must be callable")
    if output_dtype is not None:
        output_dtype = floating_dtype(output_dtype, "full_precision", "output_dtype")

    @functools.wraps(fn)
    def in_float32(*args: Any, **kwargs: Any) -> Any:
        narrowed: list[tuple[Any, Any]] = []  # nnx Variables widened in place, their dtypes
        try:
            args, kwargs = _widened((args, kwargs), narrowed)
            outputs = fn(*args, **kwargs)
        finally:
            for variable, dtype in reversed(narrowed):
                value = _get_value(variable)
                if _is_floating_array(value) and value.dtype != dtype:
                    variable.set_value(value.astype(dtype))
        return outputs if output_dtype is None else cast_tree(outputs, output_dtype)

    return in_float32  # type: ignore[return-value]


def _is_floating_array(leaf: Any) -> bool:
    return is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating)


def _is_narrow(leaf: Any) -> bool:
    """A floating array narrower than float32: what `full_precision` widens."""
    return _is_floating_array(leaf) and not is_at_least_float32(leaf.dtype)


def _nnx_types() -> tuple[type, ...]:
    """flax nnx's mutable graph nodes (modules, `Rngs`) and Variables, if flax is in use."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return ()
    kinds = (getattr(nnx, "Pytree", None), getattr(nnx, "Object", None), nnx.Variable)
    return tuple(kind for kind in kinds if isinstance(kind, type))


def _get_value(variable: Any) -> Any:
    return variable.get_value() if hasattr(variable, "get_value") else variable.value


def _widened(tree: PyTree, narrowed: list[tuple[Any, Any]]) -> PyTree:
    """`tree` with its narrow floating arrays cast to float32, every subtree with none of them
    kept as the same object, and nnx objects widened in place (recorded in `narrowed`)."""
    nnx_types = _nnx_types()

    def kept(node: Any) -> bool:
        return isinstance(node, nnx_types) or not any(map(_is_narrow, jax.tree.leaves(node)))

    def widen(node: Any) -> Any:
        if _is_narrow(node):
            return node.astype(jnp.float32)
        if isinstance(node, nnx_types):
            variables = jax.tree.leaves(node, is_leaf=lambda x: isinstance(x, nnx_types[-1]))
            for variable in variables:
                value: Any = _get_value(variable) if isinstance(variable, nnx_types[-1]) else None
                if _is_narrow(value):
                    narrowed.append((variable, value.dtype))
                    variable.set_value(value.astype(jnp.float32))
        return node

    return jax.tree.map(widen, tree, is_leaf=kept)


def _parse_dtype(policy_name: str, name: str) -> np.dtype[Any]:
    if name == "half":
        return _BY_NAME[half_dtype().dtype.name]
    if name in _BY_NAME:
        return _BY_NAME[name]
    named = _other_floating(name)
    if named is not None:
        return named
    raise ValueError(
        f"get_policy({policy_name!r}): unknown dtype {name!r}; expected one of "
        f"{', '.join([*_BY_NAME, 'half'])} (or another floating dtype's full name, such as "
        "float8_e4m3fn), or keys and dtypes as 'p=f32,c=f16,o=f32'"
    )


def _other_floating(name: str) -> np.dtype[Any] | None:
    """The floating dtype called exactly `name` by its own `.name` (`float8_e4m3fn`, which
    `str(policy)` writes for a float8 policy), or None."""
    try:
        dtype: np.dtype[Any] = jnp.dtype(name)
    except (TypeError, ValueError):
        return None
    return dtype if dtype.name == name and jnp.issubdtype(dtype, jnp.floating) else None


def _scalar_type(dtype: np.dtype[Any]) -> Any:
    """JAX's scalar type of `dtype` (`jnp.float16`), or `dtype` where JAX names none."""
    scalar_type = getattr(jnp, dtype.name, None)
    return scalar_type if scalar_type is not None and jnp.dtype(scalar_type) == dtype else dtype


def floating_dtype(dtype: Any, owner: str, name: str) -> np.dtype[Any]:
    """`dtype` (a dtype or one of its names) as a floating `jnp.dtype`."""
    if isinstance(dtype, str):
        text = dtype.strip()
        if text == "half":
            return _BY_NAME[half_dtype().dtype.name]
        if text in _BY_NAME:
            return _BY_NAME[text]
        if "=" in text or "," in text or text in _KERAS:
            raise ValueError(
                f"{owner}({name}={describe(dtype)}): {name} is a dtype, not a policy string; "
                f"parse a policy string with jls.get_policy({describe(dtype)})"
            )
    try:  # (an array is not its dtype)
        result: np.dtype[Any] | None = None if is_array(dtype) else jnp.dtype(dtype)
    except (TypeError, ValueError):
        result = None
    if result is None or dtype is None or not jnp.issubdtype(result, jnp.floating):
        raise (TypeError if result is None or dtype is None else ValueError)(
            f"{owner}({name}={describe(dtype)}): {name} must be a floating-point dtype such "
            "as jnp.float16, jnp.bfloat16 or jnp.float32"
        )
    return result
