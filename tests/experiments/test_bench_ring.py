"""Tests for experiments/bench/ring.py's native bound (ring_native.c)."""

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "bench"

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="needs a C compiler (cc)")


def _load_bench():
  spec = importlib.util.spec_from_file_location("bench_ring",
                                                _BENCH / "ring.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


bench = _load_bench()


@pytest.fixture(scope="module")
def exe(tmp_path_factory) -> str:
  return bench.build_native(str(tmp_path_factory.mktemp("native")))


@pytest.mark.parametrize("mode", ["copy", "view"])
@pytest.mark.parametrize("size", [5, 4096 + 13, 70_001])
def test_native_moves_and_checks_every_record(exe, mode, size):
  # A lane of 3 records wraps many times over 200 records; odd sizes cover
  # the tail bytes the word sum reads one by one.
  lane = 3 * ((64 + size + 63) // 64 * 64)
  proc = subprocess.run([exe, str(size), str(lane), "200", mode],
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert set(out) == {"seconds", "consumer_cpu_s", "producer_cpu_s"}
  assert out["seconds"] > 0
  assert out["producer_cpu_s"] > 0


def test_run_native_reports_gb_per_s(exe, monkeypatch):
  monkeypatch.setattr(bench, "_lane_bytes", lambda size: 4 * (size + 128))
  gbps, per_core = bench.run_native(exe, 1 << 16, 64, "copy")
  assert gbps > 0 and per_core > 0


@pytest.mark.parametrize("args", [
    ["4096", "65536", "10", "nope"],   # Unknown mode.
    ["4096", "65536", "10", "copy_xxh3"],  # Built without xxhash.h.
    ["4096", "4096", "10", "copy"],    # Lane holds < 2 records.
    ["4096", "65536"],                 # Too few arguments.
])
def test_native_rejects_bad_arguments(exe, args):
  proc = subprocess.run([exe, *args], capture_output=True, text=True,
                        check=False)
  assert proc.returncode == 2
  assert proc.stdout == ""
  assert "usage" in proc.stderr or "LANE_BYTES" in proc.stderr


def test_run_native_raises_on_failure(exe):
  with pytest.raises(RuntimeError, match="failed \\(2\\)"):
    bench.run_native(exe, 1 << 20, 10, "nope")


def test_xxhash_include_without_header_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="has no xxhash.h"):
    bench.build_native(str(tmp_path), xxhash_include=str(tmp_path))
