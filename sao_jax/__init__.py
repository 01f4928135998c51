"""sao_jax package."""
