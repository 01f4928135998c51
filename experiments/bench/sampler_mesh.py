r"""The native sampler over a mesh of CPU devices: tokens/s and parity.

The sampler's meshed code path (`sao_jax/sampler/mesh.py`: the weights and
the KV cache placed by the sampler's logical-axis rules, prefill and decode
jitted over the mesh) beside the one-device sampler, on the same weights and
prompts: greedy tokens (must be equal) and their recorded log-probs (largest
difference), and generation tokens/s per mesh. The devices are XLA's fake
host devices (``--xla_force_host_platform_device_count``), which share this
machine's cores: the figure checks the path and shows its overhead on one
host, **not a speed claim** (on a TPU host each device is a chip).

  .venv/bin/python experiments/bench/sampler_mesh.py --repeats=5

``--meshes`` lists data,expert,tensor sizes; the reference, run first, is the
sampler with no mesh (``none``: what a one-chip sampler runs), so ``1,1,1``
is the meshed code path on one device beside it. The model is a random dense
Llama-shaped decoder (``--layers``, ``--hidden``; 4 query and 4 KV heads so a
tensor axis of up to 4 splits the heads and the cache).

One JSON line per run and mesh; then one per mesh with the median tokens/s
of a generation on emptied rows (prefill and decode, as the engine reuses its
slots; building the sampler on the weights, once, is ``setup_s`` beside it),
its ratio to the sampler with no mesh, ``tokens_equal`` and
``max_logprob_diff``; the last line is the summary with the load. Exits 1
if any mesh's greedy tokens differ from the reference's.
"""

import argparse
import json
import os
import statistics
import time


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--meshes", nargs="+", default=["1,1,1", "1,1,4",
                                                      "2,1,4"],
                      help="data,expert,tensor sizes of each meshed arm")
  parser.add_argument("--devices", type=int, default=8,
                      help="fake CPU devices (at least the largest mesh)")
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--prompt_len", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--vocab", type=int, default=4096)
  parser.add_argument("--repeats", type=int, default=3)
  return parser.parse_args()


def main():
  args = _parse()
  sizes = {m: tuple(int(s) for s in m.split(",")) for m in args.meshes}
  bad = [m for m, s in sizes.items() if len(s) != 3 or min(s) < 1]
  if bad:
    raise SystemExit(f"--meshes {bad}: each must be three positive sizes "
                     "data,expert,tensor, e.g. 2,1,4.")
  need = max((s[0] * s[1] * s[2] for s in sizes.values()), default=1)
  if need > args.devices:
    raise SystemExit(f"--meshes need {need} devices; --devices={args.devices}."
                     " Raise --devices or shrink the meshes.")
  # Before jax is imported: the fake devices exist from the backend's start.
  os.environ["XLA_FLAGS"] = " ".join(filter(None, (
      os.environ.get("XLA_FLAGS"),
      f"--xla_force_host_platform_device_count={args.devices}")))
  # pylint: disable=g-import-not-at-top
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  from sao_jax.models.config import ModelConfig
  from sao_jax.models.transformer import Transformer
  from sao_jax.sampler import generate as gen_lib
  from sao_jax.sampler import mesh as mesh_lib
  from sao_jax.sampler.sampling import SamplingParams
  # pylint: enable=g-import-not-at-top

  cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                    intermediate_size=3 * args.hidden,
                    num_layers=args.layers, num_heads=4, num_kv_heads=4,
                    head_dim=args.hidden // 4)
  x = jnp.zeros((1, 4), jnp.int32)
  params = nn.unbox(jax.jit(lambda k: Transformer(cfg).init(
      k, x, x, x > -1))(jax.random.PRNGKey(0))["params"])
  params = jax.tree.map(lambda a: a * 3.0, params)  # Peaked log-probs.
  prompts = np.random.default_rng(0).integers(
      4, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
  max_len = (gen_lib.bucket_length(args.prompt_len)
             + gen_lib.bucket_length(args.new_tokens))
  n_tokens = args.batch * args.new_tokens

  def build(mesh):
    """The sampler on the weights (placed on its mesh), and its seconds."""
    t0 = time.perf_counter()
    gen = gen_lib.Generator(cfg, params, args.batch, max_len,
                            SamplingParams(greedy=True), mesh=mesh)
    return gen, time.perf_counter() - t0

  def run(gen):
    """(seconds, tokens, log-probs) of one greedy generation on emptied rows
    (as the engine reuses its slots): the prompts' prefill, then decode."""
    t0 = time.perf_counter()
    gen.reset_rows(range(args.batch))
    gen.append(prompts)
    segs = gen.generate((), args.new_tokens)
    dt = time.perf_counter() - t0
    return (dt, [s.tokens.tolist() for s in segs],
            np.concatenate([s.logprobs for s in segs]))

  meshes = {"none": None}
  meshes.update({m: mesh_lib.SamplerMesh.build(s) for m, s in sizes.items()})
  arms, setup_s = {}, {}
  for name, mesh in meshes.items():
    arms[name], setup_s[name] = build(mesh)
  ref_tokens, ref_logprobs = None, None
  times = {m: [] for m in arms}
  parity = {}
  for name, gen in arms.items():  # Compile (and the parity check).
    _, tokens, logprobs = run(gen)
    if ref_tokens is None:
      ref_tokens, ref_logprobs = tokens, logprobs
    parity[name] = {
        "tokens_equal": tokens == ref_tokens,
        "max_logprob_diff": float(np.max(np.abs(logprobs - ref_logprobs))),
        "devices": 1 if meshes[name] is None else meshes[name].size}
  for r in range(args.repeats):
    for name, gen in arms.items():
      dt = run(gen)[0]
      times[name].append(dt)
      print(json.dumps({"mesh": name, "run": r, "seconds": round(dt, 4),
                        "tokens_per_s": round(n_tokens / dt, 1)}), flush=True)
  med = {name: statistics.median(v) for name, v in times.items()}
  for name in arms:
    print(json.dumps({
        "figure": "sampler_mesh_tokens_per_s", "mesh": name,
        "median": round(n_tokens / med[name], 1),
        "over_no_mesh": round(med["none"] / med[name], 3),
        "setup_s": round(setup_s[name], 4),
        "runs": len(times[name]), **parity[name]}), flush=True)
  print(json.dumps({
      "all_tokens_equal": all(p["tokens_equal"] for p in parity.values()),
      "max_logprob_diff": max(p["max_logprob_diff"] for p in parity.values()),
      "batch": args.batch, "prompt_len": args.prompt_len,
      "new_tokens": args.new_tokens, "num_params": cfg.num_params(),
      "jax_devices": jax.device_count(), "cores": os.cpu_count(),
      "load_1min": round(os.getloadavg()[0], 2), "jax": jax.__version__}),
        flush=True)
  differ = [name for name, p in parity.items() if not p["tokens_equal"]]
  if differ:
    raise SystemExit(f"The sampler over meshes {differ} generated other "
                     "greedy tokens than the sampler with no mesh: the meshed "
                     "path is wrong (tests/sampler/test_sampler_mesh.py).")


if __name__ == "__main__":
  main()
