"""The vLLM rollout engine (``sampler.engine='vllm'``; the ``vllm`` extra).

`VllmRollout` is an `interface.Rollout` on vLLM's ``AsyncLLM`` (continuous
batching, paged attention, prefix caching), in the sampler host process; its
engine core is a child of that process, which a helper (`_start_reaper`)
SIGKILLs when the sampler dies, so a trainer that dies takes it down (the
sampler's ``PR_SET_PDEATHSIG``) and the supervisor's restart starts a new
one. One asyncio task per episode is its one episode loop: each turn
submits the episode's whole context as token ids (prefix caching makes a
grown context cheap), takes the action vLLM generated token for token (no
re-tokenisation; vLLM never sees text: ``skip_tokenizer_init``, our model's
own tokenizer and chat template encode prompts and observations) and hands
it to the shared ``rollout.Episode`` rules, with the environment's call on a
worker thread.

Log-probs are vLLM's ``processed_logprobs`` (after the temperature, as the
trainer computes them; the default ``raw_logprobs`` ignores it). Top-k and
top-p are refused (`check_config`): vLLM reports the truncated,
renormalised log-prob, the trainer the full-vocabulary one. Weights go in
place: the params from the weight slot, in HF names by the family's export
mapping (``models.hf.hf_tensors``), are written to ``/dev/shm`` and loaded
by each worker's ``reload_weights`` (`vllm_worker.WeightLoader`); in flight
as ``sampler.weight_poll_tokens`` says (``pause_generation(mode='keep')``,
push, resume), the KV cache kept or cleared (``sampler.kv_on_swap``: 'keep'
also keeps the prefix cache's blocks of the old weights for the episodes
that resubmit them, 'recompute' clears both); between episodes the prefix
cache is cleared. Each token's version is vLLM's ``weight_versions``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

from absl import logging
import numpy as np

from sao_jax.ipc import segment
from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs.base import Environment
from sao_jax.models.config import ModelConfig
from sao_jax.sampler import feed as feed_lib
from sao_jax.sampler import interface
from sao_jax.sampler import rollout

MIN_CPU_HEAD_DIM = 32  # vLLM's CPU attention refuses smaller heads.
_KV_CACHE_GIB = "2"  # VLLM_CPU_KVCACHE_SPACE unless the environment sets it.


# A sampler's files, by its pid: its model directory and pushed weights.
_TMP_RE = re.compile(r"^sao_vllm_([0-9]+)_\w+$")
_PUSH_RE = re.compile(r"^sao_vllm_([0-9]+)\.safetensors$")


def check_config(config: Any) -> None:
  """Refuses what the vLLM engine cannot report as the trainer computes it."""
  s = config.sampler
  if float(s.top_p) < 1 or int(s.top_k) > 0:
    raise ValueError(
        f"config.sampler.engine='vllm' with sampler.top_p={s.top_p}, "
        f"top_k={s.top_k}: vLLM reports the sampled token's log-prob under "
        "the truncated, renormalised distribution, the trainer computes it "
        "over the whole vocabulary (sao_jax/sampler/sampling.py), so every "
        "ratio would be off by the kept mass; use top_p=1 and top_k=0, or "
        "sampler.engine='native'.")
  if str(config.model.routing_replay) == "rollout":
    raise ValueError(
        "config.model.routing_replay='rollout' with sampler.engine='vllm': "
        "replay needs the experts of every token the sampler fed, which the "
        "vLLM engine does not record; use routing_replay='off' or "
        "sampler.engine='native'.")
  mesh = s.get("mesh")
  if mesh is not None and any(int(v) != 1 for a, v in mesh.items()
                              if not (a == "tensor" and int(v) == 0)):
    raise ValueError(
        f"config.sampler.mesh={dict(mesh)} with sampler.engine='vllm': the "
        "sampler mesh lays out the native engine's devices; the vLLM engine "
        "runs on one device here. Leave sampler.mesh at 1, 1, 0 (auto) or "
        "1, 1, 1, or use sampler.engine='native'.")
  if not 0 < float(s.vllm_gpu_memory) < 1:
    raise ValueError(
        f"config.sampler.vllm_gpu_memory={s.vllm_gpu_memory}: the share of "
        "the GPU's memory vLLM may take must be in (0, 1), leaving the rest "
        "to the trainer on the same chip.")


def _dtype_name(dtype: Any) -> str:
  return str(np.dtype(dtype))


def _versions(output: Any, n: int, fallback: int) -> np.ndarray:
  """Per-token policy versions of a finished vLLM completion."""
  out = np.full(n, fallback, np.int64)
  for span in output.weight_versions or ():
    if str(span.version).lstrip("-").isdigit():  # Ours (not 'default').
      out[span.start:span.end] = int(span.version)
  return out


class VllmRollout:
  """The ``'vllm'`` `interface.Rollout` (module docstring)."""

  name = "vllm"

  def __init__(self, settings: interface.RolloutSettings, *, config: Any,
               model_config: ModelConfig, tokenizer: tok_lib.Tokenizer,
               envs: Sequence[Environment], weights: interface.WeightSource,
               stats, seed: int = 0, arch: str | None = None):
    """Args:
      settings: slots (``max_num_seqs``), weight polling, limits, sampling.
      config: the experiment config (checked with `check_config`).
      model_config: the policy's architecture (its HF config for vLLM).
      tokenizer: the model's own tokenizer (encodes observations, decodes
        actions for the environment; stop tokens).
      envs: one environment per slot.
      weights: the newest published weights (polled).
      stats: a `SamplerStats`.
      seed: sampling seed (episode ``e``, turn ``k``: ``seed + e, k``).
      arch: HF architecture (default the config's own).
    """
    check_config(config)
    opts = settings.options
    if len(envs) != opts.num_slots:
      raise ValueError(f"{len(envs)} envs for {opts.num_slots} slots.")
    self.settings, self.opts, self.limits = settings, opts, settings.limits
    self.envs, self.tokenizer, self.weights = list(envs), tokenizer, weights
    self.stats, self.seed = stats, int(seed)
    self.model_config = model_config
    self.enforce_eager = not config.sampler.vllm_compile
    self.gpu_memory = float(config.sampler.vllm_gpu_memory)
    self.arch = arch or model_config.hf_architecture()
    self.stop_ids = tuple(rollout.default_stop_ids(tokenizer)
                          if settings.stop_ids is None else settings.stop_ids)
    self.version: int | None = None
    self._llm = None
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread: threading.Thread | None = None
    self._dir: tempfile.TemporaryDirectory | None = None
    self._pool: cf.ThreadPoolExecutor | None = None
    self._tokens = 0  # Tokens generated since the last weight poll.
    self._running = 0  # Episodes in flight.
    self._swap = None  # asyncio.Lock of weight pushes.
    self._reaper: subprocess.Popen | None = None

  # -- lifecycle -------------------------------------------------------------
  def _call(self, coro, timeout: float | None = None) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

  def start(self) -> None:
    """Starts ``AsyncLLM`` (random weights until the first push)."""
    if self._llm is not None:
      return
    cfg = self.model_config
    if cfg.head_dim < MIN_CPU_HEAD_DIM and not _has_gpu():
      raise ValueError(
          f"model.head_dim={cfg.head_dim}: vLLM's CPU attention needs "
          f"head_dim >= {MIN_CPU_HEAD_DIM}; use sampler.engine='native'.")
    if not _has_gpu():  # libtpu (the tpu extra) alone would claim a TPU.
      os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
      os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", _KV_CACHE_GIB)
      os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # Never fork this process (JAX's runtime and threads are up).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # Named by this pid, so that a start after a SIGKILLed sampler removes
    # what it could not (its config directory, its pushed tensors).
    if os.environ.get(segment.KEEP_ORPHANS_ENV) != "1":
      segment.reap_orphans(tempfile.gettempdir(), _TMP_RE, 1)
      segment.reap_orphans("/dev/shm", _PUSH_RE, 1)
    self._dir = tempfile.TemporaryDirectory(prefix=f"sao_vllm_{os.getpid()}_")
    with open(os.path.join(self._dir.name, "config.json"), "w") as f:
      json.dump(cfg.to_hf_config(self.arch), f)
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever,
                                    name="sao-vllm-loop", daemon=True)
    self._thread.start()
    self._pool = cf.ThreadPoolExecutor(self.opts.env_threads + 1,
                                       thread_name_prefix="sao-vllm-env")
    t0 = time.perf_counter()
    before = _children() if sys.platform.startswith("linux") else {}
    self._llm = self._call(self._make_llm())
    self._reaper = _start_reaper(before)
    logging.info("sampler: vLLM %s engine up in %.1f s (%d slots, %s).",
                 self.arch, time.perf_counter() - t0, self.opts.num_slots,
                 _dtype_name(cfg.dtype))

  async def _make_llm(self):
    # pylint: disable=g-import-not-at-top
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    # pylint: enable=g-import-not-at-top
    self._swap = asyncio.Lock()
    # On a CPU the same argument reserves a share of host memory instead.
    gpu = {"gpu_memory_utilization": self.gpu_memory} if _has_gpu() else {}
    args = AsyncEngineArgs(
        model=self._dir.name, skip_tokenizer_init=True, load_format="dummy",
        dtype=_dtype_name(self.model_config.dtype),
        max_model_len=self.limits.max_total_tokens,
        max_num_seqs=self.opts.num_slots, enable_prefix_caching=True,
        logprobs_mode="processed_logprobs", seed=self.seed,
        worker_extension_cls="sao_jax.sampler.vllm_worker.WeightLoader",
        disable_log_stats=True, enforce_eager=self.enforce_eager,
        # One chip: the worker in the engine-core process (no third process
        # to spawn and import torch and vLLM into).
        distributed_executor_backend="uni", **gpu)
    return AsyncLLM.from_engine_args(args)

  def stop(self) -> None:
    if self._llm is not None:
      self._llm.shutdown()
      self._llm = None
    if self._reaper is not None:  # Nothing left to reap.
      self._reaper.kill()
      self._reaper.wait()
      self._reaper = None
    if self._loop is not None:
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(10)
      self._loop = None
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)
      self._pool = None
    if self._dir is not None:
      self._dir.cleanup()
      self._dir = None
    self.version = None

  # -- weights ---------------------------------------------------------------
  def update_weights(self, params: Any, version: int) -> None:
    self._call(self._push(params, version))

  async def _push(self, params: Any, version: int) -> None:
    """Pushes ``params`` as ``version``; episodes in flight wait meanwhile."""
    from sao_jax.models import hf  # pylint: disable=g-import-not-at-top
    import safetensors.numpy  # pylint: disable=g-import-not-at-top

    async with self._swap:
      t0 = time.perf_counter()
      loop = asyncio.get_running_loop()
      path = os.path.join("/dev/shm", f"sao_vllm_{os.getpid()}.safetensors")
      tensors = await loop.run_in_executor(
          self._pool, hf.hf_tensors, self.model_config, params, self.arch)
      await loop.run_in_executor(self._pool, safetensors.numpy.save_file,
                                 tensors, path)
      in_flight = self._running > 0 and self.version is not None
      if in_flight:
        await self._llm.pause_generation(
            mode="keep", clear_cache=self.opts.kv_on_swap == "recompute")
      try:
        await self._llm.collective_rpc("sao_load_weights", args=(path,))
        await self._llm.update_weight_version(str(int(version)))
        if not in_flight:  # No cached prefix of the old weights is reused.
          await self._llm.reset_prefix_cache()
      finally:
        if in_flight:
          await self._llm.resume_generation()
        os.unlink(path)
      self.stats.engine_push_s += time.perf_counter() - t0
      logging.log_every_n(logging.INFO, "sampler: vLLM weights %s -> %d (%d "
                          "episodes in flight) in %.2f s.", 20, self.version,
                          version, self._running, time.perf_counter() - t0)
      self.version = int(version)

  async def _poll_weights(self) -> None:
    loop = asyncio.get_running_loop()
    params, version = await loop.run_in_executor(self._pool, self.weights)
    if params is not None and version != self.version:
      await self._push(params, version)

  # -- one episode -----------------------------------------------------------
  async def _episode(self, feed: feed_lib.EpisodeFeed, slot: int,
                     number: int) -> None:
    from vllm import SamplingParams  # pylint: disable=g-import-not-at-top
    from vllm.inputs import TokensPrompt  # pylint: disable=g-import-not-at-top

    loop = asyncio.get_running_loop()
    ep = rollout.Episode(self.envs[slot], self.tokenizer, self.limits, number)
    context = await loop.run_in_executor(self._pool, ep.begin,
                                         feed.task(number))
    s = self.settings.sampling
    while context is not None and not ep.over:
      budget = ep.turn_left
      params = SamplingParams(
          temperature=0.0 if s.greedy else s.temperature,
          max_tokens=budget, stop_token_ids=list(self.stop_ids),
          ignore_eos=True, logprobs=0, detokenize=False,
          skip_special_tokens=False,
          seed=(self.seed + number) * 1000 + ep.turns)
      final, seen = None, 0
      async for out in self._llm.generate(
          TokensPrompt(prompt_token_ids=list(context)), params,
          request_id=f"e{number}t{ep.turns}v{self.version}"):
        final = out
        n = len(out.outputs[0].token_ids)
        self._tokens, seen = self._tokens + n - seen, n
      c = final.outputs[0]
      tokens = [int(t) for t in c.token_ids]
      logps = [float(c.logprobs[j][t].logprob) for j, t in enumerate(tokens)]
      versions = _versions(c, len(tokens), self.version)
      ep.add_action(tokens, logps, versions)
      context = list(context) + tokens
      stopped = c.finish_reason == "stop"
      then = ep.after_segment(stopped, ended=len(tokens) < budget)
      if then != rollout.STEP:
        continue  # OVER ends the loop; GENERATE goes on.
      try:
        result = await loop.run_in_executor(
            self._pool, ep.env_step, int(versions[-1]) if tokens else
            self.version)
      except Exception as e:  # pylint: disable=broad-except
        ep.fail("step", e)
        break
      obs = ep.env_result(result)
      context = None if obs is None else context + list(obs)
    feed.finish(number, ep.trajectory())

  # -- the loop --------------------------------------------------------------
  def run(self, feed: feed_lib.EpisodeFeed,
          should_stop: Callable[[], bool]) -> int:
    """Runs ``feed``'s episodes until ``should_stop()`` (`interface.Rollout`)."""
    self.start()
    return self._call(self._run(feed, should_stop))

  async def _run(self, feed: feed_lib.EpisodeFeed,
                 should_stop: Callable[[], bool]) -> int:
    tasks: dict[int, asyncio.Task] = {}  # slot -> its episode.
    n, slots = feed.n_rollouts, self.opts.num_slots
    poll = self.opts.weight_poll_tokens
    try:
      t0 = time.perf_counter()
      while not should_stop():
        now = time.perf_counter()  # The last iteration, busy or waiting.
        if tasks:
          self.stats.busy_s += now - t0
        else:
          self.stats.idle_s += now - t0
        t0 = now
        for slot in [i for i, t in tasks.items() if t.done()]:
          tasks.pop(slot).result()  # An engine error ends the run.
        self._running = len(tasks)
        if self.version is None:
          self.stats.enter("loading weights")
          await self._poll_weights()
          if self.version is None:
            await asyncio.sleep(0.01)
            continue
        elif poll > 0 and self._tokens >= poll:
          self._tokens = 0
          await self._poll_weights()
        free = [i for i in range(slots) if i not in tasks]
        if self.opts.refill or len(free) == slots:
          while len(free) >= n and (self.opts.refill
                                    or feed.admits_ahead(slots)):
            first = feed.next_group()
            if first is None:
              break
            if not tasks:
              await self._poll_weights()  # Idle: start on the newest.
            for k in range(n):
              slot = free.pop(0)
              tasks[slot] = asyncio.create_task(
                  self._episode(feed, slot, first + k))
        self._running = len(tasks)
        self.stats.enter("running episodes (generation and env calls)"
                         if tasks else
                         "waiting for admission (the trainer's step)")
        # In this thread (the episodes' tasks add to the feed here too);
        # waiting for ring space holds the loop, vLLM's core goes on.
        if not feed.flush():
          break
        await asyncio.sleep(0.005)
    finally:
      for task in tasks.values():
        task.cancel()
      await asyncio.gather(*tasks.values(), return_exceptions=True)
      in_flight = feed.abandon(sum(t.cancelled() for t in tasks.values()))
      self._running = 0
    return in_flight


# Run by a helper process (``_start_reaper``): SIGKILLs the given processes
# (pid, start time) and their descendants when its parent, the sampler, dies.
_REAPER = r"""
import ctypes, os, signal, sys, time
parent = int(sys.argv[1])
targets = [tuple(map(int, a.split(":"))) for a in sys.argv[2:]]

def start_time(pid):
  with open(f"/proc/{pid}/stat") as f:
    return int(f.read().rsplit(")", 1)[1].split()[19])

def descendants(roots):
  children = {}
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat") as f:
          ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      except (OSError, ValueError, IndexError):
        continue
      children.setdefault(ppid, []).append(int(name))
  out, todo = [], list(roots)
  while todo:
    for child in children.get(todo.pop(), ()):
      out.append(child)
      todo.append(child)
  return out

def reap(*_):
  live = []
  for pid, started in targets:
    try:
      if start_time(pid) == started:
        live.append(pid)
    except OSError:
      pass
  # The engine core's own workers too: orphaned, they would run on (vLLM's
  # CPU worker for 15-40 s, busy, seen in the suite).
  for pid in live + descendants(live):
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass
  os._exit(0)

signal.signal(signal.SIGTERM, reap)
ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
  reap()
while True:
  time.sleep(3600)
"""


def _children() -> dict[int, int]:
  """This process's children: pid -> start time (Linux /proc)."""
  out = {}
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if int(fields[1]) == os.getpid():
      out[int(name)] = int(fields[19])
  return out


def _start_reaper(before: dict[int, int]) -> subprocess.Popen | None:
  """A helper that SIGKILLs the processes this one started since ``before``
  (vLLM's engine core; its workers follow it) when this process dies: a
  SIGKILLed sampler must not leave an engine running."""
  if not sys.platform.startswith("linux"):
    return None
  new = {p: t for p, t in _children().items() if p not in before}
  return subprocess.Popen(
      [sys.executable, "-c", _REAPER, str(os.getpid())]
      + [f"{p}:{t}" for p, t in new.items()], stdin=subprocess.DEVNULL)


def _has_gpu() -> bool:
  try:
    import torch  # pylint: disable=g-import-not-at-top
    return bool(torch.cuda.is_available())
  except ImportError:
    return False
