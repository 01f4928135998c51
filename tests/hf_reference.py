"""The family parity tests' shared pieces: a random transformers checkpoint,
a left-padded batch, logits of a transformers model and of ours on it, and
checks several families run the same way: packed rows and greedy decoding
through the KV cache.

Needs the `ref` extra (torch, transformers); importers skip without it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch

from sao_jax.models import hf
from sao_jax.models import transformer as tm
from sao_jax.sampler import generate as generate_lib
from sao_jax.sampler.sampling import SamplingParams


def save_random_model(model_class, config, path, *, scale: float = 0.2,
                      norm_center: float | None = 1.0, norm_scale: float = 0.2,
                      buffers: bool | tuple[str, ...] = False):
  """A transformers model with every weight random, saved to `path`.

  Seeds torch with 0, builds `model_class(config)` in eval mode and replaces
  each weight by `scale` * N(0, 1) noise, in `named_parameters` order; a
  `*norm.weight` by `norm_center` + `norm_scale` * N(0, 1) (transformers
  inits RMSNorm weights to 1; `norm_center=None`: `scale` * N(0, 1) like
  the rest, as for Gemma's `1 + w` norms, which init to 0). With `buffers`,
  the non-RoPE buffers too (e.g. GLM-4.5's router bias); a tuple: those
  whose names end in one of its strings, drawn as the norms are (Gemma
  4's `layer_scalar`, 1 at init).

  Returns:
    The model, as saved by `save_pretrained(path)`.
  """
  torch.manual_seed(0)
  model = model_class(config).eval()
  tensors = list(model.named_parameters())
  if buffers:
    tensors += [(n, b) for n, b in model.named_buffers()
                if buffers is True or n.endswith(tuple(buffers))]
  centered = ("norm.weight",) + (
      () if isinstance(buffers, bool) else tuple(buffers))
  with torch.no_grad():
    for name, p in tensors:
      if name.endswith("inv_freq"):
        continue
      if norm_center is not None and name.endswith(centered):
        p.copy_(norm_center + norm_scale * torch.randn_like(p))
      else:
        p.copy_(scale * torch.randn_like(p))
  model.save_pretrained(path)
  return model


def left_padded_batch(vocab: int = 128, length: int = 10,
                      pads: tuple[int, ...] = (0, 4, 7), seed: int = 0):
  """(tokens int32, mask bool, positions int32) [len(pads), length]: row i
  left-padded by pads[i] tokens, positions counting real tokens from 0."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (len(pads), length)).astype(np.int32)
  mask = np.arange(length)[None] >= np.asarray(pads)[:, None]
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def hf_logits(model, tokens, mask, positions) -> np.ndarray:
  """float32 logits of a transformers causal LM on the batch."""
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                attention_mask=torch.from_numpy(mask.astype(np.int64)),
                position_ids=torch.from_numpy(positions.astype(np.int64)))
  return out.logits.float().numpy()


def our_logits(config, params, tokens, mask, positions,
               segment_ids=None) -> np.ndarray:
  """Our `Transformer`'s logits on the batch (optionally packed rows), by
  one jitted forward (op by op, each op would be a compile of its own)."""
  logits, _ = jax.jit(tm.Transformer(config).apply)(
      {"params": params}, jnp.asarray(tokens), jnp.asarray(positions),
      jnp.asarray(mask),
      segment_ids=None if segment_ids is None else jnp.asarray(segment_ids))
  return np.asarray(logits)


def check_packed_row_equals_trajectories_alone(path, model, attn: str) -> None:
  """Two trajectories packed into one row (then padding) give the logits
  transformers gives each alone."""
  config, params = hf.load_hf_checkpoint(path)
  config = dataclasses.replace(config, attention=attn, attention_block_q=4,
                               attention_block_kv=4)
  rng = np.random.default_rng(3)
  lengths = (6, 7)
  row = rng.integers(0, 128, (1, 15)).astype(np.int32)
  seg = np.zeros((1, 15), np.int32)
  seg[0, :6], seg[0, 6:13] = 1, 2
  positions = np.zeros((1, 15), np.int32)
  positions[0, :6], positions[0, 6:13] = np.arange(6), np.arange(7)
  got = our_logits(config, params, row, seg > 0, positions, seg)
  start = 0
  for n in lengths:
    alone = row[:, start:start + n]
    want = hf_logits(model, alone, np.ones_like(alone, bool),
                     np.arange(n, dtype=np.int32)[None])
    assert np.abs(got[0, start:start + n] - want[0]).max() <= 1e-4
    start += n


def check_greedy_continuation(path, model, tokens, mask,
                              new_tokens: int) -> None:
  """Greedy tokens per prompt through the sampler's KV cache equal
  transformers' `generate`; the recorded log-probs equal the trainer's full
  forward."""
  config, params = hf.load_hf_checkpoint(path)
  prompts = [list(map(int, t[m])) for t, m in zip(tokens, mask)]
  model.generation_config.eos_token_id = None
  with torch.no_grad():
    out = model.generate(
        input_ids=torch.from_numpy(tokens.astype(np.int64)),
        attention_mask=torch.from_numpy(mask.astype(np.int64)),
        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0).numpy()
  want = out[:, tokens.shape[1]:]
  segments = generate_lib.generate(
      params, config, prompts, jax.random.key(0), max_new_tokens=new_tokens,
      sampling=SamplingParams(greedy=True))
  for i, s in enumerate(segments):
    np.testing.assert_array_equal(s.tokens, want[i])
    full = np.asarray(prompts[i] + list(map(int, s.tokens)), np.int32)[None]
    n = full.shape[1]
    logits = our_logits(config, params, full, np.ones_like(full, bool),
                        np.arange(n, dtype=np.int32)[None])
    logp = jax.nn.log_softmax(logits[0, len(prompts[i]) - 1:n - 1], axis=-1)
    trainer = np.take_along_axis(np.asarray(logp), s.tokens[:, None], 1)[:, 0]
    np.testing.assert_allclose(s.logprobs, trainer, atol=1e-4, rtol=0)
  assert len(set(map(tuple, want))) == len(want)  # Rows really differ.
