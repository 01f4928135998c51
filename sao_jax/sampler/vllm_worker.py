"""What the vLLM engine adds to vLLM's workers (``worker_extension_cls``).

vLLM mixes `WeightLoader` into its worker (in the engine-core process); the
sampler calls its method through ``AsyncLLM.collective_rpc``. It imports
nothing of sao_jax (a worker runs torch, not JAX) and only torch's
safetensors reader.
"""

from __future__ import annotations


class WeightLoader:
  """Loads weights in place from a safetensors file (HF names)."""

  def sao_load_weights(self, path: str) -> int:
    """Reads ``path`` (memory-mapped) and hands its tensors to the worker's
    ``reload_weights`` (in place, the engine's own loaders: fused QKV,
    tied embeddings); returns the number of tensors."""
    import safetensors.torch  # pylint: disable=g-import-not-at-top

    tensors = safetensors.torch.load_file(path, device="cpu")
    self.reload_weights(weights_iterator=iter(tensors.items()))  # pytype: disable=attribute-error
    return len(tensors)
