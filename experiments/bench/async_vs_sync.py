r"""Benchmark: wall time of sync, batch-async and continuous async SAO.

The policy is the quickstart's architecture at random init (no SFT), on the
quickstart's tool-use task. Three arms run the real loop (sampler process +
ring + trainer) on the same config and the same number of trajectories:

- ``sync``: generate a batch, train on it (strict alternation);
- ``batch-async``: async within the staleness bound, but the sampler is
  batch-synchronous (``sampler.refill=False``, ``weight_poll_tokens=0``): a
  batch leaves when its slowest episode ends, weights change between batches;
- ``async``: the continuous-batching sampler (slots refilled as episodes end,
  weights adopted in flight);
- ``async-vllm``: ``async`` with vLLM behind the sampler's `Rollout`
  interface (``sampler.engine='vllm'``, the `vllm` extra); not in the
  default arms. ``--arms=async,async-vllm`` gives ``async_vllm_over_async``
  (trajectories/s of vLLM's over the native engine's).

``--workload=balanced`` (default): every episode takes ``--max_new_tokens``
(the random-init policy rarely stops early). ``--workload=longtail``
(configs/longtail.py): the long tail of agentic work: 0..4 tool calls per
episode, geometric (half none, one in sixteen four), each answered after
``--tool_latency_s`` (default the config's 1 s), and actions of 8 or 16
tokens. ``--workload=repair``: coding judged by tests
(``env.name='repair'``, docs/design/grading.md "Repository repair"): the
random-init policy submits the buggy package at once (its first action is
text, not a tool call), so every episode ends with one real test-suite run
in the grading sandbox, as slow and uneven as the workspaces' suites (11 to
~100 tests); one training task per workspace (each found once per
sampler), lengths derived from the repair demonstrations, 8 episodes a
step.

The sampler is pinned to one core and the trainer to the other. The figure
is the steady-state time of the train steps (``train_wall_s``: no SFT, no
evaluation, compilation excluded: the trainer compiles in the warm-up round,
and the sampler processes share a persistent compilation cache it fills). Runs alternate between the arms and the
medians are compared.

  python experiments/bench/async_vs_sync.py --workload=longtail --repeats=3

Prints one JSON line per run and per arm; the last line has ``ratio_vs_sync``
and ``ratio_vs_batch_async`` (wall time of sync / batch-async over async).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

from absl import app
from absl import flags
from absl import logging

import loop_setup

_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per mode (medians).")
_STEPS = flags.DEFINE_integer("steps", 40, "Policy steps per run.")
_STALENESS = flags.DEFINE_integer("max_staleness", 4, "Async staleness bound.")
_SAMPLER_CORE = flags.DEFINE_integer("sampler_core", 0, "Core of the sampler.")
_TRAINER_CORE = flags.DEFINE_integer("trainer_core", 1, "Core of the trainer.")
_CRITIC_UPDATES = flags.DEFINE_integer(
    "critic_updates", 1, "Critic updates per step (training cost).")
_NEW_TOKENS = flags.DEFINE_integer(
    "max_new_tokens", 96,
    "Balanced workload: tokens per turn; sets the generation/training "
    "balance (the random-init policy rarely stops early, so episodes use the "
    "budget).")
_WORKLOAD = flags.DEFINE_enum(
    "workload", "balanced", ["balanced", "longtail", "repair"],
    "Episode lengths and environment (module docstring).")
_LATENCY = flags.DEFINE_float(
    "tool_latency_s", None, "Long-tail workload: seconds a tool call takes "
    "(default: configs/longtail.py's).")
_ARMS = flags.DEFINE_list("arms", ["sync", "batch-async", "async"],
                          "Arms to run (the ratios need all three).")
_WARMUP_ROUNDS = flags.DEFINE_integer(
    "warmup_rounds", 1, "Untimed rounds of every arm first (they fill the "
    "compilation caches; 0: the timed runs compile).")
_SET = flags.DEFINE_multi_string(
    "set", [], "KEY=VALUE: a config override (dotted key of configs/base.py, "
    "JSON value) of every run, after the workload's and the arm's, e.g. "
    "--set=model.num_layers=2.")

# Arm -> its config overrides.
ARMS = {
    "sync": {"train.mode": "sync", **loop_setup.BATCH_SAMPLER},
    "batch-async": {"train.mode": "async", **loop_setup.BATCH_SAMPLER},
    "async": {"train.mode": "async", "sampler.refill": True,
              "sampler.weight_poll_tokens": 32},
    # 'async' with vLLM behind the sampler's Rollout interface (the vllm
    # extra): e.g. --workload=longtail --arms=async,async-vllm.
    "async-vllm": {"train.mode": "async", "sampler.refill": True,
                   "sampler.weight_poll_tokens": 32, "sampler.engine": "vllm"},
}


# The coding workload's overrides of the quickstart's model and task: a
# tokenizer trained on code, lengths derived from the repair demonstrations
# (observations cut at 128 characters), one task per workspace, 8 episodes
# a step (CPU-sized).
REPAIR = {
    "env.name": "repair", "env.dataset_config": {}, "env.size": 4,
    "env.eval_size": 1, "env.max_turns": 2, "env.max_tool_calls": 1,
    "env.code_observation_chars": 128, "tokenizer.datasets": ("codeio",),
    "tokenizer.vocab_size": 2048, "tokenizer.corpus_size": 500,
    "model.vocab_size": 2048, "sampler.max_new_tokens": 0,
    "sampler.max_total_tokens": 0, "train.max_seq_len": 0,
    "sampler.batch_size": 8, "train.batch_size": 8}


def bench_config(arm: str):
  """The workload's model and task (``loop_setup.loop_config``) in ``arm``."""
  overrides = {
      **ARMS[arm],
      "train.max_staleness": _STALENESS.value, "train.log_every": 10,
      "rl.critic_updates_per_step": _CRITIC_UPDATES.value,
      "sampler.devices": str(_SAMPLER_CORE.value),
      # Unpacked rows in every arm: 'sync' cannot pack, and trajectories per
      # step (the figures' unit) stay batch_size.
      "train.pack": False}
  if _WORKLOAD.value == "balanced":
    n = _NEW_TOKENS.value
    overrides.update({"sampler.max_new_tokens": n,
                      "sampler.max_total_tokens": 32 + n,
                      "train.max_seq_len": 32 + n})
  if _WORKLOAD.value == "repair":
    overrides.update(REPAIR)
  if _LATENCY.value is not None:
    overrides["env.longtail_tool_latency_s"] = _LATENCY.value
  overrides.update(loop_setup.parse_sets(_SET.value))
  base = "longtail" if _WORKLOAD.value == "longtail" else "quickstart"
  return loop_setup.loop_config(_STEPS.value, overrides, base=base)


