"""MoE layers (sao_jax/models/layers/moe.py) against transformers and a dense
reference: routing, dropless grouped experts, replay, load-balancing loss."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import moe as moe_lib

D, E, F, K = 16, 8, 12, 2
CFG = ModelConfig(vocab_size=32, hidden_size=D, intermediate_size=24,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)


def _dense_reference(x, experts, weights, p):
  """Every expert on every token, kept where routed (the slow truth)."""
  gate = jnp.einsum("nd,edf->nef", x, p["gate_proj"])
  up = jnp.einsum("nd,edf->nef", x, p["up_proj"])
  out = jnp.einsum("nef,efd->ned", jax.nn.silu(gate) * up, p["down_proj"])
  onehot = jax.nn.one_hot(experts, E) * weights[..., None]  # [N, k, E]
  return jnp.einsum("nke,ned->nd", onehot, out)


def _params(rng, moe):
  x = jnp.zeros((1, 1, D))
  return moe_lib.MoeBlock(CFG, moe).init(rng, x)["params"]


def _unboxed(p):
  return nn.unbox(p)


@pytest.mark.parametrize("norm", [True, False])
def test_grouped_experts_equal_dense_reference(norm):
  moe = moe_lib.MoeConfig(num_experts=E, top_k=K, intermediate_size=F,
                          norm_topk_prob=norm)
  p = _unboxed(_params(jax.random.PRNGKey(0), moe))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, D))
  y, experts, _, _ = moe_lib.MoeBlock(CFG, moe).apply({"params": p}, x)
  logits = x.reshape(14, D) @ p["router_kernel"]
  r = moe_lib.route(logits, moe)
  np.testing.assert_array_equal(experts.reshape(14, K), r.experts)
  ref = _dense_reference(x.reshape(14, D), r.experts, r.weights, p)
  np.testing.assert_allclose(y.reshape(14, D), ref, atol=1e-6)
  # Renormalised weights sum to one; unnormalised ones are softmax mass < 1.
  sums = np.asarray(r.weights.sum(-1))
  if norm:
    np.testing.assert_allclose(sums, 1.0, rtol=1e-6)
  else:
    assert np.all(sums < 1.0) and np.all(sums > K / E)


def test_grouped_experts_use_ragged_dot_not_every_expert():
  moe = moe_lib.MoeConfig(num_experts=E, top_k=K, intermediate_size=F)
  p = _unboxed(_params(jax.random.PRNGKey(0), moe))
  x = jnp.ones((1, 5, D))
  jaxpr = str(jax.make_jaxpr(lambda p, x: moe_lib.MoeBlock(CFG, moe).apply(
      {"params": p}, x)[0])(p, x))
  assert jaxpr.count("= ragged_dot_general[") == 3
  # No [N, E, F] intermediate: the grouped matmuls see N*k rows, not N*E.
  assert f"f32[5,{E},{F}]" not in jaxpr and f"f32[{5 * K},{F}]" in jaxpr


def test_replay_uses_recorded_experts_and_router_gets_gradients():
  moe = moe_lib.MoeConfig(num_experts=E, top_k=K, intermediate_size=F)
  p = _unboxed(_params(jax.random.PRNGKey(0), moe))
  x = jax.random.normal(jax.random.PRNGKey(2), (1, 6, D))
  block = moe_lib.MoeBlock(CFG, moe)
  y, own, _, _ = block.apply({"params": p}, x)
  same, _, _, _ = block.apply({"params": p}, x, forced=own)
  np.testing.assert_allclose(same, y, atol=1e-7)
  forced = (own + 3) % E  # Experts the router would not choose.
  y_forced, used, _, _ = block.apply({"params": p}, x, forced=forced)
  np.testing.assert_array_equal(used, forced)
  logits = x.reshape(6, D) @ p["router_kernel"]
  probs = jax.nn.softmax(logits)
  w = jnp.take_along_axis(probs, forced.reshape(6, K), -1)
  w = w / w.sum(-1, keepdims=True)
  ref = _dense_reference(x.reshape(6, D), forced.reshape(6, K), w, p)
  np.testing.assert_allclose(y_forced.reshape(6, D), ref, atol=1e-6)
  grad = jax.grad(lambda p: block.apply({"params": p}, x, forced=forced)[0]
                  .sum())(p)
  assert float(jnp.abs(grad["router_kernel"]).sum()) > 1e-4


def test_sigmoid_group_routing_respects_groups_and_bias():
  moe = moe_lib.MoeConfig(num_experts=E, top_k=K, intermediate_size=F,
                          router="sigmoid", n_group=4, topk_group=1,
                          routed_scaling_factor=2.5)
  logits = jax.random.normal(jax.random.PRNGKey(3), (50, E))
  bias = jnp.zeros((E,)).at[5].set(10.0)  # Expert 5 always wins its group.
  r = moe_lib.route(logits, moe, bias)
  experts = np.asarray(r.experts)
  assert np.all(experts // 2 == 2)  # One group of two: experts 4 and 5.
  assert np.all((experts == 5).any(-1))
  np.testing.assert_allclose(np.asarray(r.weights).sum(-1), 2.5, rtol=1e-5)


@pytest.mark.ref
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_block_matches_transformers(family):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  if family == "qwen3_moe":
    hf_cfg = transformers.Qwen3MoeConfig(
        hidden_size=D, num_experts=E, num_experts_per_tok=K,
        moe_intermediate_size=F, norm_topk_prob=True)
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mod  # pylint: disable=g-import-not-at-top
    block = mod.Qwen3MoeSparseMoeBlock(hf_cfg)
    moe = moe_lib.MoeConfig(num_experts=E, top_k=K, intermediate_size=F)
  else:
    hf_cfg = transformers.Glm4MoeConfig(
        hidden_size=D, n_routed_experts=E, num_experts_per_tok=K,
        moe_intermediate_size=F, n_group=2, topk_group=1,
        routed_scaling_factor=1.5, n_shared_experts=1, norm_topk_prob=True)
    from transformers.models.glm4_moe import modeling_glm4_moe as mod  # pylint: disable=g-import-not-at-top
    block = mod.Glm4MoeMoE(hf_cfg)
    moe = moe_lib.MoeConfig(num_experts=E, top_k=K, intermediate_size=F,
                            router="sigmoid", n_group=2, topk_group=1,
                            routed_scaling_factor=1.5, n_shared_experts=1)
  with torch.no_grad():
    for _, t in list(block.named_parameters()) + list(block.named_buffers()):
      t.copy_(0.3 * torch.randn_like(t))
  sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
  gate_up = sd["experts.gate_up_proj"]  # [E, 2F, D]
  p = {"router_kernel": sd["gate.weight"].T,
       "gate_proj": gate_up[:, :F].transpose(0, 2, 1),
       "up_proj": gate_up[:, F:].transpose(0, 2, 1),
       "down_proj": sd["experts.down_proj"].transpose(0, 2, 1)}
  if family == "glm4_moe":
    p["router_bias"] = sd["gate.e_score_correction_bias"]
    p["shared_gate_proj"] = sd["shared_experts.gate_proj.weight"].T
    p["shared_up_proj"] = sd["shared_experts.up_proj.weight"].T
    p["shared_down_proj"] = sd["shared_experts.down_proj.weight"].T
  x = np.random.default_rng(0).normal(size=(2, 9, D)).astype(np.float32)
  with torch.no_grad():
    want = block(torch.from_numpy(x)).numpy()
  got, _, _, _ = moe_lib.MoeBlock(CFG, moe).apply(
      {"params": jax.tree.map(jnp.asarray, p)}, jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


@pytest.mark.ref
def test_load_balancing_loss_matches_transformers():
  torch = pytest.importorskip("torch")
  from transformers.models.qwen3_moe import modeling_qwen3_moe as mod  # pylint: disable=g-import-not-at-top
  logits = np.random.default_rng(1).normal(size=(2 * 6, E)).astype(np.float32)
  mask = np.ones((2, 6), np.int64)
  mask[0, :2] = 0  # Left padding is left out of the loss.
  want = float(mod.load_balancing_loss_func(
      (torch.from_numpy(logits),), E, K, torch.from_numpy(mask)))
  moe = moe_lib.MoeConfig(num_experts=E, top_k=K, intermediate_size=F)
  got = moe_lib.load_balancing_loss(
      moe_lib.route(jnp.asarray(logits), moe), jnp.asarray(mask))
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
