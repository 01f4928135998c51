"""Compile a whole run for a TPU slice from any machine; say what fits.

``check(config, topology)`` lays the run's mesh over libtpu's compile-only
devices of the slice (the trainer's and the sampler's own chips when
``sampler.chips`` splits the hosts, ``sampler/devices.py``), compiles every
program of ``aot.programs`` without weights and returns one report per
program: XLA's per-chip memory (arguments, outputs, aliased, temporaries,
peak) against the chip's HBM, its FLOP count, ``train/memory.py``'s estimate
beside it, and a verdict (docs/design/pods.md "Checking before renting").
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

from absl import logging

from sao_jax import config_validation
from sao_jax import sharding
from sao_jax.aot import programs as programs_lib
from sao_jax.aot import sampler_sizing as sizing_lib
from sao_jax import tpu_topology as topo_lib
from sao_jax.sampler import devices as devices_lib
from sao_jax.sampler import precision

_GIB = 2**30
LOOP_NOTE = ("XLA counts a loop body (lax.while_loop / scan) once, so this is "
             "one iteration's FLOPs, not the whole program's")


@dataclasses.dataclass
class Placement:
  """Which compile-only devices each process of the run gets."""

  trainer: list[Any]
  sampler: list[Any]
  trainer_label: str
  sampler_label: str
  shared: bool = False  # The sampler's chip is also the trainer's.


def place(config: Any, topo: topo_lib.Topology,
          num_slices: int = 1) -> Placement:
  """The trainer's and the sampler's devices on ``topo``.

  With a TPU ``sampler.chips`` split each gets its own block of every host
  (a single-host trainer compiles for its block as its own topology, as
  libtpu presents it to the process); without one the sampler shares the
  trainer's first chip (as it would a GPU).
  """
  split = devices_lib.parse_chips(str(config.sampler.chips))
  if split is not None and split.kind == "tpu":
    if split.topology.name != topo.name:
      raise ValueError(
          f"config.sampler.chips={config.sampler.chips!r} splits a "
          f"{split.topology.name} but the topology is {topo.name}; make them "
          "the same slice.")
    blocks = split.blocks()
    grid = lambda b: "x".join(map(str, b))
    if topo.num_hosts == 1 and num_slices == 1:
      trainer = topo_lib.compile_devices(topo.family, blocks["trainer"],
                                         host=blocks["trainer"])
    else:
      everything = topo_lib.compile_devices(topo.family, topo.shape,
                                            num_slices=num_slices)
      mine = set(split.trainer_chips())
      trainer = [d for d in everything if topo_lib.local_chip(d, topo) in mine]
    sampler = topo_lib.compile_devices(topo.family, blocks["sampler"],
                                       host=blocks["sampler"])
    return Placement(
        trainer, sampler,
        f"chips {list(split.trainer_chips())} of each host "
        f"({grid(blocks['trainer'])} per host, {len(trainer)} in all)",
        f"its {grid(blocks['sampler'])} block {list(split.sampler)} of each "
        "host (sampler.mesh over it)")
  everything = topo_lib.compile_devices(topo.family, topo.shape,
                                        num_slices=num_slices)
  return Placement(everything, everything[:1],
                   f"all {len(everything)} chips",
                   "chip 0, shared with the trainer (no sampler.chips split)",
                   shared=True)


_SCALE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = r"([\d.]+)([KMGT]?)"


def _bytes(number: str, unit: str) -> int:
  return int(float(number) * _SCALE[unit])


def _exceeded(message: str) -> int | None:
  """Bytes over HBM from XLA's RESOURCE_EXHAUSTED message, if it says."""
  match = re.search(rf"Exceeded hbm capacity by {_SIZE}", message)
  if match:
    return _bytes(*match.groups())
  match = re.search(rf"\({_SIZE}\) exceeds available HBM \({_SIZE}\)",
                    message)
  if match:
    need, have = _bytes(*match.groups()[:2]), _bytes(*match.groups()[2:])
    return need - have
  return None


def advice(config: Any, role: str, mesh_shards: int, devices: int) -> str:
  """What to change when ``role``'s program does not fit."""
  m = config.model
  tips = []
  if str(m.dtype) == "float32":
    tips.append("model.dtype=bfloat16")
  if role == "trainer":
    if str(m.remat_policy) == "none":
      tips.append("model.remat_policy=full")
    if str(m.param_dtype) == "float32":
      tips.append("model.param_dtype=bfloat16")
    if mesh_shards < devices:
      tips.append("shard the state over all chips (mesh.data=1, "
                  "mesh.fsdp=-1) or use mesh.tensor")
    tips.append("a smaller train.batch_size or train.max_seq_len")
  else:
    if precision.param_dtype(config, m) == "float32":
      tips.append("sampler.param_dtype=bfloat16")
    tips.append("fewer sampler.num_slots (or sampler.batch_size)")
    tips.append("a shorter sampler.max_total_tokens")
    tips.append("the sampler over more chips (sampler.chips, "
                "sampler.mesh.tensor=-1)")
  tips.append("a larger topology")
  return "; ".join(tips)


