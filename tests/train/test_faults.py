"""Fault injection (issue 17): a run never goes silently wrong or hangs.

Each test injects one fault from the issue's table and asserts what the run
does about it: the error's words, exit codes, which checkpoints exist and that
they are finite, what is left in /dev/shm, counters.
"""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import psutil
import pytest

from configs import base
from sao_jax import config_validation as cv
from sao_jax.data import stream as stream_lib
from sao_jax.envs import base as base_env
from sao_jax.ipc import segment
from sao_jax.models import hf
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.sampler import process as sampler_process
from sao_jax.sampler import rollout
from sao_jax.train import checkpoint as ckpt_lib
from sao_jax.train import step as step_lib
from sao_jax.data.trajectory import FinishReason
from sao_jax.data.trajectory import Trajectory
import scripted_policy
import tiny_settings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)


# ------------------------------------------------ row 11: validation ---------


@pytest.mark.parametrize("path,value,words", [
    ("optim.actor_lr", math.inf, "config.optim.actor_lr: expected a finite"),
    ("optim.critic_lr", math.nan, "config.optim.critic_lr: expected a finite"),
    ("optim.actor_lr", 0.0, "config.optim.actor_lr: expected a finite"),
    ("train.sft_lr", math.inf, "config.train.sft_lr: expected a finite"),
    ("optim.grad_clip", -1.0, "config.optim.grad_clip: expected a finite "
     "float > 0 (global-norm clip) or 0 (no clipping)"),
    ("optim.grad_clip", math.inf, "config.optim.grad_clip: expected"),
    ("env.eval_size", 0, "config.env.eval_size: expected a positive int"),
    ("sampler.devices", "abc", "config.sampler.devices: expected CPU core ids"),
    ("sampler.devices", "0-x", "config.sampler.devices: expected CPU core ids"),
    ("train.max_skipped_steps", 0,
     "config.train.max_skipped_steps: expected a positive int"),
    ("sampler.max_restarts", -1, "config.sampler.max_restarts: expected int"),
    ("sampler.restart_window_s", 0.0,
     "config.sampler.restart_window_s: expected float > 0"),
    ("sampler.max_restarts_per_window", -2,
     "config.sampler.max_restarts_per_window: expected int >= 0"),
])
def test_validation_rejects_row_11_values(path, value, words):
  config = base.get_config()
  section, _, key = path.rpartition(".")
  config[section][key] = value
  with pytest.raises(cv.ConfigError) as e:
    cv.validate_config(config)
  assert str(e.value).startswith(words), str(e.value)


@pytest.mark.parametrize("path,value", [
    ("optim.grad_clip", 0.0), ("optim.grad_clip", 0.5),
    ("sampler.devices", "0,1"), ("sampler.devices", "0-1"),
    ("env.eval_size", 1)])
def test_validation_accepts_explicit_values(path, value):
  config = base.get_config()
  section, _, key = path.rpartition(".")
  config[section][key] = value
  cv.validate_config(config)


# ------------------------------------- row 1: non-finite numbers, unit ------


def _state_and_batch(lr: float):
  tok = jnp.zeros((1, 4), jnp.int32)
  p = nn.unbox(transformer.Transformer(CFG).init(
      jax.random.PRNGKey(0), tok, tok, tok > -1)["params"])
  v = transformer.value_params_from_policy(p, CFG, jax.random.PRNGKey(1))
  ptx, vtx = optax.adam(lr), optax.adam(lr)
  state = step_lib.create_train_state(p, v, ptx, vtx)
  rng = np.random.default_rng(0)
  action = np.zeros((2, 8), np.uint8)
  action[:, 3:] = 1
  rewards = np.zeros((2, 8), np.float32)
  rewards[0, 7] = 1.0
  batch = {"tokens": jnp.asarray(rng.integers(4, 32, (2, 8)), jnp.int32),
           "attention_mask": jnp.ones((2, 8), bool),
           "action_mask": jnp.asarray(action),
           "rewards": jnp.asarray(rewards),
           "rollout_logp": jnp.asarray(-np.ones((2, 8), np.float32) * action),
           "prompt_id": jnp.asarray([0, 1])}
  fn = step_lib.make_step(CFG, step_lib.StepConfig(critic_updates_per_step=1),
                          ptx, vtx, update_policy=True)
  return state, batch, fn


