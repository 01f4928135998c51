"""SentencePiece tokenizer and the one chat / tool-call template of sao_jax.

Ids: pad=0, unk=1, bos=2, eos=3, then the chat/tool markup `SPECIAL_TOKENS`,
each a single id (SentencePiece `user_defined_symbols`, matched verbatim in
text). Models are trained with identity normalisation, no dummy prefix, no
whitespace folding and byte fallback, so `decode(encode(x)) == x` for every
string that does not itself contain the SentencePiece meta-symbol U+2581.

Its chat template is `chat_template.SAO_MARKUP` (`Tokenizer.template`); the
module-level `format_*` functions and markup constants are that template's,
kept for the from-scratch path. A pretrained model's own tokenizer and
template: `hf_tokenizer.HFTokenizer`; both satisfy `text_tokenizer.TextTokenizer`.
"""

from __future__ import annotations

import io
import os
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

from absl import logging
import sentencepiece as spm

from sao_jax import reasoning_gym_import
from sao_jax.tokenization.chat_template import ChatTemplate
from sao_jax.tokenization.chat_template import SAO_MARKUP
from sao_jax.tokenization import trained_cache

# The SAO markup under its historical module-level names (one definition:
# `chat_template.SAO_MARKUP`).
USER, ASSISTANT = SAO_MARKUP.special_tokens[:2]
TOOL_CALL, TOOL_CALL_END = SAO_MARKUP.call_open, SAO_MARKUP.call_close
TOOL_RESULT, TOOL_RESULT_END = SAO_MARKUP.result_prefix, SAO_MARKUP.result_suffix
END = SAO_MARKUP.turn_end
SPECIAL_TOKENS = SAO_MARKUP.special_tokens
# Tokens on which the sampler stops an action segment: the end of the turn,
# or a complete tool call (the env then answers with a tool result).
ACTION_STOP_TOKENS = SAO_MARKUP.stop_tokens

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# 256 byte pieces + pad/unk/bos/eos + the markup: below this, byte fallback
# cannot represent arbitrary text.
MIN_VOCAB_SIZE = 256 + 4 + len(SPECIAL_TOKENS)
# `tokenizer.vocab_size = 0` (derive): train with this as a soft limit
# (SentencePiece `hard_vocab_limit=False`: fewer pieces if the corpus gives
# fewer), or with the size the corpus's characters need if that is more.
SOFT_VOCAB_SIZE = 512

format_prompt = SAO_MARKUP.format_prompt
format_assistant_turn = SAO_MARKUP.format_assistant_turn
format_tool_call = SAO_MARKUP.format_tool_call
format_tool_result = SAO_MARKUP.format_tool_result
parse_tool_call = SAO_MARKUP.parse_tool_call


