"""tesseract, chromobius and fusion-blossom in qlink's registry: each agrees bit for bit with
its own library called directly, and each runs as a sinter custom decoder."""

from __future__ import annotations

import numpy as np
import pytest
import stim

from qlink.qec.decoders import BUILT_IN_DECODERS, compile_decoder, sinter_decoders
from qlink.qec.decoders._chromobius import steane_color_code_circuit


def _surface(p=0.004):
    return stim.Circuit.generated("surface_code:rotated_memory_z", distance=3, rounds=3,
                                  after_clifford_depolarization=p, before_measure_flip_probability=p)


def _need(name):
    reason = BUILT_IN_DECODERS[name].unavailable_reason()
    if reason:
        pytest.skip(reason)


def _shots(circuit, n=500, seed=4):
    dets, obs = circuit.compile_detector_sampler(seed=seed).sample(n, separate_observables=True)
    return dets, obs, np.packbits(dets, axis=1, bitorder="little")


def test_tesseract_agrees_with_its_direct_call():
    _need("tesseract")
    from tesseract_decoder import tesseract

    c = _surface()
    dem = c.detector_error_model(decompose_errors=True)
    dets, obs, _ = _shots(c)
    ours = compile_decoder("tesseract", dem).decode_batch(dets)
    direct = tesseract.TesseractDecoder(tesseract.TesseractConfig(dem)).decode_batch(dets)
    assert np.array_equal(ours, np.asarray(direct, np.uint8))
    assert (ours != obs).mean() < 0.1


def test_chromobius_agrees_with_its_direct_call_and_needs_colour_coordinates():
    _need("chromobius")
    import chromobius

    c = steane_color_code_circuit(rounds=3, p=0.002)
    dem = c.detector_error_model()
    dets, obs, packed = _shots(c, n=2000)
    ours = compile_decoder("chromobius", dem).decode_shots_bit_packed(packed)
    direct = chromobius.compile_decoder_for_dem(dem).predict_obs_flips_from_dets_bit_packed(packed)
    assert np.array_equal(ours, direct)
    pred = np.unpackbits(ours, axis=1, count=1, bitorder="little")
    assert (pred != obs).sum() < 0.5 * obs.sum()
    with pytest.raises(ValueError, match="4th coordinate"):
        compile_decoder("chromobius", _surface().detector_error_model(decompose_errors=True))


def test_fusion_blossom_agrees_with_sinters_wrapper_and_with_matching_on_most_shots():
    _need("fusion-blossom")
    import sinter

    c = _surface()
    dem = c.detector_error_model(decompose_errors=True)
    dets, obs, packed = _shots(c)
    ours = compile_decoder("fusion-blossom", dem).decode_shots_bit_packed(packed)
    direct = sinter.BUILT_IN_DECODERS["fusion_blossom"].compile_decoder_for_dem(dem=dem).decode_shots_bit_packed(
        bit_packed_detection_event_data=packed)
    assert np.array_equal(ours, direct)
    matching = compile_decoder("pymatching", dem).decode_shots_bit_packed(packed)
    assert (ours != matching).mean() < 0.02  # both minimum-weight matching: ties and rounding apart


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_new_decoders_run_as_sinter_custom_decoders():
    import sinter

    names = [n for n in ("tesseract", "fusion-blossom") if BUILT_IN_DECODERS[n].unavailable_reason() is None]
    if not names:
        pytest.skip("neither tesseract-decoder nor fusion-blossom is installed")
    task = sinter.Task(circuit=_surface(p=0.006), json_metadata={"d": 3})
    stats = sinter.collect(num_workers=1, tasks=[task], decoders=names, max_shots=300,
                           custom_decoders=sinter_decoders())
    assert sorted(s.decoder for s in stats) == sorted(names)
    assert all(s.shots == 300 and 0 <= s.errors < 60 for s in stats)
