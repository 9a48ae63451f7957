"""The benchmark runner runs end to end on a tiny size, so it cannot rot (no timings checked)."""

import json

from benchmarks import gpt, run

CONTENDERS = ["bare", "jax_lossscale", "jmp", "flax", "optax.apply_if_finite"]
GPT_CONTENDERS = ["bare", "DynamicLossScale", "DynamicLossScale, spike skipping", "FixedLossScale"]


def test_runner_writes_every_case_as_json(tmp_path, capsys):
    path = tmp_path / "results.json"
    argv = [
        "--sizes", "4K", "--leaves", "4", "--repeats", "2", "--block", "2",
        "--compile-leaves", "8,16", "--compile-repeats", "1", "--mlp-width", "16",
        "--mlp-depth", "2", "--mlp-batch", "4", "--gpt-sizes", "70 leaves", "--gpt-batch", "1",
        "--json", str(path),
    ]  # fmt: skip
    results = run.main(argv)
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    assert list(results["cases"]) == [
        "gpt_step", "gpt_compile", "gpt_memory", "step", "mlp", "compile", "memory", "traces",
    ]  # fmt: skip
    synthetic = {case: rows for case, rows in results["cases"].items() if "gpt" not in case}
    for case, rows in synthetic.items():
        assert [row["optimizer"] for row in rows][:2] in (["adam", "adam"], ["adam", "sgd"]), case
        for row in rows:
            assert list(row["values"]) == CONTENDERS, (case, row)
    assert [(row["optimizer"], row["leaves"]) for row in results["cases"]["compile"]] == [
        ("adam", 8), ("adam", 16), ("sgd", 8), ("sgd", 16),
    ]  # fmt: skip
    for row in results["cases"]["traces"]:
        assert row["values"]["jax_lossscale"] == 1
        assert row["values"]["bare"] == 1
    for case in ("step", "gpt_step", "gpt_compile", "gpt_memory"):
        for row in results["cases"][case]:
            assert row["ratio_to_bare"]["bare"] == 1.0
            assert all(value > 0 for value in row["values"].values())
    for case in ("gpt_step", "gpt_compile", "gpt_memory"):
        [row] = results["cases"][case]
        assert row["optimizer"] == "adamw, 70 leaves"
        assert row["leaves"] == 70
        assert list(row["values"]) == GPT_CONTENDERS
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
        _, state = gpt.train_state(gpt.SIZES[name], 100, gpt.contenders()["bare"]())
        params, counted = gpt.parameter_count(state)
        assert counted == leaves
        assert low < params < high, (name, params)


def test_the_default_json_path_names_the_platform(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run.main(["--cases", "traces", "--optimizers", "sgd"])
    written = json.loads((tmp_path / "benchmarks" / "results" / "cpu.json").read_text())
    assert written["machine"]["backend"] == "cpu"
    assert list(written["cases"]) == ["traces"]
