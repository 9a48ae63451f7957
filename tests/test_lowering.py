"""What a GPU or TPU would compile for a loss-scaled train step (docs/performance.md, "On a
GPU or TPU").

No GPU or TPU is needed: `jax.jit(step).trace(...).lower(lowering_platforms=(platform,))`
gives, on this CPU jaxlib, the StableHLO module that XLA:GPU (`"cuda"`, `"rocm"`) or XLA:TPU
(`"tpu"`) would compile. The tests count what is in it: conditionals, custom calls and host
transfers, the aliasing of donated buffers and, under SPMD, the sharding annotations. Where
XLA's own passes matter (folding a constant conditional, partitioning), the step is also
compiled on CPU, whose pipeline runs the same platform-independent HLO passes.
"""

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_lossscale as jls
from benchmarks import gpt

from helpers import compiled_reductions

PLATFORMS = ("cuda", "rocm", "tpu")
SPMD_PLATFORMS = ("cuda", "tpu")
AXIS = "d"
NUM_DEVICES = 8

LOSS_SCALES = {
    "DynamicLossScale": lambda inner: jls.loss_scaled(inner, jls.DynamicLossScale()),
    "FixedLossScale": lambda inner: jls.loss_scaled(inner, jls.FixedLossScale(2.0**10)),
    "skip_grad_norm_above": lambda inner: jls.loss_scaled(
        inner, jls.DynamicLossScale(), skip_grad_norm_above=100.0
    ),
    "skip_spike_sigmas": lambda inner: jls.loss_scaled(
        inner, jls.DynamicLossScale(), skip_spike_sigmas=6.0
    ),
}
VARIANTS = ("bare", *LOSS_SCALES)
OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "sgd": lambda: optax.sgd(1e-3, momentum=0.9, nesterov=True),
}

# Conditionals per lowered step whose branch is chosen at run time, off the CPU (see
# `case_kinds`). Under adam the skip is a `cond`: one, which a FixedLossScale with no spike
# option leaves on a constant index that XLA folds. Under sgd (an inner state no larger than
# the gradients) the skip is made of selects: none. The lowering may hold further `case`s on
# constant indices (`lax.platform_dependent`'s choice of platform), which XLA folds.
CONDITIONALS = {
    "adam": {
        "bare": 0,
        "DynamicLossScale": 1,
        "FixedLossScale": 0,
        "skip_grad_norm_above": 1,
        "skip_spike_sigmas": 1,
    },
    "sgd": dict.fromkeys(VARIANTS, 0),
}
# On a GPU every skip is made of selects (`_platforms.chosen`): no step holds a conditional.
GPU_PLATFORMS = ("cuda", "rocm")


def expected_conditionals(optimizer: str, variant: str, platform: str) -> int:
    return 0 if platform in GPU_PLATFORMS else CONDITIONALS[optimizer][variant]


# The custom calls of every lowered step, bare or loss-scaled, on every platform: none. (The
# GPT's matmuls become cuBLAS or Triton calls later, inside XLA:GPU, not in StableHLO.)
CUSTOM_CALL_TARGETS: set[str] = set()

# Under SPMD on 8 devices, compiled on CPU: the all-reduces of the step, each as (where,
# float32 scalars it reduces, distinct operands among them); all of them run on every step,
# in one combined all-reduce in the entry computation. Each of the 3 sharded gradient leaves
# gives one partial sum of squares, from which the finite flag, the NaN flag and the norm
# are all read (an infinity or an overflow makes the sum infinite, a NaN NaN): 3 operands,
# whatever the loss scale. The replicated leaf "g" and the replicated spike windows need none.
ALL_REDUCES = {
    optimizer: {"bare": [], **{variant: [("entry", 3, 3)] for variant in LOSS_SCALES}}
    for optimizer in ("adam", "sgd")
}


# --- Reading StableHLO and HLO text ---------------------------------------------------------

