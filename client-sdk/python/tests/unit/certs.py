"""A development CA and certificates made with the openssl command, as `cairnctl certs init`
makes them: a node's (``cairn://CLUSTER/node/ID``, DNS:ID, DNS:localhost, IP:127.0.0.1) and
people's (``cairn://CLUSTER/ROLE/NAME``, client auth only)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(directory: Path, cluster: str = "test") -> Path:
    """Writes ca.pem and, each with NAME-key.pem: n1.pem, admin.pem, viewer.pem, stranger.pem
    (an admin of another cluster); fails the test, naming what to install, without openssl."""
    if shutil.which("openssl") is None:
        pytest.fail("the TLS tests make certificates with openssl: apt-get install openssl")
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(
        "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca-key.pem", cwd=directory
    )
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        "ca-key.pem",
        "-subj",
        "/CN=cairn test CA",
        "-days",
        "2",
        "-out",
        "ca.pem",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )
    leaves = {
        "n1": (
            f"URI:cairn://{cluster}/node/n1,DNS:n1,DNS:localhost,IP:127.0.0.1",
            "serverAuth,clientAuth",
        ),
        "admin": (f"URI:cairn://{cluster}/admin/alice", "clientAuth"),
        "viewer": (f"URI:cairn://{cluster}/viewer/grafana", "clientAuth"),
        "stranger": ("URI:cairn://elsewhere/admin/mallory", "clientAuth"),
    }
    for name, (sans, usage) in leaves.items():
        _openssl(
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            f"{name}-key.pem",
            cwd=directory,
        )
        _openssl(
            "req",
            "-new",
            "-key",
            f"{name}-key.pem",
            "-subj",
            f"/CN={name}",
            "-out",
            f"{name}.csr",
            cwd=directory,
        )
        (directory / f"{name}.ext").write_text(
            f"subjectAltName={sans}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n"
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            f"{name}.pem",
            "-extfile",
            f"{name}.ext",
            cwd=directory,
        )
    return directory
