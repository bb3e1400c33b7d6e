"""Fixtures shared by the transport tests."""

import pytest

import transports


@pytest.fixture
def ucx_pair():
    """A connected ucx:// client and server endpoint on loopback (closed afterwards)."""
    pytest.importorskip("ucxx", reason="the ucx transport needs ucxx-cu12 (pip install 'qlink[ucx]')")
    lis = transports.listen("ucx://127.0.0.1:0")
    a = transports.connect(lis.url, timeout_s=5)
    b = lis.accept(timeout_s=5)
    yield a, b
    a.close()
    b.close()
    lis.close()


@pytest.fixture
def tcp_pair():
    """A connected tcp:// client and server endpoint on loopback (closed afterwards)."""
    from transports import tcp

    with tcp.listen("tcp://127.0.0.1:0") as lis:
        client = tcp.connect(lis.url, timeout_s=5)
        server = lis.accept(timeout_s=5)
        with client, server:
            yield client, server
