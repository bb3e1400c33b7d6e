"""qlink's own checks of a ``multi_decoder_config`` (private to :mod:`qlink.qec.cudaq_config`,
which re-exports the public names): the document's shape, ids, matrix shapes and index
ranges, the decoder types qlink serves and their custom arguments; and CUDA-Q's flat
sparse-matrix form.

>>> sparse_to_rows([0, 2, -1, -1, 1, -1])
[[0, 2], [], [1]]
"""

from __future__ import annotations

import math
from typing import Mapping

from ..errors import QlinkError

__all__ = ["CudaqConfigError", "CUDAQ_DECODER_TYPES", "MAX_REALTIME_DECODERS", "sparse_to_rows", "rows_to_sparse",
           "check_document"]

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


# ----------------------------------------------------------------------------------- checks
def check_document(doc) -> None:
    """qlink's own checks (see :func:`qlink.qec.cudaq_config.validate_multi_decoder_config`)."""
    _check_own(doc)


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
