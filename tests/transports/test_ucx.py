"""ucx:// specific behaviour: UCX_TLS honoured, loopback-only by default, bad addresses,
a killed peer seen within a second (both UCX error-handling modes), orderly close, the send
buffer bound, software put guards. The contract shared by all transports is checked by the
conformance suite."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import transports
from qlink.errors import BrokenLinkError, ClosedError, QlinkTimeoutError, RegistrationError, WouldBlock
from qlink.memory import RemoteRegion
from transports import ucx  # before ucxx itself, so its UCX environment defaults apply

pytest.importorskip("ucxx", reason="the ucx transport needs ucxx-cu12 (pip install 'qlink[ucx]')")

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _spawn(code: str, *args: str, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(**env), cwd=ROOT)


def _reap(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return out, err


# ----- configuration and addresses ------------------------------------------------------------
_PEER = r"""
import sys, transports
role, url = sys.argv[1], sys.argv[2]
if role == "server":
    lis = transports.listen("ucx://127.0.0.1:0")
    print(lis.url, flush=True)
    ep = lis.accept(timeout_s=10)
    ep.send(ep.recv(timeout_s=10) + b"!")
    import time; time.sleep(0.5)
else:
    ep = transports.connect(url, timeout_s=10)
    ep.send(b"tls?")
    extra = ep.statistics().extra
    print("RESULT", ep.recv(timeout_s=10).decode(), extra["ucx_tls"], ",".join(extra["ucx_lanes"]), flush=True)
"""


def _two_process_exchange(**env) -> tuple[list[str], str]:
    """The client's answer and its UCX protocol-selection report (UCX_PROTO_INFO=y)."""
    server = _spawn(_PEER, "server", "-", **env)
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("ucx://127.0.0.1:"), server.stderr.read()
        client = _spawn(_PEER, "client", url, UCX_PROTO_INFO="y", **env)
        out, err = _reap(client)
    finally:
        _reap(server)
    result = [line.split()[1:] for line in out.splitlines() if line.startswith("RESULT")]
    return (result[0] if result else []), out + err


@pytest.mark.timeout(60)
def test_ucx_tls_from_the_environment_is_honoured():
    result, report = _two_process_exchange(UCX_TLS="tcp,self")
    assert result[:2] == ["tls?!", "tcp,self"], report[-2000:]
    assert result[2].split(",") == ["tcp/lo"], result  # the endpoint's lanes, as UCX reports them
    assert "tcp/lo" in report and "sysv" not in report and "posix" not in report


@pytest.mark.timeout(60)
def test_default_tls_uses_shared_memory_between_local_processes():
    result, report = _two_process_exchange()
    assert result[:2] == ["tls?!", ucx.DEFAULT_UCX_TLS], report[-2000:]
    lanes = result[2].split(",")
    assert "sysv/memory" in lanes or "posix/memory" in lanes, lanes
    assert "tcp/lo" not in lanes and "tcp/eth0" not in lanes


_LISTENERS = r"""
import os, transports
lis = transports.listen("ucx://:0")
a = transports.connect(lis.url, timeout_s=5); b = lis.accept(timeout_s=5)
a.send(b"x"); b.recv(timeout_s=5)
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:  # LISTEN sockets of this process
            print(table[-4:], f[1], flush=True)
print(lis.url)
"""


