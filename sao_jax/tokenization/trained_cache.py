"""A content-addressed store of trained SentencePiece models.

Training a run's tokenizer (`tokenizer.train_tokenizer`) is deterministic:
the same texts, options, seed and SentencePiece version give a
byte-identical model. So a trained model can be kept under the hash of all
of those and handed back, unchanged, to the next run that would train the
same one: sweeps, ablation arms and test suites train the same tokenizer
many times over (3-4 CPU-seconds each for the base config's corpus).

It is off unless `SAO_JAX_TOKENIZER_CACHE` names a directory (made if
missing). Entries are written to a temporary file and renamed, so a reader
never sees half of one; an entry that does not load as a SentencePiece model
is treated as missing (trained again and rewritten). Nothing else reads the
directory: delete it at any time.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Iterable

from absl import logging
import sentencepiece as spm

ENV_VAR = "SAO_JAX_TOKENIZER_CACHE"
_FORMAT = b"sao_jax trained tokenizer v1\0"


def key(texts: Iterable[str], options: dict[str, Any], seed: int) -> str:
  """The hash of everything the trained model depends on.

  Args:
    texts: the training sentences, in order.
    options: `SentencePieceTrainer.train` keyword arguments (all but the
      input iterator and the model writer).
    seed: SentencePiece's random generator seed.
  """
  h = hashlib.sha256(_FORMAT)
  h.update(f"{spm.__version__}\0{seed}\0".encode())
  h.update(repr(sorted(options.items())).encode())
  for text in texts:
    data = text.encode("utf-8", "surrogatepass")
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
  return h.hexdigest()


def directory() -> str | None:
  """The cache directory from `SAO_JAX_TOKENIZER_CACHE`, or None (off)."""
  return os.environ.get(ENV_VAR) or None


def lookup(digest: str) -> bytes | None:
  """The stored model proto for `digest`, or None (off, missing, unusable)."""
  root = directory()
  if root is None:
    return None
  path = os.path.join(root, f"{digest}.model")
  try:
    with open(path, "rb") as f:
      proto = f.read()
    spm.SentencePieceProcessor(model_proto=proto)  # Loads, or raises.
  except FileNotFoundError:
    return None
  except (OSError, RuntimeError) as e:
    logging.warning("Ignoring the unusable cached tokenizer %s (%s); it is "
                    "trained again.", path, e)
    return None
  logging.info("Tokenizer %s from the cache %s (%s).", digest[:12], root,
               ENV_VAR)
  return proto


def store(digest: str, proto: bytes) -> None:
  """Keeps `proto` under `digest` (no-op when the cache is off)."""
  root = directory()
  if root is None:
    return
  os.makedirs(root, exist_ok=True)
  path = os.path.join(root, f"{digest}.model")
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(proto)
  os.replace(tmp, path)
