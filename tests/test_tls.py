"""Optional TLS: the TCPStore and the tcp backend's mesh over TLS, and no silent downgrade either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from tdist._errors import DistStoreError
from tdist._store.tcp_store import TCPStore
from tdist._store.tls import TlsConfig

from tdist.testing.tls_certs import OPENSSL, make_pki, tls_env

from tdist.testing.processes import python_job

pytestmark = pytest.mark.skipif(
    OPENSSL is None,
    reason="the TLS tests make their certificates with the openssl command-line tool, which is not installed",
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls(pki: Path, **kwargs: object) -> TlsConfig:
    config = TlsConfig.from_env(tls_env(pki, **kwargs))  # type: ignore[arg-type]
    assert config is not None
    return config


def test_store_over_mutual_tls_with_a_token(pki):
    tls = _tls(pki, client_auth=True)
    with TCPStore("127.0.0.1", 0, is_master=True, tls=tls, token="secret", timeout=10) as master:
        assert master._lease is not None and master._lease.server.uses_tls
        client = TCPStore("127.0.0.1", master.port, tls=tls, token="secret", timeout=10)
        client.set("k", b"v" * (3 << 20))  # several TLS records in one request
        assert master.get("k") == b"v" * (3 << 20)
        master.set("late", "x")
        client.wait(["late"], timeout=5)
        assert client.add("n", 2) == 2 and master.add("n", 1) == 3
        with pytest.raises(DistStoreError, match="authentication failed"):
            TCPStore("127.0.0.1", master.port, tls=tls, token="wrong", timeout=5)
        client.close()


@pytest.mark.parametrize(
    "client, error",
    [
        ("plaintext", "the server requires TLS"),
        ("wrong CA", "certificate was rejected"),
        ("no client certificate", "requires a client certificate"),
    ],
)
def test_a_tls_server_refuses_clients_it_cannot_trust_at_once(pki, client, error):
    tls = _tls(pki, client_auth=True)
    options = {
        "plaintext": False,
        "wrong CA": _tls(pki, ca="other-ca.pem"),
        "no client certificate": TlsConfig(ca=str(pki / "ca.pem")),
    }[client]
    with TCPStore("127.0.0.1", 0, is_master=True, tls=tls, timeout=10) as master:
        with pytest.raises(DistStoreError, match=error) as info:  # at once: the 30 s timeout would fail the test
            TCPStore("127.0.0.1", master.port, tls=options, timeout=30)
        assert f"127.0.0.1:{master.port}" in str(info.value)
        master.set("still", "serving")
        assert master.get("still") == b"serving"


def test_a_tls_client_refuses_a_plaintext_server(pki):
    with TCPStore("127.0.0.1", 0, is_master=True, tls=False, timeout=10) as master:
        with pytest.raises(DistStoreError, match="does not speak TLS") as info:
            TCPStore("127.0.0.1", master.port, tls=_tls(pki), timeout=30)
        assert f"127.0.0.1:{master.port}" in str(info.value)
        master.set("still", "serving")
        assert master.get("still") == b"serving"


def test_hostname_check_is_on_by_default_and_can_be_turned_off(pki):
    tls = _tls(pki)
    with TCPStore("127.0.0.1", 0, is_master=True, tls=tls, timeout=10) as master:
        wrong_name = TlsConfig.from_env({**tls_env(pki), "TDIST_TLS_CHECK_HOSTNAME": "1"})
        assert wrong_name is not None
        # the certificate names 127.0.0.1, not "localhost"
        with pytest.raises(DistStoreError, match="certificate was rejected"):
            TCPStore("localhost", master.port, tls=wrong_name, timeout=30)
        chain_only = TlsConfig.from_env({**tls_env(pki), "TDIST_TLS_CHECK_HOSTNAME": "0"})
        with TCPStore("localhost", master.port, tls=chain_only, timeout=10) as client:
            client.set("a", "b")
        assert master.get("a") == b"b"


_SOCKETS_ONLY = {"TDIST_TCP_SHM": "0", "TDIST_TCP_UNIX": "0"}  # ranks on one host talk over TCP, as between hosts


def test_tcp_job_over_tls_sockets_with_env_init_a_token_and_mutual_tls(pki):
    results = python_job(
        [str(Path(__file__).with_name("tls_job.py")), "run"],
        2,
        timeout=120,
        TDIST_STORE_TOKEN="job-token",
        **_SOCKETS_ONLY,
        **tls_env(pki, client_auth=True),
    )
    for rank, result in enumerate(results):
        assert result.returncode == 0 and "TLS-JOB-OK" in result.stdout, (rank, result.stdout, result.stderr[-3000:])


def test_ranks_disagreeing_about_mesh_tls_fail_with_a_clear_error(pki):
    args = [str(pki / "ca.pem"), str(pki / "node.pem"), str(pki / "node.key")]
    results = python_job(
        [str(Path(__file__).with_name("tls_job.py")), "mesh-only", *args], 2, timeout=90, **_SOCKETS_ONLY
    )
    outputs = [r.stdout for r in results]
    assert all("INIT-FAILED" in out for out in outputs), [(r.stdout, r.stderr[-2000:]) for r in results]
    assert "a connection without TLS (this rank requires TLS" in outputs[0], outputs[0]
    assert "rank 0 requires TLS and this rank has none" in outputs[1], outputs[1]


def test_tls_true_without_configuration_is_refused_before_connecting(monkeypatch):
    for name in ("TDIST_TLS_CERT", "TDIST_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="tls=True but no TLS is configured"):
        TCPStore("127.0.0.1", 1, tls=True, timeout=1)


def test_tls_handshakes_share_the_deadline_and_the_cap(pki):
    """Connections that start TLS and stall are capped and cut off at the handshake deadline;
    a legitimate TLS client is served meanwhile."""
    import socket
    import time

    from tdist._store.tcp_server import TCPStoreServer

    with TCPStoreServer("127.0.0.1", 0, tls=_tls(pki), handshake_timeout=1.0, max_pending=4) as server:
        stalled = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
        try:
            for sock in stalled:
                sock.sendall(b"\x16\x03\x01")  # the start of a TLS record, then nothing
            with TCPStore("127.0.0.1", server.port, tls=_tls(pki), timeout=10) as client:
                client.set("k", "v")
                assert client.get("k") == b"v"
            assert server.pending_handshakes <= 4
            deadline = time.monotonic() + 10
            while server.pending_handshakes and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.pending_handshakes == 0
        finally:
            for sock in stalled:
                sock.close()