# An op, at the start of a line or after `=`: `%0 = stablehlo.add ...`, `"stablehlo.case"(...)`.
_STABLEHLO_OP = re.compile(r'(?:^\s*|= )"?((?:stablehlo|sdy)\.[a-z_]+)\b', re.MULTILINE)
_CUSTOM_CALL = re.compile(r'stablehlo\.custom_call @([\w.$-]+)|call_target_name = "([^"]+)"')
_HOST_OPS = ("stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed")
_HOST_TARGET = re.compile(r"callback|host", re.IGNORECASE)
# An HLO instruction: `name = type opcode(operands)`, as in benchmarks/hlo.py.
_HLO_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?([\w.-]+) = (.*?)(?<![\w.-])([a-z][a-z0-9-]*)\(", re.MULTILINE
)
_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.-]+) \(.*\{$")


def stablehlo_ops(text: str) -> collections.Counter:
    """The StableHLO (and Shardy) ops of a lowered module, counted by name."""
    return collections.Counter(_STABLEHLO_OP.findall(text))


def custom_call_targets(text: str) -> set[str]:
    return {a or b for a, b in _CUSTOM_CALL.findall(text)}


def host_transfers(text: str) -> list[str]:
    """Whatever would move data between device and host inside the step."""
    ops = stablehlo_ops(text)
    found = [op for op in _HOST_OPS if ops[op]]
    found += [target for target in custom_call_targets(text) if _HOST_TARGET.search(target)]
    return found


def _definition(text: str, name: str, before: int) -> str | None:
    """The op that defines the SSA value `name` nearest before `before` (None for an
    argument of the function)."""
    pattern = rf'^\s*{re.escape(name)}(?::\d+)? = "?([\w.]+)'
    definitions = re.findall(pattern, text[:before], re.MULTILINE)
    return definitions[-1] if definitions else None


def _bracketed(text: str, start: int) -> str:
    """The text from the bracket at or after `start` to its matching closing bracket."""
    opening = min(i for i in (text.find("(", start), text.find("{", start)) if i >= 0)
    depth = 0
    for position in range(opening, len(text)):
        depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[opening : position + 1]
    raise ValueError("unbalanced brackets")


def case_kinds(text: str) -> list[str]:
    """For each `stablehlo.case`, "constant" when its branch index is known at compile time,
    which XLA folds away (its ConditionalSimplifier inlines the branch); else "data", a branch
    chosen at run time from the step's values.

    An index is known where it is a `stablehlo.constant`, its `stablehlo.convert`, or a result
    of a case on a known index whose chosen branch returns a known value there: as
    `lax.platform_dependent` lowers, a case on the platform's constant index whose branch for
    that platform returns a constant (another platform's branch may return a value of the
    step)."""
    known: dict[str, int] = {}
    kinds = []
    header = re.compile(r'^\s*(%[\w]+)(?::(\d+))? = "stablehlo\.case"\((%[\w#]+)\)', re.MULTILINE)
    for match in header.finditer(text):
        result, count, index = match.group(1), match.group(2), match.group(3)
        value = _known_value(text, index, match.start(), known)
        kinds.append("data" if value is None else "constant")
        if value is None:
            continue
        branches = _branches(_bracketed(text, match.end()))
        branch = branches[value if 0 <= value < len(branches) else -1]  # out of range: the last
        returned = re.findall(r"stablehlo\.return ([^:\n]*)", branch)[-1]
        operands = [operand.strip() for operand in returned.split(",")]
        names = [result] if count is None else [f"{result}#{j}" for j in range(int(count))]
        for name, operand in zip(names, operands, strict=True):
            inner = _known_value(branch, operand, len(branch), {})
            outer = _known_value(text, operand, match.start(), known)
            if (found := outer if inner is None else inner) is not None:
                known[name] = found
    return kinds


def _known_value(text: str, name: str, before: int, known: dict[str, int]) -> int | None:
    """The integer (or boolean, as 0 or 1) value of the SSA value `name` where the text before
    `before` makes it known at compile time, else None."""
    if name in known:
        return known[name]
    pattern = rf"^\s*{re.escape(name)} = stablehlo\.(constant dense<(\w+)>|convert (%[\w#]+))"
    definitions = re.findall(pattern, text[:before], re.MULTILINE)
    if not definitions:
        return None
    _, constant, converted = definitions[-1]
    if converted:
        return _known_value(text, converted, before, known)
    if constant in ("true", "false"):
        return int(constant == "true")
    return int(constant) if re.fullmatch(r"-?\d+", constant) else None


def _branches(region: str) -> list[str]:
    """The branches' texts of a case's region, `({ ... }, { ... })`."""
    branches, depth, start = [], 0, 0
    for position, character in enumerate(region):
        if character == "{":
            depth += 1
            if depth == 1:
                start = position
        elif character == "}":
            depth -= 1
            if depth == 0:
                branches.append(region[start : position + 1])
    return branches


def main_signature(text: str) -> tuple[list[str], list[str]]:
    """The attributes of each argument and of each result of the module's `@main`."""
    start = text.index("func.func public @main(") + len("func.func public @main(")
    arguments, _, results = text[start : text.index("\n", start)].partition(") -> (")
    return re.split(r"(?:^|, )%arg\d+: ", arguments)[1:], re.split(r", (?=tensor<)", results)


def sharding_of(attributes: str) -> str:
    """The dimension shardings of an argument or a result, e.g. `[{"d"}, {}]`."""
    return re.search(r"sdy\.sharding<@mesh, (\[[^\]]*\])>", attributes).group(1)


def hlo_collectives(compiled_text: str) -> list[tuple[str, str, str, list[str]]]:
    """`(where, opcode, result type, operands)` of every collective and conditional of an optimized
    HLO module, where is "entry", "skip branch" (the conditional's branch 0, taken when its
    predicate is false) or "applied branch"."""
    found, computation = [], None
    for line in compiled_text.splitlines():
        if header := _HLO_COMPUTATION.match(line):
            computation = "entry" if line.startswith("ENTRY") else header.group(1)
            continue
        instruction = _HLO_INSTRUCTION.match(line)
        if instruction is None:
            continue
        opcode = instruction.group(3)
        if opcode.startswith(("all-", "reduce-scatter", "collective-")) or opcode == "conditional":
            operands = line[instruction.end() :].split(")")[0]
            operands = re.findall(r"%[\w.-]+", operands)
            found.append((computation, opcode, instruction.group(2).strip(), operands))
    branches = re.findall(r"branch_computations=\{%?([\w.-]+), %?([\w.-]+)\}", compiled_text)
    names = {
        name: where
        for pair in branches
        for name, where in zip(pair, ("skip", "applied"), strict=True)
    }
    return [
        (where if where == "entry" else f"{names[where]} branch", opcode, type_, operands)
        for where, opcode, type_, operands in found
    ]


# --- The steps ------------------------------------------------------------------------------


def _params() -> dict[str, jax.Array]:
    """Float32 and float16 leaves; the first three split over 8 devices, "g" too small to."""
    return {
        "w": jnp.linspace(-1.0, 1.0, 64 * 32, dtype=jnp.float32).reshape(64, 32),
        "b": jnp.zeros((32,), jnp.float32),
        "h": jnp.full((16, 8), 0.5, jnp.float16),
        "g": jnp.ones((3,), jnp.float32),
    }


def _optimizer_step(tx: optax.GradientTransformation, scaled: bool):
    """`(params, opt_state, grads, loss) -> (params, opt_state)`; a loss-scaled step passes the
    loss as `value=`, which `skip_spike_sigmas` tests."""

    def step(params, opt_state, grads, loss):
        extra = {"value": loss} if scaled else {}
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    return step


def _tx(variant: str, optimizer: str) -> optax.GradientTransformation:
    inner = OPTIMIZERS[optimizer]()
    return inner if variant == "bare" else LOSS_SCALES[variant](inner)


@functools.cache
def _synthetic_traced(variant: str, optimizer: str):
    """The donated synthetic step, traced once for every platform it is lowered for."""
    tx = _tx(variant, optimizer)
    params = _params()
    step = jax.jit(_optimizer_step(tx, variant != "bare"), donate_argnums=(0, 1))
    return step.trace(params, jax.eval_shape(tx.init, params), params, jnp.float32(2.0))


@functools.cache
def synthetic_lowered(variant: str, optimizer: str, platform: str) -> str:
    """The donated synthetic step, lowered for `platform`, as StableHLO text."""
    return _synthetic_traced(variant, optimizer).lower(lowering_platforms=(platform,)).as_text()


@functools.cache
def _gpt_traced(variant: str):
    """The donated float16 GPT step of benchmarks/gpt.py, traced once: one block of its
    smaller size's four, which holds every kind of operation the four do (a conditional that
    the forward or backward pass added would show in one block as in four)."""
    size = dataclasses.replace(gpt.SIZES["70 leaves"], layers=1)

    def adamw():
        return optax.adamw(optax.linear_schedule(1e-3, 1e-4, 10_000), weight_decay=0.01)

    tx = adamw() if variant == "bare" else LOSS_SCALES[variant](adamw())
    graphdef, state = gpt.shapes_of_build(gpt.train_state, size, 96, tx)
    tokens = jax.ShapeDtypeStruct((size.batch, size.seq), jnp.int32)
    step = jax.jit(gpt.train_step_of(graphdef, variant != "bare"), donate_argnums=0)
    return step.trace(state, tokens, tokens)


@functools.cache
def gpt_lowered(variant: str, platform: str) -> str:
    return _gpt_traced(variant).lower(lowering_platforms=(platform,)).as_text()


@functools.cache
def _mesh() -> Mesh:
    assert jax.device_count() == NUM_DEVICES  # tests/conftest.py: 8 CPU devices
    return Mesh(np.array(jax.devices()), (AXIS,))


def _sharding(leaf) -> NamedSharding:
    """Split over the mesh along the first axis for a leaf shaped like a param that divides
    evenly (a param, a gradient, an adam moment), else replicated: the loss-scale state and
    the spike windows (128 entries, which would divide) stay whole on every device."""
    shapes = {np.shape(param) for param in jax.tree.leaves(_params())}
    split = np.ndim(leaf) > 0 and np.shape(leaf) in shapes and np.shape(leaf)[0] % NUM_DEVICES == 0
    return NamedSharding(_mesh(), PartitionSpec(AXIS) if split else PartitionSpec())


def _placed(tree):
    """`tree`'s shapes and dtypes, each leaf placed as `_sharding` places it, so that its type
    names the mesh, as a `jax.device_put` array's does."""
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=_sharding(leaf)), tree
    )


