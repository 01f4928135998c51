"""The sandbox's seccomp filter (docs/design/sandbox.md "Code sandbox"),
compiled with libseccomp (`pyseccomp`, ctypes bindings) to a BPF program.

Default allow; these fail with EPERM: tracing and reading other processes'
memory, new namespaces (user namespaces above all), mounts, kernel keyrings,
BPF, perf, userfaultfd, io_uring, module and kexec loading, file handles, and
sockets of any family but AF_UNIX (with `unix_sockets=False`, the Landlock
fallback, which has no network namespace: none at all; socketpair stays),
changing another process's limits or scheduling (`prlimit64`,
`setpriority`, `sched_set*` on a pid other than 0; `setpriority` of a
group or user), and with `ipc=False`
(no IPC namespace per call) System V and POSIX message-queue IPC.
clone3 answers ENOSYS so that libc falls back to clone, whose flags a
filter can inspect.
"""

from __future__ import annotations

import errno
import tempfile

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
    "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick",
    "mount_setattr", "keyctl", "add_key", "request_key", "bpf",
    "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "open_by_handle_at",
    "name_to_handle_at", "fanotify_init", "quotactl", "swapon", "swapoff",
    "reboot", "acct", "syslog", "uselib", "vhangup", "lookup_dcookie",
    "settimeofday", "clock_settime", "adjtimex",
)
_CLONE_NS_FLAGS = (0x10000000 | 0x20000000 | 0x40000000 | 0x04000000 |
                   0x08000000 | 0x00020000 | 0x02000000 | 0x00000080)
# NEWUSER | NEWPID | NEWNET | NEWUTS | NEWIPC | NEWNS | NEWCGROUP | NEWTIME.
_IPC = ("shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv",
        "msgctl", "semget", "semop", "semtimedop", "semctl", "mq_open",
        "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
        "mq_getsetattr")
_OTHER_PID = ("sched_setaffinity", "sched_setparam", "sched_setscheduler",
              "sched_setattr")  # Their pid is argument 0.
_AF_UNIX = 1
_TIOCSTI = 0x5412


def _build(unix_sockets: bool, ipc: bool):
  import pyseccomp as sc  # pylint: disable=g-import-not-at-top
  f = sc.SyscallFilter(sc.ALLOW)
  deny = sc.ERRNO(errno.EPERM)
  for name in DENIED + (() if ipc else _IPC):
    try:
      f.add_rule(deny, name)
    except (RuntimeError, ValueError, OSError):  # Unknown on this arch.
      pass
  for bit in _bits(_CLONE_NS_FLAGS):
    f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, bit, bit))
  f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
  # Another process's limits (a new limit for pid != 0) or priority.
  f.add_rule(deny, "prlimit64", sc.Arg(0, sc.NE, 0), sc.Arg(2, sc.NE, 0))
  f.add_rule(deny, "setpriority", sc.Arg(0, sc.NE, 0))  # Not PRIO_PROCESS.
  f.add_rule(deny, "setpriority", sc.Arg(1, sc.NE, 0))
  for name in _OTHER_PID:
    f.add_rule(deny, name, sc.Arg(0, sc.NE, 0))
  f.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, _TIOCSTI))
  if unix_sockets:
    f.add_rule(deny, "socket", sc.Arg(0, sc.NE, _AF_UNIX))
  else:
    f.add_rule(deny, "socket")
  return f


def _bits(mask: int):
  return [1 << i for i in range(32) if mask >> i & 1]


_CACHE: dict[tuple[bool, bool], bytes] = {}


def bpf_program(unix_sockets: bool = True, ipc: bool = True) -> bytes:
  """The filter as raw BPF (struct sock_filter[]), compiled once."""
  key = (unix_sockets, ipc)
  if key not in _CACHE:
    with tempfile.TemporaryFile() as t:
      _build(*key).export_bpf(t)
      t.seek(0)
      _CACHE[key] = t.read()
  return _CACHE[key]
