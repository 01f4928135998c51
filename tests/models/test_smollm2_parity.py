"""Real-size parity: SmolLM2-135M-Instruct, ours vs transformers, fp32 on CPU.

The converted checkpoint (tests/smollm2_checkpoint.py, cached between runs)
is loaded by `load_hf_checkpoint` for ours and by `AutoModelForCausalLM` with
eager attention for the reference. Prompts are real chat prompts in the
model's own template.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.tokenization import hf_tokenizer
from sao_jax.models import hf
from sao_jax.models import transformer as tm

import decode_parity
import smollm2_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.ref, pytest.mark.slow,
              pytest.mark.usefixtures("xla_optimized")]

QUESTIONS = [
    "What is 7 + 5?",
    "Name three primary colors.",
    "Write one sentence about the ocean and why it matters to people.",
    "Compute 3 + 4 + 9 and explain briefly.",
]


@pytest.fixture(scope="module")
def setup(pytestconfig):
  path = smollm2_checkpoint.converted_dir(pytestconfig)
  tok = hf_tokenizer.HFTokenizer.load(path)
  config, params = hf.load_hf_checkpoint(path)
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager").eval()
  prompts = [tok.encode(tok.template.format_prompt(q)) for q in QUESTIONS]
  return tok, config, params, ref, prompts


def _left_padded(prompts, pad_id):
  t = max(map(len, prompts))
  tokens = np.full((len(prompts), t), pad_id, np.int32)
  mask = np.zeros((len(prompts), t), bool)
  for i, p in enumerate(prompts):
    tokens[i, t - len(p):], mask[i, t - len(p):] = p, True
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def test_logits_match_transformers_left_padded(setup):
  tok, config, params, ref, prompts = setup
  tokens, mask, positions = _left_padded(prompts, tok.pad_id)
  assert len(set(map(len, prompts))) >= 3  # Real padding.
  ours, _ = tm.Transformer(config).apply(
      {"params": params}, jnp.asarray(tokens), jnp.asarray(positions),
      jnp.asarray(mask))
  with torch.no_grad():
    want = ref(input_ids=torch.from_numpy(tokens.astype(np.int64)),
               attention_mask=torch.from_numpy(mask.astype(np.int64)),
               position_ids=torch.from_numpy(positions.astype(np.int64))
               ).logits.numpy()
  ours = np.asarray(ours)
  delta = np.abs(ours - want)[mask]
  assert delta.max() <= 1e-3, delta.max()
  assert np.abs(want[mask]).max() > 10  # Real logits, not a degenerate case.


def test_greedy_continuation_matches_transformers_generate(setup):
  """All prompts in one batch, up to 32 tokens or the end of the turn."""
  tok, config, params, ref, prompts = setup
  n_tokens = decode_parity.check_greedy_matches_generate(
      config, params, lambda: ref, torch, prompts=prompts, alone=False,
      eos_id=tok.eos_id, stop_ids=tok.stop_ids, pad_id=tok.pad_id,
      describe=tok.decode)
  assert n_tokens >= 64  # Continuations are long enough to mean something.


def test_sampler_logprobs_equal_full_forward(setup):
  """At temperature 0.7 (the scaled log-softmax both sides must apply)."""
  tok, config, params, _, prompts = setup
  segs = decode_parity.check_sampler_logprobs_equal_full_forward(
      config, params, new_tokens=16, temperature=0.7, prompts=prompts,
      pad_id=tok.pad_id)
  assert np.mean(np.concatenate([s.logprobs for s in segs])) < -0.05