def _memory(compiled: Any) -> dict[str, int]:
  mem = compiled.memory_analysis()
  out = {
      "argument_bytes": int(mem.argument_size_in_bytes),
      "output_bytes": int(mem.output_size_in_bytes),
      "alias_bytes": int(mem.alias_size_in_bytes),
      "temp_bytes": int(mem.temp_size_in_bytes),
      "code_bytes": int(mem.generated_code_size_in_bytes),
  }
  peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
  out["peak_bytes"] = peak or (out["argument_bytes"] + out["output_bytes"] -
                               out["alias_bytes"] + out["temp_bytes"] +
                               out["code_bytes"])
  return out


def _flops(compiled: Any) -> float | None:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  flops = (cost or {}).get("flops")
  return None if flops is None else float(flops)


def compile_one(program: programs_lib.Program, topo: topo_lib.Topology,
                config: Any, label: str, mesh: Any | None = None
                ) -> dict[str, Any]:
  """Compiles one program and reports on it (see the module docstring)."""
  hbm = topo.hbm_bytes
  report: dict[str, Any] = {
      "program": program.name, "role": program.role, "topology": topo.name,
      "chips": label, "devices": program.devices,
      "mesh": dict(mesh.shape) if mesh is not None else None,
      "hbm_bytes": hbm, "estimate_bytes": int(program.estimate),
      "estimate_of": program.estimate_of}
  shards = (int(mesh.shape["fsdp"]) * int(mesh.shape["tensor"])
            if mesh is not None else 1)
  t0 = time.perf_counter()
  lowered = program.lower()
  loops = "stablehlo.while" in lowered.as_text()
  try:
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
      raise
    over = _exceeded(text)
    report.update(fits=False, compile_s=round(time.perf_counter() - t0, 1),
                  over_bytes=over, xla_error=text.splitlines()[0][:400])
  else:
    report.update(_memory(compiled))
    report["compile_s"] = round(time.perf_counter() - t0, 1)
    report["flops"] = _flops(compiled)
    report["flops_note"] = LOOP_NOTE if loops else "whole program"
    report["peak_frac"] = round(report["peak_bytes"] / hbm, 4)
    report["fits"] = report["peak_bytes"] <= hbm
    over = report["peak_bytes"] - hbm
  if report["fits"]:
    report["verdict"] = (f"fits: {report['peak_bytes'] / _GIB:.2f} of "
                         f"{hbm / _GIB:.0f} GiB per chip")
  else:
    at_least = "" if "peak_bytes" in report else "at least "
    by = f"over by {at_least}{over / _GIB:.2f} GiB" if over else "over HBM"
    report["verdict"] = (
        f"{program.name} does not fit {topo.name} ({program.role}, "
        f"{label}): {by} of {hbm / _GIB:.0f} GiB per chip. Change: "
        f"{advice(config, program.role, shards, program.devices)}.")
  return report


PROGRAMS = ("sft_step", "critic_warmup_step", "sao_step", "sampler_prefill",
            "sampler_decode")


