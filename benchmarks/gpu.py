"""The GPU case set of `python -m benchmarks --gpu` (DESIGN 4.1): about 3 minutes on one H100.

* `gpu_step`: the optimizer step alone (`benchmarks/contenders.py`), adam and sgd, at 8M
  params in 64 leaves and 128M in 192 (`--gpu-cells`), every contender.
* `gpu_gpt`: the float16 GPT step (`benchmarks/gpt.py`) at 43M params (6 layers of width 768,
  batch 16 x 256, adamw; `--gpu-gpt`): bare, `loss_scaled` and the peers, and `constant
  scale`, the same step with the loss times a constant 2**15 and the gradients divided by it,
  no check. That is the reference for a float16 model on a GPU, not the bare step: unscaled
  float16 gradients underflow, and underflowed data runs faster.
* `gpu_scale_sweep`: the constant-scale step with the loss times 2**-8, 2**4, 2**8, 2**12 and
  2**15 (`--gpu-sweep`), ratios to the bare step, the underflow speed-up in figures.

Each contender is timed two ways, in interleaved rounds, medians reported:

* pipelined, as a training loop runs: `--gpu-pipeline` steps dispatched, then one block,
  the time divided by the steps (`values`, `ratio_to_bare`);
* per call, each step blocked on (`per_call`, `per_call_ratio_to_bare`);

then profiled (`benchmarks/profile.py`), `--gpu-pipeline` steps pipelined under
`jax.profiler`: microseconds a step on the host (XLA:GPU's `ExecuteThunks`, of which its
command buffers') and on the device (`profile`). Run the set with
`XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true`, or XLA:GPU profiles its
command buffers' kernels one by one.

The constant scale is an argument of its one compiled step, so the sweep costs no compile.
"""

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from benchmarks import contenders as contenders_module
from benchmarks import gpt, profile
from benchmarks.measure import (
    OPTIMIZERS,
    Runner,
    fresh_buffers,
    params_and_grads,
    parse_count,
    result_row,
)

CASES = ("gpu_step", "gpu_gpt", "gpu_scale_sweep")
DEFAULT_PATH = "benchmarks/results/gpu-h100.json"
GPT_CONTENDERS = ("bare", "DynamicLossScale", "jmp", "flax", "optax.apply_if_finite")
CONSTANT_SCALE = 2.0**15


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--gpu",
        action="store_true",
        help=f"run the GPU case set ({', '.join(CASES)}) instead of --cases, written to "
        f"{DEFAULT_PATH} unless --json says otherwise",
    )
    parser.add_argument(
        "--gpu-cells", default="8M/64,128M/192", help="params/leaves of the gpu_step case"
    )
    parser.add_argument(
        "--gpu-gpt",
        default="6x768x256x16",
        help="layers x width x sequence x batch [x heads] of the gpu_gpt case (by default, heads "
        "of 64 wide)",
    )
    parser.add_argument(
        "--gpu-sweep", default="-8,4,8,12,15", help="the sweep's loss scales, powers of two"
    )
    parser.add_argument("--gpu-pipeline", type=int, default=20, help="steps per pipelined run")
    parser.add_argument("--gpu-rounds", type=int, default=5, help="interleaved timing rounds")


def run_gpu(args: Any) -> dict[str, list[dict]]:
    """Every case of the set, keyed by case name."""
    return {"gpu_step": gpu_step(args), **gpu_gpt(args)}


def gpu_step(args: Any) -> list[dict]:
    rows = []
    for optimizer in args.optimizers:
        for cell in args.gpu_cells.split(","):
            size, leaves = cell.split("/")
            size, leaves = parse_count(size), int(leaves)
            params, grads = params_and_grads(size, leaves)
            scaled = jax.tree.map(lambda g: g * contenders_module.LOSS_SCALE, grads)
            runners = {}
            for make in contenders_module.ALL:
                contender = make(OPTIMIZERS[optimizer]())
                inputs = scaled if contender.scales_loss else grads
                runner = Runner(contender.optimizer_step, contender.init, params, inputs)
                runners[contender.name] = _Pipelined(
                    runner.step, (runner.params, runner.state), inputs
                )
            rows.append(_timed_row(optimizer, size, leaves, runners, args))
            del runners
    return rows


