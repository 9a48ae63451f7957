"""The package's metadata: version, license, classifiers."""

import importlib.util
import pathlib
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata

import jax_lossscale

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_comes_from_the_installed_metadata():
    assert jax_lossscale.__version__ == metadata.version("jax_lossscale")
    assert jax_lossscale.__version__ == PYPROJECT["project"]["version"]


def test_the_license_is_the_apache_2_text_and_ships_with_the_package():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    assert "LICENSE" in PYPROJECT["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]


def test_the_sdist_holds_what_the_site_and_its_test_build_from():
    # docs/notebooks links to notebooks/: without it the site's test fails from an sdist.
    include = PYPROJECT["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    assert {"docs", "notebooks", "mkdocs.yml", "tests"} <= set(include)


def test_classifiers_name_the_python_versions_and_typing():
    classifiers = PYPROJECT["project"]["classifiers"]
    for version in ("3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert "Typing :: Typed" in classifiers
    assert (ROOT / "jax_lossscale" / "py.typed").exists()
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"


def _source_tree(tmp_path, version):
    """A copy of the package and of a pyproject.toml naming `version`, not installed."""
    shutil.copytree(ROOT / "jax_lossscale", tmp_path / "jax_lossscale")
    text = (ROOT / "pyproject.toml").read_text()
    old = f'version = "{PYPROJECT["project"]["version"]}"'
    assert old in text
    (tmp_path / "pyproject.toml").write_text(text.replace(old, f'version = "{version}"', 1))
    return tmp_path


def test_version_of_a_source_tree_that_is_not_installed_comes_from_its_pyproject(tmp_path):
    tree = _source_tree(tmp_path, "7.8.9")
    code = "import jax_lossscale; print(jax_lossscale.__version__, jax_lossscale.__file__)"
    printed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,  # the copy comes first on sys.path; the installed one is another version
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert printed == ["7.8.9", str(tree / "jax_lossscale" / "__init__.py")]


def test_version_without_a_pyproject_or_metadata_is_a_placeholder(tmp_path, monkeypatch):
    shutil.copy(ROOT / "jax_lossscale" / "_version.py", tmp_path / "_version.py")
    spec = importlib.util.spec_from_file_location("copied_version", tmp_path / "_version.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(module.metadata, "version", not_installed)
    assert module.version() == "0+unknown"


def _imports_of_modules() -> dict[str, set[tuple[str, str]]]:
    """Per module of the package, the (module, name) pairs it imports from the package, type-only
    imports (under `if TYPE_CHECKING:`) included: every import statement in its source."""
    import ast

    imports: dict[str, set[tuple[str, str]]] = {}
    for path in sorted((ROOT / "jax_lossscale").glob("*.py")):
        found: set[tuple[str, str]] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_lossscale"):
                for alias in node.names:
                    if node.module == "jax_lossscale":  # `from jax_lossscale import _checks`
                        found.add((alias.name, ""))
                    else:
                        found.add((node.module.removeprefix("jax_lossscale."), alias.name))
        imports[path.stem] = found
    return imports


def test_the_package_s_modules_import_no_cycle_and_no_private_name_of_another():
    imports = _imports_of_modules()
    assert imports["_base"] >= {("_checks", "check_named_arrays"), ("_numerics", "finite_flag")}
    private = sorted(
        (module, source, name)
        for module, found in imports.items()
        for source, name in found
        if name.startswith("_") and source != "_version"
    )
    assert private == []
    graph = {module: {source for source, _ in found} for module, found in imports.items()}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        for source in sorted(graph.get(module, ())):
            if source in path:
                cycles.append([*path[path.index(source) :], source])
            else:
                visit(source, [*path, source])

    for module in graph:
        if module != "__init__":
            visit(module, [module])
    assert cycles == []
