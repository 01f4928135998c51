r"""Benchmark: the SAO step at long contexts and depth (issue 25), arm by arm.

Each arm is a set of config overrides (dotted keys), so the reference and the
new paths run side by side in one process:

- ``dense`` (before): dense attention, full-vocab logits, unrolled layers:
  ``model.attention='dense'``, ``model.logits_chunk=0``,
  ``model.scan_layers=False``;
- ``new`` (after): ``model.attention='auto'`` (blockwise on CPU),
  ``model.logits_chunk=2048`` (chunked log-probs, `sao_jax.models.logprobs`),
  ``model.scan_layers=True``;
- ``logits_chunk`` (``--arms`` to add it): the dense arm with chunked
  log-probs only, to see that piece alone.

A model key the tree does not have (a piece not merged yet) is left out and
listed under ``ignored`` in the figure's line. ``--set ARM:KEY=VALUE`` changes
an arm (``--set new:model.logits_chunk=512``).

Figures (``--figures``, comma-separated), one JSON line each with the load:

- ``memory``: compile-only temp memory (XLA ``memory_analysis()``, independent
  of load) of one jitted SAO step (`train.step.make_step`: critic forward,
  ``--critic_updates`` critic updates, one policy update), batch 1 x T for T
  in ``--seqs``; the model of the issue: hidden 256, MLP 1024, 8 heads / 2 kv
  heads of 32, 2 layers, vocab 32,768, remat (``model.remat`` or
  ``model.remat_policy='full'``, whichever the tree has). The last line
  checks the goals: temp(Tmax)/temp(Tmin) <= 1.25 x Tmax/Tmin, temp under
  4 GiB at Tmax. ``--model=hybrid`` (issue 41) takes a Qwen3.5-shaped
  hybrid decoder instead (`hybrid_model`: three Gated DeltaNet layers then
  one gated full-attention layer, its chunked training form), at one
  repeat of that pattern (4 layers).
- ``compile``: seconds to lower and compile that step at ``--layers``
  (``--compile_seq`` tokens), median of ``--compile_repeats``; goal: deepest
  <= 1.5 x shallowest.
- ``smollm2``: `configs/smollm2.py`'s model (SmolLM2-135M, random weights) at
  ``--smollm2_batch`` x ``--smollm2_seq`` (8 x 128): compile seconds, and step
  seconds timed alternately arm after arm (medians of ``--repeats`` after
  ``--warmup``); ``--smollm2_layers`` shrinks it for a smoke run. Every arm
  but ``dense`` takes the config's own ``model.remat_policy``
  ('dots_with_no_batch_dims_saveable'); ``dense`` is the step before issue
  25, which kept every activation (``SMOLLM2_BEFORE``: remat 'none').
- ``packing``: the real loop (`loop.train_and_evaluate`, as
  ``async_vs_sync.py``) on ``configs/longtail.py`` and the quickstart,
  unpacked vs packed (``--pack_arms``, JSON of arm -> overrides; an arm whose
  keys the tree lacks is reported skipped): trainer action tokens per second
  of the whole run and the batches' padding fraction. End to end, so the
  sampler's pace is in it; ``experiments/bench/packing.py`` times the step
  alone on one recorded stream, packed and unpacked.

Every figure (slow on CPU: SmolLM2 compiles for minutes, the loop runs):

  python experiments/bench/long_context.py

A tiny form, seconds (tests/experiments/test_bench_long_context.py runs it):

  python experiments/bench/long_context.py --figures=memory,compile \
      --arms=dense,logits_chunk --set=logits_chunk:model.logits_chunk=64 \
      --seqs=256,512 --vocab=8192 --hidden=64 --layers=1,2 --compile_seq=64 \
      --compile_repeats=1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.train import optim
from sao_jax.train import setup as setup_lib
from sao_jax.train import step as step_lib

ARMS: dict[str, dict[str, Any]] = {
    "dense": {"model.attention": "dense", "model.logits_chunk": 0,
              "model.scan_layers": False},
    "new": {"model.attention": "auto", "model.logits_chunk": 2048,
            "model.scan_layers": True},
    # The chunked log-probs alone (not a default arm): dense attention,
    # unrolled layers.
    "logits_chunk": {"model.attention": "dense", "model.logits_chunk": 2048,
                     "model.scan_layers": False},
}
# SmolLM2's step before issue 25 (the `dense` arm of the smollm2 figure): the
# config kept every activation for the backward.
SMOLLM2_BEFORE = {"model.remat_policy": "none"}
# Remat in either tree: the bool before issue 25, the policy after.
REMAT = {"model.remat": True, "model.remat_policy": "full"}
PACK_ARMS = {"unpacked": {"train.pack": False},
             "packed": {"train.pack": True}}
MIB = 2 ** 20


def emit(figure: str, **values: Any) -> dict[str, Any]:
  """Prints one figure as a JSON line with the machine's load."""
  line = {"figure": figure, **values,
          "loadavg_1m": round(os.getloadavg()[0], 2),
          "backend": jax.default_backend()}
  print(json.dumps(line), flush=True)
  return line