class Tokenizer:
  """A SentencePiece model with sao_jax's special ids and `SAO_MARKUP`."""

  template: ChatTemplate = SAO_MARKUP

  def __init__(self, model_proto: bytes):
    self._proto = bytes(model_proto)
    self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
    expected = {"pad": (PAD_ID, self._sp.pad_id()),
                "unk": (UNK_ID, self._sp.unk_id()),
                "bos": (BOS_ID, self._sp.bos_id()),
                "eos": (EOS_ID, self._sp.eos_id())}
    for name, (want, got) in expected.items():
      if want != got:
        raise ValueError(
            f"SentencePiece model has {name}_id={got}, sao_jax needs {want}; "
            "train it with sao_jax.tokenization.tokenizer.train_tokenizer.")
    self._special = {}
    for tok in SPECIAL_TOKENS:
      tid = self._sp.piece_to_id(tok)
      if tid == self._sp.unk_id() or self._sp.id_to_piece(tid) != tok:
        raise ValueError(
            f"SentencePiece model lacks the special token {tok!r}; train it "
            "with sao_jax.tokenization.tokenizer.train_tokenizer.")
      self._special[tok] = tid

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
    """Reads a serialized `.model` file."""
    with open(path, "rb") as f:
      return cls(f.read())

  def save(self, path: str | os.PathLike[str]) -> None:
    with open(path, "wb") as f:
      f.write(self._proto)

  def serialized_proto(self) -> bytes:
    return self._proto

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def pad_id(self) -> int:
    return PAD_ID

  @property
  def unk_id(self) -> int:
    return UNK_ID

  @property
  def bos_id(self) -> int:
    return BOS_ID

  @property
  def eos_id(self) -> int:
    return EOS_ID

  @property
  def special_ids(self) -> dict[str, int]:
    """Map from each of `SPECIAL_TOKENS` to its id."""
    return dict(self._special)

  def token_id(self, special: str) -> int:
    """The id of one of `SPECIAL_TOKENS`."""
    try:
      return self._special[special]
    except KeyError:
      raise KeyError(
          f"{special!r} is not a special token; expected one of "
          f"{SPECIAL_TOKENS}.") from None

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end an action segment: end of turn, end of call, eos."""
    return tuple(self._special[t] for t in ACTION_STOP_TOKENS) + (EOS_ID,)

  def encode(self, text: str) -> list[int]:
    """Token ids of `text` (no bos/eos added)."""
    return self._sp.encode(text, out_type=int)

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`; pad/bos/eos decode to the empty string.

    An id past the vocabulary (a model whose vocabulary is padded beyond the
    tokenizer's, `model.vocab_size=0`, may sample one) decodes as unk.
    """
    size = self._sp.get_piece_size()
    return self._sp.decode([int(i) if 0 <= int(i) < size else UNK_ID
                            for i in ids])

  def id_to_piece(self, token_id: int) -> str:
    return self._sp.id_to_piece(int(token_id))


def train_tokenizer(texts: Iterable[str], out_path: str | os.PathLike[str],
                    vocab_size: int, seed: int = 0,
                    hard_limit: bool = True) -> Tokenizer:
  """Trains a deterministic unigram SentencePiece model on `texts`.

  Same texts, vocab size and seed give a byte-identical model file (single
  thread, no sentence shuffling, fixed random seed); so with
  `SAO_JAX_TOKENIZER_CACHE` set, a model trained before on the same inputs
  is taken from that cache instead (`trained_cache`).

  Args:
    texts: training sentences (may contain the special tokens and newlines).
    out_path: where the serialized model is written.
    vocab_size: vocabulary size (exact, or at most with `hard_limit=False`);
      at least `MIN_VOCAB_SIZE`.
    seed: SentencePiece's random generator seed.
    hard_limit: False: `vocab_size` is an upper bound (SentencePiece
      `hard_vocab_limit=False`), so a small corpus gives fewer pieces.

  Returns:
    The trained tokenizer.
  """
  if vocab_size < MIN_VOCAB_SIZE:
    raise ValueError(
        f"vocab_size={vocab_size} is too small: byte fallback needs at least "
        f"{MIN_VOCAB_SIZE} (256 bytes + 4 control ids + "
        f"{len(SPECIAL_TOKENS)} special tokens).")
  texts = [t for t in texts if t]
  if not texts:
    raise ValueError("train_tokenizer got no non-empty texts.")
  options = dict(
      vocab_size=vocab_size,
      model_type="unigram",
      character_coverage=1.0,
      byte_fallback=True,
      split_digits=True,
      normalization_rule_name="identity",
      add_dummy_prefix=False,
      remove_extra_whitespaces=False,
      allow_whitespace_only_pieces=True,
      user_defined_symbols=list(SPECIAL_TOKENS),
      pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
      pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>",
      eos_piece="</s>",
      num_threads=1,
      input_sentence_size=len(texts),
      shuffle_input_sentence=False,
      max_sentence_length=1 << 16,
      minloglevel=2,
      hard_vocab_limit=hard_limit,
  )
  digest = trained_cache.key(texts, options, seed)
  proto = trained_cache.lookup(digest)
  cached = proto is not None
  if not cached:
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(texts), model_writer=model, **options)
    except RuntimeError as e:
      raise ValueError(
          _training_error(str(e), vocab_size, len(texts))) from e
    proto = model.getvalue()
    trained_cache.store(digest, proto)
  out_dir = os.path.dirname(os.fspath(out_path))
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
  # Write-then-rename: a run killed mid-write, or another host of a
  # multi-host run loading it, never sees a half-written file.
  tmp = f"{os.fspath(out_path)}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(proto)
  os.replace(tmp, out_path)
  tokenizer = Tokenizer(proto)
  logging.info("%s %d-piece tokenizer (%s %d) on %d texts -> %s",
               "Reused a cached" if cached else "Trained a",
               tokenizer.vocab_size,
               "exactly" if hard_limit else "at most", vocab_size, len(texts),
               out_path)
  return tokenizer


