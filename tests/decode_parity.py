"""Decode-path parity checks shared by the family parity tests.

The sampler's greedy continuation equals transformers' `generate`, and the
log-probs the sampler records equal the trainer's full forward (the
sampler's KV-cache path and the trainer's path compute the same model).
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models.logprobs import token_logprobs
from sao_jax.sampler import generate as gen_lib
from sao_jax.sampler import sampling

PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 2, 3, 4, 5, 6, 8, 9],
           [11, 120, 64, 33, 2, 90, 71]]


def check_greedy_matches_generate(
    config, params, load_hf_model: Callable[[], Any], torch,
    new_tokens: int = 32, *, prompts: Sequence[list[int]] = PROMPTS,
    alone: bool = True, eos_id: int | None = None,
    stop_ids: Sequence[int] = (), pad_id: int = 0,
    describe: Callable[[Sequence[int]], str] | None = None) -> int:
  """Greedy continuations of `prompts`: ours equal transformers' `generate`.

  By default each prompt alone, on a freshly loaded HF model (dynamic RoPE
  depends on the batch's longest row, and HF's keeps the longest length it
  has seen), exactly `new_tokens` long (no end-of-sequence token).

  Args:
    config: our model config.
    params: our model params.
    load_hf_model: returns the transformers model, once per prompt.
    torch: the torch module.
    new_tokens: the most tokens per continuation.
    prompts: token prompts.
    alone: ours generates each prompt alone; False: all in one batch.
    eos_id: HF stops at this token (ours at `stop_ids`); None: no stop,
      every continuation is `new_tokens` long.
    stop_ids: our generator's stop tokens.
    pad_id: HF's pad token.
    describe: turns tokens into the text a failure shows (None: none).

  Returns:
    The number of tokens generated, all prompts together.
  """
  key = jax.random.PRNGKey(0)
  greedy = sampling.SamplingParams(greedy=True)
  if alone:
    ours = [gen_lib.generate(params, config, [p], key,
                             max_new_tokens=new_tokens, sampling=greedy,
                             stop_ids=stop_ids)[0] for p in prompts]
  else:
    ours = gen_lib.generate(params, config, prompts, key,
                            max_new_tokens=new_tokens, sampling=greedy,
                            stop_ids=stop_ids)
  n_tokens = 0
  for prompt, seg in zip(prompts, ours):
    hf_model = load_hf_model()
    if eos_id is None:
      hf_model.generation_config.eos_token_id = None
      stop = dict(min_new_tokens=new_tokens)
    else:
      stop = dict(eos_token_id=eos_id)
    with torch.no_grad():
      out = hf_model.generate(torch.tensor([prompt]), do_sample=False,
                              max_new_tokens=new_tokens, pad_token_id=pad_id,
                              **stop)
    want = out[0, len(prompt):].tolist()
    if describe is None:
      assert list(seg.tokens) == want
    else:
      assert list(seg.tokens) == want, (describe(seg.tokens), describe(want))
    if eos_id is None:
      assert len(want) == new_tokens
    n_tokens += len(want)
  return n_tokens


def check_sampler_logprobs_equal_full_forward(
    config, params, new_tokens: int = 16, temperature: float = 0.7, *,
    prompts: Sequence[list[int]] = PROMPTS,
    pad_id: int = 0) -> list[gen_lib.Segment]:
  """Sampled continuations' recorded log-probs equal the trainer's forward
  on the right-padded histories (at `temperature`: the scaled log-softmax
  both sides must apply). Returns the continuations."""
  segs = gen_lib.generate(
      params, config, prompts, jax.random.PRNGKey(3),
      max_new_tokens=new_tokens,
      sampling=sampling.SamplingParams(temperature=temperature))
  histories = [p + list(s.tokens) for p, s in zip(prompts, segs)]
  t = max(map(len, histories))
  tokens = np.full((len(histories), t), pad_id, np.int32)
  mask = np.zeros((len(histories), t), bool)
  for i, h in enumerate(histories):  # Right-padded, as the trainer packs.
    tokens[i, :len(h)], mask[i, :len(h)] = h, True
  full = np.asarray(token_logprobs(params, config, jnp.asarray(tokens),
                                   jnp.asarray(mask), temperature))
  for p, s, row in zip(prompts, segs, full):
    assert len(s.tokens) == new_tokens
    np.testing.assert_allclose(s.logprobs, row[len(p):len(p) + new_tokens],
                               atol=1e-4, rtol=0)
  return segs
