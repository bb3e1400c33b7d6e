"""Letting sessions in (shared by both engines' session servers): a thread that takes
handshaken endpoints off a listener and hands them over, bounded, so that a crowd of
connections never waits on the serving thread and the serving thread never waits on a
handshake.

>>> import collections, transports
>>> lis = transports.listen("tcp://127.0.0.1:0")
>>> acc = Acceptor(lis, bound=4, refused=collections.Counter())
>>> ep = transports.connect(lis.url, timeout_s=5)
>>> acc.wait(timeout_s=5) and len(acc.incoming)
1
>>> acc.stop(); ep.close(); lis.close()
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

from qlink.errors import BrokenLinkError, ClosedError, QlinkTimeoutError

__all__ = ["Acceptor", "abort_endpoint", "peer_url"]

_ACCEPT_POLL_S = 0.1


class Acceptor:
    """Accepts on ``listener`` in a thread of its own; each endpoint goes to :attr:`incoming`
    (at most ``bound`` waiting: beyond that one is closed and counted in ``refused`` as
    ``accept_queue_full``; a failed handshake is counted as ``handshake_failed``), then
    ``on_new()`` is called (the serving thread's wake-up)."""

    def __init__(self, listener, *, bound: int, refused: collections.Counter,
                 on_new: Callable[[], None] | None = None) -> None:
        self.listener = listener
        self.bound = bound
        self.refused = refused
        self.on_new = on_new
        self.incoming: collections.deque = collections.deque()
        self._arrived = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="qlink-session-acceptor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        lis = self.listener
        while not self._stop.is_set():
            try:
                ep = lis.accept(timeout_s=_ACCEPT_POLL_S)
            except QlinkTimeoutError:
                continue
            except (ClosedError, BrokenLinkError):
                return
            except Exception:  # one failed handshake (shm) must not stop accepting
                self.refused["handshake_failed"] += 1
                continue
            if len(self.incoming) >= self.bound:
                self.refused["accept_queue_full"] += 1
                abort_endpoint(ep)
                continue
            self.incoming.append(ep)
            self._arrived.set()
            if self.on_new is not None:
                self.on_new()

    def wait(self, *, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for an endpoint to be waiting; True if one is."""
        if not self.incoming:
            self._arrived.wait(timeout_s)
        self._arrived.clear()
        return bool(self.incoming)

    def stop(self) -> None:
        """Stop accepting; the endpoints still waiting are closed."""
        self._stop.set()
        self._thread.join(timeout=2 * _ACCEPT_POLL_S + 1)
        while self.incoming:
            abort_endpoint(self.incoming.popleft())


def peer_url(ep) -> str | None:
    """``scheme://host:port`` of an endpoint's peer where it has an address, else its URL."""
    addr = getattr(ep, "peer_address", None)
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{ep.capabilities.name}://{addr[0]}:{addr[1]}"
    return getattr(ep, "url", None)


def abort_endpoint(ep) -> None:
    """Close an endpoint without lingering on a peer that does not read."""
    try:
        abort = getattr(ep, "abort", None)
        (abort or ep.close)()
    except Exception:
        pass
