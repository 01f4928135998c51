"""The sampler's counters, shared with the trainer (one writer: the engine).

`SamplerStats` lives in shared memory (``multiprocessing.Value``) between the
sampler process and the trainer, which logs ``sampler/<name>``; in-process
runs (evaluation, tests) use a plain instance.

Every counter has a name and a rule for merging a run's samplers' values of
it (``SUM`` over the samplers a restart replaced, their ``MAX``, or the
``LAST`` one's; ``sampler/supervisor.py``). The sampler's own are fields of
the struct (``_OWN``). Any other component declares its own where it writes
them, as ``put(name, merge, value)`` (the code tool's: ``envs/code_env.py``
``COUNTERS``): they go to a fixed table of named slots in the same shared
struct, name and rule with the value, so the struct's layout does not depend
on what a process imported and the trainer reads them without importing the
component.
"""

from __future__ import annotations

import ctypes
import time
from typing import Iterator


PHASES = ("starting", "waiting for admission (the trainer's step)",
          "loading weights", "running episodes (generation and env calls)",
          "waiting for ring space")

SUM, MAX, LAST = "sum", "max", "last"  # How a run's samplers' values merge.
_MERGES = (SUM, MAX, LAST)

# The sampler's own counters, in struct order, and their merge rules.
_OWN = {
    "episodes": SUM,
    "action_tokens": SUM,  # Action tokens generated.
    "busy_s": SUM,  # Generating.
    "idle_s": SUM,  # Waiting for admission or ring space.
    "weight_load_s": SUM,
    # Pushing adopted weights into an engine that holds its own copy (the
    # vLLM engine's workers; 0 for the native engine).
    "engine_push_s": SUM,
    "weights_version": MAX,  # Newest weights version seen.
    "env_errors": SUM,  # Episodes that ended in an env error.
    # Episodes in flight when the sampler stopped (never written; a resumed
    # run starts them again).
    "episodes_aborted": SUM,
    # Rows x steps of the decode loop, and those that generated a token
    # (their ratio is the decode-batch occupancy).
    "decode_row_steps": SUM,
    "decode_active_row_steps": SUM,
    # Cached tokens whose keys/values were kept across a weight swap.
    "kv_cache_stale_tokens": SUM,
    # Weight versions whose MAC failed (written by another process).
    "rejected_weights": SUM,
    # Tasks skipped at selection: their prompt alone is over the budget.
    "skipped_long_prompts": SUM,
    # 1 while the loop runs, 2 after a clean exit, -1 on crash.
    "alive": LAST,
    "heartbeat": LAST,  # time.time() of the last phase change.
    "phase": LAST,  # Index into PHASES.
}
_NOT_LOGGED = ("alive", "heartbeat", "phase")
_SLOTS, _NAME_BYTES = 32, 48  # The table of other components' counters.


def merged(merge: str, past: float | None, value: float) -> float:
  """A counter's value over a run: `past` (the replaced samplers', None if
  none) and the current sampler's `value`, merged by `merge`."""
  if past is None or merge == LAST:
    return value
  return past + value if merge == SUM else max(past, value)


class SamplerStats(ctypes.Structure):
  """The sampler's counters, shared with the trainer (one writer: the child)."""

  _fields_ = [(name, ctypes.c_double) for name in _OWN] + [
      ("_names", (ctypes.c_char * _NAME_BYTES) * _SLOTS),
      ("_merges", ctypes.c_uint8 * _SLOTS),  # Index into _MERGES.
      ("_values", ctypes.c_double * _SLOTS)]

  def put(self, name: str, merge: str, value: float) -> None:
    """Sets counter `name`, merged over a run's samplers by `merge`
    (``SUM``, ``MAX`` or ``LAST``): a field, or a slot of the table."""
    if merge != _OWN.get(name, merge) or merge not in _MERGES:
      raise ValueError(f"Counter {name!r}: merge {merge!r} is not "
                       f"{_OWN.get(name, 'one of sum, max, last')}.")
    if name in _OWN:
      setattr(self, name, value)
      return
    key = name.encode()
    if len(key) >= _NAME_BYTES:
      raise ValueError(f"Counter name {name!r} is too long.")
    for i in range(_SLOTS):
      if not self._names[i].value:  # Free: claimed for `name`.
        self._names[i].value, self._merges[i] = key, _MERGES.index(merge)
      if self._names[i].value == key:
        self._values[i] = value
        return
    raise ValueError(f"More than {_SLOTS} counters of other components.")

  def counters(self) -> Iterator[tuple[str, str, float]]:
    """(name, merge, value) of every counter: the sampler's own, then those
    other components have put (in the order they first did)."""
    for name, merge in _OWN.items():
      yield name, merge, getattr(self, name)
    for i in range(_SLOTS):
      if self._names[i].value:
        yield (self._names[i].value.decode(), _MERGES[self._merges[i]],
               self._values[i])

  def describe(self) -> str:
    """What the sampler was last doing, for the trainer's errors."""
    if not self.heartbeat:
      return "the sampler has not started its loop yet"
    return (f"the sampler was {PHASES[int(self.phase)]} "
            f"{time.time() - self.heartbeat:.0f} s ago, after "
            f"{int(self.episodes)} episodes ({int(self.env_errors)} env "
            f"errors), weights version {int(self.weights_version)}")

  def enter(self, phase: str) -> None:
    self.phase, self.heartbeat = PHASES.index(phase), time.time()

  def as_dict(self) -> dict[str, float]:
    """``sampler/<name>`` of every counter but ``alive`` and the heartbeat,
    and ``sampler/decode_occupancy``."""
    out = {f"sampler/{name}": float(value)
           for name, _, value in self.counters() if name not in _NOT_LOGGED}
    out["sampler/decode_occupancy"] = self.decode_occupancy()
    return out

  def decode_occupancy(self) -> float:
    """Share of decode-batch rows that generated a token, per decode step."""
    return self.decode_active_row_steps / max(1.0, self.decode_row_steps)

  def idle_frac(self) -> float:
    """Share of the sampler's time spent waiting (admission, ring space)."""
    return self.idle_s / max(1e-9, self.idle_s + self.busy_s)
