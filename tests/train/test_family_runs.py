"""A tiny random checkpoint of each newly supported family trains with SAO.

Llama 3.x (`rope_type` llama3, Llama 3.2's chat template), Qwen3 (q/k norms,
its template with thinking off and JSON tool calls, the calculator tool
env), Mistral (a sliding window of 4, shorter than every sequence; Llama
3.2's template, there being no Mistral template fixture), Gemma 3 (mixed
sliding/full layers, its own template), Gemma 4 (Gemma 3's template; its
global layers wider, one key/value head shared as keys and values, a
logit cap, per-layer embeddings, its last layer attending with the
previous one's keys and values), Phi-3 (fused projections, half
the head rotated, a window of 4), SmolLM3 (its one layer NoPE; RoPE and
NoPE layers mixed are its parity row's), OLMo 2 (post-norm blocks,
full-width q/k norms), OLMo 3 (OLMo 2's blocks, a sliding then a full
layer), Qwen3.5 (a Gated DeltaNet layer then a gated full-attention one
rotating a quarter of each head, dense; Qwen3's template),
DeepSeek-V3 (a dense layer then a MoE layer, both with multi-head latent
attention; all four with Llama 3.2's template), Qwen3-Next (a Gated
DeltaNet layer then a gated full-attention one, each with routed experts
and a gated shared expert; Qwen3's template; the trainer replays the
sampler's routing) and Qwen3-MoE (a dense first
layer then a MoE layer; Qwen3's template; GLM-4.5's run, 2-3x as long, is
left out: its routing is run through the step in test_train_sharding.py and
test_routing_sampler.py): a checkpoint directory built with transformers
(random weights) plus the family's tiny tokenizer
(tests/family_tokenizers.py) runs `train_and_evaluate` with
`model.init_from=DIR`, `tokenizer.path=DIR` for a few synchronous SAO steps:
the run finishes and trains every step.
"""

import dataclasses
import json

import pytest

from sao_jax.models.config import ModelConfig
from sao_jax.train import loop
from sao_jax.tokenization import hf_tokenizer

import family_tokenizers
from tiny_settings import tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.ref, pytest.mark.slow, pytest.mark.multiprocess]

_ARCH = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             tie_word_embeddings=True)
_LLAMA3_ENV = {"env.chat_template_kwargs": {"date_string": "26 Jul 2024"}}
_MOE = dict(moe_intermediate_size=16, num_hidden_layers=2,
            num_experts_per_tok=2, norm_topk_prob=True)
