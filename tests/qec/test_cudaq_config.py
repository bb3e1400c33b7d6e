"""CUDA-Q QEC's multi_decoder_config: written by qlink, read back unchanged, checked field by field,
and served through qlink's decoders on measurement records."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import stim

from qlink.qec.cudaq_config import (
    CUDAQ_DECODER_TYPES,
    CudaqConfigError,
    compile_cudaq_entry,
    decoder_configs_from_cudaq,
    dump_multi_decoder_config,
    load_multi_decoder_config,
    multi_decoder_config_from_circuit,
    multi_decoder_config_from_source,
    rows_to_sparse,
    stim_measurement_matrices,
    validate_multi_decoder_config,
)
from qlink.qec.decoders import MeasurementDecoder, compile_decoder


def _surface(d=3, p=0.004):
    return stim.Circuit.generated("surface_code:rotated_memory_z", distance=d, rounds=d,
                                  after_clifford_depolarization=p, after_reset_flip_probability=p,
                                  before_measure_flip_probability=p, before_round_data_depolarization=p)


def _tiny(**over):
    entry = {"id": 0, "type": "pymatching", "block_size": 3, "syndrome_size": 2,
             "H_sparse": [0, 1, -1, 1, 2, -1], "O_sparse": [0, -1], "D_sparse": [0, 1, -1, 1, 2, -1],
             "decoder_custom_args": {"error_rate_vec": [0.1, 0.1, 0.1], "merge_strategy": "smallest_weight"}}
    entry.update(over)
    return {"decoders": [entry]}


# ---------------------------------------------------------------------------- written by qlink
@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_written_config_round_trips_unchanged(tmp_path, fmt):
    doc = multi_decoder_config_from_circuit(_surface())
    path = tmp_path / f"cfg.{fmt}"
    text = dump_multi_decoder_config(doc, path)
    first = load_multi_decoder_config(path)
    assert first == doc
    again = dump_multi_decoder_config(first, format=fmt)
    assert again == text
    assert load_multi_decoder_config(again) == first


def test_written_config_validates_against_cudaq_schema_and_configures_cudaq():
    cudaq_qec = pytest.importorskip("cudaq_qec")
    jsonschema = pytest.importorskip("jsonschema")
    doc = multi_decoder_config_from_circuit(_surface(), id=5)
    doc["decoders"].append(multi_decoder_config_from_circuit(_surface(), id=6, type="multi_error_lut",
                                                             custom_args={"lut_error_depth": 1})["decoders"][0])
    schema = json.loads(cudaq_qec.decoder_config_json_schema())
    jsonschema.Draft202012Validator(schema).validate(doc)
    validate_multi_decoder_config(doc, use_cudaq_schema=True)
    text = dump_multi_decoder_config(doc)
    # CUDA-Q's own parser reads it back to the same document
    parsed = cudaq_qec.multi_decoder_config.from_yaml_str(text)
    assert [d.id for d in parsed.decoders] == [5, 6]
    assert list(parsed.decoders[0].H_sparse) == doc["decoders"][0]["H_sparse"]
    assert list(parsed.decoders[0].D_sparse) == doc["decoders"][0]["D_sparse"]
    # CUDA-Q writes error rates with 6 significant digits; everything else comes back as written
    theirs, ours = load_multi_decoder_config(parsed.to_yaml_str()), load_multi_decoder_config(text)
    for a, b in zip(theirs["decoders"], ours["decoders"]):
        ra = a.get("decoder_custom_args", {}).pop("error_rate_vec", None)
        rb = b.get("decoder_custom_args", {}).pop("error_rate_vec", None)
        assert (ra is None) == (rb is None)
        if ra is not None:
            np.testing.assert_allclose(ra, rb, rtol=1e-5)
        assert a == b


def test_sparse_form_matches_cudaq_helpers():
    cudaq_qec = pytest.importorskip("cudaq_qec")
    rng = np.random.default_rng(3)
    m = (rng.random((7, 11)) < 0.3).astype(np.uint8)
    rows = [np.flatnonzero(r).tolist() for r in m]
    assert rows_to_sparse(rows) == list(cudaq_qec.pcm_to_sparse_vec(m))
    assert rows_to_sparse(rows) == list(cudaq_qec.d_sparse(rows))


def test_measurement_matrices_reproduce_stim_detectors():
    c = _surface(d=3)
    m2d, m2o = stim_measurement_matrices(c)
    meas = c.compile_sampler(seed=11).sample(400).astype(np.int64)
    dets, obs = c.compile_m2d_converter().convert(measurements=meas.astype(bool), separate_observables=True)
    assert np.array_equal((m2d @ meas.T).T & 1, dets)
    assert np.array_equal((m2o @ meas.T).T & 1, obs)


# ---------------------------------------------------------------------------- hand-written configs
def test_hand_written_fields_load(tmp_path):
    dem_path = tmp_path / "model.dem"
    stim.DetectorErrorModel("error(0.1) D0 L0\nerror(0.1) D0 D1\nerror(0.1) D1").to_file(dem_path)
    text = f"""
