"""The vLLM engine behind the `Rollout` interface (sampler/vllm_engine.py).

A tiny Llama (head_dim 32: vLLM's CPU attention refuses 16) in float32
through one ``AsyncLLM``: the sampled tokens' log-probs are our trainer's
forward on the same tokens, a weight push changes them exactly as the new
weights say, an in-flight push leaves two versions in one trajectory (each
token's log-prob that of its own version), multi-turn episodes with the
environment's observations, greedy evaluation through the interface, and an
async SAO run whose sampler process (running vLLM) is killed and restarted.
Skipped
when vllm is not installed (the ``vllm`` extra; README "Rollout engines").
"""

import importlib.util
import os
import signal
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import psutil
import pytest

from sao_jax.data.trajectory import FinishReason
from sao_jax.envs import base
from sao_jax.models.config import ModelConfig
from sao_jax.models.logprobs import policy_token_stats
from sao_jax.models.transformer import Transformer
from sao_jax.models.transformer import positions_from_mask
from sao_jax.sampler import interface
from sao_jax.sampler import rollout
from sao_jax.sampler import supervisor
from sao_jax.sampler import vllm_engine
from sao_jax.sampler.sampling import SamplingParams
from sao_jax.sampler.stats import SamplerStats
from sao_jax.train import loop
from sao_jax.train import metrics as metrics_lib

import tiny_models
import tiny_settings
from tiny_settings import tiny_config
import trajectory_logp

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (the vllm extra: README 'Rollout engines')")

TEMPERATURE = 0.8
SLOTS = 4
LIMITS = rollout.RolloutLimits(max_turns=3, max_total_tokens=96,
                               max_new_tokens_per_turn=10)


def _config(**sampler):
  c = ml_collections.ConfigDict()
  c.sampler = ml_collections.ConfigDict(
      {"top_p": 1.0, "top_k": 0, "engine": "vllm", "vllm_compile": False,
       "vllm_gpu_memory": 0.35, **sampler})
  c.model = ml_collections.ConfigDict({"routing_replay": "off"})
  return c


@pytest.mark.parametrize("change,words", [
    ({"top_p": 0.9}, "truncated, renormalised"),
    ({"top_k": 20}, "top_p=1 and top_k=0"),
    ({"vllm_gpu_memory": 1.0}, r"must be in \(0, 1\)"),
    ({"vllm_gpu_memory": 0.0}, r"must be in \(0, 1\)"),
    ({"mesh": ml_collections.ConfigDict({"data": 1, "expert": 1,
                                         "tensor": 4})},
     "lays out the native engine's devices"),
])
def test_settings_vllm_cannot_report_exactly_are_refused(change, words):
  vllm_engine.check_config(_config())  # The defaults pass,
  vllm_engine.check_config(_config(mesh=ml_collections.ConfigDict(
      {"data": 1, "expert": 1, "tensor": 0})))  # sampler.mesh's among them.
  with pytest.raises(ValueError, match=words):
    vllm_engine.check_config(_config(**change))
  c = _config()
  c.model.routing_replay = "rollout"
  with pytest.raises(ValueError, match="does not record"):
    vllm_engine.check_config(c)


class _EchoEnv(base.Environment):
  """Never done: every action gets an observation (multi-turn)."""

  name = "echo"
  fixed_length_actions = True

  def __init__(self, i):
    self._i = i

  def reset(self, task):
    self.prompt_id = task
    return "<|user|>what is " + "7" * (1 + task % 3) + "<|end|><|assistant|>"

  def step(self, action_text):
    return base.StepResult("<|tool_result|>ok " + "1" * (1 + self._i), 0.5,
                           False, {})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return tiny_settings.arithmetic_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tok):
  # Tied, as SmolLM2: a tied head is the one vLLM's reload does not process
  # again (vllm_worker._refresh_tied_head; untied: the sampler-kill run's
  # log-prob check below).
  cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64,
                    intermediate_size=128, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=32, tie_embeddings=True)
  x = jnp.zeros((1, 4), jnp.int32)
  params = {v: jax.tree.map(lambda a: a * 4.0 if a.ndim > 1 else a,
                            tiny_models.init_params(
                                Transformer(cfg), jax.random.PRNGKey(v), x, x,
                                x == 0)["params"])
            for v in (0, 1)}
  return cfg, params


