"""Tiny trainer settings (flattened config overrides) shared by the end-to-end
tests: a 1-layer model on two-term one-digit arithmetic, seconds per step."""

from configs import base
from sao_jax import config_validation

TINY_OVERRIDES = {
    "model.vocab_size": 294, "model.hidden_size": 32,
    "model.intermediate_size": 64, "model.num_layers": 1,
    "model.num_heads": 2, "model.num_kv_heads": 1, "model.head_dim": 16,
    "tokenizer.vocab_size": 294, "tokenizer.datasets": ("basic_arithmetic",),
    "tokenizer.corpus_size": 2000,
    "env.dataset": "basic_arithmetic", "env.size": 1000,
    "env.eval_seed": 100_000, "env.eval_size": 8,
    "sampler.max_new_tokens": 4, "sampler.max_total_tokens": 32,
    "sampler.batch_size": 8, "train.batch_size": 8, "train.max_seq_len": 32,
    "rl.critic_warmup_steps": 1, "rl.critic_updates_per_step": 2,
    "optim.actor_lr": 1e-3, "optim.critic_lr": 1e-3,
    "train.log_every": 1, "train.eval_every": 0, "train.sft_steps": 0,
    "ring.get_timeout_s": 120.0,
}
DATASET_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                  "max_digits": 1, "operators": ("+", "-"),
                  "allow_parentheses": False, "allow_negation": False}


def tiny_config(**overrides):
  """The base config with the tiny settings and ``overrides`` (dotted keys)."""
  config = base.get_config()
  for key, value in {**TINY_OVERRIDES, **overrides}.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  config.env.dataset_config.update(DATASET_CONFIG)
  config_validation.validate_config(config)
  return config


def main_args(repo: str, workdir, overrides: dict) -> list[str]:
  """``python -m sao_jax.main`` on the tiny settings plus ``overrides``."""
  import sys  # pylint: disable=g-import-not-at-top

  args = [sys.executable, "-m", "sao_jax.main",
          f"--config={repo}/configs/base.py", f"--workdir={workdir}"]
  flat = {**TINY_OVERRIDES, **overrides, **{
      f"env.dataset_config.{k}": v for k, v in DATASET_CONFIG.items()}}
  for key, value in flat.items():
    if isinstance(value, tuple):
      value = "(" + ",".join(repr(v) for v in value) + ",)"
    args.append(f"--config.{key}={value}")
  return args


def arithmetic_tokenizer(directory):
  """A 294-piece SentencePiece model trained on 100 of the tiny task's
  problems (seed 0), written to ``directory``: the sampler and fault tests'
  tokenizer."""
  # pylint: disable-next=g-import-not-at-top
  from sao_jax.tokenization import tokenizer as tok_lib
  corpus = tok_lib.task_corpus(("basic_arithmetic",), n=100, seed=0)
  return tok_lib.train_tokenizer(corpus, directory / "t.model",
                                 TINY_OVERRIDES["tokenizer.vocab_size"],
                                 seed=0)
