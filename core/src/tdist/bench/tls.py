"""``python -m tdist.bench --tls``: the tcp backend over sockets with TLS against without, in one run.

Both ranks of each world run on this host with shared memory and Unix sockets off, so every
byte crosses a TCP connection as it would between hosts; the ``tcp+tls`` backend is the same
backend with the ``tls_*`` options of a throwaway certificate authority (made with the
``openssl`` tool, deleted afterwards). The ratio column divides by plain ``tcp``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from ..testing.tls_certs import make_pki
from .workers import OPS

__all__ = ["configure_tls_bench", "TLS_BACKEND"]

TLS_BACKEND = "tcp+tls"
_SOCKETS_ONLY = ["tcp:shm=false", "tcp:unix=false", f"{TLS_BACKEND}:shm=false", f"{TLS_BACKEND}:unix=false"]


def configure_tls_bench(args: argparse.Namespace) -> str:
    """Set ``args`` up for the TLS comparison (all_reduce of 16 MiB on 2 ranks unless other
    ops, sizes or world sizes were given); returns the certificates' directory to delete."""
    directory = tempfile.mkdtemp(prefix="tdist-bench-tls-")
    try:
        pki = make_pki(Path(directory))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    if args.ops == ",".join(OPS):
        args.ops = "all_reduce"
    if not args.sizes:
        args.sizes = "16M"
    if args.world_sizes == "2,4":
        args.world_sizes = "2"
    args.backends = f"tcp,{TLS_BACKEND}"
    args.reference = "tcp"
    args.option = (
        list(args.option)
        + _SOCKETS_ONLY
        + [
            f"{TLS_BACKEND}:tls_cert={pki / 'node.pem'}",
            f"{TLS_BACKEND}:tls_key={pki / 'node.key'}",
            f"{TLS_BACKEND}:tls_ca={pki / 'ca.pem'}",
        ]
    )
    return directory