# family -> (tokenizer of tests/family_tokenizers.py, HF config, env keys).
FAMILIES = {
    "llama3": ("llama3", lambda vocab: transformers.LlamaConfig(
        vocab_size=vocab, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, **_ARCH), _LLAMA3_ENV),
    "qwen3": ("qwen3", lambda vocab: transformers.Qwen3Config(
        vocab_size=vocab, **_ARCH),
              {"env.name": "tool", "env.max_turns": 2,
               "env.chat_template_kwargs": {"enable_thinking": False}}),
    "mistral": ("llama3", lambda vocab: transformers.MistralConfig(
        vocab_size=vocab, sliding_window=4, **_ARCH), _LLAMA3_ENV),
    "gemma3": ("gemma3", lambda vocab: transformers.Gemma3TextConfig(
        vocab_size=vocab, sliding_window=4, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
        **{**_ARCH, "num_hidden_layers": 2}), {}),
    "gemma4": ("gemma3", lambda vocab: transformers.Gemma4TextConfig(
        vocab_size=vocab, sliding_window=4, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab,
        num_kv_shared_layers=1, use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention",
                     "full_attention"],
        **{**_ARCH, "num_hidden_layers": 3}), {}),
    "phi3": ("llama3", lambda vocab: transformers.Phi3Config(
        vocab_size=vocab, pad_token_id=0, sliding_window=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5}, **_ARCH),
             _LLAMA3_ENV),
    "smollm3": ("llama3", lambda vocab: transformers.SmolLM3Config(
        vocab_size=vocab, pad_token_id=0, no_rope_layer_interval=1,
        **_ARCH), _LLAMA3_ENV),
    "olmo3": ("llama3", lambda vocab: transformers.Olmo3Config(
        vocab_size=vocab, pad_token_id=0, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        **{**_ARCH, "num_hidden_layers": 2}), _LLAMA3_ENV),
    "olmo2": ("llama3", lambda vocab: transformers.Olmo2Config(
        vocab_size=vocab, pad_token_id=0, **_ARCH), _LLAMA3_ENV),
    "deepseek_v3": ("llama3", lambda vocab: transformers.DeepseekV3Config(
        vocab_size=vocab, pad_token_id=0, n_routed_experts=4, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        **{**_ARCH, **_MOE, "num_key_value_heads": 2}), _LLAMA3_ENV),
    "qwen3_moe": ("qwen3", lambda vocab: transformers.Qwen3MoeConfig(
        vocab_size=vocab, num_experts=4, mlp_only_layers=[0],
        **{**_ARCH, **_MOE}), {
            "env.chat_template_kwargs": {"enable_thinking": False}}),
    "qwen3_next": ("qwen3", lambda vocab: transformers.Qwen3NextConfig(
        vocab_size=vocab, num_experts=4, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8,
        **{**_ARCH, **_MOE}), {
            "env.chat_template_kwargs": {"enable_thinking": False},
            "model.routing_replay": "rollout"}),
    "qwen3_5": ("qwen3", lambda vocab: transformers.Qwen3_5TextConfig(
        vocab_size=vocab, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        **{**_ARCH, "num_hidden_layers": 2}), {
            "env.chat_template_kwargs": {"enable_thinking": False}}),
}
# ModelConfig fields that are run settings, not the checkpoint's.
_RUN_KEYS = ("dtype", "param_dtype", "logits_chunk", "attention",
             "attention_block_q", "attention_block_kv", "scan_layers",
             "remat_policy")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_checkpoint_trains_with_sao(family, tmp_path):
  tokenizer, make_config, env_overrides = FAMILIES[family]
  ckpt = family_tokenizers.build(tokenizer, tmp_path / "ckpt")
  vocab = hf_tokenizer.HFTokenizer.load(ckpt, {"date_string": "x"}).vocab_size
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(make_config(vocab))
  model.save_pretrained(ckpt)
  mcfg = ModelConfig.from_hf_config(json.loads(
      (ckpt / "config.json").read_text()))
  assert mcfg.hf_architecture() == type(model).__name__
  fields = {k: v for k, v in dataclasses.asdict(mcfg).items()
            if k not in _RUN_KEYS and v is not None}
  fields["rope_scaling"] = dict(mcfg.rope_scaling)
  fields.update({f"moe.{k}": v for k, v in (fields.pop("moe", None) or
                                             {}).items()})
  model_overrides = {f"model.{k}": v for k, v in fields.items()}
  config = tiny_config(**{
      **model_overrides, **env_overrides,
      "model.init_from": str(ckpt), "tokenizer.path": str(ckpt),
      # No critic warm-up step: its critic-only program would be one more
      # compile per family (the warm-up is test_loop.py's, on every run).
      "train.mode": "sync", "train.num_steps": 2, "train.checkpoint_every": 0,
      "rl.critic_warmup_steps": 0,
      # Lengths derived from the family's prompts (task_sizing): 32-64
      # tokens, 480 for Qwen3's tool prompt; every window above is shorter.
      "sampler.max_total_tokens": 0, "train.max_seq_len": 0,
      "sampler.max_new_tokens": 8})
  summary = loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert summary["steps"] == 2  # Two SAO steps.
  assert summary["trajectories_trained"] == 2 * 8
  assert summary["policy_version"] == 2
