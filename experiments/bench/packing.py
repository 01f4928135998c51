r"""Benchmark: padding fraction and trainer tokens/s, packed vs unpacked rows.

1. Records the real stream of a workload: the loop (sampler process, ring,
   trainer; ``loop_setup.loop_config``: no SFT, no evaluation) on
   ``configs/<workload>.py`` for ``--record_steps`` steps with
   ``train.record_stream`` and unpacked rows, so the trajectories are the
   workload's own (the random-init policy's lengths).
2. Builds the trainer's batches from the same recorded trajectories, in
   order, twice: one trajectory a row (``train.pack=False``) and packed
   (``sao_jax.data.packing``, ``--max_segments`` a row), both ``[B, T]`` of
   the config; the padding fraction is the share of padding tokens over all
   batch slots (the stream's ``padding_frac``).
3. Times the jitted SAO step (``train.step.make_step``: critic forward,
   ``rl.critic_updates_per_step`` critic updates, one policy update) of the
   config's model on both kinds of batch, alternating packed and unpacked
   within each repetition (side by side under the same load), medians over
   ``--repeats``. Trainer tokens/s = action tokens per batch / step time.

  python experiments/bench/packing.py --workload=longtail
  python experiments/bench/packing.py --workload=quickstart

One JSON line per figure (``loop_setup.emit``: with the 1-minute load); the
last has ``tokens_per_s_ratio`` (packed over unpacked) and both padding
fractions.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from absl import app
from absl import flags
import grain
import jax
import jax.numpy as jnp
import numpy as np

import loop_setup

_WORKLOAD = flags.DEFINE_enum("workload", "longtail",
                              ["longtail", "quickstart"], "configs/<name>.py.")
_RECORD_STEPS = flags.DEFINE_integer(
    "record_steps", 12, "Loop steps recorded (batch_size trajectories each).")
_MAX_SEGMENTS = flags.DEFINE_integer(
    "max_segments", 0, "Trajectories per packed row; 0: the config's "
    "train.pack_max_segments.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions (medians).")
_STEPS_PER_REPEAT = flags.DEFINE_integer(
    "steps_per_repeat", 3, "Steps timed per arm and repetition.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Where to record ('' = temp).")
_SET = flags.DEFINE_multi_string(
    "set", [], "KEY=VALUE: a config override (dotted key of configs/base.py, "
    "JSON value) of the workload's config, recorded and timed, e.g. "
    "--set=model.num_layers=2.")


def _record(workdir: str):
  """Runs the loop with ``train.record_stream``; returns its config."""
  from sao_jax.train import loop  # pylint: disable=g-import-not-at-top

  config = loop_setup.loop_config(
      _RECORD_STEPS.value, {**loop_setup.parse_sets(_SET.value),
                            "train.record_stream": True, "train.pack": False,
                            "train.log_every": 1000},
      base=_WORKLOAD.value)
  t0 = time.perf_counter()
  loop.train_and_evaluate(config, workdir)
  loop_setup.emit("packing_record", workload=_WORKLOAD.value,
                  steps=_RECORD_STEPS.value,
                  wall_s=round(time.perf_counter() - t0, 1))
  return config


def _trajectories(workdir: str) -> list:
  """The recorded (trajectory, staleness) pairs the trainer kept, in order."""
  from sao_jax.data import record  # pylint: disable=g-import-not-at-top

  directory = os.path.join(workdir, "stream")
  return [(e.traj, e.staleness)
          for _, _, path in record.list_shards(directory)
          for e in record.read_shard(path) if e.kept]


def _batches(elements, config, pack_segments: int):
  """Every full ``[B, T]`` batch of ``elements`` and the stream's counters."""
  from sao_jax.data import stream  # pylint: disable=g-import-not-at-top

  counters = stream.StreamCounters()
  ds = grain.MapDataset.source(list(elements)).to_iter_dataset()
  ds = stream.to_batches(
      ds, counters, batch_size=int(config.train.batch_size),
      seq_len=int(config.train.max_seq_len), overlong="truncate",
      pack_segments=pack_segments, restale=lambda t: 0)
  out = [{k: jnp.asarray(v) for k, v in b.items()} for b in ds]
  return out, counters.as_dict()


