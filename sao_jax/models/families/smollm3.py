"""SmolLM3 (`SmolLM3ForCausalLM`, model_type smollm3).

Llama's layers and tensor names, with NoPE layers: HF `no_rope_layers[i]`
0 leaves layer i's q and k unrotated (`ModelConfig.nope_layers`; by default
every `no_rope_layer_interval`-th layer, 4 in SmolLM3-3B). Its optional
sliding window over the NoPE layers (`use_sliding_window`) is refused.
docs/design/extending.md "A model family".
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry
from sao_jax.models.families.errors import UnsupportedConfigError

ARCH = "SmolLM3ForCausalLM"


def _nope_layers(hf: Mapping[str, Any], n: int) -> tuple[int, ...]:
  """The layers HF's `no_rope_layers` (1: RoPE, 0: NoPE) leave unrotated."""
  flags = hf.get("no_rope_layers")
  if flags is None:  # transformers' default: every interval-th layer.
    interval = int(hf.get("no_rope_layer_interval", 4))
    flags = [int((i + 1) % interval != 0) for i in range(n)]
  if len(flags) < n or not set(flags[:n]) <= {0, 1}:
    raise UnsupportedConfigError(
        f"SmolLM3 no_rope_layers={flags} must hold a 0 (NoPE) or 1 (RoPE) for "
        f"each of the {n} layers.")
  return tuple(i for i in range(n) if not flags[i])


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF SmolLM3 config."""
  common.refuse(hf, "SmolLM3", "attention_bias", "mlp_bias",
                "use_sliding_window")
  types = set(hf.get("layer_types") or ())
  if types - {"full_attention"}:
    raise UnsupportedConfigError(
        f"SmolLM3 layer_types with {sorted(types)}: only full attention is "
        "supported (no sliding window).")
  n = int(hf["num_hidden_layers"])
  return {**common.base_from_hf(hf), "qkv_bias": False, "qk_norm": False,
          "nope_layers": _nope_layers(hf, n)}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF SmolLM3 config.json dict of `cfg`."""
  common.check_export(cfg, ARCH, nope=True)
  nope = set(cfg.nope_layers)
  return {**common.base_to_hf(cfg, ARCH, "smollm3"),
          "no_rope_layers": [int(i not in nope)
                             for i in range(cfg.num_layers)],
          "layer_types": ["full_attention"] * cfg.num_layers,
          "use_sliding_window": False, "sliding_window": None,
          "attention_bias": False, "mlp_bias": False,
          # SmolLM3Config's default pad id (128004) must lie in the
          # vocabulary; the tokenizer's files carry the real one.
          "pad_token_id": None}


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="smollm3", from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: bool(cfg.nope_layers), priority=15))