def test_nonfinite_step_is_skipped_and_state_kept():
  state, batch, fn = _state_and_batch(1e-3)
  before = jax.device_get(state)
  bad = dict(batch, rewards=batch["rewards"].at[0, 7].set(jnp.nan))
  new, metrics = fn(jax.tree.map(jnp.copy, state), bad)
  assert int(new.step) == 1 and int(new.policy_version) == 0
  for a, b in zip(jax.tree.leaves(jax.device_get(new.policy_params)),
                  jax.tree.leaves(before.policy_params)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(jax.device_get(
      (new.value_params, new.policy_opt_state, new.value_opt_state))),
                  jax.tree.leaves((before.value_params,
                                   before.policy_opt_state,
                                   before.value_opt_state))):
    np.testing.assert_array_equal(a, b)
  assert float(metrics["health/skipped"]) == 1.0
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(
      jax.device_get(new)) if np.issubdtype(np.asarray(x).dtype, np.inexact))
  # A finite batch still trains.
  new, metrics = fn(new, batch)
  assert float(metrics["health/skipped"]) == 0.0
  assert int(new.policy_version) == 1 and int(new.step) == 2


def test_skip_guard_stops_after_consecutive_skips_naming_the_metric():
  from sao_jax.train import health  # pylint: disable=g-import-not-at-top

  guard = health.SkipGuard(3)
  good = {"policy/loss": 0.5, "critic/grad_norm": 1.0}
  bad = {"policy/loss": math.nan, "critic/grad_norm": 1.0}
  guard.observe(1, True, bad)
  guard.observe(2, False, good)  # The run of skips restarts.
  guard.observe(3, True, {"critic/grad_norm": math.inf, "policy/loss": 1.0})
  guard.observe(4, True, bad)
  with pytest.raises(health.NonFiniteError) as e:
    guard.observe(5, True, bad)
  msg = str(e.value)
  assert msg.startswith("Step 5: 3 consecutive train steps (3..5)")
  assert "at step 3, was critic/grad_norm=inf" in msg
  assert guard.skipped_total == 4


def test_checkpoint_with_nonfinite_leaf_is_never_written(tmp_path):
  good = {"w": np.ones(3, np.float32), "step": np.ones((), np.int32)}
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  try:
    ckpt.save(1, good, {})
    bad = {"w": np.array([1.0, np.nan, 2.0], np.float32),
           "step": np.ones((), np.int32)}
    saved = ckpt.save(2, bad, {})
    assert ckpt.latest_step() == 1
    assert saved is False
    state, _, step = ckpt.restore(good)
    assert step == 1 and np.isfinite(state["w"]).all()
  finally:
    ckpt.close()


# ------------------------------------- row 1: non-finite numbers, a run -----


def _checkpoint_leaves(workdir) -> dict[int, list[np.ndarray]]:
  """Every saved checkpoint's state leaves, by step (read without a target)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  out = {}
  ckpt_dir = os.path.join(workdir, "checkpoints")
  for name in sorted(os.listdir(ckpt_dir)):
    if name.isdigit():
      with ocp.StandardCheckpointer() as reader:
        state = reader.restore(os.path.join(ckpt_dir, name, "state"))
      out[int(name)] = jax.tree.leaves(state)
  return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_huge_learning_rate_stops_the_run_without_nan_checkpoints(tmp_path):
  """Row 1: lr 1e6 makes every update non-finite: skipped, then a failure."""
  workdir = tmp_path / "run"
  run = subprocess.run(
      tiny_settings.main_args(REPO, workdir, {
          "optim.actor_lr": 1e6, "optim.critic_lr": 1e6,
          "train.num_steps": 8, "train.checkpoint_every": 1,
          "train.mode": "sync"}),
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert run.returncode != 0, run.stderr[-3000:]
  assert ("NonFiniteError: Step 3: 3 consecutive train steps (1..3) produced "
          "non-finite numbers" in run.stderr), run.stderr[-3000:]
  assert "the first non-finite metric, at step 1, was" in run.stderr
  assert not (workdir / "summary.json").exists()
  saved = _checkpoint_leaves(workdir)
  assert saved, "no checkpoint at all"
  for step, leaves in saved.items():
    for leaf in leaves:
      if np.issubdtype(np.asarray(leaf).dtype, np.inexact):
        assert np.isfinite(leaf).all(), f"checkpoint {step} holds NaN/Inf"


# ------------------------------- rows 3, 4: sampler death and orphans -------


def _our_segments() -> set[str]:
  """``sao_`` segments in /dev/shm whose creator is this process or dead."""
  out = set()
  for name in os.listdir("/dev/shm"):
    pid = segment.creator_pid(name)  # None: another program's file.
    if pid is not None and (pid == os.getpid() or not psutil.pid_exists(pid)):
      out.add(name)
  return out


_HUNG_CHILD = textwrap.dedent("""
    import multiprocessing as mp
    import os
    import sys
    import time

    def hung_sampler(parent_pid, ready):
      from sao_jax.sampler import process
      process.die_with_parent(parent_pid)
      ready.set()
      time.sleep(3600)  # Stands for an env.step that never returns.

    if __name__ == "__main__":
      ctx = mp.get_context("spawn")
      ready = ctx.Event()
      child = ctx.Process(target=hung_sampler, args=(os.getpid(), ready))
      child.start()
      print(child.pid, ready.wait(120), flush=True)
      time.sleep(3600)
