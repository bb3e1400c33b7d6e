"""The lean paths of measurement-level decoding: one shot as a Python int straight to PyMatching's
graph, a batch as whole-row gathers; each bit-exact against the detector-level decoder."""

from __future__ import annotations

import numpy as np
import pytest
import stim

from qlink.qec.cudaq_config import stim_measurement_matrices
from qlink.qec.decoders import MeasurementDecoder, compile_decoder


def _circuit(d=5, p=0.01):
    return stim.Circuit.generated("surface_code:rotated_memory_z", distance=d, rounds=d,
                                  after_clifford_depolarization=p, before_measure_flip_probability=p)


def test_one_shot_through_the_matching_graph_equals_pymatchings_batch_call():
    import pymatching

    c = _circuit()
    dem = c.detector_error_model(decompose_errors=True)
    compiled = compile_decoder("pymatching", dem)
    dets = c.compile_detector_sampler(seed=2).sample(1500).astype(np.uint8)
    packed = np.packbits(dets, axis=1, bitorder="little")
    want = np.packbits(pymatching.Matching.from_detector_error_model(dem).decode_batch(dets), axis=1,
                       bitorder="little")
    assert want.any()
    got = np.concatenate([compiled.decode_shots_bit_packed(packed[i:i + 1]) for i in range(len(packed))])
    assert np.array_equal(got, want)
    one = compiled.decode_shots_bit_packed(packed[:1])
    assert not one.flags.writeable  # a shared answer row: read-only, never changed under a caller
    with pytest.raises(ValueError):
        one[0, 0] = 1


@pytest.mark.parametrize("inner_name", ["pymatching", "fusion-blossom"])
@pytest.mark.parametrize("max_table_nbytes", [16 << 20, 0])
def test_every_batch_size_is_bit_exact_and_padding_bits_are_ignored(inner_name, max_table_nbytes):
    c = _circuit(d=5 if inner_name == "pymatching" else 3)
    m2d, _ = stim_measurement_matrices(c)
    inner = compile_decoder(inner_name, c.detector_error_model(decompose_errors=True))
    wrap = MeasurementDecoder(inner, m2d, max_table_nbytes=max_table_nbytes)
    meas = c.compile_sampler(seed=4).sample(700)
    dets = c.compile_m2d_converter().convert(measurements=meas, separate_observables=False)
    packed_m = np.packbits(meas, axis=1, bitorder="little")
    packed_d = np.packbits(dets, axis=1, bitorder="little")
    assert meas.shape[1] % 8, "the record must end in a partial byte for this test"
    packed_m[:, -1] |= np.uint8((0xFF << (meas.shape[1] % 8)) & 0xFF)  # set every padding bit
    want = inner.decode_shots_bit_packed(packed_d)
    assert want.any()
    for k in (1, 2, 4, 5, 64, 700):
        got = np.concatenate([wrap.decode_shots_bit_packed(packed_m[i:i + k]) for i in range(0, 700, k)])
        assert np.array_equal(got, want), k
        mapped = np.concatenate([wrap.detectors_bit_packed(packed_m[i:i + k]) for i in range(0, 700, k)])
        assert np.array_equal(mapped, packed_d), k


def test_a_large_batch_is_cut_into_chunks_and_stays_exact():
    c = _circuit(d=3)
    m2d, _ = stim_measurement_matrices(c)
    wrap = MeasurementDecoder(compile_decoder("pymatching", c.detector_error_model(decompose_errors=True)), m2d)
    wrap._chunk_shots = 7  # several chunks, the last one short
    meas = c.compile_sampler(seed=6).sample(100)
    dets = c.compile_m2d_converter().convert(measurements=meas, separate_observables=False)
    assert np.array_equal(wrap.detectors_bit_packed(np.packbits(meas, axis=1, bitorder="little")),
                          np.packbits(dets, axis=1, bitorder="little"))


def test_single_shot_decoder_maps_measurements_in_the_call_and_matches_the_measurement_decoder():
    """The native core's single-shot form of a measurement-level decoder carries its byte table
    and calls the inner matching graph: the same flips as the decoder's own call, shot by shot."""
    from qlink.qec.hotpath import single_shot_decoder

    circuit = stim.Circuit.generated("surface_code:rotated_memory_x", distance=3, rounds=4,
                                     after_clifford_depolarization=0.01, before_measure_flip_probability=0.01)
    dem = circuit.detector_error_model(decompose_errors=True)
    m2d, _ = stim_measurement_matrices(circuit)
    dec = MeasurementDecoder(compile_decoder("pymatching", dem), m2d)
    one = single_shot_decoder(dec, None, num_detectors=dec.num_detectors, num_observables=dec.num_observables)
    assert one.kind == "fired" and one.measurement_map is not None and one.measurement_map[1] == dem.num_detectors
    meas = circuit.compile_sampler(seed=5).sample(200)
    packed = np.packbits(meas, axis=1, bitorder="little")
    want = np.unpackbits(dec.decode_shots_bit_packed(packed), axis=1, count=dec.num_observables, bitorder="little")
    got = np.array([one.decode_one(m) for m in meas.astype(np.uint8)])
    np.testing.assert_array_equal(got, want)
    assert want.any()  # some shots flip the observable: the comparison can fail
