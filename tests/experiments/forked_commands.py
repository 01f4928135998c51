"""Runs `python -m MODULE ...` and `python SCRIPT ...` commands as forks of
one process that has imported their heavy modules once.

A server (``python forked_commands.py MODULE...``, started with the commands'
environment) imports the given modules, then for each request it reads (one
JSON line: argv, env, cwd and the files for stdout and stderr) forks a child
that does what the interpreter does for that argv: ``sys.argv`` and
``sys.path[0]`` as ``python`` sets them, the module or script run as
``__main__`` (``runpy``), ``SystemExit`` turned into the exit status, atexit
handlers run. The child's exit status comes back as one line. The server
starts no thread and no JAX backend before it forks (it only imports), so
each child starts as a fresh interpreter would, less the imports.

``Server`` is the pytest side: one server per environment key, kept for the
session; ``run`` returns a ``subprocess.CompletedProcess``.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import traceback


def _child(req: dict) -> int:
  os.chdir(req["cwd"])
  os.environ.clear()
  os.environ.update(req["env"])
  for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(f, fd)
    os.close(f)
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  sys.stdin = open(0, closefd=False)  # pylint: disable=consider-using-with
  argv = req["argv"]
  # pylint: disable-next=g-import-not-at-top
  import runpy
  try:
    if argv[1] == "-m":
      sys.argv = [argv[2], *argv[3:]]  # runpy sets argv[0] to the file.
      sys.path[0] = os.getcwd()
      runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
      sys.argv = argv[1:]
      sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
      runpy.run_path(argv[1], run_name="__main__")
    code = 0
  except SystemExit as e:
    if e.code is None:
      code = 0
    elif isinstance(e.code, int):
      code = e.code
    else:
      print(e.code, file=sys.stderr)
      code = 1
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    code = 1
  try:
    atexit._run_exitfuncs()  # pylint: disable=protected-access
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # pylint: disable=broad-except
      pass
  return code


def serve(preload: list[str]) -> None:
  results = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)  # What the imports print is not a result.
  for module in preload:
    importlib.import_module(module)
  print("ready", file=results, flush=True)
  for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
      code = 1
      try:
        code = _child(req)
      finally:
        os._exit(code)  # pylint: disable=protected-access
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), file=results, flush=True)


class Server:
  """One forking server (started on first use) for commands of one env."""

  def __init__(self, preload: tuple[str, ...], env: dict[str, str],
               cwd: str):
    self._log = tempfile.TemporaryFile("w+")  # The server's own stderr.
    self._proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *preload], cwd=cwd,
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=self._log, text=True, start_new_session=True)
    self._ready = False

  def _line(self, timeout: float) -> str:
    ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
    if not ready:
      os.killpg(self._proc.pid, signal.SIGKILL)
      raise subprocess.TimeoutExpired(self._proc.args, timeout)
    line = self._proc.stdout.readline()
    if not line:
      code = self._proc.wait()
      self._log.seek(0)
      raise RuntimeError(f"the forking server exited ({code}):\n"
                         f"{self._log.read()[-3000:]}")
    return line.strip()

  def run(self, argv: list[str], env: dict[str, str], cwd: str,
          timeout: float) -> subprocess.CompletedProcess:
    if not self._ready:
      assert self._line(timeout) == "ready"
      self._ready = True
    with tempfile.TemporaryDirectory() as tmp:
      out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
      self._proc.stdin.write(json.dumps({
          "argv": argv, "env": env, "cwd": cwd, "stdout": out,
          "stderr": err}) + "\n")
      self._proc.stdin.flush()
      code = int(self._line(timeout))
      with open(out) as o, open(err) as e:
        return subprocess.CompletedProcess(argv, code, o.read(), e.read())

  def close(self) -> None:
    if self._proc.poll() is None:
      self._proc.stdin.close()
      try:
        self._proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
    self._log.close()


if __name__ == "__main__":
  serve(sys.argv[1:])