""")


@pytest.mark.multiprocess
def test_sampler_dies_with_its_parent_even_when_hung(tmp_path):
  """Row 3: SIGKILL the parent of a sampler stuck in a call: it goes too."""
  script = tmp_path / "parent.py"
  script.write_text(_HUNG_CHILD)
  parent = subprocess.Popen([sys.executable, str(script)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO))
  try:
    pid, ready = parent.stdout.readline().split()
    child = psutil.Process(int(pid))
    assert ready == "True" and child.is_running()
    parent.send_signal(signal.SIGKILL)
    parent.wait(30)
    _, alive = psutil.wait_procs([child], timeout=10)
    assert not alive, "the sampler outlived its SIGKILLed parent"
  finally:
    parent.kill()
    parent.wait(30)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dead_sampler_is_one_error_with_its_exit_code_and_error(tmp_path):
  """Row 4: a record larger than the ring kills the sampler; the trainer says
  so in one error, not a bare StopIteration, and leaves no segment."""
  before = _our_segments()
  run = subprocess.run(
      tiny_settings.main_args(REPO, tmp_path / "run", {
          "ring.capacity_bytes": 256, "train.num_steps": 4,
          "train.mode": "sync", "sampler.max_restarts": 0}),
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert run.returncode != 0
  last = run.stderr.strip().splitlines()
  error_at = [i for i, line in enumerate(last)
              if line.startswith("sao_jax.sampler.process.SamplerDiedError")]
  assert error_at, run.stderr[-3000:]
  assert "exited with code 1. Its error:" in last[error_at[-1]]
  assert last[-1].startswith("ValueError: Record of ")
  assert "does not fit in a lane of 256 bytes" in last[-1]
  assert "StopIteration" not in run.stderr
  assert not (tmp_path / "run" / "summary.json").exists()
  time.sleep(1.0)
  assert _our_segments() <= before, _our_segments() - before


# --------------------------------- rows 5, 7: checkpoints on the way out ----


def test_restore_falls_back_past_a_corrupt_newest_checkpoint(tmp_path, caplog):
  """Row 7: the newest checkpoint is corrupt: the previous one is restored."""
  state = {"w": np.zeros(3, np.float32)}
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  try:
    for step in (1, 2):
      ckpt.save(step, {"w": np.full(3, step, np.float32)}, {"at": step})
    for root, _, files in os.walk(tmp_path / "2" / "state"):
      for name in files:  # Garble every file of the newest state.
        with open(os.path.join(root, name), "wb") as f:
          f.write(b"garbage")
    with caplog.at_level("WARNING"):
      restored, meta, step = ckpt.restore_newest(state)
    assert step == 1 and meta == {"at": 1}
    np.testing.assert_array_equal(restored["w"], np.ones(3, np.float32))
    warned = [r.getMessage() for r in caplog.records
              if r.levelname == "WARNING"]
    assert any(m.startswith("Skipping checkpoint step 2: Checkpoint step 2 in")
               for m in warned), warned
    assert ckpt.latest_step() == 1
    assert (tmp_path / "2.unrestorable").is_dir()
  finally:
    ckpt.close()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_saves_the_last_completed_step(tmp_path):
  """Row 5: with periodic checkpoints off, SIGTERM still keeps the work."""
  before = _our_segments()
  workdir = tmp_path / "run"
  log_path = tmp_path / "run.log"
  with open(log_path, "w") as log:
    proc = subprocess.Popen(
        tiny_settings.main_args(REPO, workdir, {
            "train.num_steps": 200, "train.checkpoint_every": 0,
            "train.mode": "sync"}),
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
  try:
    deadline = time.time() + 300
    while " step 3/201 " not in log_path.read_text():
      assert proc.poll() is None, log_path.read_text()[-3000:]
      assert time.time() < deadline, "no step 3 within 300 s"
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(120)
  finally:
    proc.kill()
    proc.wait(30)
  text = log_path.read_text()
  assert rc != 0, text[-3000:]
  assert not (workdir / "summary.json").exists()
  saved = _checkpoint_leaves(workdir)
  assert saved and max(saved) >= 3, (sorted(saved), text[-3000:])
  assert f"saving step {max(saved)} before exiting" in text
  for leaf in saved[max(saved)]:
    if np.issubdtype(np.asarray(leaf).dtype, np.inexact):
      assert np.isfinite(leaf).all()
  time.sleep(1.0)
  assert _our_segments() <= before, _our_segments() - before


# ------------------------------------ rows 2, 6: env time limits, errors ----


class _FixedEnv(base_env.Environment):
  """One-step episodes; ``hang``: its step never returns (a hung scorer)."""

  name = "fixed"

  def __init__(self, hang: bool):
    self._hang = hang

  def reset(self, task):
    self.prompt_id = task
    return "What is 1 + 1?"

  def step(self, action_text):
    if self._hang:
      threading.Event().wait(600)
    return base_env.StepResult("", 1.0, True, {})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return tiny_settings.arithmetic_tokenizer(tmp_path_factory.mktemp("tok"))


def test_hung_env_step_becomes_an_error_row_and_others_go_on(tok):
  """Row 2: env.step_timeout_s bounds a step; only that episode fails."""
  limits = rollout.RolloutLimits(max_turns=2, max_total_tokens=64,
                                 max_new_tokens_per_turn=4,
                                 step_timeout_s=0.5)
  t0 = time.monotonic()
  trajs, _ = scripted_policy.play(
      [[tok.eos_id], [tok.eos_id]],
      [_FixedEnv(hang=True), _FixedEnv(hang=False)], [0, 1], tok, limits)
  assert time.monotonic() - t0 < 10
  assert trajs[0].finish_reason == FinishReason.ERROR
  assert trajs[0].error == ("step: TimeoutError: env.step did not return "
                            "within env.step_timeout_s=0.5 s")
  assert trajs[1].finish_reason == FinishReason.STOP
  assert float(trajs[1].rewards.sum()) == 1.0


def _traj(error: str = "") -> Trajectory:
  n = 6
  return Trajectory(
      prompt_id=7, tokens=np.arange(n), action_mask=[0, 0, 1, 1, 1, 0],
      rollout_logp=np.full(n, -1.0), policy_version=np.zeros(n),
      rewards=[0, 0, 0, 0, 1, 0], task="fixed",
      finish_reason=FinishReason.ERROR if error else FinishReason.STOP,
      error=error)


def test_error_rows_are_never_trained_on_and_too_many_stop_the_run():
  """Rows 2, 6: ERROR rows carry no action or reward; > max_error_frac of a
  window of them raises, quoting one."""
  counters = stream_lib.StreamCounters()
  pad = stream_lib.PadToLength(8, counters, max_error_frac=0.5,
                               error_window=4)
  row = pad.map((_traj("step: TimeoutError: hung"), 0))
  assert row["action_mask"].sum() == 0 and row["rewards"].sum() == 0
  assert counters.error_rows == 1
  ok = pad.map((_traj(), 0))
  assert ok["action_mask"].sum() == 3 and ok["rewards"].sum() == 1
  pad.map((_traj("reset: ValueError: prompt too long"), 0))  # 2 of 3.
  with pytest.raises(stream_lib.TooManyErrorsError) as e:
    pad.map((_traj("reset: ValueError: prompt has 40 tokens"), 0))
  assert str(e.value) == (
      "3 of the last 4 trajectories ended in an environment error (> "
      "train.max_error_frac=0.5); e.g. prompt 7 (fixed): reset: ValueError: "
      "prompt has 40 tokens")


def test_long_prompts_are_skipped_and_counted_at_selection(caplog):
  """Row 6: a task whose prompt alone is over the budget is skipped before
  any reset, counted and warned about; the same draw of a later epoch takes
  its place (a function of the draw alone: resumes pick the same tasks)."""
  from sao_jax.data import prompts  # pylint: disable=g-import-not-at-top

  lengths = {task: 40 if task % 3 == 0 else 5 for task in range(30)}
  asked = []

  def prompt_len(task):
    asked.append(task)
    if task == 3:  # Would be skipped, but its length is unknown.
      raise ValueError("the env's own reset will report this")
    return lengths[task]

  ds = prompts.prompt_dataset(range(30), seed=0)
  picker = prompts.FittingPrompts(ds, 30, prompt_len, max_tokens=32)
  with caplog.at_level("WARNING"):
    drawn = [picker[k] for k in range(60)]
  assert all(lengths[t] < 32 or t == 3 for t in drawn)

  def tries(k):  # Draws of k whose task was too long.
    i = 0
    while lengths[ds[k + i * 30]] >= 32 and ds[k + i * 30] != 3:
      i += 1
    return i

  assert picker.skipped == sum(tries(k) for k in range(60)) > 0
  assert sorted(asked) == sorted(set(asked))  # Each task measured once.
  assert [picker[k] for k in range(60)] == drawn  # Same draws, same tasks.
  again = prompts.FittingPrompts(ds, 30, prompt_len, max_tokens=32)
  assert [again[k] for k in range(30, 60)] == drawn[30:]  # As if resumed.
  warned = [r.getMessage() for r in caplog.records]
  assert warned[0].startswith("Skipped the prompt of task ")
  assert "40 tokens >= max_total_tokens=32 (1 prompts skipped so far)" in (
      warned[0])
  never = prompts.FittingPrompts(ds, 30, lambda t: 40, max_tokens=32,
                                 max_tries=5)
  with pytest.raises(ValueError, match=(
      "Prompt draw 7: 5 tasks in a row have prompts too long "
      r"\(e.g. task \d+: 40 tokens >= max_total_tokens=32\)")):
    never[7]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_prompt_too_long_stops_the_run(tmp_path):
  """Row 6: prompts longer than max_total_tokens: an error, not a run that
  trains on empty trajectories and exits 0. The task's measured lengths
  (``envs/task_sizing.py``) catch it at start-up, before any sampler runs;
  a prompt that the sample missed is skipped at selection
  (``test_long_prompts_are_skipped_and_counted_at_selection`` above)."""
  before = _our_segments()
  run = subprocess.run(
      tiny_settings.main_args(REPO, tmp_path / "run", {
          "sampler.max_total_tokens": 8, "train.max_seq_len": 8,
          "train.num_steps": 20, "train.mode": "sync"}),
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert run.returncode != 0
  last = run.stderr.strip().splitlines()[-1]
  assert last.startswith(
      "config.sampler.max_total_tokens=8 is too small for 'basic_arithmetic': "
      "prompt and reply need up to "), run.stderr[-3000:]
  assert last.endswith(
      "Raise config.sampler.max_total_tokens to >= 24, or set it to 0 to "
      "derive it from the task."), last
  assert "Started sampler process" not in run.stderr
  assert not (tmp_path / "run" / "summary.json").exists()
  time.sleep(1.0)
  assert _our_segments() <= before, _our_segments() - before


def test_trainer_wait_for_data_is_derived_from_the_config():
  """Row 2: the trainer waits for one sampler batch's generation allowance
  plus the bound of its env calls, and says how the figure was made."""
  config = base.get_config()  # 16 episodes, 1 turn, 60 s per env call.
  assert rollout.data_wait_s(config) == (3480.0, (
      "3480 s = ring.get_timeout_s=600 s (generation) + 48 env calls (16 "
      "episodes x (probe, reset, 1 steps)) x env.step_timeout_s=60 s"))
  config.env.max_turns, config.env.step_timeout_s = 3, 0.5
  config.sampler.batch_size, config.sampler.n_rollouts = 10, 4  # 2 x 4.
  assert rollout.data_wait_s(config)[0] == 600 + 8 * 5 * 0.5


@pytest.mark.slow
@pytest.mark.multiprocess
def test_trainer_wait_error_says_what_it_waited_for_and_the_sampler_state(
    tmp_path):
  """Row 2: the trainer's wait ends in an error naming the wait, how long
  and why, the batch and what the sampler was doing (its sampler starts
  slower than the 1.24 s this config allows)."""
  before = _our_segments()
  run = subprocess.run(
      tiny_settings.main_args(REPO, tmp_path / "run", {
          "ring.get_timeout_s": 1.0, "env.step_timeout_s": 0.01,
          "train.num_steps": 4, "train.mode": "sync"}),
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert run.returncode != 0
  lines = [line for line in run.stderr.splitlines()
           if line.startswith(
               "TimeoutError: Step 1: no trajectory for the batch of 8 within "
               "1.24 s = ring.get_timeout_s=1 s (generation) + 24 env calls "
               "(8 episodes x (probe, reset, 1 steps)) x "
               "env.step_timeout_s=0.01 s (0 read so far); the sampler ")]
  assert lines, run.stderr[-3000:]
  assert "raise ring.get_timeout_s for slow generation." in lines[0]
  time.sleep(1.0)
  assert _our_segments() <= before, _our_segments() - before


# ------------------------------------------------ row 10: the HF loader -----


def _hf_checkpoint(path, nan: bool = False):
  """A tiny random Llama checkpoint in ``path`` (one NaN if ``nan``)."""
  tok = jnp.zeros((1, 4), jnp.int32)
  params = nn.unbox(transformer.Transformer(CFG).init(
      jax.random.PRNGKey(0), tok, tok, tok > -1)["params"])
  if nan:
    leaves, tree = jax.tree.flatten(params)
    leaves[-1] = leaves[-1].at[(0,) * leaves[-1].ndim].set(jnp.nan)
    params = jax.tree.unflatten(tree, leaves)
  hf.save_hf_checkpoint(CFG, params, path)
  return path


def _load_error(path) -> str:
  with pytest.raises(hf.CheckpointError) as e:
    hf.load_hf_checkpoint(path)
  return str(e.value)


def test_hf_truncated_safetensors_names_the_file(tmp_path):
  weights = _hf_checkpoint(tmp_path) / hf.WEIGHTS_FILE
  data = weights.read_bytes()
  weights.write_bytes(data[:len(data) // 2])
  assert _load_error(tmp_path).startswith(f"{weights}: cannot read")


def test_hf_index_that_is_not_json_names_the_file(tmp_path):
  index = _hf_checkpoint(tmp_path) / hf.INDEX_FILE
  index.write_text("{not json")
  assert _load_error(tmp_path).startswith(
      f"{index} is not a readable JSON index (JSONDecodeError")


def test_hf_nonfinite_weights_are_an_error(tmp_path):
  weights = _hf_checkpoint(tmp_path, nan=True) / hf.WEIGHTS_FILE
  msg = _load_error(tmp_path)
  assert msg.startswith(f"{weights}: tensor ") and "holds 1 NaN/Inf" in msg


def test_hf_index_paths_stay_inside_the_checkpoint(tmp_path):
  ckpt = _hf_checkpoint(tmp_path / "ckpt")
  outside = tmp_path / "outside.safetensors"
  outside.write_bytes((ckpt / hf.WEIGHTS_FILE).read_bytes())
  (ckpt / hf.INDEX_FILE).write_text(json.dumps({"weight_map": {
      "model.embed_tokens.weight": "../outside.safetensors"}}))
  assert "'../outside.safetensors', outside the checkpoint directory" in (
      _load_error(ckpt))


# ------------------------- row 9: weight versions not from this trainer -----


class _FakeSlot:
  """Stands for a weight slot someone else may have published into."""

  def __init__(self):
    self.version = 0
    self.rejected = 0

  def read(self, timeout):
    del timeout
    return self.version, {"w": self.version}

  def latest_version(self):
    return self.version


def test_sampler_ignores_weight_versions_the_trainer_cannot_have_made():
  """Row 9: version 777 at trainer step 62, or one going backwards, is
  ignored; the sampler keeps the weights it has."""
  slot = _FakeSlot()
  mp_value = type("V", (), {"value": 62})()
  newest = sampler_process._NewestWeights(  # pylint: disable=protected-access
      slot, sampler_process.SamplerStats(), mp_value)
  slot.version = 60
  assert newest() == ({"w": 60}, 60)
  slot.version = 777
  assert newest() == ({"w": 60}, 60)
  slot.version = 59
  assert newest() == ({"w": 60}, 60)
  slot.version = 63  # Published just before the trainer announces step 63.
  assert newest() == ({"w": 63}, 63)


def test_negative_staleness_is_never_admitted():
  """Row 9: a trajectory from a version newer than the trainer's is dropped
  and counted, not admitted with staleness -715."""
  from sao_jax.data.trajectory import StalenessPolicy  # pylint: disable=g-import-not-at-top

  assert not StalenessPolicy(max_staleness=4).keeps(-715)
  assert not StalenessPolicy(max_staleness=None).keeps(-1)
  counters = stream_lib.StreamCounters()
  future = _traj()
  future.policy_version[:] = 777
  fresh = _traj()
  fresh.policy_version[:] = 60
  ds = stream_lib.StalenessFilter(
      grain.MapDataset.source([future, fresh]).to_iter_dataset(),
      lambda: 62, StalenessPolicy(max_staleness=4), counters)
  kept = list(ds)
  assert len(kept) == 1 and kept[0][1] == 2
  assert counters.dropped_future == 1 and counters.admitted == 1


def test_negative_staleness_from_authenticated_versions_is_a_bug():
  """Row 9: with authenticated weights (the trainer's own stream) a version
  newer than the trainer's cannot come from outside: it is asserted."""
  from sao_jax.data.trajectory import StalenessPolicy  # pylint: disable=g-import-not-at-top

  future = _traj()
  future.policy_version[:] = 63
  ds = stream_lib.StalenessFilter(
      grain.MapDataset.source([future]).to_iter_dataset(), lambda: 62,
      StalenessPolicy(max_staleness=4), stream_lib.StreamCounters(),
      trusted_versions=True)
  with pytest.raises(AssertionError, match=(
      "A trajectory of prompt 7 was sampled by policy version 63, newer "
      "than the trainer's 62, from authenticated weights: a bug")):
    list(ds)


_HUNG_ENV_RUN = textwrap.dedent("""
    import multiprocessing
    import sys
    import threading

    from sao_jax.envs import reasoning_gym_env
    from sao_jax.envs import registry


    class HangingEnv(reasoning_gym_env.ReasoningGymEnv):
      # Hangs in the sampler only (the trainer's eval uses it too).
      def step(self, action_text):
        if multiprocessing.current_process().name.startswith("sao-sampler"):
          print("HUNG", flush=True)
          threading.Event().wait()
        return super().step(action_text)


    # At the top level: the spawned sampler re-imports this file.
    registry.register_env("hang", HangingEnv)

    if __name__ == "__main__":
      from configs import base
      from sao_jax.train import loop
      import tiny_settings
      config = base.get_config()
      flat = {**tiny_settings.TINY_OVERRIDES, "env.name": "hang",
              "env.step_timeout_s": 3600.0, "train.mode": "sync",
              "train.num_steps": 4}
      for key, value in flat.items():
        section, leaf = key.split(".")
        config[section][leaf] = value
      config.env.dataset_config.update(tiny_settings.DATASET_CONFIG)
      loop.train_and_evaluate(config, sys.argv[1])
""")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_trainer_sigkilled_while_sampler_hangs_in_env_leaves_nothing(
    tmp_path):
  """Row 3 end to end: the sampler hangs inside env.step, the trainer is
  SIGKILLed: the sampler dies too and /dev/shm is clean."""
  before = _our_segments()
  script = tmp_path / "hung_run.py"
  script.write_text(_HUNG_ENV_RUN)
  trainer = subprocess.Popen(
      [sys.executable, str(script), str(tmp_path / "run")], cwd=REPO,
      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
      env=dict(os.environ, PYTHONPATH=f"{REPO}:{REPO}/tests"))
  children = []
  try:
    assert trainer.stdout.readline().strip() == "HUNG"
    children = psutil.Process(trainer.pid).children(recursive=True)
    assert children
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(30)
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"still alive after their parent died: {alive}"
  finally:
    trainer.kill()
    trainer.wait(30)
    for child in children:  # Only if the test failed: no orphan left.
      try:  # The resource tracker then unlinks the segments itself.
        if "resource_tracker" not in " ".join(child.cmdline()):
          child.kill()
      except psutil.NoSuchProcess:
        pass
  time.sleep(1.0)
  assert _our_segments() <= before, _our_segments() - before


# ------------------------- row 8: records not written by this run ----------

_FORGER = textwrap.dedent("""
    # Another process of the same user: attaches to the ring by name and
    # writes a trajectory with reward 1000 the way the ring's code would.
    import sys

    import numpy as np

    from sao_jax.data import trajectory as codec
    from sao_jax.ipc import ring
    from sao_jax.ipc import ring_segment as layout
    from sao_jax.ipc import segment
    from sao_jax.data.trajectory import Trajectory

    name, what = sys.argv[1], sys.argv[2]
    seg = layout.Segment(segment.attach(name), owner=False)
    ctl, mv, cap = seg.ctl[0], seg.lanes[0], seg.lane_bytes
    forged = b"".join(bytes(memoryview(b).cast("B")) for b in codec.encode(
        Trajectory(prompt_id=7, tokens=np.arange(6),
                   action_mask=[0, 0, 1, 1, 1, 0],
                   rollout_logp=np.full(6, -1.0),
                   policy_version=np.zeros(6),
                   rewards=[0, 0, 0, 0, 1000, 0], task="fixed")))
    n = len(forged)
    size = (32 + n + ring.TAG_BYTES + 63) // 64 * 64  # As RingWriter's.
    if what == "rewrite":  # The committed, unread record, checksum recomputed.
      off = ctl[layout.TAIL] % cap
      magic, _, length, seq, _ = ring.HDR.unpack_from(mv, off)
      assert length == n, (length, n)
      mv[off + 32:off + 32 + n] = forged
      ring.HDR.pack_into(mv, off, magic, 0, n, seq, ring.checksum(forged))
    else:  # A new record at the head, with the next sequence number...
      head = ctl[layout.HEAD]
      off, seq = head % cap, ctl[layout.RECORDS_WRITTEN]
      if what == "replay":  # ... or a copy of the last genuine record.
        last = (ctl[layout.TAIL] - size) % cap
        mv[off:off + size] = mv[last:last + size]
      else:
        mv[off + 32:off + 32 + n] = forged
        ring.HDR.pack_into(mv, off, ring.REC_MAGIC, 0, n, seq,
                           ring.checksum(forged))
      ctl[layout.HEAD] = head + size
    print(seq, flush=True)
""")


def _run_other_process(tmp_path, source: str, *args: str) -> str:
  """Runs ``source`` as a separate Python process (another process of the
  same user); returns its stdout."""
  script = tmp_path / "other_process.py"
  script.write_text(source)
  run = subprocess.run([sys.executable, str(script), *args], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=REPO))
  assert run.returncode == 0, run.stderr[-2000:]
  return run.stdout


