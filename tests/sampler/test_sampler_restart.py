"""Sampler restarts (sao_jax/sampler/supervisor.py; docs/design/failures.md
"Failure handling"): a run whose sampler dies carries on, trains on no
episode twice and loses none.

The runs' sampler processes (restarted ones included) compile into the
session's persistent compilation cache (tests/conftest.py), not a cache of
their own: one of their own would compile every run's decode loop cold.
test_loop.py checks that ``sampler.compilation_cache_dir`` is used."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from sao_jax.sampler import stats as stats_lib
from sao_jax.sampler import supervisor
from sao_jax.train import loop
from sao_jax.train import metrics as metrics_lib
from tiny_settings import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_restart_policy_bounds_per_run_and_per_window():
  policy = supervisor.RestartPolicy(max_restarts=4, window_s=100.0,
                                    max_per_window=2)
  assert policy.refusal([], 0.0) == ""
  assert policy.refusal([0.0], 50.0) == ""
  assert "2 in the last 100 s" in policy.refusal([0.0, 50.0], 99.0)
  assert policy.refusal([0.0, 50.0], 100.0) == ""  # The first has aged out.
  assert "4 of sampler.max_restarts=4" in policy.refusal(
      [0.0, 200.0, 400.0, 600.0], 1000.0)
  assert "0 of sampler.max_restarts=0" in supervisor.RestartPolicy().refusal(
      [], 0.0)
  unbounded_window = supervisor.RestartPolicy(3, 1.0, 0)
  assert unbounded_window.refusal([5.0, 5.0], 5.0) == ""


def test_counters_merge_over_a_restart_as_each_was_declared():
  # In shared memory, as the sampler process and the trainer hold them.
  ctx = multiprocessing.get_context("spawn")
  old, new = (ctx.Value(stats_lib.SamplerStats, lock=False) for _ in "ab")
  old.episodes, old.busy_s, old.weights_version, old.alive = 9, 2.0, 5, -1
  # Another component's counters, declared where they are written.
  old.put("code_calls", "sum", 3)
  old.put("code_exec_s_p50", "last", 0.5)
  old.put("toy_peak", "max", 7)
  past = {}
  supervisor.retire(past, old, episodes=4)  # 4 committed before the kill.
  new.episodes, new.busy_s, new.weights_version, new.alive = 2, 1.0, 3, 1
  new.put("code_calls", "sum", 1)
  new.put("toy_peak", "max", 2)
  run = supervisor.run_counters(past, new)
  got = run.as_dict()
  assert (got["sampler/episodes"], got["sampler/busy_s"]) == (6, 3.0)
  assert got["sampler/weights_version"] == 5 and run.alive == 1
  assert (got["sampler/code_calls"], got["sampler/toy_peak"]) == (4, 7)
  assert "sampler/code_exec_s_p50" not in got  # The new one's, not yet set.
  assert "sampler/alive" not in got
  new.put("code_exec_s_p50", "last", 0.25)
  assert supervisor.run_counters(past, new).as_dict()[
      "sampler/code_exec_s_p50"] == 0.25
  assert [n for n, _, _ in new.counters()][-3:] == [
      "code_calls", "toy_peak", "code_exec_s_p50"]
  with pytest.raises(ValueError, match="merge 'max' is not sum"):
    new.put("episodes", "max", 1)
  with pytest.raises(ValueError, match="one of sum, max, last"):
    new.put("toy_peak", "mean", 1)


def _kill_sampler_after(monkeypatch, steps):
  """SIGKILLs the sampler process as the trainer announces each of ``steps``
  (its main thread; a step that comes while the last one killed is not yet
  replaced, trained on records the dead one committed, moves the kill to the
  next step); returns [(step, pid)]."""
  killed = []
  original = supervisor.SupervisedSampler.set_trainer_step

  def set_step(self, step):
    original(self, step)
    pid = self.handle.process.pid
    due = [s for s in steps if s <= step][len(killed):]
    if due and pid not in [p for _, p in killed] and self.handle.alive():
      os.kill(pid, signal.SIGKILL)
      killed.append((step, pid))

  monkeypatch.setattr(supervisor.SupervisedSampler, "set_trainer_step",
                      set_step)
  return killed


def _assert_exactly_once(summary, restarts):
  assert summary["sampler_restarts"] == restarts
  assert summary["sampler_downtime_s"] > 0.0
  assert summary["episodes_consumed_twice"] == 0
  # Every record read was a distinct episode, and the watermark passed every
  # episode but the few consumed above it (in flight at the stop): the ones
  # the dead samplers had in flight were generated again, none is lost.
  read = summary["trajectories_read_from_ring"]
  assert summary["episodes_watermark"] + summary[
      "episodes_above_watermark"] == read
  # Bounded by the episodes in flight at the stop (8 slots and the staleness
  # admission window, 8 x (max_staleness 2 + 1)), however many restarts.
  assert summary["episodes_above_watermark"] <= 8 * 3
  # Records written by all the run's samplers = read + left at the stop.
  assert summary["sampler_episodes"] == read + summary["ring_unread_at_stop"]


@pytest.mark.slow
@pytest.mark.multiprocess
# Async: the last kill is more than max_staleness (2) steps before the end, so
# the dead sampler's committed records cannot serve every remaining step and
# it must be replaced, even with each kill delayed until the last one is
# replaced (at step 6 of 8, a sampler 2 steps ahead under load
# had written enough for steps 7-8 and was never restarted: 2 restarts of 3).
@pytest.mark.parametrize("mode,kills,steps", [("async", (2, 4, 6), 12),
                                              ("sync", (2, 5), 8)])
def test_sigkilled_sampler_is_restarted_and_nothing_trains_twice(
    tmp_path, monkeypatch, mode, kills, steps):
  killed = _kill_sampler_after(monkeypatch, kills)
  config = tiny_config(**{
      "train.mode": mode, "train.num_steps": steps, "train.max_staleness": 2,
      "train.checkpoint_every": 0, "sampler.max_restarts": 5})
  summary = loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert len({pid for _, pid in killed}) == len(kills)  # A new one each time.
  assert [s for s, _ in killed][0] == kills[0]
  # 1 warm-up + the policy steps, all trained.
  assert summary["steps"] == steps + 1
  assert summary["trajectories_trained"] >= (steps + 1) * 8
  _assert_exactly_once(summary, len(kills))
  if mode == "sync":
    assert summary["staleness_max"] == 0  # Still strictly on-policy.
  scalars = metrics_lib.read_scalars(str(tmp_path / "run" / "tb"))
  restarts = dict(scalars["sampler/restarts"])
  assert restarts[steps + 1] == len(kills) and restarts[1] == 0
  assert max(v for _, v in scalars["sampler/downtime_s"]) > 0


_CRASHING_ENV_RUN = textwrap.dedent("""
    import json
    import multiprocessing
    import os
    import sys

    from sao_jax.envs import reasoning_gym_env
    from sao_jax.envs import registry


    class CrashingEnv(reasoning_gym_env.ReasoningGymEnv):
      # The sampler's 20th env.reset raises SystemExit (a tool calling
      # sys.exit), in the first CRASHES sampler processes: not an error row,
      # the sampler process dies. The trainer's eval uses the env too.
      calls = 0

      def reset(self, task):
        if multiprocessing.current_process().name.startswith("sao-sampler"):
          CrashingEnv.calls += 1
          path = os.path.join(os.environ["CRASH_DIR"], "crashes")
          done = os.path.getsize(path) if os.path.exists(path) else 0
          if CrashingEnv.calls == 20 and done < int(os.environ["CRASHES"]):
            with open(path, "a") as f:
              f.write("x")
            sys.exit(f"tool crashed (crash {done + 1})")
        return super().reset(task)


    # At the top level: the spawned sampler re-imports this file.
    registry.register_env("crash", CrashingEnv)

    if __name__ == "__main__":
      from sao_jax.train import loop
      from tiny_settings import tiny_config
      config = tiny_config(**{
          "env.name": "crash", "train.mode": "async", "train.num_steps": 6,
          "train.checkpoint_every": 0, "sampler.max_restarts": 5,
          "sampler.max_restarts_per_window": int(sys.argv[2])})
      summary = loop.train_and_evaluate(config, sys.argv[1] + "/run")
      print("SUMMARY", json.dumps(summary), flush=True)
