"""Every command README.md and BENCHMARKS.md tell a user to type runs.

The commands are read out of the documents' fenced code blocks (so the two
cannot drift apart) and run in a tiny form: from the checkout's root, with the
checkout's interpreter and no ``PYTHONPATH`` (README's install: the editable
package; ``configs/`` and the experiments' own folders are found as a user
finds them), paths under ``/tmp``, ``runs/`` and ``$HOME`` moved into the
test's directory, and each script's or module's extra flags from ``TINY``
appended (the later flag wins). A documented command whose script or module
has no entry in ``TINY`` fails the test: a new command gets a tiny form (one
line here) when it is documented, so CI runs it. A tiny form runs once per
session, in whichever test process gets to it first: a command quoted twice,
two that differ only in options their tiny flags override or never read
(``effective_argv``, ``Tiny.moot``), or only in a ``--workdir`` that nothing
later in its block reads (``_generic``). The SmolLM2 commands find a
one-layer SmolLM2 with narrow widths and random weights, with the converted
checkpoint's tokenizer and vocabulary (``smollm2_tiny_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
import resource
import shlex
import subprocess
import sys

import pytest

import fresh_process

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "BENCHMARKS.md")

# A model of a few thousand parameters and one RL step: what makes a
# `sao_jax.main` run tiny whatever its config (its task stays the config's).
_TINY_MODEL = {
    "model.hidden_size": 32, "model.intermediate_size": 64,
    "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 1,
    "model.head_dim": 16,
}
_TINY_RUN = {
    "train.num_steps": 1, "train.sft_steps": 0, "train.eval_every": 0,
    "rl.critic_warmup_steps": 0, "env.eval_size": 2, "train.batch_size": 4,
    "sampler.batch_size": 4, "tokenizer.corpus_size": 2000,
    "train.checkpoint_every": 0,
}


def _config_flags(overrides: dict) -> tuple[str, ...]:
  return tuple(f"--config.{k}={v}" for k, v in overrides.items())


# The loop benchmarks' (experiments/bench/loop_setup.py) tiny model and
# batches, as their `--set` overrides.
_LOOP_SETS = tuple(f"--set={k}={v}" for k, v in {
    **_TINY_MODEL, "train.batch_size": 4, "sampler.batch_size": 4}.items())


_MAIN = _config_flags({**_TINY_MODEL, **_TINY_RUN})
# The checkpoint placed for the documents' SmolLM2 commands
# (smollm2_tiny_checkpoint): SmolLM2's tokenizer, vocabulary and chat
# template, one layer at these widths (its configs name SmolLM2's own, which
# init_from checks against the checkpoint). At SmolLM2's widths a tiny form's
# step, evaluations and checkpoint were over half its CPU time (README's codeio
# run 38 -> 16 CPU-s, its SmolLM2 run 24 -> 10, the compilation cache warm).
_SMOLLM2_TINY = {"model.num_layers": 1, "model.hidden_size": 64,
                 "model.intermediate_size": 128, "model.num_heads": 2,
                 "model.num_kv_heads": 1, "model.head_dim": 32}
# One row a batch: a row of the real vocabulary costs what a tiny model's
# whole step does (README's codeio run 69 -> 50 CPU-s at two rows, 59 -> 51
# from two to one with the compilation cache warm).
_MAIN_PRETRAINED = _config_flags({**_SMOLLM2_TINY, **_TINY_RUN,
                                  "train.batch_size": 1,
                                  "sampler.batch_size": 1})
# `sao_jax.aot`'s tiny form: one layer's decode chunk, small vocabulary.
_AOT_TINY = ("--config.model.num_layers=1", "--config.model.vocab_size=1024",
             "--programs=sampler_decode", "--nosearch_slots")


@dataclasses.dataclass(frozen=True)
class Tiny:
  """How a documented command runs in CI.

  Attributes:
    args: Flags appended to the documented command.
    env: Environment variables it runs with.
    drop: Options of the documented command left out (with their value), and
      why in ``why``.
    moot: Options of the documented command (each with a value) that the
      tiny form never reads: still passed, but two commands that differ only in
      them run one tiny form (``effective_argv``); why in ``why``.
    ci: Not run here: what runs it in CI instead (``.ci/run``'s phases, or a
      test, ``tests/<file>.py::<test>``, that runs its tiny form and checks
      its output: test_a_test_that_runs_a_command_runs_it checks the
      command's options are that test's).
    why: Why something is dropped or run elsewhere.
    smollm2: Reads the converted SmolLM2 from its default place though its
      command does not name it (commands that name it get it anyway).
  """

  args: tuple[str, ...] = ()
  env: tuple[tuple[str, str], ...] = ()
  drop: tuple[str, ...] = ()
  moot: tuple[str, ...] = ()
  ci: str = ""
  why: str = ""
  smollm2: bool = False


_CI_INSTALL = (".ci/run phases 2-3 (README's install and test commands and its "
               "'Rollout engines' install, verbatim)")

# Script, module or program of a documented command -> its tiny form. A
# `sao_jax.main` command with another config may have its own entry,
# "sao_jax.main configs/<name>.py". New commands: add one line.
TINY: dict[str, Tiny] = {
    "venv": Tiny(ci=_CI_INSTALL),
    "pip": Tiny(ci=_CI_INSTALL),
    "pytest": Tiny(ci=".ci/run phase 3 (the whole suite)"),
    "echo": Tiny(ci=".ci/run phase 5 (writes .venv/bazelrc)"),
    "bazel": Tiny(ci=".ci/run phase 5 (bazel build //:all_tests, "
                  "bazel test //:smoke_tests)"),
    "sao_jax.main": Tiny(args=_MAIN),
    "sao_jax.main configs/smollm2.py": Tiny(args=_MAIN_PRETRAINED),
    # README's one-override task switch is test_any_task's run of the same
    # command (its letter_counting row among five tasks), which checks more.
    "sao_jax.main configs/reasoning_gym.py": Tiny(
        ci="tests/envs/test_any_task.py::test_one_override_switches_the_task",
        why="the test runs it for letter_counting and four other tasks"),
    # Four codeio training tasks, two held out: a sandbox call each makes
    # their hidden tests.
    "sao_jax.main configs/smollm2_codeio.py": Tiny(
        args=(*_MAIN_PRETRAINED, "--config.env.size=4")),
    # The block's run's checkpoint (or the one-layer SmolLM2 where nothing
    # ran: the repair command), two held-out problems, two samples each.
    "sao_jax.evaluate": Tiny(args=(
        *_config_flags({**_SMOLLM2_TINY, "train.sft_steps": 0,
                        "env.size": 4, "env.eval_size": 2}),
        "--samples=2", "--k=1,2")),
    "sao_jax.models.convert": Tiny(),  # Once: a converted copy is kept.
    "experiments/sweep.py": Tiny(
        args=tuple(f"--main_flag={f}" for f in _MAIN)),
    "experiments/report.py": Tiny(),
    "experiments/accelerator_smollm2.sh": Tiny(
        args=_MAIN_PRETRAINED + ("--config.model.dtype=float32",),
        env=(("TRAIN_S", "1"), ("STEPS", "1"),
             ("BENCH_ARGS", "--matmul_n=64 --repeats=1 --warmup=0 --batch=1 "
              "--seq=16 --num_layers=1 --vocab_size=256 --dtype=float32 "
              "--matmul_dtype=float32"))),
    "experiments/bench/ring.py": Tiny(
        args=("--repeats", "1", "--total_mib", "1", "--sizes", "4096",
              "--no-native"),
        drop=("--xxhash_include",),
        why="xxhash.h comes from a downloaded sdist; the C bound is skipped"),
    "experiments/bench/ring_routing.py": Tiny(
        args=("--repeats=1", "--tokens=64", "--total_mib=1")),
    # At 16 cache slots the four `--layers both` commands (512 to 32k slots)
    # are one tiny form; the long caches' figures are the benchmark's.
    "experiments/bench/decode.py": Tiny(
        args=("--repeats=1", "--new_tokens=2", "--batch=2", "--prompt_len=4",
              "--vocab=64", "--max_total_tokens=16")),
    "experiments/bench/train_step.py": Tiny(
        args=("--repeats=1", "--warmup=0", "--matmul_n=64",
              "--sizes=quickstart", "--batch=1", "--seq=16",
              "--num_layers=1", "--vocab_size=256")),
    "experiments/bench/weights.py": Tiny(
        args=("--repeats=1", "--model=quickstart")),
    "experiments/bench/async_vs_sync.py": Tiny(  # 3 steps: one steady step.
        args=("--repeats=1", "--warmup_rounds=0", "--steps=3", "--arms=async",
              "--tool_latency_s=0.05", "--max_new_tokens=16", *_LOOP_SETS)),
    "experiments/bench/record.py": Tiny(
        args=("--repeats=1", "--warmup_rounds=0", "--steps=1",
              "--trajectories=16", "--seq_len=32", *_LOOP_SETS)),
    "experiments/bench/quickstart.py": Tiny(
        args=("--repeats=1", "--arms=continuous",
              *(f"--main_flag={f}" for f in _MAIN))),
    "experiments/bench/attention.py": Tiny(
        args=("--figures", "core", "--lengths", "16", "--batch", "1",
              "--layers", "1", "--block", "8", "--repeats", "1")),
    "experiments/bench/packing.py": Tiny(
        args=("--record_steps=3", "--max_segments=2", "--repeats=1",
              "--steps_per_repeat=1", *_LOOP_SETS,
              "--set=env.longtail_tool_latency_s=0.05")),
    "experiments/bench/sandbox.py": Tiny(
        args=("--calls", "3", "--repeats", "1", "--workers", "1",
              "--arms", "bare,warm,strict_paced", "--pace_ms", "1")),
    "experiments/bench/scan_layers.py": Tiny(
        args=("--figures=compile", "--depths=1,2", "--seq=16",
              "--arms=scan", "--repeats=1", "--warmup=0"),
        moot=("--model", "--repeats", "--skip_unrolled"),
        why="the compile figure reads neither --model nor --repeats (the "
        "step figure's), and compiles no unrolled arm to skip"),
    # The new arm only: the dense and logits_chunk arms' figures (and their
    # gap) are tests/experiments/test_bench_long_context.py's tiny form's.
    "experiments/bench/long_context.py": Tiny(
        args=("--figures=memory", "--seqs=32", "--vocab=256", "--layers=1",
              "--arms=new"),
        moot=("--smollm2_layers", "--repeats", "--warmup"),
        why="the memory figure reads none of the smollm2 figure's flags"),
    # One layer, the decode chunk only, over a 1,024-token vocabulary: the
    # command and its report, cheaply (tests/aot/test_aot.py compiles SmolLM2
    # whole and the oversized case; the LM head over Qwen2.5's 152k
    # vocabulary was half of a tiny form's CPU time).
    "sao_jax.aot": Tiny(args=_AOT_TINY, env=tuple(fresh_process.TPU_ENV.items())),
    # Its tiny form is a test's: one repeat of the layer pattern
    # (`configs/qwen3_5_hybrid.py:4`; a scanned program compiles one repeat's
    # body at any depth; `--config.model.num_layers=1` would leave the whole
    # model's 32 layer types), both programs, 128 tokens, each report checked.
    "sao_jax.aot configs/qwen3_5_hybrid.py": Tiny(
        ci="tests/aot/test_qwen3_5_hybrid.py::"
        "test_one_pattern_repeat_compiles_for_a_v5p_64 (in .ci/run phase 3)"),
    # One MoE layer, the decode chunk (the 4-layer shapes' counts are
    # tests/aot/test_deepseek_v3_4l.py's). Not one dense layer: a MoE config
    # whose layers are all dense does not decode yet (routing replay's
    # record expects a MoE layer), a known gap.
    "sao_jax.aot configs/deepseek_v3_4l.py": Tiny(
        args=(*_AOT_TINY, "--config.model.first_dense_layers=0"),
        env=tuple(fresh_process.TPU_ENV.items())),
    # The reference and one 2-device mesh, one layer, a few tokens.
    "experiments/bench/sampler_mesh.py": Tiny(
        args=("--repeats=1", "--meshes", "1,1,2", "--devices=2",
              "--layers=1", "--hidden=64", "--vocab=256", "--batch=4",
              "--new_tokens=4")),
    # The native arm only: vLLM's engine (start, episodes, push) is
    # tests/sampler/test_vllm_engine.py's; a second vLLM start here would cost
    # ~50 CPU-s for the same path.
    "experiments/bench/rollout_engines.py": Tiny(
        args=("--episodes=2", "--new_tokens=4", "--repeats=1",
              "--arms=native"), smollm2=True),
    "experiments/bench/soak.py": Tiny(
        args=("--steps=6", "--checkpoint_every=2", "--resumes=1",
              "--kill_every_s=1e6", "--nobaseline",
              *(f"--main_flag={f}" for f in _config_flags(_TINY_MODEL)))),
}

_PYTHONS = ("python", "python3", ".venv/bin/python", ".venv/bin/python3")


@dataclasses.dataclass
class Command:
  """One documented command: where it is and what it runs."""

  document: str
  block: int  # 1-based index of its fenced block in the document.
  text: str

  @property
  def argv(self) -> list[str]:
    return shlex.split(self.text, comments=True)

  @property
  def key(self) -> str:
    """Its script, module or program (the ``TINY`` key)."""
    argv = self.argv
    while argv and re.match(r"^[A-Z_]+=", argv[0]):
      argv = argv[1:]  # VAR=value prefixes.
    prog = argv[0]
    if prog in _PYTHONS:
      if argv[1:3] == ["-m", "venv"]:
        return "venv"
      if argv[1] == "-m":
        config = next((a.split("=", 1)[1] for a in argv
                       if a.startswith("--config=")), None)
        specific = f"{argv[2]} {config}"
        return specific if specific in TINY else argv[2]
      return argv[1]
    if prog == "bash":
      return argv[1]
    return os.path.basename(prog)


def documented_commands() -> list[Command]:
  """The commands of both documents' fenced code blocks (output lines, such
  as JSON figures, and comments left out; ``\\`` continuations joined;
  ``&&`` chains split; ``[--optional]`` brackets opened)."""
  out = []
  for doc in DOCUMENTS:
    text = (REPO / doc).read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    for i, block in enumerate(blocks, 1):
      joined = re.sub(r"\\\n\s*", " ", block)
      for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "{")):
          continue
        line = re.sub(r"\[(--[^\]]*)\]", r"\1", line)
        for part in line.split("&&"):
          out.append(Command(doc, i, part.strip()))
  return out


def _blocks() -> dict[tuple[str, int], list[Command]]:
  blocks: dict[tuple[str, int], list[Command]] = {}
  for cmd in documented_commands():
    blocks.setdefault((cmd.document, cmd.block), []).append(cmd)
  return blocks


def test_every_documented_command_has_a_tiny_form():
  commands = documented_commands()
  assert len(commands) >= 20, [c.text for c in commands]
  missing = sorted({f"{c.key}  ({c.document} block {c.block}: {c.text})"
                    for c in commands if c.key not in TINY})
  assert not missing, (
      "Documented commands with no tiny form in TINY "
      "(tests/experiments/test_documented_commands.py), so CI would not run "
      f"them: {missing}")
  # And the table holds nothing that is no longer documented.
  keys = {c.key for c in commands}
  assert set(TINY) - keys == set(), set(TINY) - keys


def test_a_test_that_runs_a_command_runs_it():
  """A command whose tiny form is a test's: that test exists and passes the
  documented command's module, config file, topology and programs, and its
  file holds the value of each of the command's config overrides."""
  named = [c for c in documented_commands()
           if TINY[c.key].ci.startswith("tests/")]
  assert named, "no documented command names a test as its tiny form"
  for cmd in named:
    path, _, test = TINY[cmd.key].ci.split()[0].partition("::")
    source = (REPO / path).read_text()
    body = source.split(f"def {test}(", 1)
    assert len(body) == 2, f"{path} has no {test} ({cmd.text})"
    body = body[1].split("\ndef ", 1)[0]
    module = cmd.argv[2] if cmd.argv[1] == "-m" else cmd.argv[1]
    assert (module == "sao_jax.aot" and "fresh_process.aot(" in body
            or module in body), (module, path, test)
    for a in cmd.argv[1:]:
      name, _, value = a.partition("=")
      if name in ("--topology", "--programs"):
        assert f'"{a}"' in body, (a, path, test)
      elif name == "--config":
        assert f'"--config={value}:' in body or f'"{a}"' in body, (a, test)
      elif name.startswith("--config."):  # A value the test file passes.
        assert f'"{value}"' in source, (a, path, test)


