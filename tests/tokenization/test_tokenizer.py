"""Tests for sao_jax.tokenization.tokenizer: determinism, round trips, special ids."""

import re

import hypothesis
from hypothesis import strategies as st
import pytest

from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.tokenization import trained_cache

_DATASETS = ("basic_arithmetic", "chain_sum", "leg_counting",
             "letter_counting")
_VOCAB = 400


@pytest.fixture(scope="module")
def corpus():
  return tok_lib.task_corpus(_DATASETS, n=100, seed=0)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "a.model"
  return path, tok_lib.train_tokenizer(corpus, path, _VOCAB, seed=0)


def test_corpus_shape_and_template(corpus):
  assert len(corpus) == 3 * 100 * len(_DATASETS)
  # Per problem: question, dialogue, tool dialogue.
  question, dialogue, tool = corpus[0], corpus[1], corpus[2]
  assert dialogue.startswith(tok_lib.USER + question + tok_lib.END +
                             tok_lib.ASSISTANT)
  assert dialogue.endswith(tok_lib.END)
  assert tok_lib.TOOL_CALL in tool and tok_lib.TOOL_RESULT_END in tool
  assert tok_lib.task_corpus(_DATASETS[:1], n=5, seed=3) == (
      tok_lib.task_corpus(_DATASETS[:1], n=5, seed=3))
  assert tok_lib.task_corpus(_DATASETS[:1], n=5, seed=3) != (
      tok_lib.task_corpus(_DATASETS[:1], n=5, seed=4))


def test_training_is_deterministic(corpus, trained, tmp_path, monkeypatch):
  path, tok = trained
  # Trained again for real: the suite's tokenizer cache is off here.
  monkeypatch.delenv(trained_cache.ENV_VAR, raising=False)
  again = tok_lib.train_tokenizer(corpus, tmp_path / "b.model", _VOCAB, seed=0)
  assert again.serialized_proto() == tok.serialized_proto()
  assert (tmp_path / "b.model").read_bytes() == path.read_bytes()
  assert tok.vocab_size == _VOCAB


def test_load_equals_trained(trained):
  path, tok = trained
  loaded = tok_lib.Tokenizer.load(path)
  assert loaded.serialized_proto() == tok.serialized_proto()
  text = tok_lib.format_prompt("Calculate 12 * 7.") + "84" + tok_lib.END
  assert loaded.encode(text) == tok.encode(text)
  assert loaded.vocab_size == tok.vocab_size


def test_special_ids(trained):
  _, tok = trained
  assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
  assert [tok.id_to_piece(i) for i in range(4)] == [
      "<pad>", "<unk>", "<s>", "</s>"]
  ids = [tok.token_id(s) for s in tok_lib.SPECIAL_TOKENS]
  assert len(set(ids)) == len(ids)
  assert min(ids) >= 4
  for special, tid in zip(tok_lib.SPECIAL_TOKENS, ids):
    assert tok.encode(special) == [tid]
    assert tok.decode([tid]) == special
  # Inside text each markup token stays one id.
  text = tok_lib.format_prompt("2+2") + tok_lib.format_tool_call("2+2")
  enc = tok.encode(text)
  assert enc[0] == tok.token_id(tok_lib.USER)
  assert enc[-1] == tok.token_id(tok_lib.TOOL_CALL_END)
  assert enc.count(tok.token_id(tok_lib.END)) == 1
  with pytest.raises(KeyError, match="not a special token"):
    tok.token_id("<|system|>")
  # Control ids decode to nothing.
  assert tok.decode([tok.bos_id] + tok.encode("ab") + [tok.eos_id, 0]) == "ab"


def test_roundtrip_1000_reasoning_gym_problems(trained):
  _, tok = trained
  import reasoning_gym
  texts = []
  for name in _DATASETS:  # Unseen seed: problems not in the training corpus.
    for entry in reasoning_gym.create_dataset(name, size=250, seed=12345):
      texts.append(entry["question"])
      texts.append(tok_lib.format_prompt(entry["question"]) +
                   tok_lib.format_assistant_turn(str(entry["answer"])))
  assert len(texts) == 2000
  bad = [t for t in texts if tok.decode(tok.encode(t)) != t]
  assert not bad, f"{len(bad)} texts do not round-trip, e.g. {bad[0]!r}"