class _Weights:
  """Version 0 until ``swap_after`` polls, then 1."""

  def __init__(self, params, swap_after=None):
    self.params, self.swap_after, self.polls = params, swap_after, 0

  def __call__(self):
    self.polls += 1
    v = int(self.swap_after is not None and self.polls > self.swap_after)
    return self.params[v], v


@pytest.fixture(scope="module")
def engine(tok, model):
  cfg, params = model
  weights = _Weights(params)
  eng = vllm_engine.VllmRollout(
      interface.RolloutSettings(
          interface.EngineOptions(num_slots=SLOTS, weight_poll_tokens=8,
                                  kv_on_swap="recompute", env_threads=2),
          LIMITS, SamplingParams(temperature=TEMPERATURE),
          stop_ids=tuple(range(4, tok.vocab_size, 9))),
      config=_config(), model_config=cfg, tokenizer=tok,
      envs=[_EchoEnv(i) for i in range(SLOTS)], weights=weights,
      stats=SamplerStats(), seed=5)  # vllm_compile=False: a faster start.
  eng.start()
  yield eng, weights
  eng.stop()


def _check_logp(trajs, cfg, params, version, atol=2e-4):
  """Every action token of ``version`` has the trainer's log-prob; returns
  the number checked and the largest gap."""
  ref = trajectory_logp.trainer_logp(trajs, cfg, params, TEMPERATURE)
  n, gap = 0, 0.0
  for i, t in enumerate(trajs):
    sel = t.action_mask.astype(bool) & (t.policy_version == version)
    np.testing.assert_allclose(t.rollout_logp[sel], ref[i, :t.length][sel],
                               atol=atol)
    n += int(sel.sum())
    if sel.any():
      gap = max(gap, float(np.abs(t.rollout_logp[sel]
                                  - ref[i, :t.length][sel]).max()))
  return n, gap


@needs_vllm
@pytest.mark.slow
@pytest.mark.multiprocess
def test_logprobs_are_the_trainers_and_a_push_changes_them(engine, model):
  eng, weights = engine
  cfg, params = model
  trajs = interface.run_episodes(eng, list(range(6)))
  assert [t.group_id for t in trajs] == list(range(6))
  for t in trajs:  # Multi-turn: observations between the actions.
    am = t.action_mask.astype(bool)
    assert np.count_nonzero(np.diff(am.astype(int)) == 1) >= 2
    assert t.finish_reason in (FinishReason.TURNS, FinishReason.LENGTH)
    assert set(t.policy_version[am]) == {0}
  n0, gap0 = _check_logp(trajs, cfg, params[0], 0)
  assert n0 >= 30
  # The same tokens under version 1's weights would have other log-probs.
  other = trajectory_logp.trainer_logp(trajs, cfg, params[1], TEMPERATURE)
  am = trajs[0].action_mask.astype(bool)
  assert np.abs(other[0, :trajs[0].length][am]
                - trajs[0].rollout_logp[am]).max() > 1e-2
  weights.swap_after = 0  # The slot's newest is version 1 from now on.
  eng.update_weights(params[1], 1)
  assert eng.version == 1 and eng.stats.engine_push_s > 0
  after = interface.run_episodes(eng, list(range(6)))
  n1, gap1 = _check_logp(after, cfg, params[1], 1)
  assert n1 >= 30
  print(f"vLLM vs trainer |dlogp| max: v0 {gap0:.2e} ({n0} tokens), "
        f"v1 {gap1:.2e} ({n1} tokens)")


@needs_vllm
@pytest.mark.slow
@pytest.mark.multiprocess
def test_in_flight_push_gives_two_versions_in_one_trajectory(engine, model):
  eng, weights = engine
  cfg, params = model
  weights.polls, weights.swap_after = 0, 2
  eng.update_weights(params[0], 0)
  trajs = interface.run_episodes(eng, list(range(8)))
  spans = [set(t.policy_version[t.action_mask.astype(bool)]) for t in trajs]
  assert any(s == {0, 1} for s in spans), spans
  for v in (0, 1):  # kv_on_swap='recompute': each token exact for its own.
    assert _check_logp(trajs, cfg, params[v], v)[0] > 0


