r"""Attention paths side by side: dense reference vs blockwise (CPU default).

Figures, one JSON line each (docs/design/models.md "Attention"):

- `core`: seconds of one jitted forward + backward of the attention core
  alone (`dense_attention` vs `blockwise_attention`) at SmolLM2's heads
  (9 query / 3 kv heads of 64), batch `--batch`, for each `--lengths` T,
  and the compile-only temp memory (XLA memory_analysis) of that backward;
- `memory`: that compile-only temp memory alone (nothing runs, so the
  figure does not depend on load) at batch 1 for each `--memory_lengths` T;
- `step`: seconds of a jitted value-and-grad of the policy's next-token loss
  of a SmolLM2-width model (hidden 576, MLP 1536, vocab 49,152, tied) with
  `--layers` layers at `--batch` x `--step_len` (8 x 128: the SmolLM2 step's
  shape) with `model.attention` = dense vs blockwise.

The arms are timed alternately within each repetition (the same machine
load), medians over `--repeats` runs after one warm-up; `uptime` load is
recorded on every line. The ratio `blockwise / dense` decides the CPU 'auto'
default (layers/attention.choose).

  .venv/bin/python experiments/bench/attention.py
  .venv/bin/python experiments/bench/attention.py --lengths 64 --layers 1 \
      --repeats 2 --step_len 32 --memory_lengths 256   # A smoke run.
"""

import argparse
import functools
import json
import os
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import attention
from sao_jax.models.layers import blockwise
from sao_jax.models.layers import masks


def _load() -> float:
  return os.getloadavg()[0]


def _time_alternately(fns: dict, repeats: int) -> dict:
  """Median seconds of each zero-argument fn, timed in turn per repeat."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(ts) for name, ts in times.items()}


def _core(args, t: int) -> dict:
  rng = np.random.default_rng(0)
  b, k, g, d = args.batch, 3, 3, 64
  q = jnp.asarray(rng.normal(size=(b, t, k, g, d)), jnp.float32)
  kv = [jnp.asarray(rng.normal(size=(b, t, k, d)), jnp.float32)
        for _ in range(2)]
  mask = jnp.ones((b, t), bool)
  arms = {"dense": attention.dense_attention,
          "blockwise": functools.partial(
              blockwise.blockwise_attention, block_q=args.block,
              block_kv=args.block)}
  fns, temp = {}, {}
  for name, fn in arms.items():
    grad = _grad_of(fn, mask)
    temp[name] = grad.lower(q, *kv).compile().memory_analysis(
    ).temp_size_in_bytes / 2**20
    fns[name] = functools.partial(grad, q, *kv)
  secs = _time_alternately(fns, args.repeats)
  return {"figure": "core", "batch": b, "tokens": t, "block": args.block,
          "dense_s": secs["dense"], "blockwise_s": secs["blockwise"],
          "ratio": secs["blockwise"] / secs["dense"],
          "dense_temp_mib": temp["dense"],
          "blockwise_temp_mib": temp["blockwise"]}


def _grad_of(fn, mask):
  def loss(q, k, v):
    spec, _ = masks.mask_spec(mask, None)
    return jnp.sum(fn(q, k, v, spec) ** 2)
  return jax.jit(jax.grad(loss, (0, 1, 2)))


def _memory(args, t: int) -> dict:
  """Compile-only temp MiB of the core's backward at batch 1 x t."""
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  shapes = (sds(1, t, 3, 3, 64), sds(1, t, 3, 64), sds(1, t, 3, 64))
  mask = jnp.ones((1, t), bool)
  arms = {"dense": attention.dense_attention,
          "blockwise": functools.partial(
              blockwise.blockwise_attention, block_q=args.block,
              block_kv=args.block)}
  line = {"figure": "memory", "batch": 1, "tokens": t, "block": args.block}
  for name, fn in arms.items():
    line[f"{name}_temp_mib"] = _grad_of(fn, mask).lower(
        *shapes).compile().memory_analysis().temp_size_in_bytes / 2**20
  return line


def _step(args) -> dict:
  b, t = args.batch, args.step_len
  rng = np.random.default_rng(1)
  base = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
              num_layers=args.layers, num_heads=9, num_kv_heads=3,
              head_dim=64, tie_embeddings=True,
              attention_block_q=args.block, attention_block_kv=args.block)
  tokens = jnp.asarray(rng.integers(1, 49152, (b, t)), jnp.int32)
  mask = jnp.asarray(np.arange(t)[None] < rng.integers(t // 2, t + 1,
                                                       (b, 1)))
  positions = transformer.positions_from_mask(mask)
  params = nn.unbox(transformer.Transformer(ModelConfig(**base)).init(
      jax.random.key(0), tokens, positions, mask))
  fns = {}
  for name in ("dense", "blockwise"):
    model = transformer.Transformer(ModelConfig(**base, attention=name))

    def loss(p, model=model):
      logits, _ = model.apply(p, tokens, positions, mask)
      logp = jax.nn.log_softmax(logits[:, :-1])
      nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
      return jnp.sum(nll * mask[:, 1:]) / jnp.sum(mask[:, 1:])

    fns[name] = functools.partial(jax.jit(jax.value_and_grad(loss)), params)
  secs = _time_alternately(fns, args.repeats)
  return {"figure": "step", "batch": b, "tokens": t, "layers": args.layers,
          "block": args.block, "dense_s": secs["dense"],
          "blockwise_s": secs["blockwise"],
          "ratio": secs["blockwise"] / secs["dense"]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--figures", nargs="+", default=["core", "memory", "step"],
                      choices=["core", "memory", "step"])
  parser.add_argument("--lengths", type=int, nargs="+",
                      default=[128, 512, 2048])
  parser.add_argument("--memory_lengths", type=int, nargs="*",
                      default=[1024, 4096, 16384])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--block", type=int, default=512,
                      help="attention_block_q = attention_block_kv.")
  parser.add_argument("--layers", type=int, default=4,
                      help="Layers of the `step` model (SmolLM2 has 30).")
  parser.add_argument("--step_len", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  for t in args.lengths if "core" in args.figures else ():
    start = _load()
    line = _core(args, t)
    print(json.dumps({**line, "load_before": start, "load_after": _load(),
                      "backend": jax.default_backend()}), flush=True)
  for t in args.memory_lengths if "memory" in args.figures else ():
    print(json.dumps({**_memory(args, t), "backend": jax.default_backend()}),
          flush=True)
  if "step" not in args.figures:
    return
  start = _load()
  line = _step(args)
  print(json.dumps({**line, "load_before": start, "load_after": _load(),
                    "backend": jax.default_backend()}), flush=True)


if __name__ == "__main__":
  main()