decoders:
  - id: 0
    type: pymatching
    block_size: 3
    syndrome_size: 2
    H_sparse: [0, 1, -1, 1, 2, -1]
    O_sparse: [0, -1]
    D_sparse: [0, 1, -1, 1, 2, -1]
    decoder_custom_args:
      error_rate_vec: [0.1, 0.1, 0.1]
      merge_strategy: smallest_weight
  - id: 1
    type: multi_error_lut
    block_size: 3
    syndrome_size: 2
    H_sparse: [0, 1, -1, 1, 2, -1]
    O_sparse: [0, -1]
    D_sparse: [0, -1, 1, -1]
    decoder_custom_args: {{lut_error_depth: 2}}
  - id: 2
    type: pymatching
    stim_dem_path: {dem_path.name}
    D_sparse: [0, -1, 1, -1]
    dispatch: host
  - id: 3
    type: sliding_window
    block_size: 3
    syndrome_size: 2
    H_sparse: [0, 1, -1, 1, 2, -1]
    O_sparse: [0, -1]
    D_sparse: [0, -1, 1, -1]
    decoder_custom_args: {{error_rate_vec: [0.1, 0.1, 0.1], inner_decoder_name: pymatching,
                          window_size: 2, step_size: 1, num_syndromes_per_round: 1}}
transport:
  provider: simulation