""")


def _crashing_run(tmp_path, crashes, per_window):
  script = tmp_path / "crash_run.py"
  script.write_text(_CRASHING_ENV_RUN)
  return subprocess.run(
      [sys.executable, str(script), str(tmp_path), str(per_window)],
      cwd=REPO, capture_output=True, text=True, timeout=900,
      env=dict(os.environ, PYTHONPATH=f"{REPO}:{REPO}/tests",
               CRASH_DIR=str(tmp_path), CRASHES=str(crashes)))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sampler_that_raises_in_an_environment_is_restarted(tmp_path):
  run = _crashing_run(tmp_path, crashes=2, per_window=3)
  assert run.returncode == 0, run.stderr[-4000:]
  summary = json.loads(run.stdout.split("SUMMARY ", 1)[1])
  assert (tmp_path / "crashes").read_text() == "xx"
  _assert_exactly_once(summary, 2)
  assert summary["steps"] == 7
  # The death is logged with its exit code and its traceback's tail.
  assert run.stderr.count("Restarting the sampler (restart ") == 2
  assert "exited with code 1. Its error:" in run.stderr
  assert "SystemExit: tool crashed (crash 2)" in run.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_sampler_that_keeps_dying_stops_the_run_with_its_error(tmp_path):
  """Past sampler.max_restarts_per_window the run stops with today's error,
  saying how many restarts it took."""
  run = _crashing_run(tmp_path, crashes=9, per_window=1)
  assert run.returncode != 0
  assert (tmp_path / "crashes").read_text() == "xx"  # 1 restart, 2 deaths.
  lines = run.stderr.strip().splitlines()
  died = [l for l in lines
          if l.startswith("sao_jax.sampler.process.SamplerDiedError")]
  assert died, run.stderr[-4000:]
  assert died[-1].startswith(
      "sao_jax.sampler.process.SamplerDiedError: After 1 sampler restarts")
  assert "sampler.max_restarts_per_window=1" in died[-1]
  assert "exited with code 1. Its error:" in died[-1]
  # Its message ends with the second sampler's traceback tail.
  tail = lines[len(lines) - 1 - lines[::-1].index(died[-1]):]
  assert "SystemExit: tool crashed (crash 2)" in tail, tail[-20:]
  assert not (tmp_path / "run" / "summary.json").exists()