def train_tokenizer_soft(texts: Sequence[str],
                         out_path: str | os.PathLike[str], seed: int = 0,
                         target: int = SOFT_VOCAB_SIZE) -> Tokenizer:
  """A tokenizer of the size the corpus supports (`tokenizer.vocab_size=0`).

  At most `target` pieces (soft limit); if the corpus's characters and the
  special pieces need more, exactly as many as they need.
  """
  try:
    return train_tokenizer(texts, out_path, target, seed, hard_limit=False)
  except ValueError as e:
    if not (m := _TOO_SMALL_RE.search(str(e.__cause__))):
      raise
  need = int(m.group(2))
  logging.info("The corpus's characters need %d pieces (> %d).", need, target)
  return train_tokenizer(texts, out_path, need, seed, hard_limit=False)


_TOO_SMALL_RE = re.compile(r"smaller than required_chars\. (\d+) vs (\d+)")
_TOO_HIGH_RE = re.compile(r"too high \((\d+)\)\. Please set it to a value <= (\d+)")


def _training_error(message: str, vocab_size: int, num_texts: int) -> str:
  """What to change when SentencePiece training fails (its message parsed)."""
  if m := _TOO_SMALL_RE.search(message):
    need = int(m.group(2))
    return (f"tokenizer.vocab_size={vocab_size} is too small: the corpus's "
            f"characters and the special pieces need {need}; raise "
            f"tokenizer.vocab_size to >= {need} (and model.vocab_size with "
            "it).")
  if m := _TOO_HIGH_RE.search(message):
    most = int(m.group(2))
    return (f"tokenizer.vocab_size={vocab_size} is too large: {num_texts} "
            f"texts give at most {most} pieces; lower tokenizer.vocab_size "
            f"to <= {most}, or use a larger corpus (tokenizer.corpus_size).")
  return (f"SentencePiece training failed for tokenizer.vocab_size="
          f"{vocab_size} on {num_texts} texts ({message}); use a larger "
          "corpus or a smaller vocab_size.")


# Task sets that are not reasoning-gym's: name -> n -> (question, answer)
# pairs (envs/function_tasks.py registers 'codeio').
CORPUS_SOURCES: dict[str, Callable[[int], list[tuple[str, str]]]] = {}


