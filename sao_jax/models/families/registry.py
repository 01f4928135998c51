"""The registry of model families (docs/design/extending.md "A model family").

Each family module (`families/<family>.py`) registers one `Family`: its HF
architecture and model_type, its config conversion both ways and its tensor
names where they differ from Llama's. `ModelConfig.from_hf_config` /
`to_hf_config` / `hf_architecture` and `models/hf_layout.py` dispatch here;
nothing outside `models/families/` names a family. Data flows one way:
config.py imports this package, never the reverse.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from sao_jax.registry import Registry
from sao_jax.models.families.errors import UnsupportedConfigError

# (our norm name, HF module name) of a decoder layer's norms: Llama's two.
LLAMA_NORMS = (("attn_norm", "input_layernorm"),
               ("mlp_norm", "post_attention_layernorm"))


@dataclasses.dataclass(frozen=True)
class Family:
  """One HF architecture.

  Attributes:
    architecture: The HF `architectures` entry, e.g. 'LlamaForCausalLM'.
    model_type: The HF `model_type`, e.g. 'llama'.
    from_hf: HF config.json dict -> every `ModelConfig` field it sets (`moe`
      as a dict of `MoeConfig` fields); raises UnsupportedConfigError for
      what the shared layers cannot represent.
    to_hf: `ModelConfig` -> the whole config.json dict; raises
      UnsupportedConfigError where this architecture cannot express it.
    claims: Whether a `ModelConfig` exports as this family by default
      (`ModelConfig.hf_architecture`); families are asked by `priority`.
    priority: Lower is asked first; the catch-all (Llama) goes last.
    norm_names: (ours, HF) names of a layer's norms, in block order.
    moe_router: The router of a mixture-of-experts family, None if dense.
    fused: (HF fused tensor, the Llama tensors it holds in row order) of a
      layer, e.g. Phi-3's ('self_attn.qkv_proj', ('self_attn.q_proj',
      'self_attn.k_proj', 'self_attn.v_proj')); () for none. A third item
      names the `ModelConfig` field counting equal row blocks that each
      hold every part's share in order (Qwen3-Next's per key head).
    skipped: HF config.json dict -> name prefixes of tensors the import
      skips (not part of the model we run: DeepSeek-V3's multi-token
      prediction layers); None: none.
  """

  architecture: str
  model_type: str
  from_hf: Callable[[Mapping[str, Any]], dict[str, Any]]
  to_hf: Callable[[Any], dict[str, Any]]
  claims: Callable[[Any], bool]
  priority: int = 50
  norm_names: tuple[tuple[str, str], ...] = LLAMA_NORMS
  moe_router: str | None = None
  fused: tuple[tuple[Any, ...], ...] = ()
  skipped: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None


# By HF architecture. A name not here is refused as UnsupportedConfigError
# with the supported ones (`get`, `of_hf_config`): a checkpoint's config.json
# names it.
_FAMILIES = Registry[Family](
    "model family", how="a module of sao_jax/models/families/ "
    "(docs/design/extending.md)", plural="model families")


def register(family: Family) -> Family:
  """Adds `family` (called once by its module at import)."""
  if family.model_type in {f.model_type for f in _FAMILIES.values()}:
    raise ValueError(f"model_type {family.model_type!r} is already "
                     "registered by another family.")
  return _FAMILIES.register(family.architecture, family)


def architectures() -> tuple[str, ...]:
  """Every registered HF architecture, in registration order."""
  return tuple(_FAMILIES)


def families() -> tuple[Family, ...]:
  return _FAMILIES.values()


def get(arch: str) -> Family:
  """The family of HF architecture `arch`."""
  if arch not in _FAMILIES:
    raise UnsupportedConfigError(
        f"Unsupported architecture {arch!r}; supported: {list(_FAMILIES)}.")
  return _FAMILIES.get(arch)


def of_hf_config(hf: Mapping[str, Any]) -> Family:
  """The family a HF config.json dict names (`architectures`, else
  `model_type`)."""
  archs = list(hf.get("architectures") or [])
  if archs:
    bad = [a for a in archs if a not in _FAMILIES]
    if bad:
      raise UnsupportedConfigError(
          f"Unsupported architecture {bad}; supported: {list(_FAMILIES)}.")
    return _FAMILIES.get(archs[0])
  model_type = hf.get("model_type")
  for family in _FAMILIES.values():
    if family.model_type == model_type:
      return family
  raise UnsupportedConfigError(
      "config has neither a supported `architectures` entry nor model_type "
      f"in {tuple(f.model_type for f in _FAMILIES.values())} (got "
      f"architectures={archs}, model_type={model_type!r}).")


def default_for(cfg: Any) -> Family:
  """The family `cfg` exports as by default: the first, by priority, that
  claims it."""
  for family in sorted(_FAMILIES.values(), key=lambda f: f.priority):
    if family.claims(cfg):
      return family
  raise UnsupportedConfigError(
      f"No registered family claims this config ({list(_FAMILIES)}).")
