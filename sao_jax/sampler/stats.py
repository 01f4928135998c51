"""The sampler's counters, shared with the trainer (one writer: the engine).

`SamplerStats` lives in shared memory (``multiprocessing.Value``) between the
sampler process and the trainer, which logs ``sampler/<name>``; in-process
runs (evaluation, tests) use a plain instance.
"""

from __future__ import annotations

import ctypes
import time


PHASES = ("starting", "waiting for admission (the trainer's step)",
          "loading weights", "running episodes (generation and env calls)",
          "waiting for ring space")


class SamplerStats(ctypes.Structure):
  """The sampler's counters, shared with the trainer (one writer: the child)."""

  _fields_ = [
      ("episodes", ctypes.c_double),
      ("action_tokens", ctypes.c_double),  # Action tokens generated.
      ("busy_s", ctypes.c_double),  # Generating.
      ("idle_s", ctypes.c_double),  # Waiting for admission or ring space.
      ("weight_load_s", ctypes.c_double),
      # Pushing adopted weights into an engine that holds its own copy (the
      # vLLM engine's workers; 0 for the native engine).
      ("engine_push_s", ctypes.c_double),
      ("weights_version", ctypes.c_double),  # Newest weights version seen.
      ("env_errors", ctypes.c_double),  # Episodes that ended in an env error.
      # Episodes in flight when the sampler stopped (never written; a resumed
      # run starts them again).
      ("episodes_aborted", ctypes.c_double),
      # Rows x steps of the decode loop, and those that generated a token
      # (their ratio is the decode-batch occupancy).
      ("decode_row_steps", ctypes.c_double),
      ("decode_active_row_steps", ctypes.c_double),
      # Cached tokens whose keys/values were kept across a weight swap.
      ("kv_cache_stale_tokens", ctypes.c_double),
      # Weight versions whose MAC failed (written by another process).
      ("rejected_weights", ctypes.c_double),
      # Tasks skipped at selection: their prompt alone is over the budget.
      ("skipped_long_prompts", ctypes.c_double),
      # The code tool's counters (envs/code_env.py STAT_FIELDS).
      ("code_calls", ctypes.c_double), ("code_exec_s_p50", ctypes.c_double),
      ("code_exec_s_p99", ctypes.c_double),
      ("code_timeouts", ctypes.c_double),
      ("code_memory_kills", ctypes.c_double),
      ("code_truncations", ctypes.c_double),
      ("code_refusals", ctypes.c_double),
      ("code_sandbox_errors", ctypes.c_double),
      # 1 while the loop runs, 2 after a clean exit, -1 on crash.
      ("alive", ctypes.c_double),
      ("heartbeat", ctypes.c_double),  # time.time() of the last phase change.
      ("phase", ctypes.c_double),  # Index into PHASES.
  ]

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
    out = {f"sampler/{name}": float(getattr(self, name))
           for name, _ in self._fields_
           if name not in ("alive", "heartbeat", "phase")}
    out["sampler/decode_occupancy"] = self.decode_occupancy()
    return out

  def decode_occupancy(self) -> float:
    """Share of decode-batch rows that generated a token, per decode step."""
    return self.decode_active_row_steps / max(1.0, self.decode_row_steps)

  def idle_frac(self) -> float:
    """Share of the sampler's time spent waiting (admission, ring space)."""
    return self.idle_s / max(1e-9, self.idle_s + self.busy_s)
