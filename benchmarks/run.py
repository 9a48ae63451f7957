"""The benchmark runner: `python -m benchmarks --help`.

Every case runs all contenders in the same process, with params and optimizer state
donated as in real training, and reports medians and their ratios to the bare optimizer
measured in the same run. Steps are timed as a training process runs them: each
contender's compiled step is called `--block` times in a row (the first call after a
switch is not counted), and the contenders take turns block by block, so that no figure
depends on which program ran just before. The page faults per step are recorded beside.
"""

import argparse
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import contenders as contenders_module
from benchmarks import gpt, gpu
from benchmarks.measure import (
    OPTIMIZERS,
    Runner,
    block_medians,
    command,
    default_path,
    machine,
    params_and_grads,
    parse_count,
    result_row,
    table,
    write_results,
)

CASES = ("gpt", "step", "mlp", "compile", "memory", "traces")


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parse(argv)
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    results: dict[str, Any] = {"machine": machine(), "command": command(argv), "cases": {}}
    if args.gpu:  # the GPU case set, benchmarks/gpu.py
        for name, rows in gpu.run_gpu(args).items():
            results["cases"][name] = rows
            print(table(name, rows), gpu.profile_table(name, rows), sep="\n", flush=True)
        write_results(results, args.json or gpu.DEFAULT_PATH)
        return results
    for case in args.cases:
        output = CASE_RUNNERS[case](args)
        for name, rows in (output if isinstance(output, dict) else {case: output}).items():
            results["cases"][name] = rows
            print(table(name, rows), flush=True)
    write_results(results, args.json or default_path(""))
    return results


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument(
        "--platform",
        default=None,
        help="the JAX platform to run on (cpu, gpu, tpu); default: JAX's own choice",
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {CASES}")
    parser.add_argument("--optimizers", default="adam,sgd", help="comma-separated, of adam, sgd")
    parser.add_argument("--sizes", default="1M,8M,64M", help="parameter counts for the step case")
    parser.add_argument("--leaves", default="16,64,1024", help="leaf counts for the step case")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per contender")
    parser.add_argument(
        "--block", type=int, default=10, help="calls of one contender in a row (one uncounted)"
    )
    parser.add_argument(
        "--compile-leaves", default="16,64,256,1024", help="leaf counts for the compile case"
    )
    parser.add_argument("--compile-repeats", type=int, default=5)
    parser.add_argument("--mlp-width", type=int, default=1024)
    parser.add_argument("--mlp-depth", type=int, default=4)
    parser.add_argument("--mlp-batch", type=int, default=256)
    parser.add_argument(
        "--compile-budget",
        type=float,
        default=60.0,
        help="skip a contender at a leaf count where its compile would take longer than this "
        "many seconds, extrapolated as leaves**1.5 from a smaller leaf count",
    )
    parser.add_argument(
        "--gpt-sizes",
        default=",".join(gpt.SIZES),
        help=f"comma-separated, of {', '.join(gpt.SIZES)}",
    )
    parser.add_argument(
        "--gpt-batch", type=int, default=None, help="sequences per GPT step (default 16)"
    )
    parser.add_argument(
        "--json",
        default=None,
        help="where to write JSON (default: benchmarks/results/<platform>.json)",
    )
    gpu.add_arguments(parser)
    args = parser.parse_args(argv)
    args.cases = _split(args.cases, CASES)
    args.optimizers = _split(args.optimizers, tuple(OPTIMIZERS))
    args.sizes = [parse_count(size) for size in args.sizes.split(",")]
    args.leaves = [int(leaves) for leaves in args.leaves.split(",")]
    args.compile_leaves = [int(leaves) for leaves in args.compile_leaves.split(",")]
    args.gpt_sizes = [size.strip() for size in args.gpt_sizes.split(",") if size.strip()]
    for size in args.gpt_sizes:
        if size not in gpt.SIZES:
            raise SystemExit(f"unknown GPT size {size!r}; expected some of {', '.join(gpt.SIZES)}")
    return args


def _split(text: str, allowed: tuple[str, ...]) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    for item in items:
        if item not in allowed:
            raise SystemExit(f"unknown choice {item!r}; expected some of {', '.join(allowed)}")
    return items


# --- the cases ------------------------------------------------------------------------------


def run_step(args) -> list[dict]:
    """The optimizer step alone: `update` then `optax.apply_updates`, jitted and donated."""
    rows = []
    budget = _CompileBudget(args.compile_budget)
    for optimizer in args.optimizers:
        for size in args.sizes:
            for leaves in sorted(args.leaves):
                params, grads = params_and_grads(size, leaves)
                scaled = jax.tree.map(lambda g: g * contenders_module.LOSS_SCALE, grads)
                runners, skipped = {}, {}
                for contender in _contenders(optimizer):
                    estimate = budget.estimate(contender.name, leaves)
                    if estimate is not None:
                        skipped[contender.name] = f"compile would take ~{estimate:.0f} s"
                        continue
                    inputs = scaled if contender.scales_loss else grads
                    runner = Runner(contender.optimizer_step, contender.init, params, inputs)
                    budget.record(contender.name, leaves, runner.compile_seconds)
                    runners[contender.name] = runner
                medians, faults = block_medians(runners, args.repeats, args.block)
                row = result_row(optimizer, size, leaves, medians, skipped=skipped)
                rows.append({**row, "page_faults_per_step": faults})
                del runners
    return rows


def run_mlp(args) -> list[dict]:
    """A full float16 training step of an MLP with float32 master params."""
    rows = []
    for optimizer in args.optimizers:
        params, batch = mlp(args.mlp_width, args.mlp_depth, args.mlp_batch)
        runners = {}
        for contender in _contenders(optimizer):
            step = functools.partial(mlp_train_step, contender.train_step)
            runners[contender.name] = Runner(step, contender.init, params, batch)
        medians, faults = block_medians(runners, args.repeats, args.block)
        size = sum(leaf.size for leaf in jax.tree.leaves(params))
        row = result_row(optimizer, size, len(jax.tree.leaves(params)), medians)
        rows.append({**row, "page_faults_per_step": faults})
    return rows


def run_compile(args) -> list[dict]:
    """Seconds to trace, lower and compile the donated step, at each of `--compile-leaves`,
    and of those the trace's (`trace_seconds`)."""
    rows = []
    budget = _CompileBudget(args.compile_budget)
    for optimizer in args.optimizers:
        for leaves in sorted(args.compile_leaves):
            params, grads = params_and_grads(leaves * 64, leaves)
            times: dict[str, list[float]] = {}
            traces: dict[str, list[float]] = {}  # of those seconds, the trace's
            skipped = {}
            for _ in range(args.compile_repeats):
                for contender in _contenders(optimizer):
                    estimate = budget.estimate(contender.name, leaves)
                    if estimate is not None:
                        skipped[contender.name] = f"compile would take ~{estimate:.0f} s"
                        continue
                    jax.clear_caches()
                    state = jax.eval_shape(contender.init, params)
                    start = time.perf_counter()
                    step = jax.jit(contender.optimizer_step, donate_argnums=(0, 1))
                    traced = step.trace(params, state, grads)
                    traces.setdefault(contender.name, []).append(time.perf_counter() - start)
                    traced.lower().compile()
                    seconds = time.perf_counter() - start
                    times.setdefault(contender.name, []).append(seconds)
                    budget.record(contender.name, leaves, seconds)
            medians = {name: statistics.median(values) for name, values in times.items()}
            row = result_row(optimizer, leaves * 64, leaves, medians, skipped=skipped)
            row["trace_seconds"] = {name: statistics.median(v) for name, v in traces.items()}
            rows.append(row)
    return rows


def run_memory(args) -> list[dict]:
    """XLA's temp buffer size for the compiled, donated optimizer step."""
    rows = []
    for optimizer in args.optimizers:
        for size in args.sizes:
            leaves = 64 if 64 in args.leaves else args.leaves[0]
            params, grads = params_and_grads(size, leaves)
            temp = {}
            for contender in _contenders(optimizer):
                state = jax.eval_shape(contender.init, params)
                compiled = (
                    jax.jit(contender.optimizer_step, donate_argnums=(0, 1))
                    .lower(params, state, grads)
                    .compile()
                )
                temp[contender.name] = compiled.memory_analysis().temp_size_in_bytes
            row = result_row(optimizer, size, leaves, temp, unit="bytes", ratios=False)
            row["gradient_bytes"] = size * 4
            rows.append(row)
    return rows


def run_traces(args) -> list[dict]:
    """How often each contender's jitted step is traced over 100 steps with overflows."""
    rows = []
    for optimizer in args.optimizers:
        params, grads = params_and_grads(4096, 16)
        counts = {}
        for contender in _contenders(optimizer):
            count = [0]

            def counted(p, s, g, step=contender.optimizer_step, count=count):
                count[0] += 1
                return step(p, s, g)

            step = jax.jit(counted, donate_argnums=(0, 1))
            p = jax.tree.map(jnp.copy, params)
            s = contender.init(p)
            for index in range(100):
                factor = np.float32(np.inf) if index % 10 == 3 else np.float32(1.0)
                p, s = step(p, s, jax.tree.map(lambda g, f=factor: g * f, grads))
            counts[contender.name] = count[0]
        rows.append(result_row(optimizer, 4096, 16, counts, unit="traces", ratios=False))
    return rows


def run_gpt(args) -> dict[str, list[dict]]:
    """A GPT-style decoder's float16 train step (`benchmarks/gpt.py`), bare adamw against
    `loss_scaled` and the peers (`gpt.all_contenders`): step time, trace + lower + compile
    time and XLA temp memory, each contender with its own train step and state."""
    tokens, vocab = gpt.stdlib_text()
    cases: dict[str, list[dict]] = {"gpt_step": [], "gpt_compile": [], "gpt_memory": []}
    for name in args.gpt_sizes:
        size = gpt.SIZES[name]
        if args.gpt_batch:
            size = dataclasses.replace(size, batch=args.gpt_batch)
        inputs, targets = next(gpt.batches(tokens, size))
        built = {
            name: contender.build(size, vocab) for name, contender in gpt.all_contenders().items()
        }
        compile_times: dict[str, list[float]] = {contender: [] for contender in built}
        compiled = {}  # each contender's last compile, which its runner then steps
        for _ in range(args.compile_repeats):  # the contenders take turns
            for contender, (step, state) in built.items():
                jax.clear_caches()
                start = time.perf_counter()
                jitted = jax.jit(step, donate_argnums=0)
                compiled[contender] = jitted.trace(state, inputs, targets).lower().compile()
                compile_times[contender].append(time.perf_counter() - start)
        runners, temp = {}, {}
        for contender, (_, state) in built.items():
            runners[contender] = _GptRunner(compiled[contender], state, inputs, targets)
            temp[contender] = runners[contender].temp_bytes
        medians, faults = block_medians(runners, args.repeats, args.block)
        params, leaves = gpt.parameter_count(built["bare"][1])
        gpt_row = functools.partial(result_row, f"adamw, {name}", params, leaves)
        cases["gpt_step"].append({**gpt_row(medians), "page_faults_per_step": faults})
        cases["gpt_compile"].append(
            gpt_row({contender: statistics.median(t) for contender, t in compile_times.items()})
        )
        cases["gpt_memory"].append(gpt_row(temp, unit="bytes"))
    return cases


CASE_RUNNERS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "gpt": run_gpt,
    "step": run_step,
    "mlp": run_mlp,
    "compile": run_compile,
    "memory": run_memory,
    "traces": run_traces,
}


