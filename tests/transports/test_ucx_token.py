"""ucx:// with a shared token: the bootstrap handshake admits only clients that prove it
(an HMAC of their hello; the token never travels), refuses the others with the reason,
and counts them; without a token on the listener, a client's proof is taken and ignored."""

from __future__ import annotations

import pytest

pytest.importorskip("ucxx", reason="the ucx:// transport needs the optional 'ucxx' package")

import transports  # noqa: E402
from transports._ucx_boot import PeerRefusedError  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TOKEN = "ucx-test-token-0123456789"


def _round_trip(lis) -> None:
    """A client holding the token connects and a message goes each way."""
    a = transports.connect(lis.url, timeout_s=10, token=TOKEN)
    b = lis.accept(timeout_s=10)
    try:
        a.send(b"admitted")
        assert b.recv(timeout_s=10) == b"admitted"
        b.send(b"fine")
        assert a.recv(timeout_s=10) == b"fine"
    finally:
        a.close()
        b.close()


def test_only_a_client_holding_the_token_is_admitted_and_refusals_are_counted():
    with transports.listen("ucx://127.0.0.1:0", token=TOKEN) as lis:
        with pytest.raises(PeerRefusedError, match="shared token") as no:
            transports.connect(lis.url, timeout_s=10)
        assert no.value.reason == "no_token"
        with pytest.raises(PeerRefusedError, match="not the listener's") as bad:
            transports.connect(lis.url, timeout_s=10, token="another-token-of-the-same-size")
        assert bad.value.reason == "bad_token"
        _round_trip(lis)
        assert dict(lis.refused_by_reason) == {"no_token": 1, "bad_token": 1}
        assert lis.rejected == 2


def test_a_proof_sent_to_a_listener_without_a_token_is_ignored():
    with transports.listen("ucx://127.0.0.1:0") as lis:
        _round_trip(lis)
        assert lis.rejected == 0


def test_a_short_token_is_a_value_error():
    with pytest.raises(ValueError, match="16 characters"):
        transports.listen("ucx://127.0.0.1:0", token="short")
