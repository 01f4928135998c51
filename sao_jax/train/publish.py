"""The trainer's side of the weight slot: publishing, optionally held back.

See docs/design/data_path.md "Staleness" for the holdback's use in the staleness
study.
"""

from __future__ import annotations

import collections
import os
import shutil
from typing import Any, Callable

import jax
import numpy as np

from sao_jax import sharding
from sao_jax.ipc import weights as weights_lib


class Publisher:
  """Publishes policy weights to the slot, optionally held back.

  With ``lag`` = k > 0 the slot gets the weights of version v - k when the
  trainer reaches version v, which forces the sampler to act with
  k-versions-old weights: the staleness study's controlled lag. The first
  call always publishes (the sampler needs weights to start), so for the
  first k versions after a start or resume the lag is smaller. A version
  seen before (the critic's warm-up steps leave the policy at its version)
  is neither held nor published again: one copy per version.

  Held versions wait in host memory, or, with ``spill_dir``, on disk (one
  raw file per leaf under ``spill_dir/v<version>``, read back memory-mapped
  when due), so a lag of k costs k copies of the policy on disk instead of
  in RAM (SmolLM2-135M at k = 16: 8.2 GB). ``spill_dir`` is emptied at start
  (what a killed run left) and by ``close``. ``cast`` maps the trainer's
  params to the slot's (the sampler's precision, ``sampler/precision.py``)
  on the trainer's devices, before anything is copied to the host.
  """

  def __init__(self, slot: weights_lib.WeightSlot, lag: int,
               spill_dir: str | None = None,
               cast: Callable[[Any], Any] | None = None):
    self._slot, self._lag = slot, int(lag)
    self._cast = cast or (lambda params: params)
    self._held: collections.deque[tuple[int, Any]] = collections.deque()
    self._newest: int | None = None  # The newest version published or held.
    self._spill = spill_dir if self._lag > 0 else None
    if self._spill:
      shutil.rmtree(self._spill, ignore_errors=True)
      os.makedirs(self._spill)
    self.seconds = 0.0  # Time spent publishing.

  def __call__(self, params: Any, version: int) -> None:
    first = self._newest is None
    if not first and version <= self._newest:
      return  # That version's weights are already published or held.
    self._newest = version
    host = sharding.to_host(self._cast(params))
    if self._lag == 0 or first:
      self.seconds += self._slot.publish(host, version)
      return
    self._held.append((version, self._hold(host, version)))
    due = None
    while self._held and self._held[0][0] <= version - self._lag:
      if due is not None:  # Superseded before it was published.
        self._release(due[0])
      due = self._held.popleft()
    if due is not None:
      self.seconds += self._slot.publish(self._load(*due), due[0])
      self._release(due[0])

  def close(self) -> None:
    """Drops the held versions (and the spill directory)."""
    self._held.clear()
    if self._spill:
      shutil.rmtree(self._spill, ignore_errors=True)

  def _path(self, version: int) -> str:
    return os.path.join(self._spill, f"v{version}")

  def _hold(self, host: Any, version: int) -> Any:
    if not self._spill:
      return host
    leaves, treedef = jax.tree.flatten(host)
    os.makedirs(self._path(version), exist_ok=True)
    specs = []
    for i, leaf in enumerate(leaves):
      arr = np.asarray(leaf)  # Any dtype (bfloat16 too): raw C-order bytes.
      arr.tofile(os.path.join(self._path(version), f"{i}.bin"))
      specs.append((arr.shape, arr.dtype))
    return treedef, specs

  def _load(self, version: int, held: Any) -> Any:
    if not self._spill:
      return held
    treedef, specs = held
    return jax.tree.unflatten(treedef, [
        np.memmap(os.path.join(self._path(version), f"{i}.bin"), dtype=dtype,
                  mode="r", shape=shape) if np.prod(shape, dtype=int) else
        np.zeros(shape, dtype) for i, (shape, dtype) in enumerate(specs)])

  def _release(self, version: int) -> None:
    if self._spill:
      shutil.rmtree(self._path(version), ignore_errors=True)
