"""Sizing the sampler on a slice: a decode roofline and the most slots that
fit (`python -m sao_jax.aot`, docs/design/pods.md "Checking before renting").

A decode step reads every weight and every cache slot it holds once, so its
time is at least the bytes on a chip over the chip's HBM bandwidth, and at
least its FLOPs over the chip's peak (`tpu_topology.Family`). The bytes are
XLA's per-chip arguments of the compiled decode chunk (its shares of the
weights and of the cache: dense decode attention reads every allocated
slot); the FLOPs are the matmuls', 2 x parameters per row and token, split
evenly over the sampler's chips (attention's are left out). XLA's own
`cost_analysis` counts a scanned layer's body once, so it cannot give the
whole model's figures. Each decode step gives every slot one token.

`max_slots` searches (compiling, not estimating) the largest
`sampler.num_slots` whose program fits: doubling from the configured count
while it fits, then bisecting, in multiples of the rows' shards.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

from sao_jax import tpu_topology as topo_lib
from sao_jax.models.config import ModelConfig
from sao_jax.sampler import rollout

# The search never compiles more slots than this (`--max_slots`'s default).
MAX_SLOTS = 4096


def decode_roofline(report: dict[str, Any], config: Any, mcfg: ModelConfig,
                    topo: topo_lib.Topology) -> dict[str, Any]:
  """The module docstring's bound for a compiled ``sampler_decode``
  ``report`` (its ``argument_bytes`` and ``devices``)."""
  spec = topo.spec
  slots = rollout.num_slots(config)
  read_s = report["argument_bytes"] / spec.hbm_bytes_per_s
  flops = 2.0 * mcfg.num_params() * slots / report["devices"]
  compute_s = flops / spec.peak_bf16_flops
  step_s = max(read_s, compute_s)
  episodes = math.ceil(int(config.train.batch_size) / topo.num_hosts)
  new_tokens = rollout.RolloutLimits.from_config(
      config).max_new_tokens_per_turn
  return {
      "program": "sampler_decode_roofline", "topology": topo.name,
      "slots": slots, "hbm_bytes_per_s": spec.hbm_bytes_per_s,
      "peak_bf16_flops": spec.peak_bf16_flops,
      "bytes_per_step_per_chip": report["argument_bytes"],
      "flops_per_step_per_chip": flops,
      "step_s_at_least": step_s,
      "bound": "HBM bandwidth" if read_s >= compute_s else "FLOPs",
      "decode_tokens_per_s_per_host_at_most": slots / step_s,
      # One turn of max_new_tokens for this host's share of a train batch,
      # `slots` episodes at a time (prefill and environment time left out).
      "train_batch_decode_s_per_host_at_least": (
          math.ceil(episodes / slots) * new_tokens * step_s),
      "episodes_per_host": episodes}


def max_slots(config: Any, program: str, row_shards: int,
              fits: Callable[[Any], bool],
              known: dict[int, bool] | None = None,
              cap: int = MAX_SLOTS) -> dict[str, Any]:
  """The largest ``sampler.num_slots`` (a multiple of ``row_shards`` and of
  ``sampler.n_rollouts``) up to ``cap`` for which ``fits(config_with_it)``
  holds; ``known``: verdicts already had (the configured slots' own
  compile), not asked of ``fits`` again."""
  step = math.lcm(int(row_shards), int(config.sampler.n_rollouts))
  if cap < step:
    raise ValueError(f"--max_slots={cap}: the search needs at least {step} "
                     "slots (a multiple of the rows' shards and of "
                     "sampler.n_rollouts); raise it.")
  tried: dict[int, bool] = dict(known or {})

  def check(n: int) -> bool:
    if n not in tried:
      trial = copy.deepcopy(config)
      trial.sampler.num_slots = n
      tried[n] = bool(fits(trial))
    return tried[n]

  cap = cap // step * step
  start = max(step, min(rollout.num_slots(config), cap) // step * step)
  lo, hi = 0, None  # lo fits (0: none yet), hi does not.
  n = start
  while check(n):  # Doubling, the cap itself last.
    lo = n
    if n == cap:
      break
    n = min(2 * n, cap)
  if lo == 0:  # The configured count does not fit: come down.
    hi = start
    n = start // 2 // step * step
    while n >= step and not check(n):
      hi, n = n, n // 2 // step * step
    lo = n if n >= step else 0  # The loop stopped at a fit, or at none.
  else:
    hi = None if lo == cap else n
  while hi is not None and hi - lo > step:
    mid = (lo + hi) // 2 // step * step
    if mid in (lo, hi):
      break
    if check(mid):
      lo = mid
    else:
      hi = mid
  return {"program": f"{program}_slots", "max_slots": lo,
          "first_not_fitting": hi, "cap": cap,
          "compiles": len(tried) - len(known or {}),
          "tried": {str(k): v for k, v in sorted(tried.items())}}
