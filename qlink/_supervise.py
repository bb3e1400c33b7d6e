"""Clean stops for long commands: ``qlink run``, ``qlink bench``, ``qlink budget``, ``qlink paper``
and the ``scenarios/*.py`` scripts.

The command runs as a worker process in a session of its own, under a small supervisor
(the process the user started). The terminal's Ctrl-C reaches the supervisor only, so
the worker's many processes (decoder services, KV peers, floor spinners) never print a
``KeyboardInterrupt`` traceback each. On SIGINT or SIGTERM the supervisor:

1. finds every process of the run (the worker's session and every descendant: the
   supervisor is their child subreaper, so an orphan still counts), and the
   ``/dev/shm`` entries and Unix-socket files they hold open or mapped;
2. sends them SIGTERM, then SIGKILL to whatever is left after :data:`GRACE_S`, so
   all are gone within 2 s;
3. removes those ``/dev/shm`` entries and socket files, prints one line, and exits
   130 (SIGINT) or 143 (SIGTERM).

A worker that ends on its own leaves its exit status; a process it left behind is
ended the same way. Linux only (``/proc``); elsewhere the command runs unsupervised.

>>> _stat(os.getpid())[0] == os.getppid()
True
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import stat
import subprocess
import sys
import time

__all__ = ["supervise", "WORKER_ENV", "GRACE_S", "become_worker"]

WORKER_ENV = "QLINK_SUPERVISED_WORKER"
GRACE_S = 1.0  # SIGTERM, then SIGKILL after this; everything is gone well within 2 s
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def _prctl(option: int, arg: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def become_worker() -> None:
    """In the worker: end with SIGTERM when the supervisor dies (no orphaned run)."""
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _stat(pid: int) -> tuple[int, int, int, str] | None:
    """(ppid, pgrp, session, state) of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    return int(rest[1]), int(rest[2]), int(rest[3]), rest[0]


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _session_processes(root: int) -> set[int]:
    """Live processes of ``root``'s session plus every descendant of ``root`` or of this process."""
    me = os.getpid()
    info = {p: st for p in _all_pids() if (st := _stat(p)) is not None and st[3] != "Z"}
    out = {p for p, st in info.items() if st[2] == root}
    children: dict[int, list[int]] = {}
    for p, st in info.items():
        children.setdefault(st[0], []).append(p)
    todo = [root, me]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out and c != me:
                out.add(c)
                todo.append(c)
    out.discard(me)
    return out


def _held_files(pids: set[int]) -> tuple[set[str], set[str]]:
    """``/dev/shm`` paths and socket inodes the processes hold (open or mapped)."""
    shm, inodes = set(), set()
    for p in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    t = os.readlink(f"/proc/{p}/fd/{fd}")
                    if t.startswith("/dev/shm/"):
                        shm.add(t.removesuffix(" (deleted)"))
                    elif t.startswith("socket:["):
                        inodes.add(t[8:-1])
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/maps") as f:
                for ln in f:
                    i = ln.find("/dev/shm/")
                    if i >= 0:
                        shm.add(ln[i:].strip().removesuffix(" (deleted)"))
    return shm, inodes


def _socket_paths(inodes: set[str]) -> set[str]:
    out = set()
    with contextlib.suppress(OSError):
        with open("/proc/net/unix") as f:
            next(f, None)
            for ln in f:
                parts = ln.split()
                if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/"):
                    out.add(parts[7])
    return out


def _signal_all(pids: set[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, sig)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _end_all(root: int, proc: subprocess.Popen) -> tuple[int, set[str], set[str]]:
    """SIGTERM every process of the run, SIGKILL what is left after GRACE_S; returns
    (processes ended, /dev/shm paths, socket paths) they held."""
    pids = _session_processes(root) | ({root} if proc.poll() is None else set())
    shm, inodes = _held_files(pids)
    ended = set(pids)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        proc.poll()
        _reap()
        left = _session_processes(root)
        if not left and proc.poll() is not None:
            break
        new = left - ended
        if new:  # started while stopping: hold on to what they open too
            s, i = _held_files(new)
            shm |= s
            inodes |= i
            ended |= new
            _signal_all(new, signal.SIGTERM)
        time.sleep(0.02)
    for _ in range(3):
        left = _session_processes(root)
        if not left:
            break
        s, i = _held_files(left)
        shm |= s
        inodes |= i
        ended |= left
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.05)
        _reap()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(0.5)
    _reap()
    return len(ended), shm, _socket_paths(inodes)


def _remove(paths: set[str], *, sockets: bool) -> int:
    n = 0
    uid = os.getuid()
    for p in paths:
        with contextlib.suppress(OSError):
            st = os.lstat(p)
            if st.st_uid != uid or (sockets and not stat.S_ISSOCK(st.st_mode)):
                continue
            os.unlink(p)
            n += 1
    return n


def supervise(argv: list[str], *, prog: str, command: list[str] | None = None) -> int:
    """Run ``command + argv`` (default ``python -m qlink.cli``) as a worker and stop it cleanly on
    SIGINT/SIGTERM; returns its exit status (or 128 + the signal), or -1 where it cannot supervise."""
    if not os.path.isdir("/proc/self"):
        return -1  # cannot supervise here: the caller runs the command itself
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    got: list[int] = []

    def on_signal(signum, _frame):
        got.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the worker imports this qlink
        env = dict(os.environ, **{WORKER_ENV: "1"})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        # after a stop, multiprocessing's resource tracker unlinks the semaphores the run held (good) and
        # warns about each (noise after the one line the stop prints)
        env["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"),
                                                       "ignore:resource_tracker:UserWarning"]))
        cmd = list(command) if command else [sys.executable, "-m", "qlink.cli"]
        proc = subprocess.Popen([*cmd, *argv], env=env, start_new_session=True)
        while not got:
            try:
                rc = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                continue
        if not got:
            left = _session_processes(proc.pid)
            if left:  # processes the command left behind
                _, shm, socks = _end_all(proc.pid, proc)
                _remove(shm, sockets=False)
                _remove(socks, sockets=True)
            # a worker ended by a signal (a crash at exit) gives 128 + the signal, as a shell does: a
            # negative status would read as "cannot supervise" and run the whole command again
            return rc if rc >= 0 else 128 - rc
        signum = got[0]
        t0 = time.monotonic()
        n, shm, socks = _end_all(proc.pid, proc)
        n_shm, n_sock = _remove(shm, sockets=False), _remove(socks, sockets=True)
        print(f"\n{prog}: stopped by {signal.Signals(signum).name}: ended {n} process{'es' if n != 1 else ''} in "
              f"{time.monotonic() - t0:.1f} s; removed {n_shm} /dev/shm entr{'ies' if n_shm != 1 else 'y'} and "
              f"{n_sock} socket file{'s' if n_sock != 1 else ''}", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        for s, h in old.items():
            signal.signal(s, h)