@functools.cache
def _spmd_jitted(variant: str, optimizer: str, placed: bool = True):
    """The donated synthetic step under SPMD `jit`: params, optimizer state and gradients
    sharded over the mesh, and kept so on the way out. With `placed`, the arguments carry
    their shardings, as arrays placed with `jax.device_put` do; without, the shardings are
    given as `in_shardings` alone, and the arguments' types name no mesh."""
    tx = _tx(variant, optimizer)
    params = _params()
    state = jax.eval_shape(tx.init, params)
    param_shardings = jax.tree.map(_sharding, params)
    state_shardings = jax.tree.map(_sharding, state)
    replicated = NamedSharding(_mesh(), PartitionSpec())
    step = jax.jit(
        _optimizer_step(tx, variant != "bare"),
        in_shardings=(param_shardings, state_shardings, param_shardings, replicated),
        out_shardings=(param_shardings, state_shardings),
        donate_argnums=(0, 1),
        keep_unused=True,  # every leaf keeps its argument, so the gradients are the last 5 but 1
    )
    if placed:
        params, state = _placed(params), _placed(state)
    return step.trace(params, state, params, jnp.float32(2.0))


@functools.cache
def spmd_lowered(variant: str, optimizer: str, platform: str) -> str:
    return _spmd_jitted(variant, optimizer).lower(lowering_platforms=(platform,)).as_text()


