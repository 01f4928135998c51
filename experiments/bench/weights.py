r"""Weight publication at real size: publish + adopt through the weight slot.

The trainer publishes the policy to the shared-memory `WeightSlot`
(`sao_jax.ipc.weights`) and the sampler adopts it: reads the newest complete
version (a copy out of shared memory) and places it on its device
(`jax.device_put`). This times both for the parameter tree of
`configs/<--model>.py` (default `smollm2`: 134,515,008 float32 parameters,
272 leaves, 538 MB), against a same-process `memcpy` of the same number of
bytes (`np.copyto` between two preallocated flat buffers). An ideal slot costs
two memcpys (one in, one out).

The tree has the model's shapes and dtypes filled with a constant (copy speed
does not depend on values), so no checkpoint is needed. Writer and reader run
in one process, alternating with the memcpy within each repetition; figures
are medians over `--repeats` after one warm-up.

  .venv/bin/python experiments/bench/weights.py --repeats 5

One JSON line per run and per figure; the last line is the summary with
{"publish_s", "read_s", "adopt_s", "memcpy_s", "publish_plus_adopt_over_memcpy",
"load_1min"}.
"""

import argparse
import json
import os
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.ipc import weights as weights_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Transformer
from sao_jax.train import setup as setup_lib

import loop_setup  # experiments/bench/ (the script's folder)


def model_tree(config_name: str) -> tuple[ModelConfig, dict]:
  """Host numpy params shaped like `configs/<config_name>.py`'s model."""
  cfg = setup_lib.model_config(
      loop_setup.import_config(config_name).get_config())
  x = jnp.zeros((1, 1), jnp.int32)
  shapes = nn.unbox(jax.eval_shape(
      lambda: Transformer(cfg).init(jax.random.PRNGKey(0), x, x, x == 0)
  )["params"])
  return cfg, jax.tree.map(lambda s: np.full(s.shape, 0.5, s.dtype), shapes)


def _timed(fn) -> tuple[float, object]:
  t0 = time.perf_counter()
  out = fn()
  return time.perf_counter() - t0, out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="smollm2",
                      help="configs/<name>.py whose model tree is published.")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()

  cfg, tree = model_tree(args.model)
  leaves = jax.tree.leaves(tree)
  nbytes = sum(x.nbytes for x in leaves)
  src = np.full(nbytes, 1, np.uint8)
  dst = np.empty_like(src)
  times = {"publish": [], "read": [], "adopt": [], "memcpy": []}
  with weights_lib.WeightSlot.create(tree) as slot, \
      weights_lib.WeightSlot.attach(slot.name, tree) as reader:
    for r in range(args.repeats + 1):
      t_memcpy, _ = _timed(lambda: np.copyto(dst, src))
      t_pub, _ = _timed(lambda r=r: slot.publish(tree, r))
      t_read, got = _timed(lambda: reader.read(timeout=10.0))
      version, params = got
      assert version == r
      t_put, placed = _timed(lambda p=params: jax.block_until_ready(
          jax.device_put(p)))
      del placed
      if r == 0:
        continue  # Warm-up (page faults of fresh buffers).
      run = {"publish": t_pub, "read": t_read, "adopt": t_read + t_put,
             "memcpy": t_memcpy}
      for k, v in run.items():
        times[k].append(v)
      print(json.dumps({"run": r - 1, **{f"{k}_s": round(v, 4)
                                         for k, v in run.items()}}),
            flush=True)
  med = {k: statistics.median(v) for k, v in times.items()}
  for k, v in times.items():
    print(json.dumps({"figure": f"{k}_s", "median": round(med[k], 4),
                      "min": round(min(v), 4), "max": round(max(v), 4),
                      "runs": len(v)}), flush=True)
  print(json.dumps({
      "model": args.model, "num_params": cfg.num_params(),
      "leaves": len(leaves), "bytes": nbytes,
      **{f"{k}_s": round(v, 4) for k, v in med.items()},
      "memcpy_gb_per_s": round(nbytes / med["memcpy"] / 1e9, 2),
      "publish_plus_adopt_over_memcpy": round(
          (med["publish"] + med["adopt"]) / med["memcpy"], 2),
      "load_1min": round(os.getloadavg()[0], 2),
      "jax": jax.__version__}), flush=True)


if __name__ == "__main__":
  main()
