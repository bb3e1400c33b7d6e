"""One suite over every registered decoder, plus per-backend checks, the DEM helpers and
the sliding-window decoder."""

from __future__ import annotations

import math

import numpy as np
import pytest
import stim

from qlink.errors import QlinkError
from qlink.qec.decoders import (
    BUILT_IN_DECODERS,
    DecoderUnavailableError,
    SlidingWindowDecoder,
    compile_decoder,
    dem_to_graph,
    dem_to_matrices,
    get_decoder,
    offline_throughput,
)
from qlink.qec.decoders._bp import cupy_or_none
from qlink.qec.sources import StimSource

ALL_DECODERS = sorted(BUILT_IN_DECODERS)


def _wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def _two_proportion_z(k1: int, n1: int, k2: int, n2: int) -> float:
    pooled = (k1 + k2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    return (k1 / n1 - k2 / n2) / se if se > 0 else 0.0


_SOURCE = StimSource.surface_code(distance=3, rounds=3, p=0.003)
_BATCH = _SOURCE.sample(400, seed=2024)
_COMPILED: dict[str, object] = {}
# decoders that need a code of their own: chromobius decodes colour codes (4th detector coordinate)
_SOURCES: dict[str, object] = {}


def _src(name: str):
    if name != "chromobius":
        return _SOURCE
    if name not in _SOURCES:
        from qlink.qec.decoders._chromobius import steane_color_code_circuit

        c = steane_color_code_circuit(rounds=3, p=0.003)
        rounds = [int(v[2]) for _, v in sorted(c.get_detector_coordinates().items())]
        _SOURCES[name] = StimSource(c, detector_rounds=rounds)
    return _SOURCES[name]


def _batch(name: str):
    return _BATCH if _src(name) is _SOURCE else _src(name).sample(400, seed=2024)


def _compiled(name: str):
    reason = BUILT_IN_DECODERS[name].unavailable_reason()
    if reason:
        pytest.skip(f"{name}: {reason}")
    if name not in _COMPILED:
        _COMPILED[name] = compile_decoder(name, _src(name).detector_error_model())
    return _COMPILED[name]


# -- the suite every decoder passes -----------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ALL_DECODERS)
def test_shapes_and_widths(name):
    dec = _compiled(name)
    assert dec.num_detectors == _src(name).num_detectors and dec.num_observables == 1
    pred = dec.decode_batch(_batch(name).detection_events)
    assert pred.shape == (_batch(name).num_shots, 1) and pred.dtype == np.uint8
    assert set(np.unique(pred).tolist()) <= {0, 1}
    assert dec.decode_batch(np.zeros((0, dec.num_detectors), np.uint8)).shape == (0, 1)
    assert dec.decode(np.zeros(dec.num_detectors, np.uint8)).tolist() == [0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ALL_DECODERS)
def test_decode_and_decode_batch_agree(name):
    dec = _compiled(name)
    dets = _batch(name).detection_events[:60]
    batch = dec.decode_batch(dets)
    single = np.array([dec.decode(row) for row in dets])
    assert (batch == single).all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ALL_DECODERS)
def test_bit_packed_and_unpacked_agree(name):
    dec = _compiled(name)
    dets = _batch(name).detection_events
    packed = np.packbits(dets, axis=1, bitorder="little")
    plain = dec.decode_batch(dets)
    assert (dec.decode_batch(packed, bit_packed=True) == plain).all()
    out = dec.decode_shots_bit_packed(packed)
    assert out.shape == (len(dets), 1) and out.dtype == np.uint8
    assert (np.unpackbits(out, axis=1, count=1, bitorder="little") == plain).all()
    # sinter's spelling, so the decoder also plugs into sinter.collect(custom_decoders=...)
    via_sinter = BUILT_IN_DECODERS[name].compile_decoder_for_dem(dem=_src(name).detector_error_model())
    assert (via_sinter.decode_shots_bit_packed(bit_packed_detection_event_data=packed) == out).all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ALL_DECODERS)
