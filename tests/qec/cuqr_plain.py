"""A CUDA-Q realtime decoder RPC peer written from the published wire layout alone.

Nothing here imports qlink or its transports: ``socket``, ``struct``, ``numpy`` (and, for
the server, ``stim`` and ``pymatching``). It stands for what a controller, an FPGA or
another decoder server built for CUDA-Q realtime's host-side UDP wire would send: one
request frame (24-byte ``CUQR`` header + payload) per datagram, one ``CUQS`` response per
datagram, all little-endian.

Run as a script (``python -I cuqr_plain.py client|server``, so that neither the working
directory nor ``PYTHONPATH`` is on ``sys.path``) it refuses any import of ``qlink`` or
``transports`` and says at the end that neither was loaded:

* ``client``: reads a job (JSON) on stdin -- the service's address and, per decoder,
  shots as hex-packed detection events cut into frames -- sends every shot, asks for its
  corrections, and prints what came back (JSON) on stdout.
* ``server``: reads ``{decoder_id: DEM text}`` (JSON) on stdin's first line, binds
  ``udp://127.0.0.1:0``, prints ``{"port": ...}``, answers requests decoding with
  PyMatching until stdin closes, then prints its counts.

The tests import this module for its constants and :class:`RawController` (it is plain
Python; importing it loads nothing of qlink either).
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
from collections import deque

import numpy as np

# ----- the published wire layout (little-endian), written out by hand --------------------------
REQ_HEADER = struct.Struct("<IIIIQ")  # magic, function_id, arg_len, request_id, ptp_timestamp
RESP_HEADER = struct.Struct("<IiIIQ")  # magic, status, result_len, request_id, ptp_timestamp
REQ_MAGIC, RESP_MAGIC = 0x43555152, 0x43555153
ENQUEUE_SYNDROMES, GET_CORRECTIONS, RESET_DECODER = 0x7ED8BE82, 0x882D5BA1, 0x977A59CF
ENQUEUE_FIXED = struct.Struct("<qqqq")  # decoder_id, counter, syndrome_mapping_id, num_syndromes
GET_PAYLOAD = struct.Struct("<qqB")  # decoder_id, return_size, reset
RESET_PAYLOAD = struct.Struct("<q")  # decoder_id
OK, INVALID_DECODER, BAD_REQUEST, INTERNAL_ERROR, NOT_READY, BUSY, SYNDROMES_DROPPED = range(7)
MAX_SYNDROME_BITS = 1 << 20
MAX_DECODERS = 32


def frame(function_id, payload, *, request_id, ptp_timestamp=0, magic=REQ_MAGIC, arg_len=None):
    """One request datagram: header + payload (``arg_len``/``magic`` overridable to build bad frames)."""
    n = len(payload) if arg_len is None else arg_len
    return REQ_HEADER.pack(magic, function_id, n, request_id, ptp_timestamp) + payload


def enqueue_payload(decoder_id, counter, bits, *, num_syndromes=None):
    bits = np.asarray(bits, dtype=np.uint8)
    n = len(bits) if num_syndromes is None else num_syndromes
    return ENQUEUE_FIXED.pack(decoder_id, counter, 0, n) + np.packbits(bits, bitorder="little").tobytes()


def parse_response(datagram):
    magic, status, result_len, request_id, ptp = RESP_HEADER.unpack_from(datagram)
    assert magic == RESP_MAGIC, f"response magic 0x{magic:08X}"
    assert len(datagram) == RESP_HEADER.size + result_len, "one response per datagram, nothing around it"
    return status, request_id, ptp, datagram[RESP_HEADER.size:]


def ptp_stamp(request_id):
    """A distinct, non-zero send stamp per request (what a controller's PTP clock would give)."""
    return (0x5150_0000_0000_0000 | (request_id * 0x9E37_79B9)) & 0xFFFF_FFFF_FFFF_FFFF


class RawController:
    """A controller's decoder client: one UDP socket, frames built with struct, lockstep requests.

    Every request it numbers carries its own ``ptp_timestamp``; every answer to one of them is
    checked to echo that request's ``request_id`` and ``ptp_timestamp`` (``echoes_checked``
    counts them by status)."""

    def __init__(self, address, *, timeout_s=5.0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.connect(tuple(address))
        self.sock.settimeout(timeout_s)
        self.next_request_id = 1
        self.counters = {}
        self.sent_ptp = {}  # request_id -> the ptp_timestamp it was sent with
        self.echoes_checked = {}  # status -> answers whose echo was checked

    def close(self):
        self.sock.close()

    def send(self, datagram):
        self.sock.send(datagram)

    def call(self, function_id, payload, *, ptp_timestamp=None):
        rid = self.next_request_id
        self.next_request_id += 1
        ptp = ptp_stamp(rid) if ptp_timestamp is None else ptp_timestamp
        self.sent_ptp[rid] = ptp
        self.send(frame(function_id, payload, request_id=rid, ptp_timestamp=ptp))
        return rid

    def response(self):
        status, rid, ptp, result = parse_response(self.sock.recv(65536))
        if rid in self.sent_ptp:
            assert ptp == self.sent_ptp[rid], f"request {rid}: ptp_timestamp {ptp:#x} echoed, sent {self.sent_ptp[rid]:#x}"
            self.echoes_checked[status] = self.echoes_checked.get(status, 0) + 1
        return status, rid, ptp, result

    def answer_to(self, rid):
        """Responses are matched by request_id; anything else arriving first is returned too."""
        others = []
        while True:
            status, got, ptp, result = self.response()
            if got == rid:
                return (status, ptp, result), others
            others.append((status, got))

    def enqueue(self, decoder_id, bits, *, counter=None):
        if counter is None:
            counter = self.counters.get(decoder_id, 0)
            self.counters[decoder_id] = counter + 1
        return self.call(ENQUEUE_SYNDROMES, enqueue_payload(decoder_id, counter, bits))

    def send_shot(self, decoder_id, chunks, *, skip_frame=None, swap_frames=None):
        """Send a shot as several enqueue frames. ``skip_frame`` is "lost" (its counter value is
        never sent); ``swap_frames=(i, j)`` sends frame j before frame i (each keeps its counter)."""
        first = self.counters.get(decoder_id, 0)
        self.counters[decoder_id] = first + len(chunks)
        order = list(range(len(chunks)))
        if swap_frames is not None:
            i, j = swap_frames
            order[i], order[j] = order[j], order[i]
        return [self.enqueue(decoder_id, chunks[i], counter=first + i) for i in order if i != skip_frame]

    def get_corrections(self, decoder_id, num_observables, *, pending=()):
        """Ask for the oldest shot's corrections; returns (status, flips or None, statuses of ``pending`` acks)."""
        get = self.call(GET_CORRECTIONS, GET_PAYLOAD.pack(decoder_id, num_observables, 1))
        (status, _, result), acks = self.answer_to(get)
        assert [rid for _, rid in acks] == list(pending), "every enqueue is acknowledged, in the order sent"
        flips = None
        if status == OK:
            assert len(result) == (num_observables + 7) // 8
            flips = np.unpackbits(np.frombuffer(result, np.uint8), bitorder="little")[:num_observables]
        by_rid = {rid: s for s, rid in acks}
        return status, flips, [by_rid[rid] for rid in pending]

    def decode_shot(self, decoder_id, chunks, num_observables):
        """Send a whole shot, then get its corrections."""
        rids = self.send_shot(decoder_id, chunks)
        return self.get_corrections(decoder_id, num_observables, pending=rids)


# ----- the client job (subprocess) ------------------------------------------------------------------
def run_client_job(job):
    """Every shot of every decoder in ``job``: reset, enqueue its frames, get its corrections.

    ``job``: ``{"address": [host, port], "decoders": [{"decoder_id", "num_observables",
    "frame_bits": [bits per frame...], "shots": [hex of the packed detection events...]}]}``.
    Returns ``{"decoders": [{"decoder_id", "statuses", "ack_statuses", "flips": [[0/1...]]}],
    "echoes_checked": {status: count}}``."""
    client = RawController(job["address"])
    out = []
    try:
        for d in job["decoders"]:
            did, nobs, cuts = d["decoder_id"], d["num_observables"], d["frame_bits"]
            rid = client.call(RESET_DECODER, RESET_PAYLOAD.pack(did))
            (status, _, _), _ = client.answer_to(rid)
            assert status == OK, f"reset_decoder({did}) answered {status}"
            client.counters[did] = 0
            total = sum(cuts)
            statuses, acks, flips = [], [], []
            for hexbits in d["shots"]:
                bits = np.unpackbits(np.frombuffer(bytes.fromhex(hexbits), np.uint8), count=total, bitorder="little")
                edges = np.cumsum([0] + cuts)
                chunks = [bits[a:b] for a, b in zip(edges[:-1], edges[1:])]
                status, f, ack = client.decode_shot(did, chunks, nobs)
                statuses.append(status)
                acks.append(ack)
                flips.append(None if f is None else f.tolist())
            out.append({"decoder_id": did, "statuses": statuses, "ack_statuses": acks, "flips": flips})
    finally:
        client.close()
    return {"decoders": out, "echoes_checked": {str(k): v for k, v in client.echoes_checked.items()}}


# ----- a decoder server of its own (subprocess) -----------------------------------------------------
class MatchingServer:
    """A decoder server that is not qlink's: PyMatching on each complete shot, answers by the wire.

    Per decoder: frames append their bits to the current shot (``counter`` must follow on,
    else the frame is refused ``BAD_REQUEST`` and counted); a complete shot is decoded at
    once and its flips queued; ``get_corrections`` answers the ``return_size / observables``
    oldest shots (``NOT_READY`` while fewer are queued), ``reset=1`` consumes them."""

    def __init__(self, dems, *, host="127.0.0.1"):
        import pymatching
        import stim

        self.decoders = {}
        for did, text in dems.items():
            dem = stim.DetectorErrorModel(text)
            self.decoders[int(did)] = {
                "matching": pymatching.Matching.from_detector_error_model(dem),
                "num_det": dem.num_detectors, "num_obs": dem.num_observables,
                "bits": [], "counter": 0, "ready": deque(),
            }
        self.counts = {"requests": 0, "enqueue": 0, "get_corrections": 0, "shots_decoded": 0, "refused": 0,
                       "counter_mismatch": 0, "unanswerable": 0}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.bind((host, 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]

    def _answer(self, status, rid, ptp, result=b""):
        if status != OK:
            self.counts["refused"] += 1
        return RESP_HEADER.pack(RESP_MAGIC, status, len(result), rid, ptp) + result

    def handle(self, datagram):
        """The answer to one request datagram (None when not even its request_id can be read)."""
        self.counts["requests"] += 1
        if len(datagram) < REQ_HEADER.size:
            self.counts["unanswerable"] += 1
            return None
        magic, fid, arg_len, rid, ptp = REQ_HEADER.unpack_from(datagram)
        if magic != REQ_MAGIC:
            self.counts["unanswerable"] += 1
            return None
        payload = datagram[REQ_HEADER.size:]
        if arg_len != len(payload):
            return self._answer(BAD_REQUEST, rid, ptp)
        if fid == ENQUEUE_SYNDROMES and arg_len >= ENQUEUE_FIXED.size:
            self.counts["enqueue"] += 1
            did, counter, mapping, n = ENQUEUE_FIXED.unpack_from(payload)
            d = self.decoders.get(did)
            if d is None:
                return self._answer(INVALID_DECODER, rid, ptp)
            if mapping != 0 or not 1 <= n <= MAX_SYNDROME_BITS or arg_len != ENQUEUE_FIXED.size + (n + 7) // 8:
                return self._answer(BAD_REQUEST, rid, ptp)
            if counter != d["counter"]:
                self.counts["counter_mismatch"] += 1
                return self._answer(BAD_REQUEST, rid, ptp)
            d["counter"] = counter + 1
            bits = np.unpackbits(np.frombuffer(payload, np.uint8, offset=ENQUEUE_FIXED.size), count=n,
                                 bitorder="little")
            d["bits"].append(bits)
            have = sum(len(b) for b in d["bits"])
            nd = d["num_det"]
            if have >= nd:
                if have % nd:
                    d["bits"].clear()
                    return self._answer(BAD_REQUEST, rid, ptp)
                shots = np.concatenate(d["bits"]).reshape(-1, nd)
                d["bits"].clear()
                for flips in d["matching"].decode_batch(shots):
                    d["ready"].append(np.asarray(flips, np.uint8))
                self.counts["shots_decoded"] += len(shots)
            return self._answer(OK, rid, ptp)
        if fid == GET_CORRECTIONS and arg_len == GET_PAYLOAD.size:
            self.counts["get_corrections"] += 1
            did, return_size, reset = GET_PAYLOAD.unpack(payload)
            d = self.decoders.get(did)
            if d is None:
                return self._answer(INVALID_DECODER, rid, ptp)
            no = d["num_obs"]
            if return_size < 1 or return_size % no or reset > 1:
                return self._answer(BAD_REQUEST, rid, ptp)
            m = return_size // no
            if len(d["ready"]) < m:
                return self._answer(NOT_READY, rid, ptp)
            flips = np.concatenate([d["ready"][i] for i in range(m)])
            if reset:
                for _ in range(m):
                    d["ready"].popleft()
            return self._answer(OK, rid, ptp, np.packbits(flips, bitorder="little").tobytes())
        if fid == RESET_DECODER and arg_len == RESET_PAYLOAD.size:
            (did,) = RESET_PAYLOAD.unpack(payload)
            d = self.decoders.get(did)
            if d is None:
                return self._answer(INVALID_DECODER, rid, ptp)
            d["bits"].clear()
            d["ready"].clear()
            d["counter"] = 0
            return self._answer(OK, rid, ptp)
        return self._answer(BAD_REQUEST, rid, ptp)

    def serve(self, stop):
        buf = bytearray(65536)
        while not stop.is_set():
            try:
                n, addr = self.sock.recvfrom_into(buf)
            except socket.timeout:
                continue
            answer = self.handle(bytes(buf[:n]))
            if answer is not None:
                self.sock.sendto(answer, addr)
        self.sock.close()


# ----- script entry -------------------------------------------------------------------------------
class _RefuseQlink:
    """A meta-path finder that makes any import of qlink or its transports fail loudly."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in ("qlink", "transports"):
            raise ImportError(f"the plain CUDA-Q peer must not import {name!r}")
        return None


def _modules_report():
    return {"qlink_loaded": "qlink" in sys.modules, "transports_loaded": "transports" in sys.modules}


def main(argv):
    sys.meta_path.insert(0, _RefuseQlink())
    mode = argv[1] if len(argv) > 1 else ""
    if mode == "client":
        result = run_client_job(json.load(sys.stdin))
        result.update(_modules_report())
        assert "qlink" not in sys.modules and "transports" not in sys.modules
        print(json.dumps(result), flush=True)
        return 0
    if mode == "server":
        server = MatchingServer(json.loads(sys.stdin.readline()))
        print(json.dumps({"port": server.port}), flush=True)
        stop = threading.Event()
        thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
        thread.start()
        sys.stdin.read()  # until the parent closes stdin
        stop.set()
        thread.join(5)
        assert "qlink" not in sys.modules and "transports" not in sys.modules
        print(json.dumps({"counts": server.counts, **_modules_report()}), flush=True)
        return 0
    print(f"usage: python -I {argv[0]} client|server", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
