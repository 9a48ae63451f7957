"""Every Python code block in README.md runs and prints what its `# -> ...` comments say."""

import pathlib
import re

import pytest

from helpers import assert_block_prints_what_it_says, python_blocks

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = python_blocks(README)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_and_prints_what_it_says(index, capsys):
    block = BLOCKS[index]
    assert_block_prints_what_it_says(block, f"README.md[python block {index}]", capsys)


def shell_commands(text: str) -> list[str]:
    """The commands of a Markdown page's bash blocks, one a line, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    lines = (line.split("  #")[0].strip() for block in blocks for line in block.splitlines())
    return [line for line in lines if line]


def test_shell_commands_are_read_from_bash_blocks_without_comments():
    text = "```bash\ncd x\npytest a.py    # quick\n\n```\n```python\nimport y\n```\n"
    assert shell_commands(text) == ["cd x", "pytest a.py"]


def test_the_set_up_runs_from_the_clone_and_the_test_command_is_the_one_ci_runs():
    """The install block starts in the clone's folder and holds no placeholder address; the
    whole suite's command is the one `.ci/run` runs, and the quick check names test files."""
    text = README.read_text()
    commands = shell_commands(text)
    assert commands[:3] == [
        "cd jax_lossscale",
        "python -m venv .venv && source .venv/bin/activate",
        'pip install -e ".[test]"',
    ]
    assert "OWNER" not in text
    assert 'pip install -e ".[test]" && pytest' in commands
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert {'pip install -e ".[test]" || exit', "pytest || exit"} <= set(ci)
    quick = [c.split()[1:] for c in commands if c.startswith("pytest ")]
    assert quick[0] == ["tests/test_readme.py", "tests/test_dynamic.py"]
    for paths in quick:
        assert all((README.parent / path).is_file() for path in paths), paths
