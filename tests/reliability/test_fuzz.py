"""Hostile input: every parser of peer bytes, every service fed garbage, every config knob
given nonsense. Each must answer with a clear typed error (or a counted refusal), never
crash, never hang, never hand back a view past the end of its input.

Fuzzing: a seeded mutation fuzzer over every target (quick), coverage-guided atheris
(libFuzzer) when it is installed, and one hypothesis run of 10^5 examples (slow).
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transports
from qlink import wire
from qlink.reliability.fuzz import TARGETS, FuzzCrash, atheris_available, check, run_atheris, run_random, seeds_for
from qlink.errors import QlinkError, QlinkTimeoutError, RegistrationError, WireError
from qlink.wire import Fault, FrameError, Status

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------- fuzzing


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_mutation_fuzz_finds_no_crash(target):
    r = run_random(target, num_cases=4000, seed=7)
    assert r["crashes"] == 0, r["first_crash"]


def test_the_fuzz_harness_would_see_a_crash():
    TARGETS["_broken"] = lambda data: data[10]  # IndexError on short input: what a real bug looks like
    try:
        with pytest.raises(FuzzCrash, match="IndexError"):
            check("_broken", b"short")
        assert run_random("_broken", num_cases=50, seed=1)["crashes"] > 0
    finally:
        del TARGETS["_broken"]


@pytest.mark.skipif(not atheris_available(), reason="atheris is not installed (pip install 'qlink[test]')")
@pytest.mark.parametrize("target", ["wire_request", "kv_frames"])
def test_coverage_guided_fuzzing_quick(target):
    r = run_atheris(target, runs=20_000, seed=3, timeout_s=110)
    assert r["returncode"] == 0, r["output"]
    assert r["cases"] == 20_000 and r["coverage"] > 20


# The slow runs' time limits guard against a hang, not a slow host: with two CPU hogs beside
# them on two cores they take about three times as long as on a quiet host.
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not atheris_available(), reason="atheris is not installed (pip install 'qlink[test]')")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_coverage_guided_fuzzing(target):
    r = run_atheris(target, runs=200_000, seed=11, timeout_s=1700)
    assert r["returncode"] == 0, r["output"]
    assert r["cases"] == 200_000


def _flip_cut_append(t: tuple) -> bytes:
    """A seed frame with one bit flipped, cut short, and some bytes appended (positions drawn
    large and taken modulo the seed's length: no strategy built per example, which made
    generation most of this test's time)."""
    seed, bit, cut, tail = t
    b = bytearray(seed)
    bit %= len(b) * 8
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b[:cut % (len(b) + 1)]) + tail


_frame_bytes = st.one_of(
    st.binary(max_size=200),
    st.tuples(st.sampled_from(seeds_for("wire_request")), st.integers(0, 1 << 16), st.integers(0, 1 << 16),
              st.binary(max_size=16)).map(_flip_cut_append),
)


@pytest.mark.slow
@pytest.mark.timeout(2400)
@settings(max_examples=100_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=_frame_bytes)
def test_hypothesis_hundred_thousand_frames(data):
    for target in ("wire_request", "wire_response", "wire_frame_nbytes", "kv_frames", "remote_region", "kv_spec"):
        check(target, data)


# ----------------------------------------------------------------------- services fed garbage


def _mutants(n: int, seed: int) -> list[bytes]:
    import random

    from qlink.reliability.fuzz import _mutate

    rng = random.Random(seed)
    seeds = seeds_for("wire_request")
    return [_mutate(rng, rng.choice(seeds)) for _ in range(n)]


