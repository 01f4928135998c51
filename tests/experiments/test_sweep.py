"""Tests for experiments/sweep.py, experiments/sweep_plan.py and the
`--overrides` flag of sao_jax.main."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

from sao_jax import config_overrides as overrides_lib
from sao_jax import config_validation as cv
import tiny_settings

_REPO = pathlib.Path(__file__).resolve().parents[2]
_BASE = str(_REPO / "configs" / "base.py")


def _load_sweep_module():
  if str(_REPO / "experiments") not in sys.path:  # For its `import sweep_plan`.
    sys.path.insert(0, str(_REPO / "experiments"))
  spec = importlib.util.spec_from_file_location(
      "experiments_sweep", _REPO / "experiments" / "sweep.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # For its dataclasses.
  spec.loader.exec_module(module)
  return module


sweep = _load_sweep_module()
import sweep_plan  # pylint: disable=g-import-not-at-top,wrong-import-position


def _has_cache_key() -> bool:
  return cv.get_path(cv.base_config(), "train.sft_cache_dir")[0]


def _write_config(path: pathlib.Path, points: list[dict] | None) -> str:
  """A config file: configs/base.py, with `get_sweep` returning `points`."""
  text = "from configs import base\n\n\ndef get_config():\n"
  text += "  return base.get_config()\n"
  if points is not None:
    text += f"\n\ndef get_sweep():\n  return {points!r}\n"
  path.write_text(text)
  return str(path)


# ------------------------------------------------------------------- names ---


@pytest.mark.parametrize("overrides, name", [
    ({"train.seed": 1}, "seed=1"),
    ({"train.max_staleness": 4, "rl.loss": "grpo"},
     "loss=grpo,max_staleness=4"),
    ({"optim.actor_lr": 1e-6}, "actor_lr=1e-06"),
    ({"tokenizer.datasets": ("chain_sum", "leg_counting")},
     "datasets=chain_sum-leg_counting"),
    ({"train.seed": 1, "env.seed": 2}, "env.seed=2,train.seed=1"),
    ({"env.instruction": "Answer: <x>/2"}, "instruction=Answer_x_2"),
    ({"_name": "sao/main run", "train.seed": 3}, "sao_main_run"),
    ({"_name": "..hidden"}, "hidden"),
    ({}, "run"),
])
def test_point_name(overrides, name):
  assert sweep_plan.point_name(overrides) == name


def test_long_names_are_bounded_and_distinct():
  a = sweep_plan.point_name({"env.instruction": "x" * 300 + "a"})
  b = sweep_plan.point_name({"env.instruction": "x" * 300 + "b"})
  assert len(a) == len(b) == 100 and a != b
  assert a.startswith("instruction=xxx")


@pytest.mark.parametrize("bad", ["", "...", 3])
def test_bad_explicit_name(bad):
  with pytest.raises(sweep_plan.SweepError,
                     match='"_name" must be a non-empty'):
    sweep_plan.point_name({"_name": bad})


def test_duplicate_names_are_refused(tmp_path):
  config = _write_config(tmp_path / "c.py",
                         [{"train.seed": 1}, {"train.seed": 2},
                          {"_name": "seed=1", "train.seed": 5}])
  with pytest.raises(sweep_plan.SweepError) as info:
    sweep_plan.load_points(config)
  assert str(info.value) == (
      f"--config={config}: sweep points 0 and 2 are both named 'seed=1'; "
      'give them distinct "_name" values')


def test_load_points(tmp_path):
  assert sweep_plan.load_points(_BASE) == [sweep_plan.Point("run", {})]
  config = _write_config(tmp_path / "c.py", [
      {"_name": "sao", "rl.loss": "sao"},
      {"rl.loss": "grpo", "train.max_staleness": 4}])
  assert sweep_plan.load_points(config) == [
      sweep_plan.Point("sao", {"rl.loss": "sao"}),
      sweep_plan.Point("loss=grpo,max_staleness=4",
                  {"rl.loss": "grpo", "train.max_staleness": 4})]
  with pytest.raises(sweep_plan.SweepError, match="non-empty list of dicts"):
    sweep_plan.load_points(_write_config(tmp_path / "empty.py", []))
  with pytest.raises(sweep_plan.SweepError,
                     match=r"get_sweep\(\)\[1\] must be a "):
    sweep_plan.load_points(_write_config(tmp_path / "bad.py",
                                    [{"train.seed": 1}, ["train.seed"]]))


def test_only_selects_names_with_commas():
  points = [sweep_plan.Point("a=1", {}), sweep_plan.Point("a=1,b=2", {}),
            sweep_plan.Point("c=3", {})]
  assert [p.name for p in sweep_plan.select(points, "a=1,b=2,c=3")] == [
      "a=1,b=2", "c=3"]
  assert [p.name for p in sweep_plan.select(points, "a=1")] == ["a=1"]
  with pytest.raises(sweep_plan.SweepError, match="no sweep point named 'x=9'"):
    sweep_plan.select(points, "a=1,x=9")


# -------------------------------------------------------------- overrides ---


def test_apply_overrides():
  config = cv.base_config()
  overrides_lib.apply_overrides(config, {
      "tokenizer.datasets": ["chain_sum"], "train.seed": 7,
      "optim.actor_lr": 1, "env.dataset_config.operators": ["+"]})
  assert config.tokenizer.datasets == ("chain_sum",)  # Tuple field: tuple.
  assert config.train.seed == 7
  assert config.optim.actor_lr == 1.0
  assert config.env.dataset_config.operators == ["+"]  # New free-form key.
  cv.validate_config(config)
  with pytest.raises(cv.ConfigError) as info:
    overrides_lib.apply_overrides(config, {"train.sede": 1})
  assert str(info.value) == (
      "config.train.sede: unknown key; did you mean config.train.seed?")
  with pytest.raises(cv.ConfigError, match=r"^config.train.num_steps: cannot "
                     r"set 1.5 \(.*\)$"):
    overrides_lib.apply_overrides(config, {"train.num_steps": 1.5})


def test_load_overrides_errors(tmp_path):
  missing = tmp_path / "missing.json"
  with pytest.raises(cv.ConfigError,
                     match=f"^--overrides={missing}: file not found"):
    overrides_lib.load_overrides(missing)
  bad = tmp_path / "bad.json"
  bad.write_text("{'train.seed': 1}")
  with pytest.raises(cv.ConfigError, match=f"^--overrides={bad}: not valid "):
    overrides_lib.load_overrides(bad)
  bad.write_text("[1, 2]")
  with pytest.raises(cv.ConfigError, match="expected a JSON object .* got a "
                     "JSON list$"):
    overrides_lib.load_overrides(bad)


@pytest.fixture
def main_module(monkeypatch):
  """sao_jax.main with a fake trainer recording its (config, workdir) calls."""
  from absl import flags
  from sao_jax import main

  calls = []
  fake_loop = type(sys)("sao_jax.train.loop")
  fake_loop.train_and_evaluate = lambda c, w: calls.append((c, w)) or {}
  monkeypatch.setitem(sys.modules, "sao_jax.train.loop", fake_loop)

  def parse(argv):
    monkeypatch.setattr(sys, "argv", list(argv))
    return main.parse_flags(argv)

  main.parse, main.calls = parse, calls
  yield main
  flags.FLAGS.unparse_flags()
  for name in list(flags.FLAGS):
    if name.startswith("config."):
      delattr(flags.FLAGS, name)
  del main.parse, main.calls


def test_main_applies_overrides_after_command_line(main_module, tmp_path):
  path = tmp_path / "o.json"
  path.write_text(json.dumps({
      "train.seed": 3, "tokenizer.datasets": ["basic_arithmetic"],
      "env.dataset_config.min_terms": 2}))
  main_module.parse(["main", f"--config={_BASE}", f"--workdir={tmp_path}",
                     "--config.train.seed=1", "--config.train.num_steps=9",
                     f"--overrides={path}"])
  main_module.main(["main"])
  ((config, workdir),) = main_module.calls
  assert workdir == str(tmp_path)
  assert config.train.seed == 3  # The file wins over --config.train.seed.
  assert config.train.num_steps == 9
  assert config.tokenizer.datasets == ("basic_arithmetic",)
  assert config.env.dataset_config.min_terms == 2


def test_main_bad_overrides_file_stops_before_trainer(main_module, tmp_path):
  path = tmp_path / "o.json"
  path.write_text("{not json")
  main_module.parse(["main", f"--config={_BASE}", f"--workdir={tmp_path}",
                     f"--overrides={path}"])
  with pytest.raises(SystemExit) as info:
    main_module.main(["main"])
  assert str(info.value.code).startswith(f"--overrides={path}: not valid JSON")
  assert "\n" not in str(info.value.code)
  assert not main_module.calls


@pytest.mark.multiprocess
def test_main_overrides_typo_exits_before_training(tmp_path):
  path = tmp_path / "o.json"
  path.write_text(json.dumps({"train.seed": 1, "rl.eps_lwo": 0.2}))
  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, "-m", "sao_jax.main", f"--config={_BASE}",
       f"--workdir={workdir}", f"--overrides={path}"],
      capture_output=True, text=True, timeout=300, cwd=_REPO,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 1
  assert result.stderr.strip() == (
      "config.rl.eps_lwo: unknown key; did you mean config.rl.eps_low?")
  assert not workdir.exists()  # Nothing was trained or written.


# ------------------------------------------------------------ run a sweep ---

# Stands in for sao_jax.main: counts its runs in DIR/count.txt, appends
# "start end" to DIR/times.txt, then writes summary.json, or exits 3 when
# MODE is 'fail' (always), 'flaky' (first run) or 'unfinished' (never writes).
# Its pid goes to DIR/pid.txt atomically: a test may read it while it starts.
_FAKE = textwrap.dedent("""
    import json, os, sys, time
    d, mode, sleep_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    count = os.path.join(d, "count.txt")
    n = int(open(count).read()) + 1 if os.path.exists(count) else 1
    open(count, "w").write(str(n))
    open(os.path.join(d, "pid.tmp"), "w").write(str(os.getpid()))
    os.replace(os.path.join(d, "pid.tmp"), os.path.join(d, "pid.txt"))
    start = time.time()
    time.sleep(sleep_s)
    with open(os.path.join(d, "times.txt"), "a") as f:
      f.write(f"{start} {time.time()}\\n")
    print("fake run", n, "of", d)
    if mode == "fail" or (mode == "flaky" and n == 1):
      sys.exit(3)
    if mode != "unfinished":
      json.dump({"steps": 1}, open(os.path.join(d, "summary.json"), "w"))
