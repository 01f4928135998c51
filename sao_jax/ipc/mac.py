"""The MAC of what the run's own processes write to its shared memory.

Ring records (``ipc/ring.py``) and weight versions (``ipc/weights.py``) carry
a 16-byte AES-256-GMAC tag under a secret key that the segment's creator
draws (``new_key``) and hands to the other side over the spawn pipe; it is
never stored in shared memory or on disk (docs/design/ipc.md "Authentication").
GMAC runs at memory speed with AES-NI and PCLMULQDQ, where the keyed BLAKE2b and
HMAC-SHA256 of ``hashlib`` run at about the speed of a whole
``multiprocessing.Queue`` transfer (BENCHMARKS.md).
"""

from __future__ import annotations

import hmac
import os
import struct

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG_BYTES = 16
KEY_BYTES = 32
_NONCE = struct.Struct("<Iq")


def new_key() -> bytes:
  """A fresh secret key (one per segment, so nonces never repeat)."""
  return os.urandom(KEY_BYTES)


class Mac:
  """GMAC of a payload at a (``stream``, ``index``) position.

  The pair is the nonce, so it must never repeat under one key: a ring
  uses (lane, sequence number), the weight slot (publish count, version).
  The tag therefore also binds the payload to that position.
  """

  def __init__(self, key: bytes):
    if len(key) != KEY_BYTES:
      raise ValueError(f"A MAC key has {KEY_BYTES} bytes, got {len(key)}; "
                       "pass the .key of the segment's creator.")
    self._encrypt = AESGCM(key).encrypt

  def tag(self, stream: int, index: int, payload) -> bytes:
    """The 16-byte tag of ``payload`` (bytes-like) at (stream, index)."""
    return self._encrypt(_NONCE.pack(stream, index), b"", payload)

  def verify(self, stream: int, index: int, payload, tag: bytes) -> bool:
    """Whether ``tag`` is ``payload``'s at (stream, index); constant time."""
    return hmac.compare_digest(self._encrypt(_NONCE.pack(stream, index), b"",
                                             payload), tag)
