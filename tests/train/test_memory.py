"""The memory estimate equals the bytes of the real trees it predicts."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import MoeConfig
from sao_jax.train import memory
from sao_jax.train import optim


def _nbytes(tree) -> int:
  """Bytes of the arrays in ``tree`` (arrays or jax.ShapeDtypeStructs)."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree)
             if np.ndim(x) > 0)  # Not the optimizer's scalar step counts.


@pytest.mark.parametrize("overrides", [
    dict(tie_embeddings=True),
    dict(qkv_bias=True, dtype="bfloat16"),
    dict(qkv_bias=True, scan_layers=False),  # The per-layer layout.
    # One per family's own shapes (models/families/): Qwen3's q/k norms,
    # Mistral's window, Gemma 3's four norms and mixed layers, OLMo's two
    # post-norms and full-width q/k norms, the experts.
    dict(qk_norm=True),
    dict(sliding_window=4),
    dict(norm_style="gemma", mlp_activation="gelu_tanh", qk_norm=True,
         tie_embeddings=True, sliding_window=4, local_rope_theta=10.0,
         layer_types=("sliding_attention", "full_attention")),
    dict(norm_style="olmo", qk_norm=True, qk_norm_full_width=True,
         sliding_window=4, local_rope_theta=10.0,
         layer_types=("sliding_attention", "full_attention")),
    dict(qk_norm=True, first_dense_layers=1, moe=MoeConfig(
        num_experts=4, top_k=2, intermediate_size=16)),
    dict(qk_norm=True, qkv_bias=True, rotary_dim=8, first_dense_layers=1,
         moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=16,
                       router="sigmoid", n_group=2, n_shared_experts=1)),
    dict(num_kv_heads=4, head_dim=24, kv_lora_rank=16, q_lora_rank=12,
         qk_rope_head_dim=8, v_head_dim=12, first_dense_layers=1,
         moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=16,
                       router="sigmoid", n_shared_experts=1)),
    dict(norm_style="qwen3_5", qk_norm=True, attn_output_gate=True,
         rotary_dim=4, layer_types=("linear_attention", "full_attention"),
         linear_num_key_heads=2, linear_num_value_heads=4,
         linear_key_head_dim=8, linear_value_head_dim=8,
         linear_conv_kernel_dim=4, moe=MoeConfig(
             num_experts=4, top_k=2, intermediate_size=16, n_shared_experts=1,
             shared_intermediate_size=24, shared_expert_gate=True)),
    # Gemma 4: global layers of their own shape (no v_proj), layer scalars,
    # per-layer embeddings, two KV-shared layers (no k/v, MLPs twice as
    # wide); the cache as wide as the widest layer.
    dict(norm_style="gemma4", mlp_activation="gelu_tanh", qk_norm=True,
         tie_embeddings=True, sliding_window=4, query_pre_attn_scalar=1.0,
         global_head_dim=32, global_kv_heads=1, attention_k_eq_v=True,
         per_layer_input_size=8, num_layers=4, kv_shared_layers=2,
         double_wide_mlp=True,
         layer_types=("sliding_attention", "full_attention") * 2),
], ids=["tied", "bias_bf16", "per_layer", "qwen3", "mistral", "gemma3",
        "olmo3", "qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_next",
        "gemma4"])
@pytest.mark.parametrize("frozen", [False, True])
def test_estimate_matches_the_allocated_trees(overrides, frozen):
  """The trees are those the real init, optimizers and cache functions make,
  evaluated abstractly (`jax.eval_shape`: their exact shapes and dtypes,
  which is all their bytes depend on; op-by-op eager init took 15-36 s per
  case on 2 cores)."""
  cfg = ModelConfig.tiny(vocab_size=96, **overrides)
  tok = jnp.zeros((1, 1), jnp.int32)
  policy = jax.eval_shape(lambda key: nn.unbox(transformer.Transformer(
      cfg).init(key, tok, tok, tok == 0)["params"]), jax.random.PRNGKey(0))
  value = jax.eval_shape(
      lambda p, key: transformer.value_params_from_policy(p, cfg, key),
      policy, jax.random.PRNGKey(1))
  tx = optim.make_optimizer(1e-3)
  value_tx = optim.make_optimizer(
      1e-3, labels=optim.frozen_attention_labels(value) if frozen else None)
  cache = jax.eval_shape(lambda: transformer.init_cache(cfg, 3, 40))
  est = memory.estimate_memory(cfg, kv_batch=3, kv_len=40,
                               critic_frozen_attention=frozen)
  assert est.policy_params == _nbytes(policy)
  assert est.policy_optimizer == _nbytes(jax.eval_shape(tx.init, policy))
  assert est.critic_params == _nbytes(value)
  assert est.critic_optimizer == _nbytes(jax.eval_shape(value_tx.init, value))
  assert est.kv_cache == _nbytes((cache.k, cache.v, cache.linear))
  assert est.total == sum((est.policy_params, est.policy_optimizer,
                           est.critic_params, est.critic_optimizer,
                           est.kv_cache))


def test_mla_cache_holds_the_latent_not_the_heads():
  """DeepSeek-V3's cache: 512 + 64 values per token and layer, not
  128 heads x (192 + 128)."""
  cfg = ModelConfig(vocab_size=1024, hidden_size=64, intermediate_size=64,
                    num_layers=2, num_heads=128, num_kv_heads=128,
                    head_dim=192, kv_lora_rank=512, q_lora_rank=32,
                    qk_rope_head_dim=64, v_head_dim=128, dtype="bfloat16")
  cache = jax.eval_shape(lambda: transformer.init_cache(cfg, 3, 40))
  assert cache.k.shape == (2, 3, 40, 1, 512)
  assert cache.v.shape == (2, 3, 40, 1, 64)
  est = memory.estimate_memory(cfg, kv_batch=3, kv_len=40)
  assert est.kv_cache == 2 * 3 * 40 * (512 + 64) * 2


def test_smollm2_sized_figures():
  """SmolLM2-135M: 134,515,008 fp32 params = 513 MiB; Adam doubles it."""
  cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                    tie_embeddings=True, dtype="bfloat16")
  est = memory.estimate_memory(cfg, kv_batch=32, kv_len=512)
  assert est.policy_params == 134_515_008 * 4
  assert est.policy_optimizer == 2 * est.policy_params
  assert est.critic_params == (134_515_008 + 577) * 4
  assert est.kv_cache == 2 * 30 * 32 * 512 * 3 * 64 * 2
  assert "total=" in est.summary()
