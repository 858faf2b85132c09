"""The MQTT gateway and the ``lightgate`` command."""

from pathlib import Path

__version__ = "0.1.0"
"""The one place the version is written: pyproject.toml reads it (dynamic version), ``lightgate --version``
prints it and ``/metrics`` exports it as ``lightgate_build_info``."""

SOURCE_DIR = Path(__file__).resolve().parent.parent
"""The directory holding the packages: a checkout when lightgate runs from one, else site-packages."""


def checkout() -> Path | None:
    """The checkout lightgate runs from (:data:`SOURCE_DIR` when it has the pyproject.toml), None for an install."""
    return SOURCE_DIR if (SOURCE_DIR / "pyproject.toml").is_file() else None
