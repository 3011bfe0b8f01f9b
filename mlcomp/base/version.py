"""The package version, in one place (manifests record it)."""

__version__ = "0.1.0"
