"""ipc package."""
