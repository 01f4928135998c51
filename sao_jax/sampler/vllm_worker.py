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
    _refresh_tied_head(self.model_runner.get_model())  # pytype: disable=attribute-error
    return len(tensors)


def _refresh_tied_head(model) -> None:
  """Processes a tied LM head's weight again after a reload.

  A head tied to the embedding (``tie_word_embeddings``) shares its tensor,
  so the reload writes it but never processes the head as a loaded layer:
  on a CPU the head keeps the GEMM its load packed from the first weights
  (``dispatch_cpu_unquantized_gemm``), and a tied model (SmolLM2) sampled
  with those whatever was pushed.
  """
  head = getattr(model, "lm_head", None)
  method = getattr(head, "quant_method", None)
  if (getattr(getattr(model, "config", None), "tie_word_embeddings", False)
      and hasattr(method, "process_weights_after_loading")):
    method.process_weights_after_loading(head)
