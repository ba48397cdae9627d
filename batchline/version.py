"""The release: one place, read by the package metadata, `batchline --version` and the spec's schema."""

__version__ = "0.1.0"
