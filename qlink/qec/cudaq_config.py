"""CUDA-Q QEC's realtime decoder configuration (``multi_decoder_config``), read and written as-is.

CUDA-Q QEC configures its realtime decoders from one YAML (or JSON) document:
``decoders`` (a list, one entry per decoder id) and an optional ``transport``.
Each decoder entry has an ``id``, a ``type`` and either the matrices of its
detector error model (``H_sparse`` detectors x error mechanisms, ``O_sparse``
observables x error mechanisms, ``D_sparse`` detectors x measurements, with
``block_size`` = error mechanisms and ``syndrome_size`` = detectors), or a
``stim_dem_path`` with ``D_sparse``, or ``dem_chunks``; plus the type's
``decoder_custom_args``. A sparse matrix is one flat list: each row's column
indices followed by ``-1``.

This module reads such a document (:func:`load_multi_decoder_config`), checks it
(:func:`validate_multi_decoder_config`: against ``cudaq_qec.decoder_config_json_schema()``
when cudaq-qec is installed, and always by qlink's own checks: ids, matrix shapes
and index ranges, decoder types qlink serves, their custom arguments) and writes it
back (:func:`dump_multi_decoder_config`) without changing a value, so a file round-trips
read -> write -> read unchanged. A malformed document raises :class:`CudaqConfigError`
naming the field (``decoders[1].H_sparse``). Building a document from a qlink source
lives in :mod:`qlink.qec._cudaq_config_build`; serving one in
:mod:`qlink.qec._cudaq_config_serve` (both re-exported here).

>>> doc = {"decoders": [{"id": 0, "type": "pymatching", "block_size": 2, "syndrome_size": 1,
...                      "H_sparse": [0, 1, -1], "O_sparse": [0, -1], "D_sparse": [0, -1],
...                      "decoder_custom_args": {"error_rate_vec": [0.1, 0.2]}}]}
>>> text = dump_multi_decoder_config(doc)
>>> load_multi_decoder_config(text) == doc
True
>>> bad = {"decoders": [dict(doc["decoders"][0], H_sparse=[0, 5, -1])]}
>>> validate_multi_decoder_config(bad)
Traceback (most recent call last):
...
qlink.qec.cudaq_config.CudaqConfigError: decoders[0].H_sparse: column index 5 in row 0 is out of range: block_size is 2 (indices 0..1)
"""

from __future__ import annotations

from ._cudaq_config_check import (
    CUDAQ_DECODER_TYPES,
    MAX_REALTIME_DECODERS,
    CudaqConfigError,
    rows_to_sparse,
    sparse_to_rows,
)
from ._cudaq_config_io import (
    config_file,
    cudaq_json_schema,
    dump_multi_decoder_config,
    load_multi_decoder_config,
    validate_multi_decoder_config,
)

__all__ = [
    "CudaqConfigError",
    "CUDAQ_DECODER_TYPES",
    "MAX_REALTIME_DECODERS",
    "load_multi_decoder_config",
    "dump_multi_decoder_config",
    "validate_multi_decoder_config",
    "sparse_to_rows",
    "rows_to_sparse",
    "cudaq_json_schema",
    "config_file",
]

CudaqConfigError.__module__ = __name__  # documented and raised as qlink.qec.cudaq_config.CudaqConfigError


from ._cudaq_config_build import (  # noqa: E402  (re-exported: one public module)
    multi_decoder_config_from_circuit,
    multi_decoder_config_from_dem,
    multi_decoder_config_from_source,
    decoder_entry,
    stim_measurement_matrices,
)
from ._cudaq_config_serve import (  # noqa: E402
    compile_cudaq_entry,
    decoder_config_from_spec,
    decoder_configs_from_cudaq,
    service_specs_from_cudaq,
)

__all__ += [
    "decoder_entry",
    "multi_decoder_config_from_dem",
    "multi_decoder_config_from_circuit",
    "multi_decoder_config_from_source",
    "stim_measurement_matrices",
    "decoder_configs_from_cudaq",
    "compile_cudaq_entry",
    "service_specs_from_cudaq",
    "decoder_config_from_spec",
]
