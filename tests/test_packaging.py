"""The package's metadata: version, license, classifiers."""

import pathlib
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


def test_classifiers_name_the_python_versions_and_typing():
    classifiers = PYPROJECT["project"]["classifiers"]
    for version in ("3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert "Typing :: Typed" in classifiers
    assert (ROOT / "jax_lossscale" / "py.typed").exists()
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
