"""inproc:// specifics beyond the conformance suite: the name registry, copy/reference
semantics, direct puts and two threads on one endpoint."""

from __future__ import annotations

import errno
import threading
import uuid

import numpy as np
import pytest

from qlink.errors import BrokenLinkError, RegistrationError
from transports import inproc

pytestmark = pytest.mark.timeout(30)


def _name() -> str:
    return f"inproc://t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def pair():
    with inproc.listen(_name()) as lis:
        a = inproc.connect(lis.url)
        b = lis.accept(timeout_s=1)
        try:
            yield a, b
        finally:
            a.close()
            b.close()


def test_capabilities():
    caps = inproc.CAPABILITIES
    assert (caps.cross_process, caps.one_sided, caps.zero_copy_put) == (False, True, True)


def test_a_name_listens_once_and_is_free_after_close():
    url = _name()
    lis = inproc.listen(url)
    with pytest.raises(OSError) as info:
        inproc.listen(url)
    assert info.value.errno == errno.EADDRINUSE and url in str(info.value)
    lis.close()
    inproc.listen(url).close()


def test_urls_are_checked():
    for bad in ("inproc://", "tcp://x"):
        with pytest.raises(ValueError):
            inproc.listen(bad)


def test_connect_without_listener_says_inproc_stays_in_process():
    with pytest.raises(BrokenLinkError, match="does not cross processes"):
        inproc.connect(_name())


def test_unaccepted_connection_breaks_when_the_listener_closes():
    lis = inproc.listen(_name())
    client = inproc.connect(lis.url)
    lis.close()
    with pytest.raises(BrokenLinkError):
        client.recv_into(bytearray(8), timeout_s=1)


def test_a_mutable_buffer_can_be_reused_after_send(pair):
    a, b = pair
    buf = bytearray(b"first")
    a.send(buf)
    buf[:] = b"again"
    assert b.recv(timeout_s=1) == b"first"


def test_immutable_bytes_travel_by_reference(pair):
    a, b = pair
    msg = b"x" * 1000
    a.send(msg)
    assert b._in.messages[0] is msg  # no copy until recv_into
    assert b.recv(timeout_s=1) == msg


def test_put_writes_straight_into_any_registered_array(pair):
    a, b = pair
    target = np.zeros((4, 4), dtype=np.float32)  # plain numpy memory works: no mapping is needed in one process
    region = b.register(target)
    row = np.arange(4, dtype=np.float32)
    a.put(row, region.descriptor(), offset=2 * 16, notify_id=5, tag=b"row2")
    assert np.array_equal(target[2], row)  # in place before the notification is even looked at
    note = b.wait_notification(timeout_s=1)
    assert (note.region_id, note.offset, note.nbytes, note.notify_id, note.tag) == (region.region_id, 32, 16, 5, b"row2")
    b.deregister(region)
    with pytest.raises(RegistrationError, match="not registered"):
        a.put(row, region.descriptor())  # known at once: no message round trip needed


def test_descriptor_of_another_connection_is_refused():
    with inproc.listen(_name()) as lis:
        a1, a2 = inproc.connect(lis.url), inproc.connect(lis.url)
        b1, b2 = lis.accept(timeout_s=1), lis.accept(timeout_s=1)
        region = b1.register(np.zeros(8, dtype=np.uint8))
        with pytest.raises(RegistrationError, match="not issued by this endpoint's peer"):
            a2.put(b"x", region.descriptor())
        for ep in (a1, a2, b1, b2):
            ep.close()


def test_two_threads_put_and_send_while_the_owner_waits(pair):
    a, b = pair
    count = 2000
    target = np.zeros(count, dtype=np.uint8)
    region = b.register(target)
    desc = region.descriptor()

    def producer():
        for i in range(count):
            a.put(bytes([i % 255 + 1]), desc, offset=i, notify_id=i)
            a.send(i.to_bytes(4, "little"))

    def consumer(out):
        for _ in range(count):
            out.append(int.from_bytes(b.recv(timeout_s=5), "little"))

    got = []
    threads = [threading.Thread(target=producer), threading.Thread(target=consumer, args=(got,))]
    for t in threads:
        t.start()
    ids = [b.wait_notification(timeout_s=5).notify_id for _ in range(count)]
    for t in threads:
        t.join(10)
    assert got == list(range(count)) and ids == list(range(count))
    assert (target == np.arange(count) % 255 + 1).all()
