"""End-to-end tests of the asynchronous loop: events, sync resume, SIGKILL resume."""

import glob
import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import psutil
import pytest

from sao_jax.data import consumed
from sao_jax.data import record
from sao_jax.ipc import segment
from sao_jax.train import loop
from sao_jax.train import metrics as metrics_lib
from sao_jax.train import workdir_lock
import multihost
import tiny_settings
from tiny_settings import tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Tags the issue asks the event files to hold (prefix match where per-loss).
REQUIRED_TAGS = (
    "reward/mean", "eval/accuracy", "policy/loss", "policy/accept_frac",
    "policy/reject_low_frac", "policy/reject_high_frac", "policy/ratio_mean",
    "policy/ratio_min", "policy/ratio_max", "policy/entropy",
    "critic/value_loss", "critic/explained_variance", "critic/grad_norm",
    "policy/grad_norm", "staleness/mean", "staleness/max",
    "ring/occupancy_frac", "idle/sampler_frac", "idle/trainer_frac",
    "throughput/trainer_tokens_per_s", "throughput/sampler_tokens_per_s",
    "weights/publish_s_total",
)


def _our_segments():
  """Segments created by this process or by an exited one (a killed run's).

  Segments of other live processes (e.g. an experiment running on the same
  machine) are not this test's to count.
  """
  ours = set()
  for path in glob.glob(f"/dev/shm/{segment.PREFIX}*"):
    pid = segment.creator_pid(path)  # None: another program's file.
    if pid is not None and (pid == os.getpid() or not psutil.pid_exists(pid)):
      ours.add(path)
  return ours


def test_async_run_writes_every_required_metric(tmp_path):
  before = _our_segments()
  config = tiny_config(**{"train.mode": "async", "train.num_steps": 4,
                          "train.max_staleness": 1,
                          "train.checkpoint_every": 0,
                          "sampler.compilation_cache_dir": str(
                              tmp_path / "jax_cache")})
  summary = loop.train_and_evaluate(config, str(tmp_path))
  # The sampler process compiled its decode loop into the persistent cache:
  # the whole-batch loop (`jit__decode`) and, when at most half the slots
  # generate in some turn, the row-subset loop (`jit_decode_rows`); which of
  # the two a run needs depends on how its episodes interleave.
  cached = os.listdir(tmp_path / "jax_cache")
  assert any(n.startswith(("jit__decode", "jit_decode_rows"))
             for n in cached), cached
  # Every trajectory came through the sampler process and the ring.
  assert summary["trajectories_read_from_ring"] >= 5 * 8
  assert summary["trajectories_trained"] == 5 * 8
  assert summary["trajectories_read_from_ring"] == (
      summary["trajectories_trained"] + summary["dropped_stale"])
  assert summary["sampler_episodes"] >= summary["trajectories_read_from_ring"]
  assert summary["staleness_max"] <= 1
  assert summary["policy_version"] == 4 and summary["steps"] == 5
  # Each evaluation kept its per-problem scores (paired errors between runs):
  # before RL at v0 (step 0) and after at v4 (step 5), n scores whose mean is
  # the summary's accuracy.
  assert sorted(os.listdir(tmp_path / "eval")) == ["v0.json", "v4.json"]
  for name, step, accuracy in (("v0", 0, summary["accuracy_before"]),
                               ("v4", 5, summary["accuracy_after"])):
    kept = json.loads((tmp_path / "eval" / f"{name}.json").read_text())
    assert kept["version"] == int(name[1:]) and kept["step"] == step
    assert kept["problems"] == len(kept["scores"]) == summary["eval_problems"]
    assert np.mean(kept["scores"]) == pytest.approx(accuracy, abs=1e-12)
  scalars = metrics_lib.read_scalars(os.path.join(tmp_path, "tb"))
  missing = [t for t in REQUIRED_TAGS if t not in scalars]
  assert not missing, f"event files lack {missing}"
  # Policy metrics start after the critic warm-up step.
  assert [s for s, _ in scalars["policy/loss"]] == [2, 3, 4, 5]
  # The first policy step trains version-0 episodes at version 0 with the
  # sampler's float32 weights (sampler.param_dtype '' = model.dtype): the
  # log-probs agree to rounding (bfloat16 weights: test_sampler_mesh.py).
  assert scalars["policy/logp_abs_diff"][0][1] < 1e-6
  # The continuous sampler's and the MAC's counters reach the event files;
  # a kept trajectory spans at most the staleness bound of versions.
  for tag in ("staleness/version_span_max", "sampler/decode_occupancy",
              "sampler/skipped_long_prompts", "sampler/rejected_weights"):
    assert tag in scalars, tag
  assert max(v for _, v in scalars["staleness/version_span_max"]) <= 1
  assert all(v == 0 for _, v in scalars["sampler/rejected_weights"])
  assert [s for s, _ in scalars["critic/value_loss"]] == [1, 2, 3, 4, 5]
  for _, frac in scalars["policy/accept_frac"]:
    assert 0.0 <= frac <= 1.0
  assert _our_segments() <= before  # Ring and weight slot unlinked.


