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

import copy
import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import QlinkError

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

MAX_REALTIME_DECODERS = 32  # the realtime RPC's decoder ids: 0..31

_TOP_KEYS = {"decoders", "transport"}
_TRANSPORT_KEYS = {"provider", "args", "device_graph"}
_DECODER_KEYS = {"id", "type", "block_size", "syndrome_size", "H_sparse", "O_sparse", "D_sparse",
                 "stim_dem_path", "dem_chunks", "dispatch", "decoder_custom_args", "cuda_device_id"}
_MATRIX_FIELDS = ("H_sparse", "O_sparse", "D_sparse")
_DISPATCH = ("host", "device_graph")

# Custom argument kinds of the decoder types qlink serves (the keys CUDA-Q QEC 0.8 registers
# for them): "bool", "int", "uint" (>= 0), "float", "str", "floats" (a list of numbers),
# "floats2" (a list of lists of numbers), "map" (a nested object).
_ARG_KINDS: dict[str, dict[str, str]] = {
    "pymatching": {"error_rate_vec": "floats", "merge_strategy": "str"},
    "single_error_lut": {},
    "multi_error_lut": {"lut_error_depth": "int"},
    "sliding_window": {"error_rate_vec": "floats", "inner_decoder_name": "str", "inner_decoder_params": "map",
                       "num_boundary_syndromes": "uint", "num_syndromes_per_round": "uint", "step_size": "uint",
                       "straddle_end_round": "bool", "straddle_start_round": "bool", "window_size": "uint"},
    "chromobius": {k: "bool" for k in ("drop_mobius_errors_involving_remnant_errors", "ignore_decomposition_failures",
                                       "include_coords_in_mobius_dem", "return_weight",
                                       "write_mobius_match_to_stderr")},
    "nv-qldpc-decoder": {**{k: "int" for k in ("bp_batch_size", "bp_method", "bp_seed", "composition",
                                               "gamma_ensemble_size", "iter_per_check", "max_iterations",
                                               "n_threads", "osd_batch_size", "osd_method", "osd_order")},
                         **{k: "float" for k in ("clip_value", "error_rate", "gamma0", "scale_factor")},
                         **{k: "str" for k in ("osd_init_method", "proc_float")},
                         **{k: "bool" for k in ("repeatable", "use_osd", "use_sparsity")},
                         "error_rate_vec": "floats", "gamma_dist": "floats", "explicit_gammas": "floats2",
                         "srelay_config": "map"},
}
#: The ``type`` names of a ``multi_decoder_config`` that qlink serves.
CUDAQ_DECODER_TYPES: tuple[str, ...] = tuple(_ARG_KINDS)
_MERGE_STRATEGIES = ("disallow", "independent", "smallest_weight", "keep_original", "replace")