""")


def _fake(modes=None, sleep_s=0.0):
  """A command_fn running _FAKE; `modes` maps point names to modes."""
  modes = modes or {}

  def command_fn(config_path, point_dir, overrides_path):
    assert os.path.exists(config_path) and os.path.exists(overrides_path)
    mode = modes.get(os.path.basename(point_dir), "ok")
    return [sys.executable, "-c", _FAKE, point_dir, mode, str(sleep_s)]

  return command_fn


def _count(workdir, name) -> int:
  return int((workdir / name / "count.txt").read_text())


def _statuses(records) -> dict[str, str]:
  return {r["point"]: r["status"] for r in records}


@pytest.fixture
def seeds_config(tmp_path):
  return _write_config(tmp_path / "seeds.py",
                       [{"train.seed": s} for s in (0, 1, 2)])


def test_sweep_skips_finished_and_reruns_unfinished(tmp_path, seeds_config,
                                                    capsys):
  workdir = tmp_path / "sweep"
  records = sweep.run_sweep(seeds_config, workdir, command_fn=_fake())
  assert _statuses(records) == {"seed=0": "finished", "seed=1": "finished",
                                "seed=2": "finished"}
  lines = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
  assert [l["point"] for l in lines] == ["seed=0", "seed=1", "seed=2"]
  assert lines[1]["log"] == str(workdir / "seed=1" / "log.txt")
  assert set(lines[1]) == {"point", "status", "wall_s", "log"}
  assert json.loads((workdir / "sweep.json").read_text()) == {
      "config": seeds_config,
      "points": [{"name": f"seed={s}", "overrides": {"train.seed": s}}
                 for s in (0, 1, 2)]}
  expected = {"train.seed": 1}
  if _has_cache_key():
    expected["train.sft_cache_dir"] = str(workdir / "sft_cache")
  assert json.loads(
      (workdir / "seed=1" / "overrides.json").read_text()) == expected

  # seed=1 was interrupted: its directory is there, its summary is not.
  (workdir / "seed=1" / "summary.json").unlink()
  records = sweep.run_sweep(seeds_config, workdir, command_fn=_fake())
  assert _statuses(records) == {"seed=0": "skipped", "seed=1": "finished",
                                "seed=2": "skipped"}
  assert [_count(workdir, f"seed={s}") for s in (0, 1, 2)] == [1, 2, 1]
  log = (workdir / "seed=1" / "log.txt").read_text()
  assert "===== sweep attempt 1 (" in log and "===== sweep attempt 2 (" in log
  # Output of both attempts kept.
  assert "fake run 1 of" in log and "fake run 2 of" in log


def test_sweep_resumes_a_point_that_exited_without_summary(tmp_path,
                                                           seeds_config):
  workdir = tmp_path / "sweep"
  records = sweep.run_sweep(seeds_config, workdir,
                            command_fn=_fake({"seed=2": "unfinished"}))
  assert _statuses(records)["seed=2"] == "failed"
  records = sweep.run_sweep(seeds_config, workdir, command_fn=_fake())
  assert _statuses(records) == {"seed=0": "skipped", "seed=1": "skipped",
                                "seed=2": "finished"}
  assert _count(workdir, "seed=2") == 2


def test_failed_point_does_not_stop_the_others(tmp_path, seeds_config):
  workdir = tmp_path / "sweep"
  records = sweep.run_sweep(seeds_config, workdir,
                            command_fn=_fake({"seed=0": "flaky"}))
  assert _statuses(records) == {"seed=0": "failed", "seed=1": "finished",
                                "seed=2": "finished"}
  log = workdir / "seed=0" / "log.txt"
  assert sweep.failure_message(records) == (
      f"1 of 3 sweep points failed:\n  seed=0: {log}")
  # The rerun retries only the failed point, which now succeeds.
  records = sweep.run_sweep(seeds_config, workdir,
                            command_fn=_fake({"seed=0": "flaky"}))
  assert _statuses(records) == {"seed=0": "finished", "seed=1": "skipped",
                                "seed=2": "skipped"}
  assert sweep.failure_message(records) is None
  assert [_count(workdir, f"seed={s}") for s in (0, 1, 2)] == [2, 1, 1]


@pytest.fixture(autouse=True)
def _writes_bytecode(monkeypatch):
  """Python may write .pyc caches, as where the stale-config bug was seen."""
  monkeypatch.setattr(sys, "dont_write_bytecode", False)


def _rewrite_unchanged_stat(path: pathlib.Path, points: list[dict]) -> None:
  """Rewrites a config with the same size and mtime (a .pyc cache misses it)."""
  before = path.stat()
  _write_config(path, points)
  os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
  assert path.stat().st_size == before.st_size


def test_config_edit_is_seen_at_same_size_and_mtime(tmp_path):
  path = tmp_path / "c.py"
  _write_config(path, [{"train.seed": 1}])
  assert sweep_plan.load_module(path).get_sweep() == [{"train.seed": 1}]
  _rewrite_unchanged_stat(path, [{"train.seed": 7}])
  assert sweep_plan.load_module(path).get_sweep() == [{"train.seed": 7}]


def test_changed_point_is_refused(tmp_path):
  workdir = tmp_path / "sweep"
  config = _write_config(tmp_path / "c.py", [{"_name": "a", "train.seed": 0}])
  sweep.run_sweep(config, workdir, command_fn=_fake())
  _rewrite_unchanged_stat(tmp_path / "c.py", [{"_name": "a", "train.seed": 5}])
  with pytest.raises(sweep_plan.SweepError) as info:
    sweep.run_sweep(config, workdir, command_fn=_fake())
  message = str(info.value)
  assert message.startswith(f"sweep point 'a': {workdir / 'a'} holds a run "
                            'with overrides {"train.seed": 0')
  assert message.endswith(
      f"use a new --workdir or delete {workdir / 'a'}")
  assert _count(workdir, "a") == 1  # Nothing ran.


def test_other_config_in_same_workdir_is_refused(tmp_path, seeds_config):
  workdir = tmp_path / "sweep"
  sweep.run_sweep(seeds_config, workdir, only="seed=0", command_fn=_fake())
  other = _write_config(tmp_path / "other.py", [{"train.seed": 0}])
  with pytest.raises(sweep_plan.SweepError,
                     match="holds a sweep of config .*seeds.py.*; use a new "
                     "--workdir$"):
    sweep.run_sweep(other, workdir, command_fn=_fake())


def test_invalid_point_is_refused_before_running(tmp_path):
  config = _write_config(tmp_path / "c.py",
                         [{"train.seed": 0}, {"train.sede": 1}])
  with pytest.raises(sweep_plan.SweepError) as info:
    sweep.run_sweep(config, tmp_path / "sweep", command_fn=_fake())
  assert str(info.value) == (
      "sweep point 'sede=1': config.train.sede: unknown key; did you mean "
      "config.train.seed?")
  assert not (tmp_path / "sweep").exists()


def test_config_sft_cache_dir_is_kept(tmp_path):
  if not _has_cache_key():
    pytest.skip("configs/base.py has no train.sft_cache_dir yet")
  config = tmp_path / "c.py"
  config.write_text(textwrap.dedent("""
      from configs import base
      def get_config():
        config = base.get_config()
        config.train.sft_cache_dir = "/tmp/my_cache"
        return config
      """))
  records = sweep.run_sweep(config, tmp_path / "sweep", command_fn=_fake())
  assert _statuses(records) == {"run": "finished"}
  assert json.loads(
      (tmp_path / "sweep" / "run" / "overrides.json").read_text()) == {}


def test_parallel_runs_two_at_once(tmp_path, seeds_config):
  workdir = tmp_path / "sweep"
  records = sweep.run_sweep(seeds_config, workdir, parallel=2,
                            command_fn=_fake(sleep_s=1.5))
  assert set(_statuses(records).values()) == {"finished"}
  spans = [tuple(map(float, (workdir / f"seed={s}" / "times.txt")
                     .read_text().split())) for s in (0, 1, 2)]
  (s0, e0), (s1, e1), (s2, _) = spans
  assert s1 < e0 and s0 < e1  # The first two overlap.
  assert s2 >= min(e0, e1) - 0.05  # The third waits for a free slot.


def test_interrupt_terminates_running_points(tmp_path, seeds_config):
  fake = _fake(sleep_s=120)
  started = []

  def command_fn(config_path, point_dir, overrides_path):
    if started:  # The second start: the user presses Ctrl-C.
      deadline = time.time() + 60
      while not (tmp_path / "sweep" / "seed=0" / "pid.txt").exists():
        assert time.time() < deadline
        time.sleep(0.05)
      raise KeyboardInterrupt
    started.append(point_dir)
    return fake(config_path, point_dir, overrides_path)

  with pytest.raises(KeyboardInterrupt):
    sweep.run_sweep(seeds_config, tmp_path / "sweep", parallel=2,
                    command_fn=command_fn, grace_s=10)
  pid = int((tmp_path / "sweep" / "seed=0" / "pid.txt").read_text())
  with pytest.raises(ProcessLookupError):  # Terminated and reaped.
    os.kill(pid, 0)
  assert not (tmp_path / "sweep" / "seed=0" / "summary.json").exists()


def test_dry_run_writes_nothing(tmp_path, seeds_config, capsys):
  workdir = tmp_path / "sweep"
  records = sweep.run_sweep(seeds_config, workdir, dry_run=True)
  assert [r["plan"] for r in records] == ["run", "run", "run"]
  assert records[0]["command"] == [
      sys.executable, "-m", "sao_jax.main", f"--config={seeds_config}",
      f"--workdir={workdir / 'seed=0'}",
      f"--overrides={workdir / 'seed=0' / 'overrides.json'}"]
  assert len(capsys.readouterr().out.splitlines()) == 3
  assert not workdir.exists()


@pytest.mark.multiprocess
def test_cli_refuses_unknown_point(tmp_path, seeds_config):
  result = subprocess.run(
      [sys.executable, "experiments/sweep.py", f"--config={seeds_config}",
       f"--workdir={tmp_path / 'sweep'}", "--only=seed=7", "--dry_run"],
      capture_output=True, text=True, timeout=300, cwd=_REPO)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "--only: no sweep point named 'seed=7'; the points are seed=0, seed=1, "
      "seed=2")


# ------------------------------------------------------ the real trainer ---

# The tiny settings of the end-to-end tests, as a 2-step sync run without a
# critic-only step (a program fewer to compile).
TINY_OVERRIDES = {**tiny_settings.TINY_OVERRIDES, "train.mode": "sync",
                  "train.num_steps": 2, "train.checkpoint_every": 0,
                  "rl.critic_warmup_steps": 0}
DATASET_CONFIG = tiny_settings.DATASET_CONFIG


def _run_cli(config, workdir):
  return subprocess.run(
      [sys.executable, "experiments/sweep.py", f"--config={config}",
       f"--workdir={workdir}"],
      capture_output=True, text=True, timeout=1200, cwd=_REPO,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_real_sweep_runs_then_skips(tmp_path):
  """One real point (the trainer, its override applied) runs, then a rerun
  skips it. Several points -- their order, statuses, a rerun of an unfinished
  one among skipped ones -- are test_sweep_skips_finished_and_reruns_unfinished's
  (a fake trainer): a second real point would run the same code again."""
  config = tmp_path / "tiny_sweep.py"
  config.write_text(textwrap.dedent(f"""
      from configs import base

      def get_config():
        config = base.get_config()
        config.update_from_flattened_dict({TINY_OVERRIDES!r})
        config.env.dataset_config.update({DATASET_CONFIG!r})
        return config

      def get_sweep():
        return [{{"train.seed": 1}}]
      """))
  workdir = tmp_path / "sweep"
  first = _run_cli(config, workdir)
  point = workdir / "seed=1"
  log = point / "log.txt"
  tail = log.read_text()[-3000:] if log.exists() else ""
  assert first.returncode == 0, (first.stderr[-3000:], tail)
  statuses = [json.loads(l) for l in first.stdout.splitlines()
              if l.startswith("{")]
  assert {(s["point"], s["status"]) for s in statuses} == {
      ("seed=1", "finished")}
  summary = json.loads((point / "summary.json").read_text())
  assert summary["steps"] == 2  # 2 policy steps.
  second = _run_cli(config, workdir)
  assert second.returncode == 0, second.stderr[-3000:]
  statuses = [json.loads(l) for l in second.stdout.splitlines()
              if l.startswith("{")]
  assert {(s["point"], s["status"]) for s in statuses} == {
      ("seed=1", "skipped")}
  assert second.stdout.strip().splitlines()[-1] == (
      f"sweep {workdir}: 0 finished, 1 skipped, 0 failed")
