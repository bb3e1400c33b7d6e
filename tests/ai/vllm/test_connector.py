"""vLLM with the qlink KV connector, on a CPU: a prefill engine and a decode engine in
separate processes, a tiny random Llama (float32, 4 layers, 4 heads of 64, block size 32).

The decode engine's greedy tokens must equal its own single-engine run (the same engine
given the prompt without transfer params computes the prefill itself), the decode side
must have loaded every block (the load log says how many bytes landed), and changing one
loaded block must change the output: together they prove the decode side reads the moved
KV and that it is bit-exact."""

from __future__ import annotations

import math

import pytest

from qlink.ai.peer import transport_unavailable
from qlink.ai.vllm_engines import prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
NUM_LAYERS, KV_HEADS, HEAD = 4, 4, 64
BLOCK_NBYTES = KV_HEADS * BLOCK * 2 * HEAD * 4  # one K+V slab, float32


def _reference(decode, ps, max_tokens):
    return [o["token_ids"] for o in decode.generate(ps, dict(max_tokens=max_tokens))["outputs"]]


def _disaggregated(prefill, decode, ps, max_tokens, **extra_params):
    outs = prefill.generate(ps, dict(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))["outputs"]
    params = [dict(o["kv_transfer_params"], **extra_params) for o in outs]
    assert all(p and p["remote_url"] and p["remote_block_ids"] for p in params), params
    res = decode.generate(ps, [dict(max_tokens=max_tokens, kv_transfer_params=p) for p in params])
    return [o["token_ids"] for o in res["outputs"]], params


@pytest.mark.parametrize("scheme", ["shm", "tcp", "ucx"])
def test_decode_equals_single_engine(scheme, decode, prefill_engines):
    why = transport_unavailable(scheme)
    if why:
        pytest.skip(why)
    prefill = prefill_engines(scheme)
    from qlink.ai import KVCacheSpec

    for eng in (prefill, decode):  # vLLM's own tensors, in memfd memory, in vLLM's CPU layout
        info = eng.call("connector")
        spec = KVCacheSpec.from_bytes(info["spec"])
        assert info["shared_memory"] and spec.num_planes == 1
        assert (spec.num_layers, spec.num_kv_heads, spec.head_size, spec.block_size) == (NUM_LAYERS, KV_HEADS, HEAD,
                                                                                        BLOCK)
    lengths = [100, 32, 257, 64]  # 100 and 257 are not multiples of the block size
    ps = prompts(lengths, seed=11)
    ref = _reference(decode, ps, 12)
    decode.call("loads")  # forget earlier loads
    got, params = _disaggregated(prefill, decode, ps, 12)  # all four requests in flight together
    assert got == ref
    loads = decode.call("loads")
    assert len(loads) == len(ps) and all(ld["ok"] for ld in loads), loads
    want = sorted(math.ceil(n / BLOCK) * NUM_LAYERS * BLOCK_NBYTES for n in lengths)
    assert sorted(ld["nbytes"] for ld in loads) == want  # every block of every layer moved, none recomputed
    # one at a time too, a prompt of one token past a block boundary
    ps1 = prompts([33], seed=12)
    assert _disaggregated(prefill, decode, ps1, 6)[0] == _reference(decode, ps1, 6)


def test_changed_block_changes_output(decode, prefill_engines):
    prefill = prefill_engines("tcp")
    ps = prompts([96, 96], seed=21)
    ref = _reference(decode, ps, 10)
    decode.call("loads")
    same, _ = _disaggregated(prefill, decode, ps[:1], 10)
    changed, _ = _disaggregated(prefill, decode, ps[1:], 10, qlink_perturb_block=1)
    assert same == ref[:1]
    assert changed != ref[1:], "changing a loaded block did not change the output: decode did not read the moved KV"
    assert all(ld["ok"] for ld in decode.call("loads"))


