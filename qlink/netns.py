"""Two test hosts on one machine: Linux network namespaces joined by a veth pair.

:func:`two_hosts` (root only) creates two network namespaces with unique names, one
veth pair between them with an address each in a private /30 of their own
(``10.233.0.0/30`` unless told otherwise: ``.1`` for host ``a``, ``.2`` for host ``b``),
brings up ``lo`` and the veth ends, and yields a :class:`TwoHosts`. Each namespace
holds nothing but its loopback and its veth end, and no route but the /30: traffic
from inside cannot reach any address outside the pair. On exit (also when the body
raises) every process started through it is killed and both namespaces are deleted,
which deletes the veth pair; a namespace still listed afterwards is an error.

Code runs inside a namespace as a separate process started with ``ip netns exec``
(which also gives the process a ``/sys`` of its namespace, as UCX expects):

* :meth:`Host.run` / :meth:`Host.popen`: any command;
* :meth:`Host.start` / :meth:`Host.call`: a Python function named ``"module:function"``
  with JSON keyword arguments, run by ``python -m qlink.netns``. The function may take
  an ``emit`` argument to send JSON messages back while it runs (a listening URL, say);
  its return value comes back as JSON. Nothing is pickled.

>>> reason = netns_unavailable()
>>> reason is None or isinstance(reason, str)
True
>>> check_subnet("10.233.7.0/30")
('10.233.7.1', '10.233.7.2', 30)
>>> check_subnet("8.8.8.0/30")
Traceback (most recent call last):
...
ValueError: subnet 8.8.8.0/30 is not a private IPv4 range; use one like 10.233.0.0/30
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import inspect
import ipaddress
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qlink.errors import CapabilityError, QlinkError, QlinkTimeoutError

__all__ = ["two_hosts", "TwoHosts", "Host", "HostProcess", "NetnsError", "netns_unavailable", "check_subnet",
           "DEFAULT_SUBNET", "NAME_PREFIX"]

DEFAULT_SUBNET = "10.233.0.0/30"
NAME_PREFIX = "qlink-"
_counter = itertools.count()
_PKG_ROOT = str(Path(__file__).resolve().parent.parent)  # the directory holding the qlink package


class NetnsError(QlinkError):
    """Creating, using or removing the test namespaces failed; the message has ``ip``'s words."""


