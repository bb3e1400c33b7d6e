"""Safe defaults: listeners on loopback unless told otherwise, shared memory that only its owner
can reach (memfds, a 0700 directory, a 0600 socket, nothing in /dev/shm), keys a peer cannot
guess, no unpickling or eval of data anywhere, and clients speaking the wrong protocol
refused with a reason while the others carry on."""

from __future__ import annotations

import ast
import os
import pathlib
import socket
import stat
import struct
import sys
import threading
import time

import numpy as np
import pytest

import transports
from qlink import wire
from qlink.errors import BrokenLinkError, QlinkTimeoutError, RegistrationError, WireError
from qlink.memory import RemoteRegion, alloc
from qlink.wire import Status

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[2]
_LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net shows them


def _our_sockets() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _bound(kinds=("tcp", "tcp6", "udp", "udp6")) -> list[tuple[str, str, int, str]]:
    """(kind, local address hex, port, state) of every inet socket this process holds."""
    ours = _our_sockets()
    rows = []
    for kind in kinds:
        try:
            lines = open(f"/proc/self/net/{kind}").read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for ln in lines:
            f = ln.split()
            addr, port = f[1].split(":")
            if f[9] in ours:
                rows.append((kind, addr, int(port, 16), f[3]))
    return rows


def _listening(rows):
    # tcp LISTEN is state 0A; an unconnected udp socket waiting for datagrams is state 07
    return [r for r in rows if (r[0].startswith("tcp") and r[3] == "0A") or (r[0].startswith("udp") and r[3] == "07")]


@pytest.mark.parametrize("scheme", ["tcp", "udp", "ucx"])
def test_listeners_bind_loopback_unless_an_address_is_given(scheme):
    if scheme == "ucx":
        pytest.importorskip("ucxx", reason="the ucx:// transport needs the optional 'ucxx' package")
    before = {r[2] for r in _listening(_bound())}
    with transports.listen(f"{scheme}://:0") as lis:  # no host given
        assert "127.0.0.1" in lis.url
        a = transports.connect(lis.url, timeout_s=10)  # with a connection up (UCX opens its transports lazily)
        a.send(b"hello")
        b = lis.accept(timeout_s=10)
        assert b.recv(timeout_s=10) == b"hello"
        new = [r for r in _listening(_bound()) if r[2] not in before]
        a.close(), b.close()
        assert new, "the listener holds no inet socket of this process"
        exposed = [r for r in new if r[1] not in _LOOPBACK]
        # nothing this process listens on after listen() -- the bootstrap socket and, for ucx, UCX's own
        # transports -- is reachable from another host
        assert exposed == [], f"{scheme}: sockets bound beyond loopback: {exposed}"


@pytest.mark.parametrize("scheme", ["tcp", "udp"])
def test_an_address_given_explicitly_is_honoured(scheme):
    with transports.listen(f"{scheme}://0.0.0.0:0") as lis:
        port = int(lis.url.rsplit(":", 1)[1])
        rows = [r for r in _listening(_bound()) if r[2] == port]
        assert rows and rows[0][1] == "00000000"


def _shm_url(tag: str) -> str:
    return f"shm://qlsafe-{tag}-{os.getpid()}"


def test_shm_rendezvous_is_owner_only_and_memory_is_memfd():
    from transports._shm_rendezvous import socket_dir

    dev_shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with transports.listen(_shm_url("perm")) as lis:
        a = transports.connect(lis.url, timeout_s=5)
        b = lis.accept(timeout_s=5)
        d = socket_dir()
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and os.stat(d).st_uid == os.getuid()
        sock = os.path.join(d, f"qlsafe-perm-{os.getpid()}.sock")
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        target = alloc(4096)
        b.register(target)
        fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}")]
        assert any(f.startswith("/memfd:") for f in fds), "rings and regions live in memfds"
        dev_shm_now = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        assert [n for n in dev_shm_now - dev_shm_before if "qlink" in n.lower() or "ql" in n[:2]] == []
        a.close(), b.close()
    assert not os.path.exists(sock), "the socket file is removed with the listener"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to try the rendezvous as another user")
