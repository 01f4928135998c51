"""Routing replay (R3) end to end: the sampler records each fed token's
experts (sampler/decoding.py, generate.py, engine.py), the
trajectory carries them through the ring codec and the trainer's batch
(unpacked and packed rows), and the trainer's forward with replay reproduces
the sampler's log-probs (issue 27, item 3)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.data import packing
from sao_jax.data import trajectory as traj_lib
from sao_jax.data.trajectory import StalenessPolicy
from sao_jax.envs import base
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import MoeConfig
from sao_jax.sampler import engine as engine_lib
from sao_jax.sampler import feed as feed_lib
from sao_jax.sampler import generate as generate_lib
from sao_jax.sampler import interface
from sao_jax.sampler import rollout
from sao_jax.sampler.process import SamplerStats
from sao_jax.sampler.sampling import SamplingParams
from sao_jax.train import step as step_lib
import tiny_settings

pytestmark = pytest.mark.slow

E, K = 8, 2
TEMPERATURE = 0.7
LIMITS = rollout.RolloutLimits(max_turns=3, max_total_tokens=96,
                               max_new_tokens_per_turn=8)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return tiny_settings.arithmetic_tokenizer(tmp_path_factory.mktemp("tok"))


def _cfg(vocab: int, router: str = "softmax") -> ModelConfig:
  return ModelConfig.tiny(
      vocab_size=vocab, num_layers=3, first_dense_layers=1,
      moe=MoeConfig(num_experts=E, top_k=K, intermediate_size=32,
                    router=router, n_group=2 if router == "sigmoid" else 1,
                    topk_group=1 if router == "sigmoid" else 1,
                    n_shared_experts=int(router == "sigmoid")))


@functools.cache
def _params(cfg, seed=0):
  """The model's random params, once per config (jitted init; the sampler
  never donates params, so tests share them)."""
  x = jnp.zeros((1, 4), jnp.int32)
  return jax.jit(lambda k: nn.unbox(transformer.Transformer(cfg).init(
      k, x, x, x == 0)["params"]))(jax.random.PRNGKey(seed))


class _EchoEnv(base.Environment):
  """Never done: answers every action (stopped or not) with a fixed
  observation, so every episode has max_turns turns."""

  name = "echo"
  fixed_length_actions = True

  def __init__(self, prompt, obs):
    self._prompt, self._obs = prompt, obs

  def reset(self, task):
    self.prompt_id = task
    return self._prompt

  def step(self, action_text):
    return base.StepResult(self._obs, 0.5, False, {})


def _envs(n):
  return [_EchoEnv("<|user|>hi there " + "7" * i + "<|end|><|assistant|>",
                   "<|tool_result|>ok " + "1" * (i + 1)) for i in range(n)]


def _stops(tok):
  return list(range(4, tok.vocab_size, 9))  # A random model stops early.


def _native(tok, cfg, params, slots, chunk, prefill_rows=0):
  return engine_lib.NativeRollout(
      interface.RolloutSettings(
          interface.EngineOptions(num_slots=slots, decode_chunk=chunk,
                                  weight_poll_tokens=0, env_threads=1,
                                  prefill_rows=prefill_rows),
          LIMITS, SamplingParams(temperature=TEMPERATURE),
          stop_ids=tuple(_stops(tok))),
      model_config=cfg, tokenizer=tok, envs=_envs(slots),
      weights=lambda: (params, 0), stats=SamplerStats(),
      rng=jax.random.PRNGKey(3))


def _episodes(tok, cfg, params, n=3, prefill_rows=0):
  """Evaluation's path: one episode per task, whole turns per decode call."""
  return interface.run_episodes(
      _native(tok, cfg, params, n, LIMITS.max_new_tokens_per_turn,
              prefill_rows), list(range(n)))


def _engine(tok, cfg, params, episodes=5, slots=2):
  """The sampler's path: slots refilled, 4-token chunks, written as they end."""
  out = []

  def outbox(trajs):
    out.extend(trajs)
    trajs.clear()
    return True

  eng = _native(tok, cfg, params, slots, 4)
  eng.run(feed_lib.EpisodeFeed(
      task_of=lambda d: d, outbox=outbox, stats=eng.stats,
      staleness=StalenessPolicy(max_staleness=0),
      trainer_step=lambda: episodes), lambda: len(out) >= episodes)
  return out[:episodes]


def _through_ring(trajs):
  """Each trajectory encoded and decoded as the ring carries it."""
  out = []
  for t in trajs:
    bufs = traj_lib.encode(t)
    out.append(traj_lib.decode(
        b"".join(bytes(memoryview(b).cast("B")) for b in bufs)))
  return out


def _batch(trajs, seq_len=LIMITS.max_total_tokens):
  rows = [traj_lib.pad_row(t, 0, seq_len) for t in trajs]
  return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


def _packed(trajs, seq_len=2 * LIMITS.max_total_tokens):
  rows = [traj_lib.pad_row(t, 0, t.length) for t in trajs]
  packed = packing.pack_rows([rows[:2], rows[2:]], seq_len, 2)
  return jax.tree.map(jnp.asarray, packed)


