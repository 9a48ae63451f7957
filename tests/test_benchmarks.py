"""The benchmark runner runs end to end on a tiny size, so it cannot rot (no timings checked)."""

import importlib.util
import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from benchmarks import gpt, profile, run

CONTENDERS = ["bare", "jax_lossscale", "jmp", "flax", "optax.apply_if_finite"]
GPT_CONTENDERS = [
    "bare", "DynamicLossScale", "DynamicLossScale, spike skipping", "FixedLossScale",
    "jmp", "flax", "optax.apply_if_finite",
    *(["mpx"] if importlib.util.find_spec("mpx") else []),  # mixed-precision-for-JAX, optional
]  # fmt: skip


# A GPT of no block (6 leaves: the embeddings, the final LayerNorm, the output projection):
# the runner's GPT case and the contenders' test below compile each of the 7 contenders, and
# XLA's compile time grows with the blocks (about 2 s a contender with one block). Blocks train
# in tests/test_integrations.py and tests/test_value_and_grad.py; the sizes the README names
# are checked below.
TINY_GPT = gpt.Size(layers=0, width=32, heads=2, seq=32, batch=1)


def test_runner_writes_every_case_as_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(gpt.SIZES, "6 leaves", TINY_GPT)
    path = tmp_path / "results.json"
    argv = [
        "--optimizers", "adam", "--sizes", "256", "--leaves", "4", "--repeats", "2", "--block", "2",
        "--compile-leaves", "4,8", "--compile-repeats", "1", "--mlp-width", "16",
        "--mlp-depth", "2", "--mlp-batch", "4", "--gpt-sizes", "6 leaves", "--gpt-batch", "1",
        "--json", str(path),
    ]  # fmt: skip
    results = run.main(argv)
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    assert list(results["cases"]) == [
        "gpt_step", "gpt_compile", "gpt_memory", "step", "mlp", "compile", "memory", "traces",
    ]  # fmt: skip
    synthetic = {case: rows for case, rows in results["cases"].items() if "gpt" not in case}
    for case, rows in synthetic.items():
        assert {row["optimizer"] for row in rows} == {"adam"}, case  # sgd: the GPU case set's
        for row in rows:
            assert list(row["values"]) == CONTENDERS, (case, row)
    assert [(row["optimizer"], row["leaves"]) for row in results["cases"]["compile"]] == [
        ("adam", 4), ("adam", 8),
    ]  # fmt: skip
    for row in results["cases"]["compile"]:
        assert list(row["trace_seconds"]) == CONTENDERS
        for name, seconds in row["trace_seconds"].items():
            assert 0 < seconds < row["values"][name], name
    for row in results["cases"]["traces"]:
        assert row["values"]["jax_lossscale"] == 1
        assert row["values"]["bare"] == 1
    for case in ("step", "gpt_step", "gpt_compile", "gpt_memory"):
        for row in results["cases"][case]:
            assert row["ratio_to_bare"]["bare"] == 1.0
            assert all(value > 0 for value in row["values"].values())
    for case in ("gpt_step", "gpt_compile", "gpt_memory"):
        [row] = results["cases"][case]
        assert row["optimizer"] == "adamw, 6 leaves"
        assert row["leaves"] == 6
        assert list(row["values"]) == GPT_CONTENDERS
        assert list(row["ratio_to_bare"]) == GPT_CONTENDERS
        assert row["ratio_to_bare"]["bare"] == 1.0
        for name, ratio in row["ratio_to_bare"].items():
            assert ratio == row["values"][name] / row["values"]["bare"] > 0, (case, name)
    assert "page_faults_per_step" in results["cases"]["gpt_step"][0]
    printed = capsys.readouterr().out
    assert "## step (s, ratio to bare)" in printed
    assert "## gpt_step (s, ratio to bare)" in printed
    assert "optimizer | params | leaves | bare | jax_lossscale" in printed


def test_the_gpt_sizes_are_the_ones_the_readme_names():
    tokens, vocab = gpt.stdlib_text(max_bytes=200_000)
    assert tokens.min() == 0
    assert tokens.max() == vocab - 1
    for name, leaves, (low, high) in [
        ("70 leaves", 70, (0.8e6, 0.9e6)),
        ("294 leaves", 294, (0.85e6, 0.95e6)),
    ]:
        # The state's shapes alone: the parameters counted without initialising them.
        state = jax.eval_shape(
            lambda name=name: gpt.train_state(gpt.SIZES[name], 100, gpt.contenders()["bare"]())[1]
        )
        params, counted = gpt.parameter_count(state)
        assert counted == leaves
        assert low < params < high, (name, params)


