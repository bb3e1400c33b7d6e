"""Installed versions of the packages qlink results depend on (for manifests and `qlink info`)."""

from __future__ import annotations

from importlib import metadata

_DISTS = {
    "numpy": "numpy", "scipy": "scipy", "stim": "stim", "pymatching": "pymatching", "sinter": "sinter",
    "ldpc": "ldpc", "cudaq": "cuda-quantum-cu12", "cudaq_qec": "cudaq-qec-cu12", "ucxx": "ucxx-cu12",
    "nixl_cu12": "nixl-cu12", "cupy": "cupy-cuda12x", "dask.distributed": "distributed", "torch": "torch",
    "nbclient": "nbclient", "qlink": "qlink", "tesseract_decoder": "tesseract-decoder", "chromobius": "chromobius",
    "fusion_blossom": "fusion-blossom",
}


def versions() -> dict[str, str | None]:
    """Map module name -> installed distribution version (None when absent); imports nothing heavy."""
    out: dict[str, str | None] = {}
    for mod, dist in _DISTS.items():
        try:
            out[mod] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[mod] = None
    return out