# --- measurement ----------------------------------------------------------------------------


class _GptRunner:
    """One contender's compiled GPT train step (jitted with its state donated), the state
    donated from call to call."""

    def __init__(self, compiled, state, inputs, targets):
        self.state, self.batch = state, (inputs, targets)
        self.step = compiled
        self.temp_bytes = self.step.memory_analysis().temp_size_in_bytes

    def __call__(self) -> float:
        start = time.perf_counter()
        self.state, loss = self.step(self.state, *self.batch)
        jax.block_until_ready((self.state, loss))
        return time.perf_counter() - start


class _CompileBudget:
    """Skips contenders whose compile time, growing with the leaf count, would exceed a budget.

    The growth is extrapolated as a power of the leaf count, its exponent fitted to the
    contender's last two measurements at different leaf counts (1.5 until there are two).
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.measured: dict[str, dict[int, float]] = {}

    def record(self, name: str, leaves: int, seconds: float) -> None:
        self.measured.setdefault(name, {})[leaves] = seconds

    def estimate(self, name: str, leaves: int) -> float | None:
        """The extrapolated compile time if it is over budget, else None."""
        points = sorted(self.measured.get(name, {}).items())
        if not points or points[-1][0] >= leaves:
            return None
        exponent = 1.5
        if len(points) >= 2:
            (few, few_seconds), (many, many_seconds) = points[-2:]
            exponent = max(math.log(many_seconds / few_seconds) / math.log(many / few), 1.0)
        measured_leaves, seconds = points[-1]
        estimate = seconds * (leaves / measured_leaves) ** exponent
        return estimate if estimate > self.seconds else None


def _contenders(optimizer: str) -> list[contenders_module.Contender]:
    return [make(OPTIMIZERS[optimizer]()) for make in contenders_module.ALL]


def mlp(width: int, depth: int, batch: int) -> tuple[dict, tuple]:
    keys = jax.random.split(jax.random.key(1), depth + 2)
    params = {
        f"dense_{i}": {
            "w": jax.random.normal(keys[i], (width, width), jnp.float32) / np.sqrt(width),
            "b": jnp.zeros((width,), jnp.float32),
        }
        for i in range(depth)
    }
    x = jax.random.normal(keys[-2], (batch, width), jnp.float32)
    y = jax.random.normal(keys[-1], (batch, width), jnp.float32)
    return params, (x, y)


def mlp_train_step(train_step, params, state, batch):
    return train_step(params, state, mlp_loss, batch)


def mlp_loss(params: dict, batch: tuple) -> jax.Array:
    x, y = batch
    h = x.astype(jnp.float16)
    for index, layer in enumerate(params.values()):
        h = h @ layer["w"].astype(jnp.float16) + layer["b"].astype(jnp.float16)
        if index < len(params) - 1:
            h = jax.nn.relu(h)
    return jnp.mean((h.astype(jnp.float32) - y) ** 2)