def test_the_parser_finds_chains_continuations_and_options():
  by_key = {}
  for c in documented_commands():
    by_key.setdefault(c.key, []).append(c)
  ring = by_key["experiments/bench/ring.py"][0].argv
  assert "--xxhash_include" in ring and "1048576" in ring  # Continued lines.
  sweep = by_key["experiments/sweep.py"][0].argv
  assert "--parallel=2" in sweep and "--only=sao_eta4" in sweep
  assert "sao_jax.main configs/smollm2.py" in by_key
  assert not any(c.text.startswith("{") for c in documented_commands())


def test_effective_argv_drops_overridden_repeated_and_moot_options():
  tiny = Tiny(args=("--steps=1", "--set=a=1", "--set=b=2"),
              moot=("--model", "--repeats"))
  argv = ["prog", "--steps=20", "--set=a=1", "--set=c=3", "--model=large",
          "--repeats", "5", "--seq=8", "--steps", "30", "--set", "d=4",
          *tiny.args]
  assert effective_argv(argv, tiny) == [
      "prog", "--set=c=3", "--seq=8", "--set", "d=4", "--steps=1",
      "--set=a=1", "--set=b=2"]
  # The documents' three scan_layers commands are one tiny form, and so are
  # three of long_context's six (the others: the new_unrolled and
  # new_dots arms' --set overrides, and the hybrid model).
  # And decode's five are two (the four random-model commands' batches and
  # cache lengths, two words each, are the tiny form's; SmolLM2's is its own).
  for key, runs in (("experiments/bench/scan_layers.py", 1),
                    ("experiments/bench/long_context.py", 4),
                    ("experiments/bench/decode.py", 2)):
    forms = {shlex.join(effective_argv(c.argv + list(TINY[c.key].args),
                                       TINY[c.key]))
             for c in documented_commands() if c.key == key}
    assert len(forms) == runs, forms


