"""The package version (one place: pyproject.toml's version must match, a test checks it)."""

__version__ = "0.1.0"
