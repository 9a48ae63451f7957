"""Every Python code block in README.md runs and prints what its `# -> ...` comments say."""

import pathlib

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
