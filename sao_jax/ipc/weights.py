"""A versioned weight slot in shared memory: trainer -> sampler.

See docs/design/ipc.md "Weight slot".

The trainer ``publish``es a parameter pytree with its policy version; samplers
``read`` the newest *complete* version. Two buffers plus a seqlock:

    [header 4 KiB][leaf table (JSON)][buffer 0: seq, version | leaves]
                                     [buffer 1: seq, version | leaves]

``publish`` writes the buffer that is not ``latest``: makes its sequence word
odd, copies the leaves, makes it even again and flips ``latest``. It never
waits for readers. A reader copies the ``latest`` buffer and accepts the copy
only if the buffer's sequence word was even and unchanged across the copy, so
it never returns a mix of two versions; if the writer lapped it, it retries.

One writer: only the creator publishes, and its versions never decrease. The
sequence words come from the writer's own counters, so a word another
process left odd ("being written") is overwritten by the next publish. With
``authenticate=True`` each version carries a MAC of its bytes, version and
publish count (``ipc/mac.py``) under the creator's ``key``, which readers must
be given: a version whose MAC fails (e.g. version 777 written by another
process) is rejected and counted (``rejected``), and the reader falls back on
the other buffer if that one is genuine.

Structure: the leaf table stores each leaf's key path, shape and dtype. A
reader passes a template pytree (e.g. its own freshly initialised params or
``jax.eval_shape`` output) to get the same structure back; without one it gets
a flat ``{key path: array}`` dict.
"""

from __future__ import annotations

import json
import time
from typing import Any

from absl import logging
import jax
import ml_dtypes
import numpy as np

from sao_jax.ipc import mac as mac_lib
from sao_jax.ipc import segment

_MAGIC = 0x5A0_3E16
_HEADER_BYTES = 4096
_CTL_BYTES = 64
_ALIGN = 64
_NONE = 2  # ``latest`` before the first publish.

# Header words (int64).
(_H_MAGIC, _H_LATEST, _H_TABLE_BYTES, _H_DATA_BYTES, _H_PUBLISHES,
 _H_KEYED) = range(6)
# Buffer control words (int64); words 4-5 hold the MAC tag.
_SEQ, _VERSION, _COUNT, _TAG = 0, 1, 2, 4

PyTree = Any


def _align(n: int) -> int:
  return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _dtype_name(dtype: np.dtype) -> str:
  return np.dtype(dtype).name


