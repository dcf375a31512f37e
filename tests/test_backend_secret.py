"""The ``secret`` the core passes to backend factories (tdist._secret): derived from the
token of the TCPStore under the group's store, else from $TDIST_STORE_TOKEN; empty
without a token; never the token itself, and different per backend name."""

from __future__ import annotations

import hashlib
import hmac

import pytest
import tdist
from tdist._secret import backend_secret


@pytest.fixture
def no_env_token(monkeypatch):
    monkeypatch.delenv("TDIST_STORE_TOKEN", raising=False)


def _derived(token: bytes, backend: str) -> bytes:
    return hmac.new(token, b"tdist backend secret v1\0" + backend.encode(), hashlib.sha256).digest()


def test_secret_comes_from_the_tcp_store_under_the_prefixes(no_env_token):
    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, token="s3cret", timeout=10)
    try:
        wrapped = tdist.PrefixStore("tcp", tdist.PrefixStore("pg0", store))
        secret = backend_secret(wrapped, "tcp")
        assert secret == _derived(b"s3cret", "tcp") and len(secret) == 32
        assert b"s3cret" not in secret
        assert backend_secret(wrapped, "gloo") != secret
    finally:
        store.close()


def test_a_tcp_store_without_token_gives_no_secret(monkeypatch):
    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, token="", timeout=10)
    try:
        monkeypatch.setenv("TDIST_STORE_TOKEN", "other")  # the store's own (empty) token decides
        assert backend_secret(tdist.PrefixStore("pg0", store), "tcp") == b""
    finally:
        store.close()


def test_stores_without_a_token_fall_back_to_the_environment(monkeypatch, tmp_path):
    store = tdist.FileStore(str(tmp_path / "f"), -1)
    monkeypatch.delenv("TDIST_STORE_TOKEN", raising=False)
    assert backend_secret(store, "tcp") == b""
    monkeypatch.setenv("TDIST_STORE_TOKEN", "env-token")
    assert backend_secret(tdist.PrefixStore("pg0", store), "tcp") == _derived(b"env-token", "tcp")


def test_secret_is_passed_only_to_factories_that_take_it(no_env_token, tmp_path):
    from tdist._secret import secret_argument

    store = tdist.FileStore(str(tmp_path / "f"), -1)

    def old(*, store, rank, world_size, timeout, options, global_ranks):  # before the argument existed
        return None

    def explicit(*, store, rank, secret=b"", **kwargs):
        return None

    assert secret_argument(old, store, "x") == {}
    assert secret_argument(explicit, store, "x") == {"secret": b""}
    assert secret_argument(lambda **kw: None, store, "x") == {"secret": b""}
