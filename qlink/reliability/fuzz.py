"""Fuzz targets for every parser of peer bytes, and two drivers.

Each target takes arbitrary bytes and either parses them or raises the parser's own typed
error; anything else (IndexError, struct.error, a bare ValueError, a result that points
past the input) is a crash, raised as :class:`FuzzCrash` with the input attached.

* :func:`run_random` -- a seeded mutation fuzzer with no dependency: it mutates valid
  frames (bit flips, truncation, extension, boundary values written into each field,
  spliced random bytes) and runs them through a target.
* coverage-guided: ``python -m qlink.reliability.fuzz <target> -runs=N`` runs a target under
  atheris (libFuzzer) when it is installed (``pip install atheris``; Linux x86-64 wheels).

>>> sorted(TARGETS)[:3]
['fault_query', 'kv_frames', 'kv_spec']
>>> run_random("wire_request", num_cases=200, seed=1)["crashes"]
0
"""

from __future__ import annotations

import random
import struct
import sys
from typing import Callable

__all__ = ["TARGETS", "FuzzCrash", "run_random", "run_atheris", "atheris_available", "seeds_for", "main"]


class FuzzCrash(AssertionError):
    """A parser misbehaved on ``data`` (raised something other than its typed error, or
    returned a view past the end of its input)."""

    def __init__(self, message: str, *, target: str, data: bytes):
        super().__init__(f"{target}: {message} (input {data[:64].hex()}{'...' if len(data) > 64 else ''}, "
                         f"{len(data)} bytes)")
        self.target = target
        self.data = data


# ----------------------------------------------------------------------------- targets


def _wire_request(data: bytes) -> None:
    from qlink import wire

    try:
        req = wire.decode_request(data)
    except wire.FrameError:
        return
    if req.nbytes > len(data):
        raise AssertionError(f"a request of {req.nbytes} bytes decoded from {len(data)}")
    p = req.payload
    if isinstance(p, wire.EnqueueSyndromes):
        if len(p.syndromes_bits_packed) != (p.num_syndromes + 7) // 8 or not 1 <= p.num_syndromes <= wire.MAX_SYNDROME_BITS:
            raise AssertionError("enqueue_syndromes payload inconsistent with num_syndromes")
        if not 0 <= p.decoder_id < wire.MAX_DECODERS or p.counter < 0:
            raise AssertionError("enqueue_syndromes field out of range accepted")
        p.syndromes()
    elif isinstance(p, wire.GetCorrections):
        if not 0 <= p.return_size <= wire.MAX_CORRECTION_BITS or not 0 <= p.decoder_id < wire.MAX_DECODERS:
            raise AssertionError("get_corrections field out of range accepted")


def _wire_response(data: bytes) -> None:
    from qlink import wire

    try:
        resp = wire.decode_response(data)
    except wire.FrameError:
        return
    if resp.nbytes > len(data) or len(resp.result) != resp.result_len:
        raise AssertionError("response result runs past the buffer")


def _wire_frame_nbytes(data: bytes) -> None:
    from qlink import wire

    try:
        n = wire.frame_nbytes(data)
    except wire.FrameError:
        return
    if n < wire.HEADER_NBYTES:
        raise AssertionError(f"frame_nbytes {n} below the header size")


def _kv_frames(data: bytes) -> None:
    from qlink.ai import frames as fr
    from qlink.errors import WireError

    for fn in (fr.function_of, fr.unpack_write, fr.unpack_data, fr.unpack_abort, fr.unpack_hello):
        try:
            out = fn(data)
        except WireError:
            continue
        if fn is fr.unpack_hello:
            _, _, spec, regions = out
            if len(spec) + sum(len(r) for r in regions) > len(data):
                raise AssertionError("kv_hello items longer than the frame")


def _kv_spec(data: bytes) -> None:
    from qlink.ai import KVCacheSpec, LayoutMismatchError

    try:
        spec = KVCacheSpec.from_bytes(data)
    except LayoutMismatchError:
        return
    if KVCacheSpec.from_bytes(spec.to_bytes()) != spec:  # (pad bytes are ignored, so compare specs)
        raise AssertionError("KVCacheSpec does not round-trip")


def _remote_region(data: bytes) -> None:
    from qlink.errors import RegistrationError
    from qlink.memory import RemoteRegion

    try:
        r = RemoteRegion.from_bytes(data)
    except RegistrationError:
        return
    if RemoteRegion.from_bytes(r.to_bytes()) != r or r.nbytes < 0:  # (pad bytes are ignored)
        raise AssertionError("RemoteRegion does not round-trip")


