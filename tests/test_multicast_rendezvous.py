"""The multicast ``tcp://`` rendezvous: ``tcp://<IPv4 or IPv6 multicast group>:port``.

First what needs no network: the datagrams' authentication, the rank table, the options
and the argument errors. Then real processes (tests/multihost_job.py, the job users would
write) on the hosts of a simulated cluster (tdist.testing.cluster), each host a network
namespace on one switch, so nothing reaches this machine's own network: jobs across two
hosts over IPv4 and IPv6, two jobs at the same moment on one address, an attacker on the
group, a job whose peers never come, a rank given twice, a host without a multicast
route and a switch that drops multicast.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from tdist.testing.processes import base_env
from test_multihost import JOB, NET, SIZE, check_job, finish, job_results
from tdist._errors import DistNetworkError
from tdist._rendezvous.multicast import Peer, _Rendezvous, assign_ranks
from tdist._rendezvous.multicast_socket import MulticastOptions
from tdist._rendezvous.multicast_wire import ANNOUNCE, OFFER, Datagram, Rejected, job_tag, pack, source_of, unpack
from tdist.testing.cluster import Cluster, unavailable_reason

GROUP4 = "239.255.77.1"
GROUP6 = "ff15:1e18:5d4c:4cf0:d02d:b659:53ba:b0a7"  # the example address of torch.distributed's 2017 docs
PORT = 23456  # every cluster has its own network: no other test can hold it
JOB_TIMEOUT = 90.0
_REASON = unavailable_reason()
needs_cluster = pytest.mark.skipif(_REASON is not None, reason=f"simulated cluster unavailable: {_REASON}")


# ------------------------------------------------------------------ no network
def test_datagrams_are_authenticated_and_kept_per_group():
    tag, token = job_tag("a"), b"secret"
    offer = Datagram(OFFER, b"s" * 16, 4, 2, b"r" * 16, 40000, "10.0.0.1")
    assert unpack(pack(offer, tag, token), tag, token) == offer
    assert unpack(pack(offer, tag, b""), tag, b"") == offer
    assert unpack(pack(offer, tag, token), job_tag("b"), token) is None  # another group: not even counted
    assert unpack(pack(offer, tag, b"other"), tag, token) is Rejected.BAD_MAC
    assert unpack(pack(offer, tag, b""), tag, token) is Rejected.UNAUTHENTICATED
    assert unpack(pack(offer, tag, token), tag, b"") is Rejected.UNEXPECTED_MAC
    forged = bytearray(pack(offer, tag, token))
    forged[-40] ^= 1  # the port, under the MAC
    assert unpack(bytes(forged), tag, token) is Rejected.BAD_MAC
    assert unpack(pack(offer, tag, token)[:-1], tag, token) is Rejected.MALFORMED
    assert unpack(pack(Datagram(ANNOUNCE, b"s" * 16, 2, 2), tag, b""), tag, b"") is Rejected.MALFORMED  # rank 2 of 2
    assert unpack(b"\x00" * 200, tag, b"") is None and unpack(b"TDMC", tag, b"") is None


def test_announcements_are_taken_only_from_the_source_they_name(monkeypatch):
    """A captured authenticated announcement replayed from another port or another address
    is dropped (counted), also when heard before the real one: a process's address in the
    rank table is the one its own datagrams name. A process learns its own source from
    its first datagram; others' datagrams that name no source yet are skipped, not counted."""
    monkeypatch.setenv("TDIST_STORE_TOKEN", "multicast-test-token")
    tag, token = job_tag("g"), b"multicast-test-token"
    udp = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
    try:
        listener, genuine, other_port, other_address = udp
        for sock, address in zip(udp, ("127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.2")):
            sock.bind((address, 0))
        listener.setblocking(False)
        where = listener.getsockname()
        rendezvous = _Rendezvous(listener, MulticastOptions(GROUP4, PORT), "g", -1, 3, timeout=10)
        peer = b"p" * 16
        source, source_port = source_of(genuine.getsockname())
        announce = Datagram(ANNOUNCE, peer, 3, -1, text="h0", source=source, source_port=source_port)
        captured = pack(announce, tag, token)
        other_port.sendto(captured, where)  # replays, heard first
        other_address.sendto(captured, where)
        genuine.sendto(pack(dataclasses.replace(announce, source_port=0), tag, token), where)  # no source yet
        genuine.sendto(captured, where)
        got = rendezvous.receive(time.monotonic() + 10)
        assert got is not None and got[0] == announce and got[1] == genuine.getsockname()
        assert rendezvous.rejected == {Rejected.WRONG_SOURCE: 2}
        assert rendezvous.peers[peer].address == "127.0.0.1" and list(rendezvous.peers) == [peer]
        listener.sendto(pack(rendezvous.announcement(), tag, token), where)  # its own first datagram
        got = rendezvous.receive(time.monotonic() + 10)
        assert got is not None and rendezvous.source == source_of(where)
        assert rendezvous.announcement().source_port == where[1] and rendezvous.me in rendezvous.peers
        offer = Datagram(OFFER, peer, 3, 1, rendezvous.me, 40000, "127.0.0.1", source, source_port)
        other_port.sendto(pack(offer, tag, token), where)  # an offer replayed from elsewhere: dropped too
        assert rendezvous.receive(time.monotonic() + 0.5) is None
        assert rendezvous.rejected == {Rejected.WRONG_SOURCE: 3}
    finally:
        for sock in udp:
            sock.close()


