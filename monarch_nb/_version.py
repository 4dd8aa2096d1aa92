"""The package version (one place: the package root and the Lab extension's beacon read it)."""

__version__ = "0.1.0"
