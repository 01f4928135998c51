"""A scripted decoder for tests: forced tokens, fixed log-probs, through the
native engine's one episode loop (``engine.NativeRollout``)."""

from typing import Any, Callable, Sequence

import jax
import numpy as np

from sao_jax.sampler import engine as engine_lib
from sao_jax.sampler import interface
from sao_jax.sampler import rollout
from sao_jax.sampler.generate import Segment
from sao_jax.sampler.stats import SamplerStats

Script = Sequence[int]


class ScriptedDecoder:
  """Replays a fixed token script per row (an `engine.Decoder`).

  Each `generate` emits the row's next script tokens up to and including the
  first stop token, or its budget. Each token's log-prob is ``logprob``. A
  script is a token list per row, or ``script_of(prompt tokens) -> tokens``
  (looked up when a row's episode first generates). ``contexts[i]`` is what
  row ``i`` was fed and generated since its last reset.
  """

  def __init__(self, scripts: Sequence[Script] | Callable[[list[int]], Script],
               batch_size: int, logprob: float = -1.0):
    self._fixed = None if callable(scripts) else [list(s) for s in scripts]
    self._script_of = scripts if callable(scripts) else None
    if self._fixed is not None and len(self._fixed) != batch_size:
      raise ValueError(f"{len(self._fixed)} scripts for {batch_size} rows.")
    self.logprob = logprob
    self.contexts: list[list[int]] = [[] for _ in range(batch_size)]
    self._scripts: list[list[int] | None] = [None] * batch_size
    self._cursor = [0] * batch_size
    self.last_steps = 0

  def set_params(self, params: Any, keep_cache: bool = False) -> None:
    del params, keep_cache

  def reset_rows(self, rows: Sequence[int]) -> None:
    for i in rows:
      self.contexts[i], self._scripts[i], self._cursor[i] = [], None, 0

  def append(self, chunks: Sequence[Sequence[int]]) -> None:
    for ctx, c in zip(self.contexts, chunks):
      ctx.extend(int(t) for t in c)

  def row_length(self, i: int) -> int:
    return len(self.contexts[i])

  def routing_of(self, i: int, tokens: Sequence[int]) -> None:
    del i, tokens

  def generate(self, stop_ids, max_new_tokens, active=None, row_keys=None):
    del row_keys
    out = []
    for i, ctx in enumerate(self.contexts):
      if self._scripts[i] is None:
        self._scripts[i] = list(self._fixed[i] if self._fixed is not None
                                else self._script_of(list(ctx)))
      script, toks, stopped = self._scripts[i], [], False
      while (active[i] and len(toks) < max_new_tokens[i]
             and self._cursor[i] < len(script)):
        t = script[self._cursor[i]]
        self._cursor[i] += 1
        toks.append(t)
        if t in stop_ids:
          stopped = True
          break
      ctx.extend(toks)
      out.append(Segment(np.asarray(toks, np.int32),
                         np.full(len(toks), self.logprob, np.float32),
                         stopped))
    self.last_steps = max(len(s.tokens) for s in out)
    return out


def scripted_rollout(scripts, envs, tok, limits: rollout.RolloutLimits, *,
                     version: int = 0, logprob: float = -1.0,
                     stop_ids: Sequence[int] | None = None,
                     decode_chunk: int = 4
                     ) -> tuple[engine_lib.NativeRollout, list[ScriptedDecoder]]:
  """The native engine with one slot per env, decoding ``scripts``; the
  decoder it builds is appended to the returned list."""
  built: list[ScriptedDecoder] = []

  def decoder(config, params, batch, *args):
    del config, params, args
    built.append(ScriptedDecoder(scripts, batch, logprob))
    return built[-1]

  settings = interface.RolloutSettings(
      interface.EngineOptions(num_slots=len(envs), decode_chunk=decode_chunk,
                              weight_poll_tokens=0, env_threads=2),
      limits, stop_ids=None if stop_ids is None else tuple(stop_ids))
  engine = engine_lib.NativeRollout(
      settings, model_config=None, tokenizer=tok, envs=envs,
      weights=lambda: ({}, version), stats=SamplerStats(),
      rng=jax.random.PRNGKey(0), decoder=decoder)
  return engine, built


def play(scripts, envs, tasks, tok, limits: rollout.RolloutLimits, **kw):
  """One episode per (env, task), ``scripts`` forced: (trajectories in task
  order, the decoder)."""
  engine, built = scripted_rollout(scripts, envs, tok, limits, **kw)
  trajs = interface.run_episodes(engine, list(tasks))
  return trajs, built[0]
