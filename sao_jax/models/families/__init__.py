"""Per-family HF config conversion (docs/DESIGN.md §8, "Adding a family")."""