def _forge(tmp_path, name: str, what: str) -> int:
  return int(_run_other_process(tmp_path, _FORGER, name, what))


@pytest.mark.multiprocess
def test_records_written_by_another_process_are_rejected_and_counted(
    tmp_path):
  """Row 8: a committed record rewritten (checksum recomputed), a record
  appended with the next sequence number and a replayed genuine record are
  each rejected and counted; the genuine records before and after are read
  exactly once, in order, and reading never raises."""
  from sao_jax.data import trajectory as codec  # pylint: disable=g-import-not-at-top
  from sao_jax.ipc import ring  # pylint: disable=g-import-not-at-top
  from sao_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top

  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 14,
                              authenticate=True) as r:
    with pytest.raises(ring.RingError, match="is authenticated: pass key="):
      ring.RingWriter(r.name, lane=0)  # No key, no lane.
    with ring.RingWriter(r.name, lane=0, key=r.key) as w:
      assert w.write(*codec.encode(_traj())) == 0
      assert _forge(tmp_path, r.name, "rewrite") == 0
      with pytest.raises(ring.RingEmptyError):
        r.read(timeout=0.3)  # Rejected: nothing genuine to read.
      assert r.stats()["rejected_records"] == 1
      assert _forge(tmp_path, r.name, "append") == 1
      assert w.write(*codec.encode(_traj())) == 1  # After the forged one.
      rec = r.read(timeout=1.0)
      assert rec.seq == 1 and r.stats()["rejected_records"] == 2
      assert float(codec.decode(rec.data).rewards.sum()) == 1.0
      assert _forge(tmp_path, r.name, "replay") == 2
      assert w.write(*codec.encode(_traj())) == 2
      assert r.read(timeout=1.0).seq == 2  # The replayed seq 1 was skipped.
      stats = r.stats()
  assert stats["rejected_records"] == 3 and stats["records_read"] == 2
  scalars = metrics_lib.step_scalars(
      {}, np.zeros(2), policy_version=0,
      trainer_tokens_per_s=0.0, sampler_tokens_per_s=0.0,
      trainer_idle_frac=0.0, sampler_stats=None, sampler_idle_frac=None,
      publish_s=None, generated_tokens=0,
      stream_counters={"dropped_stale": 0, "multi_version": 0, "admitted": 1},
      ring_stats=stats, skipped_steps=0)
  assert scalars["ring/rejected_records"] == 3.0