@needs_vllm
@pytest.mark.slow
@pytest.mark.multiprocess
def test_greedy_evaluation_through_the_interface(engine, model):
  eng, weights = engine
  cfg, params = model
  weights.swap_after = None
  eng.update_weights(params[0], 0)
  greedy = interface.RolloutSettings(
      eng.settings.options, LIMITS, SamplingParams(greedy=True),
      stop_ids=eng.settings.stop_ids)
  eng.settings, saved = greedy, eng.settings
  try:
    trajs = interface.run_episodes(eng, [0, 1])
  finally:
    eng.settings = saved
  toks, mask = trajectory_logp.padded(trajs)
  stats = policy_token_stats(params[0], cfg, jnp.asarray(toks),
                             positions_from_mask(jnp.asarray(mask)),
                             jnp.asarray(mask), with_argmax=True)
  ref, best = np.asarray(stats["logp"]), np.asarray(stats["argmax"])
  for i, t in enumerate(trajs):
    am = t.action_mask.astype(bool)
    assert am.sum() >= 5
    # Each action token is the trainer's argmax; its log-prob at T=1.
    np.testing.assert_array_equal(t.tokens[am], best[i, :t.length][am])
    np.testing.assert_allclose(t.rollout_logp[am], ref[i, :t.length][am],
                               atol=2e-4)


def _kill_sampler_at(monkeypatch, step):
  """SIGKILLs the sampler process when the trainer announces ``step``."""
  killed = []
  original = supervisor.SupervisedSampler.set_trainer_step

  def set_step(self, s):
    original(self, s)
    if s >= step and not killed and self.handle.alive():
      killed.append(self.handle.process.pid)
      os.kill(killed[-1], signal.SIGKILL)

  monkeypatch.setattr(supervisor.SupervisedSampler, "set_trainer_step",
                      set_step)
  return killed


def _vllm_processes():
  """Live processes of vLLM's engine core or workers."""
  out = set()
  for p in psutil.process_iter(["pid", "cmdline"]):
    cmd = " ".join(p.info["cmdline"] or ())
    if "VLLM::" in cmd or "EngineCore" in cmd:
      out.add(p.info["pid"])
  return out


@needs_vllm
@pytest.mark.slow
@pytest.mark.multiprocess
def test_async_sao_run_survives_a_sampler_kill(tmp_path, monkeypatch):
  """The sampler process runs vLLM; SIGKILLed, the supervisor's new one
  starts a new engine; nothing trains twice, nothing is left running."""
  before = _vllm_processes()
  killed = _kill_sampler_at(monkeypatch, 1)
  config = tiny_config(**{
      "sampler.engine": "vllm", "sampler.vllm_compile": False,
      "model.hidden_size": 64,
      "model.head_dim": 32, "train.mode": "async", "train.num_steps": 2,
      # No critic-only step (a program fewer to compile); no episode ahead
      # of the trainer's step: the step after the kill needs the new sampler.
      "rl.critic_warmup_steps": 0, "train.max_staleness": 0,
      "train.checkpoint_every": 0, "sampler.max_restarts": 2,
      "ring.get_timeout_s": 900.0})
  summary = loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert len(killed) == 1
  assert summary["steps"] == 2  # 2 policy steps, the kill after the first.
  assert summary["sampler_restarts"] == 1
  assert summary["episodes_consumed_twice"] == 0
  assert summary["episodes_watermark"] + summary[
      "episodes_above_watermark"] == summary["trajectories_read_from_ring"]
  assert summary["policy_version"] == 2
  scalars = metrics_lib.read_scalars(str(tmp_path / "run" / "tb"))
  assert max(v for _, v in scalars["weights/engine_push_s"]) > 0
  # An untied model (tiny_config's): the first policy step's episodes came
  # from the version it trains, float32 on both sides.
  assert scalars["policy/logp_abs_diff"][0][1] < 1e-4, scalars[
      "policy/logp_abs_diff"]
  deadline = time.monotonic() + 30  # The killed sampler's engine too.
  while _vllm_processes() - before and time.monotonic() < deadline:
    time.sleep(1)
  assert not _vllm_processes() - before
