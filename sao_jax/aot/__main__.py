r"""Check a run against a TPU slice before renting it (docs/design/pods.md
"Checking before renting").

  python -m sao_jax.aot --config=configs/smollm2.py --topology=v5e-8

Compiles every program the run compiles (SFT step if any, critic warm-up
step, SAO step, the sampler's prefill and decode chunk) for the slice's
compile-only devices, without weights, and prints one JSON line per program
(per-chip memory against HBM, FLOPs, the run's own estimate, a verdict), one
of sizes (weight slot, KV cache), the decode roofline and, for each sampler
program, the most slots it fits (a search, compiling, up to --max_slots;
--nosearch_slots skips it). With sampler.chips the sampler's programs compile over its whole
block (sampler.mesh.tensor 0, auto). Exits 1 naming each program that does
not fit, by how much, and what to change. Needs libtpu (pip install -e
'.[tpu]'); no TPU.
"""

from __future__ import annotations

import json
import sys
from typing import Sequence

from absl import app
from absl import flags
from ml_collections import config_flags

from sao_jax import config_validation
from sao_jax.aot import check as check_lib
from sao_jax.aot import sampler_sizing
from sao_jax import tpu_topology as topo_lib

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (e.g. configs/smollm2.py).",
    lock_config=False, accept_new_attributes=True)
_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "Cloud TPU slice, e.g. v5e-8, v6e-8, v5p-64, v4-32 "
    "(default: the slice named in sampler.chips).")
_NUM_SLICES = flags.DEFINE_integer(
    "num_slices", 1, "Slices joined over the data-centre network.")
_SEARCH_SLOTS = flags.DEFINE_bool(
    "search_slots", True, "Also search, compiling, the most "
    "sampler.num_slots each sampler program fits (a few compiles each; "
    "--nosearch_slots: the config's slots only).")
_MAX_SLOTS = flags.DEFINE_integer(
    "max_slots", sampler_sizing.MAX_SLOTS,
    "The slots search compiles no more slots than this.", lower_bound=1)
_PROGRAMS = flags.DEFINE_list(
    "programs", [], "Only these programs (default: all the run compiles): "
    + ", ".join(check_lib.PROGRAMS) + ".")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  topology = _TOPOLOGY.value or str(config.sampler.chips).rpartition(":")[0]
  if not topology or topology.lower() == "gpu":
    sys.exit("--topology is required (e.g. --topology=v5e-8).")
  try:  # A mistyped slice is named at once, before libtpu loads.
    topo_lib.parse(topology)
  except topo_lib.TopologyError as e:
    sys.exit(str(e))
  ok, why = check_lib.compile_devices_ok()
  if not ok:
    sys.exit(f"Cannot compile for TPUs here: {why}")
  try:
    reports = check_lib.check(config, topology, _NUM_SLICES.value,
                              tuple(_PROGRAMS.value), _SEARCH_SLOTS.value,
                              _MAX_SLOTS.value)
  except (config_validation.ConfigError, topo_lib.TopologyError,
          ValueError) as e:
    sys.exit(str(e))
  for report in reports:
    print(json.dumps(report), flush=True)
  bad = check_lib.failures(reports)
  if bad:
    sys.exit("Does not fit:\n" + "\n".join(bad))


if __name__ == "__main__":
  app.run(main)
