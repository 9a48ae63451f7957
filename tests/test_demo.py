"""`python -m jax_lossscale.demo`: float16 stalls without loss scaling, tracks float32 with it."""

import re
import runpy
import struct
import sys

import numpy as np
import pytest

from jax_lossscale import demo

STEPS = 1000
SHORT = 50  # steps of the runs that check what is printed and what a seed changes
INSTALL_HINT = 'Install the demo extra: pip install -e ".[demo]"'


@pytest.fixture(scope="module")
def plot_path(tmp_path_factory):
    return tmp_path_factory.mktemp("demo") / "curves.png"


@pytest.fixture(scope="module")
def results(plot_path):
    return demo.main(["--steps", str(STEPS), "--plot", str(plot_path)])


def test_returns_one_result_per_run_with_one_entry_per_step(results):
    assert list(results) == ["float32", "float16", "float16_scaled"]
    for r in results.values():
        for per_step in (r.losses, r.loss_scales, r.applied, r.zero_grad_shares):
            assert per_step.shape == (STEPS,)
        assert sorted(r.grad_errors) == ["b1", "b2", "b3", "w1", "w2", "w3"]
        for errors in r.grad_errors.values():
            assert errors.shape == (STEPS,)


def test_gradient_errors_against_float32_show_what_zeros_do_not(results):
    """Without scaling every parameter's float16 gradient is wholly wrong; with it, each is
    far closer to float32's; the float32 run's own gradient is float32's."""
    float32 = results["float32"].median_grad_errors()
    unscaled = results["float16"].median_grad_errors()
    scaled = results["float16_scaled"].median_grad_errors()
    assert max(float32.values()) < 1e-6
    assert min(unscaled.values()) > 0.5
    assert unscaled["w1"] == 1.0  # all its entries underflow to zero: 100% wrong
    assert max(scaled.values()) < 0.5
    for name, error in scaled.items():
        assert error < unscaled[name] / 2, name


def test_float16_gradients_underflow_to_zero_without_loss_scaling(results):
    assert results["float16"].zero_grad_share > 0.9
    assert results["float16_scaled"].zero_grad_share < 0.01
    assert results["float32"].zero_grad_share < 0.001


def test_float16_without_loss_scaling_stalls(results):
    float16, float32 = results["float16"], results["float32"]
    quarter = STEPS // 4
    assert float16.losses[quarter:].min() > 0.99 * float16.losses[quarter]
    assert float32.final_loss < 0.8 * float32.losses[quarter]
    assert float16.final_loss > 1.3 * results["float16_scaled"].final_loss


def test_float16_with_loss_scaling_tracks_float32(results):
    scaled, float32 = results["float16_scaled"].final_loss, results["float32"].final_loss
    assert abs(scaled - float32) < 0.01 * float32


def test_scale_starts_high_and_backs_off_on_skipped_steps(results):
    scaled = results["float16_scaled"]
    assert scaled.loss_scales[0] == 2.0**32
    assert not scaled.applied[0]
    assert scaled.loss_scales[1] == 2.0**31
    assert scaled.stats.skipped_steps == np.count_nonzero(~scaled.applied) >= 1
    assert np.any(np.diff(scaled.loss_scales) > 0)  # it grew as well


def test_scale_trajectory_follows_the_dynamic_rule(results):
    scaled = results["float16_scaled"]
    scale, good_steps, expected = 2.0**32, 0, []
    for applied in scaled.applied:
        expected.append(scale)
        if not applied:
            scale, good_steps = scale / 2, 0
        elif good_steps + 1 == demo.INCREMENT_PERIOD:
            scale, good_steps = scale * 2, 0
        else:
            good_steps += 1
    np.testing.assert_array_equal(scaled.loss_scales, np.array(expected, np.float32))
    assert scaled.stats.loss_scale == scale


def test_skipped_steps_leave_the_parameters_unchanged(results):
    scaled = results["float16_scaled"]
    skipped = np.flatnonzero(~scaled.applied[:-1])
    np.testing.assert_array_equal(scaled.losses[skipped + 1], scaled.losses[skipped])
    applied = np.flatnonzero(scaled.applied[: STEPS // 2])  # later, the learning rate nears 0
    assert np.all(scaled.losses[applied + 1] != scaled.losses[applied])


def test_runs_without_loss_scaling_never_skip(results):
    for key in ("float32", "float16"):
        assert results[key].stats is None
        assert np.all(results[key].applied)
        assert np.all(results[key].loss_scales == 1.0)


def test_plot_writes_a_png(results, plot_path):
    header = plot_path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", header[16:24]) == (1200, 400)  # width, height


def test_module_prints_progress_and_the_summary_table(monkeypatch, capsys):
    # `python -m jax_lossscale.demo`, run in this process as `-m` runs it: as few steps as the
    # seed's test below, which then finds the programs compiled (the steps are static)
    monkeypatch.setattr(sys, "argv", ["demo", "--steps", str(SHORT)])
    monkeypatch.delitem(sys.modules, "jax_lossscale.demo")
    runpy.run_module("jax_lossscale.demo", run_name="__main__", alter_sys=True)
    completed = capsys.readouterr()
    assert f"{SHORT}/{SHORT}" in completed.err  # the progress bars
    lines = completed.out.strip().splitlines()
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[:5]]
    assert rows[0] == [
        "run",
        "final loss",
        "vs float32",
        "skipped steps",
        "final scale",
        "zero grads*",
        "grad error**",
    ]
    assert set(lines[1]) == {"-"}
    assert [row[0] for row in rows[2:]] == [
        "float32",
        "float16, no loss scaling",
        "float16, DynamicLossScale",
    ]
    assert rows[2][2:] == ["1.00x", "-", "-", "0.0%", "-"]
    assert re.fullmatch(r"\d+\.\d%", rows[3][6])
    assert rows[3][3:5] == ["-", "-"]
    assert int(rows[4][3]) >= 1
    assert re.fullmatch(r"2\*\*\d+", rows[4][4])
    assert f"{SHORT} steps per run." in completed.out
    worst = [line.strip() for line in lines if line.startswith("  float16")]
    assert [line.split(":")[0] for line in worst] == [
        "float16, no loss scaling",
        "float16, DynamicLossScale",
    ]
    for line in worst:  # the three worst parameters, by name
        assert re.fullmatch(r"[^:]+: ([bw]\d \d+\.\d%, ){2}[bw]\d \d+\.\d%", line), line


def test_seed_changes_the_task_and_matplotlib_is_only_needed_for_plot(results, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    other = demo.main(["--steps", str(SHORT), "--seed", "1"])
    for key, result in results.items():
        assert other[key].losses[0] != result.losses[0]
    assert other["float16"].zero_grad_share > 0.9


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m jax_lossscale.demo")
    for option in ("--steps STEPS", "--seed SEED", "--plot FILE.png"):
        assert option in out


@pytest.mark.parametrize("steps", ["0", "-3", "1.5", "many"])
def test_steps_must_be_a_positive_integer(steps, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--steps", steps])
    assert exit_info.value.code == 2
    assert f"argument --steps: must be an integer >= 1, got '{steps}'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("missing", "argv"), [("tqdm", []), ("matplotlib", ["--plot", "never-written.png"])]
)
def test_missing_demo_dependency_exits_with_install_hint(missing, argv, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, missing, None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--steps", "1", *argv])
    assert exit_info.value.code == (
        f"jax_lossscale.demo needs {missing}, which is not installed. {INSTALL_HINT}"
    )
    assert not (tmp_path / "never-written.png").exists()
