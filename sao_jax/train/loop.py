"""``train_and_evaluate(config, workdir)``: the asynchronous SAO loop end to end.

One trainer process (this one) and one sampler host process (spawned):

  sampler ──trajectories──► ring ──grain stream──► jitted SAO step
     ▲                                                  │
     └──────────── versioned weight slot ◄──────────────┘

Startup: tokenizer (``tokenizer_from_config``: trained into the workdir once), policy (HF
checkpoint, or random init + SFT warm start cached in ``workdir/sft``),
critic from the policy, optimizers; then, if ``workdir/checkpoints`` has one,
the newest checkpoint is restored and the run continues from it. The sampler
is told where to resume (``episodes_consumed``) so prompts continue exactly.

Modes: ``async`` (sampler runs ahead up to ``max_staleness`` steps), ``sync``
(max staleness forced to 0: strict generate→train alternation, the baseline)
and ``group`` (sync, ``n_rollouts`` per prompt for GRPO-family losses).

Every ``log_every`` steps scalars go to TensorBoard (``workdir/tb``); held-out
accuracy every ``eval_every`` policy steps; orbax checkpoints every
``checkpoint_every`` steps and at the end. The sampler is stopped and the
shared-memory segments unlinked on every exit path.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import signal
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
from absl import logging

from sao_jax import sharding
from sao_jax import tokenizer as tok_lib
from sao_jax.data import stream as stream_lib
from sao_jax.envs import evolving
from sao_jax.envs import from_config
from sao_jax.envs import reasoning_gym_env
from sao_jax.envs import tool_env
from sao_jax.ipc import ring as ring_lib
from sao_jax.ipc import weights as weights_lib
from sao_jax.models import hf
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.rl import advantages as adv_lib
from sao_jax.sampler import process as sampler_lib
from sao_jax.train import checkpoint as ckpt_lib
from sao_jax.train import evaluate as eval_lib
from sao_jax.train import metrics as metrics_lib
from sao_jax.train import optim
from sao_jax.train import sft as sft_lib
from sao_jax.train import step as step_lib

_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
# The SFT warm start draws from the first training tasks only (generating
# reasoning-gym entries costs ~1 ms each); RL then sees all of them.
_MAX_SFT_EXAMPLES = 4096


# ------------------------------------------------------------------ setup ---


def model_config_from(config: Any, tokenizer: tok_lib.Tokenizer) -> ModelConfig:
  fields = {k: config.model[k] for k in _MODEL_FIELDS}
  mcfg = ModelConfig(**fields)
  if mcfg.vocab_size < tokenizer.vocab_size:
    raise ValueError(
        f"config.model.vocab_size={mcfg.vocab_size} < tokenizer vocab "
        f"{tokenizer.vocab_size}; raise config.model.vocab_size.")
  return mcfg


def _abstract_boxed(mcfg: ModelConfig, value: bool) -> Any:
  tok = jnp.zeros((1, 1), jnp.int32)
  module = transformer.ValueModel(mcfg) if value else transformer.Transformer(
      mcfg)
  return jax.eval_shape(
      lambda: module.init(jax.random.PRNGKey(0), tok, tok, tok == 0))["params"]


def sft_examples(tasks, tokenizer: tok_lib.Tokenizer, n: int, max_len: int,
                 tool_frac: float = 0.0,
                 styles: tuple[str, ...] = (),
                 instruction: str = "") -> list[sft_lib.Example]:
  """SFT demonstrations in the sampler's template, fitting ``max_len``.

  Longer ones are left out with a warning; if none fits, ValueError names
  the length that would.

  A ``tool_frac`` share (every k-th task) demonstrates the calculator: the
  action calls it with the task's expression, the tool result is an
  observation (not trained on), then the answer. The rest answer directly.
  With ``styles`` (the evolving env), task i's answer is written in style
  ``styles[i % len(styles)]``, so the warm-started policy knows every style
  and RL has to find out which one the reward wants now. ``instruction``
  (``env.instruction``) follows every question, as in the environments.
  """
  every = round(1.0 / tool_frac) if tool_frac > 0 else 0
  out, lengths = [], []
  for i in range(min(n, len(tasks))):
    entry = tasks.entry(i)
    segments = [(tokenizer.encode(
        tok_lib.format_prompt(entry["question"] + instruction)), False)]
    expr = entry.get("metadata", {}).get("expression")
    if every and i % every == 0 and expr is not None:
      value = tool_env.format_number(tool_env.calculate(expr))
      segments += [
          (tokenizer.encode(tok_lib.format_tool_call(expr)), True),
          (tokenizer.encode(tok_lib.format_tool_result(value)), False)]
    answer = str(entry["answer"])
    if styles:
      answer = evolving.format_style(answer, styles[i % len(styles)])
    segments.append(
        (tokenizer.encode(tok_lib.format_assistant_turn(answer)), True))
    lengths.append(sum(len(seg) for seg, _ in segments))
    if lengths[-1] <= max_len:
      out.append(segments)
  if len(out) < len(lengths):
    cut = sorted(n for n in lengths if n > max_len)
    what = (f"all {len(lengths)}" if not out else
            f"{len(cut)} of {len(lengths)}")
    message = (f"{what} SFT demonstrations are longer than train.sft_max_len="
               f"{max_len}; the median needs {int(np.median(lengths))} tokens, "
               f"the longest {cut[-1]}: raise train.sft_max_len to >= "
               f"{cut[-1]}.")
    if not out:
      raise ValueError(message)
    logging.warning("%s They are left out.", message)
  return out


def sft_cache_key(config: Any, mcfg: ModelConfig,
                  tokenizer: tok_lib.Tokenizer) -> str:
  """Hash of everything the SFT warm start depends on (a shared-cache key)."""
  t = config.train
  parts = {
      "model": dataclasses.asdict(mcfg),
      "tokenizer": hashlib.sha256(tokenizer.serialized_proto()).hexdigest(),
      "env": json.loads(config.env.to_json_best_effort(sort_keys=True)),
      "sft": [int(t.sft_steps), int(t.sft_batch_size), float(t.sft_lr),
              int(t.sft_max_len), float(t.sft_tool_frac), int(t.sft_seed),
              t.sft_data_seed],
  }
  blob = json.dumps(parts, sort_keys=True, default=str).encode()
  return hashlib.sha256(blob).hexdigest()[:16]


def sft_tasks(config: Any, train_tasks: reasoning_gym_env.ReasoningGymTasks,
              eval_tasks: reasoning_gym_env.ReasoningGymTasks
              ) -> reasoning_gym_env.ReasoningGymTasks:
  """The SFT demonstrations' problems (``train.sft_data_seed``).

  None: the RL training tasks themselves. An int: ``_MAX_SFT_EXAMPLES``
  problems of their own item seeds, which must not overlap the RL training
  or the held-out problems.
  """
  if config.train.sft_data_seed is None:
    return train_tasks
  tasks = reasoning_gym_env.ReasoningGymTasks(
      train_tasks.name, dict(config.env.dataset_config),
      seed=int(config.train.sft_data_seed), size=_MAX_SFT_EXAMPLES)
  for other, label in ((train_tasks, "RL training"), (eval_tasks, "held-out")):
    reasoning_gym_env.check_disjoint(
        other, tasks, labels=(label, "SFT (train.sft_data_seed)"),
        fix="choose a train.sft_data_seed outside the RL training and "
            "held-out item seeds")
  return tasks


def _run_sft(config: Any, mcfg: ModelConfig, tokenizer: tok_lib.Tokenizer,
             tasks: reasoning_gym_env.ReasoningGymTasks,
             writer: metrics_lib.MetricWriter) -> Any:
  """Random init + supervised warm start (``train.sft_*``)."""
  tok = jnp.zeros((1, 1), jnp.int32)
  params = nn.unbox(transformer.Transformer(mcfg).init(
      jax.random.PRNGKey(int(config.train.sft_seed)), tok, tok,
      tok == 0)["params"])
  cfg = sft_lib.SFTConfig(
      steps=int(config.train.sft_steps),
      batch_size=int(config.train.sft_batch_size),
      max_len=int(config.train.sft_max_len), lr=float(config.train.sft_lr),
      seed=int(config.train.sft_seed))
  styles = (tuple(config.env.styles) if str(config.env.name) == "evolving"
            else ())
  examples = sft_examples(tasks, tokenizer,
                          min(len(tasks), _MAX_SFT_EXAMPLES), cfg.max_len,
                          float(config.train.sft_tool_frac), styles,
                          str(config.env.get("instruction", "")))
  logging.info("SFT warm start: %d steps on %d examples.", cfg.steps,
               len(examples))
  params, _ = sft_lib.run_sft(
      mcfg, params, examples, cfg, pad_id=tokenizer.pad_id,
      on_metrics=lambda i, m: writer.write_scalars(i - cfg.steps, m))
  return params


def initial_policy(config: Any, mcfg: ModelConfig, tokenizer: tok_lib.Tokenizer,
                   train_tasks, eval_tasks, workdir: str,
                   writer: metrics_lib.MetricWriter) -> Any:
  """HF checkpoint, cached SFT result, or random init + SFT (cached).

  The SFT result is cached in ``workdir/sft``, or with ``train.sft_cache_dir``
  in ``<sft_cache_dir>/<sft_cache_key>``, shared by every run with the same
  model, tokenizer, env and SFT settings; a file lock makes concurrent runs
  wait for the one that trains it.
  """
  if config.model.init_from:
    loaded_cfg, params = hf.load_hf_checkpoint(config.model.init_from)
    if loaded_cfg != mcfg:
      raise ValueError(
          f"config.model does not match the checkpoint at "
          f"{config.model.init_from}: config {mcfg} vs checkpoint "
          f"{loaded_cfg}.")
    return params
  if int(config.train.sft_steps) <= 0:
    tok = jnp.zeros((1, 1), jnp.int32)
    return nn.unbox(transformer.Transformer(mcfg).init(
        jax.random.PRNGKey(int(config.train.seed)), tok, tok,
        tok == 0)["params"])
  cache_root = str(config.train.sft_cache_dir)
  if cache_root:
    os.makedirs(cache_root, exist_ok=True)
    sft_dir = os.path.join(cache_root, sft_cache_key(config, mcfg, tokenizer))
  else:
    sft_dir = os.path.join(workdir, "sft")
  with open(sft_dir + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
    if os.path.exists(os.path.join(sft_dir, "config.json")):
      logging.info("Using the SFT warm start cached in %s", sft_dir)
      return hf.load_hf_checkpoint(sft_dir)[1]
    params = _run_sft(config, mcfg, tokenizer,
                      sft_tasks(config, train_tasks, eval_tasks), writer)
    if os.path.exists(sft_dir):  # Left by a run killed while saving.
      shutil.rmtree(sft_dir)
    tmp = f"{sft_dir}.tmp{os.getpid()}"
    hf.save_hf_checkpoint(mcfg, params, tmp, arch="LlamaForCausalLM"
                          if not mcfg.qkv_bias else "Qwen2ForCausalLM")
    os.replace(tmp, sft_dir)  # Readers never see a half-written cache.
  return params


# --------------------------------------------------------------- the loop ---


@dataclasses.dataclass
class _Clock:
  start: float = dataclasses.field(default_factory=time.perf_counter)
  trainer_wait: float = 0.0

  @property
  def elapsed(self) -> float:
    return time.perf_counter() - self.start


class _Publisher:
  """Publishes policy weights to the slot, optionally held back (§4).

  With ``lag`` = k > 0 the slot gets the weights of version v - k when the
  trainer reaches version v, which forces the sampler to act with
  k-versions-old weights: the staleness study's controlled lag. The first
  call always publishes (the sampler needs weights to start), so for the
  first k versions after a start or resume the lag is smaller.
  """

  def __init__(self, slot: weights_lib.WeightSlot, lag: int):
    self._slot, self._lag = slot, int(lag)
    self._held: collections.deque[tuple[int, Any]] = collections.deque()
    self._published = False
    self.seconds = 0.0  # Time spent publishing.

  def __call__(self, params: Any, version: int) -> None:
    host = sharding.to_host(params)
    if self._lag == 0 or not self._published:
      self.seconds += self._slot.publish(host, version)
      self._published = True
      return
    self._held.append((version, host))
    due = None
    while self._held and self._held[0][0] <= version - self._lag:
      due = self._held.popleft()
    if due is not None:
      self.seconds += self._slot.publish(due[1], due[0])


def _group_index(prompt_ids: np.ndarray) -> np.ndarray:
  """Dense group index per row: rows with the same prompt form a group."""
  _, inverse = np.unique(prompt_ids, return_inverse=True)
  return inverse.astype(np.int32)


def _sampler_idle_frac(sstats: dict[str, float]) -> float:
  """Share of the sampler's time spent waiting (admission, ring space)."""
  idle, busy = sstats["sampler/idle_s"], sstats["sampler/busy_s"]
  return idle / max(1e-9, idle + busy)


