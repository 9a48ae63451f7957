"""`.ci/check_notebooks.py`, which CI runs after the suite: what it counts as a stale saved
output, on cells made up here (running the notebooks takes a minute, so CI does that, not this
file), and that the committed notebooks were each run top to bottom in one kernel."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "check_notebooks.py"
SPEC = importlib.util.spec_from_file_location("check_notebooks", SCRIPT)
check_notebooks = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(check_notebooks)

STATS = "LossScaleStats(loss_scale=Array(1.0737418e+09, dtype=float32), grad_norm=Array({}))\n"


def code_cell(*outputs: dict) -> dict:
    return {"cell_type": "code", "source": "", "outputs": list(outputs)}


def stdout(text: str, name: str = "stdout") -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def figure(text: str = "<Figure size 700x400 with 1 Axes>", png: bool = True) -> dict:
    data = {"text/plain": text, **({"image/png": "iVBORw0KGgo="} if png else {})}
    return {"output_type": "display_data", "data": data, "metadata": {}}


def differences(saved: dict, fresh: dict, rtol: float = 1e-3) -> list[str]:
    markdown = {"cell_type": "markdown", "source": "# A title"}
    return check_notebooks.differences([markdown, saved], [markdown, fresh], rtol)


def test_a_word_that_changed_is_a_stale_output():
    """The quickstart's skipped step printed `grad_norm=Array(nan)` after it printed `inf`."""
    saved, fresh = STATS.format("nan"), STATS.format("inf")
    found = differences(code_cell(stdout(saved)), code_cell(stdout(fresh)))
    assert found == [f"cell 1 stdout line 0:\n  saved: {saved[:-1]}\n  fresh: {fresh[:-1]}"]


def test_the_same_output_in_other_chunks_and_with_other_stderr_is_current():
    saved = code_cell(stdout("a 1\nb 2\n"))
    fresh = code_cell(stdout("a 1\n"), stdout("a warning\n", name="stderr"), stdout("b 2\n"))
    assert differences(saved, fresh) == []


@pytest.mark.parametrize(
    ("saved", "fresh", "stale"),
    [
        ("final loss 3.469e-07, scale 1024", "final loss 3.4693e-07, scale 1024", False),
        ("final loss 3.469e-07, scale 1024", "final loss 3.475e-07, scale 1024", True),
        ("final loss 3.469e-07, scale 1024", "final loss 3.469e-07, scale 2048", True),
        ("skipped 8", "skipped 9", True),
        ("step 1.58 ms, compile 2.1 s", "step 2.71 ms, compile 1.4 s", False),
        ("step 1.58 ms", "step 1.58 ms, 2 skipped", True),
        ("1000 steps, 950.2 step/s", "1000 steps, 1204.0 step/s", False),
    ],
)
def test_numbers_agree_within_rtol_and_any_number_on_a_timing_line(saved, fresh, stale):
    found = differences(code_cell(stdout(saved + "\n")), code_cell(stdout(fresh + "\n")))
    assert bool(found) == stale


def test_a_missing_figure_or_a_line_more_is_a_stale_output():
    assert differences(code_cell(figure()), code_cell(figure(png=False))) == [
        "cell 1: outputs ['display_data (image/png, text/plain)'] -> ['display_data (text/plain)']"
    ]
    assert differences(code_cell(figure()), code_cell(figure("<Figure size 700x400>"))) != []
    assert differences(code_cell(stdout("a\n")), code_cell(stdout("a\nb\n"))) == [
        "cell 1 stdout: 1 lines saved, 2 now:\n  saved: 'a\\n'\n  fresh: 'a\\nb\\n'"
    ]


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_each_committed_notebook_ran_top_to_bottom_in_one_kernel_without_errors(path):
    cells = [cell for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]
    assert [cell["execution_count"] for cell in cells] == list(range(1, len(cells) + 1))
    kinds = {output["output_type"] for cell in cells for output in cell["outputs"]}
    assert kinds <= {"stream", "display_data", "execute_result"}
