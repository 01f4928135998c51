"""The documented tiny form of experiments/bench/long_context.py runs and
shows the chunked log-probs' saving (compile-only memory: no timing)."""

import contextlib
import importlib.util
import io
import json
import pathlib
import re
import shlex
import sys

import pytest

_BENCH = (pathlib.Path(__file__).resolve().parents[2] / "experiments" /
          "bench" / "long_context.py")


def _load_bench():
  spec = importlib.util.spec_from_file_location("bench_long_context", _BENCH)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


bench = _load_bench()


def _tiny_argv() -> list[str]:
  """The arguments of the docstring's tiny command."""
  doc = bench.__doc__.split("A tiny form", 1)[1]
  command = re.search(r"python experiments/bench/long_context\.py(.*?)(?:\n\n|\Z)",
                      doc, re.S).group(1)
  return shlex.split(command.replace("\\\n", " "))


@pytest.mark.slow  # Eight compiles of a small SAO step.
def test_tiny_form_prints_its_figures():
  argv = _tiny_argv()
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    bench.main(argv)
  lines = [json.loads(line) for line in out.getvalue().splitlines()]
  mem = {(l["arm"], l["seq"]): l for l in lines
         if l["figure"] == "step_temp_memory"}
  assert set(mem) == {(a, s) for a in ("dense", "logits_chunk")
                      for s in (256, 512)}
  assert all("loadavg_1m" in l for l in lines)
  # One [1, 512, 8192] float32 logits array is 16 MiB; the chunked arm's
  # step holds none (the full one several, forward and backward).
  logits_mib = 512 * 8192 * 4 / 2 ** 20
  assert mem["logits_chunk", 512]["overrides"]["model.logits_chunk"] == 64
  assert (mem["dense", 512]["temp_mib"] - mem["logits_chunk", 512]["temp_mib"]
          >= logits_mib)
  goals = [l for l in lines if l["figure"] == "step_temp_memory_goals"]
  assert [g["arm"] for g in goals] == ["dense", "logits_chunk"]
  compiles = [l for l in lines if l["figure"] == "step_compile_s"]
  assert sorted((l["arm"], l["layers"]) for l in compiles) == [
      ("dense", 1), ("dense", 2), ("logits_chunk", 1), ("logits_chunk", 2)]
  assert all(l["compile_s"] > 0 for l in compiles)
  assert lines[-1]["figure"] == "machine"


def test_set_changes_an_arm_and_rejects_unknown_arms():
  args = bench.parse_args(["--arms=dense,mine",
                           "--set=mine:model.logits_chunk=8"])
  arms = bench.arms_from(args)
  assert arms["mine"] == {"model.logits_chunk": 8}
  cfg, ignored = bench.with_overrides(bench.issue_model(args, 2), {
      **arms["mine"], "model.not_a_field": 1})
  assert cfg.logits_chunk == 8 and ignored == ["model.not_a_field"]
  try:
    bench.arms_from(bench.parse_args(["--arms=nope"]))
  except SystemExit as e:
    assert "unknown ['nope']" in str(e)
  else:
    raise AssertionError("an unknown arm was accepted")


def test_hybrid_model_is_qwen3_5_shaped():
  args = bench.parse_args(["--model=hybrid", "--hidden=256"])
  model, depth = bench.MODELS[args.model]
  cfg = model(args, depth)
  assert cfg.hybrid and cfg.layer_pattern() == 4 and cfg.num_layers == 4
  assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
  # Qwen3.5's ratios at hidden 4096 (MLP 12288, 16 / 4 heads of 256, linear
  # 16 key / 32 value heads of 128), scaled to 256.
  assert (cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
          cfg.head_dim, cfg.rotary_dim) == (768, 4, 1, 64, 16)
  assert (cfg.linear_num_key_heads * cfg.linear_key_head_dim,
          cfg.linear_num_value_heads * cfg.linear_value_head_dim) == (128, 256)
  assert cfg.attn_output_gate and cfg.qk_norm
  with pytest.raises(SystemExit, match="multiple of its 4-layer pattern"):
    model(args, 6)
