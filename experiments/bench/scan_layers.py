r"""Scanned vs unrolled decoder layers: compile seconds by depth, step time.

Two figures of the jitted SAO train step (`sao_jax.train.step.make_step`,
policy update + critic updates, optax AdamW), `model.scan_layers` True
(`nn.scan` over stacked params: one layer body) vs False (the unrolled
reference, one HLO per layer):

- `compile` (`--depths`): compile seconds (`jit.lower().compile()`) of the
  step at each depth for the issue-25 model (hidden 256, MLP 768, 8 heads /
  2 kv heads of 32, vocab 32,768, remat 'full', 1 critic update), batch 1 x
  `--seq`; one JSON line per (arm, depth) and a summary line with the
  32-layer / 2-layer ratios (the goal: <= 1.5 with scan).
  Each line also has the optimised HLO's size (characters, dot ops), which
  does not depend on the machine's load.
- `step` (`--model=smollm2`, or a `train_step.py` size such as `large`): the
  SmolLM2-135M step at `--batch` x `--seq_model` (8 x 128), both arms compiled in this process, then timed
  alternately (scan, unrolled, scan, ...) so both see the same machine load;
  medians over `--repeats` after `--warmup` untimed steps.

Every line records the 1-minute load average.

  .venv/bin/python experiments/bench/scan_layers.py --figures=compile
  .venv/bin/python experiments/bench/scan_layers.py --figures=step --model=large
  .venv/bin/python experiments/bench/scan_layers.py --figures=step --repeats 3
"""

import argparse
import dataclasses
import json
import os
import re
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

import train_step as bench_lib  # experiments/bench/train_step.py
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.train import optim
from sao_jax.train import step as step_lib

ISSUE_MODEL = ModelConfig(vocab_size=32768, hidden_size=256,
                          intermediate_size=768, num_layers=2, num_heads=8,
                          num_kv_heads=2, head_dim=32, remat_policy="full")
ARMS = {"scan": True, "unrolled": False}


def emit(**kw) -> None:
  kw["load_1min"] = round(os.getloadavg()[0], 2)
  print(json.dumps(kw), flush=True)


def build(cfg: ModelConfig, batch: int, seq: int, critic_updates: int):
  """(jitted step, state, batch) of the SAO step for `cfg`."""
  x = jnp.zeros((1, 4), jnp.int32)
  policy = nn.unbox(jax.jit(lambda k: transformer.Transformer(cfg).init(
      k, x, x, x > -1)["params"])(jax.random.PRNGKey(0)))
  value = transformer.value_params_from_policy(policy, cfg,
                                               jax.random.PRNGKey(1))
  ptx, vtx = optim.make_optimizer(1e-4), optim.make_optimizer(5e-4)
  scfg = step_lib.StepConfig(loss="sao",
                             critic_updates_per_step=critic_updates)
  fn = step_lib.make_step(cfg, scfg, ptx, vtx, update_policy=True)
  state = step_lib.create_train_state(policy, value, ptx, vtx)
  return fn, state, bench_lib.make_batch(cfg, batch, seq)


def compile_seconds(cfg, batch, seq, critic_updates) -> tuple[float, object]:
  fn, state, data = build(cfg, batch, seq, critic_updates)
  t0 = time.perf_counter()
  compiled = fn.lower(state, data).compile()
  return time.perf_counter() - t0, (compiled, state, data)


def hlo_size(compiled) -> dict[str, int]:
  """Size of the optimised HLO (load-free): characters and dot ops."""
  text = compiled.as_text()
  return {"hlo_chars": len(text), "hlo_dots": len(re.findall(r" dot\(", text))}


def figure_compile(args) -> None:
  """Depth-major (scan d, unrolled d, scan d', ...): both arms of a depth see
  about the same load."""
  depths = [int(d) for d in args.depths.split(",")]
  skip = {int(d) for d in args.skip_unrolled.split(",") if d}
  out = {}
  for depth in depths:
    for arm in args.arms.split(","):
      if arm == "unrolled" and depth in skip:
        continue
      cfg = dataclasses.replace(ISSUE_MODEL, num_layers=depth,
                                scan_layers=ARMS[arm])
      secs, (compiled, _, _) = compile_seconds(cfg, 1, args.seq, 1)
      out[(arm, depth)] = secs
      emit(figure="scan_layers_compile", arm=arm, layers=depth, seq=args.seq,
           compile_s=round(secs, 2), **hlo_size(compiled))
  summary = {"figure": "scan_layers_compile_summary", "seq": args.seq}
  for arm in args.arms.split(","):
    done = sorted(d for a, d in out if a == arm)
    if len(done) > 1:
      summary[f"{arm}_ratio_{done[-1]}_over_{done[0]}"] = round(
          out[(arm, done[-1])] / out[(arm, done[0])], 3)
  emit(**summary)


def figure_step(args) -> None:
  cfg, _, _ = bench_lib.size(args.model)
  runs = {}
  for arm in args.arms.split(","):
    c = dataclasses.replace(cfg, scan_layers=ARMS[arm])
    secs, (compiled, state, data) = compile_seconds(
        c, args.batch, args.seq_model, args.critic_updates)
    runs[arm] = {"compiled": compiled, "state": state, "data": data,
                 "compile_s": secs, "step_s": []}
    emit(figure=f"scan_layers_step_{args.model}_compile", arm=arm,
         compile_s=round(secs, 2))

  def one(r):
    t0 = time.perf_counter()
    r["state"], metrics = r["compiled"](r["state"], r["data"])
    jax.block_until_ready((r["state"], metrics))
    return time.perf_counter() - t0

  for i in range(args.warmup + args.repeats):
    for arm, r in runs.items():
      secs = one(r)
      if i >= args.warmup:
        r["step_s"].append(secs)
        emit(figure=f"scan_layers_step_{args.model}_run", arm=arm,
             run=i - args.warmup, step_s=round(secs, 3))
  summary = {"figure": f"scan_layers_step_{args.model}", "batch": args.batch,
             "seq": args.seq_model, "critic_updates": args.critic_updates,
             "runs": args.repeats}
  for arm, r in runs.items():
    summary[f"{arm}_compile_s"] = round(r["compile_s"], 2)
    summary[f"{arm}_step_s_median"] = round(statistics.median(r["step_s"]), 3)
  if set(runs) == set(ARMS):
    summary["step_scan_over_unrolled"] = round(
        summary["scan_step_s_median"] / summary["unrolled_step_s_median"], 3)
    summary["compile_scan_over_unrolled"] = round(
        summary["scan_compile_s"] / summary["unrolled_compile_s"], 3)
  emit(**summary)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--figures", default="compile,step")
  parser.add_argument("--arms", default="scan,unrolled")
  parser.add_argument("--depths", default="2,8,32")
  parser.add_argument("--skip_unrolled", default="",
                      help="Depths whose unrolled arm is not compiled (e.g. "
                      "32 on a loaded CPU: minutes).")
  parser.add_argument("--seq", type=int, default=256,
                      help="Tokens of the compile figure's one row.")
  parser.add_argument("--model", default="smollm2")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq_model", type=int, default=128)
  parser.add_argument("--critic_updates", type=int, default=1)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1)
  args = parser.parse_args()
  emit(figure="scan_layers_machine", backend=jax.default_backend(),
       devices=jax.device_count(), jax=jax.__version__)
  for name in args.figures.split(","):
    {"compile": figure_compile, "step": figure_step}[name](args)


if __name__ == "__main__":
  main()
