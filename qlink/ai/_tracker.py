"""Receiver-side accounting of KV requests: which layers of which request have landed.

A layer of a request is complete when all its parts (merged descriptors, a gathered
``put_many`` of a whole layer, or one NIXL transfer) have been notified and their byte
counts add up to the layer's size; each layer declares its own number of parts (its first
part sets it), so a sender may gather some layers and not others; a layer is
*ready* when it and every layer of the request below it are complete, so layer ``k`` is
always reported before ``k + 1``. A request with an inconsistent, duplicated or aborted
part fails as a whole and none of its incomplete layers is ever reported.

>>> t = RequestTracker(num_layers=2, transport="inproc", mode="put")
>>> for layer in (1, 0):   # parts may arrive out of layer order
...     ok = t.on_part(5, 100, layer, 0, 2, 1, 1, 4096, 4096, now_ns=200 + layer)
>>> t.ready_ns(5, 0), t.ready_ns(5, 1)
(200, 200)
>>> t.record(5).nbytes
8192
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qlink.errors import QlinkError

__all__ = ["TransferAbortedError", "TransferRecord", "SubmitRecord", "KVStatistics", "RequestTracker"]


class TransferAbortedError(QlinkError):
    """A request failed: the sender aborted it, or its parts were inconsistent. Layers not
    reported ready before the failure never will be; ``status`` is the sender's code."""

    def __init__(self, message: str, *, request_id: int, status: int = 0):
        super().__init__(message)
        self.request_id = request_id
        self.status = status


@dataclass(frozen=True)
class _Request:
    """What both sides' records say of a request (``num_descs``: descriptors after merging,
    over all layers)."""

    request_id: int
    nbytes: int
    num_descs: int
    num_layers: int
    transport: str
    mode: str


@dataclass(frozen=True)
class TransferRecord(_Request):
    """One request as the receiver saw it land.

    ``submit_to_last_us``: from the sender's submit (its clock, same host) to the
    notification that made the last layer ready. ``layer_ready_us``: per layer, from
    submit to ready.
    """

    submit_to_last_us: float
    layer_ready_us: tuple
    submit_ns: int = 0  # the sender's submit time (time.monotonic_ns, one host's clock)

    @property
    def bandwidth_GBps(self) -> float:
        return self.nbytes / (self.submit_to_last_us * 1e3) if self.submit_to_last_us > 0 else float("nan")


@dataclass(frozen=True)
class SubmitRecord(_Request):
    """One request (or the layers sent so far) as the sender submitted it.

    ``plan_us``: block ids -> merged descriptors; ``submit_us``: issuing the puts/sends;
    ``us_per_block``: both together per (layer, plane, block) moved.
    """

    plan_us: float
    submit_us: float
    us_per_block: float


@dataclass(frozen=True)
class KVStatistics:
    """Counters of a KV engine endpoint (``receiver.statistics()``)."""

    transport: str
    mode: str
    requests_completed: int = 0
    requests_failed: int = 0
    parts: int = 0
    nbytes: int = 0
    bad_frames: int = 0


class _State:
    __slots__ = ("lo", "hi", "num_descs", "layer_nbytes", "need", "parts", "got", "ready", "next_layer",
                 "submit_ns", "error", "done")

    def __init__(self, num_layers: int, lo: int, hi: int, num_descs: int, layer_nbytes: int, submit_ns: int):
        self.lo, self.hi, self.num_descs, self.layer_nbytes = lo, hi, num_descs, layer_nbytes
        # Python lists: scalar updates on the per-notification path are cheaper than on NumPy arrays
        self.need = [0] * num_layers  # parts that complete each layer (0: none seen yet)
        self.parts = [0] * num_layers
        self.got = [0] * num_layers
        self.ready = [0] * num_layers
        self.next_layer = lo
        self.submit_ns = submit_ns
        self.error: BaseException | None = None
        self.done = False


