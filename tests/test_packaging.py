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