@pytest.mark.timeout(60)
def test_listens_on_loopback_only_by_default():
    out, err = _reap(_spawn(_LISTENERS))
    lines = out.split()
    assert lines and lines[-1].startswith("ucx://127.0.0.1:"), err[-2000:]
    addrs = [x for x in lines[:-1] if ":" in x and not x.startswith("tcp")]
    assert addrs, "expected the bootstrap listener at least"
    for hexaddr in addrs:  # /proc/net/tcp: little-endian hex IPv4 "0100007F:PORT" is 127.0.0.1
        ip = hexaddr.split(":")[0]
        assert ip == "0100007F", f"a socket of this process listens on {hexaddr}, not on loopback"


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("ucx://127.0.0.1", "needs a port"),
        ("ucx://127.0.0.1:0", "port 0"),
        ("ucx://127.0.0.1:99999", "0..65535"),
        ("ucx://127.0.0.1:5/path", "no path"),
        ("tcp://127.0.0.1:5", "ucx://"),
        ("ucx://:5", "needs a host"),
    ],
)
def test_malformed_urls_are_rejected(url, fragment):
    with pytest.raises(ValueError, match=fragment):
        ucx.connect(url, timeout_s=1)


def test_unknown_options_are_rejected():
    with pytest.raises(TypeError, match="unknown options"):
        transports.listen("ucx://127.0.0.1:0", nonsense=1)


@pytest.mark.timeout(30)
def test_connect_where_nobody_listens_is_a_broken_link():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    t0 = time.monotonic()
    with pytest.raises(BrokenLinkError, match="nobody listens"):
        transports.connect(f"ucx://127.0.0.1:{port}", timeout_s=2)
    assert time.monotonic() - t0 < 2


@pytest.mark.timeout(30)
def test_listen_on_an_address_of_another_machine_or_a_busy_port():
    with pytest.raises(OSError, match="cannot listen"):
        transports.listen("ucx://203.0.113.7:0")  # TEST-NET-3: not an address of this machine
    with transports.listen("ucx://127.0.0.1:0") as lis:
        port = int(lis.url.rsplit(":", 1)[1])
        with pytest.raises(OSError, match="cannot listen"):
            transports.listen(f"ucx://127.0.0.1:{port}")


@pytest.mark.timeout(30)
def test_a_server_that_is_not_qlink_is_refused_and_a_silent_one_times_out():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    url = f"ucx://127.0.0.1:{srv.getsockname()[1]}"

    def garbage():
        c, _ = srv.accept()
        c.recv(1024)
        c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(64))
        time.sleep(0.2)
        c.close()

    t = threading.Thread(target=garbage)
    t.start()
    with pytest.raises(BrokenLinkError, match="not a qlink ucx endpoint"):
        transports.connect(url, timeout_s=3)
    t.join()
    t0 = time.monotonic()
    with pytest.raises(QlinkTimeoutError):
        transports.connect(url, timeout_s=0.3)  # accepted by the kernel backlog, never answered
    assert time.monotonic() - t0 < 2
    srv.close()


@pytest.mark.timeout(30)
def test_listener_counts_a_garbage_client_and_keeps_serving():
    with transports.listen("ucx://127.0.0.1:0") as lis:
        host, port = lis.url[len("ucx://"):].rsplit(":", 1)
        junk = socket.create_connection((host, int(port)))
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(100))
        junk.close()
        a = transports.connect(lis.url, timeout_s=5)
        b = lis.accept(timeout_s=5)
        a.send(b"still serving")
        assert b.recv(timeout_s=5) == b"still serving"
        assert lis.rejected == 1
        a.close()
        b.close()
    with pytest.raises(ClosedError):
        lis.accept(timeout_s=0.1)