@functools.cache
def _installed_sao_jax() -> str:
  """Where this interpreter imports sao_jax from outside the checkout."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return subprocess.run(
      [sys.executable, "-c", "import sao_jax, os; "
       "print(os.path.dirname(os.path.dirname(sao_jax.__file__)))"],
      cwd="/", env=env, capture_output=True, text=True).stdout.strip()


def _environment(tmp: pathlib.Path, tiny: Tiny) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "XDG_CACHE_HOME")}
  if _installed_sao_jax() != str(REPO):
    # A worktree sharing another checkout's venv (development): the
    # checkout's code must win. CI's venv is this checkout's own.
    env["PYTHONPATH"] = str(REPO)
  env.update(HOME=str(tmp / "home"), PYTHON=sys.executable,
             JAX_PLATFORMS="cpu", **dict(tiny.env))
  return env


def tiny_smollm2(converted: pathlib.Path, out: pathlib.Path) -> None:
  """Writes into ``out`` a SmolLM2 of one layer at ``_SMOLLM2_TINY``'s widths
  with random weights (hf_reference.save_random_model), and the converted
  checkpoint's tokenizer files and config.json otherwise."""
  transformers = pytest.importorskip("transformers")
  import hf_reference  # pylint: disable=g-import-not-at-top
  out.mkdir(parents=True)
  for f in converted.iterdir():
    if f.suffix != ".safetensors" and f.name != "config.json":
      (out / f.name).write_bytes(f.read_bytes())
  hf_config = json.loads((converted / "config.json").read_text())
  widths = {k.split(".", 1)[1]: v for k, v in _SMOLLM2_TINY.items()}
  hf_config.update(
      num_hidden_layers=widths["num_layers"],
      hidden_size=widths["hidden_size"],
      intermediate_size=widths["intermediate_size"],
      num_attention_heads=widths["num_heads"],
      num_key_value_heads=widths["num_kv_heads"],
      head_dim=widths["head_dim"])
  config = transformers.AutoConfig.for_model(**hf_config)
  hf_reference.save_random_model(
      getattr(transformers, hf_config["architectures"][0]), config, out)