def test_rank_table():
    """Given ranks are kept; the others fill the free ranks host by host (by address)."""
    peers = [
        Peer(b"\x09" * 16, "10.0.0.2", "b", -1, 5),
        Peer(b"\x01" * 16, "10.0.0.10", "c", -1, 5),
        Peer(b"\x05" * 16, "10.0.0.2", "b", 0, 5),
        Peer(b"\x02" * 16, "10.0.0.2", "b", -1, 5),
        Peer(b"\x03" * 16, "10.0.0.1", "a", 4, 5),
    ]
    assert assign_ranks(peers, 5) == {
        b"\x05" * 16: 0,
        b"\x03" * 16: 4,
        b"\x02" * 16: 1,
        b"\x09" * 16: 2,
        b"\x01" * 16: 3,
    }


def test_options(monkeypatch):
    from urllib.parse import urlsplit

    def options(url: str) -> MulticastOptions:
        parsed = urlsplit(url)
        return MulticastOptions.from_url(parsed.hostname, parsed.port, parsed)

    monkeypatch.delenv("TDIST_MULTICAST_TTL", raising=False)
    monkeypatch.delenv("TDIST_MULTICAST_INTERFACE", raising=False)
    assert options(f"tcp://{GROUP4}:1") == MulticastOptions(GROUP4, 1, 1, "")
    assert options("tcp://[FF02::1%25eth1]:2") == MulticastOptions("ff02::1", 2, 1, "eth1")
    monkeypatch.setenv("TDIST_MULTICAST_TTL", "4")
    monkeypatch.setenv("TDIST_MULTICAST_INTERFACE", "eth9")
    assert options(f"tcp://{GROUP4}:1") == MulticastOptions(GROUP4, 1, 4, "eth9")
    assert options(f"tcp://{GROUP4}:1?ttl=0&interface=10.0.0.1") == MulticastOptions(GROUP4, 1, 0, "10.0.0.1")
    with pytest.raises(ValueError, match="ttl='256'.*0 to 255"):
        options(f"tcp://{GROUP4}:1?ttl=256")


