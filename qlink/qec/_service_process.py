"""Running a decoder service in a spawned child process (re-exported by :mod:`qlink.qec.service`):
the Python service serves every controller at once (:class:`~qlink.qec.sessions.SessionServer`),
and so does the native one (:class:`~qlink.qec._native_sessions.NativeSessionServer`) unless it
serves a single controller (``max_peers=1``: the one-at-a-time path, with per-shot rows).

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
_STOP_POLL_S = 0.5


def make_service(configs, service_options: Mapping[str, Any] | None = None):
    """A decoder service for ``configs``: ``service_options["engine"]`` ``"python"`` (the
    default: :class:`~qlink.qec.service.DecoderService`, every transport) or ``"native"``
    (:class:`~qlink.qec.hotpath.NativeDecoderService`, shm, tcp and udp); the other options go to it."""
    opts = dict(service_options or {})
    engine = opts.pop("engine", "python")
    if engine == "native":
        from .hotpath import NativeDecoderService

        return NativeDecoderService(configs, **opts)
    if engine != "python":
        raise ValueError(f"engine must be 'python' or 'native', got {engine!r}")
    from .service import DecoderService

    return DecoderService(configs, **opts)


def run_service_process(url: str, configs_spec: Mapping[int, Mapping[str, Any]], *, ready_queue=None,
                        result_queue=None, accept_timeout_s: float = 30.0, timeout_s: float | None = None,
                        service_options: Mapping[str, Any] | None = None, pin_cpu: int | None = None,
                        max_peers: int | None = 1, stop_event=None, token: str | bytes | None = None,
                        insecure: bool = False, session_limits: Mapping[str, Any] | None = None) -> dict:
    """Run a decoder service in this process: listen on ``url``, serve controllers one after
    another, report each.

    ``configs_spec`` is plain data, ``{decoder_id: {"source": {...}, "decoder": name, ...}}``;
    every DEM is rebuilt here from its source spec. ``ready_queue`` gets the bound URL
    (or ``"error: ..."``) once listening; ``result_queue`` gets a report as a JSON string
    each time a controller's session ends (the service's counts since it started,
    ``peers_served``, ``"error"`` if the session failed, and ``"final"``: whether the
    service ends after it), and one with ``"error"`` if listening or accepting fails. The
    Python service serves all its controllers at once, each with decoder states of its own
    (see :mod:`qlink.qec.sessions`; ``session_limits``: the fields of
    :class:`~qlink.qec.sessions.SessionLimits`), and so does the native one (the same limits, a
    core per session, see :mod:`qlink.qec._native_sessions`) unless ``max_peers`` is 1: then its
    one controller is served by the one-at-a-time path, which keeps per-shot rows. After
    ``max_peers`` sessions have ended the service ends; ``None``: until ``stop_event`` is set or
    the process is stopped.
    ``accept_timeout_s`` bounds the wait for the first controller; ``timeout_s`` each
    session. A ``url`` beyond loopback needs a shared ``token`` (tcp and ucx clients prove it in
    the handshake, udp datagrams carry its HMAC and a sequence number the service holds against
    replays, see :mod:`qlink.access`; a token on udp needs the Python engine) or ``insecure=True``;
    without either the service refuses to start (InsecureBindError). ``pin_cpu`` pins this process to that CPU slot
    (busy-polling benchmarks keep the service and the controller on different cores).
    Returns the last report. This is the target of :func:`start_service_process` (spawn).
    """
    import transports

    from qlink.procs import die_with_parent, pin_to_cpu

    from qlink.access import check_bind, token_bytes

    from .service import DecoderConfig, DecoderService
    from .sessions import SessionLimits

    _check_max_peers(max_peers)
    die_with_parent()  # a service never outlives the process that started it
    if pin_cpu is not None:
        pin_to_cpu(pin_cpu)

    try:
        key = token_bytes(token)
        check_bind(url, token=key, insecure=insecure)
        if key is not None and url.startswith("udp:") and (service_options or {}).get("engine") == "native":
            raise ValueError("a udp:// service with a token checks every datagram's HMAC and sequence number "
                             "(qlink.access) in the Python engine; the native engine does not: serve with "
                             "engine='python' (the default), or over tcp:// where the native engine is "
                             "served after the token handshake")
        limits = SessionLimits(**dict(session_limits or {}))
        if timeout_s is not None and limits.session_timeout_s is None:
            from dataclasses import replace

            limits = replace(limits, session_timeout_s=timeout_s)
        configs = {int(k): _config_from_spec(v, DecoderConfig) for k, v in configs_spec.items()}
        service = make_service(configs, service_options)
        listener = transports.listen(url, **_listen_options(url, key, limits))
    except Exception as exc:
        if ready_queue is not None:
            ready_queue.put(f"error: {type(exc).__name__}: {exc}")
        raise
    if isinstance(service, DecoderService) or max_peers != 1:
        return _serve_sessions(service, listener, limits=limits, token=key, ready_queue=ready_queue,
                               result_queue=result_queue, max_peers=max_peers, accept_timeout_s=accept_timeout_s,
                               stop_event=stop_event)
    report: dict = {}
    peers = 0
    try:
        if ready_queue is not None:
            ready_queue.put(listener.url)
        while max_peers is None or peers < max_peers:
            ep = _accept(listener, timeout_s=accept_timeout_s if peers == 0 else None, stop_event=stop_event)
            if ep is None:  # stopped
                break
            peers += 1
            try:
                # A datagram peer cannot say it has left (UDP has no close): end after a quiet second.
                idle_s = None if ep.capabilities.reliable else _DATAGRAM_IDLE_S
                report = service.serve(ep, timeout_s=timeout_s, idle_timeout_s=idle_s, stop_event=stop_event)
                report["transport"] = ep.capabilities.name
                report["transport_statistics"] = {k: v for k, v in vars(ep.statistics()).items() if k != "extra"}
            except Exception as exc:  # this session failed; the next controller is still served
                report = service.report()
                report["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                ep.close()
            report["peers_served"] = peers
            report["final"] = max_peers is not None and peers >= max_peers
            if result_queue is not None:
                result_queue.put(json.dumps(report))
    except Exception as exc:  # listening or accepting failed: the service ends
        report = service.report()
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["peers_served"] = peers
        report["final"] = True
        if result_queue is not None:
            result_queue.put(json.dumps(report))
    finally:
        listener.close()
    return report


def _listen_options(url: str, token: bytes | None, limits) -> dict:
    """The listener options the service's limits and token ask of ``url``'s transport."""
    scheme = url.split("://", 1)[0]
    if scheme == "tcp":
        return {"token": token, "read_ahead_nbytes": limits.read_ahead_nbytes}
    if scheme == "ucx":
        return {"token": token}
    if scheme == "udp":  # room in the kernel for a burst from many senders (capped by net.core.rmem_max)
        return {"rcvbuf_nbytes": 4 << 20, "reuse_port": True}  # (a socket per sender: see sessions)
    if token is not None and scheme not in ("shm", "inproc"):
        raise ValueError(f"a shared token is checked over tcp://, ucx:// and udp:// (shm:// is for this user only), "
                         f"not over {scheme}://; serve on one of those or without token=")
    return {}


def _serve_sessions(service, listener, *, limits, token, ready_queue, result_queue, max_peers, accept_timeout_s,
                    stop_event) -> dict:
    """Every controller at once (see :class:`~qlink.qec.sessions.SessionServer`, and
    :class:`~qlink.qec._native_sessions.NativeSessionServer` for the native engine); a report as
    each session ends, the last one ``final`` once ``max_peers`` have ended."""
    from .service import DecoderService
    from .sessions import SessionServer

    server = None

    def ended(rep: dict) -> None:
        rep["peers_served"] = server.ended
        rep["final"] = max_peers is not None and server.ended >= max_peers
        if result_queue is not None:
            result_queue.put(json.dumps(rep))

    try:
        if isinstance(service, DecoderService):
            server = SessionServer(service, listener, limits=limits, token=token if listener.url.startswith("udp:")
                                   else None, on_session_end=ended)
        else:
            from ._native_sessions import NativeSessionServer

            server = NativeSessionServer(service, listener, limits=limits, on_session_end=ended)
        if ready_queue is not None:
            ready_queue.put(listener.url)
        report = server.run(stop_event=stop_event, max_sessions_served=max_peers,
                            first_session_timeout_s=accept_timeout_s)
    except Exception as exc:  # listening or serving failed: the service ends
        if server is None and ready_queue is not None:  # (not listening yet: the starter is told why)
            ready_queue.put(f"error: {type(exc).__name__}: {exc}")
        report = server.report() if server is not None else service.report()
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["peers_served"] = 0 if server is None else server.ended
        report["final"] = True
        if result_queue is not None:
            result_queue.put(json.dumps(report))
    finally:
        if server is not None:
            server.close()
        listener.close()
    return report


def _config_from_spec(spec: Mapping[str, Any], config_cls):
    """A decoder spec: a source spec (``DecoderConfig.from_spec``) or one decoder of a CUDA-Q
    ``multi_decoder_config`` (``{"multi_decoder_config": ...}``, see
    :func:`qlink.qec.cudaq_config.service_specs_from_cudaq`)."""
    if "multi_decoder_config" in spec:
        from .cudaq_config import decoder_config_from_spec

        return decoder_config_from_spec(spec)
    return config_cls.from_spec(spec)


def _check_max_peers(max_peers) -> None:
    if max_peers is not None and (isinstance(max_peers, bool) or not isinstance(max_peers, int) or max_peers < 1):
        raise ValueError(f"max_peers must be an int >= 1, or None (until stopped), got {max_peers!r}")


def _accept(listener, *, timeout_s: float | None, stop_event):
    """The next peer's endpoint, or None once ``stop_event`` is set; waits at most ``timeout_s``
    (None: until stopped), looking at ``stop_event`` every half second."""
    if stop_event is None:
        return listener.accept(timeout_s=timeout_s)
    give_up = None if timeout_s is None else time.monotonic() + timeout_s
    while not stop_event.is_set():
        step = _STOP_POLL_S if give_up is None else min(_STOP_POLL_S, max(0.0, give_up - time.monotonic()))
        try:
            return listener.accept(timeout_s=step)
        except QlinkTimeoutError:
            if give_up is not None and time.monotonic() >= give_up:
                raise
    return None


class ServiceProcess:
    """A decoder service running in a spawned child process (see :func:`start_service_process`)."""

    def __init__(self, process, url: str, result_queue, *, max_peers: int | None = None) -> None:
        self.process = process
        self.url = url
        self.max_peers = max_peers  # controllers the child serves before it exits (None: until closed)
        self._results = result_queue
        self._report: dict | None = None

    def report(self, *, timeout_s: float = 30.0) -> dict:
        """The report of the next controller session to end (one per controller served, in
        order; counts are the service's since it started). Once the child has exited with
        nothing more to say, the last report again. The child is reaped after its last
        session (``max_peers`` reached) or a failure."""
        import queue as _queue

        try:
            msg = self._results.get(timeout=0 if self._done() else timeout_s)
        except _queue.Empty:
            if self._report is not None and self._done():
                return self._report
            raise QlinkTimeoutError(
                f"the decoder service process sent no report within timeout_s={timeout_s} "
                f"(alive: {self.process.is_alive()}, exit code: {self.process.exitcode})"
            ) from None
        self._report = json.loads(msg)
        if self._report.get("final"):  # the child ends after this one
            self.process.join(timeout=timeout_s)
        return self._report

    def _done(self) -> bool:
        return self._report is not None and not self.process.is_alive()

    def close(self) -> None:
        """Stop the child if it still runs. Idempotent."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=5)
        if not self.process.is_alive() and self.url.startswith("shm://"):
            from transports.shm import reclaim_after_exit

            reclaim_after_exit(self.url)  # a killed service could not remove its listener's socket

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_service_process(url: str, configs_spec: Mapping[int, Mapping[str, Any]], *, start_timeout_s: float = 60.0,
                          max_peers: int | None = None, **options) -> ServiceProcess:
    """Spawn :func:`run_service_process` and wait until it listens; returns its handle.

    The child serves controllers one after another until it is closed (``max_peers``
    None), or that many and then exits; a controller that goes away, cleanly or not,
    leaves the way open for the next, which starts with reset decoders.

    >>> # see qlink.qec.loop.run_loop for the full closed loop
    """
    import multiprocessing as mp
    import queue as _queue

    _check_max_peers(max_peers)
    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    spec = {int(k): dict(v) for k, v in configs_spec.items()}
    proc = ctx.Process(target=run_service_process, args=(url, spec),
                       kwargs=dict(ready_queue=ready, result_queue=results, max_peers=max_peers, **options),
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
    return ServiceProcess(proc, msg, results, max_peers=max_peers)
