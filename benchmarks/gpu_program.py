"""XLA's optimized program for an NVIDIA H100, compiled on a machine without a GPU.

`python -m benchmarks.gpu_program --help`. JAX compiles for a GPU it does not have when the
CUDA plugin is installed (`pip install -e ".[gpu-compile]"`: `jax-cuda13-plugin` and
`jax-cuda13-pjrt` at the installed jax's version; no CUDA libraries are needed): the step is
lowered for arrays placed on a mesh of an H100's topology, described by the H100's target
config (`h100_target_config.pbtxt` beside this file, the device description XLA reads from a
real H100: its core count, memory sizes and compute capability). The CPU stays JAX's
platform: the topology is all the compile needs, and no array is ever made on it.

What is read off the program (`GpuProgram`):

* `kernels`: the kernels a step launches. In XLA:GPU every fusion and custom call (cuBLAS,
  cuDNN) of the entry computation is one kernel; a copy is a memcpy, not a kernel. A
  `conditional` is counted as one (its thunk, which copies the predicate to the host and
  waits for the device) plus the kernels of its largest branch, and a `while` as one plus
  its body's and condition's. Calibrated on the runs on an H100 (DESIGN 4.1): the 8M-params
  optimizer steps in 64 leaves give adam 66 / 306 / 198 and sgd 64 / 237 / 195 kernels for
  the bare step / `loss_scaled` (at d8baf18) / jmp's select, as the H100 counted them.
* `variadic_reductions`: `reduce` instructions of more than one operand, anywhere in the
  program (XLA:GPU splits one in two kernels, and fuses it into nothing).
* `conditionals`: `conditional` instructions anywhere in the program (each a host sync).
* `temp_bytes`: XLA's temp buffer, `compiled.memory_analysis().temp_size_in_bytes`.
* `fresh_outputs`: outputs that alias no donated argument (the module's
  `input_output_alias`), each a new buffer at every step. XLA:GPU updates each kernel of its
  command buffer that touches a buffer whose address changed before it launches the graph:
  with every output written in place, a step with donated state updates none.
"""

import argparse
import dataclasses
import functools
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

# Set before the plugin starts: the plugin otherwise refuses to start without CUDA libraries.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

TARGET_CONFIG = Path(__file__).with_name("h100_target_config.pbtxt")
PLUGIN_MODULE = "jax_plugins.xla_cuda13"  # what `jax-cuda13-plugin` installs

