#!/usr/bin/env bash
# Runs every experiment of experiments/RESULTS.md, then writes its reports.
#
#   bash experiments/reproduce.sh [RUNS_DIR]      (default: runs)
#
# Each sweep skips finished points and resumes unfinished ones, so the script
# can be stopped and rerun. All CPU-scale arms share one SFT warm start
# (RUNS_DIR/sft_cache). Reports go to RUNS_DIR/reports/<study>/report.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUNS="${1:-runs}"
PY="${PYTHON:-.venv/bin/python}"
CACHE="${RUNS}/sft_cache"

sweep() {  # sweep CONFIG WORKDIR
  "${PY}" experiments/sweep.py --config="$1" --workdir="$2" \
      --sft_cache_dir="${CACHE}"
}

# Main comparison (2 seeds per arm, equal generated-token budgets).
for arm in sao grpo grpo_dis; do
  sweep "configs/${arm}.py" "${RUNS}/main/${arm}"
done
# Staleness study: SAO and GRPO at eta in {0, 1, 4, 16}.
sweep configs/staleness.py "${RUNS}/staleness"
# Ablations and other baselines (1 seed each).
for arm in sao_dis_only sao_no_fast_value sao_no_frozen_attention vapo \
           running_mean; do
  sweep "configs/${arm}.py" "${RUNS}/ablations/${arm}"
done
# Stability: 1,000 SAO steps.
sweep configs/sao_long.py "${RUNS}/sao_long"
# Online-learning simulation (its own SFT warm start: all three styles).
sweep configs/online.py "${RUNS}/online"

report() {  # report OUT TARGET DIR...
  local out="$1" target="$2"
  shift 2
  "${PY}" experiments/report.py "$@" --out="${RUNS}/reports/${out}" \
      --target="${target}" > /dev/null
}
report main 0.8 "${RUNS}/main/sao" "${RUNS}/main/grpo" "${RUNS}/main/grpo_dis"
report staleness 0.8 "${RUNS}/staleness"
report ablations 0.8 "${RUNS}/main/sao" "${RUNS}"/ablations/*
report sao_long 0.8 "${RUNS}/sao_long"
report online 0.5 "${RUNS}/online"
echo "Reports: ${RUNS}/reports/*/report.md"
