"""What the tests share: arrays made without compiling, bit-exact comparison of trees, the
reductions of a compiled module, the reference model of the update rule (docs/update-rule.md)
in plain Python, against which the jitted rule is checked, a call jitted or eager, the
statistics as Python values, and the runner of the Markdown pages' code blocks."""

import contextlib
import math
import pathlib
import re

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

import jax_lossscale as jls

F32_MAX = float(np.finfo(np.float32).max)
UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def device_array(values, dtype=np.float32) -> jax.Array:
    """`jnp.array(values, dtype)` made by NumPy on the host and copied to the device.

    The same array (values, dtype, not weakly typed), with no XLA program compiled to make it:
    `jnp.array`, `jnp.ones` or `.at[].set` compile one per shape and dtype, and at import they
    compile in every test process.
    """
    return jnp.asarray(np.array(values, dtype))


def bits(tree):
    """Each leaf as unsigned integers of its width: NaN payloads and signed zeros compare.

    A complex leaf gets a last axis of two: the bits of its real and imaginary parts.
    """

    def view(leaf):
        array = np.asarray(leaf)
        if np.iscomplexobj(array):
            array = np.stack([array.real, array.imag], axis=-1)
        return array.view(UINT_OF_SIZE[array.dtype.itemsize])

    return jax.tree.map(view, tree)


def assert_bits_equal(actual, expected):
    """The same structure, dtypes, shapes and bits, leaf by leaf."""
    chex.assert_trees_all_equal_dtypes(actual, expected)
    chex.assert_trees_all_equal_shapes(actual, expected)
    chex.assert_trees_all_equal(bits(actual), bits(expected))


def compiled_reductions(compiled_text: str) -> list[str]:
    """The result type of each `reduce` in an XLA module's text, e.g. `f32[]` for a sum and
    `(f32[], pred[])` for a variadic reduction giving a sum and a flag."""
    return re.findall(r"= (\([^)]*\)|\S+) reduce\(", compiled_text)


class ReferenceLossScale:
    """`DynamicLossScale`'s update rule in plain Python, the scale computed in float32 as numpy
    does it, from the same hyperparameters (a `DynamicLossScale` or its keyword arguments)."""

    def __init__(
        self,
        initial_loss_scale=2.0**15,
        increment_period=2000,
        multiplier=2.0,
        *,
        backoff_factor=None,
        min_loss_scale=1.0,
        max_loss_scale=None,
        hysteresis=1,
        consecutive_hysteresis=False,
    ):
        self.increment_period = increment_period
        self.multiplier = np.float32(multiplier)
        self.backoff_factor = None if backoff_factor is None else np.float32(backoff_factor)
        self.min_loss_scale = np.float32(min_loss_scale)
        self.ceiling = np.float32(F32_MAX if max_loss_scale is None else max_loss_scale)
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.scale = np.float32(initial_loss_scale)
        self.good_steps = 0
        self.overflows_until_backoff = hysteresis

    @classmethod
    def of(cls, loss_scale) -> "ReferenceLossScale":
        """The model of a `jls.DynamicLossScale`."""
        return cls(**loss_scale.get_config())

    def step(self, finite: bool) -> bool:
        """Advances the model by one step; returns whether the step is applied."""
        if finite:
            self.good_steps += 1
            if self.consecutive_hysteresis:
                self.overflows_until_backoff = self.hysteresis
            if self.good_steps >= self.increment_period:
                with np.errstate(over="ignore"):
                    grown = self.scale * self.multiplier
                if np.isfinite(grown) and grown <= self.ceiling:
                    self.scale = grown
                self.good_steps = 0
                self.overflows_until_backoff = self.hysteresis
            return True
        self.good_steps = 0
        if self.overflows_until_backoff > 1:
            self.overflows_until_backoff -= 1
        else:
            if self.backoff_factor is None:
                reduced = self.scale / self.multiplier
            else:
                reduced = self.scale * self.backoff_factor
            self.scale = max(reduced, self.min_loss_scale)
        return False

    def scales(self, finite_steps) -> list[float]:
        """The scale after each of `finite_steps` (booleans), the model advanced through them."""
        result = []
        for finite in finite_steps:
            self.step(bool(finite))
            result.append(float(self.scale))
        return result


def stats_dict(opt_state) -> dict:
    """The stats as Python values; a NaN `grad_norm` as "nan", so that dicts compare."""
    stats = {
        name: value.item() for name, value in jls.get_loss_scale_stats(opt_state)._asdict().items()
    }
    if math.isnan(stats["grad_norm"]):
        stats["grad_norm"] = "nan"
    return stats


