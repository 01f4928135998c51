r"""Train-step FLOP/s as a fraction of this machine's large-matmul FLOP/s.

The jitted SAO train step (`sao_jax.train.step.make_step`: a critic forward
for the advantages, `critic_updates_per_step=2` critic updates, one policy
update; optax AdamW from `sao_jax.train.optim`) on one device, for two model
sizes:

- `quickstart`: the `configs/quickstart.py` model (hidden 128, MLP 384,
  4 layers, 4 heads / 2 kv heads of 32, vocab 294), batch 32 x seq 32;
- `large`: hidden 256, MLP 768, 4 layers, 4 heads / 2 kv heads of 64,
  vocab 294, batch 32 x seq 128;
- `smollm2` (`--model=smollm2`): the `configs/smollm2.py` model
  (SmolLM2-135M: hidden 576, MLP 1536, 30 layers, 9 heads / 3 kv heads of 64,
  vocab 49,152, tied embeddings), its dtype, remat policy and layer layout
  (`--remat_policy`, `--scan_layers` override them), at the config's
  `train.batch_size` x `train.max_seq_len` (16 x 128), random weights (FLOPs
  do not depend on them).

`--num_layers` and `--vocab_size` override every size's depth and vocabulary
(a smoke run of a real size's layer: CI's tiny forms).

`--family` gives the size a family's shapes (models/families/): `qwen3` (q/k
norms), `mistral` (a window of seq/4), `gemma3` ((1 + w) norms with the
post-attention/MLP norms, GELU-tanh, three sliding layers to one full,
q/k norms, tied), `qwen3_moe` (8 experts, top 2) or `glm4_moe` (sigmoid
grouped routing, a shared expert, half rotary, a dense first layer);
default `llama`, the size as is.

FLOPs per step come from XLA's cost analysis of the compiled step
(`jit(...).lower(...).compile().cost_analysis()['flops']`); the analytic
estimates are printed beside them: `analytic_6n_flops` = 6 · N · tokens ·
(1 + K) with N the policy's matmul parameters (no embedding gather) and K
critic updates, and `analytic_flops`, which also counts the critic's forward
for the advantages, the critic's 1-wide head instead of the LM head and the
attention score/value matmuls (4 · T² · heads · head_dim per row and layer,
×3 with the backward; a sliding window is counted as full causal attention,
which the dense path computes; the blockwise path skips blocks outside it,
so XLA counts fewer). For a MoE model N counts the experts a token uses
(top_k + shared) and the router, not every expert.

The peak is a float32 2048 x 2048 @ 2048 x 2048 `jnp.dot` (2 · n³ FLOPs;
`--matmul_dtype=bfloat16 --matmul_n=8192` for an accelerator's bf16 peak,
with `--dtype=bfloat16` for the model's compute dtype) jitted in the same process, i.e. with the same XLA CPU client and threads. Matmul and
train step are timed alternately within each repetition (side by side under
the same machine load); figures are medians over `--repeats` timed runs after
`--warmup` untimed ones.

  .venv/bin/python experiments/bench/train_step.py --repeats 7

One JSON line per run and per figure; the last line is
{"fraction", "fraction_large", ...}: the achieved (XLA-counted) FLOP/s of the
quickstart-sized / large step over the matmul FLOP/s.
"""

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import MoeConfig
from sao_jax.train import setup as setup_lib
from sao_jax.models.config import REMAT_POLICIES
from sao_jax.train import optim
from sao_jax.train import step as step_lib

import loop_setup  # experiments/bench/ (the script's folder)

SIZES = {
    "quickstart": (ModelConfig(vocab_size=294, hidden_size=128,
                               intermediate_size=384, num_layers=4,
                               num_heads=4, num_kv_heads=2, head_dim=32),
                   32, 32),
    "large": (ModelConfig(vocab_size=294, hidden_size=256,
                          intermediate_size=768, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=64),
              32, 128),
}
CRITIC_UPDATES = 2
# Real-size models: configs/<name>.py's model, batch and sequence length.
CONFIG_SIZES = ("smollm2",)


def size(name: str) -> tuple[ModelConfig, int, int]:
  """(model config, batch, seq) of a named size."""
  if name in SIZES:
    return SIZES[name]
  if name not in CONFIG_SIZES:
    raise ValueError(f"Unknown size {name!r}; known: "
                     f"{sorted(SIZES) + sorted(CONFIG_SIZES)}.")
  config = loop_setup.import_config(name).get_config()
  cfg = setup_lib.model_config(config)
  return cfg, int(config.train.batch_size), int(config.train.max_seq_len)


