"""The ``indexed://`` init method: argument checks, ranks from the index variable,
and a real rendezvous of two ranks (threads, loopback)."""

from __future__ import annotations

import threading
import urllib.parse

import pytest
from tdist.testing import free_port

pytest.importorskip("tdist_template", reason="tdist-template is not installed: pip install -e <this folder> first")

from tdist_template.rendezvous import indexed_rendezvous


def _call(url: str, rank: int = -1, world_size: int = -1, group_name: str = ""):
    return indexed_rendezvous(
        urllib.parse.urlsplit(url), rank=rank, world_size=world_size, timeout=10.0, group_name=group_name
    )


@pytest.mark.parametrize(
    "url, rank, world_size, message",
    [
        ("indexed://:29500?world_size=2", 0, -1, "host missing"),
        ("indexed://localhost?world_size=2", 0, -1, "port number missing"),
        ("indexed://localhost:29500", 0, -1, "world_size is required"),
        ("indexed://localhost:29500?world_size=x", 0, -1, "not an integer"),
        ("indexed://localhost:29500?world_size=2", 0, 3, "conflicts"),
        ("indexed://localhost:29500?world_size=2", 2, -1, "out of range"),
        ("indexed://localhost:29500?world_size=2&index_var=TDIST_TEST_NO_SUCH_VAR", -1, -1, "TDIST_TEST_NO_SUCH_VAR"),
    ],
)
def test_bad_arguments_fail_before_connecting(url, rank, world_size, message):
    with pytest.raises(ValueError, match=message):
        _call(url, rank, world_size)


def test_rank_from_the_index_variable(monkeypatch):
    monkeypatch.setenv("MY_INDEX", "0")
    store, rank, world_size = _call(f"indexed://127.0.0.1:{free_port()}?world_size=1&index_var=MY_INDEX")
    try:
        assert (rank, world_size) == (0, 1)
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        store.close()


def test_two_ranks_meet():
    url = f"indexed://127.0.0.1:{free_port()}?world_size=2"
    stores = [None, None]

    def join(r):
        stores[r] = _call(url, rank=r, group_name="job-a")[0]

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        stores[1].set("from-1", b"hello")
        assert stores[0].get("from-1") == b"hello"
    finally:
        stores[1].close()
        stores[0].close()