class RequestTracker:
    """Per-request layer accounting shared by the transport and NIXL receivers."""

    def __init__(self, *, num_layers: int, transport: str, mode: str, max_requests: int = 65536):
        self.num_layers = num_layers
        self.transport = transport
        self.mode = mode
        self.max_requests = max_requests
        self._states: dict[int, _State] = {}
        self.completed = 0
        self.failed = 0
        self.parts = 0
        self.nbytes = 0
        self.bad_frames = 0
        self.broken: BaseException | None = None

    def _fail(self, st: _State, exc: BaseException) -> None:
        if st.error is None and not st.done:
            st.error = exc
            self.failed += 1

    def on_part(self, rid: int, submit_ns: int, layer: int, lo: int, hi: int, num_parts: int, num_descs: int,
                layer_nbytes: int, part_nbytes: int, *, now_ns: int) -> bool:
        """Account one landed part; False (and counted) when the part is malformed."""
        if not (0 <= lo <= layer < hi <= self.num_layers) or num_parts < 1 or part_nbytes < 1 or layer_nbytes < 1:
            self.bad_frames += 1
            return False
        st = self._states.get(rid)
        if st is None:
            if len(self._states) >= self.max_requests:
                self.bad_frames += 1
                return False
            st = self._states[rid] = _State(self.num_layers, lo, hi, num_descs, layer_nbytes, submit_ns)
        elif ((st.lo, st.hi, st.layer_nbytes) != (lo, hi, layer_nbytes) or st.done
              or st.need[layer] not in (0, num_parts)):
            self.bad_frames += 1
            self._fail(st, TransferAbortedError(
                f"request {rid}: a part disagrees with earlier parts (layers [{lo}, {hi}), {num_parts} parts for "
                f"layer {layer}, {layer_nbytes} B/layer vs [{st.lo}, {st.hi}), {st.need[layer] or 'any'}, "
                f"{st.layer_nbytes}); was the request id reused before release()?", request_id=rid))
            return False
        if st.error is not None:
            return True
        self.parts += 1
        self.nbytes += part_nbytes
        st.submit_ns = min(st.submit_ns, submit_ns)
        st.need[layer] = num_parts
        p = st.parts[layer] = st.parts[layer] + 1
        g = st.got[layer] = st.got[layer] + part_nbytes
        if p > num_parts or g > layer_nbytes:
            self._fail(st, TransferAbortedError(f"request {rid}: layer {layer} received more parts or bytes than "
                                                f"declared ({p}/{num_parts} parts, {g}/{layer_nbytes} B)",
                                                request_id=rid))
            return True
        if p == num_parts and g == layer_nbytes:
            n = st.next_layer
            need, parts, got = st.need, st.parts, st.got
            while n < st.hi and need[n] and parts[n] == need[n] and got[n] == layer_nbytes:
                st.ready[n] = now_ns
                n += 1
            st.next_layer = n
            if n == st.hi:
                st.done = True
                self.completed += 1
        elif p == num_parts:
            self._fail(st, TransferAbortedError(f"request {rid}: layer {layer} parts sum to {g} B, expected "
                                                f"{layer_nbytes} B", request_id=rid))
        return True

    def on_abort(self, rid: int, status: int, layer: int, reason: str) -> None:
        st = self._states.get(rid)
        exc = TransferAbortedError(f"request {rid} was aborted by the sender at layer {layer} (status {status}): "
                                   f"{reason}", request_id=rid, status=status)
        if st is None:
            if len(self._states) >= self.max_requests:
                self.bad_frames += 1
                return
            st = self._states[rid] = _State(self.num_layers, 0, self.num_layers, 0, 1, 0)
        self._fail(st, exc)

    def fail_all(self, exc: BaseException) -> None:
        """The link broke: every incomplete request fails with ``exc``."""
        self.broken = exc
        for st in self._states.values():
            self._fail(st, exc)

    def _state(self, rid: int) -> _State | None:
        st = self._states.get(rid)
        if st is not None and st.error is not None:
            raise st.error
        return st

    def ready_ns(self, rid: int, layer: int) -> int:
        """When ``layer`` of ``rid`` became ready (monotonic ns), 0 if not yet. A layer that
        was ready before the request failed stays ready; any other raises the request's error."""
        st = self._states.get(rid)
        if st is None:
            return 0
        if not st.lo <= layer < st.hi:
            raise ValueError(f"request {rid} moves layers [{st.lo}, {st.hi}); layer {layer} is not part of it")
        if layer < st.next_layer:
            return int(st.ready[layer])
        if st.error is not None:
            raise st.error
        return 0

    def ready_layers(self, rid: int) -> int:
        """Index one past the last ready layer of ``rid`` (0 when unknown), failed or not."""
        st = self._states.get(rid)
        return 0 if st is None else st.next_layer

    def record(self, rid: int) -> TransferRecord | None:
        """The request's record when all its layers are ready, else None."""
        st = self._state(rid)
        if st is None or not st.done:
            return None
        ready = np.array(st.ready[st.lo:st.hi], dtype=np.int64)
        return TransferRecord(
            request_id=rid, nbytes=int(st.layer_nbytes * (st.hi - st.lo)), num_descs=int(st.num_descs * (st.hi - st.lo)),
            num_layers=st.hi - st.lo, transport=self.transport, mode=self.mode,
            submit_to_last_us=(int(ready.max()) - st.submit_ns) / 1e3,
            layer_ready_us=tuple(float(x) for x in (ready - st.submit_ns) / 1e3), submit_ns=int(st.submit_ns),
        )

    def release(self, rid: int) -> None:
        self._states.pop(rid, None)

    def statistics(self) -> KVStatistics:
        return KVStatistics(transport=self.transport, mode=self.mode, requests_completed=self.completed,
                            requests_failed=self.failed, parts=self.parts, nbytes=self.nbytes,
                            bad_frames=self.bad_frames)
