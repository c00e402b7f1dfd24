"""Adapters for the frameworks users reach attention through (each imports its framework lazily)."""