def with_overrides(cfg: ModelConfig, overrides: dict[str, Any]
                   ) -> tuple[ModelConfig, list[str]]:
  """`cfg` with the ``model.*`` overrides its fields have; the others' keys."""
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  known = {k.split(".", 1)[1]: v for k, v in overrides.items()
           if k.startswith("model.") and k.split(".", 1)[1] in fields}
  ignored = sorted(k for k in overrides
                   if k.split(".", 1)[-1] not in known)
  return dataclasses.replace(cfg, **known), ignored


def issue_model(args, layers: int) -> ModelConfig:
  """The issue's model (module docstring); width flags shrink it."""
  return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                     intermediate_size=4 * args.hidden, num_layers=layers,
                     num_heads=8, num_kv_heads=2, head_dim=args.hidden // 8)


# A Qwen3.5 layer pattern (HF full_attention_interval 4).
HYBRID_PATTERN = ("linear_attention",) * 3 + ("full_attention",)


def hybrid_model(args, layers: int) -> ModelConfig:
  """Qwen3.5's text decoder scaled down to ``--hidden`` with its ratios
  (transformers' Qwen3_5TextConfig at hidden 4096: MLP 3x; full attention
  16 / 4 heads of 256, here 4 / 1 of hidden/4, a quarter of each head
  rotated, an output gate, q/k norms; linear layers 16 key / 32 value heads
  of 128, here 4 / 8 of hidden/8); `layers` a multiple of the 4-layer
  pattern."""
  if layers % len(HYBRID_PATTERN):
    raise SystemExit(f"--model=hybrid: {layers} layers is not a multiple of "
                     f"its {len(HYBRID_PATTERN)}-layer pattern; use e.g. "
                     "--layers=4,8,32.")
  h = args.hidden
  return ModelConfig(
      vocab_size=args.vocab, hidden_size=h, intermediate_size=3 * h,
      num_layers=layers, num_heads=4, num_kv_heads=1, head_dim=h // 4,
      rotary_dim=h // 16, qk_norm=True, attn_output_gate=True,
      norm_style="qwen3_5",
      layer_types=HYBRID_PATTERN * (layers // len(HYBRID_PATTERN)),
      linear_num_key_heads=4, linear_num_value_heads=8,
      linear_key_head_dim=h // 8, linear_value_head_dim=h // 8,
      linear_conv_kernel_dim=4)


# --model: (the model at a depth, its depth in the memory figure).
MODELS = {"issue": (issue_model, 2), "hybrid": (hybrid_model, 4)}


def abstract_inputs(cfg: ModelConfig, batch: int, seq: int):
  """Shapes of a train state and a batch (nothing allocated)."""
  ptx, vtx = optim.make_optimizer(1e-4), optim.make_optimizer(5e-4)
  x = jnp.zeros((1, 4), jnp.int32)

  def init(key):
    p = nn.unbox(transformer.Transformer(cfg).init(key, x, x, x > -1)[
        "params"])
    v = transformer.value_params_from_policy(p, cfg, key)
    return step_lib.create_train_state(p, v, ptx, vtx)
  state = jax.eval_shape(init, jax.random.PRNGKey(0))
  s = lambda dt: jax.ShapeDtypeStruct((batch, seq), dt)
  batch_shapes = {"tokens": s(jnp.int32), "attention_mask": s(jnp.bool_),
                  "action_mask": s(jnp.uint8), "rewards": s(jnp.float32),
                  "rollout_logp": s(jnp.float32)}
  return state, batch_shapes, ptx, vtx


def compiled_step(cfg: ModelConfig, batch: int, seq: int, critic_updates: int,
                  state=None, batch_arrays=None):
  """(compiled SAO step, seconds to lower and compile it)."""
  abstract, batch_shapes, ptx, vtx = abstract_inputs(cfg, batch, seq)
  scfg = step_lib.StepConfig(loss="sao", critic_updates_per_step=critic_updates)
  fn = step_lib.make_step(cfg, scfg, ptx, vtx, update_policy=True)
  t0 = time.perf_counter()
  compiled = fn.lower(abstract if state is None else state,
                      batch_shapes if batch_arrays is None else batch_arrays
                      ).compile()
  return compiled, time.perf_counter() - t0


def arm_config(base: ModelConfig, arm: str, arms) -> tuple[ModelConfig, list]:
  return with_overrides(base, {**REMAT, **arms[arm]})


def memory_figures(args, arms) -> None:
  """Temp memory per arm and T; the goals line."""
  temps: dict[str, dict[int, float]] = {a: {} for a in args.arms}
  model, depth = MODELS[args.model]
  for seq in args.seqs:
    for arm in args.arms:
      cfg, ignored = arm_config(model(args, depth), arm, arms)
      compiled, secs = compiled_step(cfg, 1, seq, args.critic_updates)
      mem = compiled.memory_analysis()
      temps[arm][seq] = mem.temp_size_in_bytes / MIB
      emit("step_temp_memory", model=args.model, arm=arm, batch=1, seq=seq,
           temp_mib=round(temps[arm][seq], 1),
           argument_mib=round(mem.argument_size_in_bytes / MIB, 1),
           output_mib=round(mem.output_size_in_bytes / MIB, 1),
           compile_s=round(secs, 2), vocab=cfg.vocab_size,
           hidden=cfg.hidden_size, layers=cfg.num_layers,
           critic_updates=args.critic_updates, overrides=arms[arm],
           ignored=ignored)
      del compiled
  lo, hi = min(args.seqs), max(args.seqs)
  for arm, t in temps.items():
    if lo == hi:
      continue
    ratio = t[hi] / t[lo]
    emit("step_temp_memory_goals", model=args.model, arm=arm, seq_lo=lo, seq_hi=hi,
         temp_ratio=round(ratio, 2), token_ratio=hi / lo,
         linear_within_25pct=ratio <= 1.25 * hi / lo,
         temp_hi_mib=round(t[hi], 1), under_4gib=t[hi] < 4096)


def compile_figures(args, arms) -> None:
  """Compile seconds per arm and depth; the goals line."""
  secs: dict[str, dict[int, float]] = {a: {} for a in args.arms}
  for layers in args.layers:
    for arm in args.arms:
      cfg, ignored = arm_config(MODELS[args.model][0](args, layers), arm,
                                arms)
      runs = []
      for _ in range(args.compile_repeats):
        jax.clear_caches()
        runs.append(compiled_step(cfg, 1, args.compile_seq,
                                  args.critic_updates)[1])
      secs[arm][layers] = statistics.median(runs)
      emit("step_compile_s", model=args.model, arm=arm, layers=layers, seq=args.compile_seq,
           compile_s=round(secs[arm][layers], 2),
           runs=[round(r, 2) for r in runs], overrides=arms[arm],
           ignored=ignored)
  lo, hi = min(args.layers), max(args.layers)
  for arm, s in secs.items():
    if lo != hi:
      emit("step_compile_goals", arm=arm, layers_lo=lo, layers_hi=hi,
           ratio=round(s[hi] / s[lo], 2), within_1_5x=s[hi] <= 1.5 * s[lo])


def random_batch(cfg: ModelConfig, batch: int, seq: int) -> dict[str, Any]:
  """Right-padded rows: a 4-token prompt, actions, a terminal 0/1 reward."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(seq // 2, seq + 1, batch)
  pos = np.arange(seq)[None, :]
  attn = pos < lengths[:, None]
  action = (attn & (pos >= 4)).astype(np.uint8)
  rewards = np.zeros((batch, seq), np.float32)
  rewards[np.arange(batch), lengths - 1] = rng.integers(0, 2, batch)
  logp = -rng.exponential(1.0, (batch, seq)) * action
  return {"tokens": jnp.asarray(rng.integers(4, cfg.vocab_size, (batch, seq)),
                                jnp.int32),
          "attention_mask": jnp.asarray(attn),
          "action_mask": jnp.asarray(action),
          "rewards": jnp.asarray(rewards),
          "rollout_logp": jnp.asarray(logp.astype(np.float32))}


def _state(cfg: ModelConfig):
  ptx, vtx = optim.make_optimizer(1e-4), optim.make_optimizer(5e-4)
  x = jnp.zeros((1, 4), jnp.int32)
  p = nn.unbox(jax.jit(lambda k: transformer.Transformer(cfg).init(
      k, x, x, x > -1)["params"])(jax.random.PRNGKey(0)))
  v = transformer.value_params_from_policy(p, cfg, jax.random.PRNGKey(1))
  return step_lib.create_train_state(p, v, ptx, vtx)


def smollm2_figures(args, arms) -> None:
  """SmolLM2 step and compile seconds per arm, steps timed alternately."""
  import loop_setup  # pylint: disable=g-import-not-at-top
  config = loop_setup.import_config("smollm2").get_config()
  base = setup_lib.model_config(config)
  if args.smollm2_layers:
    base = dataclasses.replace(base, num_layers=args.smollm2_layers)
  b, t = args.smollm2_batch, args.smollm2_seq
  run = {}
  for arm in args.arms:
    # The config's own remat setting (no REMAT), but `dense` as it was.
    before = SMOLLM2_BEFORE if arm == "dense" else {}
    cfg, ignored = with_overrides(base, {**before, **arms[arm]})
    state, batch = _state(cfg), random_batch(cfg, b, t)
    compiled, secs = compiled_step(cfg, b, t, args.critic_updates, state,
                                   batch)
    run[arm] = {"compiled": compiled, "state": state, "batch": batch,
                "compile_s": secs, "step_s": [], "ignored": ignored}

  def one(arm):
    r = run[arm]
    t0 = time.perf_counter()
    r["state"], m = r["compiled"](r["state"], r["batch"])
    jax.block_until_ready(m)
    return time.perf_counter() - t0
  for _ in range(args.warmup):
    for arm in args.arms:
      one(arm)
  for _ in range(args.repeats):
    for arm in args.arms:
      run[arm]["step_s"].append(one(arm))
  for arm, r in run.items():
    emit("smollm2_step", arm=arm, batch=b, seq=t, layers=base.num_layers,
         compile_s=round(r["compile_s"], 2),
         step_s_median=round(statistics.median(r["step_s"]), 4),
         step_s_runs=[round(s, 4) for s in r["step_s"]],
         overrides=arms[arm], ignored=r["ignored"])
  if {"dense", "new"} <= set(run):
    med = {a: statistics.median(run[a]["step_s"]) for a in ("dense", "new")}
    emit("smollm2_goals", step_ratio_new_over_dense=round(
        med["new"] / med["dense"], 3), compile_ratio_new_over_dense=round(
            run["new"]["compile_s"] / run["dense"]["compile_s"], 3))


def packing_figures(args) -> None:
  """Trainer tokens/s and padding fraction, unpacked vs packed, per config."""
  # pylint: disable=g-import-not-at-top
  import loop_setup
  from sao_jax import config_validation as cv
  from sao_jax.train import loop
  # pylint: enable=g-import-not-at-top
  pack_arms = json.loads(args.pack_arms) if args.pack_arms else PACK_ARMS
  with tempfile.TemporaryDirectory() as tmp:
    for base in args.pack_configs:
      for arm, overrides in pack_arms.items():
        try:
          for key in overrides:
            cv.check_key_path(key)
        except cv.ConfigError as e:
          emit("packing", config=base, arm=arm, skipped=str(e))
          continue
        config = loop_setup.loop_config(args.pack_steps, overrides, base=base)
        summary = loop.train_and_evaluate(
            config, os.path.join(tmp, f"{base}_{arm}"))
        wall = max(summary["wall_s"], 1e-9)
        emit("packing", config=base, arm=arm, steps=args.pack_steps,
             overrides=overrides,
             trainer_action_tokens_per_s=round(
                 summary["generated_tokens"] / wall, 1),
             steady_steps_per_s=round(summary["train_wall_steps"] / max(
                 summary["train_wall_s"], 1e-9), 3),
             trajectories_trained=summary["trajectories_trained"],
             padding_frac=summary.get("padding_frac"), wall_s=round(wall, 1))


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--figures", default="memory,compile,smollm2,packing")
  p.add_argument("--arms", default="dense,new")
  p.add_argument("--set", action="append", default=[],
                 help="ARM:KEY=VALUE (JSON value) changes an arm's override.")
  p.add_argument("--seqs", type=_ints,
                 default=_ints("512,1024,2048,4096,8192,16384,32768"))
  p.add_argument("--model", choices=sorted(MODELS), default="issue",
                 help="issue: issue 25's dense model; hybrid: Qwen3.5-shaped "
                 "(Gated DeltaNet + full attention, issue 41).")
  p.add_argument("--vocab", type=int, default=32768)
  p.add_argument("--hidden", type=int, default=256,
                 help="Residual width; MLP 4x, 8 heads / 2 kv of hidden/8.")
  p.add_argument("--critic_updates", type=int, default=1)
  p.add_argument("--layers", type=_ints, default=_ints("2,8,32"))
  p.add_argument("--compile_seq", type=int, default=256)
  p.add_argument("--compile_repeats", type=int, default=3)
  p.add_argument("--smollm2_batch", type=int, default=8)
  p.add_argument("--smollm2_seq", type=int, default=128)
  p.add_argument("--smollm2_layers", type=int, default=0,
                 help="0: the config's 30 layers.")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--pack_configs", default="longtail,quickstart")
  p.add_argument("--pack_arms", default="",
                 help="JSON {arm: {key: value}}; default PACK_ARMS.")
  p.add_argument("--pack_steps", type=int, default=20)
  args = p.parse_args(argv)
  args.arms = args.arms.split(",")
  args.pack_configs = args.pack_configs.split(",")
  return args


def arms_from(args) -> dict[str, dict[str, Any]]:
  """ARMS with the ``--set`` changes."""
  arms = {k: dict(v) for k, v in ARMS.items()}
  for item in args.set:
    arm, _, kv = item.partition(":")
    key, _, value = kv.partition("=")
    if not key or not value:
      raise SystemExit(f"--set {item!r}: expected ARM:KEY=VALUE, e.g. "
                       "new:model.logits_chunk=512")
    arms.setdefault(arm, {})[key] = json.loads(value)
  unknown = [a for a in args.arms if a not in arms]
  if unknown:
    raise SystemExit(f"--arms: unknown {unknown}; known {sorted(arms)} (or "
                     "define one with --set ARM:KEY=VALUE).")
  return arms


def main(argv=None) -> None:
  args = parse_args(argv)
  arms = arms_from(args)
  figures = args.figures.split(",")
  unknown = set(figures) - {"memory", "compile", "smollm2", "packing"}
  if unknown:
    raise SystemExit(f"--figures: unknown {sorted(unknown)}.")
  if "memory" in figures:
    memory_figures(args, arms)
  if "compile" in figures:
    compile_figures(args, arms)
  if "smollm2" in figures:
    smollm2_figures(args, arms)
  if "packing" in figures:
    packing_figures(args)
  emit("machine", jax=jax.__version__, devices=jax.device_count(),
       cpus=os.cpu_count())


if __name__ == "__main__":
  main()
