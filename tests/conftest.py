"""Suite-wide fixtures: no shared-memory segment of ours outlives the tests,
other programs' ``/dev/shm/sao_*`` files are never taken for ours, and each
test file's compiled programs are freed when it ends."""

import atexit
import ctypes.util
import gc
import os
import re
import shutil
import sys
import tempfile
import time

import pytest

# Tests run on the CPU backend (its fake devices included), whatever else is
# installed: with the `tpu` extra, jax would otherwise load libtpu -- a second
# XLA with its own compiler -- into every test process to look for a TPU.
# What needs TPU compile-only devices runs in a child of its own
# (tests/fresh_process.py). Set JAX_PLATFORMS to override.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _session_dir(env_var: str, off_var: str, prefix: str) -> bool:
  """A fresh temporary directory named in ``env_var`` for this session.

  The pytest controller makes it and removes it at exit; xdist workers and
  every child process inherit the variable (already set: nothing to do).
  ``off_var=0`` leaves it unset. Returns whether it was made here.
  """
  if os.environ.get(off_var, "1") == "0" or env_var in os.environ:
    return False
  path = tempfile.mkdtemp(prefix=prefix)
  os.environ[env_var] = path
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  return True


# One persistent JAX compilation cache for this pytest session. The suite
# compiles the same tiny programs over and over: in each test file (conftest
# clears jax's in-memory caches between files) and in every child process
# (`sao_jax.main` runs, sampler processes, documented commands). Fresh per
# session, so a cache from another checkout or jax version is never read;
# jax's key is the program, its compile options, the backend and jax's
# version, so a hit returns the executable a compile would have made, and an
# unreadable entry is a miss with a warning. SAO_TEST_COMPILATION_CACHE=0
# turns it off (a cold run).
if _session_dir("JAX_COMPILATION_CACHE_DIR", "SAO_TEST_COMPILATION_CACHE",
                "sao_jax_test_jit_cache_"):
  # Every program, however small or fast to compile: most of the suite's are.
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

# Python bytecode written where Python writes it by default (each source's
# __pycache__, ignored by git): the package is installed editable and pip
# compiles no bytecode for it, so with PYTHONDONTWRITEBYTECODE set (as on CI's
# machines) every worker and child process compiled sao_jax's, configs' and
# the tests' sources again. A .pyc is checked against its source's mtime and
# size, so an edit is always recompiled. (Not a PYTHONPYCACHEPREFIX: Python
# then ignores the libraries' own __pycache__ and every process of the
# session's first minutes compiled jax's, torch's and transformers' sources
# again, ~20 CPU-s more at the start; BENCHMARKS.md "Test suite time".)
# SAO_TEST_PYCACHE=0 leaves Python's settings.
if os.environ.get("SAO_TEST_PYCACHE", "1") != "0":
  os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# One trained-tokenizer cache per session: nearly every `sao_jax.main` run
# trains the same few SentencePiece models (3-4 CPU-s each). Training is
# deterministic and the key is everything the model depends on
# (sao_jax.tokenization.trained_cache), so a hit is the model a training would
# have made; tests of training turn it off. SAO_TEST_TOKENIZER_CACHE=0: off.
_session_dir("SAO_JAX_TOKENIZER_CACHE", "SAO_TEST_TOKENIZER_CACHE",
             "sao_jax_test_tokenizers_")

