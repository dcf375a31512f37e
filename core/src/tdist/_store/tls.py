"""Optional TLS for tdist's TCP connections (the TCPStore, and the tcp backend's mesh between hosts).

Configured by environment variables (the same on every process of the job), or by a
:class:`TlsConfig` passed explicitly:

``TDIST_TLS_CERT``
    PEM certificate (chain) of this process: what its servers present, and what its
    clients present when a server asks for one.
``TDIST_TLS_KEY``
    the PEM private key of that certificate (default: read from ``TDIST_TLS_CERT``).
``TDIST_TLS_CA``
    PEM bundle of the certificate authorities that peers' certificates must chain to.
``TDIST_TLS_CHECK_HOSTNAME``
    ``1`` (default): a client checks that the server's certificate names the host it
    connects to (a DNS name or an IP address in the subjectAltName); ``0`` checks only the
    chain, for clusters addressed by IP whose certificates do not list every address.
``TDIST_TLS_CLIENT_AUTH``
    ``1``: servers require a client certificate chaining to ``TDIST_TLS_CA`` (mutual TLS).

TLS is on as soon as ``TDIST_TLS_CERT`` or ``TDIST_TLS_CA`` is set. A server needs a
certificate and key; a client needs the CA. A TLS client refuses a server without TLS and
a server with TLS refuses a client without it: there is no silent downgrade.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Mapping, Optional, Union

from .._flags import flag

__all__ = ["TlsConfig", "TlsError", "TLS_ENV", "WOULD_BLOCK", "TLS_RECORD_TYPE", "describe_ssl_error"]

TLS_ENV = ("TDIST_TLS_CERT", "TDIST_TLS_KEY", "TDIST_TLS_CA", "TDIST_TLS_CHECK_HOSTNAME", "TDIST_TLS_CLIENT_AUTH")
#: the first byte of every TLS handshake record (a ClientHello starts with it)
TLS_RECORD_TYPE = 0x16
#: raised by a non-blocking (or SO_RCVTIMEO-bounded) TLS socket that must wait
WOULD_BLOCK = (ssl.SSLWantReadError, ssl.SSLWantWriteError)


class TlsError(ValueError):
    """The TLS configuration is incomplete or its files cannot be loaded."""


def _setting(value: object) -> object:
    """A TLS option as :func:`flag` reads it: unset (None or empty) means the default."""
    return "" if value is None else value


@dataclass(frozen=True)
class TlsConfig:
    """Certificate files and checks of one process's TLS connections (see the module docstring)."""

    cert: Optional[str] = None
    key: Optional[str] = None
    ca: Optional[str] = None
    check_hostname: bool = True
    client_auth: bool = False

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> Optional["TlsConfig"]:
        """The configuration the ``TDIST_TLS_*`` variables give, or None when TLS is off."""
        env = os.environ if env is None else env
        return cls.from_mapping({k[len("TDIST_TLS_") :].lower(): env.get(k) for k in TLS_ENV})

    @classmethod
    def from_mapping(cls, options: Mapping[str, object]) -> Optional["TlsConfig"]:
        """From keys ``cert``, ``key``, ``ca``, ``check_hostname``, ``client_auth``; None when
        neither ``cert`` nor ``ca`` is given."""
        cert, key, ca = (str(options[k]) if options.get(k) else None for k in ("cert", "key", "ca"))
        if not cert and not ca:
            return None
        check_hostname = flag("TDIST_TLS_CHECK_HOSTNAME", True, _setting(options.get("check_hostname")))
        client_auth = flag("TDIST_TLS_CLIENT_AUTH", False, _setting(options.get("client_auth")))
        return cls(cert, key, ca, check_hostname, client_auth)

    @classmethod
    def resolve(cls, tls: Union["TlsConfig", None, bool]) -> Optional["TlsConfig"]:
        """A ``tls=`` argument: a config as is, None for the variables' config, True for the
        variables' config (which must exist), False for none."""
        if isinstance(tls, TlsConfig):
            return tls
        if tls is False:
            return None
        config = cls.from_env()
        if config is None and tls is True:
            raise TlsError(
                "tls=True but no TLS is configured: set TDIST_TLS_CA (clients) and TDIST_TLS_CERT / "
                "TDIST_TLS_KEY (servers), or pass a TlsConfig"
            )
        return config

    def server_context(self, where: str) -> ssl.SSLContext:
        """The context of a listening side (TLS 1.2+), requiring client certificates with ``client_auth``."""
        if not self.cert:
            raise TlsError(f"{where}: TLS is configured but a server needs a certificate (TDIST_TLS_CERT)")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_cert(ctx, where)
        if self.client_auth:
            self._load_ca(ctx, where)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self, where: str) -> ssl.SSLContext:
        """The context of a connecting side: verifies the server against ``ca`` (and its name
        unless ``check_hostname`` is off); presents ``cert`` when one is configured."""
        if not self.ca:
            raise TlsError(
                f"{where}: TLS is configured but a client needs the CA bundle to verify the server (TDIST_TLS_CA)"
            )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_ca(ctx, where)
        ctx.check_hostname = self.check_hostname
        ctx.verify_mode = ssl.CERT_REQUIRED
        if self.cert:
            self._load_cert(ctx, where)
        return ctx

    def _load_cert(self, ctx: ssl.SSLContext, where: str) -> None:
        try:
            ctx.load_cert_chain(self.cert, self.key)  # type: ignore[arg-type]
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(f"{where}: cannot load the TLS certificate {self.cert!r} / key {self.key!r}: {exc}") from exc

    def _load_ca(self, ctx: ssl.SSLContext, where: str) -> None:
        if not self.ca:
            raise TlsError(f"{where}: TDIST_TLS_CLIENT_AUTH needs the CA bundle (TDIST_TLS_CA)")
        try:
            ctx.load_verify_locations(cafile=self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(f"{where}: cannot load the TLS CA bundle {self.ca!r}: {exc}") from exc


def describe_ssl_error(exc: ssl.SSLError) -> str:
    """A sentence explaining a failed TLS handshake (wrong CA, name mismatch, a peer without TLS)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"the peer's certificate was rejected ({exc.verify_message or exc}): it does not chain to "
            "TDIST_TLS_CA, or does not name this address (TDIST_TLS_CHECK_HOSTNAME=0 checks only the chain)"
        )
    reason = getattr(exc, "reason", None) or str(exc)
    if "CERTIFICATE_REQUIRED" in reason:
        return "the server requires a client certificate (TDIST_TLS_CERT and TDIST_TLS_KEY) and got none"
    if reason in (
        "WRONG_VERSION_NUMBER",
        "RECORD_LAYER_FAILURE",
        "PACKET_LENGTH_TOO_LONG",
        "HTTP_REQUEST",
        "UNKNOWN_PROTOCOL",
    ):
        return f"the peer does not speak TLS ({reason}): it runs without TDIST_TLS_* configured"
    return f"TLS handshake failed: {exc}"