def test_digits_are_split(trained):
  _, tok = trained
  ids = tok.encode("12345")
  assert [tok.id_to_piece(i) for i in ids] == list("12345")


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.text(alphabet=st.characters(
    blacklist_characters="\u2581", blacklist_categories=("Cs",))))
def test_roundtrip_arbitrary_text(trained, text):
  _, tok = trained
  assert tok.decode(tok.encode(text)) == text


def test_rejects_bad_inputs(corpus, tmp_path):
  with pytest.raises(ValueError, match="too small"):
    tok_lib.train_tokenizer(corpus, tmp_path / "c.model", 100)
  with pytest.raises(ValueError, match="no non-empty texts"):
    tok_lib.train_tokenizer(["", ""], tmp_path / "c.model", _VOCAB)
  with pytest.raises(ValueError, match="larger corpus"):
    tok_lib.train_tokenizer(["ab"], tmp_path / "c.model", 5000)


def test_vocab_size_errors_name_the_size_that_works(tmp_path):
  texts = tok_lib.task_corpus(("chain_sum",), n=200, seed=0)
  with pytest.raises(ValueError) as small:
    tok_lib.train_tokenizer(texts, tmp_path / "a.model", 280)
  need = int(re.search(r"need (\d+);", str(small.value)).group(1))
  assert str(small.value) == (
      f"tokenizer.vocab_size=280 is too small: the corpus's characters and "
      f"the special pieces need {need}; raise tokenizer.vocab_size to >= "
      f"{need} (and model.vocab_size with it).")
  with pytest.raises(ValueError) as high:
    tok_lib.train_tokenizer(texts, tmp_path / "b.model", 1000)
  most = int(re.search(r"at most (\d+) pieces", str(high.value)).group(1))
  assert str(high.value) == (
      f"tokenizer.vocab_size=1000 is too large: {len(texts)} texts give at "
      f"most {most} pieces; lower tokenizer.vocab_size to <= {most}, or use a "
      "larger corpus (tokenizer.corpus_size).")
  # The sizes the messages name do work.
  assert 280 < need <= most < 1000
  for size in (need, most):
    assert tok_lib.train_tokenizer(texts, tmp_path / f"{size}.model",
                                   size).vocab_size == size


def test_parse_tool_call():
  action = "think" + tok_lib.format_tool_call("3 * (4 + 5)")
  assert tok_lib.parse_tool_call(action) == "3 * (4 + 5)"
  assert tok_lib.parse_tool_call("no call" + tok_lib.END) is None
  assert tok_lib.parse_tool_call(tok_lib.TOOL_CALL + "1+") is None
  two = tok_lib.format_tool_call("1") + tok_lib.format_tool_call("2")
  assert tok_lib.parse_tool_call(two) == "2"


def test_tokenizer_from_config(trained, tmp_path):
  import ml_collections
  cfg = ml_collections.ConfigDict(dict(
      path="", vocab_size=300, seed=0, datasets=("chain_sum",),
      corpus_size=50))
  first = tok_lib.tokenizer_from_config(cfg, tmp_path)
  assert first.vocab_size == 300
  model_file = tmp_path / "tokenizer.model"
  assert model_file.read_bytes() == first.serialized_proto()
  # A restart loads the file instead of retraining (a changed seed is moot).
  cfg.seed = 7
  mtime = model_file.stat().st_mtime_ns
  again = tok_lib.tokenizer_from_config(cfg, tmp_path)
  assert again.serialized_proto() == first.serialized_proto()
  assert model_file.stat().st_mtime_ns == mtime
  # An explicit path wins.
  path, tok = trained
  cfg.path = str(path)
  assert tok_lib.tokenizer_from_config(cfg, tmp_path).serialized_proto() == (
      tok.serialized_proto())