def _run_sync(workdir, num_steps):
  config = tiny_config(**{"train.mode": "sync", "train.num_steps": num_steps,
                          "train.checkpoint_every": 0})
  return loop.train_and_evaluate(config, str(workdir))


def test_time_budget_stops_after_the_step_that_crosses_it(tmp_path):
  # The trainer's clock starts before the initial eval, so a 1e-3 s budget
  # is spent by the end of step 1: the run stops there, then evaluates,
  # checkpoints and writes its summary like a finished run.
  config = tiny_config(**{"train.mode": "sync", "train.num_steps": 6,
                          "train.checkpoint_every": 0,
                          "train.max_train_s": 1e-3})
  summary = loop.train_and_evaluate(config, str(tmp_path))
  assert summary["steps"] == 1
  assert os.path.isfile(tmp_path / "summary.json")
  assert os.listdir(tmp_path / "checkpoints") == ["1"]


def test_an_evaluation_cut_short_by_a_stop_runs_on_resume(tmp_path,
                                                         monkeypatch):
  # Warm-up step 1, then evaluations after steps 3 (version 2) and 5 (the
  # final one). A stop (SIGTERM unwinds as KeyboardInterrupt) during step 3's
  # evaluation saves step 3 on the way out; the resumed run evaluates it.
  config = tiny_config(**{"train.mode": "sync", "train.num_steps": 4,
                          "train.eval_every": 2, "train.checkpoint_every": 0})
  evaluate = loop._Trainer.evaluate  # pylint: disable=protected-access

  def stopped_at_step_3(self, step, generated):
    if step == 3:
      raise KeyboardInterrupt("SIGTERM during the evaluation")
    return evaluate(self, step, generated)

  monkeypatch.setattr(loop._Trainer, "evaluate", stopped_at_step_3)  # pylint: disable=protected-access
  with pytest.raises(KeyboardInterrupt):
    loop.train_and_evaluate(config, str(tmp_path))
  assert os.listdir(tmp_path / "checkpoints") == ["3"]
  assert sorted(os.listdir(tmp_path / "eval")) == ["v0.json"]
  monkeypatch.undo()
  summary = loop.train_and_evaluate(config, str(tmp_path))
  assert summary["steps"] == 5 and summary["policy_version"] == 4
  assert sorted(os.listdir(tmp_path / "eval")) == [
      "v0.json", "v2.json", "v4.json"]
  kept = json.loads((tmp_path / "eval" / "v2.json").read_text())
  assert kept["step"] == 3 and kept["version"] == 2
  scalars = metrics_lib.read_scalars(os.path.join(tmp_path, "tb"))
  assert [s for s, _ in scalars["eval/accuracy"]] == [0, 3, 5]


