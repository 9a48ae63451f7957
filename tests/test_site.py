"""The documentation site, built as CI builds it (`mkdocs build --strict`) and read as a browser
shows it: the API reference shows every docstring example as a code block and every Returns
section as one row, no `**` of a power turns prose bold, and the notebooks' titles and tables of
contents keep the code of their headings."""

import doctest
import html.parser
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import jax_lossscale

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(path.stem for path in (ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """The site built once for the module; a broken link, anchor or reference fails the build."""
    site_dir = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return site_dir


class Page(html.parser.HTMLParser):
    """What a reader sees of a built page: its title, the text of its code blocks, its
    blockquotes, the headings of its content, the links of its table of contents, all links
    with their text, and the rows of the API reference's docstring sections (by object and
    section title, each row its cells' texts)."""

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.title = ""
        self.code_blocks: list[str] = []
        self.blockquotes = 0
        self.headings: list[tuple[str, str]] = []  # (id, text), in the page's content
        self.toc: list[tuple[str, str]] = []  # (href, text)
        self.links: list[tuple[str, str]] = []  # (href, text)
        self.section_rows: dict[tuple[str, str], list[tuple[str, ...]]] = {}
        self._object = ""  # the id of the last heading: "jax_lossscale.LossScale.update"
        self._section = ""  # the title of the last docstring section: "Returns:"
        self._cells: list[str] = []
        self._open: list[tuple[str, dict[str, str]]] = []
        self._texts: list[list[str]] = []
        self.feed(path.read_text())

    def _inside(self, tag: str, class_: str = "") -> bool:
        return any(
            t == tag and (not class_ or class_ in a.get("class", "").split()) for t, a in self._open
        )

    def handle_starttag(self, tag, attrs):
        if tag in {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta"}:
            return  # void elements: no end tag, no text
        attributes = {key: value or "" for key, value in attrs}
        if re.fullmatch(r"h[1-6]", tag) and attributes.get("id"):
            self._object = attributes["id"]
        self._open.append((tag, attributes))
        self._texts.append([])
        self.blockquotes += tag == "blockquote"

    def handle_startendtag(self, tag, attrs):
        pass  # <x/>: no text

    def handle_endtag(self, tag):
        if tag not in (open_tag for open_tag, _ in self._open):
            return
        while True:
            open_tag, attributes = self._open.pop()
            text = "".join(self._texts.pop())
            if self._texts:
                self._texts[-1].append(text)
            if open_tag == tag:
                break
        text = " ".join(text.replace("¶", "").split())
        if tag == "title":
            self.title = text
        elif tag == "pre":
            self.code_blocks.append(text)
        elif tag == "a":
            self.links.append((attributes.get("href", ""), text))
            if self._inside("nav", "md-nav--secondary"):
                self.toc.append((attributes.get("href", ""), text))
        elif re.fullmatch(r"h[1-6]", tag) and self._inside("article"):
            self.headings.append((attributes.get("id", ""), text))
        elif tag == "span" and "doc-section-title" in attributes.get("class", "").split():
            self._section = text
        elif tag == "td":
            self._cells.append(text)
        elif tag == "tr" and "doc-section-item" in attributes.get("class", "").split():
            key = (self._object, self._section)
            self.section_rows.setdefault(key, []).append(tuple(self._cells))
            self._cells = []

    def handle_data(self, data):
        if self._texts:
            self._texts[-1].append(data)


def test_the_site_builds_strictly_with_a_page_for_every_doc_and_notebook(site):
    built = {path.parent.relative_to(site).as_posix() for path in site.glob("**/index.html")}
    docs = {path.stem for path in (ROOT / "docs").glob("*.md") if path.stem != "index"}
    assert built == {".", *docs, *(f"notebooks/{notebook}" for notebook in NOTEBOOKS)}


def test_the_sitemap_lists_every_page_under_the_site_url(site):
    """Without `site_url` the sitemap lists no page, and 404.html links from the server's root."""
    url = re.search(r"^site_url: (\S+)", (ROOT / "mkdocs.yml").read_text(), re.M)[1]
    pages = {path.parent.relative_to(site).as_posix() for path in site.glob("**/index.html")}
    expected = {url + ("" if page == "." else page + "/") for page in pages}
    assert set(re.findall(r"<loc>(.*?)</loc>", (site / "sitemap.xml").read_text())) == expected
    path = re.sub(r"^https?://[^/]+", "", url)
    assets = re.findall(r'href="([^"]*assets/[^"]*)"', (site / "404.html").read_text())
    assert assets
    assert all(href.startswith(path + "assets/") for href in assets)


def docstring_examples() -> dict[str, list[str]]:
    """The `>>>` examples of the public names' docstrings (a class's methods included), each
    as its prompts and expected output read, by docstring."""
    examples = {}
    finder = doctest.DocTestFinder()
    for name in jax_lossscale.__all__:
        for test in finder.find(getattr(jax_lossscale, name), name, module=False):
            for example in test.examples:
                source = re.sub(r"\s*# doctest:.*", "", example.source).splitlines()
                lines = [">>> " + source[0], *("... " + line for line in source[1:])]
                text = " ".join(" ".join([*lines, example.want]).split())
                examples.setdefault(test.name, []).append(text)
    return examples


def test_the_api_reference_shows_every_example_as_a_code_block_not_as_quotes(site):
    page = Page(site / "api" / "index.html")
    examples = docstring_examples()
    assert len(examples) >= 28
    code = "\n".join(page.code_blocks)
    missing = {name: [t for t in texts if t not in code] for name, texts in examples.items()}
    assert {name: texts for name, texts in missing.items() if texts} == {}
    assert page.blockquotes == 0


def returns_sections() -> dict[str, str]:
    """The `Returns:` section of each public function's and method's docstring, by the id of
    its heading in the API reference, as its text reads with the backticks of code dropped."""
    sections = {}
    for name in jax_lossscale.__all__:
        value = getattr(jax_lossscale, name)
        members = vars(value).items() if isinstance(value, type) else [("", value)]
        for member, function in members:
            lines = (inspect.getdoc(function) or "").splitlines() if callable(function) else []
            if "Returns:" in lines:
                section = lines[lines.index("Returns:") + 1 :]
                text = " ".join(section[: [*section, ""].index("")])
                sections[".".join(["jax_lossscale", name, member]).rstrip(".")] = " ".join(
                    text.replace("`", "").split()
                )
    return sections


def test_every_returns_section_renders_as_one_row_with_the_whole_text(site):
    """Griffe's Google parser starts a new return value at each line of a multi-line section
    unless told there is one (`returns_multiple_items: false`)."""
    page = Page(site / "api" / "index.html")
    expected = returns_sections()
    assert {
        "jax_lossscale.LossScale.adjust",
        "jax_lossscale.LossScale.update",
        "jax_lossscale.LossScale.scale",
        "jax_lossscale.LossScale.unscale",
        "jax_lossscale.stochastic_rounding",
        "jax_lossscale.kahan_summation",
        "jax_lossscale.count_non_finite",
    } <= set(expected)
    rendered = {
        obj: [cells[-1] for cells in rows]
        for (obj, section), rows in page.section_rows.items()
        if section == "Returns:"
    }
    assert rendered == {obj: [text] for obj, text in expected.items()}


def emphasis_inside_numbers(page: pathlib.Path) -> list[str]:
    """Bold or italics opened or closed between two characters of a number: `2**15, not 2**16`
    read as Markdown is `2<strong>15, not 2</strong>16`."""
    text = page.read_text()
    return re.findall(r".{0,20}(?:\d<(?:strong|em)>|</(?:strong|em)>\d).{0,20}", text)


def test_no_power_turns_prose_bold_on_any_page(site):
    found = {
        path.relative_to(site).as_posix(): spans
        for path in sorted(site.glob("**/*.html"))
        if (spans := emphasis_inside_numbers(path))
    }
    assert found == {}


def prose(markdown: str) -> str:
    """A Markdown page without its fenced code blocks, HTML comments and code spans."""
    markdown = re.sub(r"^( *)(```|~~~).*?^\1\2", "", markdown, flags=re.S | re.M)
    markdown = re.sub(r"<!--.*?-->", "", markdown, flags=re.S)
    return re.sub(r"(`+).+?\1", "", markdown, flags=re.S)


def test_powers_in_the_prose_of_the_readme_and_the_docs_are_written_as_code():
    assert prose("2**15 and `2**16`\n```python\nx = 2**17\n```\n") == "2**15 and \n\n"
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = {
        page.name: powers
        for page in pages
        if (powers := re.findall(r".{0,20}\w\*\*[-\w(].{0,20}", prose(page.read_text())))
    }
    assert found == {}


def test_the_distributed_notebook_keeps_the_code_of_its_headings(site):
    page = Page(site / "notebooks" / "distributed" / "index.html")
    assert page.title == "One train step under pmap, shard_map and SPMD jit - jax_lossscale"
    assert list(dict.fromkeys(page.toc)) == [
        ("#the-model-and-the-data", "The model and the data"),
        ("#pmap-with-axis_name", "pmap, with axis_name"),
        ("#without-axis_name-what-goes-wrong", "Without axis_name: what goes wrong"),
        ("#shard_map-with-axis_name", "shard_map, with axis_name"),
        ("#spmd-jit-no-axis_name", "SPMD jit, no axis_name"),
        ("#the-three-agree", "The three agree"),
    ]


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_a_notebook_title_nav_entry_and_toc_read_as_its_headings(site, notebook):
    """The body's headings are rendered from the notebook with their code; the title, the nav
    entry and the table of contents are built apart, from the notebook's Markdown."""
    page = Page(site / "notebooks" / notebook / "index.html")
    (title_id, title), *sections = page.headings
    assert title_id
    assert sections
    assert page.title == f"{title} - jax_lossscale"
    nav = {text for href, text in Page(site / "index.html").links if href.endswith(f"/{notebook}/")}
    assert nav == {title}
    assert list(dict.fromkeys(page.toc)) == [(f"#{id_}", text) for id_, text in sections]


def test_no_page_shows_a_literal_double_colon_or_a_file_path_as_a_cross_reference(site):
    """A docstring's `::` (reStructuredText's code marker) and a reference written as a path
    (`docs/integrations.md, "fp8 layers"`) reach the reader as text; they are written as a
    code block and a link."""
    found = {}
    for path in sorted(site.glob("**/*.html")):
        text = re.sub(r"<(pre|code)\b.*?</\1>", "", path.read_text(), flags=re.S)
        spans = re.findall(r".{0,30}(?:::</p>|\bdocs/[\w-]+\.md\b).{0,10}", text)
        if spans:
            found[path.relative_to(site).as_posix()] = spans
    assert found == {}