def test_another_user_cannot_reach_the_shm_rendezvous():
    from transports._shm_rendezvous import socket_dir

    with transports.listen(_shm_url("other")) as lis:
        path = os.path.join(socket_dir(), f"qlsafe-other-{os.getpid()}.sock")
        pid = os.fork()  # the child only touches a socket, then leaves with os._exit
        if pid == 0:
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    s.connect(path)
                except PermissionError:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
            "a process of another uid got through to the rendezvous socket"
        assert lis.url


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_region_keys_are_unguessable_and_a_forged_descriptor_is_refused(scheme):
    url = _shm_url("key") if scheme == "shm" else "tcp://127.0.0.1:0"
    keys = []
    with transports.listen(url) as lis:
        for _ in range(2):
            a = transports.connect(lis.url, timeout_s=5)
            b = lis.accept(timeout_s=5)
            target = alloc(64)
            region = b.register(target)
            d = region.descriptor()
            keys.append(d.key)
            forged = RemoteRegion(region_id=d.region_id, nbytes=d.nbytes, kind=d.kind,
                                  key=bytes(x ^ 0x01 for x in d.key) if d.key else b"guess")
            with pytest.raises(RegistrationError):
                a.put(b"x" * 8, forged, offset=0, timeout_s=5)
            assert not target.any(), "a forged descriptor wrote into the region"
            a.close(), b.close()
    assert keys[0] != keys[1], "two connections share a region key"
    assert all(len(k) >= 8 for k in keys)


# ----------------------------------------------------------------------- nothing unpickles or evals data

_FORBIDDEN_CALLS = {
    ("pickle", "loads"), ("pickle", "load"), ("pickle", "Unpickler"), ("cPickle", "loads"),
    ("marshal", "loads"), ("marshal", "load"), ("shelve", "open"), ("dill", "loads"), ("cloudpickle", "loads"),
    ("yaml", "load"), ("yaml", "unsafe_load"), ("os", "system"), ("jsonpickle", "decode"),
}
_FORBIDDEN_NAMES = {"eval", "exec", "__import__"}
# Each allowed use, and why it never touches peer bytes.
_ALLOWED: dict[tuple[str, str], str] = {}


