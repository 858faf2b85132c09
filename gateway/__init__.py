"""The MQTT gateway and the ``lightgate`` command."""

__version__ = "0.1.0"
"""The one place the version is written: pyproject.toml reads it (dynamic version), ``lightgate --version``
prints it and ``/metrics`` exports it as ``lightgate_build_info``."""