@functools.cache
def spmd_compiled_on_cpu(variant: str, optimizer: str) -> str:
    """The optimized, partitioned HLO of the SPMD step, compiled by XLA:CPU."""
    return _spmd_jitted(variant, optimizer).lower().compile().as_text()


# --- Conditionals ---------------------------------------------------------------------------


def run_time_conditionals(text: str) -> int:
    """The `case`s of a lowered module whose branch is chosen from the step's values."""
    return case_kinds(text).count("data")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_conditionals_per_synthetic_step(variant, optimizer, platform):
    """At most one conditional chosen at run time per loss-scaled step (see CONDITIONALS),
    none under sgd, none in the bare step.

    XLA:GPU runs a conditional by copying its predicate to the host and waiting for it (a
    device-to-host synchronisation) unless the conditional is recorded into a CUDA graph as a
    device-side conditional node; one per step is one such wait per step, not one per leaf or
    per check, and a step skipped by selects never waits.
    """
    text = synthetic_lowered(variant, optimizer, platform)
    assert run_time_conditionals(text) == expected_conditionals(optimizer, variant, platform)
    assert stablehlo_ops(text)["stablehlo.if"] == 0
    assert stablehlo_ops(text)["stablehlo.while"] == 0  # nothing loops over leaves


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_conditionals_per_gpt_step(variant, platform):
    """The float16 GPT train step (benchmarks/gpt.py, adamw) holds as many conditionals as the
    adam step alone: the forward and backward passes add none, so a GPU waits on the host at
    most once per step, after the backward pass has produced the gradients."""
    text = gpt_lowered(variant, platform)
    assert run_time_conditionals(text) == expected_conditionals("adam", variant, platform)
    assert stablehlo_ops(text)["stablehlo.if"] == 0


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_conditional_reader_tells_a_constant_index_from_a_computed_one(platform):
    """`case_kinds` is not blind: under adam a FixedLossScale's skip is a `case` on a constant
    index (XLA's ConditionalSimplifier, which XLA:GPU runs too, replaces it by the applied
    branch), a DynamicLossScale's a `case` on the skip decision off a GPU (on a GPU the skip
    is selects), beside the `case`s on the platform's constant index; and a `lax.cond` on a
    computed predicate is one conditional chosen at run time on every platform."""
    fixed = case_kinds(synthetic_lowered("FixedLossScale", "adam", platform))
    assert "constant" in fixed
    assert "data" not in fixed
    dynamic = case_kinds(synthetic_lowered("DynamicLossScale", "adam", platform))
    assert dynamic.count("data") == (0 if platform in GPU_PLATFORMS else 1)

    def halve_if_large(x):
        return jax.lax.cond(jnp.sum(x) > 1.0, lambda: x / 2, lambda: x)

    text = jax.jit(halve_if_large).trace(jnp.ones(4)).lower(lowering_platforms=(platform,))
    assert case_kinds(text.as_text()) == ["data"]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_reader_follows_the_platforms_branch_of_a_platform_dependent_predicate(platform):
    """A `cond` on a predicate that `platform_dependent` gives is known where the branch of the
    platform lowered for returns a constant, and chosen at run time where that branch returns
    a value of the step, whatever the other platforms' branches return (XLA inlines the
    platform's branch, then folds a constant predicate)."""

    def halve_on_a_gpu_or_if_large(x):
        large = jnp.sum(x) > 1.0
        on_gpu = jax.lax.platform_dependent(
            cuda=lambda: jnp.bool_(True), rocm=lambda: jnp.bool_(True), default=lambda: large
        )
        return jax.lax.cond(on_gpu, lambda: x / 2, lambda: x)

    traced = jax.jit(halve_on_a_gpu_or_if_large).trace(jnp.ones(4))
    kinds = case_kinds(traced.lower(lowering_platforms=(platform,)).as_text())
    assert kinds[-1] == ("constant" if platform in GPU_PLATFORMS else "data")
    assert kinds.count("data") == (0 if platform in GPU_PLATFORMS else 1)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_xla_folds_only_the_fixed_loss_scales_conditional(variant, optimizer):
    """Compiled by XLA (on CPU, single device): under adam the FixedLossScale step has no
    conditional left and every other loss-scaled step one, the skip; under sgd no step has
    one, the skip being selects and the NaN flag a by-product of the finite check."""
    compiled = _synthetic_traced(variant, optimizer).lower().compile().as_text()
    opcodes = [opcode for _, opcode, _, _ in hlo_collectives(compiled)]
    skips_by_cond = optimizer == "adam" and variant not in ("bare", "FixedLossScale")
    assert opcodes.count("conditional") == (1 if skips_by_cond else 0)


