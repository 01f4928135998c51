"""Real-size parity: SmolLM2-135M-Instruct, ours vs transformers, fp32 on CPU.

The converted checkpoint (tests/smollm2_checkpoint.py, cached between runs)
is loaded by `load_hf_checkpoint` for ours and by `AutoModelForCausalLM` with
eager attention for the reference. Prompts are real chat prompts in the
model's own template.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.tokenization import hf_tokenizer
from sao_jax.models import hf
from sao_jax.models import transformer as tm
from sao_jax.models.logprobs import token_logprobs
from sao_jax.sampler import generate as gen_lib
from sao_jax.sampler import sampling

import smollm2_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.ref, pytest.mark.slow]

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
  tok, config, params, ref, prompts = setup
  ours = gen_lib.generate(
      params, config, prompts, jax.random.PRNGKey(0), max_new_tokens=32,
      sampling=sampling.SamplingParams(greedy=True), stop_ids=tok.stop_ids)
  n_tokens = 0
  for prompt, seg in zip(prompts, ours):
    with torch.no_grad():
      out = ref.generate(torch.tensor([prompt]), max_new_tokens=32,
                         do_sample=False, eos_token_id=tok.eos_id,
                         pad_token_id=tok.pad_id)
    want = out[0, len(prompt):].tolist()
    assert list(seg.tokens) == want, (tok.decode(seg.tokens), tok.decode(want))
    n_tokens += len(want)
  assert n_tokens >= 64  # Continuations are long enough to mean something.


def test_sampler_logprobs_equal_full_forward(setup):
  """At temperature 0.7 (the scaled log-softmax both sides must apply)."""
  tok, config, params, _, prompts = setup
  temperature = 0.7
  segs = gen_lib.generate(
      params, config, prompts, jax.random.PRNGKey(3), max_new_tokens=16,
      sampling=sampling.SamplingParams(temperature=temperature))
  histories = [p + list(s.tokens) for p, s in zip(prompts, segs)]
  t = max(map(len, histories))
  tokens = np.full((len(histories), t), tok.pad_id, np.int32)
  mask = np.zeros((len(histories), t), bool)
  for i, h in enumerate(histories):  # Right-padded, as the trainer packs.
    tokens[i, :len(h)], mask[i, :len(h)] = h, True
  full = np.asarray(token_logprobs(params, config, jnp.asarray(tokens),
                                   jnp.asarray(mask), temperature))
  for p, s, row in zip(prompts, segs, full):
    assert len(s.tokens) == 16
    np.testing.assert_allclose(s.logprobs, row[len(p):len(p) + 16],
                               atol=1e-4, rtol=0)
  assert np.mean(np.concatenate([s.logprobs for s in segs])) < -0.05