_SLOT_FORGER = textwrap.dedent("""
    # Another process of the same user, with the code but not the key.
    import sys

    import numpy as np

    from sao_jax.ipc import segment
    from sao_jax.ipc import weights as w

    name, what = sys.argv[1], sys.argv[2]
    try:
      w.WeightSlot.attach(name).publish({"w": np.zeros((4, 8))}, 777)
      print("published", flush=True)
    except ValueError:  # An authenticated slot: the API needs the key.
      shm = segment.attach(name)
      hdr = np.frombuffer(shm.buf, np.int64, count=8)
      start = w._HEADER_BYTES + w._align(int(hdr[w._H_TABLE_BYTES]))
      data_bytes = int(hdr[w._H_DATA_BYTES])
      latest = int(hdr[w._H_LATEST])
      b = 1 - latest if what == "publish" else latest
      at = start + b * (w._CTL_BYTES + data_bytes)
      ctl = np.frombuffer(shm.buf, np.int64, count=8, offset=at)
      data = np.frombuffer(shm.buf, np.float32, count=32,
                           offset=at + w._CTL_BYTES)
      ctl[w._SEQ] += 1  # Odd: being written.
      if what == "publish":  # Version 777, its seqlock and `latest` as
        ctl[w._VERSION] = 777  # WeightSlot.publish would leave them.
        data[:] = 777.0
        ctl[w._SEQ] += 1
        hdr[w._H_LATEST] = b
      print("raw", flush=True)  # "stall": left odd, as if it died writing.
""")


