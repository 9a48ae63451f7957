"""The benchmark runner runs end to end on a tiny size, so it cannot rot (no timings checked)."""

import json

from benchmarks import run

CONTENDERS = ["bare", "jax_lossscale", "jmp", "flax", "optax.apply_if_finite"]


def test_runner_writes_every_case_as_json(tmp_path, capsys):
    path = tmp_path / "results.json"
    argv = [
        "--sizes", "4K", "--leaves", "4", "--repeats", "2", "--compile-leaves", "8",
        "--compile-repeats", "1", "--mlp-width", "16", "--mlp-depth", "2", "--mlp-batch", "4",
        "--json", str(path),
    ]  # fmt: skip
    results = run.main(argv)
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    assert set(results["cases"]) == {"step", "mlp", "compile", "memory", "traces"}
    for case, rows in results["cases"].items():
        assert [row["optimizer"] for row in rows][:2] in (["adam", "adam"], ["adam", "sgd"]), case
        for row in rows:
            assert list(row["values"]) == CONTENDERS, (case, row)
    for row in results["cases"]["traces"]:
        assert row["values"]["jax_lossscale"] == 1
        assert row["values"]["bare"] == 1
    for row in results["cases"]["step"]:
        assert row["ratio_to_bare"]["bare"] == 1.0
        assert all(value > 0 for value in row["values"].values())
    printed = capsys.readouterr().out
    assert "## step (s, ratio to bare)" in printed
    assert "optimizer | params | leaves | bare | jax_lossscale" in printed