def stats_tuple(opt_state) -> tuple[float, int, bool]:
    """The scale, the skipped steps and whether the last step was applied, as Python values."""
    stats = jls.get_loss_scale_stats(opt_state)
    return float(stats.loss_scale), int(stats.skipped_steps), bool(stats.last_step_applied)


JIT_MODES = ["jit", "nojit"]


def jit_mode(mode: str):
    """The context of one of `JIT_MODES`: none for "jit", `jax.disable_jit()` for "nojit"."""
    return jax.disable_jit() if mode == "nojit" else contextlib.nullcontext()


def call_in_mode(mode: str, fn, *args):
    """`fn(*args)`, wrapped in `jax.jit` ("jit") or eagerly under `jax.disable_jit()`."""
    if mode == "jit":
        return jax.jit(fn)(*args)
    with jit_mode(mode):
        return fn(*args)


def jitted(fn, *args):
    """`jax.jit(fn)(*args)`: for a test of code that takes the same path eagerly (see
    `jit_or_eager` in conftest.py for where it does not)."""
    return jax.jit(fn)(*args)


def python_blocks(page: pathlib.Path) -> list[str]:
    """The Python code blocks of a Markdown page, in order."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)


def assert_block_prints_what_it_says(block: str, name: str, capsys) -> None:
    """Runs a code block in a fresh namespace; what it prints starts with what its
    `# -> ...` comments say, one line each (a comment's text up to " (", where a remark
    may follow)."""
    exec(compile(block, name, "exec"), {})
    expected = [match.split(" (")[0] for match in re.findall(r"# -> (.*)", block)]
    assert capsys.readouterr().out.split("\n")[: len(expected)] == expected


HALF_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# Ops XLA may run on half-precision operands held in float32 (elementwise and layout ops).
EXCESS_PRECISION_OPS = {
    "abs", "add", "broadcast_in_dim", "ceil", "concatenate", "copysign", "div", "eq", "exp",
    "floor", "ge", "gt", "integer_pow", "is_finite", "le", "log", "lt", "max", "min", "mul",
    "ne", "neg", "reshape", "round", "select_n", "sign", "sqrt", "squeeze", "sub", "square",
}  # fmt: skip


def with_excess_precision(fn):
    """`fn` run as XLA's GPU compiler may run it (`xla_allow_excess_precision`, on by default):
    a float32 value cast to bfloat16 or float16 keeps its float32 bits while it feeds only
    elementwise ops and casts back to float32; it is rounded where another op needs the
    declared type (a bitcast, say) and at the outputs. The CPU compiler rounds at every
    cast, so a rounding that relies on a cast and back shows its GPU result only here."""

    def run(*args):
        closed = jax.make_jaxpr(fn)(*args)
        outputs = _run_with_excess_precision(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        declared = [var.aval.dtype for var in closed.jaxpr.outvars]
        outputs = [value.astype(dtype) for value, dtype in zip(outputs, declared, strict=True)]
        return jax.tree.unflatten(jax.tree.structure(jax.eval_shape(fn, *args)), outputs)

    return run


def _run_with_excess_precision(jaxpr, consts, args):
    env = {}

    def read(var):
        return var.val if isinstance(var, jax.extend.core.Literal) else env[var]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        values = [jnp.asarray(read(var)) for var in eqn.invars]
        declared = [var.aval.dtype for var in eqn.invars]
        excess = [
            value.dtype == jnp.float32 and dtype in HALF_DTYPES
            for value, dtype in zip(values, declared, strict=True)
        ]
        name = eqn.primitive.name
        if (
            name == "convert_element_type"
            and values[0].dtype == jnp.float32
            and (np.dtype(eqn.params["new_dtype"]) in (*HALF_DTYPES, np.dtype(jnp.float32)))
        ):
            outputs = [values[0]]  # the cast to half precision (or back) is dropped
        elif name in ("jit", "pjit"):
            inner = eqn.params["jaxpr"]
            outputs = _run_with_excess_precision(inner.jaxpr, inner.consts, values)
        else:
            if name in EXCESS_PRECISION_OPS and any(excess):
                values = [v.astype(jnp.float32) if v.dtype in HALF_DTYPES else v for v in values]
            else:
                values = [
                    v.astype(d) if wide else v
                    for v, d, wide in zip(values, declared, excess, strict=True)
                ]
            outputs = eqn.primitive.bind(*values, **eqn.params)
            outputs = outputs if eqn.primitive.multiple_results else [outputs]
        env.update(zip(eqn.outvars, outputs, strict=True))
    return [read(var) for var in jaxpr.outvars]
