"""Decode-path parity checks shared by the family parity tests.

The sampler's greedy continuation equals transformers' `generate`, and the
log-probs the sampler records equal the trainer's full forward (the
sampler's KV-cache path and the trainer's path compute the same model).
"""

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models.logprobs import token_logprobs
from sao_jax.sampler import generate as gen_lib
from sao_jax.sampler import sampling

PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 2, 3, 4, 5, 6, 8, 9],
           [11, 120, 64, 33, 2, 90, 71]]


def check_greedy_matches_generate(config, params, load_hf_model, torch,
                                  new_tokens=32):
  """Each prompt alone, on a freshly loaded HF model: dynamic RoPE depends on
  the batch's longest row, and HF's keeps the longest length it has seen."""
  for prompt in PROMPTS:
    hf_model = load_hf_model()
    hf_model.generation_config.eos_token_id = None
    ours = gen_lib.generate(
        params, config, [prompt], jax.random.PRNGKey(0),
        max_new_tokens=new_tokens,
        sampling=sampling.SamplingParams(greedy=True))[0]
    with torch.no_grad():
      out = hf_model.generate(torch.tensor([prompt]), do_sample=False,
                              max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    assert list(ours.tokens) == want
    assert len(want) == new_tokens


def check_sampler_logprobs_equal_full_forward(config, params, new_tokens=16,
                                              temperature=0.7):
  segs = gen_lib.generate(
      params, config, PROMPTS, jax.random.PRNGKey(3),
      max_new_tokens=new_tokens,
      sampling=sampling.SamplingParams(temperature=temperature))
  histories = [p + list(s.tokens) for p, s in zip(PROMPTS, segs)]
  t = max(map(len, histories))
  tokens = np.zeros((len(histories), t), np.int32)
  mask = np.zeros((len(histories), t), bool)
  for i, h in enumerate(histories):  # Right-padded, as the trainer packs.
    tokens[i, :len(h)], mask[i, :len(h)] = h, True
  full = np.asarray(token_logprobs(params, config, jnp.asarray(tokens),
                                   jnp.asarray(mask), temperature))
  for p, s, row in zip(PROMPTS, segs, full):
    assert len(s.tokens) == new_tokens
    np.testing.assert_allclose(s.logprobs, row[len(p):len(p) + new_tokens],
                               atol=1e-4, rtol=0)