@pytest.fixture(scope="session")
def smollm2_tiny_checkpoint(pytestconfig, tmp_path_factory) -> pathlib.Path:
  """What the documents' SmolLM2 commands load in their tiny forms
  (``TINY`` gives them ``_SMOLLM2_TINY``'s widths to match): the suite's one
  conversion's tokenizer and vocabulary, one narrow layer. The conversion
  command itself runs, finding a complete checkpoint; the real model's
  conversion, weights and parity are tests/models/test_smollm2_parity.py's,
  its TPU compile tests/aot/test_aot.py's."""
  import smollm2_checkpoint  # pylint: disable=g-import-not-at-top
  out = tmp_path_factory.mktemp("smollm2") / "tiny"
  tiny_smollm2(pathlib.Path(smollm2_checkpoint.converted_dir(pytestconfig)),
               out)
  return out


def _shared_smollm2(home: pathlib.Path, checkpoint: pathlib.Path) -> None:
  """``checkpoint`` where the documents' commands look for the converted
  SmolLM2 (``~/.cache/sao_jax/smollm2``)."""
  target = home / ".cache" / "sao_jax" / "smollm2"
  target.parent.mkdir(parents=True, exist_ok=True)
  if not target.exists():
    target.symlink_to(checkpoint)


def tiny_argv(cmd: Command, tmp: pathlib.Path,
              env: dict[str, str]) -> list[str] | None:
  """The command's tiny form in ``env`` (None: CI runs it elsewhere)."""
  tiny = TINY[cmd.key]
  if tiny.ci:
    return None
  argv = cmd.argv
  while argv and re.match(r"^[A-Z_]+=", argv[0]):
    argv = argv[1:]
  if argv[0] in _PYTHONS:
    argv = [sys.executable, *argv[1:]]
  kept, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    name = a.split("=", 1)[0]
    if name in tiny.drop:
      skip = "=" not in a
      continue
    kept.append(a)
  # The documents' /tmp/ and runs/ go under the test's directory; the
  # interpreter stays where it is (a checkout under /tmp has its venv there).
  moved = [a if a == sys.executable else
           _expand(re.sub(r"^(--[\w.]+=)?runs/", rf"\g<1>{tmp}/runs/",
                          a.replace("/tmp/", f"{tmp}/tmp/")), env)
           for a in kept]
  return moved + list(tiny.args)


