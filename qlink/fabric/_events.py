"""The discrete-event core: a heap of timed events merged with a pre-sorted arrival stream.

Events are ``(time_ns, seq, handler, arg)`` on a ``heapq``; ``seq`` (insertion order)
breaks ties, so a run is a pure function of its inputs and seeds. Arrivals whose times
are known before the run starts (frames leaving a link) come as one sorted array and
are merged with the heap instead of being pushed one by one: on equal times the heap
event runs first.

>>> loop = EventLoop()
>>> seen = []
>>> loop.schedule(30.0, lambda a: seen.append(("heap", a, loop.now_ns)), "x")
>>> loop.run(arrival_ns=[10.0, 30.0, 40.0],
...          on_arrival=lambda i: seen.append(("arrival", i, loop.now_ns)))
>>> seen
[('arrival', 0, 10.0), ('heap', 'x', 30.0), ('arrival', 1, 30.0), ('arrival', 2, 40.0)]
>>> loop.processed
4
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Sequence

__all__ = ["EventLoop"]


class EventLoop:
    """A minimal event loop: :meth:`schedule` handlers at times, :meth:`run` them in order."""

    __slots__ = ("now_ns", "processed", "_heap", "_seq")

    def __init__(self) -> None:
        self.now_ns = 0.0
        self.processed = 0
        self._heap: list = []
        self._seq = 0

    def schedule(self, t_ns: float, handler: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``handler(arg)`` at ``t_ns`` (never earlier than the current time)."""
        if t_ns < self.now_ns:
            raise ValueError(f"cannot schedule an event at {t_ns} ns, before the current time {self.now_ns} ns")
        self._seq += 1
        heapq.heappush(self._heap, (t_ns, self._seq, handler, arg))

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, *, arrival_ns: Sequence[float] = (), on_arrival: Callable[[int], None] | None = None,
            until_ns: float = math.inf) -> None:
        """Process events in time order until none is left (or the next is past ``until_ns``).

        ``arrival_ns`` (non-decreasing) are extra events: ``on_arrival(i)`` runs at
        ``arrival_ns[i]``.
        """
        heap = self._heap
        pop = heapq.heappop
        times = list(arrival_ns)
        if times and on_arrival is None:
            raise ValueError("arrival_ns given without on_arrival")
        n = len(times)
        i = 0
        t_next = times[0] if n else math.inf
        processed = 0
        while True:
            if heap and heap[0][0] <= t_next:
                t = heap[0][0]
                if t > until_ns:
                    break
                _, _, handler, arg = pop(heap)
                self.now_ns = t
                handler(arg)
            elif i < n:
                if t_next > until_ns:
                    break
                if i and t_next < times[i - 1]:
                    raise ValueError(f"arrival_ns must be non-decreasing; item {i} goes back in time")
                self.now_ns = t_next
                on_arrival(i)
                i += 1
                t_next = times[i] if i < n else math.inf
            else:
                break
            processed += 1
        self.processed += processed