def test_prefill_killed_request_is_recomputed_and_next_served(decode, model_dir):
    """A prefill engine dies (SIGKILL) after handing out transfer params, with the decode
    side's link to it open: the decode side reports the load failed, vLLM recomputes the
    request (kv_load_failure_policy="recompute") and the next request is served."""
    from transports import loopback_url
    from qlink.ai.vllm_engines import EngineProcess, connector_config

    doomed = EngineProcess(model_dir, kv_transfer_config=connector_config("kv_producer", url=loopback_url("tcp")))
    try:
        ps = prompts([70, 90, 50], seed=31)
        ref = _reference(decode, ps, 8)
        decode.call("loads")
        assert _disaggregated(doomed, decode, ps[:1], 8)[0] == ref[:1]  # the link is open now
        outs = doomed.generate(ps[1:2], dict(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        params = outs["outputs"][0]["kv_transfer_params"]
        doomed.kill()
        res = decode.generate(ps[1:2], [dict(max_tokens=8, kv_transfer_params=params)], timeout_s=120)
        assert [o["token_ids"] for o in res["outputs"]] == ref[1:2]  # recomputed, same tokens
        loads = decode.call("loads")
        assert loads[0]["ok"] and not loads[1]["ok"], loads
        assert "went away" in loads[1]["error"] or "cannot pull" in loads[1]["error"], loads[1]["error"]
        # the next request, to a prefill engine that is gone before any link opened
        res = decode.generate(ps[2:], [dict(max_tokens=8, kv_transfer_params=dict(params, remote_xfer_id=77))],
                              timeout_s=120)
        assert [o["token_ids"] for o in res["outputs"]] == ref[2:]
        assert not decode.call("loads")[0]["ok"]
    finally:
        doomed.close()


def test_fail_policy_fails_the_request_clearly_and_serves_the_next(model_dir):
    """With vLLM's kv_load_failure_policy="fail", a load from a prefill engine that is not
    there ends that request with finish_reason "error" (the load log says why); the next
    request is served, and malformed transfer params are computed locally, not crashed on."""
    from qlink.ai.vllm_engines import EngineProcess, connector_config

    dec = EngineProcess(model_dir, kv_transfer_config=connector_config(
        "kv_consumer", extra={"load_timeout_s": 5}, kv_load_failure_policy="fail"))
    try:
        ps = prompts([90, 40, 40], seed=41)
        ref = _reference(dec, ps[1:], 4)
        gone = {"do_remote_prefill": True, "remote_url": "tcp://127.0.0.1:9", "remote_xfer_id": 1,
                "remote_block_ids": [1, 2, 3], "remote_num_tokens": 90}
        out = dec.generate(ps[:1], [dict(max_tokens=8, kv_transfer_params=gone)], timeout_s=120)["outputs"][0]
        assert out["finish_reason"] == "error" and out["token_ids"] == []
        (ld,) = dec.call("loads")
        assert not ld["ok"] and "tcp://127.0.0.1:9" in ld["error"] and "connection refused" in ld["error"]
        bad = {"do_remote_prefill": True, "remote_url": 42, "remote_block_ids": "x"}
        outs = dec.generate(ps[1:], [dict(max_tokens=4), dict(max_tokens=4, kv_transfer_params=bad)])["outputs"]
        assert [o["token_ids"] for o in outs] == ref
        assert dec.call("loads") == []
    finally:
        dec.close()


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_layers_leave_during_the_prefill_forward_pass(scheme, decode, prefill_engines):
    """The decode engine gets the request first (push mode): the prefill engine's
    save_kv_layer sends each layer as the forward pass writes it, so every layer but the
    last left before wait_for_save (the end of the pass); the decode output equals the
    single-engine run and every block was loaded, none recomputed."""
    import random
    import time

    why = transport_unavailable(scheme)
    if why:
        pytest.skip(why)
    prefill = prefill_engines(scheme)
    url = prefill.call("connector")["url"]
    n_tokens = 1500  # a forward pass long enough to see layers leave inside it (one step, no chunking)
    ps = prompts([n_tokens], seed=51)
    ref = _reference(decode, ps, 6)
    decode.call("loads")
    prefill.call("streams")
    xfer_id = random.randrange(1 << 31, 1 << 32)
    decode.submit_generate(ps, [dict(max_tokens=6, kv_transfer_params={
        "do_remote_prefill": True, "qlink_push": True, "remote_url": url, "remote_xfer_id": xfer_id,
        "remote_num_tokens": n_tokens})])
    deadline = time.monotonic() + 60
    while prefill.call("connector")["expected"] < 1:  # the decode side's expectation reached the prefill engine
        assert time.monotonic() < deadline, "the decode engine's kv_expect never reached the prefill engine"
        time.sleep(0.01)
    prefill.generate(ps, dict(max_tokens=1, kv_transfer_params={"do_remote_decode": True, "qlink_xfer_id": xfer_id}))
    got = [o["token_ids"] for o in decode.result(timeout_s=120)["outputs"]]
    assert got == ref
    (ld,) = decode.call("loads")
    assert ld["ok"] and ld["nbytes"] == math.ceil(n_tokens / BLOCK) * NUM_LAYERS * BLOCK_NBYTES, ld
    streams = [s for s in prefill.call("streams") if s["xfer_id"] == xfer_id]
    assert len(streams) == 1 and streams[0]["streamed"], streams
    st = streams[0]
    assert [k for k, _ in st["sent_ns"]] == list(range(NUM_LAYERS))
    left_before_end = [k for k, t in st["sent_ns"] if t < st["ended_ns"]]
    assert left_before_end[:NUM_LAYERS - 1] == list(range(NUM_LAYERS - 1)), st  # all but the last, inside the pass