def effective_argv(argv: list[str], tiny: Tiny) -> list[str]:
  """What ``argv`` (a tiny form) runs: less the documented ``--flag=value``
  (or ``--flag value``) options that a flag given once in ``tiny.args``
  overrides (the later flag wins), less those ``tiny.args`` repeats verbatim
  (a repeated flag, ``--main_flag`` or ``--set``, given the same value again
  changes nothing),
  and less the ``tiny.moot`` options (``--flag=value`` or ``--flag value``).
  Two commands that differ only there run the same tiny form."""
  names = [a.split("=", 1)[0] for a in tiny.args if a.startswith("--")]
  once = {n for n in names if names.count(n) == 1}
  # Flags the tiny form gives a value once (`--flag=value`): the documented
  # `--flag value` (two words) is overridden too.
  valued = {a.split("=", 1)[0] for a in tiny.args if "=" in a} & once
  documented = argv[:len(argv) - len(tiny.args)]
  kept, skip = [], False
  for a in documented:
    if skip:
      skip = False
    elif a in tiny.moot or a in valued:
      skip = True  # And its value.
    elif a not in tiny.args and not (
        a.startswith("--") and "=" in a
        and a.split("=", 1)[0] in once | set(tiny.moot)):
      kept.append(a)
  return kept + list(tiny.args)