# ----- a killed peer -------------------------------------------------------------------------
_VICTIM = r"""
import sys, time, transports
ep = transports.connect(sys.argv[1], timeout_s=10, peer_error_handling=sys.argv[2] == "1")
ep.send(b"hello")
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer_error_handling", [False, True], ids=["socket-watch", "ucx-peer-mode"])
def test_sigkilled_peer_is_a_broken_link_within_a_second(peer_error_handling):
    lis = transports.listen("ucx://127.0.0.1:0", peer_error_handling=peer_error_handling)
    victim = _spawn(_VICTIM, lis.url, "1" if peer_error_handling else "0")
    try:
        ep = lis.accept(timeout_s=20)
        assert ep.recv(timeout_s=10) == b"hello"
        assert victim.stdout.readline().strip() == "ready"
        lanes = ep.statistics().extra["ucx_lanes"]  # UCX's peer error mode rules out shared memory here
        if peer_error_handling:
            assert lanes and all(lane.startswith("tcp/") for lane in lanes), lanes
        else:
            assert any(lane in ("sysv/memory", "posix/memory") for lane in lanes), lanes
        killed_at = []

        def kill():
            time.sleep(0.3)
            killed_at.append(time.monotonic())
            os.kill(victim.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill)
        killer.start()
        with pytest.raises(BrokenLinkError, match="peer"):
            ep.recv_into(bytearray(16), timeout_s=None)  # blocked, with no timeout, when the peer dies
        seen_after_s = time.monotonic() - killed_at[0]
        killer.join()
        assert seen_after_s < 1.0
        with pytest.raises(BrokenLinkError):
            ep.send(b"anyone?")
        if peer_error_handling:
            t_end = time.monotonic() + 1.0  # UCX itself noticed the failure and called our error callback
            while not ep.statistics().extra["ucx_error_reported"] and time.monotonic() < t_end:
                ep._worker.progress_once()
            assert ep.statistics().extra["ucx_error_reported"]
            assert ep.statistics().extra["peer_error_handling"] is True
        t0 = time.monotonic()
        ep.close()
        assert time.monotonic() - t0 < 2.0
    finally:
        victim.kill()
        _reap(victim)
        lis.close()


# ----- one worker, many connections, threads ----------------------------------------------------
@pytest.mark.timeout(30)
def test_connections_sharing_a_worker_never_see_each_others_messages():
    with transports.listen("ucx://127.0.0.1:0") as lis:
        clients = [transports.connect(lis.url, timeout_s=5) for _ in range(3)]
        servers = [lis.accept(timeout_s=5) for _ in range(3)]
        for round_ in range(20):  # interleaved, both directions
            for i, (c, s) in enumerate(zip(clients, servers)):
                c.send(f"c{i}-{round_}".encode())
                s.send(f"s{i}-{round_}".encode() * (1 + 3000 * (round_ % 2)))
        first = {}
        for i, s in enumerate(servers):  # each accepted endpoint gets exactly its own client's messages
            first[i] = [s.recv(timeout_s=5) for _ in range(20)]
        for i, c in enumerate(clients):
            got = [c.recv(timeout_s=5) for _ in range(20)]
            assert got == [f"s{i}-{r}".encode() * (1 + 3000 * (r % 2)) for r in range(20)]
        assert all(first[i] == [f"c{i}-{r}".encode() for r in range(20)] for i in range(3))
        for e in clients + servers:
            e.close()


@pytest.mark.timeout(30)
def test_a_sending_thread_and_a_receiving_thread_share_an_endpoint(ucx_pair):
    a, b = ucx_pair
    count = 2000
    got = []

    def echo():
        buf = np.empty(64, dtype=np.uint8)
        for _ in range(count):
            n = b.recv_into(buf, timeout_s=10)
            b.send(buf[:n], timeout_s=10)

    def receive():
        buf = bytearray(64)
        for _ in range(count):
            n = a.recv_into(buf, timeout_s=10)
            got.append(int.from_bytes(buf[:n], "little"))

    threads = [threading.Thread(target=echo), threading.Thread(target=receive)]
    for t in threads:
        t.start()
    for i in range(count):  # this thread only sends on ``a`` while another thread receives on it
        a.send(i.to_bytes(4, "little"), timeout_s=10)
    for t in threads:
        t.join(20)
    assert got == list(range(count))


# ----- across hosts, emulated with a network namespace ---------------------------------------------
_NS_SERVER = r"""
import sys, transports
lis = transports.listen(sys.argv[1])
print(lis.url, flush=True)
ep = lis.accept(timeout_s=20)
for _ in range(3):
    ep.send(ep.recv(timeout_s=20))