MIN_BELOW_ONE = {
    "DynamicLossScale": jls.DynamicLossScale(),
    "min_loss_scale below 1": jls.DynamicLossScale(min_loss_scale=2.0**-10),
    "FixedLossScale": jls.FixedLossScale(2.0**10),
}


# The reductions of the synthetic step compiled under `pmap` or on one device of 8 (the CPU
# form): the four small leaves (float32 w, b, g and float16 h), combined entry by entry,
# summed over rows of 512 (four rows) in a reduction of two results, the sum and an infinity
# flag, as XLA:CPU compiles in one loop; then one sum over the rows' sums, which the finite
# check, the NaN flag and the norm all read. There is no other reduction, whatever the loss
# scale and the optimizer.
UNSHARDED_REDUCTIONS = {
    optimizer: ["f32[]", "(f32[4]{0}, pred[4]{0})"] for optimizer in ("adam", "sgd")
}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("loss_scale", MIN_BELOW_ONE.values(), ids=MIN_BELOW_ONE.keys())
def test_one_reduction_per_part_checks_and_measures_under_pmap(loss_scale, optimizer):
    """Compiled under `pmap` (CPU): one reduction per part, giving both the sum for the
    finite check and the norm and the NaN flag, and no other reduction, a scale that can go
    below 1 included."""
    tx = jls.loss_scaled(OPTIMIZERS[optimizer](), loss_scale, axis_name="i")
    params = jax.tree.map(lambda leaf: jnp.stack([leaf] * 2), _params())
    state = jax.pmap(tx.init, axis_name="i", devices=jax.devices()[:2])(params)

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    pmapped = jax.pmap(step, axis_name="i", devices=jax.devices()[:2], donate_argnums=(0, 1))
    text = pmapped.lower(params, state, params).compile().as_text()
    assert sorted(compiled_reductions(text)) == sorted(UNSHARDED_REDUCTIONS[optimizer])


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("loss_scale", MIN_BELOW_ONE.values(), ids=MIN_BELOW_ONE.keys())
def test_one_reduction_per_part_on_one_device_of_eight(loss_scale, optimizer):
    """The step jitted with its arrays on one device of this process's 8 compiles as on a
    host with one device: the same reductions as under `pmap`, no collective."""
    tx = jls.loss_scaled(OPTIMIZERS[optimizer](), loss_scale)
    params = jax.device_put(_params(), jax.devices()[5])
    step = jax.jit(_optimizer_step(tx, True), donate_argnums=(0, 1))
    state = jax.eval_shape(tx.init, params)
    text = step.lower(params, state, params, jnp.float32(2.0)).compile().as_text()
    assert sorted(compiled_reductions(text)) == sorted(UNSHARDED_REDUCTIONS[optimizer])
    assert {opcode for _, opcode, _, _ in hlo_collectives(text)} <= {"conditional"}