def family_config(cfg: ModelConfig, family: str, seq: int) -> ModelConfig:
  """`cfg` with the shapes of `family` (see the module docstring)."""
  window = max(1, seq // 4)
  moe_f = max(1, cfg.intermediate_size // 4)
  shapes = {
      "llama": {},
      "qwen3": dict(qk_norm=True),
      "mistral": dict(sliding_window=window),
      "gemma3": dict(
          norm_style="gemma", mlp_activation="gelu_tanh", qk_norm=True,
          tie_embeddings=True, sliding_window=window,
          local_rope_theta=10000.0, rope_theta=1e6,
          layer_types=tuple("full_attention" if i % 4 == 3 else
                            "sliding_attention"
                            for i in range(cfg.num_layers))),
      "qwen3_moe": dict(qk_norm=True, moe=MoeConfig(
          num_experts=8, top_k=2, intermediate_size=moe_f)),
      "glm4_moe": dict(
          qk_norm=True, qkv_bias=True, rotary_dim=cfg.head_dim // 2,
          first_dense_layers=min(1, cfg.num_layers - 1),
          moe=MoeConfig(num_experts=8, top_k=2, intermediate_size=moe_f,
                        router="sigmoid", n_group=2, topk_group=1,
                        n_shared_experts=1, routed_scaling_factor=1.5)),
  }
  if family not in shapes:
    raise ValueError(f"Unknown family {family!r}; known: {sorted(shapes)}.")
  return dataclasses.replace(cfg, **shapes[family])


def matmul_params(cfg: ModelConfig, value: bool) -> int:
  """Parameters that enter a matmul per token: blocks + output head (a MoE
  layer: its router and the top_k + shared experts a token goes through)."""
  d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  attn = d * dh * (cfg.num_heads * 2 + cfg.num_kv_heads * 2)
  head = d if value else d * cfg.vocab_size
  dense = cfg.num_layers * (attn + 3 * d * f) + head
  if cfg.moe is None:
    return dense
  m = cfg.moe
  sparse = d * m.num_experts + 3 * d * m.intermediate_size * (
      m.top_k + m.n_shared_experts)
  return dense + cfg.num_moe_layers * (sparse - 3 * d * f)


def analytic_flops(cfg: ModelConfig, batch: int, seq: int) -> dict[str, float]:
  """6·N·tokens·(1+K), and the refined count (see the module docstring)."""
  tokens = batch * seq
  n_pol, n_val = matmul_params(cfg, False), matmul_params(cfg, True)
  attn_fwd = cfg.num_layers * batch * 4 * seq * seq * cfg.num_heads * (
      cfg.head_dim)
  simple = 6 * n_pol * tokens * (1 + CRITIC_UPDATES)
  refined = (2 * n_val * tokens + attn_fwd                       # V for GAE.
             + CRITIC_UPDATES * (6 * n_val * tokens + 3 * attn_fwd)
             + 6 * n_pol * tokens + 3 * attn_fwd)                # Policy.
  return {"analytic_6n_flops": float(simple), "analytic_flops": float(refined),
          "policy_matmul_params": n_pol}


def make_batch(cfg: ModelConfig, batch: int, seq: int) -> dict[str, Any]:
  """Right-padded rows: a 4-token prompt, actions, a terminal 0/1 reward."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(seq // 2, seq + 1, batch)
  pos = np.arange(seq)[None, :]
  attn = pos < lengths[:, None]
  action = (attn & (pos >= 4)).astype(np.uint8)
  rewards = np.zeros((batch, seq), np.float32)
  rewards[np.arange(batch), lengths - 1] = rng.integers(0, 2, batch)
  logp = -rng.exponential(np.log(cfg.vocab_size), (batch, seq))
  return {
      "tokens": jnp.asarray(rng.integers(4, cfg.vocab_size, (batch, seq)),
                            jnp.int32),
      "attention_mask": jnp.asarray(attn),
      "action_mask": jnp.asarray(action),
      "rewards": jnp.asarray(rewards),
      "rollout_logp": jnp.asarray((logp * action).astype(np.float32)),
  }


def xla_flops(compiled: Any) -> float:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # Older JAX: one dict per program.
    cost = cost[0]
  return float(cost["flops"])


def _timed(fn) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def bench_size(name: str, args, matmul) -> dict[str, Any]:
  """Timings of one size's step, alternating with the matmul."""
  cfg, batch_size, seq = size(name)
  batch_size, seq = args.batch or batch_size, args.seq or seq
  if args.dtype:
    cfg = dataclasses.replace(cfg, dtype=args.dtype)
  if args.remat_policy:
    cfg = dataclasses.replace(cfg, remat_policy=args.remat_policy)
  if args.scan_layers:
    cfg = dataclasses.replace(cfg, scan_layers=args.scan_layers == "true")
  if args.num_layers:
    cfg = dataclasses.replace(cfg, num_layers=args.num_layers)
  if args.vocab_size:
    cfg = dataclasses.replace(cfg, vocab_size=args.vocab_size)
  cfg = family_config(cfg, args.family, seq)
  x = jnp.zeros((1, 4), jnp.int32)
  policy = jax.jit(lambda k: transformer.Transformer(cfg).init(
      k, x, x, x > -1)["params"])(jax.random.PRNGKey(0))
  policy = nn.unbox(policy)
  value = transformer.value_params_from_policy(policy, cfg,
                                               jax.random.PRNGKey(1))
  ptx = optim.make_optimizer(1e-4)
  vtx = optim.make_optimizer(5e-4)
  scfg = step_lib.StepConfig(loss="sao",
                             critic_updates_per_step=CRITIC_UPDATES)
  fn = step_lib.make_step(cfg, scfg, ptx, vtx, update_policy=True)
  state = step_lib.create_train_state(policy, value, ptx, vtx)
  batch = make_batch(cfg, batch_size, seq)

  t0 = time.perf_counter()
  compiled = fn.lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  flops = xla_flops(compiled)
  holder = {"state": state}

  def one_step():
    holder["state"], metrics = compiled(holder["state"], batch)
    return holder["state"], metrics

  for _ in range(args.warmup):
    _timed(one_step)
  step_s, mm_s = [], []
  for r in range(args.repeats):
    mm_s.append(_timed(matmul))
    step_s.append(_timed(one_step))
    print(json.dumps({"size": name, "run": r, "step_s": round(step_s[-1], 5),
                      "matmul_s": round(mm_s[-1], 5)}), flush=True)
  med_step, med_mm = statistics.median(step_s), statistics.median(mm_s)
  peak = args.matmul_flops / med_mm
  achieved = flops / med_step
  out = {
      "figure": f"train_step_{name}", "batch": batch_size, "seq": seq,
      "dtype": cfg.dtype, "remat_policy": cfg.remat_policy,
      "scan_layers": cfg.scan_layers, "family": args.family,
      "num_params": cfg.num_params(), "xla_flops": flops,
      **analytic_flops(cfg, batch_size, seq),
      "compile_s": round(compile_s, 2),
      "step_s_median": round(med_step, 5), "step_s_min": round(min(step_s), 5),
      "step_s_max": round(max(step_s), 5),
      "tokens_per_s": round(batch_size * seq / med_step, 1),
      "achieved_gflops": round(achieved / 1e9, 3),
      "matmul_gflops": round(peak / 1e9, 3),
      "matmul_gflops_min": round(args.matmul_flops / max(mm_s) / 1e9, 3),
      "matmul_gflops_max": round(args.matmul_flops / min(mm_s) / 1e9, 3),
      "fraction": round(achieved / peak, 4),
      "runs": args.repeats,
  }
  out["xla_over_analytic"] = round(flops / out["analytic_flops"], 3)
  print(json.dumps(out), flush=True)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--matmul_n", type=int, default=2048)
  parser.add_argument("--sizes", default="quickstart,large")
  parser.add_argument("--model", default="",
                      help="A real-size model alone (e.g. smollm2): the same "
                      "as --sizes=NAME.")
  parser.add_argument("--batch", type=int, default=0,
                      help="Override every size's batch (0: its own).")
  parser.add_argument("--seq", type=int, default=0,
                      help="Override every size's sequence length.")
  parser.add_argument("--dtype", default="",
                      help="Override the models' compute dtype (e.g. "
                      "bfloat16 on an accelerator); params stay float32.")
  parser.add_argument("--remat_policy", choices=("",) + REMAT_POLICIES,
                      default="", help="Override the models' `remat_policy`.")
  parser.add_argument("--scan_layers", choices=("", "true", "false"),
                      default="", help="Override the models' `scan_layers`.")
  parser.add_argument("--num_layers", type=int, default=0,
                      help="Override every size's depth (0: its own); e.g. "
                      "a 1-layer smoke run of a real-size model.")
  parser.add_argument("--vocab_size", type=int, default=0,
                      help="Override every size's vocabulary (0: its own); "
                      "with --num_layers, a smoke run of a real size's "
                      "layer without its LM head's cost.")
  parser.add_argument("--family", default="llama",
                      help="Give each size a family's shapes: llama, qwen3, "
                      "mistral, gemma3, qwen3_moe or glm4_moe.")
  parser.add_argument("--matmul_dtype", default="float32",
                      help="dtype of the peak matmul: float32 on CPU, "
                      "bfloat16 for an accelerator's bf16 peak.")
  args = parser.parse_args()
  if args.model:
    args.sizes = args.model

  n = args.matmul_n
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), args.matmul_dtype)
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n), args.matmul_dtype)
  dot = jax.jit(jnp.dot)
  args.matmul_flops = 2.0 * n ** 3
  compiled_dot = dot.lower(a, b).compile()
  print(json.dumps({"figure": "matmul_xla_flops",
                    "xla_flops": xla_flops(compiled_dot),
                    "analytic_flops": args.matmul_flops}), flush=True)
  matmul = lambda: compiled_dot(a, b)
  for _ in range(args.warmup):
    _timed(matmul)

  results = {name: bench_size(name, args, matmul)
             for name in args.sizes.split(",")}
  last = {"fraction": results.get("quickstart", {}).get("fraction"),
          "fraction_large": results.get("large", {}).get("fraction")}
  for name, r in results.items():
    last[f"{name}_achieved_gflops"] = r["achieved_gflops"]
    last[f"{name}_matmul_gflops"] = r["matmul_gflops"]
    last[f"{name}_fraction"] = r["fraction"]
  last.update({"matmul_n": n, "matmul_dtype": args.matmul_dtype,
               "jax": jax.__version__,
               "load_1min": round(os.getloadavg()[0], 2),
               "backend": jax.default_backend(),
               "devices": jax.device_count()})
  print(json.dumps(last), flush=True)


if __name__ == "__main__":
  main()