def test_the_decoder_service_survives_garbage_counts_it_and_still_decodes():
    from qlink.qec.decoders import compile_decoder
    from qlink.qec.service import DecoderConfig, DecoderService
    from qlink.qec.sources import StimSource

    src = StimSource.surface_code(distance=3, rounds=3, p=0.01)
    dem = src.detector_error_model(decompose_errors=True)
    svc = DecoderService({0: DecoderConfig(decoder="pymatching", dem=dem, frames_per_shot=1)})
    garbage = _mutants(2000, seed=5) + [b"", b"\x00" * 23, bytes(range(256)) * 600]  # empty, short, oversized
    with transports.listen("inproc://qlrel-fuzz-svc") as lis:
        client = transports.connect("inproc://qlrel-fuzz-svc")
        server = lis.accept(timeout_s=2)
        for g in garbage:
            client.send(g)
        svc.serve(server, max_requests=len(garbage), timeout_s=60)
        rep = svc.report()
        assert rep["counts"]["requests"] == len(garbage)  # every frame counted, none lost silently
        assert sum(rep["faults"].values()) > 0 and "error" not in rep
        # answers are well-formed frames
        answers = 0
        while True:
            try:
                wire.decode_response(client.recv(timeout_s=0.05))
                answers += 1
            except QlinkTimeoutError:
                break
        assert answers > 0
        # and a clean controller that follows is served correctly (after resetting what garbage left)
        buf = bytearray(256)
        n = wire.encode_reset_decoder_into(buf, request_id=1, decoder_id=0)
        client.send(buf[:n])
        dets = src.sample(1, seed=2).detection_events.astype(np.uint8)
        n = wire.encode_enqueue_syndromes_into(buf, request_id=2, decoder_id=0, counter=0, syndrome_mapping_id=0,
                                               syndromes=dets[0])
        client.send(buf[:n])
        n = wire.encode_get_corrections_into(buf, request_id=3, decoder_id=0, return_size=1, reset=True)
        client.send(buf[:n])
        svc.serve(server, max_requests=3, timeout_s=10)
        got = [wire.decode_response(client.recv(timeout_s=2)) for _ in range(3)]
        expect = int(compile_decoder("pymatching", dem).decode_batch(dets)[0][0])
        assert got[-1].status == Status.OK and got[-1].request_id == 3
        assert got[-1].result[0] & 1 == expect
        client.close(), server.close()


def test_the_kv_receiver_counts_garbage_frames_and_still_receives():
    from qlink.ai import KVCache, KVReceiver, KVSender, preset

    spec = preset("tiny", num_blocks=8)
    with transports.listen("inproc://qlrel-fuzz-kv") as lis:
        a = transports.connect("inproc://qlrel-fuzz-kv")
        b = lis.accept(timeout_s=2)
        rx = KVReceiver(b, KVCache.allocate(spec))
        tx_cache = KVCache.allocate(spec)
        tx_cache.fill_random(seed=1)
        tx = KVSender(a, tx_cache)
        tx.handshake(timeout_s=2)
        import random

        from qlink.reliability.fuzz import _mutate

        rng = random.Random(3)
        hello = wire.fnv1a_32("kv_hello")
        seeds = [s for s in seeds_for("kv_frames") if struct.unpack_from("<I", s, 4)[0] != hello]
        for _ in range(500):
            g = _mutate(rng, rng.choice(seeds))
            if wire.fnv1a_32("kv_data") == (struct.unpack_from("<I", g, 4)[0] if len(g) >= 8 else 0):
                continue  # a kv_data frame takes the next message as its payload: keep the stream in step
            a.send(g)
        rx.progress()
        assert rx.statistics().bad_frames > 0
        tx.send_request(99, [1, 2], [3, 4], timeout_s=5)
        rec = rx.wait_request(99, timeout_s=5)
        assert rec.num_layers == spec.num_layers
        assert (rx.cache.block_checksums([3, 4]) == tx_cache.block_checksums([1, 2])).all()
        rx.close(), a.close(), b.close()


