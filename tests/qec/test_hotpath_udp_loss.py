"""The native QEC path over udp when datagrams are lost: chosen datagrams are dropped on purpose
by a relay between the controller and the service (the first time each passes), so what is
lost does not depend on timing. Every shot must come back with the decoder's own correction
(the lost frames sent again and the shot repaired), never another shot's.
"""

from __future__ import annotations

import select
import socket
import struct
import threading

import numpy as np
import pytest

from qlink import wire
from qlink.qec.hotpath import NativeController, available
from tests.qec.test_hotpath import (
    _direct,
    _frame_enqueue,
    _frame_get,
    _Served,
    _stream,
    _surface,
)

pytestmark = pytest.mark.skipif(available() is not None, reason=f"native path not built: {available()}")

_NAMED = 0xC0000000  # a get whose request id names its shot: the counter of the shot's last frame
_HDR = struct.Struct("<IIIIQ")  # magic, function (request) or status (response), length, request id, ptp


class _LossyRelay:
    """Forwards datagrams between one controller and a udp service, dropping those ``drop``
    picks, each the first time it passes (a datagram sent again goes through).

    ``drop(direction, fields)``: direction ``"up"`` (controller to service: fields
    ``("enqueue", counter)`` or ``("get", request_id)``) or ``"down"`` (service to controller:
    ``("answer", request_id)``).
    """

    def __init__(self, service_url: str, drop) -> None:
        host, port = service_url.removeprefix("udp://").rsplit(":", 1)
        self.drop = drop
        self.up = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # faces the controller
        self.up.bind(("127.0.0.1", 0))
        self.down = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # faces the service
        self.down.connect((host, int(port)))
        for s in (self.up, self.down):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.url = f"udp://127.0.0.1:{self.up.getsockname()[1]}"
        self.seen: set = set()
        self.dropped: list = []
        self.ctl = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _fields(self, data: bytes, direction: str):
        if len(data) < _HDR.size:
            return None
        _, fn_or_status, _, rid, _ = _HDR.unpack_from(data)
        if direction == "down":
            return ("answer", rid)
        if fn_or_status == wire.function_id_for("enqueue_syndromes"):
            return ("enqueue", struct.unpack_from("<q", data, _HDR.size + 8)[0])
        if fn_or_status == wire.function_id_for("get_corrections"):
            return ("get", rid)
        return None

    def _pass(self, data: bytes, direction: str) -> bool:
        f = self._fields(data, direction)
        if f is None or (direction, f) in self.seen:
            return True
        self.seen.add((direction, f))
        if self.drop(direction, f):
            self.dropped.append((direction, f))
            return False
        return True

    def _run(self) -> None:
        while not self.stop.is_set():
            ready, _, _ = select.select([self.up, self.down], [], [], 0.05)
            for s in ready:
                while True:
                    try:
                        data, addr = s.recvfrom(65536, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        break
                    if s is self.up:
                        self.ctl = addr
                        if self._pass(data, "up"):
                            self.down.send(data)
                    elif self.ctl is not None and self._pass(data, "down"):
                        self.up.sendto(data, self.ctl)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.up.close()
        self.down.close()


def _lossy_run(stream, dem, F, drop, *, lockstep=False, packed=False):
    import transports

    served = _Served(dem, frames_per_shot=F, keep=stream.num_shots, scheme="udp", connect=False)
    relay = _LossyRelay(served.lis.url, drop)
    try:
        ep = transports.connect(relay.url, timeout_s=10)
        served.ep = ep
        # (one frame a datagram, as the drops name them: no frames joined when behind the clock)
        res = NativeController(ep, stream, cycle_ns=1100, lockstep=lockstep, get_in_last_datagram=packed,
                               join_nbytes=0).run(timeout_s=120)
    finally:
        rep = served.close()
        relay.close()
    return res, rep, relay


@pytest.mark.parametrize("lockstep", [False, True])
def test_udp_lost_frames_gets_and_answers_are_recovered_bit_exact(lockstep):
    """Frames (mid-shot, a shot's last, two of one shot, a whole shot with its get, the run's
    very last), gets and answers are dropped: the controller sends the lost frames again, the
    service repairs those shots, and every shot gets its own decoder correction. (Each get in a
    datagram of its own, so a get alone can be lost.)"""
    stream, dem = _stream(_surface("Z", 3, 3), 120, 21)
    F = len(stream.frames(rounds_per_frame=1))
    S = stream.num_shots
    lost_frames = {5 * F + 1,  # mid-shot
                   9 * F + F - 1,  # a shot's last frame
                   20 * F + 0, 20 * F + 2,  # two gaps in one shot
                   *range(30 * F, 31 * F),  # a whole shot ...
                   S * F - 1}  # ... and the run's very last frame
    whole_shot_get = 30 * F + F - 1
    lost_gets = {whole_shot_get, 44 * F + F - 1, 70 * F + F - 1}  # by the counter each names
    lost_answers = {50 * F + F - 1, 51 * F + F - 1}

    def drop(direction, f):
        kind, v = f
        if kind == "enqueue":
            return v in lost_frames
        if kind == "get":
            return (v & _NAMED) == _NAMED and (v & ~_NAMED) in lost_gets
        return (v & _NAMED) == _NAMED and (v & ~_NAMED) in lost_answers

    res, rep, relay = _lossy_run(stream, dem, F, drop, lockstep=lockstep)
    assert len(relay.dropped) == len(lost_frames) + len(lost_gets) + len(lost_answers), relay.dropped
    assert res.shots_ok == S, (res.statuses, res.answer_faults)
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    truth = np.packbits(stream.observables, axis=1, bitorder="little")
    assert res.logical_errors == int(np.any(res.corrections != truth, axis=1).sum())
    # the shots that lost frames were sent again; those the service had dropped were repaired
    touched = {i // F for i in lost_frames}
    assert res.answer_faults["repairs"] >= len(touched)
    # (shots 5 and 20 lost frames that later frames of theirs revealed; in lock-step shot 30's
    # frames, sent again, simply arrive late, otherwise the next shot's frames revealed it first)
    assert rep["counts"]["shots_repaired"] >= (2 if lockstep else 3)
    assert rep["counts"]["shots_decoded"] >= S
    assert res.answer_faults["resent_gets"] >= 1  # a lost get or answer: asked again when none came


def test_udp_gets_name_their_shot_so_a_lost_get_takes_no_other_shot():
    """Gets that name their shot, one of them lost: the next get is answered with its own shot
    (not the lost get's), and the lost get asked again still gets its own; a frame of a dropped
    shot sent again repairs it; a get named past the frames received is NOT_READY."""
    stream, dem = _stream(_surface("Z", 3, 3), 4, 8)
    served = _Served(dem, frames_per_shot=1, scheme="udp")
    ep = served.ep
    want = _direct("pymatching", dem, stream.detectors)

    def ask(counter):
        ep.send(_frame_get(_NAMED | counter))
        a = wire.decode_response(ep.recv(timeout_s=5))
        assert a.request_id == _NAMED | counter
        return a

    try:
        for k in (0, 1, 3):  # shot 2's only frame is lost
            ep.send(_frame_enqueue(k, k, stream.detectors[k]))
        a1 = ask(1)  # (the get for shot 0 was lost)
        a0 = ask(0)
        a1b = ask(1)  # asked again: the same answer, nothing consumed
        a2 = ask(2)  # lost to the counter gap
        ep.send(_frame_enqueue(10, 2, stream.detectors[2]))  # its frame sent again
        a2b = ask(2)
        a3 = ask(3)
        a4 = ask(4)  # not sent yet
    finally:
        rep = served.close()
    for a, k in ((a0, 0), (a1, 1), (a1b, 1), (a2b, 2), (a3, 3)):
        assert a.status == wire.Status.OK and bytes(a.result) == bytes(want[k]), (k, a)
    assert a2.status == wire.Status.SYNDROMES_DROPPED
    assert a4.status == wire.Status.NOT_READY
    assert rep["counts"]["shots_repaired"] == 1 and rep["counts"]["frames_lost"] == 1


def test_two_gaps_in_one_shot_drop_it_once():
    """Two frames of one shot lost apart (a gap, a frame discarded, another gap): the shot is
    dropped once, so first-come gets stay with their own shots."""
    stream, dem = _stream(_surface("Z", 3, 3), 3, 4)
    layouts = stream.frames(rounds_per_frame=1)
    F = len(layouts)
    assert F >= 4
    served = _Served(dem, frames_per_shot=F, scheme="shm")
    ep = served.ep
    lost = {F + 1, F + 3}
    try:
        i = 0
        for s in range(3):
            for lay in layouts:
                if i not in lost:
                    ep.send(_frame_enqueue(i, i, stream.detectors[s, lay.first_bit:lay.first_bit + lay.num_bits]))
                i += 1
        for k in range(3):
            ep.send(_frame_get(0x80000000 + k))
        answers = [wire.decode_response(ep.recv(timeout_s=5)) for _ in range(3)]
    finally:
        rep = served.close()
    want = _direct("pymatching", dem, stream.detectors)
    assert [a.status for a in answers] == [wire.Status.OK, wire.Status.SYNDROMES_DROPPED, wire.Status.OK]
    assert bytes(answers[0].result) == bytes(want[0]) and bytes(answers[2].result) == bytes(want[2])
    assert rep["counts"]["shots_dropped"] == 1


def test_udp_controller_waits_for_the_service_before_playing():
    """The service starts reading its socket late, its buffer far too small for the run's
    burst: the controller's first look is answered only once the service reads, and nothing is
    lost (no counter gap, no repair)."""
    stream, dem = _stream(_surface("Z", 3, 3), 300, 6)
    F = len(stream.frames(rounds_per_frame=1))
    served = _Served(dem, frames_per_shot=F, keep=300, scheme="udp", rcvbuf_nbytes=4096, accept_delay_s=0.5)
    try:
        res = NativeController(served.ep, stream, cycle_ns=200).run(timeout_s=60)
    finally:
        rep = served.close()
    assert res.shots_ok == 300
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    assert rep["faults"] == {} and "repairs" not in res.answer_faults


@pytest.mark.parametrize("lockstep", [False, True])
def test_udp_lost_datagrams_of_a_last_frame_with_its_get_are_recovered_bit_exact(lockstep):
    """The default over udp: a shot's get rides in the datagram of its last frame, so losing
    that datagram loses both. Such datagrams, other frames and answers are dropped: every shot
    still gets its own decoder correction."""
    stream, dem = _stream(_surface("Z", 3, 3), 120, 22)
    F = len(stream.frames(rounds_per_frame=1))
    S = stream.num_shots
    lost_frames = {5 * F + 1,  # mid-shot
                   9 * F + F - 1, 44 * F + F - 1,  # a shot's last frame, its get with it
                   *range(30 * F, 31 * F),  # a whole shot
                   S * F - 1}  # the run's very last frame and its get
    lost_answers = {50 * F + F - 1}

    def drop(direction, f):
        kind, v = f
        if kind == "enqueue":  # (a datagram is named by its first frame)
            return v in lost_frames
        return kind == "answer" and (v & _NAMED) == _NAMED and (v & ~_NAMED) in lost_answers

    res, rep, relay = _lossy_run(stream, dem, F, drop, lockstep=lockstep, packed=True)
    assert len(relay.dropped) == len(lost_frames) + len(lost_answers), relay.dropped
    assert res.shots_ok == S, (res.statuses, res.answer_faults)
    np.testing.assert_array_equal(res.corrections, _direct("pymatching", dem, stream.detectors))
    assert rep["counts"]["frames_packed"] >= S - 4  # (the gets of the lost datagrams came again on their own)
    assert res.answer_faults["repairs"] >= len({i // F for i in lost_frames})
