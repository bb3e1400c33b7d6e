"""Waiting, one family of policies for every transport: spin while the answer is close, then
give the CPU back, then sleep longer and longer, and never past the caller's deadline.

* :class:`Backoff`: counted, for loops that own their own clock (``spin`` polls return at
  once, then sleeps doubling from ``min_sleep_s`` to ``max_sleep_s``); ``reset()`` after progress.
* :class:`SpinThenSleep`: timed, with a deadline, for the blocking calls of an endpoint:
  busy-poll for ``spin_s`` (yielding the CPU after ``yield_after_s``, so two processes that
  share a core still take turns), then sleep doubling to ``max_sleep_s``; ``progressed()``
  starts over, ``restart()`` makes the same object serve the next call. A subclass says what
  an idle moment also does (:meth:`SpinThenSleep.idle`: look at the peer's socket, say), how
  it sleeps (:meth:`SpinThenSleep.sleep`) and what an expired deadline raises.
* :class:`SpinThenPoll`: the socket transports' form (tcp, udp): busy-poll for ``spin_s``,
  then sleep in ``poll(2)`` until the socket is ready, never past the deadline (and at most
  ``max_block_s`` at a time, for a caller that must look at something else now and then).
* :func:`deadline_of`: a ``timeout_s`` as an absolute ``time.monotonic()`` deadline;
  :func:`poll_ms`: a time left as the milliseconds ``poll(2)`` takes.

>>> b = Backoff(spin=2)
>>> b.pause(); b.pause(); b.spinning
False
>>> w = SpinThenSleep(timeout_s=0.0, spin_s=0.0)
>>> w.pause()
Traceback (most recent call last):
...
qlink.errors.QlinkTimeoutError: wait did not complete within timeout_s=0.0
>>> poll_ms(0.0012), poll_ms(None), poll_ms(None, cap_s=0.1), poll_ms(-1.0)
(2, None, 100, 0)
"""

from __future__ import annotations

import math
import os
import time

from qlink.errors import QlinkTimeoutError

__all__ = ["Backoff", "SpinThenPoll", "SpinThenSleep", "deadline_of", "poll_ms"]


class Backoff:
    """Bounded busy-poll, then exponential sleep up to ``max_sleep_s``.

    ``spin`` iterations return immediately (the hot path); after that each call
    sleeps, doubling from ``min_sleep_s``. ``reset()`` after progress.
    """

    __slots__ = ("spin", "min_sleep_s", "max_sleep_s", "_n", "_sleep")

    def __init__(self, *, spin: int = 20000, min_sleep_s: float = 5e-6, max_sleep_s: float = 1e-3):
        self.spin = spin
        self.min_sleep_s = min_sleep_s
        self.max_sleep_s = max_sleep_s
        self._n = 0
        self._sleep = min_sleep_s

    def reset(self) -> None:
        self._n = 0
        self._sleep = self.min_sleep_s

    @property
    def spinning(self) -> bool:
        return self._n < self.spin

    def pause(self, wake=None) -> None:
        """One idle moment. ``wake``: a ``threading.Event`` that ends a sleep early (work was
        handed over): it is then cleared and the backoff starts over."""
        if self._n < self.spin:
            self._n += 1
            return
        if wake is None:
            time.sleep(self._sleep)
        elif wake.wait(self._sleep):
            wake.clear()
            self.reset()
            return
        self._sleep = min(self._sleep * 2, self.max_sleep_s)


def deadline_of(timeout_s: float | None) -> float | None:
    """Absolute ``time.monotonic()`` deadline for a relative timeout (None or inf: no deadline)."""
    if timeout_s is None or timeout_s == float("inf"):
        return None
    if timeout_s != timeout_s or timeout_s < 0:  # NaN or negative
        raise ValueError(f"timeout_s must be a non-negative number or None, got {timeout_s!r}")
    return time.monotonic() + timeout_s


def poll_ms(left_s: float | None, *, cap_s: float | None = None) -> int | None:
    """``left_s`` (None: no limit) as ``poll(2)``'s timeout: whole milliseconds rounded up (a
    poll never ends before the deadline it serves), at least 0, at most ``cap_s``."""
    if cap_s is not None and (left_s is None or left_s > cap_s):
        left_s = cap_s
    return None if left_s is None else max(0, math.ceil(left_s * 1000))


