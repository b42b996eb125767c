"""Helpers for models from other libraries (each module imports its library lazily)."""