def test_a_malformed_hello_after_the_handshake_is_counted_not_fatal():
    from qlink.ai import KVCache, KVReceiver, KVSender, preset
    from qlink.ai import frames as fr

    spec = preset("tiny", num_blocks=8)
    with transports.listen("inproc://qlrel-fuzz-hello") as lis:
        a = transports.connect("inproc://qlrel-fuzz-hello")
        b = lis.accept(timeout_s=2)
        rx = KVReceiver(b, KVCache.allocate(spec))
        tx = KVSender(a, KVCache.allocate(spec))
        tx.handshake(timeout_s=2)
        a.send(fr.pack_hello(role=1, mode=0, spec=spec.to_bytes(), regions=[b"ab"]))  # garbage descriptor
        rx.progress()
        tx.send_request(5, [1], [2], timeout_s=5)
        assert rx.wait_request(5, timeout_s=5).num_layers == spec.num_layers
        assert rx.statistics().bad_frames >= 1
        rx.close(), a.close(), b.close()


# ----------------------------------------------------------------------- oversize, negative, too many bits


def _req(fn: int, payload: bytes, *, arg_len: int | None = None, rid: int = 9) -> bytes:
    return struct.pack("<IIIIQ", wire.REQUEST_MAGIC, fn, len(payload) if arg_len is None else arg_len, rid, 0) + payload


@pytest.mark.parametrize("frame, fault", [
    (_req(wire.ENQUEUE_SYNDROMES, struct.pack("<qqqq", 0, 0, 0, 8) + b"\x01", arg_len=0xFFFF_FFFF), Fault.LENGTH_PAST_END),
    (_req(wire.ENQUEUE_SYNDROMES, struct.pack("<qqqq", 0, 0, 0, (1 << 20) + 1) + bytes((1 << 17) + 1)),
     Fault.PAYLOAD_SIZE),
    (_req(wire.ENQUEUE_SYNDROMES, struct.pack("<qqqq", 0, 0, 0, 1 << 40) + b"\x01"), Fault.NUM_SYNDROMES),
    (_req(wire.ENQUEUE_SYNDROMES, struct.pack("<qqqq", 0, 0, 0, -8) + b"\x01"), Fault.NUM_SYNDROMES),
    (_req(wire.ENQUEUE_SYNDROMES, struct.pack("<qqqq", -1, 0, 0, 8) + b"\x01"), Fault.DECODER_ID),
    (_req(wire.ENQUEUE_SYNDROMES, struct.pack("<qqqq", 0, -1, 0, 8) + b"\x01"), Fault.COUNTER),
    (_req(wire.ENQUEUE_SYNDROMES, struct.pack("<qqqq", 1 << 62, 0, 0, 8) + b"\x01"), Fault.DECODER_ID),
    (_req(wire.GET_CORRECTIONS, struct.pack("<qqB", 0, (1 << 20) + 1, 1)), Fault.RETURN_SIZE),
    (_req(wire.GET_CORRECTIONS, struct.pack("<qqB", 0, -1, 1)), Fault.RETURN_SIZE),
    (_req(wire.GET_CORRECTIONS, struct.pack("<qqB", -5, 1, 1)), Fault.DECODER_ID),
    (_req(wire.RESET_DECODER, struct.pack("<q", -(1 << 63))), Fault.DECODER_ID),
])
def test_oversize_lengths_too_many_bits_and_negative_ids_are_named_faults(frame, fault):
    with pytest.raises(FrameError) as e:
        wire.decode_request(frame)
    assert e.value.fault is fault and e.value.request_id == 9
    assert str(e.value)  # says what was wrong


def test_encoders_refuse_out_of_range_values_before_writing():
    buf = bytearray(1 << 18)
    with pytest.raises(ValueError, match="num_syndromes"):
        wire.encode_enqueue_syndromes_into(buf, request_id=1, decoder_id=0, counter=0, syndrome_mapping_id=0,
                                           syndromes=np.zeros((1 << 20) + 1, np.uint8))
    for kw, name in ((dict(request_id=-1), "request_id"), (dict(decoder_id=-1), "decoder_id"),
                     (dict(decoder_id=32), "decoder_id"), (dict(counter=-1), "counter")):
        args = dict(request_id=1, decoder_id=0, counter=0, syndrome_mapping_id=0, syndromes=[1]) | kw
        with pytest.raises(ValueError, match=name):
            wire.encode_enqueue_syndromes_into(buf, **args)
    with pytest.raises(ValueError, match="return_size"):
        wire.encode_get_corrections_into(buf, request_id=1, decoder_id=0, return_size=(1 << 20) + 1)


