"""The jitted SAO train step on a (2, 2, 2) mesh equals the one-device step.

The checks run this file as subprocesses (XLA_FLAGS must be set before JAX
starts):

* `single`: 8 forced CPU devices in one process. Three train steps (step 0
  critic-only, steps 1-2 with a policy update; SAO loss, 2 critic updates per
  step, optax AdamW from `sao_jax.train.optim`) once on one device and once
  with the state placed by `sharding.param_shardings` on a (data, fsdp,
  tensor) = (2, 2, 2) mesh, the batch split over data x fsdp and the step
  jitted with state/batch shardings inside `sharding.mesh_rules`.
* `multi`: two processes with 4 devices each join with
  `jax.distributed.initialize` (gloo); each feeds its half of the 8 rows
  through `stream.make_global_batch`. Process 0 writes its losses and the
  all-gathered final parameters to a file, compared with the one-device run.

Every subprocess writes an `.npz` (losses per step, flattened final params);
the comparisons are made here.
"""

import contextlib
import functools
import json
import os
import subprocess
import sys
from typing import Any

import flax.linen as nn
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from sao_jax import sharding
from sao_jax.data import stream as stream_lib
from sao_jax.models import logprobs as logprobs_lib
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import MoeConfig
from sao_jax.train import optim
from sao_jax.train import step as step_lib
import multihost