def gpu_gpt(args: Any) -> dict[str, list[dict]]:
    layers, width, seq, batch, *heads = (int(n) for n in args.gpu_gpt.split("x"))
    heads = heads[0] if heads else max(width // 64, 1)
    size = gpt.Size(layers=layers, width=width, heads=heads, seq=seq, batch=batch)
    tokens, vocab = gpt.stdlib_text()
    inputs, targets = next(gpt.batches(tokens, size))
    everything = gpt.all_contenders()
    runners: dict[str, _Pipelined] = {}
    for name in GPT_CONTENDERS:
        step, state = everything[name].build(size, vocab)
        compiled = jax.jit(step, donate_argnums=0).trace(state, inputs, targets).lower().compile()
        runners[name] = _Pipelined(compiled, state, (inputs, targets), returns_loss=True)
    step, state = constant_scale_step(size, vocab)
    compiled = jax.jit(step, donate_argnums=0).lower(state, jnp.float32(1), inputs, targets)
    compiled = compiled.compile()
    scales = {f"constant scale 2**{int(e)}": 2.0 ** float(e) for e in args.gpu_sweep.split(",")}

    def at_scale(scale: float) -> _Pipelined:
        fresh = fresh_buffers(state)
        return _Pipelined(compiled, fresh, (jnp.float32(scale), inputs, targets), True)

    runners["constant scale"] = at_scale(CONSTANT_SCALE)
    params, leaves = gpt.parameter_count(state)
    name = f"adamw, {layers}x{width}, batch {batch}x{seq}"
    gpt_row = _timed_row(name, params, leaves, runners, args)
    sweep_runners = {"bare": runners["bare"]}
    sweep_runners.update({label: at_scale(scale) for label, scale in scales.items()})
    sweep_row = _timed_row(name, params, leaves, sweep_runners, args)
    return {"gpu_gpt": [gpt_row], "gpu_scale_sweep": [sweep_row]}


def constant_scale_step(size: gpt.Size, vocab: int) -> tuple[Any, Any]:
    """The GPT step with the loss times `scale` (an argument) and the gradients divided by
    it, no check and no skip: `(state, scale, inputs, targets) -> (state, loss)`."""
    graphdef, state = gpt.train_state(size, vocab, gpt.adamw())

    def train_step(state, scale, inputs, targets):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            loss = optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()
            return loss * scale, loss

        grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
        grads = jax.tree.map(lambda g: g / scale, grads)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return train_step, state


class _Pipelined:
    """A compiled step `(state, *inputs) -> (state, ...)` with its state donated from call to
    call, timed pipelined (`steps` dispatched, one block) or per call."""

    def __init__(self, compiled, state, inputs, returns_loss: bool = False):
        self.compiled, self.state, self.returns_loss = compiled, state, returns_loss
        self.inputs = inputs if isinstance(inputs, tuple) else (inputs,)

    def _step(self) -> Any:
        if self.returns_loss:  # (state, loss)
            self.state, out = self.compiled(self.state, *self.inputs)
        else:  # (params, state) from (params, state, grads)
            self.state = self.compiled(*self.state, *self.inputs)
            out = None
        return out

    def pipelined(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            out = self._step()
        jax.block_until_ready((self.state, out))
        return (time.perf_counter() - start) / steps

    def per_call(self, steps: int) -> float:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            jax.block_until_ready((self._step(), self.state))
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def _timed_row(optimizer, size, leaves, runners: dict[str, _Pipelined], args) -> dict:
    for runner in runners.values():  # warm up
        runner.pipelined(2)
    pipelined: dict[str, list[float]] = {name: [] for name in runners}
    per_call: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.gpu_rounds):
        for name, runner in runners.items():
            runner.pipelined(1)  # the first call after a switch is not counted
            pipelined[name].append(runner.pipelined(args.gpu_pipeline))
            per_call[name].append(runner.per_call(max(args.gpu_pipeline // 4, 1)))
    medians = {name: statistics.median(values) for name, values in pipelined.items()}
    row = result_row(optimizer, size, leaves, medians)
    calls = {name: statistics.median(values) for name, values in per_call.items()}
    row["per_call"] = calls
    row["per_call_ratio_to_bare"] = {name: value / calls["bare"] for name, value in calls.items()}
    row["profile"] = {
        name: profile.per_step(runner.pipelined, args.gpu_pipeline)
        for name, runner in runners.items()
    }
    return row


def profile_table(case: str, rows: list[dict]) -> str:
    """The profiled microseconds a step of each contender: host, command buffers, device."""
    lines = [f"\n## {case}: host / command buffers / device, us a step (jax.profiler)"]
    for row in rows:
        cells = []
        for name, times in row["profile"].items():
            figures = [times[key] for key in ("host_us", "command_buffer_us", "device_us")]
            shown = " / ".join("-" if value is None else f"{value:.0f}" for value in figures)
            cells.append(f"{name} {shown}")
        lines.append(f"{row['optimizer']} | " + " | ".join(cells))
    return "\n".join(lines)
