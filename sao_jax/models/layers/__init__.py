"""Shared layers of the model families (norms, rotary, attention, MLPs, KV cache)."""