def test_oversize_descriptors_and_specs_are_typed_errors():
    from qlink.ai import KVCacheSpec, LayoutMismatchError
    from qlink.ai import frames as fr
    from qlink.memory import RemoteRegion

    good = RemoteRegion(region_id=1, nbytes=64, key=b"k").to_bytes()
    huge_key = good[:20] + struct.pack("<I", 0xFFFF_FFFF) + good[24:]
    with pytest.raises(RegistrationError, match="key length"):
        RemoteRegion.from_bytes(huge_key)
    with pytest.raises(LayoutMismatchError):
        KVCacheSpec.from_bytes(b"QLKV" + b"\xff" * 28)
    hello = bytearray(fr.pack_hello(role=1, mode=0, spec=b"s" * 8, regions=[b"r"]))
    struct.pack_into("<I", hello, 32, 0xFFFF_FFF0)  # the spec item claims 4 GiB
    with pytest.raises(WireError, match="runs past the end"):
        fr.unpack_hello(hello)


def test_kv_request_ids_and_block_ids_out_of_range_are_refused():
    from qlink.ai import BlockIdError, KVCache, KVReceiver, KVSender, preset

    spec = preset("tiny", num_blocks=8)
    with transports.listen("inproc://qlrel-kv-ids") as lis:
        a = transports.connect("inproc://qlrel-kv-ids")
        b = lis.accept(timeout_s=2)
        rx, tx = KVReceiver(b, KVCache.allocate(spec)), KVSender(a, KVCache.allocate(spec))
        for rid in (-1, 1 << 32, 1.5, "7"):
            with pytest.raises(ValueError, match="request_id"):
                tx.send_request(rid, [0], [0], timeout_s=2)
        for src, dst in (([-1], [0]), ([0], [8]), ([0, 1], [0]), ([], []), ([0, 1], [2, 2])):
            with pytest.raises(BlockIdError):
                tx.send_request(1, src, dst, timeout_s=2)
        with pytest.raises(ValueError, match="request_id"):
            rx.wait_request(-3, timeout_s=0)
        rx.close(), a.close(), b.close()


# ----------------------------------------------------------------------- configs: NaN, inf, nonsense

NONFINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("v", NONFINITE)
def test_link_models_refuse_non_finite_numbers(v):
    from qlink.links import LinkModel

    for field in ("latency_ns", "bandwidth_Bps", "overhead_ns", "jitter_ns", "loss"):
        kw = dict(latency_ns=1.0, bandwidth_Bps=1e9) | {field: v}
        with pytest.raises(ValueError, match=field):
            LinkModel("x", **kw)


@pytest.mark.parametrize("v", NONFINITE)
def test_budgets_and_figures_refuse_non_finite_numbers(v):
    from qlink.budget import Budget

    with pytest.raises(ValueError, match="limit_ns"):
        Budget(key="k", name="n", domain="qec", limit_ns=v, citation="c")


@pytest.mark.parametrize("v", [math.nan, -1.0])
def test_timeouts_refuse_nan_and_negative(v):
    with transports.listen("inproc://qlrel-timeout") as lis:
        a = transports.connect("inproc://qlrel-timeout")
        b = lis.accept(timeout_s=1)
        with pytest.raises(ValueError, match="timeout_s"):
            b.recv(timeout_s=v)
        with pytest.raises(ValueError, match="timeout_s"):
            lis.accept(timeout_s=v)
        a.close(), b.close()


def test_an_infinite_timeout_waits_without_limit_instead_of_overflowing():
    with transports.listen("tcp://127.0.0.1:0") as lis:
        a = transports.connect(lis.url, timeout_s=math.inf)
        b = lis.accept(timeout_s=5)
        a.close(), b.close()
    with transports.listen("inproc://qlrel-inf") as lis:
        a = transports.connect("inproc://qlrel-inf")
        b = lis.accept(timeout_s=5)
        a.send(b"x")
        assert b.recv(timeout_s=math.inf) == b"x"
        a.close(), b.close()


