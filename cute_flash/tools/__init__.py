"""Contributor tools: compile-and-report without a GPU (``inspect``)."""
