"""CUDA-Q's own realtime decoding, run as a peer of qlink's decoder service.

A memory experiment (repetition code or rotated surface code, Z basis) is one
``@cudaq.kernel`` that loops over shots inside a single launch (a kernel with the
realtime calls is recompiled at every launch): each shot calls ``reset_decoder``,
measures every ancilla each round and ``enqueue_syndromes`` the round's
measurements, measures the data qubits, enqueues them, asks ``get_corrections``
and returns the measurement record and the correction. It runs on CUDA-Q's
``stim`` target with ``Depolarization2(p)`` after every CNOT.

The decoders come from a ``multi_decoder_config`` built from the experiment's stim
twin (:func:`layout_stim_circuit`: the same gates in the same order with
``DEPOLARIZE2(p)`` after each ``CX``), its ``D_sparse`` mapping the kernel's
measurement record to detectors. The same file configures CUDA-Q
(``configure_decoders_from_file``) and qlink
(:func:`qlink.qec.cudaq_config.decoder_configs_from_cudaq`).

>>> lay = surface_layout(distance=3, rounds=2)
>>> lay.num_data, lay.num_anc, len(lay.x_anc), lay.num_measurements
(9, 8, 4, 25)
>>> c = layout_stim_circuit(lay, p=0.001)
>>> c.num_detectors, c.num_observables
(16, 1)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import missing

__all__ = ["MemoryLayout", "RealtimeRun", "repetition_layout", "surface_layout", "layout_stim_circuit",
           "run_cudaq_realtime", "config_for_layout"]


@dataclass(frozen=True)
class MemoryLayout:
    """A CSS memory experiment in the Z basis: ``num_data`` data qubits, ``num_anc``
    ancillas (those in ``x_anc`` measure X stabilizers: H before and after their CNOTs),
    the CNOTs of one round in order (``cx_data[k]``, ``cx_anc[k]``, ``cx_anc_controls[k]``:
    1 when the ancilla is the control), ``rounds`` rounds, and the data qubits of the
    logical Z observable. Each round measures every ancilla (the record: ``rounds``
    blocks of ``num_anc`` bits, then ``num_data`` data bits)."""

    name: str
    num_data: int
    num_anc: int
    x_anc: tuple[int, ...]
    cx_data: tuple[int, ...]
    cx_anc: tuple[int, ...]
    cx_anc_controls: tuple[int, ...]
    logical: tuple[int, ...]
    rounds: int

    @property
    def num_measurements(self) -> int:
        return self.rounds * self.num_anc + self.num_data

    def measurement_rounds(self) -> np.ndarray:
        """The round of each bit of the record (the data readout is round ``rounds``)."""
        return np.concatenate([np.repeat(np.arange(self.rounds), self.num_anc),
                               np.full(self.num_data, self.rounds)]).astype(np.int64)

    def z_stabilizers(self) -> list[list[int]]:
        """Data qubits of each ancilla's stabilizer (empty lists for X ancillas' final check)."""
        sup: list[list[int]] = [[] for _ in range(self.num_anc)]
        for d, a in zip(self.cx_data, self.cx_anc):
            sup[a].append(d)
        return sup


def repetition_layout(*, distance: int, rounds: int) -> MemoryLayout:
    """Bit-flip repetition code: ancilla i measures Z_i Z_{i+1}; logical Z = data qubit 0.

    >>> repetition_layout(distance=3, rounds=2).cx_anc
    (0, 0, 1, 1)
    """
    if distance < 2 or rounds < 1:
        raise ValueError(f"need distance >= 2 and rounds >= 1, got distance={distance}, rounds={rounds}")
    cd, ca = [], []
    for i in range(distance - 1):
        cd += [i, i + 1]
        ca += [i, i]
    return MemoryLayout(f"repetition d={distance} r={rounds}", distance, distance - 1, (), tuple(cd), tuple(ca),
                        (0,) * len(cd), (0,), rounds)


def surface_layout(*, distance: int, rounds: int) -> MemoryLayout:
    """Rotated surface code, the qubits and CNOT order of stim's generated
    ``surface_code:rotated_memory_z`` circuit (one round of it)."""
    import stim

    if distance < 2 or rounds < 1:
        raise ValueError(f"need distance >= 2 and rounds >= 1, got distance={distance}, rounds={rounds}")
    flat = stim.Circuit.generated("surface_code:rotated_memory_z", distance=distance, rounds=2).flattened()
    final = [inst for inst in flat if inst.name == "M"][-1]  # the data readout
    data = [t.value for t in final.targets_copy()]
    h_q: set[int] = set()
    cx: list[tuple[int, int]] = []
    anc: list[int] = []
    for inst in flat:  # the first round: H, CX layers, then MR of the ancillas
        if inst.name == "H":
            h_q.update(t.value for t in inst.targets_copy())
        elif inst.name == "CX":
            ts = [t.value for t in inst.targets_copy()]
            cx += list(zip(ts[0::2], ts[1::2]))
        elif inst.name == "MR":
            anc = [t.value for t in inst.targets_copy()]
            break
    a_idx = {q: i for i, q in enumerate(anc)}
    d_idx = {q: i for i, q in enumerate(data)}
    cd, ca, ctrl = [], [], []
    for c0, c1 in cx:
        anc_ctl = c0 in a_idx
        cd.append(d_idx[c1] if anc_ctl else d_idx[c0])
        ca.append(a_idx[c0] if anc_ctl else a_idx[c1])
        ctrl.append(int(anc_ctl))
    # the observable's record targets count back from the end, where the data readout is last
    first_final = flat.num_measurements - len(data)
    obs = sorted(flat.num_measurements + t.value - first_final
                 for inst in flat if inst.name == "OBSERVABLE_INCLUDE" for t in inst.targets_copy())
    return MemoryLayout(f"surface d={distance} r={rounds}", len(data), len(anc),
                        tuple(sorted(a_idx[q] for q in h_q if q in a_idx)), tuple(cd), tuple(ca), tuple(ctrl),
                        tuple(obs), rounds)


def layout_stim_circuit(layout: MemoryLayout, *, p: float):
    """The stim twin of the kernel: same gates and order, ``DEPOLARIZE2(p)`` after each CNOT,
    detectors (Z ancillas from round 0, X ancillas from round 1, then the data readout
    against the last round's Z ancillas) and the logical observable over the record."""
    import stim

    nd, na, R = layout.num_data, layout.num_anc, layout.rounds
    q_anc = [nd + a for a in range(na)]
    c = stim.Circuit()
    c.append("R", list(range(nd + na)))
    xs = [q_anc[a] for a in layout.x_anc]
    x_set = set(layout.x_anc)
    for r in range(R):
        if xs:
            c.append("H", xs)
        for d, a, actl in zip(layout.cx_data, layout.cx_anc, layout.cx_anc_controls):
            pair = [q_anc[a], d] if actl else [d, q_anc[a]]
            c.append("CX", pair)
            if p > 0:
                c.append("DEPOLARIZE2", pair, p)
        if xs:
            c.append("H", xs)
        c.append("M", q_anc)
        c.append("R", q_anc)
        for a in range(na):
            here = stim.target_rec(-na + a)
            if r == 0:
                if a not in x_set:
                    c.append("DETECTOR", [here])
            else:
                c.append("DETECTOR", [here, stim.target_rec(-2 * na + a)])
    c.append("M", list(range(nd)))
    sup = layout.z_stabilizers()
    for a in range(na):
        if a in x_set:
            continue
        c.append("DETECTOR", [stim.target_rec(-nd - na + a)] + [stim.target_rec(-nd + d) for d in sup[a]])
    c.append("OBSERVABLE_INCLUDE", [stim.target_rec(-nd + d) for d in layout.logical], 0)
    return c


def config_for_layout(layout: MemoryLayout, *, p: float, decoder_type: str = "pymatching", decoder_id: int = 0,
                      custom_args=None) -> dict:
    """The ``multi_decoder_config`` of one decoder for this experiment (measurement-level ``D_sparse``)."""
    from .cudaq_config import multi_decoder_config_from_circuit

    return multi_decoder_config_from_circuit(layout_stim_circuit(layout, p=p), id=decoder_id, type=decoder_type,
                                             custom_args=custom_args)


@dataclass(frozen=True)
class RealtimeRun:
    """One kernel launch: per shot the measurement record and CUDA-Q's correction, and the wall time."""

    measurements: np.ndarray  # (num_shots, num_measurements) uint8
    corrections: np.ndarray  # (num_shots, 1) uint8 (zeros when decode=False)
    wall_s: float
    num_shots: int
    decoded: bool


_KERNELS: dict = {}


def _kernel():
    """The generic memory kernel (built once per process)."""
    if "memory" in _KERNELS:
        return _KERNELS["memory"]
    try:
        import cudaq
        import cudaq_qec
    except ImportError as exc:
        raise missing("cudaq-qec-cu12", extra="quantum", feature="CUDA-Q realtime decoding") from exc
    # CUDA-Q's kernel compiler resolves calls through the module's globals
    globals()["cudaq_qec"] = cudaq_qec

    @cudaq.kernel
    def realtime_memory(nd: int, na: int, xa: list[int], cd: list[int], ca: list[int], cc: list[int],
                        rounds: int, shots: int, decode: bool, decoder_id: int) -> list[bool]:
        width = rounds * na + nd + 1
        out = [False for _ in range(shots * width)]
        data = cudaq.qvector(nd)
        anc = cudaq.qvector(na)
        k = 0
        for s in range(shots):
            if decode:
                cudaq_qec.qec.reset_decoder(decoder_id)
            for r in range(rounds):
                for a in xa:
                    h(anc[a])  # noqa: F821 - CUDA-Q kernel builtins
                for j in range(len(cd)):
                    if cc[j] == 1:
                        x.ctrl(anc[ca[j]], data[cd[j]])  # noqa: F821
                    else:
                        x.ctrl(data[cd[j]], anc[ca[j]])  # noqa: F821
                for a in xa:
                    h(anc[a])  # noqa: F821
                m = mz(anc)  # noqa: F821
                if decode:
                    cudaq_qec.qec.enqueue_syndromes(decoder_id, m, 0)
                for i in range(na):
                    out[k] = m[i]
                    k += 1
                reset(anc)  # noqa: F821
            f = mz(data)  # noqa: F821
            for i in range(nd):
                out[k] = f[i]
                k += 1
            if decode:
                cudaq_qec.qec.enqueue_syndromes(decoder_id, f, 0)
                corr = cudaq_qec.qec.get_corrections(decoder_id, 1, False)
                out[k] = corr[0]
            k += 1
            reset(data)  # noqa: F821

        return out

    _KERNELS["memory"] = realtime_memory
    return realtime_memory


def run_cudaq_realtime(layout: MemoryLayout, *, p: float, num_shots: int, config=None, decoder_id: int = 0,
                       decode: bool = True, seed: int | None = None) -> RealtimeRun:
    """Launch the kernel once for ``num_shots`` shots on CUDA-Q's ``stim`` target.

    ``config``: a ``multi_decoder_config`` path (or text / mapping) configuring CUDA-Q's
    realtime decoders before the launch (and finalized after); None with ``decode=True``
    uses :func:`config_for_layout`. ``decode=False`` runs the same circuit without the
    realtime calls (the simulation floor).
    """
    try:
        import cudaq
        import cudaq_qec
    except ImportError as exc:
        raise missing("cudaq-qec-cu12", extra="quantum", feature="CUDA-Q realtime decoding") from exc
    from .cudaq_config import config_file, dump_multi_decoder_config, load_multi_decoder_config

    if num_shots < 1:
        raise ValueError(f"num_shots must be >= 1, got {num_shots}")
    if cudaq.get_target().name != "stim":
        cudaq.set_target("stim")
    if seed is not None:
        cudaq.set_random_seed(int(seed))
    noise = cudaq.NoiseModel()
    if p > 0:
        noise.add_all_qubit_channel("x", cudaq.Depolarization2(float(p)), 1)
    kernel = _kernel()
    configured = False
    if decode:
        if config is None:
            config = config_for_layout(layout, p=p, decoder_id=decoder_id)
        path = config_file(config)
        if path is not None:
            load_multi_decoder_config(path)  # checked by qlink too, so both sides refuse the same files
            status = cudaq_qec.configure_decoders_from_file(str(path))
        else:
            status = cudaq_qec.configure_decoders_from_str(dump_multi_decoder_config(load_multi_decoder_config(config)))
        if status != 0:
            raise RuntimeError(f"CUDA-Q refused the decoder configuration (status {status})")
        configured = True
    try:
        t0 = time.perf_counter()
        res = cudaq.run(kernel, layout.num_data, layout.num_anc, list(layout.x_anc), list(layout.cx_data),
                        list(layout.cx_anc), list(layout.cx_anc_controls), layout.rounds, int(num_shots),
                        bool(decode), int(decoder_id), shots_count=1, noise_model=noise)
        wall = time.perf_counter() - t0
    finally:
        if configured:
            cudaq_qec.finalize_decoders()
    width = layout.num_measurements + 1
    arr = np.asarray(res[0], dtype=np.uint8)
    if arr.size != num_shots * width:
        raise RuntimeError(f"the kernel returned {arr.size} bits, expected {num_shots} x {width}")
    arr = arr.reshape(num_shots, width)
    return RealtimeRun(measurements=np.ascontiguousarray(arr[:, :-1]), corrections=arr[:, -1:].copy(),
                       wall_s=wall, num_shots=int(num_shots), decoded=bool(decode))