def test_source_specs_refuse_nonsense_with_the_reason():
    from qlink.qec.loop import build_source, source_spec

    with pytest.raises(ValueError, match="p must"):
        source_spec(distance=3, p=math.nan)
    with pytest.raises(ValueError, match="distance"):
        source_spec(distance=1)
    with pytest.raises(TypeError, match="str/int/float"):
        build_source({"distance": True, "p": 0.001})
    with pytest.raises(TypeError, match="str/int/float"):
        build_source({"distance": 3, "p": [0.1]})
    with pytest.raises(ValueError, match="unknown source spec keys"):
        build_source({"distance": 3, "p": 0.001, "shell": "rm -rf /"})
    with pytest.raises(ValueError, match="kind"):
        build_source({"kind": "pickle", "distance": 3, "p": 0.001})


def test_decoder_configs_refuse_nonsense_with_the_reason():
    from qlink.qec.service import DecoderConfig, DecoderService

    for v in (math.nan, math.inf, "many", 0, -3):
        with pytest.raises((TypeError, ValueError), match="capacity_shots"):
            DecoderConfig(num_detectors=6, num_observables=1, decoder="pymatching", capacity_shots=v)
    with pytest.raises(ValueError, match="unknown decoder spec keys"):
        DecoderConfig.from_spec({"source": {"distance": 3, "p": 0.001}, "exec": "x"})
    with pytest.raises(ValueError, match="source"):
        DecoderConfig.from_spec({"decoder": "pymatching"})
    with pytest.raises(ValueError, match="unknown decoder"):
        DecoderService({0: DecoderConfig.from_spec({"source": {"distance": 3, "p": 0.001}, "decoder": "oracle"})})
    with pytest.raises(ValueError, match="decoder ids"):
        DecoderService({32: DecoderConfig(num_detectors=6, num_observables=1, decoder="pymatching")})


@pytest.mark.parametrize("knob", ["cycle_ns", "poll_interval_ns", "feed_forward_deadline_ns", "run_timeout_s"])
def test_loop_parameters_refuse_nan_and_inf_by_name(knob):
    from qlink.qec.controller import Controller, SyndromeStream

    s = SyndromeStream(detectors=np.zeros((2, 6), np.uint8), observables=np.zeros((2, 1), np.uint8),
                       round_of_detector=np.array([0, 0, 1, 1, 2, 2]))
    with transports.listen("inproc://qlrel-ctl") as lis:
        a = transports.connect("inproc://qlrel-ctl")
        b = lis.accept(timeout_s=1)
        name = "timeout_s" if knob == "run_timeout_s" else knob
        for v in (math.nan, math.inf):
            with pytest.raises(ValueError, match=name):
                if knob == "run_timeout_s":
                    Controller(a, s).run(timeout_s=v)
                else:
                    Controller(a, s, **{knob: v})
        a.close(), b.close()


@pytest.mark.parametrize("knob, minimum", [("get_timeout_ns", 1), ("gap_cycles", 0), ("start_delay_ns", 0),
                                            ("reveal_gap_after_ns", 0), ("max_in_flight_shots", 1),
                                            ("max_gets_in_flight", 1), ("get_window_shots", 1)])
def test_other_controller_numbers_refuse_nan_inf_and_too_small_by_name(knob, minimum):
    from qlink.qec.controller import Controller, SyndromeStream

    s = SyndromeStream(detectors=np.zeros((2, 6), np.uint8), observables=np.zeros((2, 1), np.uint8),
                       round_of_detector=np.array([0, 0, 1, 1, 2, 2]))
    with transports.listen("inproc://qlrel-ctl2") as lis:
        a = transports.connect("inproc://qlrel-ctl2")
        b = lis.accept(timeout_s=1)
        for v in (math.nan, math.inf, -math.inf, minimum - 1):
            with pytest.raises(ValueError, match=f"{knob} must be a finite number >= {minimum}"):
                Controller(a, s, **{knob: v})
        with pytest.raises(TypeError, match=knob):
            Controller(a, s, **{knob: "10"})
        a.close(), b.close()


