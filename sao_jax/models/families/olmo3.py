"""OLMo 3 (`Olmo3ForCausalLM`, model_type olmo3).

OLMo 2's post-norm blocks and full-width q/k norms (families/olmo2.py) with
sliding-window layers interleaved with full ones (`layer_types`, by default
three sliding then one full), each kind with its own RoPE: the full layers'
`rope_theta` and scaling (OLMo 3's long-context YaRN), the sliding layers'
base without scaling (`local_rope_theta`), as Gemma 3's.
docs/design/extending.md "A model family".
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import olmo2
from sao_jax.models.families import registry
from sao_jax.models.families.errors import UnsupportedConfigError
from sao_jax.models.layers import rope as rope_lib

ARCH = "Olmo3ForCausalLM"
_DEFAULT_THETA = 500000.0  # transformers' Olmo3Config.default_theta.


def _rope(hf: Mapping[str, Any]) -> tuple[float, Any, float]:
  """(full layers' theta, their scaling, sliding layers' theta), from the
  per-kind `rope_parameters` (transformers 5) or `rope_theta` and
  `rope_scaling` (transformers 4: the scaling is the full layers')."""
  params = hf.get("rope_parameters") or {}
  theta = hf.get("rope_theta", _DEFAULT_THETA)
  if "full_attention" in params or "sliding_attention" in params:
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
  else:
    full = dict(params or hf.get("rope_scaling") or {})
    local = {}
  full.setdefault("rope_theta", theta)
  local.setdefault("rope_theta", theta)
  local_type = local.get("rope_type", local.get("type", "default"))
  if local_type != "default":
    raise UnsupportedConfigError(
        f"OLMo 3 sliding-layer RoPE scaling {local} is not supported (only "
        "the full layers' RoPE may be scaled).")
  rope_type = full.get("rope_type", full.get("type", "default"))
  if rope_type in ("dynamic", "yarn") and hf.get("max_position_embeddings"):
    full.setdefault("max_position_embeddings", hf["max_position_embeddings"])
  full_theta = float(full.pop("rope_theta"))
  try:
    scaling = rope_lib.normalize_scaling(full)
  except ValueError as e:
    raise UnsupportedConfigError(f"OLMo 3 RoPE scaling: {e}") from e
  return full_theta, scaling, float(local["rope_theta"])


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF OLMo 3 config."""
  n = int(hf["num_hidden_layers"])
  types = tuple(hf.get("layer_types") or (
      "sliding_attention" if (i + 1) % 4 else "full_attention"
      for i in range(n)))
  window = int(hf.get("sliding_window") or 0)
  if "sliding_attention" in types and window < 1:
    raise UnsupportedConfigError(
        f"OLMo 3 sliding_window={hf.get('sliding_window')} must be >= 1 "
        "when layer_types has sliding layers.")
  theta, scaling, local_theta = _rope(hf)
  base = common.base_from_hf({**hf, "rope_parameters": None,
                              "rope_scaling": None})
  if "sliding_attention" not in types:  # Full layers only: OLMo 2's config.
    types, window, local_theta = (), 0, 0.0
  return {**base, **olmo2.block_fields(hf, "OLMo 3"), "rope_theta": theta,
          "rope_scaling": scaling, "layer_types": types,
          "sliding_window": window, "local_rope_theta": local_theta}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF OLMo 3 config.json dict of `cfg`."""
  common.check_export(cfg, ARCH, qk_norm=(True,), norm_style="olmo",
                      full_width_qk=True, sliding=True, layer_types=True)
  types = list(cfg.layer_types) or [
      "sliding_attention" if cfg.sliding_window else "full_attention"
  ] * cfg.num_layers
  return {**common.base_to_hf(cfg, ARCH, "olmo3"), "attention_bias": False,
          "layer_types": types, "sliding_window": cfg.sliding_window or None,
          "rope_parameters": {
              "full_attention": common.rope_parameters(cfg),
              "sliding_attention": {
                  "rope_type": "default",
                  "rope_theta": cfg.local_rope_theta or cfg.rope_theta}}}


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="olmo3", from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: cfg.norm_style == "olmo" and bool(
        cfg.layer_types or cfg.sliding_window),
    priority=11, norm_names=olmo2.NORM_NAMES))
