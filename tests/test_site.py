"""The documentation site, built as CI builds it (`mkdocs build --strict`) and read as a browser
shows it: the API reference shows every docstring example as a code block and every Returns
section as one row, no `**` of a power turns prose bold, and the notebooks' titles and tables of
contents keep the code of their headings."""

import doctest
import html
import html.parser
import importlib.util
import inspect
import json
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
        "jax_lossscale.value_and_grad",
        "jax_lossscale.get_loss_scale_stats",
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


# --- the site at a laptop's width, 1280 px, and offline -----------------------------------
#
# No browser runs here: the page's geometry at 1280 px is computed from the theme's stylesheet
# (mkdocs-material 9: the root font at 125%, so 1 rem = 20 px; the left sidebar 12.1 rem; the
# content's margins 1.2 rem each; tables at 0.64 rem; code at 0.85 em, 0.6 em a character in a
# monospace font) and ours (docs/stylesheets/extra.css, read below), and a table's narrowest
# width from its cells' longest unbreakable runs of text, as a browser's table layout takes it.

WINDOW = 1280
REM = 20.0
MONOSPACE_ADVANCE = 0.6  # em, DejaVu Sans Mono, Liberation Mono, Menlo, Consolas
TEXT_ADVANCE = 0.55  # em, an upper estimate of a sans-serif letter's mean width
EXTRA_CSS = ROOT / "docs" / "stylesheets" / "extra.css"


def css_value(selector: str, prop: str) -> str:
    """The value of `prop` in the rule for `selector` in docs/stylesheets/extra.css."""
    css = re.sub(r"/\*.*?\*/", "", EXTRA_CSS.read_text(), flags=re.S)
    for selectors, body in re.findall(r"([^{}]+)\{([^}]*)\}", css):
        if selector in [part.strip() for part in selectors.split(",")]:
            declarations = dict(re.findall(r"([\w-]+)\s*:\s*([^;]+);", body))
            if prop in declarations:
                return declarations[prop].strip()
    raise KeyError(f"{selector} {{{prop}}}")


def page_width() -> float:
    """The width of a page's content at 1280 px: the grid, less the left sidebar and the
    margins; the right sidebar is not there (its contents are in the left one)."""
    assert "toc.integrate" in (ROOT / "mkdocs.yml").read_text()
    grid = min(WINDOW, float(css_value(".md-grid", "max-width").removesuffix("rem")) * REM)
    return grid - 12.1 * REM - 2 * 1.2 * REM


def test_code_blocks_show_100_columns_at_1280_px(site):
    code_font = 0.85 * 0.8 * REM
    padding = 2 * 1.1764705882 * code_font  # the theme's, left and right of a code block
    columns = (page_width() - padding) / (MONOSPACE_ADVANCE * code_font)
    assert 100 <= columns < 125, columns
    assert 'href="stylesheets/extra.css"' in (site / "index.html").read_text()


class Tables(html.parser.HTMLParser):
    """The tables of a page: each a list of rows, each a list of cells, each cell a list of
    `(text, is_code)` runs; a `<br>` or `<wbr>` is a place to break, a run of its own."""

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.tables: list[list[list[list[tuple[str, bool]]]]] = []
        self._code = 0
        self._cell: list[tuple[str, bool]] | None = None
        self.feed(path.read_text())

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in {"td", "th"} and self.tables:
            self._cell = []
            self.tables[-1][-1].append(self._cell)
        elif tag == "code":
            self._code += 1
        elif tag in {"br", "wbr"} and self._cell is not None:
            self._cell.append((" ", False))

    def handle_endtag(self, tag):
        if tag == "code":
            self._code -= 1
        elif tag in {"td", "th"}:
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append((data, self._code > 0))


def narrowest_cell(runs: list[tuple[str, bool]]) -> float:
    """The width of a cell's longest unbreakable run, in px: inline code breaks at a space or
    a `<wbr>` only (docs/stylesheets/extra.css: never inside a name), text at a space."""
    table_font = 0.64 * REM
    widths = {True: 0.85 * table_font * MONOSPACE_ADVANCE, False: table_font * TEXT_ADVANCE}
    widest = current = 0.0
    for text, is_code in runs:
        for character in text:
            current = 0.0 if character.isspace() else current + widths[is_code]
            widest = max(widest, current)
    return widest


def narrowest_table(table: list[list[list[tuple[str, bool]]]]) -> float:
    padding = float(css_value(".md-typeset table:not([class]) td", "padding").split()[1][:-2])
    columns: dict[int, float] = {}
    for row in table:
        for index, cell in enumerate(row):
            columns[index] = max(columns.get(index, 0.0), narrowest_cell(cell))
    return sum(width + 2 * padding * 0.64 * REM for width in columns.values())


