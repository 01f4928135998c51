"""The policy a run starts from: an HF checkpoint or a random init, then an
optional SFT warm start.

The warm start trains on demonstrations in the sampler's template
(``sft_examples``, drawn from ``sft_tasks``) with ``sft.run_sft``; the result
is cached on disk (``initial_policy``) so a resumed run, or any run with the
same starting checkpoint, model, tokenizer, env and SFT settings, does not
train it again.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from sao_jax.tokenization import text_tokenizer
from sao_jax.envs import demonstrations
from sao_jax.envs import function_tasks
from sao_jax.envs import reasoning_gym_env
from sao_jax.models import hf
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.train import metrics as metrics_lib
from sao_jax.train import sft as sft_lib

# The SFT warm start draws from the first training tasks only (generating
# reasoning-gym entries costs ~1 ms each); RL then sees all of them.
MAX_SFT_EXAMPLES = 4096


def random_policy(mcfg: ModelConfig, seed: int) -> Any:
  """Unboxed ``Transformer`` params from ``PRNGKey(seed)``.

  One jitted init program: op by op, every layer's initialisers dispatch (and
  on first use compile) dozens of tiny programs, which cost about 2-3x the
  CPU of the one compile. The values are the same random draws (jax's PRNG does
  not depend on jit); only float rounding of the scaled draws may differ.
  """
  tok = jnp.zeros((1, 1), jnp.int32)

  def init(key):
    return nn.unbox(transformer.Transformer(mcfg).init(
        key, tok, tok, tok == 0)["params"])

  return jax.jit(init)(jax.random.PRNGKey(seed))


def sft_examples(tasks, tokenizer: text_tokenizer.TextTokenizer, n: int,
                 max_len: int,
                 tool_frac: float = 0.0,
                 styles: tuple[str, ...] = (),
                 instruction: str = "",
                 code_tool: bool = False) -> list[sft_lib.Example]:
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
  every = demonstrations.tool_every(tool_frac)
  out, lengths = [], []
  for i in range(min(n, len(tasks))):
    segments = demonstrations.demonstration(
        tasks.entry(i), i, tokenizer, tool_every=every, styles=styles,
        instruction=instruction, code_tool=code_tool)
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


def _checkpoint_files(path: str) -> list[tuple[str, int, int]]:
  """(name, size, mtime_ns) of a checkpoint directory's files: the SFT cache
  of a checkpoint replaced at the same path is not reused."""
  if not path:
    return []
  return sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                for e in os.scandir(path) if e.is_file())


def sft_cache_key(config: Any, mcfg: ModelConfig,
                  tokenizer: text_tokenizer.TextTokenizer) -> str:
  """Hash of everything the SFT warm start depends on (a shared-cache key)."""
  t = config.train
  parts = {
      "model": dataclasses.asdict(mcfg),
      "init_from": [str(config.model.init_from),
                    _checkpoint_files(str(config.model.init_from))],
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

  None: the RL training tasks themselves. An int: ``MAX_SFT_EXAMPLES``
  problems of their own item seeds, which must not overlap the RL training
  or the held-out problems.
  """
  if config.train.sft_data_seed is None:
    return train_tasks
  if train_tasks.name == function_tasks.NAME:
    raise ValueError(
        "train.sft_data_seed: the codeio tasks warm-start on the RL training "
        "tasks' own reference solutions; leave it None (its held-out split "
        "is disjoint by construction).")
  tasks = reasoning_gym_env.ReasoningGymTasks(
      train_tasks.name, dict(config.env.dataset_config),
      seed=int(config.train.sft_data_seed), size=MAX_SFT_EXAMPLES)
  for other, label in ((train_tasks, "RL training"), (eval_tasks, "held-out")):
    reasoning_gym_env.check_disjoint(
        other, tasks, labels=(label, "SFT (train.sft_data_seed)"),
        fix="choose a train.sft_data_seed outside the RL training and "
            "held-out item seeds")
  return tasks


def _run_sft(config: Any, mcfg: ModelConfig,
             tokenizer: text_tokenizer.TextTokenizer,
             tasks: reasoning_gym_env.ReasoningGymTasks,
             writer: metrics_lib.MetricWriter, params: Any = None) -> Any:
  """Supervised warm start (``train.sft_*``) of ``params``, or of a random
  init (``train.sft_seed``) when None."""
  if params is None:
    params = random_policy(mcfg, int(config.train.sft_seed))
  cfg = sft_lib.SFTConfig(
      steps=int(config.train.sft_steps),
      batch_size=int(config.train.sft_batch_size),
      max_len=int(config.train.sft_max_len), lr=float(config.train.sft_lr),
      seed=int(config.train.sft_seed))
  styles = (tuple(config.env.styles) if str(config.env.name) == "evolving"
            else ())
  examples = sft_examples(tasks, tokenizer,
                          min(len(tasks), MAX_SFT_EXAMPLES), cfg.max_len,
                          float(config.train.sft_tool_frac), styles,
                          str(config.env.get("instruction", "")),
                          code_tool=str(config.env.name) == "code")
  logging.info("SFT warm start: %d steps on %d examples.", cfg.steps,
               len(examples))
  params, _ = sft_lib.run_sft(
      mcfg, params, examples, cfg, pad_id=tokenizer.pad_id,
      on_metrics=lambda i, m: writer.write_scalars(i - cfg.steps, m))
  return params


def initial_policy(config: Any, mcfg: ModelConfig,
                   tokenizer: text_tokenizer.TextTokenizer,
                   train_tasks, eval_tasks, workdir: str,
                   writer: metrics_lib.MetricWriter) -> Any:
  """The checkpoint (``model.init_from``) or a random init, then SFT when
  ``train.sft_steps`` > 0 (cached). A fresh run's only: a resumed run
  restores its trained policy (``setup.build`` does not call this).

  The SFT result is cached in ``workdir/sft``, or with ``train.sft_cache_dir``
  in ``<sft_cache_dir>/<sft_cache_key>``, shared by every run with the same
  starting checkpoint, model, tokenizer, env and SFT settings; a file lock
  makes concurrent runs wait for the one that trains it.
  """
  start = None
  if config.model.init_from:
    loaded_cfg, start = hf.load_hf_checkpoint(
        config.model.init_from, param_dtype=mcfg.param_dtype,
        scan_layers=mcfg.scan_layers)
    if not loaded_cfg.same_architecture(mcfg):
      raise ValueError(
          f"config.model does not match the checkpoint at "
          f"{config.model.init_from}: config {mcfg} vs checkpoint "
          f"{loaded_cfg}.")
  if int(config.train.sft_steps) <= 0:
    return start if start is not None else random_policy(
        mcfg, int(config.train.seed))
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
      return hf.load_hf_checkpoint(sft_dir,
                                   scan_layers=mcfg.scan_layers)[1]
    params = _run_sft(config, mcfg, tokenizer,
                      sft_tasks(config, train_tasks, eval_tasks), writer,
                      start)
    if os.path.exists(sft_dir):  # Left by a run killed while saving.
      shutil.rmtree(sft_dir)
    tmp = f"{sft_dir}.tmp{os.getpid()}"
    # The family the config belongs to (Llama or Qwen2 for a plain one).
    hf.save_hf_checkpoint(mcfg, params, tmp, arch=mcfg.hf_architecture())
    os.replace(tmp, sft_dir)  # Readers never see a half-written cache.
  return params
