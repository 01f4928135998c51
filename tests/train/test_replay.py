"""Record an asynchronous run's stream, then replay it bit for bit (issue 19).

One recorded run, stopped after 3 steps and resumed to 6 (1 critic warm-up
step + 5 policy steps), serves every test: its first part alone is an
uninterrupted run, the whole one a stop/resume.
"""

import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

from sao_jax.data import record
from sao_jax.train import loop
from sao_jax.train import metrics as metrics_lib
from tiny_settings import tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

FIRST, TOTAL = 3, 6  # Steps (warm-up included) before the stop; in all.
# Scalars that depend on timing or on the sampler/ring, not on the data.
TIMING = ("throughput/", "idle/", "weights/", "ring/", "sampler/", "summary/",
          "eval/seconds")
RECORDED = {"train.mode": "async", "train.max_staleness": 2,
            "train.publish_lag": 1, "train.checkpoint_every": 2,
            "train.eval_every": 2, "train.record_stream": True,
            "train.record_shard_steps": 2}


def _replay_config(source, **overrides):
  return tiny_config(**{**RECORDED, "train.num_steps": TOTAL - 1,
                        "train.mode": "replay",
                        "train.replay_from": str(source),
                        "train.record_stream": False, **overrides})


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
  """(the run stopped after FIRST steps, the same run resumed to TOTAL)."""
  root = tmp_path_factory.mktemp("recorded")
  run = root / "run"
  loop.train_and_evaluate(
      tiny_config(**{**RECORDED, "train.num_steps": FIRST - 1}), str(run))
  first = root / "first"
  shutil.copytree(run, first)
  summary = loop.train_and_evaluate(
      tiny_config(**{**RECORDED, "train.num_steps": TOTAL - 1}), str(run))
  assert summary["steps"] == TOTAL
  return first, run, summary


def _final_state(workdir, step):
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  return ocp.PyTreeCheckpointer().restore(path)


def _assert_same_state(a, b):
  leaves_a, tree_a = _flatten(a)
  leaves_b, tree_b = _flatten(b)
  assert tree_a == tree_b
  assert len(leaves_a) > 10
  for (path, x), (_, y) in zip(leaves_a, leaves_b):
    assert np.array_equal(np.asarray(x), np.asarray(y)), path


def _flatten(tree):
  import jax  # pylint: disable=g-import-not-at-top
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(p), v) for p, v in flat], treedef


def _data_scalars(workdir, steps):
  """Data-dependent scalars {tag: {step: value}} at ``steps``."""
  out = {}
  for tag, series in metrics_lib.read_scalars(
      os.path.join(workdir, "tb")).items():
    if not tag.startswith(TIMING):
      out[tag] = {s: v for s, v in series if s in steps}
  return out


def _assert_same_scalars(original, replay, steps):
  want = _data_scalars(original, steps)
  got = _data_scalars(replay, steps)
  assert {"policy/loss", "critic/value_loss", "reward/mean", "eval/accuracy",
          "staleness/mean", "stream/dropped_stale", "policy_version",
          "tokens/generated_total"} <= want.keys()
  for tag, series in want.items():
    assert got.get(tag) == series, tag  # Exact, step by step.


def _stream_entries(workdir):
  d = os.path.join(workdir, "stream")
  return [e for _, _, p in record.list_shards(d) for e in record.read_shard(p)]


def test_recording_is_complete_across_stop_resume(recorded):
  first, run, summary = recorded
  spans = [(s, e) for s, e, _ in record.list_shards(str(run / "stream"))]
  assert spans == [(0, 2), (2, 3), (3, 4), (4, 6)]
  entries = _stream_entries(run)
  steps = [e.step for e in entries]
  assert steps == sorted(steps) and set(steps) == set(range(TOTAL))
  kept = [e for e in entries if e.kept]
  assert all(sum(e.step == s for e in kept) == 8 for s in range(TOTAL))
  assert len(entries) == summary["trajectories_read_from_ring"]
  assert len(entries) - len(kept) == summary["dropped_stale"]
  assert len(_stream_entries(first)) < len(entries)


def test_replay_reproduces_a_run_exactly(recorded, tmp_path):
  first, _, _ = recorded
  summary = loop.train_and_evaluate(
      _replay_config(first, **{"train.num_steps": FIRST - 1}), str(tmp_path))
  assert summary["steps"] == FIRST and "sampler_episodes" not in summary
  _assert_same_state(_final_state(first, FIRST), _final_state(tmp_path, FIRST))
  _assert_same_scalars(first, tmp_path, set(range(FIRST + 1)))


def test_replay_reproduces_a_stopped_and_resumed_run(recorded, tmp_path):
  _, run, summary = recorded
  replayed = loop.train_and_evaluate(_replay_config(run), str(tmp_path))
  for key in ("accuracy_before", "accuracy_after", "trajectories_trained",
              "trajectories_read_from_ring", "dropped_stale",
              "generated_tokens", "staleness_mean", "policy_version"):
    assert replayed[key] == summary[key], key
  _assert_same_state(_final_state(run, TOTAL), _final_state(tmp_path, TOTAL))
  _assert_same_scalars(run, tmp_path, set(range(TOTAL + 1)))


def test_window_replay_starts_from_a_checkpoint(recorded, tmp_path):
  _, run, _ = recorded
  # Checkpoints of the run: 3, 4, 6. Window [5, 6) starts from step 4.
  loop.train_and_evaluate(
      _replay_config(run, **{"train.replay_steps": (5, 6)}), str(tmp_path))
  replayed = metrics_lib.read_scalars(str(tmp_path / "tb"))
  assert [s for s, _ in replayed["policy/loss"]] == [5, 6]
  _assert_same_state(_final_state(run, TOTAL), _final_state(tmp_path, TOTAL))
  _assert_same_scalars(run, tmp_path, {5, 6})


def test_what_if_replay_trains_another_loss_on_the_same_data(recorded,
                                                             tmp_path):
  _, run, _ = recorded
  loop.train_and_evaluate(_replay_config(
      run, **{"rl.loss": "grpo", "rl.advantage": "decoupled_gae"}),
                          str(tmp_path))
  original = metrics_lib.read_scalars(str(run / "tb"))
  what_if = metrics_lib.read_scalars(str(tmp_path / "tb"))
  # Identical batches: the same rewards and staleness at every step ...
  for tag in ("reward/mean", "staleness/mean", "tokens/action"):
    assert what_if[tag] == original[tag], tag
  # ... a different update: other losses and other final weights.
  assert what_if["policy/loss"] != original["policy/loss"]
  a = _flatten(_final_state(run, TOTAL)["policy_params"])[0]
  b = _flatten(_final_state(tmp_path, TOTAL)["policy_params"])[0]
  assert any(not np.array_equal(x, y) for (_, x), (_, y) in zip(a, b))