def test_argument_errors(monkeypatch):
    """Refused before anything is sent: no world size, a rank out of range, no such interface."""
    import tdist as dist

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    timeout = timedelta(seconds=5)
    with pytest.raises(ValueError, match=r"world_size is required.*world_size=.*\?world_size=.*WORLD_SIZE"):
        dist.init_process_group("tcp", init_method=f"tcp://{GROUP4}:{PORT}", timeout=timeout)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="rank 2 is out of range for world_size 2"):
        dist.init_process_group("tcp", init_method=f"tcp://{GROUP4}:{PORT}?rank=2", timeout=timeout)
    with pytest.raises(DistNetworkError, match="no network interface named 'nosuch0'"):
        dist.init_process_group("tcp", init_method=f"tcp://[{GROUP6}]:{PORT}?interface=nosuch0", timeout=timeout)
    assert not dist.is_initialized()


# ------------------------------------------------------------------ real processes across hosts
def launch(placements, timeout: float = JOB_TIMEOUT, **popen) -> list:
    """Start ``(host, job arguments, environment)`` each, output captured; killed after ``timeout``."""
    return [
        host.popen(
            [sys.executable, JOB, "--backend", "tcp", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            timeout=timeout,
            **popen,
        )
        for host, args, env in placements
    ]


def failures(procs) -> list[str]:
    """Each process's stderr; every one must have failed (not timed out)."""
    outputs = [(p, *p.communicate()) for p in procs]
    for p, out, err in outputs:
        assert not p.timed_out and p.returncode not in (0, None), f"{p.host.hostname}: exit {p.returncode}\n{out}{err}"
    return [err for _, _, err in outputs]


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_jobs_across_hosts(tdist_cluster):
    """Two jobs start at the same moment on the same IPv4 group, then on the same IPv6
    group (the 2017 docs' example address), told apart by group_name only. Job "a": two processes per
    host, ranks assigned (host 0's get 0 and 1). Job "b": ranks 0 and 1 given, in reverse
    host order, rank 2 assigned, the interface and TTL set in the environment; on IPv4 a
    process that dies before it connects (a "ghost") is counted in first, and a process
    started after it takes its rank. Both jobs reduce
    over both hosts' links, and no process keeps a UDP socket on the port."""
    h0, h1 = tdist_cluster

    def job(world_size: int, group: str, rank: str = "") -> list[str]:
        query = f"?world_size={world_size}{rank}#{group}"
        return [
            "--size",
            str(SIZE),
            "--init-method",
            f"tcp://{GROUP4}:{PORT}{query}",
            "--init-method",
            f"tcp://[{GROUP6}]:{PORT}{query}",
        ]

    ghost = h1.popen(
        [sys.executable, NET, "mcast-ghost", GROUP4, str(PORT), "b", "3"],
        stdout=subprocess.PIPE,
        text=True,
        timeout=JOB_TIMEOUT,
    )
    job_a = launch([(host, job(4, "a"), base_env()) for host in (h0, h0, h1, h1)])
    options = base_env(TDIST_MULTICAST_INTERFACE="eth0", TDIST_MULTICAST_TTL="2")  # interface by name
    job_b = launch([(host, job(3, "b", f"&rank={1 - host.index}"), options) for host in (h0, h1)])
    job_b += launch([(h1, ["--hold", *job(3, "b")], options)], stdin=subprocess.PIPE)
    offered = ghost.communicate(timeout=JOB_TIMEOUT)[0].strip()
    job_b[-1].stdin.write("go\n")
    job_b[-1].stdin.flush()
    results = job_results([out for _, out, _ in finish(job_a + job_b)])  # fails showing every output
    assert offered == "offered 2", offered
    for family in (GROUP4, GROUP6):
        ran = [r for r in results if family in r["init_method"]]
        check_job(tdist_cluster, [r for r in ran if r["init_method"].endswith("#a")], 4, "tcp")
        b = sorted((r for r in ran if r["init_method"].endswith("#b")), key=lambda r: r["rank"])
        assert [(r["rank"], r["host"]) for r in b] == [(0, h1.hostname), (1, h0.hostname), (2, h1.hostname)], b
        assert all(r["reduced_ok"] and r["hosts"] == [h1.hostname, h0.hostname, h1.hostname] for r in b), b
        assert all(r["udp_open"] == 0 for r in ran), ran


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.tdist_cluster(3)
def test_attacks_and_failures(tdist_cluster):
    """At the same moment on one group, while an attacker on host 1 announces a fake process
    and offers every real one a place in its own store: a job with TDIST_STORE_TOKEN set
    forms as if the attacker were not there; the same job without a token is hijacked (it
    fails, naming the attacker's store or its fake process); a job whose third process
    never comes, and two processes given the same rank, fail with errors saying so; on host
    2, without a multicast route, a process fails at once. Meanwhile, in a second cluster
    whose switch drops multicast, each host's process times out having found only itself."""
    h0, h1, h2 = tdist_cluster
    url = f"tcp://{GROUP4}:{PORT}"
    forger = h1.popen(
        [sys.executable, NET, "mcast-forge", GROUP4, str(PORT), "60", "secure", "open"],
        stdout=subprocess.PIPE,
        text=True,
        timeout=JOB_TIMEOUT,
    )
    h2.run(["ip", "route", "del", "224.0.0.0/4"], check=True)

    def job(init: str, timeout: float = 30) -> list[str]:
        return ["--size", "4096", "--timeout", str(timeout), "--init-method", init]

    with Cluster(2, multicast=False) as deaf:  # meanwhile, on a switch that drops multicast
        unheard = launch([(host, job(f"{url}?world_size=2", timeout=3), base_env()) for host in deaf])
        assert forger.stdout.readline().strip() == "ready"
        token = base_env(TDIST_STORE_TOKEN="multicast-test-token")
        secure = launch(
            [
                (host, job(f"{url}?world_size=2&interface={host.address}#secure"), token)  # by address
                for host in (h0, h1)
            ]
        )
        hijacked = launch([(host, job(f"{url}?world_size=2#open"), base_env()) for host in (h0, h1)])
        lonely = launch([(h0, job(f"{url}?world_size=3#lonely", timeout=3), base_env())])
        twice = launch([(host, job(f"{url}?world_size=2&rank=1#twice"), base_env()) for host in (h0, h1)])
        unrouted = launch([(h2, job(f"{url}?world_size=2#unrouted"), base_env())])

        secured = job_results([out for _, out, _ in finish(secure)])
        assert [(r["rank"], r["host"], r["reduced_ok"], r["udp_open"]) for r in secured] == [
            (0, h0.hostname, True, 0),
            (1, h1.hostname, True, 0),
        ], secured
        for err in failures(hijacked):
            assert re.search(
                rf"the store at {re.escape(h1.address)}:\d+ offered rank 0 but gave it to another "
                r"process|3 processes \(.*forger.*\) announce this group but world_size is 2",
                err,
            ), err[-3000:]
        (err,) = failures(lonely)
        assert re.search(
            rf"found 1 of 3 processes within 3 s \(1 on {h0.hostname} \({h0.address}\)\)\. .*"
            "No process on another host was heard",
            err,
        ), err[-3000:]
        for err in failures(twice):
            assert re.search(rf"rank 1 is given to 2 processes \(on {h0.hostname} .*, {h1.hostname} .*\)", err), err[
                -3000:
            ]
        (err,) = failures(unrouted)
        assert re.search(
            rf"DistNetworkError: .*cannot join {GROUP4}:{PORT}: .*No such device.*no route for "
            "multicast",
            err,
        ), err[-3000:]
        forger.terminate()
        offers = json.loads(forger.communicate(timeout=30)[0])
        assert offers["secure"] >= 2 and offers["open"] >= 2, offers  # it answered every real process
        for host, err in zip(deaf, failures(unheard)):
            assert re.search(
                rf"found 1 of 2 processes within 3 s \(1 on {host.hostname} \({host.address}\)\)\. "
                ".*does the network between the hosts carry multicast",
                err,
            ), err[-3000:]