@pytest.mark.parametrize("v", NONFINITE)
def test_source_specs_refuse_nan_and_inf_distance_and_rounds_by_name(v):
    from qlink.qec.loop import build_source, source_spec

    with pytest.raises(ValueError, match="distance must be a finite number >= 2"):
        source_spec(distance=v)
    with pytest.raises(ValueError, match="rounds must be a finite number >= 1"):
        source_spec(distance=3, rounds=v)
    with pytest.raises(ValueError, match="p must"):
        source_spec(distance=3, p=v)
    with pytest.raises(ValueError, match="finite numbers, got distance="):
        build_source({"distance": v, "p": 0.001})


def test_fault_and_link_urls_refuse_nonsense():
    for url in ("emulated+tcp://127.0.0.1:0", "emulated+tcp://127.0.0.1:0?link=warp",
                "emulated+tcp://127.0.0.1:0?link=ib-ndr&seed=abc", "emulated+tcp://127.0.0.1:0?link=ib-ndr&drop=nan",
                "emulated+://x?link=ib-ndr", "tcp://127.0.0.1:99999", "nope://x", "udp://127.0.0.1:0"):
        with pytest.raises((ValueError, QlinkError)):
            transports.connect(url, timeout_s=1)


# ----------------------------------------------------------------------- malformed .stim files


@pytest.mark.parametrize("text, what", [
    ("H 0\nCNOT banana\n", "not a valid stim circuit"),
    ("H 0\nM 0\nDETECTOR rec[-1]\n", "non-deterministic"),
    ("M 0\nDETECTOR rec[-5]\n", "before the beginning of time"),
    ("X_ERROR(1.5) 0\nM 0\nDETECTOR rec[-1]\n", "stim"),
    ("REPEAT -3 {\nM 0\n}\n", "stim"),
])
def test_malformed_stim_files_are_circuit_errors_naming_the_file(tmp_path, text, what):
    from qlink.qec.sources import CircuitError, StimSource

    p = tmp_path / "bad.stim"
    p.write_text(text)
    with pytest.raises(CircuitError, match=what) as e:
        StimSource.from_file(p)
    assert str(p) in str(e.value)


def test_a_binary_stim_file_is_a_circuit_error(tmp_path):
    from qlink.qec.sources import CircuitError, StimSource

    p = tmp_path / "binary.stim"
    p.write_bytes(b"\xff\xfe\x00\x81 not text")
    with pytest.raises(CircuitError):
        StimSource.from_file(p)


_HUGE_REPEAT = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    from qlink.qec.sources import CircuitError, StimSource
    try:
        StimSource.from_file(sys.argv[1])
    except CircuitError as e:
        print("refused:", str(e)[:200])
        sys.exit(0)
    sys.exit(1)
""")


def test_a_stim_file_with_a_huge_repeat_is_refused_not_a_hang(tmp_path):
    p = tmp_path / "huge.stim"
    p.write_text("REPEAT 1000000000000 {\n    M 0\n    DETECTOR rec[-1]\n}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        proc = subprocess.run([sys.executable, "-c", _HUGE_REPEAT, str(p)], capture_output=True, text=True,
                              timeout=20, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("loading the file did not finish within 20 s")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_toml_run_configs_are_fuzzed_in_their_own_file():
    """The one TOML reader (qlink.config) has its hostile-input tests in tests/test_config.py."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    readers = sorted(str(p.relative_to(root)) for d in ("qlink", "transports", "scenarios") for p in (root / d).rglob("*.py")
                     if "tomllib" in p.read_text(encoding="utf-8") or "import toml" in p.read_text(encoding="utf-8"))
    assert readers == ["qlink/config.py"], f"TOML readers to add hostile-input tests for: {readers}"
    assert "nan" in (root / "tests" / "test_config.py").read_text(encoding="utf-8")