def _ip(*args: str, check: bool = True, timeout_s: float = 20.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


@functools.lru_cache(maxsize=1)
def netns_unavailable() -> str | None:
    """None when :func:`two_hosts` can run here, else why not (a sentence to skip a test with).

    Probes once per process by making (and removing) a namespace with a veth pair inside."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run as root, e.g. in CI's container)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing; install it with: apt-get install -y iproute2"
    name = f"{NAME_PREFIX}{os.getpid()}-probe{next(_counter)}"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
        veth = _ip("-n", name, "link", "add", "qlprobe0", "type", "veth", "peer", "name", "qlprobe1", check=False)
        if veth.returncode != 0:
            return f"veth pairs cannot be created here: {veth.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip` could not be run: {e}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


def check_subnet(subnet: str) -> tuple[str, str, int]:
    """The two host addresses (first and second) of a private IPv4 subnet with room for two, and its prefix."""
    try:
        net = ipaddress.ip_network(subnet, strict=True)
    except ValueError as e:
        raise ValueError(f"subnet {subnet!r} is not a network like 10.233.0.0/30 ({e})") from None
    if net.version != 4 or not net.is_private or net.is_loopback or net.is_link_local:
        raise ValueError(f"subnet {subnet} is not a private IPv4 range; use one like {DEFAULT_SUBNET}")
    if net.prefixlen > 30:
        raise ValueError(f"subnet {subnet} has no room for two hosts; use a /30 (or wider)")
    hosts = itertools.islice(net.hosts(), 2)
    a, b = (str(h) for h in hosts)
    return a, b, net.prefixlen


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces this module made in processes that no longer run (a crash's leftovers)."""
    listing = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in listing:
        name = line.split(" ", 1)[0].strip()
        if not name.startswith(NAME_PREFIX):
            continue
        pid = name[len(NAME_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            if _ip("netns", "del", name, check=False).returncode == 0:
                removed.append(name)
    return removed


def _child_env(env: dict | None) -> dict:
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([_PKG_ROOT, *[p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]])
    out["PYTHONUNBUFFERED"] = "1"
    if env:
        out.update({str(k): str(v) for k, v in env.items()})
    return out


class HostProcess:
    """A Python function running in a namespace (see :meth:`Host.start`).

    :meth:`receive` returns the messages it emits, in order; :meth:`result` its return value.
    """

    def __init__(self, popen: subprocess.Popen, target: str, host: str) -> None:
        self.popen = popen
        self.target = target
        self.host = host
        self._messages: queue.Queue = queue.Queue()
        self._stderr: collections.deque = collections.deque(maxlen=40)
        self._final: dict | None = None
        self._out = threading.Thread(target=self._read_out, daemon=True, name=f"netns-out-{popen.pid}")
        self._err = threading.Thread(target=self._read_err, daemon=True, name=f"netns-err-{popen.pid}")
        self._out.start()
        self._err.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read_out(self) -> None:
        for line in self.popen.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                self._stderr.append(f"(unparsable output) {line.rstrip()}")
                continue
            self._messages.put(msg)
        self._messages.put(None)  # end of output

    def _read_err(self) -> None:
        for line in self.popen.stderr:
            self._stderr.append(line.rstrip())

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr)

    def _fail(self, what: str) -> NetnsError:
        self._err.join(2)
        return NetnsError(f"{self.target} in namespace {self.host} {what} (exit code {self.popen.poll()}); "
                          f"its stderr ends with:\n{self.stderr_tail()}")

    def _next(self, timeout_s: float):
        try:
            return self._messages.get(timeout=timeout_s)
        except queue.Empty:
            raise QlinkTimeoutError(f"{self.target} in namespace {self.host} said nothing within "
                                    f"timeout_s={timeout_s}") from None

    def receive(self, *, timeout_s: float = 60.0) -> Any:
        """The next message the function emitted; :class:`NetnsError` if it ended instead."""
        msg = self._next(timeout_s)
        if msg is None:
            raise self._fail("ended without the message expected")
        if "emit" in msg:
            return msg["emit"]
        self._final = msg
        if "error" in msg:
            raise self._fail(f"failed: {msg['error']}")
        raise self._fail("returned before emitting the message expected")

    def result(self, *, timeout_s: float = 60.0) -> Any:
        """Wait for the function's return value (skipping unread messages) and reap the process."""
        deadline = time.monotonic() + timeout_s
        while self._final is None:
            msg = self._next(max(0.0, deadline - time.monotonic()))
            if msg is None:
                raise self._fail("ended without a result")
            if "emit" not in msg:
                self._final = msg
        try:
            self.popen.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if "error" in self._final:
            raise self._fail(f"failed: {self._final['error']}")
        return self._final["result"]

    def close(self) -> None:
        """Kill the process (and anything it started in its session) if it still runs."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(3)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        for s in (self.popen.stdout, self.popen.stderr, self.popen.stdin):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()


@dataclass
class Host:
    """One end of the pair: a namespace, its veth interface and its address."""

    name: str
    ifname: str
    address: str
    peer_address: str
    _procs: list = field(default_factory=list, repr=False)

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` prefixed to run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: list[str], *, timeout_s: float = 60.0, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside the namespace and wait for it (output captured as text)."""
        proc = subprocess.run(self.argv(list(argv)), capture_output=True, text=True, timeout=timeout_s,
                              env=_child_env(env))
        if check and proc.returncode != 0:
            raise NetnsError(f"{argv!r} in namespace {self.name} failed (exit {proc.returncode}): "
                             f"{proc.stderr.strip()[-2000:]}")
        return proc

    def popen(self, argv: list[str], *, env: dict | None = None, **kwargs) -> subprocess.Popen:
        """Start a command inside the namespace, in its own session; killed when the pair is torn down."""
        proc = subprocess.Popen(self.argv(list(argv)), env=_child_env(env), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def start(self, target: str, kwargs: dict | None = None, *, env: dict | None = None) -> HostProcess:
        """Run the function ``target`` (``"package.module:function"``) with keyword arguments
        ``kwargs`` (JSON-able) in the namespace; ``env`` adds environment variables."""
        if not isinstance(target, str) or target.count(":") != 1:
            raise ValueError(f"target must be 'package.module:function', got {target!r}")
        try:
            payload = json.dumps(dict(kwargs or {}))
        except TypeError as e:
            raise TypeError(f"kwargs for {target} must be JSON-able: {e}") from None
        proc = self.popen([sys.executable, "-m", "qlink.netns", "call", target], env=env, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        handle = HostProcess(proc, target, self.name)
        self._procs[-1] = handle
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once; result() says why
        return handle

    def call(self, target: str, kwargs: dict | None = None, *, timeout_s: float = 120.0,
             env: dict | None = None) -> Any:
        """:meth:`start` and wait (up to ``timeout_s``) for the return value."""
        handle = self.start(target, kwargs, env=env)
        try:
            return handle.result(timeout_s=timeout_s)
        finally:
            handle.close()

    def _kill_all(self) -> None:
        for p in self._procs:
            if isinstance(p, HostProcess):
                p.close()
            elif p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)
        self._procs.clear()


@dataclass
class TwoHosts:
    """Hosts ``a`` and ``b`` joined by one veth pair on ``subnet``."""

    a: Host
    b: Host
    subnet: str

    @property
    def names(self) -> tuple[str, str]:
        return self.a.name, self.b.name


def _listed() -> set[str]:
    return {line.split(" ", 1)[0].strip() for line in _ip("netns", "list", check=False).stdout.split("\n") if line}


@contextlib.contextmanager
def two_hosts(*, subnet: str = DEFAULT_SUBNET, mtu: int | None = None):
    """Create two namespaces joined by a veth pair; yield :class:`TwoHosts`; remove everything after.

    Raises :class:`~qlink.errors.CapabilityError` (with the reason) where namespaces cannot
    be made, :class:`NetnsError` when an ``ip`` step fails or something is left behind.
    """
    addr_a, addr_b, prefix = check_subnet(subnet)
    why = netns_unavailable()
    if why:
        raise CapabilityError(f"two test hosts cannot be made here: {why}")
    remove_stale_namespaces()
    n = next(_counter)
    base = f"{NAME_PREFIX}{os.getpid()}-{n}"
    tag = f"{os.getpid() % 100000}{n % 100}"
    a = Host(name=f"{base}-a", ifname=f"qla{tag}", address=addr_a, peer_address=addr_b)
    b = Host(name=f"{base}-b", ifname=f"qlb{tag}", address=addr_b, peer_address=addr_a)
    made: list[str] = []
    try:
        for h in (a, b):
            _ip("netns", "add", h.name)
            made.append(h.name)
        _ip("link", "add", a.ifname, "netns", a.name, "type", "veth", "peer", "name", b.ifname, "netns", b.name)
        for h in (a, b):
            _ip("-n", h.name, "link", "set", "lo", "up")
            _ip("-n", h.name, "addr", "add", f"{h.address}/{prefix}", "dev", h.ifname)
            # no IPv6 link-local address: the pair carries only the IPv4 traffic it is given
            _ip("-n", h.name, "link", "set", "dev", h.ifname, "addrgenmode", "none", check=False)
            if mtu is not None:
                _ip("-n", h.name, "link", "set", h.ifname, "mtu", str(int(mtu)))
            _ip("-n", h.name, "link", "set", h.ifname, "up")
        yield TwoHosts(a=a, b=b, subnet=subnet)
    finally:
        for h in (a, b):
            h._kill_all()
        errors = []
        for name in made:
            gone = _ip("netns", "del", name, check=False)
            if gone.returncode != 0:
                errors.append(f"{name}: {gone.stderr.strip()}")
        left = _listed() & set(made)
        if left or errors:
            raise NetnsError(f"namespaces left behind: {sorted(left)} {errors}; remove them with `ip netns del NAME`")


# ---------------------------------------------------------------------- the child side


def _child_main(argv: list[str]) -> int:
    """``python -m qlink.netns call module:function``: kwargs JSON on stdin, JSON lines out."""
    if len(argv) != 2 or argv[0] != "call":
        print("usage: python -m qlink.netns call package.module:function  (JSON kwargs on stdin)", file=sys.stderr)
        return 2
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the function prints goes to stderr; stdout carries only our JSON lines

    def emit(obj) -> None:
        proto.write(json.dumps({"emit": obj}) + "\n")
        proto.flush()

    try:
        kwargs = json.loads(sys.stdin.read() or "{}")
        mod_name, fn_name = argv[1].split(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        if "emit" in inspect.signature(fn).parameters:
            kwargs["emit"] = emit
        result = fn(**kwargs)
        proto.write(json.dumps({"result": result}) + "\n")
        code = 0
    except BaseException as e:  # reported to the parent, which raises NetnsError with it
        traceback.print_exc()
        proto.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        code = 1
    proto.flush()
    return code


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