def _staleness_stats(batch: dict[str, np.ndarray]) -> dict[str, float]:
  st = batch["staleness"].astype(np.float64)
  return {"staleness/min": st.min(), "staleness/mean": st.mean(),
          "staleness/max": st.max()}


def _to_device_batch(batch: dict[str, np.ndarray], config: Any, mesh,
                     rules) -> dict[str, jax.Array]:
  batch = dict(batch)
  batch["prompt_id"] = (batch["prompt_id"] - int(config.env.seed)).astype(
      np.int32)
  # Hosts draw disjoint prompt shards: offset so groups stay apart globally.
  batch["group_index"] = _group_index(batch["prompt_id"]) + (
      jax.process_index() * len(batch["prompt_id"]))
  for k in ("length", "staleness"):
    batch[k] = batch[k].astype(np.int32)
  return sharding.make_global_batch(batch, mesh, rules)


def _run_tokenizer(config: Any, workdir: str,
                   primary: bool) -> tok_lib.Tokenizer:
  """The run's tokenizer (``tokenizer_from_config``), one for all processes.

  In a multi-host run process 0 trains (or loads) it first and the others
  wait at a barrier, then load the file it wrote to the shared workdir, so
  every host maps text to the same ids.
  """
  if jax.process_count() == 1:
    return tok_lib.tokenizer_from_config(config.tokenizer, workdir)
  tokenizer = (tok_lib.tokenizer_from_config(config.tokenizer, workdir)
               if primary else None)
  multihost_utils.sync_global_devices("sao_jax tokenizer ready")
  return tokenizer or tok_lib.tokenizer_from_config(config.tokenizer, workdir)