# XLA without its expensive optimisation passes (backend optimisation level 0)
# for the suite's processes and their children: what a test program computes
# is the same up to float rounding and every test keeps its tolerance, and the
# suite's tiny programs compile in about half the CPU time (test_attention and
# test_models: 328 -> 175 CPU-s). Compiles for TPU report memory figures that
# tests assert, so their processes run with it off
# (fresh_process.TPU_ENV). SAO_TEST_XLA_OPTIMIZE=1 turns it off everywhere.
#
# And XLA:CPU's elemental emitter instead of its MLIR fusion emitters
# (--xla_cpu_use_fusion_emitters=false): the same fused HLO turned into machine
# code without the MLIR pipeline, the slow part of a CPU compile here (the
# tiny SAO step's two programs: 12.7 -> 6.1 CPU-s cold). Appended to any
# XLA_FLAGS already set; a child given XLA_FLAGS of its own compiles without it.
if os.environ.get("SAO_TEST_XLA_OPTIMIZE", "0") != "1":
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(filter(None, (
        os.environ.get("XLA_FLAGS"), "--xla_cpu_use_fusion_emitters=false")))

# One thread per process for OpenMP and BLAS (torch's intra-op pool, numpy's
# OpenBLAS), in the suite's processes and their children: three workers and
# their children already share two cores, and idle OpenMP threads spin before
# they sleep (test_family_parity at -n 3: 138 -> 122 CPU-s, 71 -> 63 s).
# Thread counts change no result beyond float rounding inside every test's
# tolerance. SAO_TEST_THREADS=0 leaves the libraries' defaults.
if os.environ.get("SAO_TEST_THREADS", "1") != "0":
  for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# gperftools' TCMalloc for the suite's worker processes and their children,
# where it is installed (Debian's libtcmalloc-minimal4; `.ci/run` installs it):
# XLA's and libtpu's compilers spend ~11 % of their CPU in glibc's malloc
# (perf, the Qwen3.5 hybrid's TPU step), and under TCMalloc the Qwen3-30B-A3B
# one-layer TPU step compiles in 50 CPU-s against 59, the tiny hybrid's CPU
# step in 9.1 against 10.9 (medians of 5 and 3, 2026-12-07), memory figures
# equal to the byte. The allocator changes no value a test computes. Set
# before xdist starts its workers, which inherit it; the sandbox's processes
# never do (their environment is its own, sandbox/launcher.py). Not installed,
# or SAO_TEST_TCMALLOC=0: glibc's malloc.
if os.environ.get("SAO_TEST_TCMALLOC", "1") != "0":
  _TCMALLOC = ctypes.util.find_library("tcmalloc_minimal")
  if _TCMALLOC and _TCMALLOC not in os.environ.get("LD_PRELOAD", ""):
    os.environ["LD_PRELOAD"] = " ".join(filter(None, (
        os.environ.get("LD_PRELOAD"), _TCMALLOC)))

# A run's processes remove dead processes' segments when they start
# (segment.reap_orphans); in the suite they must stay, so that the leak check
# below sees every segment a test's process failed to remove (inherited by
# every child).
os.environ["SAO_KEEP_ORPHANS"] = "1"

# sao_jax.ipc.segment's name pattern (make_name: sao_<kind>_<pid>_<8 hex>),
# spelled out so that this conftest (part of every test target) needs no
# dependency on the package; tests/ipc/test_ring.py checks that they agree.
NAME_RE = re.compile(r"^sao_([A-Za-z0-9]+)_([0-9]+)_([0-9a-f]{8})$")
# Names another program could leave in /dev/shm (the issue-30 report's among
# them): present for the whole session, so every segment check runs with them.
FOREIGN_NAMES = ("sao_x_y", "sao_probe_root_0600", "sao_ring_12_notours")
# Seconds a dead process's segment may take to be cleaned up by its owner.
_GRACE_S = 30.0


def _our_segments() -> set[str]:
  try:
    return {n for n in os.listdir("/dev/shm") if NAME_RE.match(n)}
  except FileNotFoundError:  # Not Linux: nothing to check.
    return set()


