"""Every Python code block of every page in docs/ runs and prints what its `# -> ...` comments
say (as `tests/test_readme.py` does for the README), and every page is in the site's nav."""

import json
import pathlib
import re

import pytest

import jax_lossscale

from helpers import assert_block_prints_what_it_says, python_blocks

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
NOTEBOOKS = sorted((DOCS.parent / "notebooks").glob("*.ipynb"))
PAGES = sorted(DOCS.glob("*.md"))
BLOCKS = [
    pytest.param(page.name, index, block, id=f"{page.name}[{index}]")
    for page in PAGES
    for index, block in enumerate(python_blocks(page))
]


def test_the_docs_have_pages_with_python_blocks():
    assert len(PAGES) >= 10
    assert len(BLOCKS) >= 20


@pytest.mark.parametrize(("page", "index", "block"), BLOCKS)
def test_docs_block_runs_and_prints_what_it_says(page, index, block, capsys):
    assert_block_prints_what_it_says(block, f"docs/{page}[python block {index}]", capsys)


def test_every_page_is_in_the_nav_and_every_public_name_in_the_api_reference():
    import jax_lossscale

    config = (DOCS.parent / "mkdocs.yml").read_text()
    for page in PAGES:
        assert f": {page.name}\n" in config, page.name
    api = (DOCS / "api.md").read_text()
    for name in jax_lossscale.__all__:
        if name != "__version__":
            assert f"::: jax_lossscale.{name}\n" in api, name


def test_every_public_method_has_a_docstring_the_reference_renders():
    """mkdocstrings leaves out members without a docstring (`show_if_no_docstring: false`)."""
    missing = []
    for name in jax_lossscale.__all__:
        value = getattr(jax_lossscale, name)
        if not isinstance(value, type):
            continue
        for member, function in vars(value).items():
            public = not member.startswith("_") or member == "__call__"
            if public and callable(function) and not (function.__doc__ or "").strip():
                missing.append(f"{name}.{member}")
    assert missing == []


def section(markdown: str, heading: str) -> str:
    """The text under `heading` (a whole heading line), up to the next heading of its level."""
    level = heading.split(" ")[0]
    return markdown.split(f"\n{heading}\n")[1].split(f"\n{level} ")[0]


def test_the_api_at_a_glance_names_every_public_name():
    glance = section((DOCS / "getting-started.md").read_text(), "## The API at a glance")
    names = [name for name in jax_lossscale.__all__ if name != "__version__"]
    assert [name for name in names if not re.search(rf"\b{name}\b", glance)] == []
    assert "fp8_meta" in glance


def test_the_lists_of_notebooks_name_every_notebook():
    listed = section((DOCS / "getting-started.md").read_text(), "## Notebooks")
    quickstart = json.loads((DOCS.parent / "notebooks" / "quickstart.ipynb").read_text())
    (where_next,) = [
        "".join(cell["source"])
        for cell in quickstart["cells"]
        if "".join(cell["source"]).startswith("## Where next")
    ]
    assert [path.name for path in NOTEBOOKS if f"`{path.name}`" not in listed] == []
    others = [path.name for path in NOTEBOOKS if path.stem != "quickstart"]
    assert [name for name in others if f"`{name}`" not in where_next] == []


def test_the_home_page_links_every_page():
    where_to_go = section((DOCS / "index.md").read_text(), "## Where to go")
    linked = set(re.findall(r"\]\(([\w-]+)\.md[)#]", where_to_go))
    assert {page.stem for page in PAGES} - {"index"} - linked == set()
    assert "integrations.md#fp8-layers-scales-and-amax-histories" in where_to_go
