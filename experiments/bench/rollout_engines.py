r"""Rollout engines side by side: native vs vLLM on SmolLM2 (issue 37 item 5).

Both engines run behind the `Rollout` interface the sampler process drives
(`sao_jax.sampler.factory.make_rollout`), in one process, on the converted
SmolLM2-135M-Instruct (`configs/smollm2.py`: its tokenizer, chat template and
`chain_sum` prompts), float32:

- ``decode``: ``--episodes`` single-turn episodes of exactly
  ``--new_tokens`` sampled tokens each (temperature 1, no stop tokens, so
  every episode ends at its budget on both engines), all in flight together;
  tokens/s is the episodes' action tokens over the wall of
  `interface.run_episodes` (prompt encoding, prefill, decode, the host copy).
- ``push``: one weight update as the sampler process does it: the weight
  slot's read (shared memory -> host numpy, `WeightSlot.read`; what every
  engine pays) and then the engine's ``update_weights`` (native: a swap of
  the decoder's params, whose host arrays its next decode call takes as
  arguments, so ~0 here; vLLM: the HF-named tensors written to /dev/shm and
  its worker's ``reload_weights``, with the prefix cache reset).

Each engine starts and runs one untimed round first (compiles, CUDA-graph-
free warm-up); then every repetition runs the arms one after the other, so
both see the same machine load. Figures are medians over ``--repeats``.
Needs the `vllm` extra (README "Rollout engines").

  .venv/bin/python experiments/bench/rollout_engines.py --repeats=3

One JSON line per run and per figure; the last line is the summary.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", default="",
                      help="Converted SmolLM2 (default configs/smollm2.py's).")
  parser.add_argument("--episodes", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--arms", default="native,vllm")
  args = parser.parse_args()
  os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
  os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
  os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
  # pylint: disable=g-import-not-at-top
  import jax
  import numpy as np

  import loop_setup  # This script's folder: puts the checkout on sys.path.
  from sao_jax.envs import build as env_build
  from sao_jax.ipc import weights as weights_lib
  from sao_jax.models import hf
  from sao_jax.sampler import factory
  from sao_jax.sampler import interface
  from sao_jax.sampler import rollout
  from sao_jax.sampler.sampling import SamplingParams
  from sao_jax.sampler.stats import SamplerStats
  from sao_jax.tokenization import tokenizer as tok_lib
  # pylint: enable=g-import-not-at-top

  config = loop_setup.import_config("smollm2").get_config()
  path = args.checkpoint or config.model.init_from
  config.model.init_from = config.tokenizer.path = path
  config.env.max_turns = 1
  config.sampler.max_new_tokens = args.new_tokens
  config.sampler.max_total_tokens = 64 + args.new_tokens  # Prompts < 64.
  mcfg, params = hf.load_hf_checkpoint(path)
  params = jax.tree.map(np.asarray, params)
  tokenizer = tok_lib.tokenizer_from_config(config.tokenizer, "", config.env)
  tasks, _ = env_build.build_tasks(config.env)
  n = args.episodes
  settings = interface.RolloutSettings(
      interface.EngineOptions(num_slots=n, decode_chunk=args.new_tokens,
                              weight_poll_tokens=0, env_threads=4),
      rollout.RolloutLimits.from_config(config),
      SamplingParams(temperature=1.0), stop_ids=())
  arms = args.arms.split(",")
  engines = {}
  for arm in arms:
    engines[arm] = factory.make_rollout(
        config, model_config=mcfg, tokenizer=tokenizer,
        envs=env_build.make_envs(config.env, tasks, n, reward="exact"),
        weights=lambda: (params, 0), stats=SamplerStats(),
        rng=jax.random.PRNGKey(0), settings=settings, engine=arm)
    t0 = time.perf_counter()
    engines[arm].start()
    engines[arm].update_weights(params, 0)
    interface.run_episodes(engines[arm], list(range(n)))  # Warm-up.
    loop_setup.emit("warmup", arm=arm, seconds=time.perf_counter() - t0)

  figures = {arm: {"tokens_per_s": [], "push_s": [], "read_s": []}
             for arm in arms}
  with weights_lib.WeightSlot.create(params) as slot:
    for rep in range(args.repeats):
      for arm in arms:
        tasks_i = [n * (rep + 1) + i for i in range(n)]
        t0 = time.perf_counter()
        trajs = interface.run_episodes(engines[arm], tasks_i)
        wall = time.perf_counter() - t0
        tokens = sum(t.num_action_tokens for t in trajs)
        if tokens != n * args.new_tokens:
          raise RuntimeError(f"{arm}: {tokens} action tokens, expected "
                             f"{n * args.new_tokens}.")
        slot.publish(params, rep + 1)
        t0 = time.perf_counter()
        version, tree = slot.read()
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engines[arm].update_weights(tree, version)
        push_s = time.perf_counter() - t0
        for k, v in (("tokens_per_s", tokens / wall), ("push_s", push_s),
                     ("read_s", read_s)):
          figures[arm][k].append(v)
        loop_setup.emit("run", arm=arm, repeat=rep, tokens=tokens,
                        wall_s=wall, tokens_per_s=tokens / wall,
                        slot_read_s=read_s, engine_push_s=push_s)
  for engine in engines.values():
    engine.stop()
  med = {arm: {k: statistics.median(v) for k, v in f.items()}
         for arm, f in figures.items()}
  for arm in arms:
    loop_setup.emit(f"{arm}_median", episodes=n, new_tokens=args.new_tokens,
                    tokens_per_s=med[arm]["tokens_per_s"],
                    slot_read_s=med[arm]["read_s"],
                    engine_push_s=med[arm]["push_s"],
                    tokens_per_s_runs=[round(x, 1) for x in
                                       figures[arm]["tokens_per_s"]])
  last = {"repeats": args.repeats, "episodes": n,
          "new_tokens": args.new_tokens,
          **{f"{a}_tokens_per_s": med[a]["tokens_per_s"] for a in arms},
          **{f"{a}_engine_push_s": med[a]["push_s"] for a in arms},
          "slot_read_s": statistics.median(
              x for a in arms for x in figures[a]["read_s"])}
  if len(arms) == 2:
    last[f"{arms[1]}_over_{arms[0]}_tokens_per_s"] = (
        med[arms[1]]["tokens_per_s"] / med[arms[0]]["tokens_per_s"])
  loop_setup.emit("rollout_engines", **last)


if __name__ == "__main__":
  main()