# Small enough for 2 shared cores, every sharded dim divisible by 2.
_MODEL = dict(vocab_size=128, hidden_size=64, intermediate_size=128,
              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
_B, _T = 8, 16
_TEMP = 0.7
_LR = 1e-3
_UPDATE_POLICY = (False, True, True)  # Step 0: critic warm-up.
_TOL = 1e-5
# The expert-parallel variant (`moe` mode): a GLM-style MoE policy, one dense
# layer then one MoE layer of 8 experts (top-2, a shared expert), with its
# experts split over fsdp and the load-balancing loss in the policy loss.
_MOE = dict(moe=MoeConfig(num_experts=8, top_k=2, intermediate_size=32,
                          router="sigmoid", n_group=2, topk_group=1,
                          n_shared_experts=1), first_dense_layers=1)
_CASE = {"moe": False}


def _problem() -> tuple[ModelConfig, Any, Any, dict[str, np.ndarray]]:
  """Model config, initial params (host NumPy) and the [8, 16] batch.

  Rows: a prompt of 2-4 tokens, actions, on even rows an environment
  observation of 2 tokens inside the actions (action mask gap), right padding
  on rows shorter than 16, a terminal 0/1 reward; `rollout_logp` is the
  trainer's log-probs at step 0 plus small random shifts and a few large ones
  (tokens outside the DIS band). Identical in every process (fixed seeds).
  """


  cfg = ModelConfig(**_MODEL, **(_MOE if _CASE["moe"] else {}))
  tok = jnp.zeros((1, 4), jnp.int32)
  policy = jax.jit(lambda k: transformer.Transformer(cfg).init(
      k, tok, tok, tok > -1)["params"])(jax.random.PRNGKey(0))
  policy = jax.tree.map(np.asarray, nn.unbox(policy))
  value = transformer.value_params_from_policy(policy, cfg,
                                               jax.random.PRNGKey(1))
  value = jax.tree.map(np.asarray, value)

  rng = np.random.default_rng(0)
  tokens = rng.integers(4, cfg.vocab_size, (_B, _T)).astype(np.int32)
  attn = np.zeros((_B, _T), bool)
  action = np.zeros((_B, _T), np.uint8)
  rewards = np.zeros((_B, _T), np.float32)
  for i in range(_B):
    length = int(rng.integers(10, _T + 1))
    prompt = int(rng.integers(2, 5))
    attn[i, :length] = True
    action[i, prompt:length] = 1
    if i % 2 == 0:  # An observation of 2 tokens in the middle.
      mid = (prompt + length) // 2
      action[i, mid:mid + 2] = 0
    rewards[i, length - 1] = float(rng.integers(0, 2))
  logp = np.asarray(logprobs_lib.token_logprobs(
      policy, cfg, jnp.asarray(tokens), jnp.asarray(attn), _TEMP))
  shift = rng.normal(0.0, 0.2, (_B, _T)).astype(np.float32)
  shift[0, 5] = 1.0    # r = e^-1 < 1 - 0.3: rejected low.
  shift[3, 6] = -2.5   # r = e^2.5 > 1 + 5: rejected high.
  batch = {
      "tokens": tokens, "attention_mask": attn, "action_mask": action,
      "rewards": rewards,
      "rollout_logp": ((logp + shift) * action).astype(np.float32),
  }
  return cfg, policy, value, batch


def _txs() -> tuple[Any, Any]:
  """AdamW for policy and critic.

  eps = 1e-6 rather than 1e-8: Adam's update g / (|g| + eps) has slope 1/eps
  at g = 0, so on the few weights whose gradient is ~1e-8 the float32
  reassociation noise of a different reduction order (~1e-10) becomes a
  parameter difference of lr * 1e-2 = 1e-5 with eps = 1e-8 (seen: 2.7e-5 on one
  of 200k entries). That is Adam's conditioning, not sharding; eps = 1e-6
  keeps the comparison meaningful at 1e-5.
  """
  return (optim.make_optimizer(_LR, weight_decay=0.01, eps=1e-6),
          optim.make_optimizer(_LR, weight_decay=0.01, eps=1e-6))


def _step_cfg() -> step_lib.StepConfig:
  return step_lib.StepConfig(
      loss="sao", critic_updates_per_step=2, temperature=_TEMP,
      router_aux_loss_coef=0.01 if _CASE["moe"] else 0.0)


def _flat(prefix: str, tree: Any) -> dict[str, np.ndarray]:
  return {prefix + jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _leaf(tree: Any, *keys: str) -> Any:
  """The first leaf whose path contains all `keys`."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    name = jax.tree_util.keystr(path)
    if all(k in name for k in keys):
      return leaf
  raise KeyError(f"no leaf path contains all of {keys}")


def _run_steps(fns, state, batch, ctx) -> tuple[Any, list[dict[str, float]]]:
  """Three steps; the scalar metrics of each step as floats."""

  history = []
  for flag in _UPDATE_POLICY:
    with ctx():
      state, metrics = fns[flag](state, batch)
    if jax.process_count() > 1:
      metrics = multihost_utils.process_allgather(metrics, tiled=True)
    history.append({k: float(v) for k, v in metrics.items()})
  return state, history


def _reference(cfg, policy, value, batch) -> tuple[Any, list[dict]]:
  """The three steps on one device, no mesh."""



  ptx, vtx = _txs()
  dev = jax.local_devices()[0]
  state = jax.device_put(
      step_lib.create_train_state(policy, value, ptx, vtx), dev)
  fns = {f: step_lib.make_step(cfg, _step_cfg(), ptx, vtx, update_policy=f)
         for f in (False, True)}
  return _run_steps(fns, state, jax.device_put(batch, dev),
                    contextlib.nullcontext)


def _sharded(cfg, policy, value, local_batch) -> tuple[Any, list, dict]:
  """The three steps on a (2, 2, 2) mesh over all (global) devices."""



  mesh = sharding.make_mesh(ml_collections.ConfigDict(
      dict(data=2, fsdp=2, tensor=2)))
  rules = sharding.DEFAULT_RULES
  ptx, vtx = _txs()
  tok = jnp.zeros((1, 1), jnp.int32)

  def abstract_state():
    """The train state with logically boxed params and Adam moments."""
    p = transformer.Transformer(cfg).init(jax.random.PRNGKey(0), tok, tok,
                                          tok == 0)["params"]
    v = transformer.ValueModel(cfg).init(jax.random.PRNGKey(0), tok, tok,
                                         tok == 0)["params"]
    return step_lib.create_train_state(p, v, ptx, vtx)

  state_sharding = sharding.param_shardings(jax.eval_shape(abstract_state),
                                            mesh, rules)
  host_state = jax.device_get(
      step_lib.create_train_state(policy, value, ptx, vtx))
  state = sharding.shard_params(host_state, state_sharding)
  bsharding = sharding.batch_sharding(mesh, rules)
  batch = stream_lib.make_global_batch(local_batch, bsharding)
  fns = {f: step_lib.make_step(cfg, _step_cfg(), ptx, vtx, update_policy=f,
                               state_sharding=state_sharding,
                               batch_sharding=bsharding)
         for f in (False, True)}

  first = cfg.stages()[0][0]  # 'layers', or a MoE model's 'dense_layers'.
  gate = state.policy_params["decoder"][first]["mlp"]["gate_proj"]
  info = dict(
      gate_shape=list(gate.shape),
      gate_spec=[str(a) for a in gate.sharding.spec],
      gate_shard_shapes=sorted({str(list(s.data.shape))
                                for s in gate.addressable_shards}),
      batch_shard_shapes=sorted({str(list(s.data.shape)) for s in
                                 batch["tokens"].addressable_shards}),
  )
  state, history = _run_steps(
      fns, state, batch, functools.partial(sharding.mesh_rules, mesh, rules))
  if cfg.moe is not None:
    experts = state.policy_params["decoder"]["moe_layers"]["moe"]["up_proj"]
    info.update(expert_spec=[str(a) for a in experts.sharding.spec],
                expert_shard_shapes=sorted({str(list(s.data.shape))
                                            for s in experts.addressable_shards}))
  mu = _leaf(state.policy_opt_state, ".mu", f"['{first}']", "gate_proj")
  out_gate = state.policy_params["decoder"][first]["mlp"]["gate_proj"]
  info.update(
      out_gate_spec=[str(a) for a in out_gate.sharding.spec],
      adam_mu_spec=[str(a) for a in mu.sharding.spec],
      process=[jax.process_index(), jax.process_count(), jax.device_count(),
               jax.local_device_count()])
  return state, history, info


def _save(path: str, named: dict[str, Any]) -> None:
  """Losses and final params of each run into one .npz."""

  arrays = {}
  for name, (state, history) in named.items():
    params = {"policy": state.policy_params, "value": state.value_params}
    if jax.process_count() > 1:
      params = multihost_utils.process_allgather(params, tiled=True)
    arrays.update(_flat(f"{name}/params", params))
    arrays[f"{name}/history"] = np.asarray(json.dumps(history))
  if jax.process_index() == 0:
    np.savez(path, **arrays)


def _single_process_main(path: str) -> dict:
  assert jax.device_count() == 8, jax.devices()
  cfg, policy, value, batch = _problem()
  ref_state, ref_hist = _reference(cfg, policy, value, batch)
  state, hist, info = _sharded(cfg, policy, value, batch)
  _save(path, {"ref": (ref_state, ref_hist), "mesh": (state, hist),
               "init": (jax.device_get(_init_state(policy, value)), [])})
  return info


def _init_state(policy: Any, value: Any) -> step_lib.TrainState:
  ptx, vtx = _txs()
  return step_lib.create_train_state(policy, value, ptx, vtx)


def _multi_process_main(process_id: int, port: int, path: str) -> dict:


  sharding.initialize_distributed(ml_collections.ConfigDict(dict(
      coordinator_address=f"localhost:{port}", num_processes=2,
      process_id=process_id, cpu_collectives="gloo")))
  cfg, policy, value, batch = _problem()
  rows = slice(_B // 2 * process_id, _B // 2 * (process_id + 1))
  local = {k: v[rows] for k, v in batch.items()}
  state, hist, info = _sharded(cfg, policy, value, local)
  _save(path, {"mesh": (state, hist)})
  return info


# --------------------------------------------------------------------------
# The tests (parent process).


def _run_self(*args, devices: int, log: str) -> tuple[subprocess.Popen, str]:
  """Starts this file's `__main__`; stdout+stderr go to `log` (no pipe fills)."""
  with open(log, "w") as f:
    proc = multihost.run_as_main(__file__, *args, devices=devices, stdout=f,
                                 stderr=subprocess.STDOUT)
  return proc, log


def _result(run: tuple[subprocess.Popen, str], timeout: float = 900) -> dict:
  """The JSON the subprocess printed last (its log's tail if it failed)."""
  proc, log = run
  try:
    proc.wait(timeout=timeout)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  with open(log) as f:
    lines = f.read().strip().splitlines()
  assert proc.returncode == 0, "\n".join(lines[-40:])
  # Logging may follow the JSON line (e.g. at distributed shutdown).
  return json.loads(next(l for l in reversed(lines) if l.startswith("{")))


def _load(path: str, name: str) -> tuple[list[dict], dict[str, np.ndarray]]:
  with np.load(path) as f:
    history = json.loads(str(f[f"{name}/history"]))
    prefix = f"{name}/params"
    params = {k[len(prefix):]: f[k] for k in f.files if k.startswith(prefix)}
  return history, params


def _max_param_diff(a: dict, b: dict) -> float:
  assert sorted(a) == sorted(b)
  return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def _check_history(hist: list[dict], ref: list[dict]) -> None:
  assert len(hist) == len(ref) == 3
  for step, (h, r) in enumerate(zip(hist, ref)):
    assert sorted(h) == sorted(r), step
    assert abs(h["critic/loss"] - r["critic/loss"]) <= _TOL, (step, h, r)
    if _UPDATE_POLICY[step]:
      assert abs(h["policy/loss"] - r["policy/loss"]) <= _TOL, (step, h, r)
    for k in r:  # Every other metric, relative to its size.
      assert abs(h[k] - r[k]) <= _TOL * max(1.0, abs(r[k])), (step, k, h, r)


class _Runs:
  """The three subprocesses, started together (2 cores: compiles overlap)."""

  def __init__(self, tmp: str):
    self.single_path = os.path.join(tmp, "single.npz")
    self.multi_path = os.path.join(tmp, "multi.npz")
    port = multihost.free_port()
    log = lambda name: os.path.join(tmp, name + ".log")
    self.procs = {"single": _run_self("single", self.single_path, devices=8,
                                      log=log("single"))}
    for i in range(2):
      self.procs[f"multi{i}"] = _run_self("multi", i, port, self.multi_path,
                                          devices=4, log=log(f"multi{i}"))
    self._results: dict[str, dict] = {}

  def result(self, name: str) -> dict:
    if name not in self._results:
      self._results[name] = _result(self.procs[name])
    return self._results[name]

  def kill(self) -> None:
    for proc, _ in self.procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  r = _Runs(str(tmp_path_factory.mktemp("train_sharding")))
  try:
    yield r
  finally:
    r.kill()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_mesh_2x2x2_three_steps_match_one_device(runs):
  info, path = runs.result("single"), runs.single_path
  ref_hist, ref_params = _load(path, "ref")
  hist, params = _load(path, "mesh")
  _, init_params = _load(path, "init")
  # Step 0 is critic-only; steps 1 and 2 update the policy.
  assert ["policy/loss" in h for h in ref_hist] == list(_UPDATE_POLICY)
  _check_history(hist, ref_hist)
  # Some DIS rejections happen (the shifted tokens), and the losses move.
  assert ref_hist[1]["policy/accept_frac"] < 1.0
  assert ref_hist[0]["critic/loss"] != ref_hist[2]["critic/loss"]
  assert _max_param_diff(params, ref_params) <= _TOL
  # The parameters really moved (AdamW steps of ~lr = 1e-3 each).
  moved_policy = {k: v for k, v in ref_params.items() if k.startswith(
      "['policy']")}
  init_policy = {k: init_params[k] for k in moved_policy}
  assert _max_param_diff(moved_policy, init_policy) > 1e-3
  assert _max_param_diff(ref_params, init_params) > 1e-3
  # gate_proj [embed=64, mlp=128] is split fsdp x tensor into 8 [32, 64]
  # shards, before and after the steps, and so is its Adam moment.
  # Stacked layers (scan_layers): the leading [L] axis is never split.
  assert info["gate_shape"] == [2, 64, 128]
  assert info["gate_spec"] == ["None", "fsdp", "tensor"]
  assert info["gate_shard_shapes"] == ["[2, 32, 64]"]
  assert info["out_gate_spec"] == ["None", "fsdp", "tensor"]
  assert info["adam_mu_spec"] == ["None", "fsdp", "tensor"]
  # 8 rows over data x fsdp = 4: 2 rows per shard.
  assert info["batch_shard_shapes"] == [f"[2, {_T}]"]
  assert info["process"] == [0, 1, 8, 8]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_gloo_match_single_process(runs):
  infos = [runs.result(f"multi{i}") for i in range(2)]
  runs.result("single")  # The one-device reference is written by this run.
  single_path, path = runs.single_path, runs.multi_path
  for i, info in enumerate(infos):
    assert info["process"] == [i, 2, 8, 4]
    assert info["gate_spec"] == ["None", "fsdp", "tensor"]
    assert info["gate_shard_shapes"] == ["[2, 32, 64]"]
    assert info["out_gate_spec"] == ["None", "fsdp", "tensor"]
    # This process's 4 rows over its 2 (data, fsdp) slots, 2 rows each.
    assert info["batch_shard_shapes"] == [f"[2, {_T}]"]
  ref_hist, ref_params = _load(single_path, "ref")
  hist, params = _load(path, "mesh")  # Written by process 0.
  _check_history(hist, ref_hist)
  assert _max_param_diff(params, ref_params) <= _TOL


@pytest.mark.slow
@pytest.mark.multiprocess
def test_expert_parallel_moe_step_matches_one_device(tmp_path):
  """Experts split over fsdp (the 'expert' rule): the SAO step's losses,
  metrics (incl. the router's load-balancing loss) and updated parameters
  equal the one-device run."""
  path = str(tmp_path / "moe.npz")
  info = _result(_run_self("moe", path, devices=8,
                           log=str(tmp_path / "moe.log")))
  ref_hist, ref_params = _load(path, "ref")
  hist, params = _load(path, "mesh")
  _check_history(hist, ref_hist)
  assert ref_hist[1]["policy/moe_aux_loss"] > 0
  assert _max_param_diff(params, ref_params) <= _TOL
  # up_proj [L=1, expert=8, embed=64, mlp=32]: experts over fsdp, mlp over
  # tensor: each of the 8 devices holds 4 experts' halves.
  assert info["expert_spec"] == ["None", "fsdp", "None", "tensor"]
  assert info["expert_shard_shapes"] == ["[1, 4, 64, 16]"]


if __name__ == "__main__":
  if sys.argv[1] in ("single", "moe"):
    _CASE["moe"] = sys.argv[1] == "moe"
    print(json.dumps(_single_process_main(sys.argv[2])))
  else:
    print(json.dumps(_multi_process_main(int(sys.argv[2]), int(sys.argv[3]),
                                         sys.argv[4])))
