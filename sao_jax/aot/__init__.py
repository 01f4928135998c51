"""Ahead-of-time compile of a run for a TPU slice (docs/DESIGN.md §10)."""
