"""The waiting policy of ``udp://`` endpoints, of :mod:`transports._waiting`'s family
(:class:`~transports._waiting.SpinThenPoll`): a receive busy-polls for ``busy_poll_s``, then
sleeps in ``poll`` on the socket, at most ``WAKE_S`` at a time (a reader then looks whether
its endpoint was closed); a send that finds the socket buffer full sleeps in ``poll`` at once.
A wait object is made when a call first finds nothing to do, one per call (a connected
endpoint has no lock, so two threads may wait on it at once)."""

from __future__ import annotations

import select
import time

from qlink.errors import QlinkTimeoutError

from ._udp_socket import WAKE_S
from ._waiting import SpinThenPoll

__all__ = ["UdpWait", "HubWait"]


class UdpWait(SpinThenPoll):
    """One blocking call's wait on an endpoint's own socket (``fd``, for ``events``); the
    poll object is made only if the spin ends without the socket getting ready."""

    __slots__ = ("ep", "fd", "events")

    def __init__(self, ep, fd: int, events: int, *, what: str, timeout_s: float | None, deadline: float | None,
                 spin_s: float) -> None:
        self.ep = ep
        self.fd = fd
        self.events = events
        super().__init__(None, timeout_s=timeout_s, spin_s=spin_s, what=what, max_block_s=WAKE_S, deadline=deadline)

    def timed_out(self) -> Exception:
        return self.ep._timed_out(self.what, self.timeout_s)

    def sleep(self, left_s: float | None) -> None:
        if self.poller is None:
            self.poller = select.poll()
            self.poller.register(self.fd, self.events)
        super().sleep(left_s)


class HubWait(SpinThenPoll):
    """The wait of the thread reading a listener's shared socket (its lock released): the
    spin polls the socket itself, so the reader learns of a datagram without reading it
    (it may be another peer's), then sleeps in the listener's poll object."""

    __slots__ = ("ep",)

    def __init__(self, poller, ep, *, what: str, timeout_s: float | None, deadline: float | None,
                 spin_s: float) -> None:  # ep: the endpoint receiving; None for accept()
        self.ep = ep
        super().__init__(poller, timeout_s=timeout_s, spin_s=spin_s, what=what, max_block_s=WAKE_S, deadline=deadline)

    def timed_out(self) -> Exception:
        if self.ep is not None:
            return self.ep._timed_out(self.what, self.timeout_s)
        return QlinkTimeoutError(f"udp: {self.what} did not complete within timeout_s={self.timeout_s}")

    def progressed(self) -> None:
        super().progressed()
        self.spin_until = None  # the spin starts when this call first reads and finds nothing

    def pause(self) -> None:
        now = time.monotonic()
        until = self.spin_until
        if until is None:
            until = self.spin_until = now + self.spin_s
        if now < until and (self.deadline is None or now < self.deadline):
            poll = self.poller.poll
            while not poll(0) and time.monotonic() < until:
                pass
            return
        super().pause()