# --- Custom calls and host transfers --------------------------------------------------------


@pytest.mark.parametrize("platform", [*PLATFORMS, "cpu"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_no_custom_call_or_host_transfer_in_any_step(variant, platform):
    """No custom call at all, so none from the library, and nothing that goes to the host:
    no callback, send, recv, infeed or outfeed. A host callback would make a GPU step wait for
    Python each step. (On "cpu" a callback lowers to `xla_ffi_python_cpu_callback`; for a GPU
    this CPU jaxlib would refuse to lower one at all.)"""
    for text, bare in (
        (gpt_lowered(variant, platform), gpt_lowered("bare", platform)),
        (synthetic_lowered(variant, "adam", platform), synthetic_lowered("bare", "adam", platform)),
        (synthetic_lowered(variant, "sgd", platform), synthetic_lowered("bare", "sgd", platform)),
    ):
        assert custom_call_targets(text) == CUSTOM_CALL_TARGETS
        assert custom_call_targets(text) <= custom_call_targets(bare)  # none of the library's
        assert host_transfers(text) == []
        assert "has_side_effect" not in text


@pytest.mark.parametrize(
    ("platform", "target"),
    [("cuda", "cusolver_potrf_ffi"), ("rocm", "hipsolver_potrf_ffi"), ("cpu", "lapack_spotrf_ffi")],
)
def test_the_custom_call_reader_finds_what_is_there(platform, target):
    """The reader above is not blind: a Cholesky factorisation lowers to the platform's
    solver, and a host callback on CPU to a Python callback that `host_transfers` reports."""

    def factor(x):
        return jnp.linalg.cholesky(x @ x.T + jnp.eye(4))

    text = jax.jit(factor).trace(jnp.ones((4, 4))).lower(lowering_platforms=(platform,)).as_text()
    assert custom_call_targets(text) == {target}
    assert host_transfers(text) == []

    def calls_back(x):
        jax.debug.callback(lambda value: None, x)
        return x + 1

    lowered = jax.jit(calls_back).trace(jnp.ones(4))
    if platform == "cpu":
        text = lowered.lower(lowering_platforms=("cpu",)).as_text()
        assert host_transfers(text) == ["xla_ffi_python_cpu_callback"]
    else:
        with pytest.raises(ValueError, match="different from the lowering platform"):
            lowered.lower(lowering_platforms=(platform,))


# --- Donation -------------------------------------------------------------------------------


# Arguments of the lowered GPT step beyond the bare step's 71 (69 donated model and adamw
# state leaves that the step reads, and the two token arrays): every leaf of the loss-scale
# state (3 of a DynamicLossScale, 1 of a FixedLossScale), the 7 skip statistics and, with
# `skip_spike_sigmas`, the 7 leaves of the spike windows. None is left out as unread (which
# would leave its new value a fresh buffer at every step, not written in place).
EXTRA_GPT_ARGUMENTS = {
    "bare": 0,
    "DynamicLossScale": 10,
    "FixedLossScale": 8,
    "skip_grad_norm_above": 10,
    "skip_spike_sigmas": 17,
}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_donated_buffer_is_updated_in_place(variant, platform):
    """Every argument of the donated GPT step but the two token arrays is aliased to an
    output (`tf.aliasing_output`): a GPU writes the new params, optimizer and loss-scale
    state over the old ones, and a skipped step needs no second copy of the model."""
    arguments, _ = main_signature(gpt_lowered(variant, platform))
    aliased = ["tf.aliasing_output" in attributes for attributes in arguments]
    assert aliased[-2:] == [False, False]  # inputs, targets
    assert all(aliased[:-2])
    assert len(arguments) == 71 + EXTRA_GPT_ARGUMENTS[variant]


# --- SPMD -----------------------------------------------------------------------------------


@pytest.mark.parametrize("platform", SPMD_PLATFORMS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_spmd_lowering_keeps_gradients_and_params_sharded(variant, optimizer, platform):
    """Before partitioning, the module a GPU or TPU gets says: 8 partitions, gradients in
    and params out split over the mesh as given, and nothing in between that would replicate
    them (no sharding constraint, no reshard), so the partitioner has no reason to gather a
    gradient."""
    text = spmd_lowered(variant, optimizer, platform)
    assert "mhlo.num_partitions = 8" in text
    arguments, results = main_signature(text)
    gradients = [sharding_of(attributes) for attributes in arguments[-5:-1]]
    assert gradients == ['[{"d"}]', "[{}]", '[{"d"}, {}]', '[{"d"}, {}]']  # b, g, h, w
    new_params = [sharding_of(attributes) for attributes in results[:4]]
    assert new_params == gradients
    assert sharding_of(arguments[-1]) == "[]"  # the loss
    ops = stablehlo_ops(text)
    shardy_ops = sorted(op for op in ops if op.startswith("sdy.") and op != "sdy.mesh")
    assert shardy_ops == []
    assert run_time_conditionals(text) == expected_conditionals(optimizer, variant, platform)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_spmd_step_all_reduces_scalars_only(variant, optimizer):
    """Partitioned by XLA over 8 devices: no all-gather, reduce-scatter, all-to-all or
    collective permute, so no gradient ever leaves its device; the only collectives are
    all-reduces of float32 scalars (partial sums for the finite check, the norm and the NaN
    flag), a few bytes each, combined into one. On a GPU that is one small NCCL all-reduce
    per step."""
    found = hlo_collectives(spmd_compiled_on_cpu(variant, optimizer))
    opcodes = collections.Counter(opcode for _, opcode, _, _ in found)
    assert set(opcodes) <= {"all-reduce", "conditional"}
    assert opcodes["conditional"] == CONDITIONALS[optimizer][variant]

    all_reduces = [
        (where, shape, operands)
        for where, opcode, shape, operands in found
        if opcode == "all-reduce"
    ]
    for _, shape, _ in all_reduces:
        operands = re.findall(r"\b([a-z]+\d*)\[([^\]]*)\]", shape)
        assert operands, shape
        assert all(dims == "" for _, dims in operands), shape  # scalars only
        assert {dtype for dtype, _ in operands} == {"f32"}, shape
    observed = [
        (where, len(re.findall(r"\[\]", shape)), len(set(operands)))
        for where, shape, operands in all_reduces
    ]
    assert sorted(observed) == sorted(ALL_REDUCES[optimizer][variant])


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("variant", LOSS_SCALES)
def test_spmd_step_given_in_shardings_alone_gathers_small_arrays_only(variant, optimizer):
    """With the shardings given only as `jit`'s `in_shardings`, the arguments' types name no
    mesh, nothing says a leaf may be sharded, and the small leaves (of at most 4,096 entries)
    are combined as on one device: XLA's partitioner then gathers them, and the partial
    results of their rows' reduction, never a larger array. Placing the arrays
    (`jax.device_put`) or entering the mesh (`jax.sharding.set_mesh`) gives the form of
    `test_spmd_step_all_reduces_scalars_only`."""
    found = hlo_collectives(_spmd_jitted(variant, optimizer, False).lower().compile().as_text())
    assert {opcode for _, opcode, _, _ in found} <= {"all-gather", "all-reduce", "conditional"}
    gathered = [type_ for _, opcode, type_, _ in found if opcode == "all-gather"]
    dims = [re.search(r"\[([\d,]*)\]", type_).group(1).split(",") for type_ in gathered]
    sizes = [int(np.prod([int(n) for n in shape if n])) for shape in dims]
    assert gathered
    assert max(sizes) <= 4096


def test_the_sharding_readers_find_a_replicated_gradient():
    """The readers above are not blind: a gradient constrained to be replicated shows as an
    `sdy.sharding_constraint` in the lowering and as an all-gather once partitioned."""
    split = NamedSharding(_mesh(), PartitionSpec(AXIS))

    def step(params, grads):
        whole = jax.lax.with_sharding_constraint(grads, NamedSharding(_mesh(), PartitionSpec()))
        return params - whole * jnp.sum(whole)

    jitted = jax.jit(step, in_shardings=(split, split), out_shardings=split)
    arrays = (jnp.ones(64), jnp.ones(64))
    text = jitted.trace(*arrays).lower(lowering_platforms=("cuda",)).as_text()
    assert stablehlo_ops(text)["sdy.sharding_constraint"] == 1
    opcodes = [
        opcode for _, opcode, _, _ in hlo_collectives(jitted.lower(*arrays).compile().as_text())
    ]
    assert opcodes == ["all-gather"]