def _expand(arg: str, env: dict[str, str]) -> str:
  """What bash makes of ``$VAR``, ``${VAR:-default}`` and ``~/`` in ``env``."""
  arg = re.sub(r"\$\{(\w+):-([^}]*)\}",
               lambda m: env.get(m.group(1)) or m.group(2), arg)
  arg = re.sub(r"(^|=)~/", lambda m: m.group(1) + env["HOME"] + "/", arg)
  return re.sub(r"\$(\w+)|\$\{(\w+)\}",
                lambda m: env.get(m.group(1) or m.group(2), ""), arg)


def _generic(argv: list[str], tmp: pathlib.Path,
             later: list[Command]) -> str:
  """What makes two tiny forms the same run: ``argv`` with the test's
  directory made generic, and its ``--workdir`` too where no later command of
  the block reads that directory (two runs that differ only in the name of a
  directory nothing else reads are one run)."""
  def generic(arg: str) -> str:
    name, _, value = arg.partition("=")
    if name == "--workdir" and not any(
        os.path.basename(value) in c.text for c in later):
      return "--workdir=ANY"
    return arg
  return shlex.join(map(generic, argv)).replace(str(tmp), "TMP")


_BLOCKS = _blocks()
# README's blocks first, as documented (it holds the longest one, the codeio
# run and its three evaluations: last, it was the suite's tail, one core
# idle), then BENCHMARKS'.
_IN_ORDER = sorted(_BLOCKS, key=lambda w: (DOCUMENTS.index(w[0]), w[1]))


