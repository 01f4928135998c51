"""Ahead-of-time compile of a run for a TPU slice (docs/design/pods.md "Checking
before renting")."""
