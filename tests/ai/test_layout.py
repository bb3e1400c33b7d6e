"""KV-cache layout: specs, presets, allocation, layout agreement, descriptor planning."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlink.ai import (
    PRESETS,
    BlockIdError,
    KVCache,
    KVCacheSpec,
    LayoutMismatchError,
    plan_transfer,
    preset,
)
from qlink.errors import CapabilityError, MissingDependencyError, QlinkError
from qlink.memory import shared_fd_of


@pytest.mark.parametrize("name, expected", [("llama-3-8b", 131_072), ("llama-3-70b", 327_680)])
def test_preset_bytes_per_token(name, expected):
    spec = preset(name)
    assert spec.bytes_per_token == expected
    assert spec.bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * spec.head_size * spec.itemsize
    assert spec.dtype_name == "bfloat16" and spec.storage_dtype == np.uint16


def test_preset_shapes_match_the_flash_attention_layout():
    spec = preset("llama-3-8b", num_blocks=10)
    assert spec.layer_shape == (2, 10, 16, 8, 128)
    assert spec.block_nbytes == 16 * 8 * 128 * 2
    assert spec.layer_nbytes == 2 * 10 * spec.block_nbytes
    assert spec.nbytes == 32 * spec.layer_nbytes
    assert spec.kv_nbytes(num_tokens=512) == 512 * 131_072
    assert spec.blocks_for(num_tokens=17) == 2 and spec.kv_nbytes(num_tokens=17) == 32 * 131_072
    assert set(PRESETS) >= {"llama-3-8b", "llama-3-70b", "tiny"}


def test_unknown_preset_and_bad_fields_are_rejected():
    with pytest.raises(ValueError, match="unknown KV preset"):
        preset("gpt-5")
    with pytest.raises(ValueError, match="head_size"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_size=0)
    with pytest.raises(ValueError, match="dtype_name"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_size=8, dtype_name="bf16")


def test_spec_bytes_round_trip_and_garbage():
    spec = preset("tiny", num_blocks=123)
    assert KVCacheSpec.from_bytes(spec.to_bytes()) == spec
    with pytest.raises(LayoutMismatchError) as e:
        KVCacheSpec.from_bytes(b"x" * KVCacheSpec.SIZE_BYTES)
    assert e.value.field == "encoding"
    with pytest.raises(LayoutMismatchError):
        KVCacheSpec.from_bytes(spec.to_bytes()[:-1])


@pytest.mark.parametrize("field, value", [("num_layers", 5), ("num_kv_heads", 4), ("head_size", 32),
                                          ("block_size", 8), ("dtype_name", "float16")])
def test_layout_mismatch_names_the_field(field, value):
    a = preset("tiny", num_blocks=8)
    b = dataclasses.replace(a, **{field: value})
    with pytest.raises(LayoutMismatchError) as e:
        a.check_compatible(b)
    assert e.value.field == field
    assert field in str(e.value)
    assert isinstance(e.value, QlinkError)


def test_num_blocks_may_differ_between_sides():
    a = preset("tiny", num_blocks=8)
    a.check_compatible(a.with_blocks(1000))


def test_allocate_host_shared_and_private():
    spec = preset("tiny", num_blocks=6)
    shared = KVCache.allocate(spec)
    assert len(shared.layers) == spec.num_layers
    for arr in shared.layers:
        assert arr.shape == spec.layer_shape and arr.dtype == np.uint16
        assert shared_fd_of(arr) is not None  # memfd-backed: shm can put into it without a copy
        assert not arr.any()
    private = KVCache.allocate(spec, shared=False)
    assert shared_fd_of(private.layers[0]) is None
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache.allocate(preset("tiny"))
    with pytest.raises(ValueError, match="device"):
        KVCache.allocate(spec, device="tpu")


def test_fill_random_is_reproducible_and_checksums_see_every_block():
    spec = preset("tiny", num_blocks=6)
    a, b = KVCache.allocate(spec), KVCache.allocate(spec)
    a.fill_random(seed=4)
    b.fill_random(seed=4)
    ids = np.arange(6)
    assert (a.block_checksums(ids) == b.block_checksums(ids)).all()
    b.layers[3][1, 5, 0, 0, 0] ^= 1  # one bit of layer 3, V plane, block 5
    diff = a.block_checksums(ids) != b.block_checksums(ids)
    assert diff.sum() == 1 and diff[3, 1, 5]
    with pytest.raises(IndexError):
        a.block_checksums([6])


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU with CuPy; none is visible on this machine")
def test_allocate_on_gpu():
    spec = preset("tiny", num_blocks=4)
    cache = KVCache.allocate(spec, device="gpu")
    assert cache.device == "gpu" and cache.layers[0].shape == spec.layer_shape
    cache.fill_random(seed=1)
    host = KVCache.allocate(spec)
    host.fill_random(seed=1)
    assert (cache.block_checksums([0, 3]) == host.block_checksums([0, 3])).all()


@pytest.mark.skipif(_has_gpu(), reason="checks the error raised where no GPU is present")
def test_allocate_on_gpu_without_one_is_a_clear_error():
    with pytest.raises((CapabilityError, MissingDependencyError), match="GPU|gpu"):
        KVCache.allocate(preset("tiny", num_blocks=4), device="gpu")


# ----- descriptor planning ---------------------------------------------------------


def _plan(src, dst, nsrc=64, ndst=64, bn=16, **kw):
    return plan_transfer(src, dst, src_num_blocks=nsrc, dst_num_blocks=ndst, block_nbytes=bn, **kw)


@pytest.mark.parametrize("src, dst, expected_descs", [
    (range(10), range(10), 2),                   # one run per plane
    (range(64), range(64), 1),                   # the whole cache: K's last block abuts V's first
    ([0, 2, 4, 6], [0, 1, 2, 3], 8),             # source strided: nothing merges
    ([5, 6, 7, 1, 2], [10, 11, 12, 20, 21], 4),  # two runs per plane
    ([3, 1, 2], [7, 5, 6], 2),                   # shuffled pairs still merge once sorted
    ([9, 9, 9], [0, 1, 2], 6),                   # one source block copied three times
    ([4], [60], 2),
])
def test_run_merging_descriptor_counts(src, dst, expected_descs):
    p = _plan(list(src), list(dst))
    assert p.num_descs == expected_descs
    assert int(p.nbytes.sum()) == p.layer_nbytes == 2 * len(list(src)) * 16


def test_long_runs_are_split_at_the_message_limit():
    p = _plan(range(10), range(10), max_desc_nbytes=48)  # 3 blocks of 16 B per descriptor
    assert p.nbytes.tolist() == [48, 48, 48, 16] * 2
    assert int(p.nbytes.sum()) == p.layer_nbytes
    with pytest.raises(ValueError, match="smaller than one block"):
        _plan([0], [0], max_desc_nbytes=8)


@pytest.mark.parametrize("src, dst, match", [
    ([0, 64], [0, 1], "src_block_ids contains block id 64"),
    ([-1], [0], "src_block_ids contains block id -1"),
    ([0], [99], "dst_block_ids contains block id 99"),
    ([0, 1], [0], "pair up one to one"),
    ([0, 1], [3, 3], "names block 3 more than once"),
    ([], [], "at least one block"),
    ([0.5], [1], "integers"),
    ([[0, 1]], [[0, 1]], "1-D"),
])
def test_bad_block_lists_are_typed_errors(src, dst, match):
    with pytest.raises(BlockIdError, match=match):
        _plan(src, dst)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_plan_moves_exactly_the_requested_pairs(data):
    nsrc = data.draw(st.integers(1, 40))
    ndst = data.draw(st.integers(1, 40))
    n = data.draw(st.integers(1, ndst))
    dst = data.draw(st.permutations(range(ndst)))[:n]
    src = data.draw(st.lists(st.integers(0, nsrc - 1), min_size=n, max_size=n))
    bn = 4
    p = plan_transfer(src, dst, src_num_blocks=nsrc, dst_num_blocks=ndst, block_nbytes=bn)
    # Replay the descriptors on byte arrays and compare with a per-block copy.
    src_mem = np.arange(2 * nsrc * bn, dtype=np.int64)
    got = np.full(2 * ndst * bn, -1, dtype=np.int64)
    for so, do, nb in zip(p.src_offsets, p.dst_offsets, p.nbytes):
        assert nb > 0 and nb % bn == 0
        got[do:do + nb] = src_mem[so:so + nb]
    want = np.full(2 * ndst * bn, -1, dtype=np.int64)
    for s, d in zip(src, dst):
        for k in (0, 1):
            want[(k * ndst + d) * bn:(k * ndst + d + 1) * bn] = src_mem[(k * nsrc + s) * bn:(k * nsrc + s + 1) * bn]
    assert (got == want).all()
    # Merged: no two consecutive descriptors could have been one.
    ends_s = p.src_offsets[:-1] + p.nbytes[:-1]
    ends_d = p.dst_offsets[:-1] + p.nbytes[:-1]
    assert not np.any((ends_s == p.src_offsets[1:]) & (ends_d == p.dst_offsets[1:]))