print("LANES", ",".join(ep.statistics().extra["ucx_lanes"]), flush=True)
ep.recv(timeout_s=20)
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.skipif(not (hasattr(os, "geteuid") and os.geteuid() == 0), reason="needs root to create a network namespace")
def test_across_network_namespaces_over_tcp():
    """A peer in its own network namespace behind a veth pair: a non-loopback address, UCX over TCP."""
    tag = f"qlu{os.getpid() % 100000}"
    net = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    ns_cmds = [
        ["ip", "netns", "add", tag],
        ["ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b"],
        ["ip", "link", "set", f"{tag}b", "netns", tag],
        ["ip", "addr", "add", f"{net}.1/24", "dev", f"{tag}a"],
        ["ip", "link", "set", f"{tag}a", "up"],
        ["ip", "netns", "exec", tag, "ip", "addr", "add", f"{net}.2/24", "dev", f"{tag}b"],
        ["ip", "netns", "exec", tag, "ip", "link", "set", f"{tag}b", "up"],
        ["ip", "netns", "exec", tag, "ip", "link", "set", "lo", "up"],
    ]
    server = None
    try:
        for cmd in ns_cmds:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot build the namespace ({' '.join(cmd)}: {r.stderr.strip()})")
        env = _env(UCX_TLS="tcp,self")  # one kernel: without this UCX would rightly pick shared memory
        server = subprocess.Popen(["ip", "netns", "exec", tag, sys.executable, "-c", _NS_SERVER,
                                   f"ucx://{net}.2:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env, cwd=ROOT)
        url = server.stdout.readline().strip()
        assert url.startswith(f"ucx://{net}.2:"), server.stderr.read()
        client = _spawn(
            "import sys, numpy as np, transports\n"
            "ep = transports.connect(sys.argv[1], timeout_s=10)\n"
            "for m in (b'hi', bytes(64), np.arange(3 << 20, dtype=np.uint8)):\n"
            "    ep.send(m); assert ep.recv(timeout_s=20) == bytes(memoryview(m).cast('B'))\n"
            "print('LANES', ','.join(ep.statistics().extra['ucx_lanes']), flush=True)\n"
            "ep.send(b'bye'); ep.close()\n",
            url, UCX_TLS="tcp,self")
        out, err = _reap(client)
        assert client.returncode == 0, err[-2000:]
        assert f"LANES tcp/{tag}a" in out
        s_out, s_err = _reap(server)
        assert f"LANES tcp/{tag}b" in s_out, s_err[-2000:]
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            _reap(server)
        subprocess.run(["ip", "netns", "del", tag], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{tag}a"], capture_output=True)


# ----- hot paths, close, buffering, put guards ------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("hot_path", ucx.HOT_PATHS)
def test_both_hot_paths_carry_messages_and_puts(hot_path):
    with transports.listen("ucx://127.0.0.1:0", hot_path=hot_path) as lis:
        a = transports.connect(lis.url, timeout_s=5, hot_path=hot_path)
        b = lis.accept(timeout_s=5)
        assert a.statistics().extra["hot_path"] == b.statistics().extra["hot_path"] == hot_path
        msgs = [b"", b"x" * 64, np.arange(70_000, dtype=np.uint32)]
        for m in msgs:
            a.send(m)
        assert b.recv_into(bytearray(10), timeout_s=5) == 0  # the empty message fits...
        with pytest.raises(transports.BufferTooSmallError) as too_small:
            b.recv_into(bytearray(10), timeout_s=5)  # ...this one does not, and stays queued
        assert too_small.value.needed_nbytes == 64
        assert b.recv(timeout_s=5) == b"x" * 64
        big = np.empty(70_000, dtype=np.uint32)
        assert b.recv_into(big, timeout_s=5) == big.nbytes and np.array_equal(big, msgs[2])
        target = np.zeros(1 << 16, dtype=np.uint8)
        desc = b.register(target).descriptor()
        a.put(b"\x05" * 100, desc, offset=1, notify_id=3, tag=b"small")
        a.put(np.full(30_000, 6, dtype=np.uint8), desc, offset=200, notify_id=4)
        notes = [b.wait_notification(timeout_s=5) for _ in range(2)]
        assert [(n.notify_id, n.tag) for n in notes] == [(3, b"small"), (4, b"")]
        assert target[1:101].min() == 5 and target[200:30_200].min() == 6 and target[0] == 0
        a.close()
        b.close()


# ----- close, buffering, put guards -------------------------------------------------------------
@pytest.mark.timeout(30)
def test_close_delivers_what_was_sent_even_a_staged_large_message(ucx_pair):
    a, b = ucx_pair
    big = np.arange(16 << 20, dtype=np.uint8)
    a.send(b"first")
    a.send(big)  # staged: the receiver has not asked for it yet
    a.close()
    assert b.recv(timeout_s=5) == b"first"
    buf = np.empty(16 << 20, dtype=np.uint8)
    assert b.recv_into(buf, timeout_s=10) == big.nbytes
    assert np.array_equal(buf, big)
    with pytest.raises(BrokenLinkError, match="closed the connection"):
        b.recv(timeout_s=1)
    with pytest.raises(ClosedError):
        a.send(b"after close")


@pytest.mark.timeout(30)
def test_a_receive_overlapping_this_sides_close_is_closed_even_if_the_peer_answered(ucx_pair):
    """The race behind a blocked receive: another thread closes this side while the receiver is
    inside a progress round, and the peer's answer (its CLOSE) lands in that same round. The
    receiver must report this side's close (ClosedError), not a broken link."""
    a, _ = ucx_pair
    real_poll, closer, rounds = a._poll, [], []

    def poll_during_close(want_msg):
        rounds.append(want_msg)
        if want_msg and len(rounds) == 2 and not closer:  # the blocked wait's first round
            closer.append(threading.Thread(target=a.close))
            closer[0].start()
            t_end = time.monotonic() + 5
            while not a._closed and time.monotonic() < t_end:
                time.sleep(0.001)
            a._peer_closed = True  # the peer's CLOSE, taken in this round
            return None
        return real_poll(want_msg)

    a._poll = poll_during_close
    with pytest.raises(ClosedError):
        a.recv_into(bytearray(16), timeout_s=5)
    closer[0].join(5)
    assert not closer[0].is_alive()


@pytest.mark.timeout(30)
def test_close_drains_what_the_peer_sent_to_this_connection(ucx_pair):
    a, b = ucx_pair
    for i in range(50):
        a.send(bytes([i]) * 100)
    a.send(np.ones(100_000, dtype=np.uint8))  # a rendezvous message too
    t_end = time.monotonic() + 5
    while time.monotonic() < t_end:  # let them arrive (the first is taken off UCX's queue and held)
        with b._rx_lock:
            if b._poll(True) is not None:
                break
    ops, conn = b._ops, b._rx_msg & 0xFFFFFF00000000
    b.close()  # never received: the shared worker must not keep them
    assert ops.probe(conn, 0xFFFFFF00000000) is None


@pytest.mark.timeout(30)
def test_send_buffer_bound_blocks_then_times_out_without_sending():
    with transports.listen("ucx://127.0.0.1:0") as lis:
        a = transports.connect(lis.url, timeout_s=5, send_buffer_nbytes=1 << 20)
        b = lis.accept(timeout_s=5)
        chunk = np.ones(600_000, dtype=np.uint8)  # above the eager size: stays in flight until received
        a.send_nowait(chunk)
        with pytest.raises(WouldBlock, match="send buffer is full"):
            a.send_nowait(chunk)
        with pytest.raises(QlinkTimeoutError):
            a.send(chunk, timeout_s=0.1)
        assert a.statistics().messages_sent == 1
        buf = np.empty(600_000, dtype=np.uint8)
        assert b.recv_into(buf, timeout_s=5) == 600_000
        a.send(b"next", timeout_s=5)
        assert b.recv(timeout_s=5) == b"next"  # the timed-out send left nothing behind
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_zero_copy_sends_with_a_receiving_thread():
    with transports.listen("ucx://127.0.0.1:0") as lis:
        a = transports.connect(lis.url, timeout_s=5, zero_copy_send_nbytes=1 << 16)
        b = lis.accept(timeout_s=5)
        msgs = [np.full(1 << 20, i, dtype=np.uint8) for i in range(4)]
        got = []

        def receive():
            buf = np.empty(1 << 20, dtype=np.uint8)
            for _ in msgs:
                b.recv_into(buf, timeout_s=10)
                got.append(int(buf[0]) if (buf == buf[0]).all() else -1)

        t = threading.Thread(target=receive)
        t.start()
        for m in msgs:
            a.send(m, timeout_s=10)
        t.join()
        assert got == [0, 1, 2, 3]
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_put_guards_foreign_descriptor_revoked_region_and_bounds(ucx_pair):
    a, b = ucx_pair
    target = np.zeros(64 << 10, dtype=np.uint8)
    region = b.register(target)
    desc = region.descriptor()
    foreign = RemoteRegion(region_id=desc.region_id, nbytes=desc.nbytes, key=b"elsewhere")
    with pytest.raises(RegistrationError, match="not issued by this endpoint's peer"):
        a.put(b"x", foreign)
    with pytest.raises(RegistrationError, match="outside region"):
        a.put(bytes(16), desc, offset=desc.nbytes - 8)
    a.put(np.full(40_000, 7, dtype=np.uint8), desc, offset=100, notify_id=1)  # header + bytes straight in
    note = b.wait_notification(timeout_s=5)
    assert (note.offset, note.nbytes, note.notify_id) == (100, 40_000, 1)
    assert target[100:40_100].min() == 7 and target[99] == 0 and target[40_100] == 0
    b.deregister(region)
    t_end = time.monotonic() + 2
    with pytest.raises(RegistrationError, match="deregistered"):
        while time.monotonic() < t_end:  # the revocation reaches the initiator with its next progress
            a.put(b"late", desc)
            b.poll_notification_nowait()
    with pytest.raises(WouldBlock):
        b.poll_notification_nowait()


_PUT_TARGET = r"""
import sys, numpy as np, transports
lis = transports.listen("ucx://127.0.0.1:0")
print(lis.url, flush=True)
ep = lis.accept(timeout_s=10)
target = np.zeros(1 << 20, dtype=np.uint8)
ep.send(ep.register(target).descriptor().to_bytes())
notes = [ep.wait_notification(timeout_s=10) for _ in range(2)]
ep.send(np.array([n.notify_id for n in notes] + [int(target[:16].sum()), int(target[4096:].sum())], dtype=np.int64))
ep.recv(timeout_s=10)
"""


@pytest.mark.timeout(60)
def test_put_between_two_processes():
    target = _spawn(_PUT_TARGET)
    try:
        url = target.stdout.readline().strip()
        ep = transports.connect(url, timeout_s=10)
        desc = ep.recv(timeout_s=10)
        ep.put(np.full(16, 2, dtype=np.uint8), desc, notify_id=11)  # inline
        ep.put(np.ones((1 << 20) - 4096, dtype=np.uint8), desc, offset=4096, notify_id=12)  # header + bytes
        result = np.frombuffer(ep.recv(timeout_s=10), dtype=np.int64)
        assert result.tolist() == [11, 12, 32, (1 << 20) - 4096]
        ep.send(b"done")
        ep.close()
    finally:
        out, err = _reap(target)
    assert target.returncode == 0, err[-2000:]