def _figures(summary, batch: int) -> dict[str, float]:
  """Per-run figures from the loop's summary."""
  wall = summary["train_wall_s"]
  return {
      "train_wall_s": wall,
      "trajectories_per_s": summary["train_wall_steps"] * batch / wall,
      "action_tokens_per_s": summary["sampler_tokens_per_s"],
      "decode_occupancy": summary["sampler_decode_occupancy"],
      "trainer_idle_frac": summary["trainer_idle_frac"],
      "sampler_idle_frac": summary["sampler_idle_frac"],
      "staleness_mean": summary["staleness_mean"],
      "trajectories_trained": summary["trajectories_trained"]}


def main(argv):
  del argv
  # Pin before JAX starts its thread pools; the sampler pins itself.
  os.sched_setaffinity(0, {_TRAINER_CORE.value})
  from sao_jax.train import loop  # pylint: disable=g-import-not-at-top

  runs = {arm: [] for arm in _ARMS.value}
  with tempfile.TemporaryDirectory() as tmp:
    # Warm-up runs of each arm fill the compilation caches of the trainer.
    warmup = _WARMUP_ROUNDS.value
    for i in range(warmup + _REPEATS.value):
      for arm in _ARMS.value:
        config = bench_config(arm)
        # Each run spawns a new sampler process: the warm-up round fills a
        # shared compilation cache, so no timed run compiles its decode.
        config.sampler.compilation_cache_dir = os.path.join(tmp, "jax_cache")
        summary = loop.train_and_evaluate(config, os.path.join(
            tmp, f"{arm}_{i}"))
        if i < warmup:
          continue
        runs[arm].append(_figures(summary, int(config.train.batch_size)))
        loop_setup.emit("run", workload=_WORKLOAD.value, arm=arm,
                        repeat=i - warmup + 1, **runs[arm][-1])
  med = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
         for arm, rs in runs.items()}
  for arm, figures in med.items():
    loop_setup.emit(f"{arm}_median", workload=_WORKLOAD.value, **figures,
                    train_wall_s_runs=[r["train_wall_s"] for r in runs[arm]])
  wall = {arm: f["train_wall_s"] for arm, f in med.items()}
  last = {"workload": _WORKLOAD.value, "steps": _STEPS.value,
          **({"tool_latency_s": config.env.longtail_tool_latency_s}
             if _WORKLOAD.value == "longtail" else {}),
          "repeats": _REPEATS.value, **{f"{a}_s": w for a, w in wall.items()}}
  if "async" in wall:
    for ref in ("sync", "batch-async"):
      if ref in wall:
        last[f"ratio_vs_{ref.replace('-', '_')}"] = wall[ref] / wall["async"]
  if "async" in med and "async-vllm" in med:
    last["async_vllm_over_async"] = (
        med["async-vllm"]["trajectories_per_s"]
        / med["async"]["trajectories_per_s"])
  logging.info("%s", last)
  print(json.dumps(last))


if __name__ == "__main__":
  app.run(main)
