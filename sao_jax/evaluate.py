r"""Held-out evaluation of a run's policy: greedy pass@1, and pass@k.

  python -m sao_jax.evaluate --config=configs/smollm2_codeio.py \
      --workdir=runs/smollm2_codeio --config.env.eval_dataset=humaneval \
      --samples=10 --k=1,10

The policy is the newest checkpoint's in `--workdir`, else the one the
config starts RL from (its SFT warm start, cached in the workdir, included;
`--config.train.sft_steps=0`: the initial checkpoint itself). The held-out
tasks are the config's (`env.eval_size` of them): disjoint codeio rows,
held-out repair seeds, or HumanEval (`env.eval_dataset=humaneval`, graded in
the sandbox). Greedy pass@1 always; with `--samples=n`, the unbiased pass@k
from n episodes per problem at `sampler.temperature`. The figures go to
stdout as one JSON line and to `--out` if given.
"""

from __future__ import annotations

import json
import sys
from typing import Sequence

from absl import app
from absl import flags
from ml_collections import config_flags

from sao_jax import config_validation
from sao_jax.train import evaluate as eval_lib
from sao_jax.train import metrics as metrics_lib
from sao_jax.train import setup as setup_lib

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (e.g. configs/smollm2_codeio.py).",
    lock_config=False, accept_new_attributes=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "The run's directory (its checkpoints and tokenizer).")
_SAMPLES = flags.DEFINE_integer(
    "samples", 0, "Sampled episodes per problem for pass@k; 0: greedy only.")
_K = flags.DEFINE_list("k", ["1", "10"], "The k of pass@k (each <= samples).")
_OUT = flags.DEFINE_string("out", None, "Also write the JSON here.")
flags.mark_flags_as_required(["config", "workdir"])


def run(config, workdir: str, samples: int = 0,
        ks: Sequence[int] = (1, 10)) -> dict[str, float]:
  """The figures of the module docstring for `config`'s policy in
  `workdir`."""
  writer = metrics_lib.MetricWriter(workdir, active=False)
  built = setup_lib.build(config, workdir, writer, True)
  try:
    params = built.state.policy_params
    version = int(built.state.policy_version)
    batch = int(built.config.train.eval_batch_size)
    greedy = eval_lib.evaluate(
        params, built.mcfg, built.config, built.tokenizer,
        built.eval_tasks, version=version, batch_size=batch)
    out = {"pass@1_greedy": greedy["eval/accuracy"],
           "problems": greedy["eval/num_problems"],
           "policy_version": float(version),
           "step": float(built.state.step)}
    if samples:
      out.update(eval_lib.pass_at_k(
          params, built.mcfg, built.config, built.tokenizer,
          built.eval_tasks, samples=samples, ks=tuple(ks), batch_size=batch,
          version=version))
    return out
  finally:
    built.ckpt.close()


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  try:
    config_validation.validate_config(config)
  except config_validation.ConfigError as e:
    sys.exit(str(e))
  try:
    ks = [int(k) for k in _K.value]
  except ValueError:
    sys.exit(f"--k={','.join(_K.value)}: give whole numbers, e.g. --k=1,10.")
  out = {"dataset": str(config.env.get("eval_dataset", "")
                        or config.env.dataset),
         **run(config, _WORKDIR.value, _SAMPLES.value, ks)}
  line = json.dumps(out)
  if _OUT.value:
    metrics_lib.write_json_atomic(_OUT.value, out)
  print(line)  # The CLI's result.


if __name__ == "__main__":
  app.run(main)