def _tcp_framing(data: bytes) -> None:
    from qlink.errors import WireError
    from transports import framing as fr

    # the transport reads exactly a header / hello / reply before parsing it: fuzz that many bytes
    for fn, size in ((fr.parse_header, fr.HEADER.size), (fr.check_hello, fr.HELLO.size),
                     (fr.parse_reply, fr.REPLY.size)):
        try:
            fn(bytes(data[:size]).ljust(size, b"\0"))
        except WireError:
            pass


def _fault_query(data: bytes) -> None:
    from transports.emulated import FaultSpec

    try:
        FaultSpec.from_query(data.decode("latin-1"))
    except ValueError:
        pass


TARGETS: dict[str, Callable[[bytes], None]] = {
    "wire_request": _wire_request,
    "wire_response": _wire_response,
    "wire_frame_nbytes": _wire_frame_nbytes,
    "kv_frames": _kv_frames,
    "kv_spec": _kv_spec,
    "remote_region": _remote_region,
    "tcp_framing": _tcp_framing,
    "fault_query": _fault_query,
}


def check(target: str, data: bytes) -> None:
    """Run ``target`` on ``data``; raise :class:`FuzzCrash` on anything but its typed error."""
    fn = TARGETS[target]
    try:
        fn(data)
    except AssertionError as e:
        raise FuzzCrash(str(e), target=target, data=bytes(data)) from e
    except Exception as e:  # noqa: BLE001 - any other exception is exactly what fuzzing looks for
        raise FuzzCrash(f"{type(e).__name__}: {e}", target=target, data=bytes(data)) from e


# ----------------------------------------------------------------------------- seeds


