"""What every benchmark shares: the optimizers, the synthetic params, the runner of a donated
step, the interleaved timing, and the rows of results."""

import json
import math
import os
import platform
import resource
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

OPTIMIZERS = {"adam": lambda: optax.adam(1e-3), "sgd": lambda: optax.sgd(1e-3)}


def parse_count(text: str) -> int:
    text = text.strip().upper()
    multiplier = {"K": 10**3, "M": 10**6}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * multiplier)


def params_and_grads(size: int, leaves: int) -> tuple[dict, dict]:
    per_leaf = size // leaves
    keys = jax.random.split(jax.random.key(0), 2 * leaves)
    params = {
        f"layer_{i:04d}": jax.random.normal(keys[2 * i], (per_leaf,), jnp.float32) * 0.02
        for i in range(leaves)
    }
    grads = {
        f"layer_{i:04d}": jax.random.normal(keys[2 * i + 1], (per_leaf,), jnp.float32) * 1e-4
        for i in range(leaves)
    }
    return params, grads


class Runner:
    """One contender's compiled step with its own donated params and state."""

    def __init__(self, step, init, params, inputs):
        self.inputs = inputs
        self.params = fresh_buffers(params)
        self.state = init(self.params)
        start = time.perf_counter()
        jitted = jax.jit(step, donate_argnums=(0, 1))
        self.step = jitted.lower(self.params, self.state, inputs).compile()
        self.compile_seconds = time.perf_counter() - start
        self.temp_bytes = self.step.memory_analysis().temp_size_in_bytes

    def __call__(self) -> float:
        start = time.perf_counter()
        self.params, self.state = self.step(self.params, self.state, self.inputs)
        jax.block_until_ready((self.params, self.state))
        return time.perf_counter() - start


def fresh_buffers(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


def block_medians(
    runners: dict[str, Any], repeats: int, block: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per call, and page faults per call, timed block by block.

    Each round calls every runner `block` times in a row; the first call of a block,
    the one after switching programs, is not counted. Rounds go on until every runner
    has `repeats` counted calls.
    """
    for runner in runners.values():  # compile and warm up
        runner()
        runner()
    times: dict[str, list[float]] = {name: [] for name in runners}
    faults: dict[str, list[int]] = {name: [] for name in runners}
    counted = max(block - 1, 1)
    for _ in range(math.ceil(repeats / counted)):
        for name, runner in runners.items():
            runner()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(counted):
                times[name].append(runner())
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    medians = {name: statistics.median(values) for name, values in times.items()}
    per_call = {name: sum(values) / len(times[name]) for name, values in faults.items()}
    return medians, per_call


def result_row(optimizer, size, leaves, values, *, unit="s", ratios=True, skipped=None) -> dict:
    row = {"optimizer": optimizer, "params": size, "leaves": leaves, "unit": unit, "values": values}
    if ratios:
        row["ratio_to_bare"] = {name: value / values["bare"] for name, value in values.items()}
    if skipped:
        row["skipped"] = skipped
    return row


def write_results(results: dict[str, Any], path: str) -> None:
    """Writes `results` to `path` as JSON (its folder made if missing) and says so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        json.dump(results, file, indent=1)
    print(f"wrote {path}")


def default_path(prefix: str) -> str:
    """benchmarks/results/<prefix><backend>.json, where a run's results go by default."""
    return os.path.join("benchmarks", "results", f"{prefix}{jax.default_backend()}.json")


def table(case: str, rows: list[dict]) -> str:
    if not rows:
        return f"{case}: nothing to report"
    names = list(
        dict.fromkeys(name for row in rows for name in (*row["values"], *row.get("skipped", {})))
    )
    header = ["optimizer", "params", "leaves", *names]
    ratio_note = ", ratio to bare" if "ratio_to_bare" in rows[0] else ""
    lines = [f"\n## {case} ({rows[0]['unit']}{ratio_note})"]
    lines.append(" | ".join(header))
    for row in rows:
        cells = [row["optimizer"], human(row["params"]), str(row["leaves"])]
        for name in names:
            if name not in row["values"]:
                cells.append(f"skipped: {row.get('skipped', {}).get(name, 'not run')}")
                continue
            value = row["values"][name]
            notes = [f"{row['ratio_to_bare'][name]:.2f}x"] if "ratio_to_bare" in row else []
            faults = round(row.get("page_faults_per_step", {}).get(name, 0))
            if faults:  # a buffer given back to the OS and faulted in again, step after step
                notes.append(f"{faults:,} page faults")
            note = f" ({', '.join(notes)})" if notes else ""
            cells.append(f"{format_value(value, row['unit'])}{note}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def format_value(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.2f} s"
    if unit == "bytes":
        return f"{value / 2**20:.1f} MiB"
    return str(value)


def human(count: int) -> str:
    return f"{count / 1e6:g}M" if count >= 10**6 else f"{count / 1e3:g}K"


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(device) for device in jax.devices()],
    }


def command(argv: Sequence[str] | None) -> str:
    import sys

    return "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv)