def _first_to_run(generic: str, tmp_path_factory) -> bool:
  """Whether no test process of this session has run (or is running) the
  tiny form ``generic`` yet; claims it if so. The claims are files in the
  session's temporary root, which pytest-xdist's workers share."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # pytest-N/, above the workers' popen-gwK/.
  claims = root / "documented_commands_ran"
  claims.mkdir(exist_ok=True)
  name = hashlib.sha256(generic.encode()).hexdigest()[:32]
  try:
    os.close(os.open(claims / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
  except FileExistsError:
    return False
  return True


def _children_cpu_s() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def _log_command_cpu(cmd: Command, cpu_s: float) -> None:
  """With ``SAO_TEST_CPU_LOG`` (conftest.py), a JSON line per command run:
  the suite's budget by command, not only by block."""
  if os.environ.get("SAO_TEST_CPU_LOG"):
    with open(os.environ["SAO_TEST_CPU_LOG"], "a") as f:
      f.write(json.dumps({"command": f"{cmd.document}-{cmd.block}: {cmd.text}",
                          "cpu_s": round(cpu_s, 2)}) + "\n")


def _run_verbatim_by_ci(cmd: Command) -> bool:
  """Part of README's blocks 1 and 2, which .ci/run runs in full, verbatim
  (.ci/readme_command), wherever a document quotes them."""
  return cmd.text in _CI_VERBATIM


_CI_VERBATIM = {part.strip() for block in re.findall(
    r"^```[^\n]*\n(.*?)^```", (REPO / "README.md").read_text(),
    flags=re.S | re.M)[:2] for part in block.split("&&")}


@pytest.mark.skipif("TEST_SRCDIR" in os.environ,
                    reason="runs the experiments from the checkout's root")
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("where", _IN_ORDER,
                         ids=[f"{d}-{b}" for d, b in _IN_ORDER])
def test_documented_block_runs_in_its_tiny_form(where, tmp_path, request,
                                                tmp_path_factory):
  """The commands of one block, in order, in one directory (a block's later
  commands read what its earlier ones wrote)."""
  ran = []
  for i, cmd in enumerate(_BLOCKS[where]):
    env = _environment(tmp_path, TINY[cmd.key])
    argv = tiny_argv(cmd, tmp_path, env)
    if argv is None or _run_verbatim_by_ci(cmd):
      continue
    generic = _generic(effective_argv(argv, TINY[cmd.key]), tmp_path,
                       _BLOCKS[where][i + 1:])
    if not _first_to_run(generic, tmp_path_factory):
      ran.append(cmd.key)  # Quoted again (e.g. in two sections): runs once.
      continue
    if ("smollm2" in cmd.text or "smollm2" in cmd.key
        or TINY[cmd.key].smollm2):
      _shared_smollm2(tmp_path / "home",
                      request.getfixturevalue("smollm2_tiny_checkpoint"))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    cpu = _children_cpu_s()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)
    _log_command_cpu(cmd, _children_cpu_s() - cpu)
    assert done.returncode == 0, (
        f"{cmd.document} block {cmd.block}: `{cmd.text}` failed in its tiny "
        f"form `{shlex.join(argv)}` (exit {done.returncode}):\n"
        f"{done.stderr[-3000:]}\n{done.stdout[-1500:]}")
    ran.append(cmd.key)
    if cmd.key.startswith("sao_jax.main"):
      workdir = next(a.split("=", 1)[1] for a in argv
                     if a.startswith("--workdir="))
      summary = json.loads((pathlib.Path(workdir) / "summary.json").read_text())
      assert summary["steps"] >= 1
  if not ran:  # Every command of the block is .ci/run's.
    assert all(TINY[c.key].ci or _run_verbatim_by_ci(c)
               for c in _BLOCKS[where])
