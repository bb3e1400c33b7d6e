"""The waiting policy of an ``shm://`` endpoint: :class:`~transports._waiting.SpinThenSleep`
whose idle moments also poll the peer's socket, so a peer that died (even by SIGKILL) is
seen within one sleep of the spin ending."""

from __future__ import annotations

from ._waiting import SpinThenSleep

__all__ = ["ShmWait"]

# Yield only after this long without progress: a yield hands the CPU to whatever else is
# runnable, and on a busy machine that costs a time slice; short waits (a streamed chunk,
# a prompt reply) should not pay it.
_YIELD_AFTER_S = 100e-6
_MIN_SLEEP_S = 5e-6
_MAX_SLEEP_S = 1e-3


class ShmWait(SpinThenSleep):
    """The shm endpoint's wait (:class:`~transports._waiting.SpinThenSleep`): each idle moment
    also polls the peer's socket, so a peer that died is seen within a sleep."""

    __slots__ = ("ep",)

    def __init__(self, ep, what: str, timeout_s: float | None) -> None:  # ep: the ShmEndpoint waiting
        self.ep = ep
        super().__init__(timeout_s=timeout_s, spin_s=ep._spin_s, what=what, yield_after_s=_YIELD_AFTER_S,
                         min_sleep_s=_MIN_SLEEP_S, max_sleep_s=_MAX_SLEEP_S)

    def timed_out(self) -> Exception:
        return self.ep._timed_out(self.what, self.timeout_s)

    def idle(self) -> bool:
        self.ep._poll_socket()
        return self.ep._peer_gone is not None  # the caller sees it and raises once nothing is left to deliver
