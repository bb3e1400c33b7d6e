"""Running a decoder service in a spawned child process (re-exported by :mod:`qlink.qec.service`).

Only plain data crosses into the child: the URL and a spec per decoder (source
parameters, decoder name) from which the child rebuilds its DEM and compiles its
decoder. The child reports back as a JSON string.
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

from qlink.errors import QlinkTimeoutError

__all__ = ["run_service_process", "ServiceProcess", "start_service_process"]


_DATAGRAM_IDLE_S = 1.0


def run_service_process(url: str, configs_spec: Mapping[int, Mapping[str, Any]], *, ready_queue=None,
                        result_queue=None, accept_timeout_s: float = 30.0, timeout_s: float | None = None,
                        service_options: Mapping[str, Any] | None = None, pin_cpu: int | None = None) -> dict:
    """Run a decoder service in this process: listen on ``url``, serve one peer, report.

    ``configs_spec`` is plain data, ``{decoder_id: {"source": {...}, "decoder": name, ...}}``;
    every DEM is rebuilt here from its source spec. ``ready_queue`` gets the bound URL
    (or ``"error: ..."``) once listening; ``result_queue`` gets the report as a JSON
    string; ``pin_cpu`` pins this process to that CPU slot (busy-polling benchmarks
    keep the service and the controller on different cores). This is the target of
    :func:`start_service_process` (spawn).
    """
    import transports

    from qlink.bench._procs import die_with_parent, pin_to_cpu

    from .service import DecoderConfig, DecoderService

    die_with_parent()  # a service never outlives the process that started it
    if pin_cpu is not None:
        pin_to_cpu(pin_cpu)

    try:
        configs = {int(k): DecoderConfig.from_spec(v) for k, v in configs_spec.items()}
        service = DecoderService(configs, **dict(service_options or {}))
        listener = transports.listen(url)
    except Exception as exc:
        if ready_queue is not None:
            ready_queue.put(f"error: {type(exc).__name__}: {exc}")
        raise
    report: dict = {}
    try:
        if ready_queue is not None:
            ready_queue.put(listener.url)
        ep = listener.accept(timeout_s=accept_timeout_s)
        try:
            # A datagram peer cannot say it has left (UDP has no close): end after a quiet second.
            idle_s = None if ep.capabilities.reliable else _DATAGRAM_IDLE_S
            report = service.serve(ep, timeout_s=timeout_s, idle_timeout_s=idle_s)
            report["transport"] = ep.capabilities.name
            report["transport_statistics"] = {k: v for k, v in vars(ep.statistics()).items() if k != "extra"}
        finally:
            ep.close()
    except Exception as exc:
        report = service.report()
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        listener.close()
        if result_queue is not None:
            result_queue.put(json.dumps(report))
    return report


class ServiceProcess:
    """A decoder service running in a spawned child process (see :func:`start_service_process`)."""

    def __init__(self, process, url: str, result_queue) -> None:
        self.process = process
        self.url = url
        self._results = result_queue
        self._report: dict | None = None

    def report(self, *, timeout_s: float = 30.0) -> dict:
        """Wait for the child's report (sent when its peer disconnects) and reap it."""
        if self._report is None:
            import queue as _queue

            try:
                self._report = json.loads(self._results.get(timeout=timeout_s))
            except _queue.Empty:
                raise QlinkTimeoutError(
                    f"the decoder service process sent no report within timeout_s={timeout_s} "
                    f"(alive: {self.process.is_alive()}, exit code: {self.process.exitcode})"
                ) from None
            self.process.join(timeout=timeout_s)
        return self._report

    def close(self) -> None:
        """Stop the child if it still runs. Idempotent."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_service_process(url: str, configs_spec: Mapping[int, Mapping[str, Any]], *, start_timeout_s: float = 60.0,
                          **options) -> ServiceProcess:
    """Spawn :func:`run_service_process` and wait until it listens; returns its handle.

    >>> # see qlink.qec.loop.run_loop for the full closed loop
    """
    import multiprocessing as mp
    import queue as _queue

    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    spec = {int(k): dict(v) for k, v in configs_spec.items()}
    proc = ctx.Process(target=run_service_process, args=(url, spec),
                       kwargs=dict(ready_queue=ready, result_queue=results, **options),
                       name="qlink-decoder-service", daemon=True)
    proc.start()
    give_up = time.monotonic() + start_timeout_s
    while True:
        try:
            msg = ready.get(timeout=0.1)
            break
        except _queue.Empty:
            if not proc.is_alive():
                proc.join(1)
                raise RuntimeError(f"the decoder service process exited (code {proc.exitcode}) before listening; "
                                   "its stderr says why") from None
            if time.monotonic() > give_up:
                proc.terminate()
                proc.join(5)
                raise QlinkTimeoutError(
                    f"the decoder service did not start listening within {start_timeout_s} s") from None
    if msg.startswith("error:"):
        proc.join(5)
        raise RuntimeError(f"the decoder service failed to start: {msg[7:]}")
    return ServiceProcess(proc, msg, results)
