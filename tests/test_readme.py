"""Every Python code block in README.md runs and prints what its `# -> ...` comments say."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_and_prints_what_it_says(index, capsys):
    block = BLOCKS[index]
    exec(compile(block, f"README.md[python block {index}]", "exec"), {})
    expected = [match.split(" (")[0] for match in re.findall(r"# -> (.*)", block)]
    assert capsys.readouterr().out.split("\n")[: len(expected)] == expected
