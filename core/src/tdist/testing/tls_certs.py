"""Throwaway certificate authorities and certificates for TLS tests and ``python -m tdist.bench --tls``
(made with the ``openssl`` command-line tool; :data:`OPENSSL` is None where it is missing).

:func:`make_pki` writes, under a directory: ``ca.pem`` (a CA), ``node.pem``/``node.key`` (a
certificate signed by it naming 127.0.0.1 (not localhost), used by servers and clients alike) and
``other-ca.pem`` (an unrelated CA, for "wrong CA" tests). :func:`tls_env` gives the
``TDIST_TLS_*`` variables that use them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Dict

__all__ = ["make_pki", "tls_env", "OPENSSL"]

OPENSSL = shutil.which("openssl")
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    if OPENSSL is None:
        raise RuntimeError("making test certificates needs the openssl command-line tool, which is not installed")
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> None:
    _openssl(
        "req",
        "-x509",
        *_KEY,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        "-subj",
        f"/CN=tdist test {name}",
        cwd=directory,
    )


def make_pki(directory: Path) -> Path:
    """Write the CAs and the node certificate into ``directory``; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    _ca(directory, "ca")
    _ca(directory, "other-ca")
    (directory / "node.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", *_KEY, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=tdist node", cwd=directory)
    _openssl(
        "x509",
        "-req",
        "-in",
        "node.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "node.pem",
        "-days",
        "2",
        "-extfile",
        "node.ext",
        cwd=directory,
    )
    return directory


def tls_env(pki: Path, ca: str = "ca.pem", client_auth: bool = False) -> Dict[str, str]:
    """The ``TDIST_TLS_*`` variables of a process using the node certificate and ``ca``."""
    env = {
        "TDIST_TLS_CERT": str(pki / "node.pem"),
        "TDIST_TLS_KEY": str(pki / "node.key"),
        "TDIST_TLS_CA": str(pki / ca),
    }
    if client_auth:
        env["TDIST_TLS_CLIENT_AUTH"] = "1"
    return env
