"""Reading, writing and validating a CUDA-Q ``multi_decoder_config`` document (YAML or JSON);
re-exported by :mod:`qlink.qec.cudaq_config`, which documents it."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from ._cudaq_config_check import CudaqConfigError, check_document


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
    from ..errors import optional_import

    return optional_import("yaml", package="pyyaml", extra="all", feature="reading and writing multi_decoder_config YAML")


def _looks_like_path(source: str) -> bool:
    """One line that is not a YAML/JSON document (a file may well be called decoders.yaml)."""
    return ("\n" not in source and len(source) < 4096 and not source.lstrip().startswith("{")
            and re.match(r"\s*decoders\s*:", source) is None)


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
    check_document(doc)  # first: its errors name the field most precisely
    if use_cudaq_schema is None or use_cudaq_schema:
        schema = cudaq_json_schema()
        if schema is None and use_cudaq_schema:
            from ..errors import missing

            raise missing("cudaq-qec-cu12", extra="quantum", feature="validating against CUDA-Q QEC's schema")
        if schema is not None:
            _check_cudaq_schema(doc, schema)
