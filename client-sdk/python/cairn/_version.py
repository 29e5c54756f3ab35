"""The version of cairn-sdk."""

__version__ = "0.1.0"
