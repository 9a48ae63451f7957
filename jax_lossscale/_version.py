"""The version, read from the installed package's metadata or, in a source tree that is
not installed, from its pyproject.toml: the one place where it is written."""

import pathlib
import tomllib
from importlib import metadata


def version() -> str:
    """The version of the jax_lossscale that is imported.

    A source tree imported without being installed (a checkout on `sys.path`) reads its
    own `pyproject.toml`, also when another version is installed beside it.
    """
    pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        with pyproject.open("rb") as file:
            project = tomllib.load(file).get("project", {})
        if project.get("name") == "jax_lossscale" and "version" in project:
            return str(project["version"])
    try:
        return metadata.version("jax_lossscale")
    except metadata.PackageNotFoundError:
        return "0+unknown"