# A computation's header, `[ENTRY ]%name (params) -> type {`, and its closing `}`.
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.-]+) .*\{$")
# An instruction, `[ROOT ]%name = type opcode(operands), attributes`: the opcode is the first
# word followed by a parenthesis after the ` = ` (a type holds none).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = (.*?)(?<![\w.-])([a-z][a-z0-9-]*)\((.*)$")
_CALLED = re.compile(
    r"(?:true_computation|false_computation|body|condition)=%?([\w.-]+)"
    r"|branch_computations=\{([^}]*)\}"
)
KERNEL_OPCODES = ("fusion", "custom-call")
# An entry of the module's `input_output_alias`: `{output index}: (parameter, {index}, kind)`.
_ALIAS = re.compile(r"\{[\d,]*\}: \(\d+, \{[\d,]*\}, (?:may|must)-alias\)")


@dataclasses.dataclass(frozen=True)
class GpuProgram:
    """What XLA compiled for one step on an H100 (see the module's docstring)."""

    kernels: int
    variadic_reductions: int
    conditionals: int
    temp_bytes: int
    fresh_outputs: int  # outputs written to a new buffer, not over a donated argument
    text: str = dataclasses.field(repr=False, compare=False)


@functools.cache
def h100_mesh() -> jax.sharding.Mesh:
    """A one-device mesh, axis "d", of an H100's topology (no GPU needed)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGET_CONFIG.read_text(), topology="1x1x1"
    )
    return topologies.make_mesh(topology, (1,), ("d",))


def on_h100(tree: Any) -> Any:
    """`tree`'s arrays (or shapes) as `jax.ShapeDtypeStruct`s placed on `h100_mesh()`."""
    sharding = jax.sharding.NamedSharding(h100_mesh(), jax.sharding.PartitionSpec())

    def place(leaf: Any) -> Any:
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(place, tree)


def compile_for_h100(fn: Callable, *args: Any, donate_argnums: Any = ()) -> Any:
    """`jax.jit(fn, donate_argnums=...)` compiled for an H100, for arguments shaped like `args`."""
    jitted = jax.jit(fn, donate_argnums=donate_argnums)
    return jitted.lower(*on_h100(args)).compile()


def gpu_program(compiled: Any) -> GpuProgram:
    """The counts of `compiled`, an H100 program from `compile_for_h100`."""
    text = compiled.as_text()
    computations = _computations(text)
    entry = next(name for name in computations if name.startswith("ENTRY "))
    variadic = conditionals = 0
    for instructions in computations.values():
        for type_, opcode, _ in instructions:
            variadic += opcode == "reduce" and type_.startswith("(")
            conditionals += opcode == "conditional"
    kernels = _kernels(computations, entry)
    temp = compiled.memory_analysis().temp_size_in_bytes
    aliased = len(_ALIAS.findall(text.splitlines()[0]))
    fresh = len(jax.tree.leaves(compiled.out_info)) - aliased
    return GpuProgram(kernels, variadic, conditionals, temp, fresh, text)


def _computations(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """Each computation's instructions as `(type, opcode, rest of the line)`."""
    computations: dict[str, list[tuple[str, str, str]]] = {}
    name = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line.startswith(" "):
            name = ("ENTRY " if header.group(1) else "") + header.group(2)
            computations[name] = []
        elif line == "}":
            name = None
        elif name is not None:
            instruction = _INSTRUCTION.match(line)
            if instruction:
                computations[name].append(instruction.groups())
    return computations


def _kernels(computations: dict[str, list[tuple[str, str, str]]], name: str) -> int:
    kernels = 0
    for _, opcode, rest in computations[name]:
        if opcode in KERNEL_OPCODES:
            kernels += 1
        elif opcode in ("conditional", "while"):
            called = [
                callee.strip().lstrip("%")
                for single, several in _CALLED.findall(rest)
                for callee in ([single] if single else several.split(","))
            ]
            counts = [_kernels(computations, callee) for callee in called]
            kernels += 1 + (max(counts) if opcode == "conditional" else sum(counts))
    return kernels


# --- the benchmark steps ---------------------------------------------------------------------


def optimizer_steps(size: int, leaves: int, optimizer: str) -> dict[str, GpuProgram]:
    """The H100 programs of the optimizer-step contenders (`benchmarks/contenders.py`)."""
    from benchmarks import contenders, measure

    params, grads = measure.params_and_grads(size, leaves)
    programs = {}
    for make in contenders.ALL:
        contender = make(measure.OPTIMIZERS[optimizer]())
        state = jax.eval_shape(contender.init, params)
        compiled = compile_for_h100(
            contender.optimizer_step, params, state, grads, donate_argnums=(0, 1)
        )
        programs[contender.name] = gpu_program(compiled)
    return programs


GPT_CONTENDERS = ("bare", "DynamicLossScale", "jmp", "flax", "optax.apply_if_finite")


def gpt_steps(size: Any, names: Sequence[str] = ("bare", "DynamicLossScale")) -> dict:
    """The H100 programs of the GPT train steps `names` (`benchmarks/gpt.py`), at `size`."""
    from benchmarks import gpt

    contenders = gpt.all_contenders()
    vocab = 100
    inputs = jax.ShapeDtypeStruct((size.batch, size.seq), jax.numpy.int32)
    programs = {}
    for name in names:
        step, state = gpt.shapes_of_build(contenders[name].build, size, vocab)
        compiled = compile_for_h100(step, state, inputs, inputs, donate_argnums=0)
        programs[name] = gpu_program(compiled)
    return programs


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    from benchmarks import gpt, measure

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_program", description=__doc__)
    parser.add_argument("--size", default="8M", help="parameters of the optimizer step")
    parser.add_argument("--leaves", type=int, default=64, help="leaves of the optimizer step")
    parser.add_argument("--optimizers", default="adam,sgd")
    parser.add_argument(
        "--gpt",
        default="1x64x64x2",
        help="the GPT's layers x width x sequence x batch (heads of 64 wide), or none",
    )
    parser.add_argument("--json", default=None, help="where to write the figures as JSON")
    args = parser.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    results: dict[str, dict[str, Any]] = {}
    for optimizer in args.optimizers.split(","):
        for name, program in optimizer_steps(
            measure.parse_count(args.size), args.leaves, optimizer
        ).items():
            results[f"{optimizer} {args.size}/{args.leaves} / {name}"] = _figures(program)
    if args.gpt != "none":
        layers, width, seq, batch = (int(n) for n in args.gpt.split("x"))
        size = gpt.Size(layers, width, heads=max(width // 64, 1), seq=seq, batch=batch)
        for name, program in gpt_steps(size, GPT_CONTENDERS).items():
            results[f"gpt {args.gpt} / {name}"] = _figures(program)
    from benchmarks import hlo

    columns = ["kernels", "variadic reduce", "conditional", "temp bytes", "fresh outputs"]
    hlo.report(results, columns, args.json)
    return results


def _figures(program: GpuProgram) -> dict[str, int]:
    fields = ("kernels", "variadic_reductions", "conditionals", "temp_bytes", "fresh_outputs")
    return {field: getattr(program, field) for field in fields}


if __name__ == "__main__":
    main()
