"""TLS: the session over mutual TLS with the node's certificate, as a daemon with --tls-*
serves its application port; what the SDK refuses to load."""

from __future__ import annotations

from pathlib import Path

import pytest

from cairn import AppSession, ConnectError, Tls, TlsError

from certs import make_certs
from fake_daemon import FakeDaemon, run, serving, within


@run
async def test_a_session_over_mutual_tls(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    node = Tls.from_files(certs / "ca.pem", certs / "n1.pem", certs / "n1-key.pem")
    assert node.has_identity and "key" not in repr(node).lower().replace("identity", "")
    daemon = FakeDaemon(peers=["n2"])
    async with serving(daemon, node.server_credentials()) as address:
        # The daemon's certificate names IP:127.0.0.1, the host dialed.
        session = await AppSession.connect(address, tls=node)
        await session.send("n2", b"over TLS")
        assert await daemon.sent_messages(1) == [("n2", b"over TLS")]
        await session.close()
        # No client certificate, or plaintext: refused (retryable, as a daemon may come up).
        with pytest.raises(ConnectError) as e:
            await AppSession.connect(
                address, tls=Tls.from_files(certs / "ca.pem"), attach_timeout=5
            )
        assert e.value.retryable
        with pytest.raises(ConnectError):
            await AppSession.connect(address, attach_timeout=5)
    # A daemon whose certificate is not of the CA given.
    other = make_certs(tmp_path / "other")
    async with serving(daemon, node.server_credentials()) as address:
        stranger = Tls.from_files(other / "ca.pem", other / "n1.pem", other / "n1-key.pem")
        with pytest.raises(ConnectError):
            await within(AppSession.connect(address, tls=stranger, attach_timeout=5))


def test_files_that_cannot_be_used_are_named(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    with pytest.raises(TlsError, match="--tls-ca .*missing.pem"):
        Tls.from_files(tmp_path / "missing.pem")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(TlsError, match="holds no PEM certificate"):
        Tls.from_files(tmp_path / "junk.pem")
    with pytest.raises(TlsError, match="--tls-key .*holds no PEM private key"):
        Tls.from_files(certs / "ca.pem", certs / "n1.pem", certs / "n1.pem")
    with pytest.raises(TlsError, match="go together"):
        Tls.from_files(certs / "ca.pem", certs / "n1.pem")
    with pytest.raises(TlsError, match="serving TLS needs"):
        Tls.from_files(certs / "ca.pem").server_credentials()
    # A reload keeps what is in force when the files went bad, and takes new good ones.
    ca = tmp_path / "ca.pem"
    ca.write_bytes((certs / "ca.pem").read_bytes())
    tls = Tls.from_files(ca)
    ca.write_text("half written")
    assert not tls.reload()
    assert tls.ca == (certs / "ca.pem").read_bytes()
    ca.write_bytes((certs / "admin.pem").read_bytes())
    assert tls.reload() and tls.ca == (certs / "admin.pem").read_bytes()
