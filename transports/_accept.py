"""The queue between a listener's background connection handling and ``accept()``.

Connections are established (handshake and all) off the caller's thread and
*offered* here; ``accept(timeout_s)`` *takes* the next one. Closing the queue
hands back the endpoints nobody accepted, so the listener can close them.

>>> q = AcceptQueue("demo://x")
>>> q.offer("endpoint-1")
True
>>> q.take(timeout_s=0.1)
'endpoint-1'
>>> q.close(), q.offer("late")
([], False)
"""

from __future__ import annotations

import threading
import time
from collections import deque

from qlink.errors import BrokenLinkError, ClosedError, QlinkTimeoutError

from ._base import deadline_of

__all__ = ["AcceptQueue"]


class AcceptQueue:
    """Endpoints waiting to be accepted; thread-safe."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._cond = threading.Condition(threading.Lock())
        self._items: deque = deque()
        self._error: BaseException | None = None
        self.closed = False

    def offer(self, endpoint) -> bool:
        """Queue a connected endpoint; False when the listener is closed (the caller closes it)."""
        with self._cond:
            if self.closed:
                return False
            self._items.append(endpoint)
            self._cond.notify_all()
            return True

    def fail(self, error: BaseException) -> None:
        """The background side stopped for good: accept() raises BrokenLinkError from ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def take(self, *, timeout_s: float | None = None):
        """The next endpoint; ClosedError once closed, QlinkTimeoutError after ``timeout_s``."""
        scheme = self.url.split("://", 1)[0]
        deadline = deadline_of(timeout_s)
        with self._cond:
            while True:
                if self.closed:
                    raise ClosedError(f"{scheme} listener {self.url} was closed by this side")
                if self._items:
                    return self._items.popleft()
                if self._error is not None:
                    raise BrokenLinkError(f"{scheme} listener {self.url} stopped: {self._error!r}") from self._error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise QlinkTimeoutError(f"{scheme}: no connection to {self.url} within timeout_s={timeout_s}")
                self._cond.wait(left)

    def close(self) -> list | None:
        """Close; returns the endpoints never accepted, or None if it was already closed."""
        with self._cond:
            if self.closed:
                return None
            self.closed = True
            pending = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return pending
