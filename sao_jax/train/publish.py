"""The trainer's side of the weight slot: publishing, optionally held back.

See docs/design/data_path.md "Staleness" for the holdback's use in the staleness
study.
"""

from __future__ import annotations

import collections
from typing import Any

from sao_jax import sharding
from sao_jax.ipc import weights as weights_lib


class Publisher:
  """Publishes policy weights to the slot, optionally held back.

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
