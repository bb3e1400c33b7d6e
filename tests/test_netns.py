"""Two hosts for real: network namespaces joined by a veth pair, the QEC loop across them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qlink.netns import NetnsError, check_subnet, netns_unavailable, two_hosts

REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")


def _listed() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_subnet_must_be_private_with_room_for_two():
    assert check_subnet("10.233.5.0/30") == ("10.233.5.1", "10.233.5.2", 30)
    for bad in ("8.8.8.0/30", "127.0.0.0/30", "10.233.0.0/31", "fd00::/64", "10.233.0.1/30", "nonsense"):
        with pytest.raises(ValueError):
            check_subnet(bad)


@pytest.mark.timeout(120)
def test_pair_is_isolated_reachable_and_torn_down():
    with two_hosts(subnet="10.233.9.0/30") as hosts:
        names = hosts.names
        assert all(n in _listed() for n in names)
        addr_a = hosts.a.run(["ip", "-4", "-o", "addr", "show", "dev", hosts.a.ifname]).stdout
        assert "10.233.9.1/30" in addr_a
        # no route but the pair's /30: nothing outside it can be reached from inside
        routes = [r for r in hosts.b.run(["ip", "-4", "route"]).stdout.splitlines() if r.strip()]
        assert routes and all(r.startswith("10.233.9.0/30 ") for r in routes)
        links = hosts.a.run(["ip", "-o", "link"]).stdout
        assert "lo:" in links and hosts.a.ifname in links and "eth0" not in links
        # a real round trip across the veth: A listens on its address, B connects
        echo = hosts.a.start("qlink.bench.crosshost:clock_echo", {"url": f"tcp://{hosts.a.address}:0"})
        url = echo.receive(timeout_s=60)["ready"]
        assert url.startswith("tcp://10.233.9.1:")
        clock = hosts.b.call("qlink.bench.crosshost:clock_probe", {"url": url, "num_samples": 20}, timeout_s=60)
        assert echo.result(timeout_s=30) == 40  # 20 warm-up pings + 20 samples
        assert clock["transport"] == "tcp"
        # from A's own namespace, B's address answers and the outside world is unreachable
        unreachable = hosts.a.run([sys.executable, "-c", "import socket; s = socket.socket(); s.settimeout(2); "
                                                    "print(s.connect_ex(('10.233.10.1', 9)))"], check=False)
        assert unreachable.stdout.strip() not in ("0", "")
    assert not any(n in _listed() for n in names)


@pytest.mark.timeout(60)
def test_teardown_after_failure_leaves_nothing():
    with pytest.raises(RuntimeError, match="boom"):
        with two_hosts() as hosts:
            names = hosts.names
            sleeper = hosts.a.popen(["sleep", "600"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None  # the process inside was killed
    assert not any(n in _listed() for n in names)


@pytest.mark.timeout(60)
def test_function_errors_come_back_with_their_reason():
    with two_hosts() as hosts:
        with pytest.raises(NetnsError, match="ValueError: num_samples"):
            hosts.b.call("qlink.clock:estimate_offset", {"ping_fn": None, "num_samples": 0}, timeout_s=30)
        with pytest.raises(NetnsError, match="ModuleNotFoundError"):
            hosts.b.call("qlink.no_such_module:f", timeout_s=30)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_qec_loop_across_namespaces(transport):
    if transport == "ucx":
        pytest.importorskip("ucxx", reason="ucx transport needs ucxx-cu12")
    from qlink.bench.crosshost import run_crosshost_loop
    from qlink.qec.loop import source_spec

    with two_hosts() as hosts:
        r = run_crosshost_loop(hosts, transport=transport, source=source_spec(distance=3, rounds=3, p=0.01),
                               num_shots=300, warmup_shots=50, clock_samples=100)
    assert r["transport"] == transport and r["url"].startswith(f"{transport}://10.233.0.1:")
    assert r["answered_shots"] == 300 and r["shots_dropped"] == 0
    assert r["bit_identical"], "corrections across the namespaces differ from direct decoding"
    assert r["logical_errors"] > 0  # p=0.01 at d=3: some shots do fail, and are counted
    assert r["service"]["counts"]["shots_decoded"] == 350 and not r["service"]["faults"]
    # the namespaces share one monotonic clock: the true offset is 0
    clock = r["clock"]
    assert clock["transport"] == transport and clock["error_bound_ns"] > 0
    assert abs(clock["offset_ns"]) <= clock["error_bound_ns"]
