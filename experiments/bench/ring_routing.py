r"""Trajectory records with and without routed experts, through the ring.

The size of one trajectory record (the sampler's ``trajectory.encode``) per
token, for a dense policy and with the routed experts of a mixture-of-experts
policy (uint16 [T, M, k]: M MoE layers, k experts a token; ``MODELS``), and
the ring's end-to-end rate on such records (encode, write, read, decode;
on an authenticated ring, the trainer's: AES-GMAC per record;
tokens/s, medians over the repeats, the arms alternating within each
repetition). One JSON line per model.

  .venv/bin/python experiments/bench/ring_routing.py --repeats 5
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from sao_jax.data import trajectory as codec
from sao_jax.ipc import ring

_CTX = mp.get_context("spawn")


def _lane_bytes(size: int) -> int:
  """A lane of >= 4 records and >= 8 MiB, a multiple of 64 bytes."""
  return max(8 << 20, 4 * (size + 4096) // 64 * 64 + 64)


# (MoE layers M, experts a token k): configs/moe_replay.py's policy and
# Qwen3-30B-A3B (configs/qwen3_30b_a3b.py, HF config: 48 layers, top-8).
MODELS = {"dense": (0, 0), "moe_replay": (4, 2),
                   "qwen3_30b_a3b": (48, 8)}


def _routed_trajectory(tokens: int, m: int, k: int) -> codec.Trajectory:
  """A ``tokens``-long episode (half actions), experts [T, m, k] if m."""
  rng = np.random.default_rng(0)
  act = (np.arange(tokens) >= tokens // 2).astype(np.uint8)
  return codec.Trajectory(
      prompt_id=1, tokens=rng.integers(0, 151_936, tokens),
      action_mask=act, rollout_logp=-rng.random(tokens) * act,
      policy_version=np.where(act == 1, 3, codec.NO_VERSION),
      rewards=np.zeros(tokens), task="reasoning_gym",
      routed_experts=(rng.integers(0, 128, (tokens, m, k)) if m else None))


def _routing_producer(name, key, traj, count, ready, go):
  with ring.RingWriter(name, lane=0, timeout=120.0, key=key) as w:
    w.write(*codec.encode(traj))  # Untimed warm-up record.
    ready.set()
    go.wait()
    for _ in range(count):
      w.write(*codec.encode(traj))


def run_routing(traj: codec.Trajectory, count: int) -> float:
  """Tokens/s of ``count`` records through the ring (encode -> decode)."""
  size = sum(memoryview(b).nbytes for b in codec.encode(traj))
  with ring.RingReader.create(1, _lane_bytes(size), authenticate=True) as r:
    ready, go = _CTX.Event(), _CTX.Event()
    p = _CTX.Process(target=_routing_producer,
                     args=(r.name, r.key, traj, count, ready, go))
    p.start()
    codec.decode(r.read(timeout=120.0).data)
    ready.wait(120)
    t0 = time.perf_counter()
    go.set()
    for _ in range(count):
      got = codec.decode(r.read(timeout=120.0).data)
    dt = time.perf_counter() - t0
    assert got.length == traj.length
    del got
    p.join(60)
  return traj.length * count / dt


def routing(repeats: int, tokens: int, total_mib: int) -> None:
  """One JSON line per model: record bytes per token and ring tokens/s."""
  trajs = {name: _routed_trajectory(tokens, m, k)
           for name, (m, k) in MODELS.items()}
  nbytes = {name: sum(memoryview(b).nbytes for b in codec.encode(t))
            for name, t in trajs.items()}
  counts = {name: max(8, (total_mib << 20) // n) for name, n in nbytes.items()}
  runs = {name: [] for name in trajs}
  for _ in range(repeats):
    for name, traj in trajs.items():
      runs[name].append(run_routing(traj, counts[name]))
  dense = statistics.median(runs["dense"])
  for name, (m, k) in MODELS.items():
    med = statistics.median(runs[name])
    print(json.dumps({
        "bench": "ring_routing", "model": name, "moe_layers": m, "top_k": k,
        "tokens": tokens, "record_bytes": nbytes[name],
        "bytes_per_token": round(nbytes[name] / tokens, 3),
        "bytes_per_token_vs_dense": round(nbytes[name] / nbytes["dense"], 2),
        "records": counts[name], "tokens_per_s": round(med),
        "runs": [round(v) for v in runs[name]],
        "tokens_per_s_vs_dense": round(med / dense, 3),
        "load_1m": os.getloadavg()[0]}), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--tokens", type=int, default=8192,
                      help="tokens of the trajectory record")
  parser.add_argument("--total_mib", type=int, default=256,
                      help="MiB moved per model and repetition (>= 8 records)")
  args = parser.parse_args()
  routing(args.repeats, args.tokens, args.total_mib)


if __name__ == "__main__":
  main()