def check(config: Any, topology: str, num_slices: int = 1,
          only: tuple[str, ...] = (), search_slots: bool = False,
          max_slots: int = sizing_lib.MAX_SLOTS) -> list[dict[str, Any]]:
  """One report per program the run compiles (those named in ``only``, if
  given), then one of sizes, the decode roofline and, with
  ``search_slots``, the most slots each sampler program fits, up to
  ``max_slots`` (`sampler_sizing.py`)."""
  unknown = sorted(set(only) - set(PROGRAMS))
  if unknown:
    raise ValueError(f"unknown programs {unknown}; known: {PROGRAMS}.")
  wanted = lambda p: not only or p.name in only
  config_validation.validate_config(config)
  programs_lib.check_explicit_lengths(config)
  topo = topo_lib.parse(topology)
  placement = place(config, topo, num_slices)
  config_validation.validate_mesh(config, len(placement.trainer))
  mcfg = programs_lib.model_config(config)
  mesh = sharding.make_mesh(config.mesh, placement.trainer)
  rules = sharding.normalize_rules(config.mesh.rules)
  reports = []
  # Built outside the mesh context (their eager set-up runs on the host);
  # lowered inside it, where the models' logical constraints take effect.
  for program in filter(wanted, programs_lib.train_programs(
      config, mcfg, mesh, rules)):
    with sharding.mesh_rules(mesh, rules):
      reports.append(compile_one(program, topo, config,
                                 placement.trainer_label, mesh))
  sampler_mcfg = precision.sampler_model_config(config, mcfg)
  shapes = programs_lib.sampler_shapes(config)
  sizing = []
  for program in filter(wanted, programs_lib.sampler_programs(
      config, sampler_mcfg, placement.sampler)):
    report = compile_one(program, topo, config, placement.sampler_label,
                         program.mesh)
    reports.append(report)
    if program.name == "sampler_decode" and report["fits"]:
      sizing.append(sizing_lib.decode_roofline(report, config, sampler_mcfg,
                                               topo))
    if search_slots:  # The configured slots' verdict is this report's.
      sizing.append(_search_slots(program, config, sampler_mcfg, placement,
                                  topo, {shapes["slots"]: report["fits"]},
                                  max_slots))
  if placement.shared:
    reports.extend(_shared_chip(reports, topo, config))
  est = programs_lib.memory.estimate_memory(
      sampler_mcfg, kv_batch=shapes["slots"], kv_len=shapes["cache_len"],
      critic=False)
  reports.append({
      "program": "sizes", "topology": topo.name,
      "params": mcfg.num_params(),
      "sampler_param_dtype": sampler_mcfg.param_dtype,
      "weight_slot_bytes": programs_lib.weight_slot_bytes(sampler_mcfg),
      "weight_slot_of": "host shared memory, two buffers of the policy in "
                        "sampler.param_dtype",
      "kv_cache_bytes": est.kv_cache, **shapes,
      "fits": all(r["fits"] for r in reports)})
  return reports + sizing


def _search_slots(program: programs_lib.Program, config: Any,
                  sampler_mcfg: Any, placement: Placement,
                  topo: topo_lib.Topology,
                  known: dict[int, bool], cap: int) -> dict[str, Any]:
  """`sampler_sizing.max_slots` for ``program`` up to ``cap`` slots, each
  trial compiled but those in ``known`` (slots -> the verdict already
  had)."""

  def fits(trial: Any) -> bool:
    again = next(p for p in programs_lib.sampler_programs(
        trial, sampler_mcfg, placement.sampler) if p.name == program.name)
    return compile_one(again, topo, trial, placement.sampler_label,
                       again.mesh)["fits"]

  shape = dict(program.mesh.shape)
  logging.info("Searching the most slots %s fits on %s.", program.name,
               topo.name)
  return sizing_lib.max_slots(config, program.name,
                              shape["data"] * shape["fsdp"], fits, known,
                              cap)


def _shared_chip(reports: list[dict[str, Any]], topo: topo_lib.Topology,
                 config: Any) -> list[dict[str, Any]]:
  """Trainer and sampler on one chip: their largest peaks must fit together
  (an upper bound: each program's peak includes its own temporaries)."""
  peaks = {role: max((r.get("peak_bytes", 0) for r in reports
                      if r["role"] == role), default=0)
           for role in ("trainer", "sampler")}
  if not all(peaks.values()):
    return []
  total, hbm = sum(peaks.values()), topo.hbm_bytes
  report = {"program": "shared_chip", "role": "both", "topology": topo.name,
            "peak_bytes": total, "hbm_bytes": hbm, "fits": total <= hbm,
            "trainer_peak_bytes": peaks["trainer"],
            "sampler_peak_bytes": peaks["sampler"]}
  if report["fits"]:
    report["verdict"] = (f"fits: trainer and sampler together "
                         f"{total / _GIB:.2f} of {hbm / _GIB:.0f} GiB on chip 0"
                         " (on a TPU VM the sampler needs chips of its own: "
                         "sampler.chips)")
  else:
    report["verdict"] = (
        f"trainer and sampler do not fit chip 0 of {topo.name} together: "
        f"{peaks['trainer'] / _GIB:.2f} + {peaks['sampler'] / _GIB:.2f} GiB, "
        f"over by {(total - hbm) / _GIB:.2f} GiB of {hbm / _GIB:.0f}. Change:"
        f" give the sampler its own chips (sampler.chips='{topo.name}:...'); "
        f"{advice(config, 'sampler', 1, 1)}.")
  return [report]


def failures(reports: list[dict[str, Any]]) -> list[str]:
  """The verdicts of the programs that do not fit."""
  return [r["verdict"] for r in reports
          if r["program"] != "sizes" and not r.get("fits", True)]


def compile_devices_ok() -> tuple[bool, str]:
  """Whether this machine can compile for TPUs (libtpu loads)."""
  return topo_lib.libtpu_available()


