"""The far ends of ``qlink bench gpu``, each run in a spawned process.

* :func:`bandwidth_target` registers one buffer (device memory on ``device="gpu"``,
  :func:`qlink.memory.alloc` host memory on ``"cpu"``), sends its descriptor and, on each
  ``CHK!`` request, takes the notifications announced and answers with the CRC-32 of the
  bytes that landed.
* :func:`qec_controller` plays the QPU controller: it receives the syndrome region's
  descriptor and the shots (as one message of ``num_shots x num_detectors`` bytes), puts
  each shot into the region, waits for its correction, and sends back the reaction times
  (``int64`` ns) and the corrections it got.

Everything between the two processes travels over the transport as bytes (``struct``,
raw arrays): nothing is pickled.
"""

from __future__ import annotations

import struct
import time
import zlib

import numpy as np

__all__ = ["array_module", "synchronize", "host_copy", "bandwidth_target", "qec_controller", "CHECK", "REPLY",
           "SHOTS"]

CHECK = struct.Struct("<4sQQ")  # b"CHK!", notifications to take, bytes to checksum
REPLY = struct.Struct("<QI")  # notifications taken, CRC-32
SHOTS = struct.Struct("<4sQQ")  # b"SHOT", num_shots, num_detectors (then the shots)
_CHECK_MAGIC, _SHOT_MAGIC = b"CHK!", b"SHOT"


def array_module(device: str):
    """``cupy`` for ``"gpu"``, ``numpy`` for ``"cpu"``."""
    if device == "gpu":
        from transports.cuda import require

        return require("qlink bench gpu")
    if device == "cpu":
        return np
    raise ValueError(f"device must be 'gpu' or 'cpu', got {device!r}")


def synchronize(xp) -> None:
    """Wait for the work queued on the current stream (nothing to wait for on NumPy)."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def host_copy(x) -> np.ndarray:
    """``x`` as a host array (a copy off the GPU, or ``x`` itself)."""
    return x if isinstance(x, np.ndarray) else x.get()


def _target_buffer(xp, nbytes: int):
    if xp is np:
        from qlink.memory import alloc

        return alloc(nbytes, dtype=np.uint8)
    return xp.zeros(nbytes, dtype=xp.uint8)


def bandwidth_target(url: str, max_nbytes: int, device: str) -> None:
    """Register ``max_nbytes`` and answer checksum requests until ``bye``."""
    import transports

    from qlink.procs import die_with_parent

    die_with_parent()
    xp = array_module(device)
    ep = transports.connect(url, timeout_s=60)
    try:
        buf = _target_buffer(xp, max_nbytes)
        ep.send(ep.register(buf).descriptor().to_bytes())
        while True:
            msg = ep.recv(timeout_s=600)  # put notifications are set aside meanwhile
            if msg == b"bye":
                return
            magic, count, nbytes = CHECK.unpack(msg)
            if magic != _CHECK_MAGIC or nbytes > max_nbytes:
                raise ValueError(f"bandwidth target got a malformed request {msg[:32]!r}")
            for _ in range(count):
                ep.wait_notification(timeout_s=60)
            ep.send(REPLY.pack(count, zlib.crc32(host_copy(buf[:nbytes]))))
    finally:
        ep.close()


def qec_controller(url: str) -> None:
    """Put each shot into the decoder's syndrome region, time it until its correction returns."""
    import transports

    from qlink.procs import die_with_parent

    die_with_parent()
    ep = transports.connect(url, timeout_s=60)
    try:
        desc = ep.recv(timeout_s=120)
        head = ep.recv(timeout_s=120)
        magic, num_shots, num_detectors = SHOTS.unpack_from(head, 0)
        if magic != _SHOT_MAGIC or len(head) != SHOTS.size + num_shots * num_detectors:
            raise ValueError("QEC controller got a malformed shots message")
        shots = np.frombuffer(head, dtype=np.uint8, offset=SHOTS.size).reshape(num_shots, num_detectors)
        times = np.zeros(num_shots, dtype=np.int64)
        answer = bytearray(4096)
        got = []
        for k in range(num_shots):
            t0 = time.perf_counter_ns()
            ep.put(shots[k], desc, notify_id=k)
            n = ep.recv_into(answer, timeout_s=60)
            times[k] = time.perf_counter_ns() - t0
            if n < 8 or struct.unpack_from("<Q", answer, 0)[0] != k:
                raise ValueError(f"correction for shot {k} came back malformed or out of order")
            got.append(bytes(answer[8:n]))
        ep.send(times.tobytes())
        ep.send(b"".join(got))
        ep.recv(timeout_s=60)  # bye
    finally:
        ep.close()