def seeds_for(target: str) -> list[bytes]:
    """Valid inputs of ``target`` to mutate from."""
    from qlink import wire

    out: list[bytes] = []
    buf = bytearray(256)
    if target.startswith("wire"):
        for nbits in (1, 8, 9, 24, 100):
            n = wire.encode_enqueue_syndromes_into(buf, request_id=7, decoder_id=3, counter=5,
                                                   syndrome_mapping_id=0, syndromes=[1, 0] * (nbits // 2) + [1] * (nbits % 2))
            out.append(bytes(buf[:n]))
        n = wire.encode_get_corrections_into(buf, request_id=1, decoder_id=0, return_size=9, reset=True)
        out.append(bytes(buf[:n]))
        n = wire.encode_reset_decoder_into(buf, request_id=2, decoder_id=31)
        out.append(bytes(buf[:n]))
        n = wire.encode_corrections_response_into(buf, request_id=3, corrections=[1, 0, 1])
        out.append(bytes(buf[:n]))
        n = wire.encode_response_into(buf, status=wire.Status.NOT_READY, request_id=4)
        out.append(bytes(buf[:n]))
    elif target == "kv_frames":
        from qlink.ai import frames as fr
        from qlink.ai import preset

        out.append(fr.pack_write(fr.FN_WRITE, 7, 123, layer=2, layer_lo=0, layer_hi=4, num_parts=3, num_descs=3,
                                 layer_nbytes=4096, part_nbytes=1024))
        out.append(fr.pack_data(7, 123, layer=1, layer_lo=0, layer_hi=4, num_parts=1, num_descs=1, layer_nbytes=64,
                                part_nbytes=64, dst_offset=0))
        out.append(fr.pack_abort(7, status=3, layer=1, reason="gone"))
        out.append(fr.pack_hello(role=1, mode=0, spec=preset("tiny", num_blocks=4).to_bytes(), regions=[b"ab", b""]))
    elif target == "kv_spec":
        from qlink.ai import preset

        out += [preset(n, num_blocks=8).to_bytes() for n in ("tiny", "llama-3-8b")]
    elif target == "remote_region":
        from qlink.memory import RemoteRegion

        out += [RemoteRegion(region_id=1, nbytes=64, key=b"k" * 10).to_bytes(),
                RemoteRegion(region_id=2, nbytes=0, kind="device").to_bytes()]
    elif target == "tcp_framing":
        from transports import framing as fr

        hdr = bytearray(fr.HEADER.size)
        fr.pack_header(hdr, fr.KIND_PUT, nbytes=5, region_id=3, offset=8, notify_id=1, tag_nbytes=2)
        out += [bytes(hdr), fr.pack_hello(1234), fr.pack_reply(0, 99, "ok")]
    elif target == "fault_query":
        out += [b"drop=0.1&dup=0.01&seed=3", b"delay_ns=1000&fault_start=5&fault_stop=9&fault_puts=0"]
    return out


_BOUNDARY = (0, 1, 0x7F, 0x80, 0xFF, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF, 1 << 20, (1 << 20) + 1, 1 << 31,
             (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


def _mutate(rng: random.Random, seed: bytes) -> bytes:
    b = bytearray(seed)
    for _ in range(rng.choice((1, 1, 2, 3, 8))):
        op = rng.randrange(7)
        if op == 0 and b:  # flip a bit
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # truncate
            del b[rng.randrange(len(b) + 1):]
        elif op == 2:  # extend
            b += bytes(rng.randrange(256) for _ in range(rng.choice((1, 7, 64))))
        elif op == 3 and len(b) >= 4:  # a boundary u32 somewhere
            i = rng.randrange(len(b) - 3)
            struct.pack_into("<I", b, i, rng.choice(_BOUNDARY) & 0xFFFF_FFFF)
        elif op == 4 and len(b) >= 8:  # a boundary u64 / i64 somewhere (8-aligned fields)
            i = rng.randrange((len(b) - 8) // 8 + 1) * 8
            struct.pack_into("<Q", b, i, rng.choice(_BOUNDARY))
        elif op == 5 and b:  # a random byte
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 6:  # splice random bytes in
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
    return bytes(b)


def run_random(target: str, *, num_cases: int = 10_000, seed: int = 0) -> dict:
    """Mutation-fuzz ``target`` for ``num_cases`` inputs; ``{"cases", "crashes", "first_crash"}``."""
    if target not in TARGETS:
        raise ValueError(f"unknown fuzz target {target!r}; known: {', '.join(sorted(TARGETS))}")
    rng = random.Random(seed)
    seeds = seeds_for(target) or [b""]
    crashes = 0
    first = None
    for i in range(num_cases):
        data = _mutate(rng, rng.choice(seeds)) if i % 16 else bytes(rng.randrange(256)
                                                                     for _ in range(rng.randrange(96)))
        try:
            check(target, data)
        except FuzzCrash as e:
            crashes += 1
            first = first or str(e)
    return {"target": target, "cases": num_cases, "crashes": crashes, "first_crash": first}


# ----------------------------------------------------------------------------- atheris


def atheris_available() -> bool:
    """Whether atheris (coverage-guided fuzzing) is installed here."""
    import importlib.util

    return importlib.util.find_spec("atheris") is not None


# Instrument qlink and transports only (not NumPy...): import them inside instrument_imports.
_LAUNCHER = (
    "import sys, atheris\n"
    "with atheris.instrument_imports(include=['qlink', 'transports']):\n"
    "    import qlink.ai.frames, qlink.ai.kv, qlink.memory, qlink.wire, transports._faults, transports.framing\n"
    "    from qlink.reliability import fuzz as _fuzz\n"
    "sys.exit(_fuzz.main(sys.argv, instrumented=True))\n"
)


def run_atheris(target: str, *, runs: int = 20_000, seed: int = 1, timeout_s: float = 600.0) -> dict:
    """Coverage-guided fuzzing of ``target`` under atheris in a child interpreter:
    ``{"cases", "crashes", "coverage", "output"}`` (a crash makes libFuzzer exit non-zero)."""
    import re
    import subprocess

    if target not in TARGETS:
        raise ValueError(f"unknown fuzz target {target!r}; known: {', '.join(sorted(TARGETS))}")
    if not atheris_available():
        from qlink.errors import missing

        raise missing("atheris", extra="test", feature="coverage-guided fuzzing")
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER, target, f"-runs={runs}", f"-seed={seed}",
                           "-max_len=4096"], capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout + proc.stderr
    done = re.search(r"Done (\d+) runs", out)
    cov = re.findall(r"cov: (\d+)", out)
    return {"target": target, "cases": int(done.group(1)) if done else 0, "crashes": 0 if proc.returncode == 0 else 1,
            "coverage": int(cov[-1]) if cov else 0, "returncode": proc.returncode,
            "output": "" if proc.returncode == 0 else out[-4000:]}


def main(argv: list[str] | None = None, *, instrumented: bool = False) -> int:
    """``python -m qlink.reliability.fuzz TARGET [libFuzzer options]``: coverage-guided under atheris."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in TARGETS:
        print(f"usage: python -m qlink.reliability.fuzz TARGET [-runs=N ...]; targets: {', '.join(sorted(TARGETS))}")
        return 2
    target = argv.pop(1)
    try:
        import atheris
    except ImportError:
        print("atheris is not installed (pip install atheris); use run_random() instead", file=sys.stderr)
        return 3
    if not instrumented:  # run as a module: qlink was imported before anything could be instrumented
        atheris.instrument_all()
    import os
    import tempfile

    corpus = tempfile.mkdtemp(prefix="qlink-fuzz-")
    for i, s in enumerate(seeds_for(target)):
        with open(os.path.join(corpus, f"seed{i}"), "wb") as f:
            f.write(s)

    def one(data: bytes) -> None:
        check(target, data)

    atheris.Setup(argv + [corpus], one)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