def _dtype_from_name(name: str) -> np.dtype:
  if name == "bfloat16":
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def _leaf_table(template: PyTree) -> list[dict]:
  leaves = jax.tree_util.tree_flatten_with_path(template)[0]
  table, off = [], 0
  for path, leaf in leaves:
    dtype = np.dtype(leaf.dtype)
    shape = tuple(int(d) for d in leaf.shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    table.append({
        "path": jax.tree_util.keystr(path), "shape": list(shape),
        "dtype": _dtype_name(dtype), "offset": off, "nbytes": nbytes,
    })
    off = _align(off + nbytes)
  return table


def _layout(template: PyTree) -> tuple[list[dict], bytes, int, int]:
  """(leaf table, its JSON, bytes of one buffer, bytes of the whole slot)."""
  table = _leaf_table(template)
  raw = json.dumps(table).encode("utf-8")
  data_bytes = max(_ALIGN, table[-1]["offset"] + table[-1]["nbytes"]
                   if table else 0)
  data_bytes = _align(data_bytes)
  size = _HEADER_BYTES + _align(len(raw)) + 2 * (_CTL_BYTES + data_bytes)
  return table, raw, data_bytes, size


def slot_bytes(template: PyTree) -> int:
  """Shared-memory bytes of a slot for ``template`` (arrays or
  ``jax.ShapeDtypeStruct``s): header, leaf table and two buffers."""
  return _layout(template)[3]


class WeightSlot:
  """Publisher (``create``) or reader (``attach``) of a versioned pytree."""

  def __init__(self, shm, owner: bool, template: PyTree | None,
               key: bytes | None = None):
    self._shm = shm
    self._name = shm.name
    self._owner = owner
    self._hdr = np.frombuffer(shm.buf, np.int64, count=8)
    if int(self._hdr[_H_MAGIC]) != _MAGIC:
      raise ValueError(
          f"Segment {shm.name!r} is not a sao_jax weight slot; pass the name "
          "returned by WeightSlot.create(...).name."
      )
    if bool(self._hdr[_H_KEYED]) != (key is not None):
      raise ValueError(
          f"Weight slot {shm.name} is {'' if self._hdr[_H_KEYED] else 'not '}"
          "authenticated: pass key=WeightSlot.key of its creator exactly "
          "when it is.")
    self._key = key
    self._mac = mac_lib.Mac(key) if key is not None else None
    # The writer's own state: what another process writes never steers it.
    self._seqs, self._count, self._last_version = [0, 0], 0, None
    self._latest = _NONE
    table_bytes = int(self._hdr[_H_TABLE_BYTES])
    self._data_bytes = int(self._hdr[_H_DATA_BYTES])
    raw = bytes(shm.buf[_HEADER_BYTES:_HEADER_BYTES + table_bytes])
    self._table = json.loads(raw.decode("utf-8"))
    start = _HEADER_BYTES + _align(table_bytes)
    stride = _CTL_BYTES + self._data_bytes
    self._ctl = [
        np.frombuffer(shm.buf, np.int64, count=8, offset=start + b * stride)
        for b in range(2)
    ]
    self._data = [
        np.frombuffer(shm.buf, np.uint8, count=self._data_bytes,
                      offset=start + b * stride + _CTL_BYTES)
        for b in range(2)
    ]
    self._treedef = None
    if template is not None:
      self._treedef = self._check_template(template)
    self.retries = 0
    self.rejected = 0  # Versions whose MAC failed (not this run's writer).

  @classmethod
  def create(cls, template: PyTree, *,
             authenticate: bool = False) -> WeightSlot:
    """Creates a slot for pytrees shaped like ``template`` (owned by caller).

    Args:
      template: A pytree of arrays or ``jax.ShapeDtypeStruct``s; leaves are
        stored (and read back) in their own dtypes.
      authenticate: Versions carry a MAC under a fresh secret ``key``, which
        readers must be given.
    """
    table, raw, data_bytes, size = _layout(template)
    shm = segment.create("w", size)
    try:
      hdr = np.frombuffer(shm.buf, np.int64, count=8)
      shm.buf[_HEADER_BYTES:_HEADER_BYTES + len(raw)] = raw
      hdr[_H_TABLE_BYTES] = len(raw)
      hdr[_H_DATA_BYTES] = data_bytes
      hdr[_H_LATEST] = _NONE
      hdr[_H_KEYED] = int(authenticate)
      hdr[_H_MAGIC] = _MAGIC
      del hdr
      slot = cls(shm, owner=True, template=template,
                 key=mac_lib.new_key() if authenticate else None)
    except BaseException:
      segment.release(shm, unlink=True)
      raise
    logging.info("Created weight slot %s: %d leaves, %d bytes per version.",
                 shm.name, len(table), data_bytes)
    return slot

  @classmethod
  def attach(cls, name: str, template: PyTree | None = None,
             key: bytes | None = None) -> WeightSlot:
    """Reads a slot created elsewhere; ``template`` gives the tree structure.

    ``key`` is the creator's ``key`` if the slot is authenticated.
    """
    shm = segment.attach(name)
    try:
      return cls(shm, owner=False, template=template, key=key)
    except BaseException:
      segment.release(shm, unlink=False)
      raise

  @property
  def name(self) -> str:
    return self._name

  @property
  def key(self) -> bytes | None:
    """The MAC key to hand to readers (never stored in shared memory)."""
    return self._key

  @property
  def nbytes(self) -> int:
    """Bytes copied per publish/read."""
    return self._data_bytes

  def _check_template(self, template: PyTree):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    got = [(jax.tree_util.keystr(p), [int(d) for d in l.shape])
           for p, l in leaves]
    want = [(e["path"], e["shape"]) for e in self._table]
    if got != want:
      diff = next(((g, w) for g, w in zip(got, want) if g != w),
                  (len(got), len(want)))
      raise ValueError(
          f"Template does not match weight slot {self._name}: first "
          f"difference (template, slot) = {diff}. Pass a pytree with the "
          "publisher's structure and shapes."
      )
    return treedef

  # --- writer ---------------------------------------------------------------

  def publish(self, params: PyTree, version: int) -> float:
    """Makes ``params`` the newest version; returns seconds spent copying.

    Raises:
      PermissionError: this process attached the slot (only its creator
        publishes).
      ValueError: ``version`` is older than the last one published, or the
        tree does not match the slot.
    """
    if not self._owner:
      raise PermissionError(
          f"Weight slot {self.name} has one writer, its creator; this "
          "process attached it and may only read.")
    if self._last_version is not None and version < self._last_version:
      raise ValueError(
          f"Weight versions only increase: slot {self.name} has version "
          f"{self._last_version}, publish() got {version}.")
    t0 = time.perf_counter()
    leaves = jax.tree_util.tree_leaves(params)
    if len(leaves) != len(self._table):
      raise ValueError(
          f"publish() got {len(leaves)} leaves; slot {self.name} holds "
          f"{len(self._table)}. Publish the pytree the slot was created for."
      )
    b = 0 if self._latest == _NONE else 1 - self._latest
    ctl, data = self._ctl[b], self._data[b]
    seq = self._seqs[b]
    self._seqs[b] = seq + 2
    ctl[_SEQ] = seq + 1  # Odd: writing (whatever another process left).
    ctl[_VERSION] = version
    for leaf, e in zip(leaves, self._table):
      arr = np.asarray(leaf)
      if list(arr.shape) != e["shape"]:
        ctl[_SEQ] = seq + 2
        raise ValueError(
            f"Leaf {e['path']} has shape {arr.shape}; the slot expects "
            f"{tuple(e['shape'])}."
        )
      dst = data[e["offset"]:e["offset"] + e["nbytes"]].view(
          _dtype_from_name(e["dtype"])).reshape(arr.shape)
      np.copyto(dst, arr, casting="unsafe")
    if self._mac is not None:
      self._count += 1
      ctl[_COUNT] = self._count
      ctl[_TAG:_TAG + 2].view(np.uint8)[:] = np.frombuffer(
          self._mac.tag(self._count, version, data), np.uint8)
    ctl[_SEQ] = seq + 2  # Even: complete.
    self._last_version, self._latest = version, b
    self._hdr[_H_LATEST] = b
    self._hdr[_H_PUBLISHES] += 1
    return time.perf_counter() - t0

  # --- readers --------------------------------------------------------------

  def latest_version(self) -> int:
    """Version of the newest complete publish, or -1 before the first.

    A hint only: not authenticated (``read`` checks the MAC).
    """
    latest = int(self._hdr[_H_LATEST])
    return -1 if latest == _NONE else int(self._ctl[latest][_VERSION])

  def read(self, timeout: float | None = 10.0) -> tuple[int, PyTree] | None:
    """Copies the newest complete version as ``(version, tree)``, or None.

    Raises:
      TimeoutError: the writer kept overwriting the buffer for ``timeout`` s.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    out = np.empty(self._data_bytes, np.uint8)
    while True:
      b = int(self._hdr[_H_LATEST])
      if b == _NONE:
        return None
      got = self._copy(b, out)
      if got is not None:
        if got[1]:
          return got[0], self._unflatten(out)
        self.rejected += 1
        logging.warning(
            "Weight slot %s: version %d has a bad MAC: written by another "
            "process, rejected (%d so far).", self.name, got[0],
            self.rejected)
        got = self._copy(1 - b, out)  # The other buffer, if genuine.
        return (got[0], self._unflatten(out)) if got and got[1] else None
      self.retries += 1
      if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(
            f"Weight slot {self.name}: no consistent copy within {timeout} s "
            "(the publisher overwrites faster than this reader copies, or "
            "another process marked the buffer as being written: the next "
            "publish repairs it)."
        )
      time.sleep(0)

  def _copy(self, b: int, out: np.ndarray) -> tuple[int, bool] | None:
    """Copies buffer ``b`` into ``out``: (its version, whether authentic), or
    None if it was being written or changed during the copy."""
    ctl = self._ctl[b]
    s1 = int(ctl[_SEQ])
    if s1 % 2:
      return None
    version, count = int(ctl[_VERSION]), int(ctl[_COUNT])
    tag = ctl[_TAG:_TAG + 2].tobytes()
    out[:] = self._data[b]
    if int(ctl[_SEQ]) != s1:
      return None
    return version, (self._mac is None
                     or self._mac.verify(count, version, out, tag))

  def _unflatten(self, out: np.ndarray) -> PyTree:
    leaves = [
        out[e["offset"]:e["offset"] + e["nbytes"]].view(
            _dtype_from_name(e["dtype"])).reshape(e["shape"])
        for e in self._table
    ]
    if self._treedef is None:
      return {e["path"]: leaf for e, leaf in zip(self._table, leaves)}
    return jax.tree_util.tree_unflatten(self._treedef, leaves)

  def close(self) -> None:
    """Detaches; the creator also unlinks the segment."""
    if self._shm is None:
      return
    self._hdr = self._ctl = self._data = None
    segment.release(self._shm, unlink=self._owner)
    self._shm = None

  def __del__(self):
    # Drop our NumPy views before SharedMemory.__del__ closes the mapping.
    if getattr(self, "_shm", None) is not None:
      self.close()

  def __enter__(self) -> WeightSlot:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