def task_corpus(dataset_names: Sequence[str], n: int, seed: int,
                dataset_configs: Mapping[str, Mapping[str, Any]] | None = None
                ) -> list[str]:
  """Tokenizer training text from reasoning-gym tasks in the chat template.

  For each dataset, `n` problems (`reasoning_gym.create_dataset(name, size=n,
  seed=seed, **dataset_configs.get(name, {}))`) each give the question alone, a full single-turn dialogue
  ending in the answer, and a tool-use dialogue (calling the tool with the
  problem's `metadata['expression']` when it has one, else with the answer).

  Returns:
    `3 * n * len(dataset_names)` strings, in a deterministic order.
  """
  reasoning_gym = reasoning_gym_import.import_reasoning_gym(
      [n for n in dataset_names if n not in CORPUS_SOURCES])

  texts = []
  configs = dict(dataset_configs or {})
  for name in dataset_names:
    if name in CORPUS_SOURCES:  # Not reasoning-gym's: no tool dialogue.
      for question, answer in CORPUS_SOURCES[name](n):
        texts.append(question)
        texts.append(format_prompt(question) + format_assistant_turn(answer))
      continue
    for entry in reasoning_gym.create_dataset(
        name, size=n, seed=seed, **dict(configs.get(name) or {})):
      question, answer = entry["question"], str(entry["answer"])
      expr = str(entry.get("metadata", {}).get("expression", answer))
      texts.append(question)
      texts.append(format_prompt(question) + format_assistant_turn(answer))
      texts.append(
          format_prompt(question) + format_tool_call(expr)
          + format_tool_result(answer) + format_assistant_turn(answer))
  return texts


def tokenizer_from_config(config: Any, workdir: str | os.PathLike[str],
                          env: Any = None) -> Any:
  """The run's tokenizer from the `config.tokenizer` section.

  `config.path` set: that model file, or that HF model directory (its
  `tokenizer.json` and chat template, `hf_tokenizer.HFTokenizer`, rendered
  with `_template_settings(env)`).
  Otherwise `<workdir>/tokenizer.model`, trained on `task_corpus(
  config.datasets, config.corpus_size, config.seed)` on the first start and
  loaded again on restarts (so a resumed run keeps its ids). Settings that
  follow the task (docs/design/envs.md "Settings that follow the task"):
  `datasets=()` is the run's own task, `env.dataset` with its
  `env.dataset_config` (`env`: the `config.env` section); `vocab_size=0`
  is the size the corpus supports (`train_tokenizer_soft`).
  """
  if config.path and os.path.isdir(config.path):  # A pretrained model's own.
    from sao_jax.tokenization import hf_tokenizer  # pylint: disable=g-import-not-at-top
    return hf_tokenizer.HFTokenizer.load(config.path,
                                         **_template_settings(env))
  if config.path:
    return Tokenizer.load(config.path)
  path = os.path.join(os.fspath(workdir), "tokenizer.model")
  if os.path.exists(path):
    logging.info("Loading the run's tokenizer from %s", path)
    return Tokenizer.load(path)
  datasets, configs = tuple(config.datasets), {}
  if not datasets:
    if env is None:
      raise ValueError("tokenizer.datasets=() means the run's own task, but "
                       "no env section was given to read it from.")
    datasets = (str(env.dataset),)
    configs = {str(env.dataset): dict(env.dataset_config)}
  texts = task_corpus(datasets, config.corpus_size, config.seed, configs)
  if not config.vocab_size:
    return train_tokenizer_soft(texts, path, seed=config.seed)
  return train_tokenizer(texts, path, config.vocab_size, seed=config.seed)


TOOL_ENVS = ("tool", "tool_longtail")  # env.name values that call the tool.


def _template_settings(env: Any) -> dict[str, Any]:
  """A HF chat template's inputs from the `env` section (docs/design/models.md
  "Tokenizer and chat template").

  `env.chat_template_kwargs`: template variables (Qwen3's
  `enable_thinking=False`, Llama 3's `date_string`); `env.system_prompt`: a
  system message ("" for none; Gemma folds it into the first user turn); the
  calculator tool is declared to the template when `env.name` calls it.
  """
  if env is None:
    return {}
  from sao_jax.tokenization import jinja_template  # pylint: disable=g-import-not-at-top
  return {"template_kwargs": dict(env.get("chat_template_kwargs") or {}),
          "system": str(env.get("system_prompt") or ""),
          "tools": ([jinja_template.CALCULATOR_TOOL]
                    if env.get("name") in TOOL_ENVS else None)}