class SpinThenSleep:
    """Deadline; busy-poll for ``spin_s``, after ``yield_after_s`` of it also yielding the CPU,
    then sleep doubling from ``min_sleep_s`` to ``max_sleep_s`` (never past the deadline),
    calling :meth:`idle` before each sleep. ``progressed()`` starts the phases over."""

    __slots__ = ("what", "timeout_s", "deadline", "spin_s", "yield_after_s", "min_sleep_s", "max_sleep_s",
                 "yield_after", "spin_until", "sleep_s")

    def __init__(self, *, timeout_s: float | None, spin_s: float, what: str = "wait", yield_after_s: float = 100e-6,
                 min_sleep_s: float = 5e-6, max_sleep_s: float = 1e-3, deadline: float | None | str = "now") -> None:
        self.spin_s = spin_s
        self.yield_after_s = yield_after_s
        self.min_sleep_s = min_sleep_s
        self.max_sleep_s = max_sleep_s
        # deadline: "now" counts timeout_s from here, else the call's own (taken when it began)
        self.restart(what, timeout_s, deadline_of(timeout_s) if isinstance(deadline, str) else deadline)

    def restart(self, what: str, timeout_s: float | None, deadline: float | None) -> None:
        """Serve a new wait (``deadline``: :func:`deadline_of` ``timeout_s``, taken when the
        call began), so one object can serve call after call of an endpoint."""
        self.what = what
        self.timeout_s = timeout_s
        self.deadline = deadline
        self.progressed()

    def progressed(self) -> None:
        now = time.monotonic()
        self.yield_after = now + self.yield_after_s
        self.spin_until = now + self.spin_s
        self.sleep_s = self.min_sleep_s

    def timed_out(self) -> Exception:
        """The error an expired deadline raises (a subclass names its endpoint)."""
        return QlinkTimeoutError(f"{self.what} did not complete within timeout_s={self.timeout_s}")

    def left_s(self) -> float | None:
        """Seconds left before the deadline (None: no deadline); raises :meth:`timed_out`'s
        error once it has passed. For a caller that waits some other way (a condition)."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.timed_out()
        return left

    def idle(self) -> bool:
        """Called before each sleep; True skips the sleep (the caller has something to see)."""
        return False

    def pause(self) -> None:
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            raise self.timed_out()
        if now < self.spin_until:
            if now >= self.yield_after:
                # still busy-polling, but let a runnable process sharing this CPU (perhaps the
                # peer itself, on a machine with few cores) run instead of spinning against it
                os.sched_yield()
            return
        if self.idle():
            return
        self.sleep(None if self.deadline is None else self.deadline - now)

    def sleep(self, left_s: float | None) -> None:
        """The pause after the spin, ``left_s`` before the deadline (None: no deadline): sleep,
        doubling from ``min_sleep_s`` to ``max_sleep_s``."""
        time.sleep(self.sleep_s if left_s is None else min(self.sleep_s, left_s))
        self.sleep_s = min(self.sleep_s * 2, self.max_sleep_s)


class SpinThenPoll(SpinThenSleep):
    """:class:`SpinThenSleep` for a socket: after the busy-poll, sleep in ``poller.poll`` (a
    :func:`select.poll` object, or anything with its ``poll(ms)``) until the socket is ready or
    the deadline comes, at most ``max_block_s`` at a time (None: no cap). The spin does not
    yield the CPU unless ``yield_after_s`` is given: a socket's spin is short. A subclass that
    waits on several things overrides :meth:`sleep`.

    >>> import select, socket
    >>> a, b = socket.socketpair()
    >>> p = select.poll(); p.register(a, select.POLLIN)
    >>> w = SpinThenPoll(p, timeout_s=5.0, spin_s=0.0)
    >>> b.send(b"x") and w.pause()  # readable: the poll returns at once
    >>> a.recv(1), a.close(), b.close()
    (b'x', None, None)
    """

    __slots__ = ("poller", "max_block_s")

    def __init__(self, poller, *, timeout_s: float | None, spin_s: float, what: str = "wait",
                 max_block_s: float | None = None, yield_after_s: float = math.inf,
                 deadline: float | None | str = "now") -> None:
        self.poller = poller
        self.max_block_s = max_block_s
        super().__init__(timeout_s=timeout_s, spin_s=spin_s, what=what, yield_after_s=yield_after_s, deadline=deadline)

    def sleep(self, left_s: float | None) -> None:
        self.poller.poll(poll_ms(left_s, cap_s=self.max_block_s))