class CudaqConfigError(QlinkError, ValueError):
    """A ``multi_decoder_config`` document that cannot be used; ``field`` names the culprit
    (``"decoders[2].D_sparse"``), the message says what was wrong and what would be right."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# ----------------------------------------------------------------------------------- matrices
def sparse_to_rows(vec, *, field: str = "matrix") -> list[list[int]]:
    """CUDA-Q's flat sparse form -> one list of column indices per row.

    >>> sparse_to_rows([0, 2, -1, -1, 1, -1])
    [[0, 2], [], [1]]
    """
    if not isinstance(vec, (list, tuple)):
        raise CudaqConfigError(field, f"a sparse matrix is a list of integers (each row's column indices, then "
                                      f"-1), got {type(vec).__name__}")
    rows: list[list[int]] = []
    cur: list[int] = []
    for i, v in enumerate(vec):
        if isinstance(v, bool) or not isinstance(v, int):
            raise CudaqConfigError(field, f"entry {i} is {v!r}; entries are integers >= -1")
        if v == -1:
            rows.append(cur)
            cur = []
        elif v < -1:
            raise CudaqConfigError(field, f"entry {i} is {v}; column indices are >= 0 and -1 ends a row")
        else:
            cur.append(v)
    if cur:
        raise CudaqConfigError(field, f"the last row ({len(rows)}) is not ended by -1; every row, the last "
                                      "included, ends with -1")
    return rows


def rows_to_sparse(rows) -> list[int]:
    """One list of column indices per row -> CUDA-Q's flat sparse form (what
    ``cudaq_qec.pcm_to_sparse_vec`` gives for the same matrix).

    >>> rows_to_sparse([[0, 2], [], [1]])
    [0, 2, -1, -1, 1, -1]
    """
    out: list[int] = []
    for r in rows:
        out.extend(int(c) for c in r)
        out.append(-1)
    return out


# ----------------------------------------------------------------------------------- read / write
def _parse_text(text: str, *, origin: str) -> Any:
    s = text.lstrip()
    if s.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise CudaqConfigError(origin, f"not valid JSON: {exc}") from None
    yaml = _import_yaml()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CudaqConfigError(origin, f"not valid YAML: {exc}") from None


def _import_yaml():
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - pyyaml is a dependency
        from ..errors import missing

        raise missing("pyyaml", extra="all", feature="reading and writing multi_decoder_config YAML") from exc
    return yaml


def _looks_like_path(source: str) -> bool:
    return "\n" not in source and not source.lstrip().startswith(("{", "decoders")) and len(source) < 4096


def config_file(source) -> Path | None:
    """The path ``source`` names when it is a path to an existing file, else None (text, a mapping)."""
    if isinstance(source, os.PathLike) or (isinstance(source, str) and _looks_like_path(source)):
        try:
            path = Path(source)
            return path if path.is_file() else None
        except (OSError, ValueError):
            return None
    return None


def load_multi_decoder_config(source, *, validate: bool = True, use_cudaq_schema: bool | None = None) -> dict:
    """Read a ``multi_decoder_config`` from a path, a YAML/JSON string or a mapping.

    Returns the document as plain data (a deep copy for a mapping), checked with
    :func:`validate_multi_decoder_config` unless ``validate=False``. A relative
    ``stim_dem_path`` stays as written; :func:`qlink.qec.cudaq_config.decoder_configs_from_cudaq`
    resolves it against the file's folder.
    """
    if isinstance(source, Mapping):
        doc = copy.deepcopy(dict(source))
    elif isinstance(source, (str, os.PathLike)):
        if isinstance(source, os.PathLike) or _looks_like_path(source):
            path = Path(source)
            if not path.is_file():
                raise CudaqConfigError(str(path), "no such file; pass the path of a multi_decoder_config "
                                                  "YAML/JSON file, or its text")
            doc = _parse_text(path.read_text(encoding="utf-8"), origin=str(path))
        else:
            doc = _parse_text(source, origin="multi_decoder_config")
    else:
        raise TypeError(f"expected a path, a YAML/JSON string or a mapping, got {type(source).__name__}")
    if validate:
        validate_multi_decoder_config(doc, use_cudaq_schema=use_cudaq_schema)
    return doc


class _FlowDumper:  # built lazily: yaml is imported only when writing YAML
    cls = None


def _yaml_dumper():
    if _FlowDumper.cls is None:
        yaml = _import_yaml()

        class Dumper(yaml.SafeDumper):
            pass

        def _list(dumper, data):  # lists of scalars on one line (the sparse vectors), nested ones in blocks
            flow = all(not isinstance(v, (list, dict)) for v in data)
            return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

        Dumper.add_representer(list, _list)
        Dumper.add_representer(tuple, _list)
        _FlowDumper.cls = Dumper
    return _FlowDumper.cls


def dump_multi_decoder_config(doc, path=None, *, format: str | None = None, validate: bool = True) -> str:
    """Write ``doc`` as YAML (default, or ``path`` ending ``.yaml``/``.yml``) or JSON
    (``format="json"`` or a ``.json`` path); returns the text, and writes it to ``path``
    if given. Key order and every value are kept as they are.
    """
    if validate:
        validate_multi_decoder_config(doc)
    fmt = format or ("json" if path is not None and str(path).endswith(".json") else "yaml")
    if fmt == "json":
        text = json.dumps(doc, indent=2) + "\n"
    elif fmt == "yaml":
        yaml = _import_yaml()
        text = yaml.dump(_plain(doc), Dumper=_yaml_dumper(), sort_keys=False, width=100, allow_unicode=True)
    else:
        raise ValueError(f"format must be 'yaml' or 'json', got {format!r}")
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def _plain(obj):
    """Mappings as dicts, tuples as lists (YAML writes them alike), everything else as it is."""
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------- validation
@functools.lru_cache(maxsize=1)
def cudaq_json_schema() -> dict | None:
    """``cudaq_qec.decoder_config_json_schema()`` as a dict (read once), or None without cudaq-qec."""
    try:
        import cudaq_qec
    except ImportError:
        return None
    return json.loads(cudaq_qec.decoder_config_json_schema())


def _schema_path(path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "multi_decoder_config"


def _check_cudaq_schema(doc, schema: dict) -> None:
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - jsonschema comes with the quantum extra
        return
    validator = jsonschema.Draft202012Validator(schema)
    err = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if err is None:
        return
    # the deepest error says most ("decoders[0].decoder_custom_args: 'bogus' was unexpected")
    while err.context:
        err = jsonschema.exceptions.best_match(err.context)
    path = list(err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, Mapping):
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
        path += extra[:1]
    elif err.validator == "required" and isinstance(err.instance, Mapping):
        path += [k for k in err.validator_value if k not in err.instance][:1]
    raise CudaqConfigError(_schema_path(path), f"{err.message} (CUDA-Q QEC's decoder_config_json_schema)")


def validate_multi_decoder_config(doc, *, use_cudaq_schema: bool | None = None) -> None:
    """Raise :class:`CudaqConfigError` (naming the field) unless ``doc`` is a
    ``multi_decoder_config`` qlink can serve.

    ``use_cudaq_schema``: check against CUDA-Q QEC's JSON schema too (default: when
    cudaq-qec is installed; ``True`` without it is an error). qlink's own checks always
    run: the top-level keys; at most 32 decoders with distinct integer ids in 0..31; a
    ``type`` qlink serves (:data:`CUDAQ_DECODER_TYPES`); one of the complete matrix set
    (``H_sparse``, ``O_sparse``, ``D_sparse``, ``block_size``, ``syndrome_size``) or
    ``stim_dem_path`` with ``D_sparse``; every row count and column index in range;
    ``decoder_custom_args`` keys and value kinds of the type (``error_rate_vec`` one
    probability in (0, 0.5] per error mechanism).
    """
    _check_own(doc)  # first: its errors name the field most precisely
    if use_cudaq_schema is None or use_cudaq_schema:
        schema = cudaq_json_schema()
        if schema is None and use_cudaq_schema:
            from ..errors import missing

            raise missing("cudaq-qec-cu12", extra="quantum", feature="validating against CUDA-Q QEC's schema")
        if schema is not None:
            _check_cudaq_schema(doc, schema)


def _check_own(doc) -> None:
    if not isinstance(doc, Mapping):
        raise CudaqConfigError("multi_decoder_config", f"the document is a mapping with a 'decoders' list, "
                                                       f"got {type(doc).__name__}")
    unknown = sorted(set(doc) - _TOP_KEYS)
    if unknown:
        raise CudaqConfigError(str(unknown[0]), f"unknown top-level key; allowed: {sorted(_TOP_KEYS)}")
    if "decoders" not in doc:
        raise CudaqConfigError("decoders", "missing: the document needs a 'decoders' list")
    decoders = doc["decoders"]
    if not isinstance(decoders, list):
        raise CudaqConfigError("decoders", f"must be a list of decoder entries, got {type(decoders).__name__}")
    if len(decoders) > MAX_REALTIME_DECODERS:
        raise CudaqConfigError("decoders", f"{len(decoders)} decoders; the realtime RPC addresses at most "
                                           f"{MAX_REALTIME_DECODERS} (ids 0..{MAX_REALTIME_DECODERS - 1})")
    if "transport" in doc:
        _check_transport(doc["transport"])
    seen: dict[int, int] = {}
    for i, entry in enumerate(decoders):
        did = _check_decoder(entry, f"decoders[{i}]")
        if did in seen:
            raise CudaqConfigError(f"decoders[{i}].id", f"duplicate id {did} (decoders[{seen[did]}] has it too); "
                                                        "each decoder needs its own id")
        seen[did] = i


def _check_transport(t) -> None:
    if not isinstance(t, Mapping):
        raise CudaqConfigError("transport", f"must be a mapping (provider, args, device_graph), got {t!r}")
    unknown = sorted(set(t) - _TRANSPORT_KEYS)
    if unknown:
        raise CudaqConfigError(f"transport.{unknown[0]}", f"unknown key; allowed: {sorted(_TRANSPORT_KEYS)}")


def _int_field(entry, key: str, where: str, *, minimum: int) -> int | None:
    if key not in entry:
        return None
    v = entry[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise CudaqConfigError(f"{where}.{key}", f"must be an integer >= {minimum}, got {v!r}")
    return v


def _check_decoder(entry, where: str) -> int:
    if not isinstance(entry, Mapping):
        raise CudaqConfigError(where, f"a decoder entry is a mapping (id, type, matrices...), got {entry!r}")
    unknown = sorted(set(entry) - _DECODER_KEYS)
    if unknown:
        raise CudaqConfigError(f"{where}.{unknown[0]}", f"unknown key; allowed: {sorted(_DECODER_KEYS)}")
    if "id" not in entry:
        raise CudaqConfigError(f"{where}.id", "missing: every decoder needs an integer id (0..31), the "
                                              "decoder_id its syndromes are enqueued to")
    did = entry["id"]
    if isinstance(did, bool) or not isinstance(did, int) or not 0 <= did < MAX_REALTIME_DECODERS:
        raise CudaqConfigError(f"{where}.id", f"must be an integer in 0..{MAX_REALTIME_DECODERS - 1}, got {did!r}")
    if "type" not in entry:
        raise CudaqConfigError(f"{where}.type", f"missing: name the decoder type, one of {list(CUDAQ_DECODER_TYPES)}")
    dtype = entry["type"]
    if dtype not in _ARG_KINDS:
        raise CudaqConfigError(f"{where}.type", f"unknown decoder type {dtype!r}; qlink serves "
                                                f"{', '.join(CUDAQ_DECODER_TYPES)}")
    if "dispatch" in entry and entry["dispatch"] not in _DISPATCH:
        raise CudaqConfigError(f"{where}.dispatch", f"must be one of {list(_DISPATCH)}, got {entry['dispatch']!r}")
    _int_field(entry, "cuda_device_id", where, minimum=0)
    block = _int_field(entry, "block_size", where, minimum=0)
    syn = _int_field(entry, "syndrome_size", where, minimum=0)
    if "stim_dem_path" in entry and not isinstance(entry["stim_dem_path"], str):
        raise CudaqConfigError(f"{where}.stim_dem_path", f"must be a path string, got {entry['stim_dem_path']!r}")
    full = ("H_sparse", "O_sparse", "D_sparse", "block_size", "syndrome_size")
    if "dem_chunks" in entry:
        raise CudaqConfigError(f"{where}.dem_chunks", "chunked DEMs are CUDA-Q's own; give qlink the whole model "
                                                      "(H_sparse, O_sparse, D_sparse, block_size, syndrome_size) "
                                                      "or stim_dem_path with D_sparse")
    if not all(k in entry for k in full) and not ("stim_dem_path" in entry and "D_sparse" in entry):
        missing_keys = [k for k in full if k not in entry]
        raise CudaqConfigError(f"{where}.{missing_keys[0]}",
                               f"missing: a decoder needs all of {list(full)}, or stim_dem_path with D_sparse "
                               f"(this one lacks {missing_keys})")
    rows = {k: sparse_to_rows(entry[k], field=f"{where}.{k}") for k in _MATRIX_FIELDS if k in entry}
    if "H_sparse" in rows:
        _check_rows(rows["H_sparse"], f"{where}.H_sparse", num_rows=syn, num_cols=block,
                    rows_name="syndrome_size", cols_name="block_size")
    if "O_sparse" in rows:
        _check_rows(rows["O_sparse"], f"{where}.O_sparse", num_rows=None, num_cols=block,
                    rows_name="", cols_name="block_size")
    if "D_sparse" in rows:
        _check_rows(rows["D_sparse"], f"{where}.D_sparse", num_rows=syn, num_cols=None,
                    rows_name="syndrome_size", cols_name="")
        if not any(rows["D_sparse"]):
            raise CudaqConfigError(f"{where}.D_sparse", "no detector reads any measurement; D_sparse row i lists "
                                                        "the measurements whose XOR is detector i")
    _check_custom_args(entry.get("decoder_custom_args", {}), dtype, where, block_size=block)
    return did


def _check_rows(rows, field: str, *, num_rows, num_cols, rows_name: str, cols_name: str) -> None:
    if num_rows is not None and len(rows) != num_rows:
        raise CudaqConfigError(field, f"has {len(rows)} rows, but {rows_name} is {num_rows}: one row per detector")
    if num_cols is None:
        return
    for r, cols in enumerate(rows):
        for c in cols:
            if c >= num_cols:
                raise CudaqConfigError(field, f"column index {c} in row {r} is out of range: {cols_name} is "
                                              f"{num_cols} (indices 0..{num_cols - 1})")


def _check_custom_args(args, dtype: str, where: str, *, block_size) -> None:
    field = f"{where}.decoder_custom_args"
    if not isinstance(args, Mapping):
        raise CudaqConfigError(field, f"must be a mapping of {dtype}'s parameters, got {args!r}")
    kinds = _ARG_KINDS[dtype]
    for key, value in args.items():
        if key not in kinds:
            raise CudaqConfigError(f"{field}.{key}", f"unknown parameter of {dtype!r}; it takes "
                                                     f"{sorted(kinds) or 'none'}")
        if not _is_kind(value, kinds[key]):
            raise CudaqConfigError(f"{field}.{key}", f"must be {_KIND_WORDS[kinds[key]]}, got {value!r}")
    rates = args.get("error_rate_vec")
    if rates is not None:
        if block_size is not None and len(rates) != block_size:
            raise CudaqConfigError(f"{field}.error_rate_vec", f"has {len(rates)} entries; block_size is {block_size}: "
                                                              "one probability per error mechanism")
        bad = next((p for p in rates if not 0.0 < p <= 0.5), None)
        if bad is not None:
            raise CudaqConfigError(f"{field}.error_rate_vec", f"probability {bad!r} is outside (0, 0.5]")
    if dtype == "pymatching" and "merge_strategy" in args and args["merge_strategy"] not in _MERGE_STRATEGIES:
        raise CudaqConfigError(f"{field}.merge_strategy", f"must be one of {list(_MERGE_STRATEGIES)}, "
                                                          f"got {args['merge_strategy']!r}")


_KIND_WORDS = {"bool": "true or false", "int": "an integer", "uint": "an integer >= 0", "float": "a number",
               "str": "a string", "floats": "a list of numbers", "floats2": "a list of lists of numbers",
               "map": "a mapping"}


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_kind(v, kind: str) -> bool:
    if kind == "bool":
        return isinstance(v, bool)
    if kind in ("int", "uint"):
        return isinstance(v, int) and not isinstance(v, bool) and (kind == "int" or v >= 0)
    if kind == "float":
        return _is_num(v)
    if kind == "str":
        return isinstance(v, str)
    if kind == "floats":
        return isinstance(v, list) and all(_is_num(x) for x in v)
    if kind == "floats2":
        return isinstance(v, list) and all(isinstance(r, list) and all(_is_num(x) for x in r) for r in v)
    return isinstance(v, Mapping)


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
