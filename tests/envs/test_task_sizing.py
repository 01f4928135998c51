"""Settings that follow the task (sao_jax.envs.task_sizing, issue 18).

Lengths and the model vocabulary at 0 are derived from a measured sample of
the task's demonstrations; explicit values win but are checked, and each
error names the key, the measured need and the share of problems cut. The
tokenizer trains with a soft vocabulary limit and on the run's own task.
"""

import numpy as np
import pytest

from configs import reasoning_gym
from sao_jax import config_validation as cv
from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs import build as env_build
from sao_jax.envs import demonstrations
from sao_jax.envs import task_sizing


def _lengths(prompt, action, reply):
  prompt, action = np.asarray(prompt), np.asarray(action)
  return task_sizing.TaskLengths("t", prompt, action,
                                 prompt + np.asarray(reply))


def test_derive_rounds_up_with_margins():
  lengths = _lengths([50, 60, 113], [2, 3, 3], [2, 3, 3])
  # action 3 + slack 2 -> 8; ceil(113 * 1.1) = 125, + reply 3 + slack 2 = 130
  # -> 136.
  assert task_sizing.derive(lengths) == {
      "sampler.max_new_tokens": 8, "sampler.max_total_tokens": 136,
      "train.max_seq_len": 136, "train.sft_max_len": 136}
  # Long answers: slack is a quarter of the longest action turn.
  lengths = _lengths([10, 20], [40, 30], [40, 30])
  assert task_sizing.derive(lengths)["sampler.max_new_tokens"] == 56  # 50 -> 56
  assert task_sizing.derive(lengths)["sampler.max_total_tokens"] == 72


def test_explicit_length_too_small_names_key_need_and_share():
  lengths = _lengths([60, 62, 64, 70], [3, 3, 3, 5], [3, 3, 3, 5])
  task_sizing.check_length("sampler.max_total_tokens", 75, lengths)  # Fits.
  with pytest.raises(task_sizing.SizingError) as info:
    task_sizing.check_length("sampler.max_total_tokens", 66, lengths)
  assert str(info.value) == (
      "config.sampler.max_total_tokens=66 is too small for 't': prompt and "
      "reply need up to 75 tokens (median 66); 50.0% of 4 sampled problems "
      "would be cut. Raise config.sampler.max_total_tokens to >= 75, or set "
      "it to 0 to derive it from the task.")
  with pytest.raises(task_sizing.SizingError) as info:
    task_sizing.check_length("sampler.max_new_tokens", 4, lengths)
  assert str(info.value) == (
      "config.sampler.max_new_tokens=4 is too small for 't': the longest "
      "action turn (answer or tool call) need up to 5 tokens (median 3); "
      "25.0% of 4 sampled problems would be cut. Raise "
      "config.sampler.max_new_tokens to >= 5, or set it to 0 to derive it "
      "from the task.")


def test_model_vocab_follows_the_tokenizer_padded():
  config = reasoning_gym.get_config()

  class Tok:
    vocab_size = 305

  assert config.model.vocab_size == 0
  assert task_sizing.model_vocab_size(config, Tok()) == 320
  config.model.vocab_size = 305
  assert task_sizing.model_vocab_size(config, Tok()) == 305
  config.model.vocab_size = 294
  with pytest.raises(task_sizing.SizingError) as info:
    task_sizing.model_vocab_size(config, Tok())
  assert str(info.value) == (
      "config.model.vocab_size=294 is smaller than the tokenizer's 305 "
      "pieces: raise it to >= 305, or set it to 0 (the tokenizer's size "
      "rounded up to a multiple of 64).")


def test_validation_accepts_derive_and_names_bad_values():
  config = reasoning_gym.get_config()
  cv.validate_config(config)
  config.sampler.max_total_tokens = -1
  with pytest.raises(cv.ConfigError) as info:
    cv.validate_config(config)
  assert str(info.value) == (
      "config.sampler.max_total_tokens: expected a positive int, or 0 to "
      "derive it from the task, got -1")
  config = reasoning_gym.get_config()
  config.tokenizer.vocab_size = 100
  with pytest.raises(cv.ConfigError) as info:
    cv.validate_config(config)
  assert str(info.value) == (
      f"config.tokenizer.vocab_size: expected int >= {tok_lib.MIN_VOCAB_SIZE}"
      " (256 byte pieces + control and special tokens), or 0 for the size the"
      " corpus supports, got 100")
  # An explicit length still has to agree with an explicit neighbour.
  config = reasoning_gym.get_config()
  config.sampler.max_total_tokens, config.train.max_seq_len = 96, 64
  with pytest.raises(cv.ConfigError) as info:
    cv.validate_config(config)
  assert str(info.value) == (
      "config.train.max_seq_len: expected int >= sampler.max_total_tokens=96,"
      " got 64")


