"""Runs each notebook top to bottom in a fresh kernel and compares what its cells print with
the outputs saved in it: exit status 1, with the differences, when a saved output is stale.

    python .ci/check_notebooks.py                     # every notebook in notebooks/
    python .ci/check_notebooks.py notebooks/quickstart.ipynb
    python .ci/check_notebooks.py --update            # save the fresh outputs instead

Compared: each code cell's stdout, and the text and kinds (`image/png`, ...) of its results and
displays; not stderr (warnings name the machine), nor the bytes of images. Words and symbols
must match exactly (`nan` against `inf` fails); numbers may differ by `--rtol` relatively, for
the last printed digit of float sums on another CPU. On a line that reads as a timing (a number
followed by a unit of time, or a rate per second) the numbers are not compared.
"""

import argparse
import math
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
TIMING = re.compile(r"\d\s*(?:ns|us|µs|ms|s|sec|seconds|min|minutes)\b|/s\b|\bper second\b")


def cell_outputs(cell: dict) -> list[tuple[str, str]]:
    """A code cell's outputs as (kind, text): stdout runs joined into one, results and displays
    as their MIME types and their plain text, errors as their name and value."""
    outputs: list[tuple[str, str]] = []
    for output in cell.get("outputs", []):
        kind = output["output_type"]
        if kind == "stream":
            if output["name"] != "stdout":
                continue
            text = "".join(output["text"])
            if outputs and outputs[-1][0] == "stdout":
                outputs[-1] = ("stdout", outputs[-1][1] + text)
            else:
                outputs.append(("stdout", text))
        elif kind in {"execute_result", "display_data"}:
            data = output["data"]
            mimes = ", ".join(sorted(data))
            outputs.append((f"{kind} ({mimes})", "".join(data.get("text/plain", ""))))
        else:
            outputs.append((kind, f"{output.get('ename')}: {output.get('evalue')}"))
    return outputs


def lines_agree(saved: str, fresh: str, rtol: float) -> bool:
    """Whether two printed lines say the same: equal words, numbers within `rtol`, and any
    numbers on a timing line."""
    if saved == fresh:
        return True
    if NUMBER.split(saved) != NUMBER.split(fresh):
        return False
    saved_numbers, fresh_numbers = NUMBER.findall(saved), NUMBER.findall(fresh)
    if TIMING.search(saved) and TIMING.search(fresh):
        return True
    return all(
        math.isclose(float(a), float(b), rel_tol=rtol, abs_tol=0.0)
        for a, b in zip(saved_numbers, fresh_numbers, strict=True)
    )


def differences(saved_cells: list[dict], fresh_cells: list[dict], rtol: float) -> list[str]:
    """What a fresh run printed differently from the saved outputs, cell by cell."""
    found = []
    for index, (saved_cell, fresh_cell) in enumerate(zip(saved_cells, fresh_cells, strict=True)):
        if saved_cell["cell_type"] != "code":
            continue
        saved, fresh = cell_outputs(saved_cell), cell_outputs(fresh_cell)
        where = f"cell {index}"
        if [kind for kind, _ in saved] != [kind for kind, _ in fresh]:
            found.append(f"{where}: outputs {[k for k, _ in saved]} -> {[k for k, _ in fresh]}")
            continue
        for (kind, saved_text), (_, fresh_text) in zip(saved, fresh, strict=True):
            saved_lines, fresh_lines = saved_text.splitlines(), fresh_text.splitlines()
            if len(saved_lines) != len(fresh_lines):
                found.append(
                    f"{where} {kind}: {len(saved_lines)} lines saved, {len(fresh_lines)} now:\n"
                    f"  saved: {saved_text!r}\n  fresh: {fresh_text!r}"
                )
                continue
            for line, (a, b) in enumerate(zip(saved_lines, fresh_lines, strict=True)):
                if not lines_agree(a, b, rtol):
                    found.append(f"{where} {kind} line {line}:\n  saved: {a}\n  fresh: {b}")
    return found


def execute(path: pathlib.Path):
    """The notebook at `path` run top to bottom in a fresh kernel, from its own folder."""
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        joined = []  # a stream's text arrives in chunks that depend on timing: one output each
        for output in cell.get("outputs", []):
            previous = joined[-1] if joined else None
            if (
                output.output_type == "stream"
                and previous is not None
                and previous.output_type == "stream"
                and previous.name == output.name
            ):
                previous.text += output.text
            else:
                joined.append(output)
        if cell.cell_type == "code":
            cell.outputs = joined
    return notebook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path)
    parser.add_argument("--update", action="store_true", help="save the fresh outputs")
    parser.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance of numbers")
    args = parser.parse_args(argv)
    import nbformat

    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    stale = 0
    for path in paths:
        saved = nbformat.read(path, as_version=4)
        fresh = execute(path)
        found = differences(saved.cells, fresh.cells, args.rtol)
        if args.update:
            nbformat.write(fresh, path)
            print(f"{path}: saved the fresh outputs; they changed thus:", *found, sep="\n")
        elif found:
            stale += 1
            print(f"{path}: the saved outputs differ from a fresh run:", *found, sep="\n")
        else:
            print(f"{path}: the saved outputs are those of a fresh run")
    if stale:
        print(f"{stale} notebook(s) stale: `python .ci/check_notebooks.py --update` re-runs them")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