def test_a_table_is_measured_by_its_longest_names():
    cell = [("flax ", False), ("DynamicScale", True), (" or ", False)]
    assert narrowest_cell(cell) == pytest.approx(12 * 0.85 * 12.8 * 0.6)
    wrapped = [("tf.", True), (" ", False), ("compat", True)]  # a <wbr> after the dot
    assert narrowest_cell(wrapped) == pytest.approx(6 * 0.85 * 12.8 * 0.6)


def test_every_table_fits_the_page_whole_at_1280_px(site):
    """A table wider than the page scrolls, its last columns out of sight; one that fits
    shows every column, and no name in it breaks (the table is as wide as its names)."""
    too_wide = {
        f"{path.parent.relative_to(site).as_posix()}[{index}]": round(narrowest_table(table))
        for path in sorted(site.glob("**/index.html"))
        for index, table in enumerate(Tables(path).tables)
        if narrowest_table(table) > page_width()
    }
    assert too_wide == {}


def test_inline_code_breaks_only_between_names():
    assert css_value(".md-typeset code", "word-break") == "normal"
    spec = importlib.util.spec_from_file_location("hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = (
        '<p><code><a href="#jax_lossscale.get">jls.get</a>(opt_state, x[0], 2.0)</code> '
        "<code>tf.compat.v1.mixed_precision</code></p><pre><code>jls.get(x)</code></pre>"
    )
    assert hooks.wrap_code(page) == (
        '<p><code><a href="#jax_lossscale.get">jls.<wbr>get</a>(<wbr>opt_state, x[0], 2.0)'
        "</code> <code>tf.<wbr>compat.<wbr>v1.<wbr>mixed_precision</code></p>"
        "<pre><code>jls.get(x)</code></pre>"
    )


def test_no_page_loads_anything_from_another_host(site):
    """Web fonts from an outside host failed 39 times a page offline; the theme's fonts are
    the system's (`font: false`)."""
    found = {}
    for path in sorted(site.glob("**/*.html")):
        text = path.read_text()
        loads = re.findall(r"<(?:link|script|img|iframe)\b[^>]*>", text)
        outside = [
            tag
            for tag in loads
            if re.search(r'\b(?:href|src)="(?:https?:)?//', tag) and 'rel="canonical"' not in tag
        ]
        outside += re.findall(r"@import\s+url\([^)]*\)|fonts\.(?:googleapis|gstatic)\.com", text)
        if outside:
            found[path.relative_to(site).as_posix()] = outside
    for path in sorted(site.glob("**/*.css")):
        if re.search(r"url\(\s*['\"]?(?:https?:)?//|@import", path.read_text()):
            found[path.relative_to(site).as_posix()] = ["a url of another host"]
    assert found == {}


def search_words(site: pathlib.Path, separator: str) -> dict[str, set[str]]:
    """The words the site's search finds on each page: as the theme's search tokenizes its
    index, the text between tags split by `separator`, lowercased."""
    index = json.loads((site / "search" / "search_index.json").read_text())
    words: dict[str, set[str]] = {}
    for entry in index["docs"]:
        page = entry["location"].split("#")[0]
        for text in re.split(r"<[^>]*>", entry["title"] + "<br>" + entry["text"]):
            words.setdefault(page, set()).update(
                w.lower() for w in re.split(separator, html.unescape(text)) if w
            )
    return words


def test_search_finds_every_public_name_a_page_writes(site):
    """`jls.where_applied(opt_state,` is a word to the theme's default separator (spaces and
    hyphens), so a search for `where_applied` missed the pages that write it so."""
    separator = json.loads((site / "search" / "search_index.json").read_text())["config"][
        "separator"
    ]
    words = search_words(site, separator)
    names = [name for name in jax_lossscale.__all__ if name != "__version__"] + ["MultiSteps"]
    missed = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        location = "" if page.stem == "index" else f"{page.stem}/"
        written = [name for name in names if re.search(rf"\b{name}\b", page.read_text())]
        if lost := [name for name in written if name.lower() not in words[location]]:
            missed[page.name] = lost
    assert missed == {}
    assert "where_applied" in words["migrating/"]
    assert "multisteps" in words["integrations/"]
    default = search_words(site, r"[\s\-]+")
    assert "where_applied" not in default["migrating/"]
    assert "multisteps" not in default["integrations/"]


def test_the_home_page_quick_start_shows_the_readmes_code(site):
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- --8<-- [start:quickstart] -->")
    code = readme[start:].split("```python\n", 1)[1].split("```", 1)[0]
    for path in ("index.html", "getting-started/index.html"):
        assert " ".join(code.split()) in Page(site / path).code_blocks, path
