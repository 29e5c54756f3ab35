"""TLS from PEM files: the CA that servers' certificates must chain to, and optionally this
process's own certificate and key (presented as the client certificate).

A node daemon started with ``--tls-*`` serves mutual TLS on its application port and
wants the application to present *its node's* certificate (``cairn://CLUSTER/node/ID``);
a coordinator wants a certificate of the CA (and, for most calls, a role or a bearer
token). ``cairnctl certs init`` and ``cairnctl cluster up`` write such files.

As in the Rust SDK, the server's certificate is checked against the CA for the host that is
dialed (``127.0.0.1`` needs an IP SAN, ``node-0.cairn`` a DNS SAN) — except the
coordinator's, which must name ``coordinator`` whatever address is dialed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import grpc

from .errors import CairnError

__all__ = ["Tls", "TlsError"]

_log = logging.getLogger("cairn.tls")

PathLike = str | os.PathLike[str]


class TlsError(CairnError):
    """A PEM file cannot be used; the text names the flag-like role of the file (``--tls-ca``,
    ``--tls-cert``, ``--tls-key``) and its path, as the Rust tools do."""

    def __init__(self, flag: str, path: str, reason: str) -> None:
        """The file (``flag``) at ``path`` and what is wrong with it."""
        super().__init__(f"{flag} {path}: {reason}")
        #: Which file: ``--tls-ca``, ``--tls-cert`` or ``--tls-key``.
        self.flag = flag
        #: Its path (or ``<memory>`` for PEM given as bytes).
        self.path = path
        #: What is wrong with it.
        self.reason = reason


def _check(flag: str, path: str, pem: bytes) -> bytes:
    """``pem`` if it holds PEM of the kind ``flag`` names; :class:`TlsError` otherwise."""
    if flag == "--tls-key":
        if b"PRIVATE KEY-----" not in pem:
            raise TlsError(flag, path, "holds no PEM private key")
    elif b"-----BEGIN CERTIFICATE-----" not in pem:
        raise TlsError(flag, path, "holds no PEM certificate")
    return pem


def _read(flag: str, path: PathLike) -> bytes:
    """The PEM bytes of ``path``, checked; :class:`TlsError` naming the file otherwise."""
    try:
        return _check(flag, str(path), Path(path).read_bytes())
    except OSError as e:
        raise TlsError(flag, str(path), e.strerror or str(e)) from e


class Tls:
    """A CA and optionally an identity (certificate chain and private key), in PEM.

    Build it with :meth:`from_files` (the files are read again for each new connection, so
    a renewed certificate is used without a restart, as the Rust SDK's reload does) or
    :meth:`from_pem`.
    """

    def __init__(
        self,
        ca: bytes,
        cert: bytes | None = None,
        key: bytes | None = None,
        *,
        paths: tuple[PathLike, PathLike | None, PathLike | None] | None = None,
    ) -> None:
        """PEM bytes: ``ca`` (one or more CA certificates), and ``cert`` with ``key``
        (both or neither). ``paths``: the files they came from, read again by
        :meth:`reload`."""
        if (cert is None) != (key is None):
            missing = "--tls-key" if key is None else "--tls-cert"
            raise TlsError(missing, "<none>", "a certificate and its key go together; give both")
        self._ca = _check("--tls-ca", "<memory>", ca)
        self._cert = None if cert is None else _check("--tls-cert", "<memory>", cert)
        self._key = None if key is None else _check("--tls-key", "<memory>", key)
        self._paths = paths

    @classmethod
    def from_files(
        cls, ca: PathLike, cert: PathLike | None = None, key: PathLike | None = None
    ) -> Tls:
        """Reads the CA file and, when given, the certificate and key files (both or
        neither). Raises :class:`TlsError` naming the file that cannot be read or holds
        no PEM of the right kind."""
        if (cert is None) != (key is None):
            missing = "--tls-key" if key is None else "--tls-cert"
            raise TlsError(missing, "<none>", "a certificate and its key go together; give both")
        return cls(
            _read("--tls-ca", ca),
            None if cert is None else _read("--tls-cert", cert),
            None if key is None else _read("--tls-key", key),
            paths=(ca, cert, key),
        )

    @classmethod
    def from_pem(cls, ca: bytes, cert: bytes | None = None, key: bytes | None = None) -> Tls:
        """From PEM bytes held in memory."""
        return cls(ca, cert, key)

    @property
    def has_identity(self) -> bool:
        """Whether this process presents a certificate of its own."""
        return self._cert is not None

    @property
    def ca(self) -> bytes:
        """The CA certificates (PEM)."""
        return self._ca

    @property
    def cert(self) -> bytes | None:
        """This process's certificate chain (PEM), if any."""
        return self._cert

    @property
    def key(self) -> bytes | None:
        """This process's private key (PEM), if any."""
        return self._key

    def reload(self) -> bool:
        """Reads the files again (for a :class:`Tls` made by :meth:`from_files`): new
        connections use what they hold now. Files that cannot be read or hold no PEM keep
        the old ones in force (logged at error level). Whether new files are in force."""
        if self._paths is None:
            return False
        ca, cert, key = self._paths
        try:
            fresh = Tls.from_files(ca, cert, key)
        except TlsError as e:
            _log.error("%s; keeping the TLS certificate in force", e)
            return False
        changed = (fresh._ca, fresh._cert, fresh._key) != (self._ca, self._cert, self._key)
        self._ca, self._cert, self._key = fresh._ca, fresh._cert, fresh._key
        return changed

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for a client channel: the CA, and this identity if any (re-read from
        its files first, when it has files)."""
        self.reload()
        return grpc.ssl_channel_credentials(
            root_certificates=self._ca, private_key=self._key, certificate_chain=self._cert
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials to serve mutual TLS with this identity: a client certificate of the
        CA is required (the Rust servers' rule). Raises :class:`TlsError` without an
        identity."""
        if self._cert is None or self._key is None:
            raise TlsError("--tls-cert", "<none>", "serving TLS needs a certificate and key")
        self.reload()
        assert self._cert is not None and self._key is not None
        return grpc.ssl_server_credentials(
            [(self._key, self._cert)], root_certificates=self._ca, require_client_auth=True
        )

    def __repr__(self) -> str:
        # Never the key.
        """Where it came from and whether it has an identity (never the key)."""
        source = "files" if self._paths is not None else "memory"
        return f"Tls(from {source}, identity={self.has_identity})"
