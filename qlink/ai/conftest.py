"""Doctest collection of qlink.ai: the vLLM connector module imports vLLM, which lives in
its own environment (``make test`` runs it there); elsewhere it is left out."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm_connector.py"]
