"""The version of the ``tdist`` distribution: its one source (core/pyproject.toml reads it)."""

__version__ = "0.1.0"
