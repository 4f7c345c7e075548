"""The flowopt version (written into every saved workflow's ``meta``)."""

__version__ = "0.1.0"