def test_sync_resume_reproduces_uninterrupted_run(tmp_path):
  k, extra = 3, 5  # Steps include 1 critic warm-up step.
  _run_sync(tmp_path / "full", k - 1 + extra)
  _run_sync(tmp_path / "resumed", k - 1)  # Stops (and checkpoints) at step k.
  summary = _run_sync(tmp_path / "resumed", k - 1 + extra)
  assert summary["steps"] == k + extra
  # Sync mode is strict alternation: the sampler never runs ahead, so nothing
  # is ever stale (train.max_staleness=4 in the config must not leak in).
  assert summary["dropped_stale"] == 0 and summary["staleness_max"] == 0
  full = metrics_lib.read_scalars(str(tmp_path / "full" / "tb"))
  resumed = metrics_lib.read_scalars(str(tmp_path / "resumed" / "tb"))
  for tag in ("policy/loss", "critic/value_loss", "reward/mean",
              "policy/ratio_mean", "advantage/mean"):
    a = dict(full[tag])
    b = dict(resumed[tag])
    for step in range(k + 1, k + extra + 1):
      np.testing.assert_allclose(b[step], a[step], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{tag} at step {step}")


# Async, 12 slots for batches of 8, a staleness bound of 3 and the long-tail
# tool task (actions of 1, 2 or 4 tokens, half of the tasks make one
# 0.2 s tool call): episodes of neighbouring steps are in flight together
# and reach the ring far out of order.
EXACTLY_ONCE = {"train.mode": "async", "train.max_staleness": 3,
                "train.publish_lag": 0, "sampler.num_slots": 12,
                "train.record_stream": True, "train.checkpoint_every": 0,
                "env.name": "tool_longtail", "env.longtail_min_tokens": 1,
                "env.longtail_levels": 3, "env.longtail_tool_calls": 1,
                "env.longtail_tool_latency_s": 0.2, "env.max_tool_calls": 1,
                "env.max_turns": 2, "sampler.max_total_tokens": 64,
                "train.max_seq_len": 64}


def _consumed_meta(workdir, step):
  with open(os.path.join(workdir, "checkpoints", str(step), "meta",
                         "metadata")) as f:
    (own,) = json.load(f)[consumed.META_KEY]  # One host.
  return own["watermark"], set(own["above"])


def test_async_stop_resume_consumes_every_episode_exactly_once(tmp_path):
  """Issue 16 (3): across a stop and a resume every episode number below the
  final watermark is read from the ring (trained on or dropped stale) exactly
  once, and every started episode is read, left unread in the ring at the
  stop or aborted in flight, each counted."""
  first = loop.train_and_evaluate(
      tiny_config(**{**EXACTLY_ONCE, "train.num_steps": 2}), str(tmp_path))
  assert first["steps"] == 3
  second = loop.train_and_evaluate(
      tiny_config(**{**EXACTLY_ONCE, "train.num_steps": 5}), str(tmp_path))
  assert second["steps"] == 6
  entries = [e for _, _, p in record.list_shards(str(tmp_path / "stream"))
             for e in record.read_shard(p)]
  assert sorted({e.step for e in entries}) == list(range(6))
  # One host, one rollout per prompt: the group id is the episode number.
  episodes = [e.traj.group_id for e in entries]
  assert len(episodes) == len(set(episodes)), sorted(
      e for e in set(episodes) if episodes.count(e) > 1)
  w2, above2 = _consumed_meta(tmp_path, 6)
  assert set(episodes) == set(range(w2)) | above2
  assert len(episodes) >= 6 * 8 and w2 > 3 * 8
  w1, above1 = _consumed_meta(tmp_path, 3)
  assert w1 + len(above1) == first["trajectories_read_from_ring"]
  # The stop left episodes behind, generated again after the resume.
  left = first["ring_unread_at_stop"] + first["sampler_episodes_aborted"]
  assert left > 0 and above1 <= set(episodes)
  assert second["episodes_consumed_twice"] == 0
  assert second["episodes_watermark"] == w2
  # Counters: what each segment's sampler wrote was read or left unread;
  # all of it, over both segments, is what was consumed plus the leftovers.
  read = [first["trajectories_read_from_ring"],
          second["trajectories_read_from_ring"]
          - first["trajectories_read_from_ring"]]
  for summary, n in zip((first, second), read):
    assert summary["sampler_episodes"] == n + summary["ring_unread_at_stop"]
  assert len(entries) == sum(read) == second["trajectories_read_from_ring"]
  assert (len(entries) - sum(e.kept for e in entries)
          == second["dropped_stale"])


def _main_cmd(workdir, num_steps):
  return tiny_settings.main_args(REPO, workdir, {
      "train.mode": "async", "train.num_steps": num_steps,
      "train.checkpoint_every": 2})


def test_sigkill_trainer_then_resume(tmp_path):
  before = _our_segments()
  workdir = tmp_path / "run"
  log1 = open(tmp_path / "first.log", "w")
  first = subprocess.Popen(_main_cmd(workdir, 1000), cwd=REPO, stdout=log1,
                           stderr=subprocess.STDOUT)
  ckpt_dir = workdir / "checkpoints"
  deadline = time.time() + 300
  while time.time() < deadline:
    steps = [d for d in os.listdir(ckpt_dir)] if ckpt_dir.exists() else []
    if any(s.isdigit() and int(s) >= 2 for s in steps):
      break
    assert first.poll() is None, open(tmp_path / "first.log").read()[-3000:]
    time.sleep(0.5)
  else:
    pytest.fail("no checkpoint within 300 s")
  children = psutil.Process(first.pid).children(recursive=True)
  samplers = [c for c in children if "sao_jax" in " ".join(c.cmdline())
              or "multiprocessing" in " ".join(c.cmdline())]
  assert samplers, "the trainer has no sampler child process"
  # The same command again while the first runs: refused before any compute,
  # naming the holder (issue 30: both used to write the same checkpoints).
  again = subprocess.run(_main_cmd(workdir, 1000), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
  assert again.returncode == 1, again.stderr[-3000:]
  assert f"is in use by another run: pid {first.pid} on host" in again.stderr
  assert "Started sampler" not in again.stderr
  assert first.poll() is None  # The first run is untouched.
  first.send_signal(signal.SIGKILL)
  first.wait(30)
  # The orphaned sampler notices its parent is gone and exits.
  _, alive = psutil.wait_procs(samplers, timeout=30)
  assert not alive, f"orphaned processes still alive: {alive}"

  # The killed run's lock does not block its resume, which trains on from
  # its newest checkpoint to 2 steps past it (not all 1,000: the check is the
  # resume, not the steps after it).
  saved = max(int(s) for s in os.listdir(ckpt_dir) if s.isdigit())
  assert 2 <= saved < 1001
  second = subprocess.run(_main_cmd(workdir, saved + 1), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
  assert second.returncode == 0, second.stderr[-3000:]
  resumed = re.search(r"Resumed from checkpoint step (\d+)", second.stderr)
  assert resumed and 2 <= int(resumed.group(1)) <= saved, (
      second.stderr[-3000:])
  steps_done = max(int(s) for s in os.listdir(ckpt_dir) if s.isdigit())
  assert steps_done == saved + 2  # 1 warm-up + saved + 1 policy steps.
  time.sleep(1.0)  # The killed run's resource tracker unlinks its segments.
  assert _our_segments() <= before, _our_segments() - before


def _two_process_run(workdir, num_steps, logdir, expect_rc=0):
  """Runs two trainer processes (one run on 2 hosts); returns their logs."""
  port = multihost.free_port()
  procs, logs = [], []
  for pid in range(2):
    logs.append(logdir / f"steps{num_steps}_process{pid}.log")
    cmd = _main_cmd(workdir, num_steps) + [
        "--config.sampler.batch_size=4",  # Each host's half of 8 rows.
        f"--config.distributed.coordinator_address=localhost:{port}",
        "--config.distributed.num_processes=2",
        f"--config.distributed.process_id={pid}"]
    with open(logs[-1], "w") as log:
      procs.append(subprocess.Popen(
          cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
          env=dict(os.environ, JAX_PLATFORMS="cpu")))
  try:
    rcs = [p.wait(timeout=900) for p in procs]
  finally:
    for p in procs:
      p.kill()
  texts = [log.read_text() for log in logs]
  assert rcs == [expect_rc] * 2, "\n\n".join(t[-3000:] for t in texts)
  return texts


def test_two_process_run_trains_one_global_model_and_resumes(tmp_path):
  """Two trainer processes (jax.distributed on localhost, gloo), one sampler
  and ring each, one shared workdir: the multi-host shape of a TPU pod run."""
  before = _our_segments()
  workdir = tmp_path / "run"
  texts = _two_process_run(workdir, 3, tmp_path)
  for pid, text in enumerate(texts):
    assert f"Distributed: process {pid} of 2" in text
    assert f"prompt shard {pid} of 2" in text  # Its sampler's prompts.
    # 1 critic warm-up step + 3 policy steps, in lockstep on both hosts.
    assert "step 4/4 | v3 |" in text
  assert texts[1].count("Trained a ") == 0  # Host 1 loaded host 0's file.
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == 4 and summary["policy_version"] == 3
  # Host 0's stream: 4 of the 8 rows of each of the 4 steps.
  assert summary["trajectories_trained"] == 4 * 4
  events = glob.glob(str(workdir / "tb" / "events.out.tfevents*"))
  assert len(events) == 1, events  # Only process 0 writes events.
  assert [s for s, _ in metrics_lib.read_scalars(
      str(workdir / "tb"))["policy/loss"]] == [2, 3, 4]

  # While another run holds the workdir, both processes refuse at once.
  holder = workdir_lock.acquire(str(workdir), 0, 1)
  try:
    texts = _two_process_run(workdir, 5, tmp_path, expect_rc=1)
  finally:
    holder.release()
  assert f"is in use by another run: pid {os.getpid()}" in texts[0]
  assert "Process 0 of this run could not lock" in texts[1]
  assert not any("Started sampler" in text for text in texts)
  # Both hosts resume from the step-4 checkpoint into the mesh shardings.
  texts = _two_process_run(workdir, 5, tmp_path)
  for text in texts:
    assert "Resumed from checkpoint step 4 (policy version 3)" in text
    assert "step 6/6 | v5 |" in text
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == 6 and summary["policy_version"] == 5
  assert [s for s, _ in metrics_lib.read_scalars(
      str(workdir / "tb"))["policy/loss"]] == [2, 3, 4, 5, 6]
  assert sorted(int(d) for d in os.listdir(workdir / "checkpoints")
                if d.isdigit()) == [2, 4, 6]
  # Each host's consumed episodes (its own numbers), gathered into the
  # checkpoint: 4 rows of each of the 6 steps at least.
  with open(workdir / "checkpoints" / "6" / "meta" / "metadata") as f:
    hosts = json.load(f)[consumed.META_KEY]
  assert len(hosts) == 2
  assert all(h["watermark"] + len(h["above"]) >= 4 * 6 for h in hosts)
  assert _our_segments() <= before


def test_packed_run_trains_several_trajectories_a_row_and_resumes(tmp_path):
  """``train.pack`` end to end (docs/design/data_path.md "Packed rows"): rows
  hold several trajectories (more trained than rows, less padding), the metrics
  say so, and across a stop and a resume no episode is consumed twice."""
  packed = {**EXACTLY_ONCE, "train.record_stream": False, "train.pack": True,
            "train.pack_max_segments": 4}
  first = loop.train_and_evaluate(
      tiny_config(**{**packed, "train.num_steps": 2}), str(tmp_path))
  second = loop.train_and_evaluate(
      tiny_config(**{**packed, "train.num_steps": 4}), str(tmp_path))
  assert second["steps"] == 5
  rows = 8 * first["steps"]
  assert first["trajectories_trained"] > rows
  assert 0.0 <= first["padding_frac"] < 0.5
  assert second["episodes_consumed_twice"] == 0
  scalars = metrics_lib.read_scalars(str(tmp_path / "tb"))
  fracs = [v for _, v in scalars["batch/padding_frac"]]
  assert fracs and all(0.0 <= f < 0.5 for f in fracs)
  assert np.mean([v for _, v in scalars["batch/trajectories"]]) > 8
  assert "stream/padding_frac" in scalars and "summary/padding_frac" in scalars
