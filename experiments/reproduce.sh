#!/usr/bin/env bash
# Runs every experiment of experiments/RESULTS.md, then writes its reports.
#
#   bash experiments/reproduce.sh [RUNS_DIR] [REPORTS_DIR]
#       (defaults: runs, experiments/results)
#
# Each sweep skips finished points and resumes unfinished ones, so the script
# can be stopped and rerun. All CPU-scale arms share one SFT warm start
# (RUNS_DIR/sft_cache). Reports go to REPORTS_DIR/<study>/report.md (+ PNGs);
# experiments/RESULTS.md discusses the committed ones.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUNS="${1:-runs}"
REPORTS="${2:-experiments/results}"
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
sweep configs/online_short.py "${RUNS}/online_short"
# What-if on a recorded stream: the staleness-16 GRPO run recorded, replayed
# exactly, then replayed with the DIS loss (GRPO+DIS) on the same stream.
main() {  # main WORKDIR [--config.x=y...]: configs/grpo.py at eta = 16
  local dir="$1"
  shift
  [[ -f "${dir}/summary.json" ]] || "${PY}" -m sao_jax.main \
      --config=configs/grpo.py --workdir="${dir}" \
      --config.train.max_staleness=16 --config.train.publish_lag=16 "$@"
}
W="${RUNS}/whatif"
main "${W}/grpo_eta16" --config.train.record_stream=True
main "${W}/replay" --config.train.mode=replay \
    --config.train.replay_from="${W}/grpo_eta16"
main "${W}/replay_dis" --config.train.mode=replay \
    --config.train.replay_from="${W}/grpo_eta16" --config.rl.loss=grpo_dis

report() {  # report NAME TITLE DIR... [--flags]
  local name="$1" title="$2"
  shift 2
  "${PY}" experiments/report.py "$@" --out="${REPORTS}/${name}" \
      --title="${title}" > /dev/null
}
report main "Main comparison: SAO vs GRPO+DIS vs GRPO" --target=0.9 \
    "${RUNS}/main/sao" "${RUNS}/main/grpo_dis" "${RUNS}/main/grpo"
report staleness "Staleness study: SAO and GRPO at eta = 0, 1, 4, 16" \
    --target=0.9 "${RUNS}/staleness"
report ablations "Ablations and other baselines (SAO seeds for reference)" \
    --target=0.9 "${RUNS}/main/sao" "${RUNS}"/ablations/*
report sao_long "SAO for 1,000 policy steps" --target=0.9 "${RUNS}/sao_long"
report online "Online-learning simulation (style switches at 60, 120)" \
    --target=0.8 --switch_versions=60,120 "${RUNS}/online"
report online_short "Online-learning simulation, short phases (switches at 25, 50)" \
    --target=0.8 --switch_versions=25,50 "${RUNS}/online_short"
report whatif "What-if: the staleness-16 GRPO stream replayed with DIS" \
    --target=0.9 "${W}/grpo_eta16" "${W}/replay" "${W}/replay_dis"
echo "Reports: ${REPORTS}/*/report.md"
