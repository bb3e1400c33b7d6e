"""Shared (memfd) host memory: blocks released by the garbage collector in any thread."""

from __future__ import annotations

import gc
import os

from qlink import memory


def test_a_block_released_while_this_thread_holds_the_lock_does_not_deadlock():
    """The collector may run a block's finalizer inside shared_fd_of (which holds the lock);
    the release is then noted and carried out by the next holder of the lock, not waited for."""
    a = memory.alloc(4096)
    fd, offset, nbytes = memory.shared_fd_of(a)
    assert offset == 0 and nbytes == 4096 and os.fstat(fd).st_size >= 4096
    with memory._shared_lock:  # as inside shared_fd_of when the collector strikes
        del a
        gc.collect()  # the finalizer runs here, in this thread (it used to wait for the lock forever)
        assert memory._released, "the release is noted while the lock is held"
    b = memory.alloc(128)  # the next holder forgets the released block and closes its memfd
    assert not memory._released
    try:
        os.fstat(fd)
    except OSError:
        pass  # closed, as it should be (unless the new block's memfd reused the number:)
    else:
        assert memory.shared_fd_of(b)[0] == fd
    assert memory.shared_fd_of(b)[2] == 128