def test_soft_vocab_limit_takes_the_size_the_corpus_supports(tmp_path):
  texts = tok_lib.task_corpus(("chain_sum",), n=200, seed=0)
  with pytest.raises(ValueError) as high:  # The hard limit: an error.
    tok_lib.train_tokenizer(texts, tmp_path / "h.model", 1000)
  most = int(str(high.value).split("at most ")[1].split()[0])
  soft = tok_lib.train_tokenizer_soft(texts, tmp_path / "s.model", target=1000)
  assert soft.vocab_size == most
  # Below what the characters need: exactly what they need.
  with pytest.raises(ValueError) as small:
    tok_lib.train_tokenizer(texts, tmp_path / "l.model", 280)
  need = int(str(small.value).split("need ")[1].split(";")[0])
  assert tok_lib.train_tokenizer_soft(
      texts, tmp_path / "n.model", target=280).vocab_size == need


def test_tokenizer_trains_on_the_runs_own_task(tmp_path):
  config = reasoning_gym.get_config()
  config.env.dataset = "spell_backward"
  config.env.dataset_config.min_word_len = 5
  config.tokenizer.corpus_size = 50
  tok = tok_lib.tokenizer_from_config(config.tokenizer, tmp_path, config.env)
  texts = tok_lib.task_corpus(("spell_backward",), 50, 0,
                              {"spell_backward": {"min_word_len": 5}})
  assert tok.serialized_proto() == tok_lib.train_tokenizer_soft(
      texts, tmp_path / "again.model").serialized_proto()
  assert tok_lib.MIN_VOCAB_SIZE <= tok.vocab_size <= tok_lib.SOFT_VOCAB_SIZE
  with pytest.raises(ValueError, match="no env section"):
    tok_lib.tokenizer_from_config(config.tokenizer, tmp_path / "b")


@pytest.fixture(scope="module")
def letter_counting(tmp_path_factory):
  config = reasoning_gym.get_config()
  config.env.dataset = "letter_counting"
  config.env.size, config.env.eval_size = 300, 64
  config.tokenizer.corpus_size = 200
  tok = tok_lib.tokenizer_from_config(
      config.tokenizer, tmp_path_factory.mktemp("tok"), config.env)
  return config, tok, env_build.build_tasks(config.env)


def test_resolve_derives_what_the_task_needs(letter_counting):
  config, tok, tasks = letter_counting
  resolved = task_sizing.resolve(config, tok, tasks)
  lengths = task_sizing.measure(config, tok, tasks)
  assert len(lengths.total) == 300 + 64  # Every problem of both sets here.
  want = task_sizing.derive(lengths)
  for key, value in want.items():
    section, leaf = key.split(".")
    assert resolved[section][leaf] == value
    assert config[section][leaf] == 0  # The config itself is left as it was.
  assert resolved.model.vocab_size % 64 == 0
  assert 0 <= resolved.model.vocab_size - tok.vocab_size < 64
  # Every sampled demonstration fits what was derived, with room to spare.
  assert lengths.total.max() < resolved.train.sft_max_len
  assert lengths.action.max() < resolved.sampler.max_new_tokens
  # The measurement is of the SFT demonstrations themselves.
  first = demonstrations.demonstration(tasks[0].entry(0), 0, tok)
  assert lengths.total[0] == sum(len(s) for s, _ in first)


def test_resolve_checks_explicit_lengths(letter_counting):
  config, tok, tasks = letter_counting
  lengths = task_sizing.measure(config, tok, tasks)
  config = config.copy_and_resolve_references()
  fits = int(lengths.total.max())
  config.train.sft_max_len = fits
  assert task_sizing.resolve(config, tok, tasks).train.sft_max_len == fits
  short = int(np.median(lengths.total))
  config.train.sft_max_len = short
  cut = np.mean(lengths.total > short)
  with pytest.raises(task_sizing.SizingError) as info:
    task_sizing.resolve(config, tok, tasks)
  assert str(info.value) == (
      f"config.train.sft_max_len={short} is too small for 'letter_counting':"
      f" the SFT demonstrations (prompt and reply) need up to {fits} tokens "
      f"(median {short}); {cut:.1%} of 364 sampled problems would be cut. "
      f"Raise config.train.sft_max_len to >= {fits}, or set it to 0 to "
      "derive it from the task.")
  # Without a warm start (sft_steps=0) sft_max_len is unused, so unchecked.
  config.train.sft_steps = 0
  assert task_sizing.resolve(config, tok, tasks).train.sft_max_len == short
  config.train.sft_steps = 100
  # An explicit length below a derived neighbour it must hold.
  config.train.sft_max_len = 0
  config.train.max_seq_len = fits
  config.sampler.max_new_tokens = 8
  derived_total = task_sizing.derive(lengths)["sampler.max_total_tokens"]
  with pytest.raises(task_sizing.SizingError) as info:
    task_sizing.resolve(config, tok, tasks)
  assert str(info.value) == (
      f"config.train.max_seq_len: expected int >= sampler.max_total_tokens="
      f"{derived_total}, got {fits}")