def _scan(path: pathlib.Path) -> list[tuple[str, int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                imported[a.asname or a.name] = (node.module.split(".")[0], a.name)
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        what = None
        if isinstance(f, ast.Name):
            if f.id in _FORBIDDEN_NAMES:
                what = f.id
            elif f.id in imported and imported[f.id] in _FORBIDDEN_CALLS:
                what = ".".join(imported[f.id])
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if (f.value.id, f.attr) in _FORBIDDEN_CALLS:
                what = f"{f.value.id}.{f.attr}"
        for kw in node.keywords:
            if kw.arg == "shell" and isinstance(kw.value, ast.Constant) and kw.value.value is True:
                what = "subprocess(shell=True)"
        if what is not None:
            found.append((str(path.relative_to(ROOT)), node.lineno, what))
    return found


def test_no_module_unpickles_evals_or_execs_data():
    hits = []
    for pkg in ("qlink", "transports"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            hits += [h for h in _scan(path) if (h[0], h[2]) not in _ALLOWED]
    assert hits == [], "pickle/marshal/eval/exec on data (add to _ALLOWED only with a reason): " + repr(hits)


def test_the_scan_would_see_a_forbidden_call(tmp_path):
    p = ROOT / "qlink" / "_scan_probe_tmp.py"
    try:
        p.write_text("import pickle\nfrom marshal import loads\n"
                     "def f(b):\n    return pickle.loads(b), loads(b), eval(b)\n")
        assert [h[2] for h in _scan(p)] == ["pickle.loads", "marshal.loads", "eval"]
    finally:
        p.unlink()


def test_no_module_imports_pickle_at_all():
    """Multiprocessing pipes between qlink's own processes pickle under the hood (a local control
    channel, never peer traffic); qlink itself never imports pickle."""
    hits = []
    for pkg in ("qlink", "transports"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if any(n.split(".")[0] in ("pickle", "cPickle", "marshal", "dill", "cloudpickle") for n in names):
                    hits.append((str(path.relative_to(ROOT)), node.lineno))
    assert hits == []


# ----------------------------------------------------------------------- wrong protocol: refused, others fine


def _tcp_raw_hello(url: str, hello: bytes) -> bytes:
    host, port = url[len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(hello)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return out
            out += chunk


@pytest.mark.parametrize("hello, says", [
    (b"HTTP" + bytes(12), "magic"),
    (struct.pack("<4sHHQ", b"QLTC", 99, 0, 1), "version"),
])
def test_a_tcp_client_with_the_wrong_magic_or_version_is_refused_and_others_carry_on(hello, says):
    with transports.listen("tcp://127.0.0.1:0") as lis:
        good = transports.connect(lis.url, timeout_s=5)
        server = lis.accept(timeout_s=5)
        stop = threading.Event()
        echoed = []

        def echo():
            buf = bytearray(64)
            while not stop.is_set():
                try:
                    n = server.recv_into(buf, timeout_s=0.05)
                except QlinkTimeoutError:
                    continue
                echoed.append(n)  # before the echo leaves: the main thread checks the count once it has it
                server.send(buf[:n])

        t = threading.Thread(target=echo, daemon=True)
        t.start()
        try:
            for i in range(20):
                good.send(b"ping%d" % i)
                if i == 5:
                    reply = _tcp_raw_hello(lis.url, hello)  # a stranger in the middle of the good client's work
                assert good.recv(timeout_s=5) == b"ping%d" % i
            assert says in reply.decode("latin-1").lower(), reply
            assert lis.refused_handshakes >= 1 and len(echoed) == 20
            with pytest.raises(QlinkTimeoutError):
                lis.accept(timeout_s=0.2)  # the stranger never became an endpoint
        finally:
            stop.set()
            t.join(5)
            good.close(), server.close()


def test_a_qlink_client_meeting_a_non_qlink_server_says_so():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def answer():
        c, _ = srv.accept()
        c.recv(64)
        c.sendall(b"SSH-2.0-OpenSSH_9.0\r\n" + bytes(32))
        time.sleep(0.2)
        c.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    with pytest.raises((WireError, BrokenLinkError)) as e:
        transports.connect(f"tcp://127.0.0.1:{port}", timeout_s=5)
    assert "magic" in str(e.value).lower() or "not" in str(e.value).lower()
    t.join(5)
    srv.close()


def test_the_decoder_service_over_udp_ignores_strangers_and_keeps_answering_others():
    from qlink.qec.decoders import compile_decoder
    from qlink.qec.service import DecoderConfig, DecoderService
    from qlink.qec.sources import StimSource

    src = StimSource.surface_code(distance=3, rounds=3, p=0.01)
    dem = src.detector_error_model(decompose_errors=True)
    dets = src.sample(20, seed=9).detection_events.astype(np.uint8)
    expected = compile_decoder("pymatching", dem).decode_batch(dets)
    svc = DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem, frames_per_shot=1)})
    stop = threading.Event()
    with transports.listen("udp://127.0.0.1:0") as lis:
        ep = lis.serve_endpoint()
        t = threading.Thread(target=svc.serve, args=(ep,), kwargs=dict(stop_event=stop), daemon=True)
        t.start()
        stranger = transports.connect(lis.url)
        good = transports.connect(lis.url)
        try:
            buf = bytearray(256)
            bad_frames = [b"GET / HTTP/1.1\r\n\r\n" + bytes(8),  # another protocol: bad magic
                          struct.pack("<IIIIQ", wire.RESPONSE_MAGIC, 0, 0, 5, 0),  # a response where a request goes
                          b"\x52\x51\x55\x43" + bytes(10),  # the right magic, then too short
                          struct.pack("<IIIIQ", wire.REQUEST_MAGIC, 0xDEADBEEF, 0, 77, 0)]  # unknown function
            for shot in range(20):
                stranger.send(bad_frames[shot % len(bad_frames)])
                n = wire.encode_enqueue_syndromes_into(buf, request_id=shot, decoder_id=0, counter=shot,
                                                       syndrome_mapping_id=0, syndromes=dets[shot])
                good.send(buf[:n])
                n = wire.encode_get_corrections_into(buf, request_id=1000 + shot, decoder_id=0, return_size=1,
                                                     reset=True)
                good.send(buf[:n])
                while True:
                    r = wire.decode_response(good.recv(timeout_s=5))
                    if r.request_id == 1000 + shot:
                        break
                    assert r.status == Status.OK  # an enqueue acknowledged, nothing else reaches this client
                assert r.status == Status.OK and r.result[0] & 1 == int(expected[shot][0]), f"shot {shot}"
            # the stranger got answers only where a request_id could be read (unknown function: BAD_REQUEST)
            answers = []
            while True:
                try:
                    answers.append(wire.decode_response(stranger.recv(timeout_s=0.2)))
                except QlinkTimeoutError:
                    break
            assert answers and {a.request_id for a in answers} == {77}
            assert all(a.status == Status.BAD_REQUEST for a in answers)
            faults = svc.report()["faults"]
            assert faults["bad_magic"] >= 10 and faults["short_buffer"] >= 5 and faults["unknown_function"] >= 5
        finally:
            stop.set()
            t.join(5)
            stranger.close(), good.close(), ep.close()