def _creator_pid(name: str) -> int:
  """The pid in ``sao_<kind>_<pid>_<random>`` (segment.make_name), or -1."""
  m = NAME_RE.match(name)
  return int(m.group(2)) if m else -1


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
  """Frees the compiled programs of a test file once it is done.

  XLA's CPU backend keeps each live executable's machine code in its JIT
  memory; a process that compiles hundreds of programs and keeps them (jax's
  caches do) has crashed inside a later compile (SIGSEGV or SIGABRT in
  `backend_compile_and_load`, a different test each time; cf. jax-ml/jax
  #27201). Clearing jax's caches after every file keeps a test process's
  code to one file's programs.
  """
  yield
  jax = sys.modules.get("jax")  # Only if the file used it.
  if jax is not None:
    jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="module")
def xla_optimized():
  """XLA's optimisation passes on for a test file's own compiles.

  For files that run a real-size model (SmolLM2-135M): what the suite's
  default (no optimisation, above) saves in compile time, they lose several
  times over in running unfused programs (test_smollm2_parity: 64 -> 44
  CPU-s with them on). Use as ``pytestmark = pytest.mark.usefixtures(
  "xla_optimized")``.
  """
  import jax  # pylint: disable=g-import-not-at-top
  was = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", was)


@pytest.fixture(scope="session", autouse=True)
def foreign_shm_files():
  """Creates other programs' ``sao_*`` files in /dev/shm for the session
  (those not there already) and removes the ones it created."""
  made = []
  if os.path.isdir("/dev/shm"):
    for name in FOREIGN_NAMES:
      try:
        with open(os.path.join("/dev/shm", name), "x") as f:
          f.write("not a sao_jax segment\n")
        made.append(name)
      except FileExistsError:  # Another session's: left alone.
        pass
  yield made
  for name in made:
    try:
      os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
      pass


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory(foreign_shm_files):  # pylint: disable=redefined-outer-name,unused-argument
  """Fails the session if a ``sao_`` segment created during it remains.

  Counted: segments created by this process, or by a process that has exited
  (e.g. a test's child). Segments of other live processes (another test run
  sharing the machine) are theirs to clean up.
  """
  before = _our_segments()
  yield

  def leaked() -> list[str]:
    return sorted(
        n for n in _our_segments() - before
        if _creator_pid(n) == os.getpid() or not _alive(_creator_pid(n)))

  # A dead child's segment may be another test process's (pytest-xdist's
  # other worker, another run) and about to be cleaned up by it: a grace
  # period before one that is not this process's own counts as leaked.
  deadline = time.monotonic() + _GRACE_S
  found = leaked()
  while found and time.monotonic() < deadline and all(
      _creator_pid(n) != os.getpid() for n in found):
    time.sleep(1.0)
    found = leaked()
  if found:
    pytest.fail(
        f"Shared-memory segments leaked in /dev/shm: {found}. Close rings and "
        "weight slots (use `with`), and never SIGKILL their creator in tests.",
        pytrace=False,
    )


# SAO_TEST_CPU_LOG=path: one JSON line per test with the CPU seconds (user +
# sys) its phases used in the test process and in the children it waited for
# (resource.getrusage), so the suite's budget can be spent where the CPU goes
# (wall times under pytest-xdist count the other workers' load too), and its
# wall seconds, when it ended and on which xdist worker (a timeline).
_CPU_LOG = os.environ.get("SAO_TEST_CPU_LOG")


def _cpu_seconds() -> float:
  import resource  # pylint: disable=g-import-not-at-top
  return sum(r.ru_utime + r.ru_stime for r in (
      resource.getrusage(resource.RUSAGE_SELF),
      resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  if not _CPU_LOG:
    yield
    return
  start, wall = _cpu_seconds(), time.monotonic()
  yield
  import json  # pylint: disable=g-import-not-at-top
  with open(_CPU_LOG, "a") as f:
    f.write(json.dumps({"test": item.nodeid,
                        "cpu_s": round(_cpu_seconds() - start, 2),
                        "wall_s": round(time.monotonic() - wall, 2),
                        "end": round(time.time(), 2),
                        "worker": os.environ.get("PYTEST_XDIST_WORKER", "")
                        }) + "\n")
