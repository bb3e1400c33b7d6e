"""Shared test setup: tests marked ``gpu`` skip, with the reason, where no NVIDIA GPU can run CuPy."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gpu_skip_reason() -> str | None:
    """None when CuPy can run on a visible NVIDIA GPU, else why not (import lazily: CuPy is slow to load)."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - not installed, or installed without its CUDA libraries
        return f"needs CuPy on an NVIDIA GPU; CuPy does not import here ({type(e).__name__}: {e})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver or no device
        return f"needs an NVIDIA GPU; CUDA reports none here ({type(e).__name__})"
    return None if count > 0 else "needs an NVIDIA GPU; CUDA reports 0 devices here"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and gpu_skip_reason() is not None:
        skip = pytest.mark.skip(reason=gpu_skip_reason())
        for item in gpu_items:
            item.add_marker(skip)
