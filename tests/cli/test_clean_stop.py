"""SIGINT / SIGTERM during a long command: every process of the run ends within 2 s, nothing
is left in /dev/shm, one line is printed, and the exit status is 130 / 143."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           PYTHONUNBUFFERED="1")


def _session(sid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                s = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            rest = s[s.rindex(")") + 2:].split()
            if int(rest[3]) == sid and rest[0] != "Z":
                out.append(int(d))
    return out


def _dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _held_anywhere(names: set[str]) -> set[str]:
    """The /dev/shm names some live process holds open or mapped (other users of this machine)."""
    held = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{d}/fd"):
                try:
                    t = os.readlink(f"/proc/{d}/fd/{fd}")
                except OSError:
                    continue
                if t.startswith("/dev/shm/"):
                    held.add(t[9:].removesuffix(" (deleted)"))
            held |= {n for n in names if f"/dev/shm/{n}" in Path(f"/proc/{d}/maps").read_text()}
        except OSError:
            continue
    return held


def _held_by(pids: list[int]) -> set[str]:
    """/dev/shm names the processes hold open or mapped."""
    held = set()
    for p in pids:
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                try:
                    t = os.readlink(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if t.startswith("/dev/shm/"):
                    held.add(t[9:].removesuffix(" (deleted)"))
            for ln in Path(f"/proc/{p}/maps").read_text().splitlines():
                i = ln.find("/dev/shm/")
                if i >= 0:
                    held.add(ln[i + 9:].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return held


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig,after_s,status", [(signal.SIGINT, 4.0, 130), (signal.SIGINT, 12.0, 130),
                                                 (signal.SIGTERM, 8.0, 143)],
                         ids=["sigint-early", "sigint-later", "sigterm"])
def test_a_stopped_run_leaves_nothing_behind(tmp_path, sig, after_s, status):
    before = _dev_shm()
    proc = subprocess.Popen([sys.executable, "-m", "qlink.cli", "run", "--quick", "--out", str(tmp_path / "out")],
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        worker = None
        while time.monotonic() < deadline and worker is None:  # the supervisor's worker runs the job
            kids = _children(proc.pid)
            worker = kids[0] if kids else None
            time.sleep(0.05)
        assert worker is not None, "no worker process started"
        ours: set[str] = set()  # what the run holds in /dev/shm (multiprocessing semaphores, UCX, ...)
        until = time.monotonic() + after_s  # into the measurements: the decoder service and its peers run
        while time.monotonic() < until:
            ours |= _held_by(_session(worker))
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        assert len(_session(worker)) >= 1
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, (out[-2000:], err[-2000:])
    assert took < 4.0, took  # every child ends within 2 s (plus the supervisor's own start-up slack)
    assert _session(worker) == [], "processes of the run are still alive"
    assert "Traceback" not in err and "Traceback" not in out
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"qlink run: stopped by {signal.Signals(sig).name}"), err[-2000:]
    assert sum("stopped by" in ln for ln in err.splitlines()) == 1
    assert not (ours & _dev_shm()), ours & _dev_shm()  # what the run held is gone
    time.sleep(1.0)
    new = {n for n in _dev_shm() - before if not n.startswith("sem.mp-")}  # other users' semaphores come and go
    leaked = new - _held_anywhere(new)
    assert leaked == set(), leaked


@pytest.mark.timeout(120)
def test_a_finished_command_keeps_its_status_and_bad_input_is_not_supervised(tmp_path):
    r = subprocess.run([sys.executable, "-m", "qlink.cli", "bench", "qec", "--distances", "4"], cwd=tmp_path,
                       env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_scenario_script_stops_cleanly_too(tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / "scenarios" / "realtime_loop.py"), "--quick", "--out",
                             str(tmp_path / "out")], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        worker = None
        while time.monotonic() < deadline and worker is None:
            kids = _children(proc.pid)
            worker = kids[0] if kids else None
            time.sleep(0.05)
        assert worker is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_session(worker)) < 2:  # the decoder service is up
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out[-2000:], err[-2000:])
    assert _session(worker) == []
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("realtime_loop.py: stopped by SIGINT")


@pytest.mark.timeout(60)
def test_a_worker_killed_by_a_signal_is_not_run_a_second_time(tmp_path):
    """A worker that dies by a signal gives 128 + the signal; it is never read as "cannot supervise"
    (which would run the whole command again in the supervisor)."""
    marker = tmp_path / "runs"
    worker = (f"import os, signal; open({str(marker)!r}, 'a').write('x'); "
              "os.kill(os.getpid(), signal.SIGSEGV)")
    # the supervisor in a process of its own (it makes itself a child subreaper)
    sup = ("import sys; from qlink._supervise import supervise; "
           f"sys.exit(supervise([], prog='qlink test', command=[sys.executable, '-c', {worker!r}]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", sup], env=env, capture_output=True, text=True, timeout=50)
    assert r.returncode == 128 + signal.SIGSEGV, r.stderr
    assert marker.read_text() == "x"  # it ran once
