"""The sampler on scanned layers (the cache in the layer scan's carry,
written in place) samples what it samples on the unrolled layers.

Same weights, stacked or not (one HF checkpoint loaded in each layout): a
prompt prefill of
uneven rows, a sampled decode chunk with per-row keys, an observation
appended to some rows (`append_rows`) and a second chunk on a subset of rows
(`decode_rows`) give the same tokens, log-probs within 1e-5 and, for a MoE
policy, the same recorded experts. Rows: dense with mixed sliding / full
layers, MLA + MoE after a dense layer (two scanned stages sharing the
cache), and a hybrid linear-attention decoder over two repeats of its
pattern (the linear states in the carry too).
"""

import jax
import numpy as np
import pytest

from sao_jax.models import hf
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import MoeConfig
from sao_jax.sampler.generate import Generator
from sao_jax.sampler.sampling import SamplingParams
from tiny_models import init_params

CONFIGS = {
    "dense_sliding": ModelConfig.tiny(  # Gemma 3's layers.
        vocab_size=64, num_layers=3, norm_style="gemma",
        mlp_activation="gelu_tanh", qk_norm=True, tie_embeddings=True,
        sliding_window=4, local_rope_theta=10.0, query_pre_attn_scalar=16.0,
        layer_types=("sliding_attention", "full_attention",
                     "sliding_attention")),
    "mla_moe": ModelConfig.tiny(
        vocab_size=64, num_layers=3, num_kv_heads=4, head_dim=24,
        kv_lora_rank=16, q_lora_rank=8, qk_rope_head_dim=8, v_head_dim=12,
        first_dense_layers=1, moe=MoeConfig(
            num_experts=4, top_k=2, intermediate_size=16, router="sigmoid",
            n_shared_experts=1)),
    "hybrid": ModelConfig.tiny(
        vocab_size=64, num_layers=4, norm_style="qwen3_5", qk_norm=True,
        attn_output_gate=True, rotary_dim=4,
        layer_types=("linear_attention", "full_attention") * 2,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4),
}


def _run(cfg, params):
  """Prefill, decode, observation on rows 1 and 3, decode rows 1-3."""
  gen = Generator(cfg, params, 4, 48, SamplingParams(temperature=0.9),
                  min_bucket=4)
  rng = np.random.default_rng(0)
  gen.append([list(rng.integers(1, 64, n)) for n in (5, 9, 3, 7)])
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(7), i))(
      np.arange(4))
  first = gen.generate([], 6, row_keys=keys)
  gen.append([[], [11, 12, 13], [], [14]])
  second = gen.generate([], [0, 5, 4, 5], active=[False, True, True, True],
                        row_keys=keys)
  experts = [gen.row_experts(i) for i in range(4)]
  return first + second, experts


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_scanned_decode_matches_unrolled(name, tmp_path):
  tok = np.zeros((1, 4), np.int32)
  hf.save_hf_checkpoint(CONFIGS[name], init_params(
      transformer.Transformer(CONFIGS[name]), jax.random.PRNGKey(1), tok, tok,
      tok > -1)["params"], str(tmp_path))
  cfg, stacked = hf.load_hf_checkpoint(str(tmp_path))
  assert cfg.scan_layers
  scanned, experts_s = _run(cfg, stacked)
  unrolled, experts_u = _run(*hf.load_hf_checkpoint(str(tmp_path),
                                                    scan_layers=False))
  assert sum(len(s.tokens) for s in scanned) == 4 * 6 + 14
  for a, b in zip(scanned, unrolled):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
  assert min(float(s.logprobs.min()) for s in scanned if len(s.tokens)) < -1
  for a, b in zip(experts_s, experts_u):
    if cfg.moe is None:
      assert a is None and b is None
    else:
      assert a.shape == (len(a), cfg.num_moe_layers, cfg.moe.top_k)
      np.testing.assert_array_equal(a, b)
