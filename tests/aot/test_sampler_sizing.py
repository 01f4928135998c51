"""aot/sampler_sizing.py: the slots search (against a stand-in for "compile
and see whether it fits") and the decode roofline's arithmetic. The search
through real compiles is `python -m sao_jax.aot --search_slots`
(BENCHMARKS.md "The sampler's copy in bfloat16")."""

import math

import pytest

from configs import base
from sao_jax import tpu_topology as topo_lib
from sao_jax.aot import sampler_sizing
from sao_jax.models.config import ModelConfig


def _config(slots, n_rollouts=1):
  config = base.get_config()
  config.sampler.num_slots = slots
  config.sampler.n_rollouts = n_rollouts
  return config


def _fits_below(limit, seen):
  def fits(trial):
    seen.append(int(trial.sampler.num_slots))
    return trial.sampler.num_slots <= limit
  return fits


@pytest.mark.parametrize("start,limit,shards,want", [
    (16, 100, 1, 100),   # Doubles to 128, bisects down to 100.
    (16, 100, 8, 96),    # Multiples of the rows' 8 shards.
    (64, 40, 1, 40),     # The configured 64 does not fit: halves, bisects.
    (16, 10_000, 1, 4096),  # Stops at the cap.
    (8, 4, 8, 0),        # Not even one shard's rows fit.
])
def test_the_search_finds_the_boundary(start, limit, shards, want):
  seen = []
  got = sampler_sizing.max_slots(_config(start), "sampler_decode", shards,
                                 _fits_below(limit, seen))
  assert got["max_slots"] == want, got
  assert got["compiles"] == len(seen) == len(set(seen))  # None twice.
  assert all(n % shards == 0 for n in seen)
  if want and want < 4096:
    assert got["first_not_fitting"] - want <= shards
  # Logarithmic, not a scan: at most two passes of log2(cap) compiles.
  assert len(seen) <= 2 * math.log2(4096) + 2


def test_the_search_reuses_the_verdicts_it_is_given():
  # The configured 16 slots were compiled already (their report): the
  # search asks only of the slots it has no verdict for.
  seen = []
  got = sampler_sizing.max_slots(_config(16), "sampler_decode", 1,
                                 _fits_below(100, seen), known={16: True})
  assert got["max_slots"] == 100 and 16 not in seen, (got, seen)
  assert got["compiles"] == len(seen) and got["tried"]["16"] is True


def test_the_search_keeps_groups_whole():
  seen = []
  got = sampler_sizing.max_slots(_config(12, n_rollouts=3), "sampler_decode",
                                 2, _fits_below(50, seen))
  assert got["max_slots"] == 48 and all(n % 6 == 0 for n in seen), got


def test_the_search_stops_at_the_cap_it_is_given():
  # --max_slots: a configured count above the cap starts the search at it.
  for start, cap, want, tried in ((16, 48, 48, [16, 32, 48]),
                                  (128, 40, 40, [40])):
    seen = []
    got = sampler_sizing.max_slots(_config(start), "sampler_decode", 8,
                                   _fits_below(10_000, seen), cap=cap)
    assert (got["max_slots"], got["cap"]) == (want, cap), got
    assert got["first_not_fitting"] is None and sorted(seen) == tried, got
  with pytest.raises(ValueError, match="--max_slots=4: .* at least 8"):
    sampler_sizing.max_slots(_config(16), "sampler_decode", 8,
                             _fits_below(100, []), cap=4)


def test_the_roofline_is_the_slower_of_bytes_and_flops():
  config = _config(64)
  config.train.batch_size = 512
  config.sampler.max_new_tokens = 100
  config.sampler.max_total_tokens = 200
  topo = topo_lib.parse("v5p-64")  # 8 hosts.
  mcfg = ModelConfig.tiny(vocab_size=256)
  bytes_ = 2.765e12 * 0.001  # 1 ms of v5p HBM bandwidth a step.
  got = sampler_sizing.decode_roofline(
      {"argument_bytes": bytes_, "devices": 2}, config, mcfg, topo)
  flops = 2 * mcfg.num_params() * 64 / 2
  assert got["flops_per_step_per_chip"] == flops
  assert flops / 459e12 < 0.001 and got["bound"] == "HBM bandwidth"
  assert got["step_s_at_least"] == pytest.approx(0.001)
  assert got["decode_tokens_per_s_per_host_at_most"] == pytest.approx(64_000)
  # 512 / 8 hosts = 64 episodes: one wave of 64 slots, 100 tokens.
  assert got["episodes_per_host"] == 64
  assert got["train_batch_decode_s_per_host_at_least"] == pytest.approx(0.1)
