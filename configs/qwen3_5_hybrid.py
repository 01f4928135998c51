r"""A real-size Qwen3.5 hybrid decoder, for checking against TPU slices.

The text decoder of transformers' ``Qwen3_5TextConfig`` defaults
(``Qwen3_5ForCausalLM``, 8,953,803,264 parameters): hidden 4096, 32 layers
in 8 repeats of three Gated DeltaNet linear-attention layers (16 key / 32
value heads of 128, a 4-tap conv) and one gated full-attention layer (16 / 4
heads of 256, RoPE on a quarter of each head), MLP 12,288, vocabulary
248,320; ``models/hf.py`` loads such a checkpoint with
``--config.model.init_from=DIR``. The linear layers train through the
chunked gated delta rule (memory linear in tokens) and the sampler keeps
their fixed-size state. At 8k tokens per trajectory on a v5p-64 laid out as
configs/qwen2_5_7b.py (bfloat16 compute over float32 master weights, remat
'full', the state FSDP-sharded over the trainer's 16 chips, the sampler on
chip 2 of each host). Check it before renting the slice:

  python -m sao_jax.aot --config=configs/qwen3_5_hybrid.py --topology=v5p-64

``configs/qwen3_5_hybrid.py:4`` keeps the first 4 layers (one repeat of
the pattern: a scanned program compiles one repeat's body at any depth).

What fits is in BENCHMARKS.md ("TPU slices on paper", Qwen3.5 hybrid).
"""

import ml_collections

from configs import base
from configs import qwen2_5_7b

# One repeat of the layer pattern (HF full_attention_interval 4).
PATTERN = ("linear_attention",) * 3 + ("full_attention",)


def get_config(layers: str = "32") -> ml_collections.ConfigDict:
  """The run with the first ``layers`` of the 32 (a multiple of 4)."""
  if not layers.isdigit() or int(layers) % len(PATTERN) or not (
      0 < int(layers) <= 32):
    raise ValueError(f"layers {layers!r}: expected a multiple of "
                     f"{len(PATTERN)} (the layer pattern) up to 32.")
  config = base.get_config()
  length = 8192

  m = config.model  # transformers' Qwen3_5TextConfig() defaults.
  m.vocab_size = 248320
  m.hidden_size = 4096
  m.intermediate_size = 12288
  m.num_layers = int(layers)
  m.num_heads = 16
  m.num_kv_heads = 4
  m.head_dim = 256
  m.rotary_dim = 64  # partial_rotary_factor 0.25.
  m.rope_theta = 10000.0
  m.rms_norm_eps = 1e-6
  m.qk_norm = True
  m.attn_output_gate = True
  m.norm_style = "qwen3_5"
  m.tie_embeddings = False
  m.layer_types = PATTERN * (m.num_layers // len(PATTERN))
  m.linear_num_key_heads = 16
  m.linear_num_value_heads = 32
  m.linear_key_head_dim = 128
  m.linear_value_head_dim = 128
  m.linear_conv_kernel_dim = 4
  m.param_dtype = "float32"  # Master weights and AdamW moments.

  return qwen2_5_7b.v5p_layout(config, length, ring_bytes=256 * 2**20)