def test_ids_past_the_vocabulary_decode_as_unk(trained):
  # A model vocabulary padded past the tokenizer's (model.vocab_size=0) can
  # sample such ids; they must not crash the environment's decode.
  _, tok = trained
  ids = tok.encode("12")
  assert tok.decode(ids + [tok.vocab_size + 3]) == tok.decode(
      ids + [tok_lib.UNK_ID])
  assert tok.decode(ids + [tok.vocab_size + 3]) != tok.decode(ids)


def _count_trainings(monkeypatch) -> list[int]:
  """Counts SentencePiece trainings from now on (they still run)."""
  calls = []
  real = tok_lib.spm.SentencePieceTrainer.train

  def counted(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)

  monkeypatch.setattr(tok_lib.spm.SentencePieceTrainer, "train", counted)
  return calls


def test_cache_returns_the_model_training_makes(corpus, tmp_path,
                                                monkeypatch):
  monkeypatch.delenv(trained_cache.ENV_VAR, raising=False)
  texts = corpus
  uncached = tok_lib.train_tokenizer(texts, tmp_path / "u.model", 380, seed=1)
  cache = tmp_path / "cache"
  monkeypatch.setenv(trained_cache.ENV_VAR, str(cache))
  calls = _count_trainings(monkeypatch)
  first = tok_lib.train_tokenizer(texts, tmp_path / "a.model", 380, seed=1)
  second = tok_lib.train_tokenizer(texts, tmp_path / "b.model", 380, seed=1)
  assert len(calls) == 1  # The second came from the cache.
  assert len(list(cache.glob("*.model"))) == 1
  for tok, name in ((first, "a.model"), (second, "b.model")):
    assert tok.serialized_proto() == uncached.serialized_proto()
    assert (tmp_path / name).read_bytes() == uncached.serialized_proto()
  # Any input that changes the model misses: texts, size, seed, limit.
  tok_lib.train_tokenizer(texts[:-1], tmp_path / "c.model", 380, seed=1)
  tok_lib.train_tokenizer(texts, tmp_path / "d.model", 381, seed=1)
  tok_lib.train_tokenizer(texts, tmp_path / "e.model", 380, seed=2)
  soft = tok_lib.train_tokenizer(texts, tmp_path / "f.model", 380, seed=1,
                                 hard_limit=False)
  assert len(calls) == 5 and len(list(cache.glob("*.model"))) == 5
  assert soft.vocab_size <= 380


def test_cache_key_separates_texts_that_concatenate_alike():
  options = {"vocab_size": 300}
  assert (trained_cache.key(["ab", "c"], options, 0)
          != trained_cache.key(["a", "bc"], options, 0))
  assert (trained_cache.key(["ab"], options, 0)
          != trained_cache.key(["ab"], {"vocab_size": 301}, 0))
  assert (trained_cache.key(["ab"], options, 0)
          == trained_cache.key(["ab"], dict(options), 0))


def test_unusable_cache_entry_is_trained_again(corpus, tmp_path, monkeypatch):
  cache = tmp_path / "cache"
  monkeypatch.setenv(trained_cache.ENV_VAR, str(cache))
  texts = corpus
  good = tok_lib.train_tokenizer(texts, tmp_path / "a.model", 380, seed=3)
  (entry,) = cache.glob("*.model")
  entry.write_bytes(b"not a sentencepiece model")  # A corrupted entry.
  calls = _count_trainings(monkeypatch)
  again = tok_lib.train_tokenizer(texts, tmp_path / "b.model", 380, seed=3)
  assert len(calls) == 1
  assert again.serialized_proto() == good.serialized_proto()
  assert entry.read_bytes() == good.serialized_proto()  # Rewritten.


def test_cache_off_writes_nothing(corpus, tmp_path, monkeypatch):
  monkeypatch.delenv(trained_cache.ENV_VAR, raising=False)
  monkeypatch.chdir(tmp_path)
  calls = _count_trainings(monkeypatch)
  tok_lib.train_tokenizer(corpus, tmp_path / "a.model", 380, seed=4)
  tok_lib.train_tokenizer(corpus, tmp_path / "b.model", 380, seed=4)
  assert len(calls) == 2
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a.model", "b.model"]
