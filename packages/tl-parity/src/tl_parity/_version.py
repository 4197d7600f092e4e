"""The tl-parity version (read by hatchling)."""

__version__ = "0.1.0"
