"""Stub: only what kvcore uses."""