@functools.partial(jax.jit, static_argnames=("cfg", "replay"))
def _logp(cfg, params, batch, replay):
  """The trainer's log-probs (and routing), jitted: one compile, not
  op-by-op dispatch."""
  return step_lib._policy_logp(transformer.Transformer(cfg), params, batch,
                               TEMPERATURE, replay=replay)


def _check_replay(cfg, params, trajs, packed=False):
  """Replay reproduces the recorded log-probs; returns the trainer's own
  routing (non-replay forward) and the batch."""
  batch = _packed(trajs) if packed else _batch(trajs)
  act = np.asarray(batch["action_mask"], bool)
  assert act.sum() >= 10
  replayed, _, moe = _logp(cfg, params, batch, replay=True)
  np.testing.assert_allclose(np.asarray(replayed)[act],
                             np.asarray(batch["rollout_logp"])[act],
                             atol=1e-5, rtol=0)
  return np.asarray(moe["moe_own_experts"]), batch


@pytest.mark.parametrize("runner", ["run_episodes", "engine",
                                    "one_row_a_prefill"])
def test_replay_reproduces_the_samplers_logprobs_and_routing(tok, runner):
  cfg = _cfg(tok.vocab_size)
  params = _params(cfg)
  run = {"run_episodes": _episodes, "engine": _engine,
         # sampler.prefill_rows=1: prompts and observations fed a row a
         # call, their experts recorded all the same.
         "one_row_a_prefill": functools.partial(_episodes, prefill_rows=1),
         }[runner]
  trajs = _through_ring(run(tok, cfg, params))
  for t in trajs:  # Every token (prompt, actions, observations) routed.
    assert t.routed_experts.shape == (t.length, cfg.num_moe_layers, K)
    am = t.action_mask.astype(bool)
    assert np.count_nonzero(np.diff(am.astype(int)) == 1) >= 2  # Multi-turn.
  if runner == "engine":  # A last observation, fed only to be routed.
    assert any(t.action_mask[-1] == 0 for t in trajs)
  own, batch = _check_replay(cfg, params, trajs)
  # Same weights, float32: the sampler's cached routing is the trainer's.
  real = np.asarray(batch["attention_mask"], bool)
  recorded = np.asarray(batch["routed_experts"])
  np.testing.assert_array_equal(np.sort(recorded, -1)[real],
                                np.sort(own, -1)[real])
  assert (recorded[real] < E).all() and (recorded[~real] == 0).all()
  if runner == "run_episodes":  # Packed rows carry the routing too.
    own_packed, packed_batch = _check_replay(cfg, params, trajs, packed=True)
    seg = np.asarray(packed_batch["segment_ids"]) > 0
    np.testing.assert_array_equal(
        np.sort(np.asarray(packed_batch["routed_experts"]), -1)[seg],
        np.sort(own_packed, -1)[seg])


def test_replay_reproduces_where_the_trainers_own_routing_differs(tok):
  """The sigmoid router chooses on scores + a score-correction bias that is
  not trained (DeepSeek-V3 / GLM-4.5) but weights experts by the scores
  alone: a sampler whose bias differs routes elsewhere with the same trained
  weights. Replay reproduces its log-probs; the trainer's own routing does
  not."""
  cfg = _cfg(tok.vocab_size, "sigmoid")
  params = _params(cfg)
  sampler_params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.5 * jax.random.normal(
          jax.random.PRNGKey(len(str(p))), x.shape)
      if "router_bias" in jax.tree_util.keystr(p) else x, params)
  assert any("router_bias" in jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_leaves_with_path(params))
  trajs = _through_ring(_episodes(tok, cfg, sampler_params))
  own, batch = _check_replay(cfg, params, trajs)
  real = np.asarray(batch["attention_mask"], bool)
  differ = np.any(np.sort(own, -1) != np.sort(
      np.asarray(batch["routed_experts"]), -1), axis=-1)[real]
  assert differ.mean() > 0.2  # Its own routing differs on many tokens...
  act = np.asarray(batch["action_mask"], bool)
  not_replayed, _, _ = _logp(cfg, params, batch, replay=False)
  gap = np.abs(np.asarray(not_replayed) - np.asarray(batch["rollout_logp"]))
  assert gap[act].max() > 1e-3  # ...and without replay the log-probs too.


def test_dense_policy_records_no_routing(tok):
  cfg = ModelConfig.tiny(vocab_size=tok.vocab_size)
  trajs = _episodes(tok, cfg, _params(cfg), n=2)
  assert all(t.routed_experts is None for t in trajs)
  assert "routed_experts" not in _batch(trajs)
  gen = generate_lib.Generator(cfg, _params(cfg), 1, 32)
  gen.append([[5, 6, 7]])
  seg = gen.generate([], 4)[0]
  assert seg.experts is None and gen.row_experts(0) is None
