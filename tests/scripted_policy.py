"""A scripted ``rollout.Policy`` for tests: forced tokens, fixed log-probs."""

from typing import Sequence

import numpy as np

from sao_jax.sampler.rollout import Policy
from sao_jax.sampler.generate import Segment


class ScriptedPolicy(Policy):
  """Replays a fixed token script per row (tests, forced trajectories).

  Each `act` emits the row's next script tokens up to and including the first
  stop token, or `budget` tokens. Each token's recorded log-prob is
  `logprob`; the version is `version` (settable between turns).
  """

  def __init__(self, scripts: Sequence[Sequence[int]], version: int = 0,
               logprob: float = -1.0):
    self.scripts = [list(s) for s in scripts]
    self.version = version
    self.logprob = logprob
    self.contexts: list[list[int]] = []
    self._cursor = [0] * len(self.scripts)

  def start(self, prompts):
    if len(prompts) != len(self.scripts):
      raise ValueError(f"{len(prompts)} prompts for {len(self.scripts)} scripts.")
    self.contexts = [list(p) for p in prompts]
    self._cursor = [0] * len(self.scripts)

  def observe(self, chunks):
    for ctx, c in zip(self.contexts, chunks):
      ctx.extend(c)

  def refresh(self) -> int:
    return self.version

  def act(self, stop_ids, budgets, active):
    out = []
    for i, script in enumerate(self.scripts):
      toks, stopped = [], False
      while active[i] and len(toks) < budgets[i] and self._cursor[i] < len(script):
        t = script[self._cursor[i]]
        self._cursor[i] += 1
        toks.append(t)
        if t in stop_ids:
          stopped = True
          break
      self.contexts[i].extend(toks)
      out.append(Segment(np.asarray(toks, np.int32),
                         np.full(len(toks), self.logprob, np.float32), stopped))
    return out