"""
    path = tmp_path / "hand.yaml"
    path.write_text(text)
    doc = load_multi_decoder_config(path)
    assert [d["id"] for d in doc["decoders"]] == [0, 1, 2, 3]
    if "cudaq-multi_error_lut" not in _available():  # serve the rest without CUDA-Q's table decoder
        doc["decoders"] = [d for d in doc["decoders"] if d["type"] != "multi_error_lut"]
        dump_multi_decoder_config(doc, path)
    configs = decoder_configs_from_cudaq(path)
    assert configs[0].num_detectors == 3 and configs[2].num_detectors == 2
    # decoder 0 takes measurements: m0 alone flips D0 -> the L0 edge
    shot = np.packbits([[1, 0, 0]], axis=1, bitorder="little")
    assert configs[0].decoder.decode_shots_bit_packed(shot).tolist() == [[1]]
    assert configs[2].decoder.decode_shots_bit_packed(np.array([[1]], np.uint8)).tolist() == [[1]]
    assert configs[3].decoder.decode_shots_bit_packed(np.array([[1]], np.uint8)).tolist() == [[1]]
    if "cudaq-multi_error_lut" in _available():
        assert configs[1].decoder.decode_shots_bit_packed(np.array([[1]], np.uint8)).tolist() == [[1]]


def _available():
    from qlink.qec.decoders import BUILT_IN_DECODERS

    return {n for n, d in BUILT_IN_DECODERS.items() if d.unavailable_reason() is None}


# ---------------------------------------------------------------------------- malformed configs
def _many(n):
    base = _tiny()["decoders"][0]
    return {"decoders": [dict(copy.deepcopy(base), id=i % 32) for i in range(n)]}


@pytest.mark.parametrize("doc, field, words", [
    (_tiny(type="bogus-decoder"), "decoders[0].type", "unknown decoder type 'bogus-decoder'; qlink serves"),
    (_tiny(H_sparse=[0, 1, -1, 1, 9, -1]), "decoders[0].H_sparse", "column index 9 in row 1 is out of range"),
    (_tiny(O_sparse=[3, -1]), "decoders[0].O_sparse", "column index 3"),
    (_tiny(H_sparse=[0, 1, -1]), "decoders[0].H_sparse", "has 1 rows, but syndrome_size is 2"),
    (_tiny(D_sparse=[0, -1, 1]), "decoders[0].D_sparse", "not ended by -1"),
    ({"decoders": [{k: v for k, v in _tiny()["decoders"][0].items() if k != "id"}]}, "decoders[0].id", "missing"),
    ({"decoders": [_tiny()["decoders"][0], _tiny()["decoders"][0]]}, "decoders[1].id", "duplicate id 0"),
    (_many(33), "decoders", "33 decoders"),
    (_tiny(id=40), "decoders[0].id", "0..31"),
    ({"decoders": [{k: v for k, v in _tiny()["decoders"][0].items() if k != "O_sparse"}]},
     "decoders[0].O_sparse", "missing"),
    (_tiny(decoder_custom_args={"bogus_key": 1}), "decoders[0].decoder_custom_args", "bogus_key"),
    (_tiny(decoder_custom_args={"error_rate_vec": [0.1, 0.1]}), "decoders[0].decoder_custom_args.error_rate_vec",
     "block_size is 3"),
    (_tiny(decoder_custom_args={"error_rate_vec": [0.1, 0.9, 0.1]}),
     "decoders[0].decoder_custom_args.error_rate_vec", "outside (0, 0.5]"),
    (_tiny(block_size=-1), "decoders[0].block_size", ">= 0"),
    ({"decoders": [], "extra": 1}, "extra", "unknown top-level key"),
])
@pytest.mark.parametrize("with_schema", [False, True])
def test_malformed_config_names_the_field(doc, field, words, with_schema):
    if with_schema:
        pytest.importorskip("cudaq_qec")
    with pytest.raises(CudaqConfigError) as info:
        validate_multi_decoder_config(doc, use_cudaq_schema=with_schema)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field.startswith(field), (err.field, str(err))
    if not with_schema or "CUDA-Q" not in str(err):
        assert words in str(err), str(err)


def test_unknown_type_lists_what_qlink_has():
    with pytest.raises(CudaqConfigError) as info:
        load_multi_decoder_config(dump_multi_decoder_config(_tiny(type="nv-fusion-decoder"), validate=False))
    for name in CUDAQ_DECODER_TYPES:
        assert name in str(info.value)


def test_bad_text_is_a_typed_error(tmp_path):
    with pytest.raises(CudaqConfigError, match="not valid YAML"):
        load_multi_decoder_config("decoders: [\n  - id: 0\n   type: x: y")
    with pytest.raises(CudaqConfigError, match="no such file"):
        load_multi_decoder_config(tmp_path / "missing.yaml")


# ---------------------------------------------------------------------------- measurement-level decoding
@pytest.mark.parametrize("max_table_nbytes", [16 << 20, 0])
@pytest.mark.parametrize("circuit", [
    _surface(d=5),  # 120 detectors: 15 bytes, odd -> byte-wide table
    _surface(d=3),  # 24 detectors: 3 bytes
    stim.Circuit.generated("repetition_code:memory", distance=5, rounds=15,
                           after_clifford_depolarization=0.02),  # 64 detectors: one 64-bit word
    stim.Circuit.generated("repetition_code:memory", distance=5, rounds=3,
                           after_clifford_depolarization=0.02),  # 16 detectors: 2 bytes
], ids=["surface5", "surface3", "rep64", "rep16"])
def test_measurement_decoder_matches_detector_level(max_table_nbytes, circuit):
    c = circuit
    dem = c.detector_error_model(decompose_errors=True)
    m2d, _ = stim_measurement_matrices(c)
    inner = compile_decoder("pymatching", dem)
    wrap = MeasurementDecoder(inner, m2d, max_table_nbytes=max_table_nbytes)
    meas = c.compile_sampler(seed=5).sample(2000)
    dets = c.compile_m2d_converter().convert(measurements=meas, separate_observables=False)
    packed_m = np.packbits(meas, axis=1, bitorder="little")
    packed_d = np.packbits(dets, axis=1, bitorder="little")
    assert np.array_equal(wrap.detectors_bit_packed(packed_m), packed_d)
    for k in (1, 3, 4, 5):  # a few shots per call take the Python-int path, more the NumPy one
        for start in (0, 17, 1500):
            assert np.array_equal(wrap.detectors_bit_packed(packed_m[start:start + k]), packed_d[start:start + k])
            assert np.array_equal(wrap.decode_shots_bit_packed(packed_m[start:start + k]),
                                  inner.decode_shots_bit_packed(packed_d[start:start + k]))
    assert np.array_equal(wrap.decode_shots_bit_packed(packed_m), inner.decode_shots_bit_packed(packed_d))
    assert np.array_equal(wrap.decode_batch(meas), inner.decode_batch(dets))


def test_served_config_agrees_with_direct_matching():
    c = _surface(d=3)
    doc = multi_decoder_config_from_source(c)
    compiled = compile_cudaq_entry(doc["decoders"][0])
    meas = c.compile_sampler(seed=9).sample(3000)
    dets, obs = c.compile_m2d_converter().convert(measurements=meas, separate_observables=True)
    pred = compiled.decode_batch(meas)
    direct = compile_decoder("pymatching", c.detector_error_model(decompose_errors=True)).decode_batch(dets)
    # same graph up to merged parallel edges: nearly all shots agree, and the LER is a decoder's
    assert (pred != direct).mean() < 0.01
    assert (pred != obs).mean() < 0.05


def test_source_spec_builds_detection_level_without_circuit_loss():
    doc = multi_decoder_config_from_source({"kind": "stim", "distance": 3, "rounds": 2, "p": 0.002})
    e = doc["decoders"][0]
    assert e["syndrome_size"] == 16 and max(e["D_sparse"]) + 1 > e["syndrome_size"]


def test_cudaq_schema_errors_name_the_field():
    pytest.importorskip("cudaq_qec")
    pytest.importorskip("jsonschema")
    from qlink.qec._cudaq_config_io import _check_cudaq_schema, cudaq_json_schema

    with pytest.raises(CudaqConfigError) as info:
        _check_cudaq_schema(_tiny(decoder_custom_args={"bogus_key": 1}), cudaq_json_schema())
    assert info.value.field == "decoders[0].decoder_custom_args.bogus_key"
    assert "CUDA-Q" in str(info.value)


def test_chromobius_from_stim_dem_path_takes_measurement_records(tmp_path):
    pytest.importorskip("chromobius")
    import chromobius

    from qlink.qec.decoders._chromobius import steane_color_code_circuit

    c = steane_color_code_circuit(rounds=2, p=0.003)
    c.detector_error_model().to_file(tmp_path / "colour.dem")
    m2d, _ = stim_measurement_matrices(c)
    rows = [m2d.indices[m2d.indptr[i]:m2d.indptr[i + 1]].tolist() for i in range(m2d.shape[0])]
    path = tmp_path / "colour.yaml"
    dump_multi_decoder_config({"decoders": [{"id": 4, "type": "chromobius", "stim_dem_path": "colour.dem",
                                             "D_sparse": rows_to_sparse(rows)}]}, path)
    served = decoder_configs_from_cudaq(path)[4].decoder
    meas = c.compile_sampler(seed=2).sample(500)
    dets = c.compile_m2d_converter().convert(measurements=meas, separate_observables=False)
    direct = chromobius.compile_decoder_for_dem(c.detector_error_model()).predict_obs_flips_from_dets_bit_packed(
        np.packbits(dets, axis=1, bitorder="little"))
    assert np.array_equal(served.decode_shots_bit_packed(np.packbits(meas, axis=1, bitorder="little")), direct)


def test_chromobius_without_coordinates_is_refused_by_field():
    with pytest.raises(CudaqConfigError, match="stim_dem_path") as info:
        decoder_configs_from_cudaq(_tiny(type="chromobius", decoder_custom_args={}))
    assert info.value.field.endswith("stim_dem_path")


def test_nv_qldpc_without_gpu_is_refused_with_the_reason():
    from qlink.qec.decoders import BUILT_IN_DECODERS, DecoderUnavailableError

    reason = BUILT_IN_DECODERS["cudaq-nv-qldpc-decoder"].unavailable_reason()
    if reason is None:
        pytest.skip("an NVIDIA GPU is present: nv-qldpc-decoder runs here")
    if "cudaq-qec" in reason:
        pytest.skip(reason)
    with pytest.raises(DecoderUnavailableError, match="GPU") as info:
        decoder_configs_from_cudaq(_tiny(type="nv-qldpc-decoder", decoder_custom_args={}))
    assert "decoders[id=0].type" in str(info.value)