def _write_json_atomic(path: str, obj: Any) -> None:
  """Writes ``obj`` as JSON to ``path`` via rename (the run-finished marker)."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


def _sampler_cores(config: Any) -> tuple[int, ...]:
  """``sampler.devices`` as CPU core ids ('0,1' or '0-3'); '' = no pinning."""
  spec = str(config.sampler.devices).strip()
  cores: list[int] = []
  for part in filter(None, spec.split(",")):
    lo, _, hi = part.partition("-")
    try:
      cores.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
      raise ValueError(
          f"config.sampler.devices={spec!r}: expected CPU core ids such as "
          "'0' or '0,2' or '0-3'.") from None
  return tuple(cores)


def train_and_evaluate(config: Any, workdir: str) -> dict[str, float]:
  """Runs SFT (if configured), asynchronous SAO RL and evaluation.

  Returns:
    A summary: held-out accuracy before/after RL, steps, trajectories, tokens/s,
    mean staleness, ring and sampler counters.
  """
  os.makedirs(workdir, exist_ok=True)
  workdir = os.path.abspath(workdir)
  mode = str(config.train.mode)
  max_staleness = 0 if mode in ("sync", "group") else int(
      config.train.max_staleness)
  publish_lag = int(config.train.publish_lag)
  token_budget = int(config.train.max_generated_tokens)
  n_roll = int(config.sampler.n_rollouts)
  if mode == "group" and n_roll < 2:
    raise ValueError("train.mode='group' needs sampler.n_rollouts >= 2.")
  nproc = jax.process_count()
  local_batch = int(config.train.batch_size) // nproc
  episodes_per_batch = max(1, int(config.sampler.batch_size) // n_roll) * n_roll
  if local_batch % episodes_per_batch:
    raise ValueError(
        f"train.batch_size/process_count={local_batch} must be a multiple of "
        f"the sampler's episodes per batch ({episodes_per_batch} = "
        "sampler.batch_size rounded down to a multiple of n_rollouts); "
        "otherwise sync mode cannot alternate.")

  # One event file and one summary.json per run: process 0 writes them (the
  # losses are global; ring, sampler and staleness figures are its host's).
  primary = jax.process_index() == 0
  writer = metrics_lib.MetricWriter(os.path.join(workdir, "tb"),
                                    active=primary)
  tokenizer = _run_tokenizer(config, workdir, primary)
  mcfg = model_config_from(config, tokenizer)
  train_tasks, eval_tasks = from_config.build_tasks(config.env)

  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.normalize_rules(config.mesh.rules)
  p_shard = sharding.param_shardings(_abstract_boxed(mcfg, False), mesh, rules)
  v_shard = sharding.param_shardings(_abstract_boxed(mcfg, True), mesh, rules)

  policy_params = initial_policy(config, mcfg, tokenizer, train_tasks,
                                 eval_tasks, workdir, writer)
  value_params = transformer.value_params_from_policy(
      policy_params, mcfg, jax.random.PRNGKey(int(config.train.seed) + 7))
  policy_params = sharding.shard_params(policy_params, p_shard)
  value_params = sharding.shard_params(value_params, v_shard)

  warmup = int(config.rl.critic_warmup_steps)
  total_steps = warmup + int(config.train.num_steps)
  o = config.optim
  policy_tx = optim.make_optimizer(
      float(o.actor_lr), warmup_steps=int(o.warmup_steps),
      schedule=str(o.schedule), total_steps=int(config.train.num_steps),
      weight_decay=float(o.weight_decay), b1=float(o.b1), b2=float(o.b2),
      eps=float(o.eps), grad_clip=float(o.grad_clip))
  value_tx = optim.make_optimizer(
      float(o.critic_lr), warmup_steps=int(o.warmup_steps),
      schedule=str(o.schedule), total_steps=total_steps,
      weight_decay=float(o.weight_decay), b1=float(o.b1), b2=float(o.b2),
      eps=float(o.eps), grad_clip=float(o.grad_clip),
      labels=(optim.frozen_attention_labels(value_params)
              if config.rl.critic_frozen_attention else None))
  step_cfg = step_lib.StepConfig(
      loss=str(config.rl.loss),
      loss_hparams=tuple(sorted(
          (k, config.rl[k]) for k in ("eps_low", "eps_high", "kl_coef",
                                      "dual_clip", "cap", "mismatch_low",
                                      "mismatch_high", "behav_weight_cap",
                                      "constant")
          if config.rl[k] is not None)),
      advantage=str(config.rl.advantage), gamma=float(config.rl.gamma),
      lam_critic=float(config.rl.lam_critic),
      lam_policy_alpha=float(config.rl.lam_policy_alpha),
      critic_updates_per_step=int(config.rl.critic_updates_per_step),
      temperature=float(config.sampler.temperature),
      value_clip=config.rl.value_clip, max_groups=int(config.train.batch_size),
      running_mean_global=config.rl.running_mean_scope == "global")
  running_mean = None
  if step_cfg.advantage == "running_mean":
    running_mean = adv_lib.running_mean_init(
        1 if step_cfg.running_mean_global else len(train_tasks),
        int(config.rl.running_mean_k))
  state = step_lib.create_train_state(policy_params, value_params, policy_tx,
                                      value_tx, running_mean=running_mean)

  # Params and optimizer moments keep their mesh shardings; scalars (step,
  # version, Adam counts) are replicated over the mesh (not one local device,
  # which would break multi-host runs).
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state_sharding = jax.tree.map(
      lambda x: x.sharding if isinstance(
          x.sharding, jax.sharding.NamedSharding) else replicated, state)
  state = jax.device_put(state, state_sharding)

  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
  meta: dict[str, Any] = {"episodes_consumed": 0, "stream": {},
                          "eval_before": None}
  if ckpt.latest_step() is not None:
    # Restored straight into the mesh shardings (each host reads its shards).
    state, meta, step0 = ckpt.restore(state)
    logging.info("Resumed from checkpoint step %d (policy version %d).",
                 step0, int(state.policy_version))
  start_step = int(state.step)
  bsharding = sharding.batch_sharding(mesh, rules)
  step_fns = {
      flag: step_lib.make_step(mcfg, step_cfg, policy_tx, value_tx,
                               update_policy=flag,
                               state_sharding=state_sharding,
                               batch_sharding=bsharding)
      for flag in (False, True)}

  if meta.get("eval_before") is None:
    meta["eval_before"] = eval_lib.evaluate(
        sharding.to_host(state.policy_params), mcfg, config, tokenizer,
        eval_tasks, version=int(state.policy_version))
    logging.info("Held-out accuracy before RL: %.3f",
                 meta["eval_before"]["eval/accuracy"])
    writer.write_scalars(start_step, {**meta["eval_before"],
                                      "tokens/generated_total": 0.0})

  summary: dict[str, float] = {}
  sampler = None
  ring = ring_lib.RingReader.create(
      num_lanes=1, lane_bytes=int(config.ring.capacity_bytes) // 64 * 64)
  slot = weights_lib.WeightSlot.create(sharding.to_host(state.policy_params))
  previous_sigterm = signal.getsignal(signal.SIGTERM)

  def on_sigterm(signum, frame):
    del frame
    raise KeyboardInterrupt(f"signal {signum}")

  signal.signal(signal.SIGTERM, on_sigterm)
  try:
    clock = _Clock()
    publish = _Publisher(slot, publish_lag)
    publish(state.policy_params, int(state.policy_version))
    sampler = sampler_lib.SamplerHandle(sampler_lib.SamplerSpec(
        config=config, model_config=mcfg, tokenizer_proto=tokenizer.serialized_proto(),
        ring_name=ring.name, lane=0, weights_name=slot.name,
        parent_pid=os.getpid(),
        start_episode=int(meta["episodes_consumed"]) // nproc,
        # The held-back versions use up part of the staleness bound.
        max_staleness=max_staleness - publish_lag,
        cores=_sampler_cores(config),
        process_index=jax.process_index(), process_count=nproc))
    sampler.set_trainer_step(start_step)
    sampler.start()
    version_box = {"v": int(state.policy_version)}
    stream = stream_lib.TrajectoryStream(
        ring, batch_size=local_batch, seq_len=int(config.train.max_seq_len),
        trainer_version=lambda: version_box["v"], max_staleness=max_staleness,
        overlong="truncate", pad_id=tokenizer.pad_id,
        read_timeout=float(config.ring.get_timeout_s),
        check_producers=sampler.check)
    stream.counters.load(meta.get("stream", {}))
    batches = iter(stream.dataset)
    steady: dict[str, float] = {}
    consumed = int(meta["episodes_consumed"])
    last = {"time": time.perf_counter(), "sampler_tokens":
            sampler.stats_dict()["sampler/action_tokens"]}
    for step in range(start_step, total_steps):
      t_wait = time.perf_counter()
      read_before = stream.counters.records_read
      host_batch = next(batches)
      clock.trainer_wait += time.perf_counter() - t_wait
      consumed += (stream.counters.records_read - read_before) * nproc
      update_policy = step >= warmup
      batch = _to_device_batch(host_batch, config, mesh, rules)
      with sharding.mesh_rules(mesh, rules):
        state, m = step_fns[update_policy](state, batch)
      version_box["v"] = int(state.policy_version)
      done = step + 1
      if done % int(config.train.publish_every) == 0 or done == total_steps:
        publish(state.policy_params, version_box["v"])
      generated = stream.counters.action_tokens_read * nproc
      out_of_tokens = bool(token_budget) and generated >= token_budget
      sampler.set_trainer_step(done)
      if done == start_step + 2:  # Trainer and sampler have compiled by now.
        steady = {"t0": time.perf_counter(), "steps": 0}
      elif steady:
        steady["steps"] += 1
        steady["t1"] = time.perf_counter()

      if (done % int(config.train.log_every) == 0 or done == total_steps
          or out_of_tokens):
        scalars = {k: float(v) for k, v in jax.device_get(m).items()}
        scalars.update(_staleness_stats(host_batch))
        now = time.perf_counter()
        sstats = sampler.stats_dict()
        counters = stream.counters.as_dict()
        rstats = ring.stats()
        scalars.update({
            "policy_version": version_box["v"],
            "throughput/trainer_tokens_per_s": (
                scalars["tokens/action"] * int(config.train.log_every)
                / max(now - last["time"], 1e-9)),
            "throughput/sampler_tokens_per_s": (
                (sstats["sampler/action_tokens"] - last["sampler_tokens"])
                / max(now - last["time"], 1e-9)),
            "idle/trainer_frac": clock.trainer_wait / clock.elapsed,
            "idle/sampler_frac": _sampler_idle_frac(sstats),
            "weights/publish_s_total": publish.seconds,
            "tokens/generated_total": float(generated),
            "stream/dropped_stale": counters["dropped_stale"],
            "stream/multi_version_frac": counters["multi_version"] / max(
                1, counters["admitted"]),
            "ring/occupancy_bytes": float(sum(
                lane["occupancy_bytes"] for lane in rstats["lanes"])),
            "ring/occupancy_frac": float(rstats["occupancy"]),
            "ring/producer_deaths": float(rstats["producer_deaths"]),
            **sstats,
        })
        last.update(time=now, sampler_tokens=sstats["sampler/action_tokens"])
        writer.write_scalars(done, scalars)
        writer.write_histograms(done, {"staleness": host_batch["staleness"]})
        writer.flush()
        logging.info(
            "step %d/%d | v%d | reward %.3f | accept %.3f | value_loss %.4f | "
            "staleness %.2f | %.1fs elapsed", done, total_steps,
            version_box["v"], scalars["reward/mean"],
            scalars.get("policy/accept_frac", float("nan")),
            scalars.get("critic/value_loss", float("nan")),
            scalars["staleness/mean"], clock.elapsed)

      policy_steps = done - warmup
      if (int(config.train.eval_every) and policy_steps > 0
          and policy_steps % int(config.train.eval_every) == 0
          and done != total_steps and not out_of_tokens):
        ev = eval_lib.evaluate(sharding.to_host(state.policy_params), mcfg,
                               config, tokenizer, eval_tasks,
                               version=version_box["v"])
        writer.write_scalars(done, {**ev,
                                    "tokens/generated_total": generated})
        logging.info("step %d: held-out accuracy %.3f", done,
                     ev["eval/accuracy"])
      meta.update(episodes_consumed=consumed,
                  stream=stream.counters.as_dict())
      if (int(config.train.checkpoint_every)
          and done % int(config.train.checkpoint_every) == 0
          and done != total_steps and not out_of_tokens):
        ckpt.save(done, state, meta)
      if out_of_tokens:
        logging.info("Generated-token budget reached: %d >= %d tokens at "
                     "step %d.", generated, token_budget, done)
        break

    final_step = int(state.step)
    if final_step > start_step or ckpt.latest_step() != final_step:
      ckpt.save(final_step, state, meta)
    ev = eval_lib.evaluate(sharding.to_host(state.policy_params), mcfg, config,
                           tokenizer, eval_tasks,
                           version=int(state.policy_version))
    counters = stream.counters.as_dict()
    writer.write_scalars(final_step, {
        **ev, "tokens/generated_total": float(
            counters["action_tokens_read"] * nproc)})
    sstats = sampler.stats_dict()
    summary = {
        "accuracy_before": meta["eval_before"]["eval/accuracy"],
        "accuracy_after": ev["eval/accuracy"],
        "eval_problems": ev["eval/num_problems"],
        "steps": float(final_step),
        "policy_version": float(state.policy_version),
        "trajectories_read_from_ring": float(counters["records_read"]),
        "trajectories_trained": float(counters["admitted"]),
        "dropped_stale": float(counters["dropped_stale"]),
        "generated_tokens": float(counters["action_tokens_read"] * nproc),
        "staleness_mean": float(counters["staleness_mean"]),
        "staleness_max": float(counters["staleness_max"]),
        "sampler_episodes": sstats["sampler/episodes"],
        "sampler_tokens_per_s": sstats["sampler/action_tokens"] / max(
            1e-9, clock.elapsed),
        "wall_s": clock.elapsed,
        # Steady state (from the 3rd step on: compilation excluded).
        "train_wall_s": steady.get("t1", 0.0) - steady.get("t0", 0.0),
        "train_wall_steps": float(steady.get("steps", 0)),
        "trainer_idle_frac": clock.trainer_wait / max(1e-9, clock.elapsed),
        "sampler_idle_frac": _sampler_idle_frac(sstats),
    }
    writer.write_scalars(final_step, {f"summary/{k}": v
                                      for k, v in summary.items()})
    logging.info("Summary: %s", summary)
    if primary:
      _write_json_atomic(os.path.join(workdir, "summary.json"), summary)
    return summary
  finally:
    signal.signal(signal.SIGTERM, previous_sigterm)
    if sampler is not None:
      sampler.stop()
    ring.close()
    slot.close()
    writer.close()
    ckpt.close()