def test_the_default_json_path_names_the_platform(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run.main(["--cases", "traces", "--optimizers", "sgd"])
    written = json.loads((tmp_path / "benchmarks" / "results" / "cpu.json").read_text())
    assert written["machine"]["backend"] == "cpu"
    assert list(written["cases"]) == ["traces"]


def test_every_gpt_contender_trains_alike_and_the_skipping_ones_skip_a_non_finite_step():
    """From the same model, two finite batches, then one whose first token is out of the
    vocabulary: `nnx.Embed` (`jnp.take`, mode "fill") embeds it as NaN, so that
    position's logits, the loss and the output projection's gradients are NaN. Every contender that
    skips non-finite steps (all but bare adamw and a `FixedLossScale`, which applies them by
    design) keeps the model bit-identical across that step; on the finite steps, the
    losses of all contenders agree to float16 rounding."""
    tokens, vocab = gpt.stdlib_text()  # the runner's: the same programs, compiled once
    size = TINY_GPT
    stream = gpt.batches(tokens, size)
    batches = [next(stream), next(stream)]
    inputs, targets = next(stream)
    batches.append((inputs.at[:, 0].set(vocab), targets))
    contenders = gpt.all_contenders()
    assert list(contenders) == GPT_CONTENDERS
    losses, initial = {}, {}
    for name, contender in contenders.items():
        train_step, state = contender.build(size, vocab)
        step = jax.jit(train_step, donate_argnums=0)
        models, losses[name] = [], []
        for inputs, targets in batches:
            models.append([np.array(leaf) for leaf in jax.tree.leaves(state[0])])
            state, loss = step(state, inputs, targets)
            losses[name].append(float(loss))
        models.append([np.array(leaf) for leaf in jax.tree.leaves(state[0])])
        assert step._cache_size() == 1, name  # the state comes back with the types it went in
        initial[name] = models[0]
        assert not all(map(np.array_equal, models[1], models[2])), name  # it trained
        assert not np.isfinite(losses[name][2]), name
        kept = all(np.array_equal(a, b) for a, b in zip(models[2], models[3], strict=True))
        assert kept == contender.skips_non_finite, name
    for name, model in initial.items():  # the same model for everyone
        assert all(np.array_equal(a, b) for a, b in zip(model, initial["bare"], strict=True)), name
    reference = np.array(losses["bare"][:2])
    for name, values in losses.items():
        np.testing.assert_allclose(values[:2], reference, rtol=2**-10, err_msg=name)


def test_the_bf16_weights_benchmark_runs_its_four_contenders(tmp_path, capsys):
    from benchmarks import bf16_weights

    path = tmp_path / "bf16.json"
    argv = ["--steps", "6", "--block", "3", "--batch", "4", "--context", "4", "--embed", "4",
            "--hidden", "8", "--step-sizes", "8K", "--step-repeats", "2",
            "--json", str(path)]  # fmt: skip
    results = bf16_weights.main(argv)
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    rows = {row["contender"]: row for row in results["rows"]}
    assert list(rows) == list(bf16_weights.CONTENDERS)
    # params and adamw's moments, plus the scalars (adamw's count, the key) spread thin
    bytes_per_param = [row["bytes_per_param"] for row in rows.values()]
    assert bytes_per_param == pytest.approx([12.0, 6.0, 6.0, 8.0], abs=0.02)
    assert rows["float32 master"]["loss_ratio_to_master"] == 1.0
    assert rows["bf16 nearest"]["time_ratio_to_nearest"] == 1.0
    assert all(row["final_loss"] > 0 and row["step_seconds"] > 0 for row in rows.values())
    assert results["command"].startswith("python -m benchmarks bf16-weights --steps 6")
    assert "bf16 + stochastic_rounding |" in capsys.readouterr().out
    steps = {(row["grads"], row["contender"]): row for row in results["optimizer_step"]}
    assert list(steps) == [
        (grads, contender)
        for grads in ("bfloat16", "float32")
        for contender in bf16_weights.CONTENDERS[1:]
    ]
    assert {row["params"] for row in steps.values()} == {8000}
    assert steps["bfloat16", "bf16 nearest"]["time_ratio_to_nearest"] == 1.0
    assert steps["float32", "bf16 nearest"]["time_ratio_to_nearest"] == 1.0


def test_the_low_precision_state_benchmark_runs_its_four_contenders(tmp_path, capsys):
    from benchmarks import low_precision_state

    path = tmp_path / "state.json"
    argv = ["--steps", "6", "--block", "3", "--batch", "4", "--context", "4", "--embed", "4",
            "--hidden", "8", "--step-sizes", "8K", "--step-repeats", "2", "--decoder-steps", "2",
            "--decoder-layers", "0", "--decoder-width", "8", "--decoder-seq", "8",
            "--decoder-batch", "2", "--json", str(path)]  # fmt: skip
    results = low_precision_state.main(argv)
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    rows = {row["contender"]: row for row in results["rows"]}
    assert list(rows) == list(low_precision_state.CONTENDERS)
    # params, buffer and adamw's moments: 4 + 8, 2 + 2 + 8, 2 + 2 + 4 (scalars spread thin)
    bytes_per_param = [row["bytes_per_param"] for row in rows.values()]
    assert bytes_per_param == pytest.approx([12.0, 12.0, 8.0, 8.0], abs=0.05)
    assert rows["float32 master"]["loss_ratio_to_master"] == 1.0
    assert rows["bf16 + kahan, bf16 state nearest"]["time_ratio_to_nearest"] == 1.0
    assert all(row["final_loss"] > 0 and row["step_seconds"] > 0 for row in rows.values())
    assert results["command"].startswith("python -m benchmarks.low_precision_state --steps 6")
    printed = capsys.readouterr().out
    assert "bf16 state stochastic" in printed
    assert "## the GPT-style decoder" in printed
    assert {row["params"] for row in results["optimizer_step"]} == {8000}
    decoder = results["decoder"]
    assert decoder["model"]["leaves"] == 6  # embed, positions, the norm's 2, the head's 2
    rows = {row["contender"]: row for row in decoder["rows"]}
    assert list(rows) == list(low_precision_state.CONTENDERS)
    assert [row["bytes_per_param"] for row in rows.values()] == pytest.approx(
        [12.0, 12.0, 8.0, 8.0], abs=0.05
    )
    assert all(row["final_loss"] > 0 for row in rows.values())


def test_the_rl_benchmark_runs_its_mismatch_and_grpo_cases(tmp_path, capsys, monkeypatch):
    from benchmarks import rl

    monkeypatch.setattr(rl, "DTYPES", {"float32": np.float32, "float16": np.float16})  # 2 of 3
    path = tmp_path / "rl.json"
    argv = ["--width", "16", "--layers", "1", "--heads", "2", "--digits", "2", "--batches", "4",
            "--train-steps", "2", "--grpo-steps", "2", "--seeds", "0", "--groups", "2",
            "--group-size", "2", "--increment-periods", "2000", "--no-subprocess",
            "--json", str(path)]  # fmt: skip
    results = rl.main(argv)
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    assert results["command"].startswith("python -m benchmarks rl --width 16")
    mismatch = results["mismatch"]["default"]
    assert list(mismatch) == [
        "supervised_loss", "init, float32 islands", "trained, float32 islands",
        "init, all in the compute dtype", "trained, all in the compute dtype",
    ]  # fmt: skip
    for stage in list(mismatch)[1:]:
        assert list(mismatch[stage]["4"]) == ["float32", "float16"]
        assert mismatch[stage]["4"]["float32"]["trainer_vs_float32"]["mean_abs"] == 0.0
    assert list(results["grpo"]) == ["float32", "float16, increment_period=2000"]
    [run] = results["grpo"]["float16, increment_period=2000"]["runs"].values()
    assert run["traces"] == {"sampler": 1, "train": 1}
    assert run["loss_scale"] == [2.0**15, 2.0**15]
    assert "## mismatch, init, float32 islands, batch 4, XLA flags: default" in (
        capsys.readouterr().out
    )


def test_the_gpu_case_set_runs_every_contender_pipelined_and_per_call(tmp_path, capsys):
    """`python -m benchmarks --gpu` at a tiny size, on the CPU: the optimizer steps, the GPT
    step with the constant-scale reference, and the scale sweep, each timed two ways. (The
    GPT is the runner's test's above, whose compiled programs the run's cache holds; the
    optimizer step is sgd's, which that test leaves out.)"""
    path = tmp_path / "gpu.json"
    argv = [
        "--gpu", "--optimizers", "sgd", "--gpu-cells", "4K/4", "--gpu-gpt", "0x32x32x1x2",
        "--gpu-sweep=-8,15", "--gpu-pipeline", "2", "--gpu-rounds", "1", "--json", str(path),
    ]  # fmt: skip
    results = run.main(argv)
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    assert list(results["cases"]) == ["gpu_step", "gpu_gpt", "gpu_scale_sweep"]
    [step] = results["cases"]["gpu_step"]
    assert (step["optimizer"], step["params"], step["leaves"]) == ("sgd", 4000, 4)
    assert list(step["values"]) == CONTENDERS
    [gpt_row] = results["cases"]["gpu_gpt"]
    assert list(gpt_row["values"]) == [
        "bare", "DynamicLossScale", "jmp", "flax", "optax.apply_if_finite", "constant scale",
    ]  # fmt: skip
    [sweep] = results["cases"]["gpu_scale_sweep"]
    assert list(sweep["values"]) == ["bare", "constant scale 2**-8", "constant scale 2**15"]
    for row in (step, gpt_row, sweep):
        assert row["ratio_to_bare"]["bare"] == row["per_call_ratio_to_bare"]["bare"] == 1.0
        assert all(value > 0 for value in [*row["values"].values(), *row["per_call"].values()])
        assert list(row["profile"]) == list(row["values"])
        for times in row["profile"].values():  # on the CPU: PjRt's execution, no device
            assert times["host_event"] == "ExecuteHelper"
            assert times["host_us"] > 0
            assert times["command_buffer_us"] is times["device_us"] is None
    printed = capsys.readouterr().out
    assert "## gpu_scale_sweep (s, ratio to bare)" in printed
    assert "## gpu_step: host / command buffers / device, us a step (jax.profiler)" in printed


def test_the_profile_reads_xla_gpus_host_and_device_events_a_step():
    def plane(name, lines):
        return SimpleNamespace(
            name=name, lines=[SimpleNamespace(name=line, events=events) for line, events in lines]
        )

    def events(*pairs):
        return [SimpleNamespace(name=name, duration_ns=ns) for name, ns in pairs]

    thunks, buffer = "GpuExecutable::ExecuteThunks", "command_buffer_1"
    host = plane("/host:CPU", [
        ("python", events(("PjitFunction(step)", 50_000),
                          ("CommonPjRtLoadedExecutable::ExecuteHelper", 300_000))),
        ("executor", events((thunks, 240_000), (buffer, 210_000),
                            (thunks, 244_000), (buffer, 214_000))),
    ])  # fmt: skip
    device = plane("/device:GPU:0", [
        ("XLA Ops", events(("fusion.1", 99_000))),  # the same kernels again, by op: not counted
        ("Stream #13(Compute)", events(("loop_add_fusion", 100_000), ("reduce", 60_000),
                                       ("loop_add_fusion", 100_000), ("reduce", 78_000))),
    ])  # fmt: skip
    times = profile.times_per_step(SimpleNamespace(planes=[host, device]), steps=2)
    assert times == {
        "host_event": "GpuExecutable::ExecuteThunks",
        "host_us": 242.0,
        "command_buffer_us": 212.0,
        "device_us": 169.0,
    }


def test_the_gpu_case_set_writes_gpu_h100_json_by_default():
    from benchmarks import gpu

    assert gpu.DEFAULT_PATH == "benchmarks/results/gpu-h100.json"
    args = run._parse(["--gpu"])
    assert (args.gpu_cells, args.gpu_gpt, args.gpu_sweep) == (
        "8M/64,128M/192", "6x768x256x16", "-8,4,8,12,15",
    )  # fmt: skip


def test_the_table_shows_page_faults_beside_a_ratio_where_a_step_took_them():
    from benchmarks import measure

    row = {
        "optimizer": "adam", "params": 8_000_000, "leaves": 64, "unit": "s",
        "values": {"bare": 0.0076, "jax_lossscale": 0.0175},
        "ratio_to_bare": {"bare": 1.0, "jax_lossscale": 2.3},
        "page_faults_per_step": {"bare": 0.4, "jax_lossscale": 7815.2},
    }  # fmt: skip
    assert measure.table("step", [row]).splitlines()[-1] == (
        "adam | 8M | 64 | 7.60 ms (1.00x) | 17.50 ms (2.30x, 7,815 page faults)"
    )
    no_faults = {key: value for key, value in row.items() if key != "page_faults_per_step"}
    assert measure.table("step", [no_faults]).splitlines()[-1] == (
        "adam | 8M | 64 | 7.60 ms (1.00x) | 17.50 ms (2.30x)"
    )
    memory = {**no_faults, "unit": "bytes", "values": {"bare": 0, "jax_lossscale": 2 * 2**20}}
    del memory["ratio_to_bare"]
    last_line = measure.table("memory", [memory]).splitlines()[-1]
    assert last_line == "adam | 8M | 64 | 0.0 MiB | 2.0 MiB"