def test_deterministic(name):
    dec = _compiled(name)
    first = dec.decode_batch(_batch(name).detection_events)
    again = dec.decode_batch(_batch(name).detection_events)
    fresh = compile_decoder(name, _src(name).detector_error_model()).decode_batch(_batch(name).detection_events)
    assert (first == again).all() and (first == fresh).all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ALL_DECODERS)
def test_wrong_width_is_a_value_error(name):
    dec = _compiled(name)
    nd = dec.num_detectors
    with pytest.raises(ValueError, match=f"expected {nd} detectors per shot.*got {nd - 1}"):
        dec.decode_batch(np.zeros((2, nd - 1), np.uint8))
    with pytest.raises(ValueError, match=f"expected {nd} detectors"):
        dec.decode(np.zeros(nd + 1, np.uint8))
    with pytest.raises(ValueError, match="bit-packed bytes"):
        dec.decode_shots_bit_packed(np.zeros((2, (nd + 7) // 8 + 1), np.uint8))
    with pytest.raises(ValueError, match="1-D"):
        dec.decode(np.zeros((1, nd), np.uint8))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ALL_DECODERS)
def test_corrects_most_logical_flips(name):
    """At d=3, p=0.003 a decoder must remove most of the raw observable flips (doing
    nothing leaves all of them; the single-error LUT, which only knows single faults,
    leaves about a third, matching about a tenth)."""
    dec = _compiled(name)
    batch = _src(name).sample(3000, seed=7)
    raw = int(batch.observable_flips.sum())
    left = int(np.count_nonzero(dec.decode_batch(batch.detection_events) != batch.observable_flips))
    assert raw > 50
    assert left < 0.5 * raw, (left, raw)


# -- registry ---------------------------------------------------------------------------

def test_registry_names_and_unknown_name():
    assert {"pymatching", "cudaq-single_error_lut", "cudaq-multi_error_lut", "cudaq-nv-qldpc-decoder",
            "bposd", "qlink-bp"} <= set(BUILT_IN_DECODERS)
    assert all(d.name == n for n, d in BUILT_IN_DECODERS.items())
    with pytest.raises(ValueError, match="unknown decoder 'blossom'.*pymatching.*qlink-bp"):
        get_decoder("blossom")


def test_offline_throughput_counts_shots_per_second():
    dec = compile_decoder("pymatching", _SOURCE.detector_error_model())
    rate = offline_throughput(dec, _BATCH.bit_packed_detection_events(), repeat=2)
    assert rate > 0 and math.isfinite(rate)
    with pytest.raises(ValueError):
        offline_throughput(dec, np.zeros((0, 3), np.uint8))


# -- backends ------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_pymatching_logical_error_rate_falls_with_distance():
    """p=0.001 circuit noise, rounds=d: 95% Wilson intervals of d=3, 5, 7 are disjoint and ordered."""
    intervals = []
    for d, n in ((3, 100_000), (5, 200_000), (7, 400_000)):
        src = StimSource.surface_code(distance=d, rounds=d, p=0.001)
        dets, obs = src.sample_bit_packed(n, seed=d)
        pred = compile_decoder("pymatching", src.detector_error_model()).decode_shots_bit_packed(dets)
        k = int(np.count_nonzero(pred != obs))
        intervals.append(_wilson(k, n))
    (lo3, hi3), (lo5, hi5), (lo7, hi7) = intervals
    assert hi5 < lo3 and hi7 < lo5, intervals


@pytest.mark.timeout(120)
@pytest.mark.parametrize("distance", [3, 5])
def test_qlink_bp_logical_error_rate_is_sane(distance):
    """BP alone is not matching, but at p=0.001 its per-round logical error rate must be
    well below the physical rate (seen: about p/3 per round at d=3 and d=5)."""
    p, n = 0.001, 20_000
    src = StimSource.surface_code(distance=distance, rounds=distance, p=p)
    batch = src.sample(n, seed=99)
    dec = compile_decoder("qlink-bp", src.detector_error_model(), device="cpu")
    k = int(np.count_nonzero(np.any(dec.decode_batch(batch.detection_events) != batch.observable_flips, axis=1)))
    raw = int(batch.observable_flips.sum())
    assert k / n < 0.75 * p * distance, (k, n)
    assert k < 0.1 * raw, (k, raw)


def _reference_min_sum(h: np.ndarray, priors: np.ndarray, syndrome: np.ndarray, *, alpha: float,
                       max_iter: int) -> np.ndarray:
    """Textbook flooding min-sum, one shot, loops over edges: the check on qlink-bp."""
    nc, nv = h.shape
    llr = np.log((1 - priors) / priors)
    edges = [(c, v) for c in range(nc) for v in range(nv) if h[c, v]]
    q = {e: llr[e[1]] for e in edges}
    e_hat = np.zeros(nv, dtype=np.uint8)
    for _ in range(max_iter):
        r = {}
        for c, v in edges:
            others = [q[(c, u)] for u in range(nv) if h[c, u] and u != v]
            if not others:
                r[(c, v)] = (-1) ** syndrome[c] * 50.0
                continue
            sign = (-1) ** (syndrome[c] + sum(x < 0 for x in others))
            r[(c, v)] = sign * min(alpha * min(abs(x) for x in others), 50.0)
        total = llr.copy()
        for c, v in edges:
            total[v] += r[(c, v)]
        e_hat = (total < 0).astype(np.uint8)
        if np.array_equal(h @ e_hat % 2, syndrome):
            break
        q = {(c, v): total[v] - r[(c, v)] for c, v in edges}
    return e_hat


@pytest.mark.timeout(60)
def test_qlink_bp_matches_a_textbook_reference_on_a_tiny_code():
    rng = np.random.default_rng(5)
    # Distinct random priors so no belief is exactly tied at zero.
    lines = []
    for a, b in [(0, None), (0, 1), (1, 2), (2, None), (0, 3), (1, 4), (2, 5), (3, 4), (4, 5), (3, None), (5, None),
                 (1, 3), (2, 4)]:
        targets = f"D{a}" + (f" D{b}" if b is not None else "") + (" L0" if b is None and a in (2, 5) else "")
        lines.append(f"error({rng.uniform(0.01, 0.2):.6f}) {targets}")
    dem = stim.DetectorErrorModel("\n".join(lines))
    m = dem_to_matrices(dem)
    h, o = m.check_matrix.toarray(), m.observables_matrix.toarray()
    syndromes = np.array([[(i >> k) & 1 for k in range(6)] for i in range(64)], dtype=np.uint8)
    dec = compile_decoder("qlink-bp", dem, device="cpu", dtype="float64", max_iter=12, scaling_factor=0.8)
    got = dec.decode_batch(syndromes)
    want = np.array([o @ _reference_min_sum(h, m.priors, s, alpha=0.8, max_iter=12) % 2 for s in syndromes])
    assert 0 < want.sum() < len(want)  # the example exercises both answers
    assert (got == want).all()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_qlink_bp_cupy_matches_numpy():
    if cupy_or_none() is None:
        pytest.skip("no NVIDIA GPU / CuPy cannot run")
    src = StimSource.surface_code(distance=5, rounds=5, p=0.003)
    batch = src.sample(2000, seed=3)
    dem = src.detector_error_model()
    cpu = compile_decoder("qlink-bp", dem, device="cpu", dtype="float64")
    gpu = compile_decoder("qlink-bp", dem, device="gpu", dtype="float64")
    assert gpu.device == "gpu" and cpu.device == "cpu"
    a, b = cpu.decode_batch(batch.detection_events), gpu.decode_batch(batch.detection_events)
    # Sums may run in a different order on the GPU; a belief exactly at zero could then
    # round differently, so allow a handful of differing shots out of 2000.
    assert np.count_nonzero(np.any(a != b, axis=1)) <= 2


def test_qlink_bp_gpu_request_without_gpu_is_a_typed_error():
    if cupy_or_none() is not None:
        pytest.skip("a GPU is present; the no-GPU error path does not apply")
    with pytest.raises(DecoderUnavailableError, match="GPU"):
        compile_decoder("qlink-bp", _SOURCE.detector_error_model(), device="gpu")
    assert compile_decoder("qlink-bp", _SOURCE.detector_error_model(), device="auto").device == "cpu"
    with pytest.raises(ValueError, match="device"):
        compile_decoder("qlink-bp", _SOURCE.detector_error_model(), device="tpu")


def test_nv_qldpc_without_gpu_is_a_typed_error():
    dec = BUILT_IN_DECODERS["cudaq-nv-qldpc-decoder"]
    reason = dec.unavailable_reason()
    if reason is None:
        pytest.skip("a GPU is present: nv-qldpc-decoder runs, covered by the suite")
    if "cudaq-qec" in reason:
        pytest.skip(reason)
    assert "GPU" in reason
    with pytest.raises(DecoderUnavailableError, match="GPU") as info:
        dec.compile_for_dem(_SOURCE.detector_error_model())
    assert isinstance(info.value, QlinkError)


# -- DEM helpers -------------------------------------------------------------------------------

def test_dem_matrices_xor_decompositions_and_merge_duplicates():
    dem = stim.DetectorErrorModel("""
        error(0.1) D0 D1 ^ D1 D2 L0
        error(0.1) D0 D2 L0
        error(0.3) L0
        error(0.2) D3
        error(0.2) D3
        detector D4
    """)
    m = dem_to_matrices(dem)
    assert m.num_detectors == 5 and m.num_observables == 1 and m.num_errors == 2
    cols = {tuple(np.flatnonzero(m.check_matrix[:, j].toarray())): j for j in range(m.num_errors)}
    j02, j3 = cols[(0, 2)], cols[(3,)]
    assert m.observables_matrix[0, j02] == 1 and m.observables_matrix[0, j3] == 0
    assert m.priors[j02] == pytest.approx(0.1 * 0.9 * 2) and m.priors[j3] == pytest.approx(0.2 * 0.8 * 2)
    split = dem_to_matrices(dem, split_components=True)
    assert split.num_errors == 4  # D0D1, D1D2L0, D0D2L0, D3


def test_dem_graph_rejects_hyperedges():
    with pytest.raises(ValueError, match="decompose_errors=True"):
        dem_to_graph(stim.DetectorErrorModel("error(0.1) D0 D1 D2"))
    g = dem_to_graph(stim.DetectorErrorModel("error(0.1) D0 D1 ^ D2\nerror(0.2) D2 L1"))
    assert g.endpoints.tolist() == [[0, 1], [2, -1]]
    assert g.observable_masks.tolist() == [0, 2]  # the likelier D2 edge labels the merged edge
    assert g.probabilities[1] == pytest.approx(0.1 * 0.8 + 0.2 * 0.9)


# -- sliding window ---------------------------------------------------------------------------------

def _window(src: StimSource, *, window_rounds: int, commit_rounds: int) -> SlidingWindowDecoder:
    return SlidingWindowDecoder(src.detector_error_model(), detector_rounds=src.detector_rounds,
                                window_rounds=window_rounds, commit_rounds=commit_rounds)


@pytest.mark.timeout(120)
def test_sliding_window_matches_whole_history_logical_error_rate():
    src = StimSource.surface_code(distance=3, rounds=24, p=0.004)
    n = 12_000
    batch = src.sample(n, seed=31)
    win = _window(src, window_rounds=6, commit_rounds=3)
    p_win = win.decode_batch(batch.detection_events)
    p_all = win.whole_history_decoder().decode_batch(batch.detection_events)
    k_win = int(np.count_nonzero(np.any(p_win != batch.observable_flips, axis=1)))
    k_all = int(np.count_nonzero(np.any(p_all != batch.observable_flips, axis=1)))
    assert k_all > 300  # errors occur (LER ~ 0.08)
    z = _two_proportion_z(k_win, n, k_all, n)
    assert abs(z) < 4, (k_win, k_all, z)
    # Shot by shot the two decoders almost always agree.
    assert np.count_nonzero(np.any(p_win != p_all, axis=1)) < 0.01 * n


@pytest.mark.timeout(60)
def test_sliding_window_work_per_round_does_not_grow_with_rounds():
    stats = []
    for rounds in (12, 48):
        src = StimSource.surface_code(distance=3, rounds=rounds, p=0.004)
        win = _window(src, window_rounds=6, commit_rounds=3)
        win.decode_batch(src.sample(50, seed=1).detection_events)
        stats.append(win.statistics())
    short, long = stats
    assert long.num_windows_decoded > 3 * short.num_windows_decoded - 3
    assert long.max_window_detectors == short.max_window_detectors <= 6 * 8
    assert long.max_window_edges == short.max_window_edges
    assert long.num_compiled_windows == short.num_compiled_windows <= 4


@pytest.mark.timeout(60)
def test_sliding_window_streams_round_by_round():
    src = StimSource.surface_code(distance=3, rounds=10, p=0.01)
    batch = src.sample(200, seed=8)
    win = _window(src, window_rounds=4, commit_rounds=2)
    total = np.zeros((200, 1), np.uint8)
    emitted_before_end = 0
    for r, events in src.iter_rounds(batch.detection_events):
        out = win.push_round(events)
        assert out.shape == (200, 1)
        if r < src.num_rounds - 1:
            emitted_before_end += int(out.sum())
        total ^= out
    assert win.done
    assert (total == win.decode_batch(batch.detection_events)).all()
    assert emitted_before_end > 0  # corrections are committed while the experiment runs
    # one shot, 1-D rounds
    win.reset()
    one = np.zeros(1, np.uint8)
    for r, events in src.iter_rounds(batch.detection_events[0]):
        one ^= win.push_round(events)
    assert one.tolist() == total[0].tolist()
    with pytest.raises(ValueError, match="already pushed"):
        win.push_round(np.zeros(4, np.uint8))
    win.reset()
    with pytest.raises(ValueError, match="round 0 has 4 detectors"):
        win.push_round(np.zeros((3, 5), np.uint8))


def test_sliding_window_single_window_equals_whole_history():
    src = StimSource.surface_code(distance=3, rounds=4, p=0.01)
    batch = src.sample(500, seed=9)
    win = _window(src, window_rounds=10, commit_rounds=10)
    a = win.decode_batch(batch.detection_events)
    b = win.whole_history_decoder().decode_batch(batch.detection_events)
    assert np.count_nonzero(a != b) <= 5  # same graph; only equal-weight ties may differ


def test_sliding_window_bad_arguments():
    src = StimSource.surface_code(distance=3, rounds=4, p=0.01)
    dem = src.detector_error_model()
    with pytest.raises(ValueError, match="commit_rounds"):
        SlidingWindowDecoder(dem, detector_rounds=src.detector_rounds, window_rounds=2, commit_rounds=3)
    with pytest.raises(ValueError, match="non-decreasing"):
        SlidingWindowDecoder(dem, detector_rounds=src.detector_rounds[::-1], window_rounds=2, commit_rounds=1)
    with pytest.raises(ValueError, match="one entry per detector"):
        SlidingWindowDecoder(dem, detector_rounds=[0], window_rounds=2, commit_rounds=1)


def test_folded_dem_index_equals_the_flattened_dem():
    """stim folds long experiments into repeat blocks; the folded edge index must give
    exactly the edges of the flattened DEM, in every detector range."""
    from qlink.qec.decoders._dem_graph import DemEdgeIndex

    circuit = stim.Circuit.generated("surface_code:rotated_memory_z", distance=3, rounds=60,
                                     after_clifford_depolarization=0.003, before_measure_flip_probability=0.002)
    dem = circuit.detector_error_model(decompose_errors=True)
    assert any(isinstance(inst, stim.DemRepeatBlock) for inst in dem)
    folded, flat = dem_to_graph(dem), dem_to_graph(dem.flattened())
    assert (folded.endpoints == flat.endpoints).all()
    assert (folded.observable_masks == flat.observable_masks).all()
    assert np.allclose(folded.probabilities, flat.probabilities, rtol=1e-9)
    index = DemEdgeIndex(dem)
    for lo, hi in [(0, 7), (100, 140), (233, 481), (470, dem.num_detectors)]:
        a, b, _, _ = index.edges_in_range(lo, hi)
        sel = (flat.endpoints[:, 0] >= lo) & (flat.endpoints[:, 0] < hi)
        assert (np.stack([a, b], axis=1) == flat.endpoints[sel]).all()
