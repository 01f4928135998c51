"""Trajectory <-> bytes without pickle: a small header plus raw array bytes.

Layout (little-endian)::

    header  <4sHHIqqII : magic b"SAOT", codec version, finish_reason,
                         T, prompt_id, group_id, len(task), len(error)
    tokens          int32[T]
    rollout_logp    float32[T]
    policy_version  int32[T]
    rewards         float32[T]
    action_mask     uint8[T]
    task, error     utf-8

The 4-byte arrays follow the 32-byte header, so every array starts aligned and
``decode`` returns NumPy views into the given buffer (no copy).
"""

from __future__ import annotations

import struct

import numpy as np

from sao_jax.trajectory import FinishReason
from sao_jax.trajectory import Trajectory

_MAGIC = b"SAOT"
_VERSION = 1
_HEADER = struct.Struct("<4sHHIqqII")
HEADER_BYTES = _HEADER.size  # 36 -> padded below to keep arrays aligned.
_PAD = (-HEADER_BYTES) % 8
_ARRAYS = (
    ("tokens", "<i4"),
    ("rollout_logp", "<f4"),
    ("policy_version", "<i4"),
    ("rewards", "<f4"),
    ("action_mask", "u1"),
)


def encode(traj: Trajectory) -> list:
  """Buffers whose concatenation is the record (for ``RingWriter.write``)."""
  task = traj.task.encode("utf-8")
  error = traj.error.encode("utf-8")
  header = _HEADER.pack(
      _MAGIC, _VERSION, int(traj.finish_reason), traj.length,
      int(traj.prompt_id), int(traj.group_id), len(task), len(error),
  ) + b"\0" * _PAD
  bufs = [header]
  for field, dtype in _ARRAYS:
    bufs.append(np.ascontiguousarray(getattr(traj, field), dtype=dtype))
  bufs.append(task + error)
  return bufs


def decode(buf) -> Trajectory:
  """A Trajectory whose arrays are NumPy views into ``buf``."""
  mv = memoryview(buf).cast("B")
  if mv.nbytes < HEADER_BYTES:
    raise ValueError(
        f"Trajectory record of {mv.nbytes} bytes is shorter than its "
        f"{HEADER_BYTES}-byte header: not produced by codec.encode."
    )
  magic, version, finish, length, prompt_id, group_id, n_task, n_err = (
      _HEADER.unpack_from(mv, 0)
  )
  if magic != _MAGIC or version != _VERSION:
    raise ValueError(
        f"Not a trajectory record (magic {magic!r}, version {version}; "
        f"expected {_MAGIC!r} v{_VERSION}): the ring carries raw payloads or "
        "another codec version."
    )
  expected = HEADER_BYTES + _PAD + 17 * length + n_task + n_err
  if mv.nbytes != expected:
    raise ValueError(
        f"Trajectory record has {mv.nbytes} bytes; its header says {expected} "
        f"(T={length}). The record is truncated or corrupted."
    )
  off = HEADER_BYTES + _PAD
  arrays = {}
  for field, dtype in _ARRAYS:
    arr = np.frombuffer(mv, dtype=dtype, count=length, offset=off)
    arrays[field] = arr.astype(arr.dtype.newbyteorder("="), copy=False)
    off += arr.nbytes
  task = bytes(mv[off:off + n_task]).decode("utf-8")
  error = bytes(mv[off + n_task:off + n_task + n_err]).decode("utf-8")
  return Trajectory(
      prompt_id=prompt_id, task=task, finish_reason=FinishReason(finish),
      group_id=group_id, error=error, **arrays,
  )
