"""A Dask preload for the workers of a sweep's ``LocalCluster``: each worker imports what its
chunks use while the cluster starts (in parallel with the chunk-size probe), so the first
chunk on each worker does not pay the imports."""

from __future__ import annotations


def dask_setup(worker) -> None:  # noqa: ARG001 - Dask's preload hook
    from ._work import warm_worker

    warm_worker()