def _forge_slot(tmp_path, name: str, what: str) -> str:
  return _run_other_process(tmp_path, _SLOT_FORGER, name, what).strip()


@pytest.mark.multiprocess
def test_weights_published_by_another_process_are_rejected(tmp_path):
  """Row 9: another process publishes version 777 into the slot: the reader
  rejects and counts it and keeps the trainer's version; a buffer it leaves
  "being written" costs the sampler nothing, and the trainer's next publish
  repairs it. Only the creator publishes, and never an older version."""
  from sao_jax.ipc import weights  # pylint: disable=g-import-not-at-top

  tree = lambda v: {"w": np.full((4, 8), v, np.float32)}
  stats = sampler_process.SamplerStats()
  trainer_step = type("V", (), {"value": 1})()
  with weights.WeightSlot.create(tree(0.0), authenticate=True) as slot:
    slot.publish(tree(1.0), version=1)
    reader = weights.WeightSlot.attach(slot.name, tree(0.0), key=slot.key)
    try:
      newest = sampler_process._NewestWeights(  # pylint: disable=protected-access
          reader, stats, trainer_step)
      assert newest()[1] == 1
      assert _forge_slot(tmp_path, slot.name, "publish") == "raw"
      version, got = reader.read(timeout=1.0)  # The genuine buffer.
      assert version == 1 and float(got["w"].max()) == 1.0
      assert reader.rejected == 1
      params, version = newest()
      assert version == 1 and float(params["w"].max()) == 1.0
      assert stats.rejected_weights == 2
      assert _forge_slot(tmp_path, slot.name, "stall") == "raw"
      with pytest.raises(TimeoutError, match="the next publish repairs it"):
        reader.read(timeout=0.2)
      assert newest()[1] == 1  # Survives, keeps what it has.
      for v in (2, 3):  # Both buffers written again: repaired.
        trainer_step.value = v
        slot.publish(tree(float(v)), version=v)
        params, version = newest()
        assert version == v and float(params["w"].min()) == v
      with pytest.raises(PermissionError, match="one writer"):
        reader.publish(tree(9.0), version=9)
      with pytest.raises(ValueError, match="only increase"):
        slot.publish(tree(2.0), version=2)
    finally:
      reader.close()
