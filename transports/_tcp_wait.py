"""The waiting policy of a ``tcp://`` endpoint, one of :mod:`transports._waiting`'s family
(:class:`~transports._waiting.SpinThenPoll`): a receive busy-polls for ``busy_poll_s``, then
sleeps in ``poll`` on the socket until bytes (or the end of the stream) arrive or the deadline
comes; a send that finds the socket full sleeps in ``poll`` at once. While one side sleeps it
keeps the other moving when no thread of its own does: a sleeping receiver flushes a frame
left half written, a sleeping sender drains what comes in (two peers sending large messages
to each other cannot deadlock). Each endpoint keeps one object per side (its lock guards it),
so a blocking call allocates nothing."""

from __future__ import annotations

import select

from ._waiting import SpinThenPoll, poll_ms

__all__ = ["TcpRecvWait", "TcpSendWait"]

_POLLOUT = select.POLLOUT


class TcpRecvWait(SpinThenPoll):
    """A receive's wait (the caller holds the endpoint's receive lock)."""

    __slots__ = ("ep",)

    def __init__(self, ep, *, spin_s: float) -> None:  # ep: the TcpEndpoint waiting
        self.ep = ep
        super().__init__(ep._poll_in, timeout_s=None, spin_s=spin_s, what="receive")

    def timed_out(self) -> Exception:
        return self.ep._timed_out(self.what, self.timeout_s)

    def sleep(self, left_s: float | None) -> None:
        ep = self.ep
        if ep._pending is not None and not ep._slock.locked():  # nobody sends: finish the half-written frame
            ep._poll_in_out.poll(poll_ms(left_s))
            ep._flush_background()
        else:
            self.poller.poll(poll_ms(left_s))


class TcpSendWait(SpinThenPoll):
    """A send's wait for room in the socket (the caller holds the endpoint's send lock): no spin."""

    __slots__ = ("ep",)

    def __init__(self, ep) -> None:
        self.ep = ep
        super().__init__(ep._poll_out, timeout_s=None, spin_s=0.0, what="send")

    def timed_out(self) -> Exception:
        return self.ep._timed_out(self.what, self.timeout_s)

    def sleep(self, left_s: float | None) -> None:
        ep = self.ep
        if ep._rlock.locked():  # a receiving thread drains the incoming side
            self.poller.poll(poll_ms(left_s))
            return
        events = ep._poll_out_in.poll(poll_ms(left_s))
        if events and events[0][1] & ~_POLLOUT:
            ep._drain_background()  # keep reading so two peers sending large messages cannot deadlock
        if ep._dead is not None:
            ep._raise_broken(self.what)