def _step_fn(config, workdir: str):
  """The config's jitted SAO step and a fresh-state maker."""
  # pylint: disable=g-import-not-at-top
  import flax.linen as nn
  from sao_jax.tokenization import tokenizer as tok_lib
  from sao_jax.models import transformer
  from sao_jax.train import setup as setup_lib
  from sao_jax.train import step as step_lib
  # pylint: enable=g-import-not-at-top

  tokenizer = tok_lib.Tokenizer.load(os.path.join(workdir, "tokenizer.model"))
  mcfg = setup_lib.model_config_from(config, tokenizer)
  tok = jnp.zeros((1, 4), jnp.int32)
  params = nn.unbox(jax.jit(transformer.Transformer(mcfg).init)(
      jax.random.PRNGKey(0), tok, tok, tok > -1)["params"])
  values = transformer.value_params_from_policy(params, mcfg,
                                                jax.random.PRNGKey(1))
  ptx, vtx = setup_lib.optimizers(config, values)
  step_cfg = setup_lib.step_config_from(config)
  fn = step_lib.make_step(mcfg, step_cfg, ptx, vtx, update_policy=True)
  state = step_lib.create_train_state(params, values, ptx, vtx)
  return fn, state


def _time(fn, state, batches, n: int):
  """Seconds per step over ``n`` steps cycling through ``batches``."""
  t0 = time.perf_counter()
  for i in range(n):
    state, metrics = fn(state, batches[i % len(batches)])
  jax.block_until_ready(metrics)
  return state, (time.perf_counter() - t0) / n


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    workdir = _WORKDIR.value or tmp
    config = _record(workdir)
    elements = _trajectories(workdir)
    segments = _MAX_SEGMENTS.value or int(config.train.pack_max_segments)
    arms = {"unpacked": _batches(elements, config, 0),
            "packed": _batches(elements, config, segments)}
    fn, state = _step_fn(config, workdir)
  tokens = {}
  for arm, (batches, counters) in arms.items():
    if not batches:
      raise SystemExit(f"No full {arm} batch from {len(elements)} "
                       "trajectories: raise --record_steps.")
    tokens[arm] = float(np.mean([float(b["action_mask"].sum())
                                 for b in batches]))
    loop_setup.emit("packing_batches", workload=_WORKLOAD.value, arm=arm,
                    batches=len(batches), padding_frac=round(
                        counters["padding_frac"], 4),
                    trajectories=len(elements),
                    action_tokens_per_batch=tokens[arm])
    state, _ = _time(fn, state, batches, 2)  # Compile (shapes are equal).
  times = {arm: [] for arm in arms}
  for _ in range(_REPEATS.value):
    for arm, (batches, _) in arms.items():
      state, dt = _time(fn, state, batches, _STEPS_PER_REPEAT.value)
      times[arm].append(dt)
  rate = {}
  for arm in arms:
    med = statistics.median(times[arm])
    rate[arm] = tokens[arm] / med
    loop_setup.emit("packing_step", workload=_WORKLOAD.value, arm=arm,
                    step_s_median=round(med, 4),
                    step_s_all=[round(t, 4) for t in times[arm]],
                    trainer_tokens_per_s=round(rate[arm], 1))
  loop_setup.emit(
      "packing_summary", workload=_WORKLOAD.value, max_segments=segments,
      batch=int(config.train.batch_size),
      seq_len=int(config.train.max_seq_len),
      padding_frac_unpacked=round(arms["unpacked"][1]["padding_frac"], 4),
      padding_frac_packed=round(arms["packed"][1]["padding_frac"], 4),
      tokens_per_s_ratio=round(rate["packed"] / rate["unpacked"], 3))


if __name__ == "__main__":
  app.run(main)
