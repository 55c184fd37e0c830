"""The version of pgflow, in a leaf module so the worker can report it without importing the package."""

__version__ = "0.1.0"
