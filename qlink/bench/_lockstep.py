"""A well-behaved controller in lock step with a decoder service: one shot's syndrome
frame and its ``get_corrections`` out, its answer back, then the next shot.

It measures the reaction (last syndrome frame handed to the transport → correction
received) of every shot into a preallocated array and keeps the corrections, so a
caller can hold them bit for bit against a direct PyMatching call. Over ``udp://`` it
speaks from a plain socket (signing each datagram when given a token, each with a new
sequence number of its own, see :mod:`qlink.access`) and, as a UDP
controller must, sends a shot's two frames again when no answer came within
``retry_s`` (the same counter, request ids and ``ptp_timestamp``: the service answers
a repeated get_corrections from what it kept, so nothing is decoded twice). A get answered
``NOT_READY`` means its shot's syndromes were lost: both frames go again at once, the get as a
new request (a new ``ptp_timestamp``), since a service keeps a consuming get's NOT_READY for its
very same request. Over other URLs it speaks through a qlink endpoint. Close frames from the
service are counted, never taken for answers.

>>> import numpy as np
>>> _pack(np.array([1, 0, 1, 1], np.uint8)).tobytes()
b'\\r'
"""

from __future__ import annotations

import socket
import time

import numpy as np

from qlink import wire
from qlink.clock import ptp_now_ns
from qlink.access import DatagramSigner, token_bytes
from qlink.errors import QlinkTimeoutError

__all__ = ["LockstepController"]

_CLOSE_RID = 0xFFFFFFFF
_NOT_READY = int(wire.Status.NOT_READY)


def _pack(bits: np.ndarray) -> np.ndarray:
    return np.packbits(bits, bitorder="little")


class LockstepController:
    """One controller (see the module docstring); ``run(dets)`` decodes each row of ``dets``."""

    def __init__(self, url: str, *, num_observables: int, decoder_id: int = 0, token=None,
                 timeout_s: float = 10.0, retry_s: float = 0.02) -> None:
        self.url = url
        self.decoder_id = decoder_id
        self.num_obs = num_observables
        self.timeout_s = timeout_s
        key = token_bytes(token)
        self._signer = None if key is None else DatagramSigner(key)
        self._buf = bytearray(1 << 16)
        self._rbuf = bytearray(1 << 16)
        self.close_frames = 0
        self.retries = 0
        self.retry_s = retry_s
        self.counter = 0
        self._rid = 1
        if url.startswith("udp://"):
            host, _, port = url[len("udp://"):].rpartition(":")
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sock.connect((host.strip("[]"), int(port)))
            self._sock.settimeout(retry_s)
            self._ep = None
        else:
            import transports

            opts = {"token": token} if token is not None and url.startswith(("tcp://", "ucx://")) else {}
            self._ep = transports.connect(url, timeout_s=timeout_s, **opts)
            self._sock = None

    def _send(self, mv) -> None:
        if self._sock is not None:
            self._sock.send(mv if self._signer is None else self._signer.sign(mv))
        else:
            self._ep.send(mv)

    def _recv(self, give_up: float) -> memoryview | None:
        """The next answer; None when a datagram answer is overdue (send again)."""
        if self._sock is not None:
            try:
                n = self._sock.recv_into(self._rbuf)
            except (socket.timeout, ConnectionRefusedError):
                if time.monotonic() > give_up:
                    raise QlinkTimeoutError(f"no answer from {self.url} within {self.timeout_s} s") from None
                return None
        else:
            n = self._ep.recv_into(self._rbuf, timeout_s=self.timeout_s)
        return memoryview(self._rbuf)[:n]

    def run(self, dets: np.ndarray, *, pause_s: float = 0.0,
            time_limit_s: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decode every shot of ``dets`` (rows of detection events); returns ``(flips, statuses,
        reaction_ns)``, one row/entry per shot. ``pause_s`` between shots (0: back to back);
        ``time_limit_s``: stop after the shot that passes it (the arrays then hold only the
        shots done)."""
        n_shots = len(dets)
        stop_at = None if time_limit_s is None else time.monotonic() + time_limit_s
        flips = np.zeros((n_shots, self.num_obs), np.uint8)
        statuses = np.zeros(n_shots, np.int32)
        reaction = np.zeros(n_shots, np.int64)
        buf = self._buf
        mv = memoryview(buf)
        did = self.decoder_id
        for i in range(n_shots):
            rid = self._rid
            self._rid = (rid + 2) & 0x7FFFFFFF or 1
            n = wire.encode_enqueue_syndromes_into(buf, request_id=rid, decoder_id=did, counter=self.counter,
                                                   syndrome_mapping_id=0, syndromes=dets[i])
            self.counter += 1
            t0 = time.perf_counter_ns()
            k = wire.encode_get_corrections_into(mv[n:], request_id=rid + 1, decoder_id=did,
                                                 return_size=self.num_obs, reset=True, ptp_timestamp=ptp_now_ns())
            self._send(mv[:n])
            self._send(mv[n:n + k])
            give_up = time.monotonic() + self.timeout_s
            while True:
                r = self._recv(give_up)
                if r is not None:
                    magic, status, rlen, got_rid, _ptp = wire.RESPONSE_HEADER.unpack_from(r)
                    if got_rid == _CLOSE_RID:
                        self.close_frames += 1
                        continue
                    if got_rid != rid + 1:
                        continue
                    if status != _NOT_READY or self._sock is None:
                        break
                    # NOT_READY over udp: its syndromes were lost on the way. The get goes again as a new
                    # request (a new ptp_timestamp): the native service keeps a consuming get's NOT_READY,
                    # so the very same get sent again is answered NOT_READY again, even once its shot has
                    # come; only a new one consumes it
                    if time.monotonic() > give_up:
                        raise QlinkTimeoutError(f"{self.url} answered NOT_READY for {self.timeout_s} s")
                    k = wire.encode_get_corrections_into(mv[n:], request_id=rid + 1, decoder_id=did,
                                                         return_size=self.num_obs, reset=True,
                                                         ptp_timestamp=ptp_now_ns())
                # (datagrams) no answer, or NOT_READY: both frames again (the get as it was after a silence)
                self.retries += 1
                self._send(mv[:n])
                self._send(mv[n:n + k])
            reaction[i] = time.perf_counter_ns() - t0
            statuses[i] = status
            if status == 0 and got_rid == rid + 1:
                flips[i] = np.unpackbits(np.frombuffer(r[24:24 + rlen], np.uint8), count=self.num_obs,
                                         bitorder="little")
            if pause_s:
                time.sleep(pause_s)
            if stop_at is not None and time.monotonic() > stop_at:
                return flips[:i + 1], statuses[:i + 1], reaction[:i + 1]
        return flips, statuses, reaction

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._ep is not None:
            self._ep.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
