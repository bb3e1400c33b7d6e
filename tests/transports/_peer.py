"""A scriptable peer for the transport conformance suite.

The peer connects to a URL, says ``HELO`` and then obeys commands that arrive as
ordinary two-sided messages: a 4-byte opcode followed by little-endian arguments.
It runs as a separate process (``python _peer.py URL``, or started warm with
``python _peer.py --warm SCHEME`` and given the URL on stdin) for cross-process
transports, or as a thread for ``inproc://``. Its exit code (or ``result`` for a
thread) tells the test whether the checks it made on its side passed.

Opcodes (arguments after the opcode):

``ECHO`` payload
    send the payload back.
``GEN_`` <u32 seed, u32 count> count x <u64 nbytes>
    send ``count`` messages, message i = ``payload(seed + i, nbytes[i])``.
``SUM_`` <u32 count>
    receive ``count`` messages, answer count x <u64 nbytes, u32 crc32>.
``HOLD`` <f64 sleep_s>
    sleep without receiving, then receive until a message ``END!``; answer
    <u64 count, u32 crc32 chained over all of them>.
``REG_`` <u64 nbytes>
    register a zeroed ``qlink.memory.alloc`` region, answer its descriptor bytes.
``DREG`` <u32 region_id>
    deregister it, answer ``DREG-OK``.
``WPUT`` <f64 timeout_s>
    wait for a put notification, answer <u32 region_id, u64 offset, u64 nbytes,
    u64 notify_id, u32 crc32 of the region bytes it names, u16 tag length> + tag.
``PUTS`` <u32 count> count x (<u64 offset, u64 notify_id, u32 seed, u64 nbytes,
    u16 tag length> + tag) + descriptor
    do the puts back to back (data ``payload(seed, nbytes)``), answer ``PUT-OK``.
``MIX_`` <u32 count> + descriptor
    for i in range(count): put ``payload(i, 64 + i)`` at ``i * 256`` with notify_id i
    and tag ``b"m%d" % i``, then send ``b"msg%d" % i``.
``SCLO`` <u32 count, u64 nbytes> [+ descriptor]
    send ``count`` messages ``payload(i, nbytes)``, put ``payload(99, 64)`` at offset 0
    with notify_id 7 when a descriptor is given, then close and exit 0.
``ECLO`` <u32 count, f64 timeout_s>
    receive ``count`` messages, then expect BrokenLinkError from the next receive
    within timeout_s; exit 0 if so, 3 otherwise.
``QUIT``
    close and exit 0.

A command that fails with a qlink error answers ``ERR!`` + its description.
When the test closes its side, the peer exits 0.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_TEST_MESSAGE = (16 << 20) + 64

_PUT_SPEC = struct.Struct("<QQIQH")
_NOTE_REPLY = struct.Struct("<IQQQIH")


def payload(seed: int, nbytes: int) -> bytes:
    """Deterministic pseudo-random bytes; both sides regenerate them to compare."""
    return np.random.default_rng(seed).bytes(nbytes)


def crc(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def put_spec(*, offset: int, notify_id: int, seed: int, nbytes: int, tag: bytes = b"") -> bytes:
    return _PUT_SPEC.pack(offset, notify_id, seed, nbytes, len(tag)) + tag


def parse_note_reply(data: bytes) -> tuple[int, int, int, int, int, bytes]:
    """``(region_id, offset, nbytes, notify_id, crc, tag)`` from a ``WPUT`` answer."""
    rid, off, n, nid, c, tag_n = _NOTE_REPLY.unpack_from(data, 0)
    return rid, off, n, nid, c, bytes(data[_NOTE_REPLY.size:_NOTE_REPLY.size + tag_n])


class _Done(Exception):
    def __init__(self, code: int):
        self.code = code


def serve(ep) -> int:
    """Obey commands on ``ep`` until told to stop or the test closes its side; return the exit code."""
    from qlink.errors import BrokenLinkError, QlinkError
    from qlink.memory import RemoteRegion, alloc

    buf = bytearray(MAX_TEST_MESSAGE)
    view = memoryview(buf)
    regions: dict[int, tuple[np.ndarray, object]] = {}

    def recv() -> memoryview:
        n = ep.recv_into(buf, timeout_s=60)
        return view[:n]

    while True:
        try:
            msg = recv()
        except BrokenLinkError:
            ep.close()
            return 0
        op, args = bytes(msg[:4]), msg[4:]
        try:
            if op == b"ECHO":
                ep.send(args, timeout_s=60)
            elif op == b"GEN_":
                seed, count = struct.unpack_from("<II", args, 0)
                sizes = struct.unpack_from(f"<{count}Q", args, 8)
                for i, n in enumerate(sizes):
                    ep.send(payload(seed + i, n), timeout_s=60)
            elif op == b"SUM_":
                (count,) = struct.unpack_from("<I", args, 0)
                out = bytearray()
                for _ in range(count):
                    m = recv()
                    out += struct.pack("<QI", len(m), crc(m))
                ep.send(bytes(out), timeout_s=60)
            elif op == b"HOLD":
                (sleep_s,) = struct.unpack_from("<d", args, 0)
                time.sleep(sleep_s)
                count, chain = 0, 0
                while True:
                    m = recv()
                    if bytes(m) == b"END!":
                        break
                    count += 1
                    chain = zlib.crc32(m, chain)
                ep.send(struct.pack("<QI", count, chain & 0xFFFFFFFF), timeout_s=60)
            elif op == b"REG_":
                (nbytes,) = struct.unpack_from("<Q", args, 0)
                arr = alloc(nbytes)
                region = ep.register(arr)
                regions[region.region_id] = (arr, region)
                ep.send(region.descriptor().to_bytes(), timeout_s=60)
            elif op == b"DREG":
                (rid,) = struct.unpack_from("<I", args, 0)
                ep.deregister(regions.pop(rid)[1])
                ep.send(b"DREG-OK", timeout_s=60)
            elif op == b"WPUT":
                (timeout_s,) = struct.unpack_from("<d", args, 0)
                note = ep.wait_notification(timeout_s=timeout_s)
                arr = regions[note.region_id][0]
                c = crc(memoryview(arr)[note.offset:note.offset + note.nbytes])
                ep.send(_NOTE_REPLY.pack(note.region_id, note.offset, note.nbytes, note.notify_id, c, len(note.tag))
                        + note.tag, timeout_s=60)
            elif op == b"PUTS":
                (count,) = struct.unpack_from("<I", args, 0)
                at = 4
                todo = []
                for _ in range(count):
                    off, nid, seed, n, tag_n = _PUT_SPEC.unpack_from(args, at)
                    at += _PUT_SPEC.size
                    todo.append((off, nid, seed, n, bytes(args[at:at + tag_n])))
                    at += tag_n
                remote = RemoteRegion.from_bytes(bytes(args[at:]))
                for off, nid, seed, n, tag in todo:
                    ep.put(payload(seed, n), remote, offset=off, notify_id=nid, tag=tag, timeout_s=60)
                ep.send(b"PUT-OK", timeout_s=60)
            elif op == b"MIX_":
                (count,) = struct.unpack_from("<I", args, 0)
                remote = RemoteRegion.from_bytes(bytes(args[4:]))
                for i in range(count):
                    ep.put(payload(i, 64 + i), remote, offset=i * 256, notify_id=i, tag=b"m%d" % i, timeout_s=60)
                    ep.send(b"msg%d" % i, timeout_s=60)
            elif op == b"SCLO":
                count, n = struct.unpack_from("<IQ", args, 0)
                for i in range(count):
                    ep.send(payload(i, n), timeout_s=60)
                if len(args) > 12:
                    ep.put(payload(99, 64), RemoteRegion.from_bytes(bytes(args[12:])), offset=0, notify_id=7, timeout_s=60)
                ep.close()
                return 0
            elif op == b"ECLO":
                count, timeout_s = struct.unpack_from("<Id", args, 0)
                for _ in range(count):
                    recv()
                try:
                    ep.recv_into(buf, timeout_s=timeout_s)
                except BrokenLinkError:
                    ep.close()
                    return 0
                except QlinkError as e:
                    print(f"peer: expected BrokenLinkError after the test closed, got {e!r}", file=sys.stderr)
                    return 3
                print("peer: expected BrokenLinkError after the test closed, got another message", file=sys.stderr)
                return 3
            elif op == b"QUIT":
                ep.close()
                return 0
            else:
                ep.send(b"ERR!unknown opcode " + op, timeout_s=60)
        except BrokenLinkError:
            ep.close()
            return 0
        except QlinkError as e:
            ep.send(f"ERR!{type(e).__name__}: {e}".encode(), timeout_s=60)


def _connect_and_serve(url: str) -> int:
    import transports

    ep = transports.connect(url, timeout_s=60)
    ep.send(b"HELO" + struct.pack("<I", os.getpid()), timeout_s=60)
    return serve(ep)


class ThreadPeer:
    """The peer as a thread of this process (for transports that do not cross processes)."""

    is_process = False

    def __init__(self, url: str):
        self.result: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url,), name=f"peer {url}", daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        try:
            self.result = _connect_and_serve(url)
        except BaseException as e:  # reported by wait()
            self.error = e
            self.result = 1

    def wait(self, timeout_s: float) -> int | None:
        self._thread.join(timeout_s)
        if self.error is not None:
            raise AssertionError(f"peer thread failed: {self.error!r}") from self.error
        return self.result

    def kill(self) -> None:
        raise RuntimeError("a thread peer cannot be killed; cross-process tests skip inproc")

    def stop(self) -> None:
        self._thread.join(5)

    def diagnostics(self) -> str:
        return "".join(traceback.format_exception(self.error)) if self.error else ""


class ProcessPeer:
    """The peer as a child process (``subprocess``), always reaped by :meth:`stop`.

    The process starts *warm*: it imports qlink and the transport module (plus any
    ``preload`` modules, e.g. the transport's optional stack), then waits for the URL on
    its stdin, so the import time of a heavy stack overlaps with the previous test.
    """

    is_process = True

    def __init__(self, scheme: str, preload: tuple[str, ...] = ()):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--warm", scheme, *preload],
                                     env=env, stdin=subprocess.PIPE, stdout=self._stderr, stderr=self._stderr)
        self.killed_at: float | None = None

    def attach(self, url: str) -> None:
        """Tell the waiting process where to connect."""
        self.proc.stdin.write(url.encode() + b"\n")
        self.proc.stdin.close()

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the peer; a watcher notes when it is gone (:meth:`exited_at`)."""
        import select

        try:
            pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            pidfd = None
        self._exited: list[float] = []

        def watch():
            if pidfd is None:
                return
            try:
                if select.select([pidfd], [], [], 60)[0]:
                    self._exited.append(time.monotonic())
            finally:
                os.close(pidfd)

        self._watcher = threading.Thread(target=watch, daemon=True)
        self._watcher.start()  # before the signal: a survivor may notice the death (and ask) at once
        self.killed_at = time.monotonic()
        self.proc.send_signal(signal.SIGKILL)

    def exited_at(self) -> float:
        """When the killed peer was gone (its sockets closed by the kernel), or the kill's time
        where that could not be watched. On a loaded host the dying process waits for a core
        before the kernel ends it; a transport can only notice its end after that."""
        self._watcher.join(60)
        return self._exited[0] if self._exited else self.killed_at

    def stop(self) -> None:
        if not self.proc.stdin.closed:
            self.proc.stdin.close()  # a process still waiting for its URL exits on EOF
        if self.wait(5) is None:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()

    def diagnostics(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")


_warm: dict[tuple, ProcessPeer] = {}


def start(url: str, *, in_thread: bool, preload: tuple[str, ...] = ()):
    """Start a peer that connects to ``url`` (a thread, or a process taken from the warm pool)."""
    if in_thread:
        return ThreadPeer(url)
    key = (urlsplit(url).scheme or url.split("://", 1)[0], tuple(preload))  # urlsplit drops 'cuda_ipc'
    peer = _warm.pop(key, None)
    if peer is None or peer.proc.poll() is not None:
        if peer is not None:
            peer.stop()
        peer = ProcessPeer(*key)
    peer.attach(url)
    _warm[key] = ProcessPeer(*key)  # warms up while this peer works
    return peer


_retired: list[ProcessPeer] = []


def retire(peer) -> None:
    """A test is done with ``peer``: reap it now if it is a thread or has exited, else later in
    :func:`stop_all` (killed if it has not exited by then), so no test waits for an interpreter to exit."""
    if not peer.is_process:
        peer.stop()
        return
    _retired.append(peer)
    for p in [p for p in _retired if p.proc.poll() is not None]:
        _retired.remove(p)
        p.stop()


def stop_all() -> None:
    """Reap every peer process still around: retired ones and those waiting in the warm pool."""
    while _retired:
        _retired.pop().stop()
    while _warm:
        _warm.popitem()[1].stop()


atexit.register(stop_all)


def _main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[1] == "--warm":
        importlib.import_module(f"transports.{argv[2]}")
        for name in argv[3:]:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        url = sys.stdin.readline().strip()
        return _connect_and_serve(url) if url else 0
    if len(argv) == 2:
        return _connect_and_serve(argv[1])
    print("usage: python _peer.py URL | python _peer.py --warm SCHEME [MODULE...] < URL", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
