"""``python -m tdist.bench``: a quick smoke run (2 ranks, all_reduce at 4 B and 1 KiB), the
report helpers, ``--core-overhead``, ``--recorder-overhead`` and ``--ddp``. No timing is asserted:
the machine is shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tdist.bench.__main__ import default_sizes, parse_size
from tdist.bench.report import annotate, bus_factor, table, write_csv

pytestmark = pytest.mark.timeout(300)


def _run(args, tmp_path, timeout=240):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "tdist.bench", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_smoke_all_reduce_two_ranks(tmp_path):
    out = tmp_path / "r.json"
    csv = tmp_path / "r.csv"
    proc = _run(
        [
            "--sizes",
            "4,1024",
            "--world-sizes",
            "2",
            "--ops",
            "all_reduce",
            "--repeats",
            "2",
            "--sample-time",
            "0.01",
            "--json",
            str(out),
            "--csv",
            str(csv),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all_reduce, 2 ranks" in proc.stdout
    assert "tcp/gloo" in proc.stdout
    data = json.loads(out.read_text())
    rows = data["results"]
    backends = {r["backend"] for r in rows}
    assert {"tcp", "gloo"} <= backends
    assert {(r["backend"], r["bytes"]) for r in rows} >= {("tcp", 4), ("tcp", 1024), ("gloo", 4), ("gloo", 1024)}
    for r in rows:
        assert r["world"] == 2 and r["op"] == "all_reduce" and r["time_s"] > 0 and r["busbw_GBps"] >= 0
    assert csv.read_text().splitlines()[0].startswith("world,op,bytes,backend,time_s")
    # progress by default: stderr is not a terminal here, so a line per case
    assert "[bench] world 2 (1 of 1): starting 2 workers" in proc.stderr
    assert "[bench] world 2, 1/2: all_reduce 4 B: tcp " in proc.stderr
    assert "[bench] world 2, 2/2: all_reduce 1 KiB: tcp " in proc.stderr


def test_progress_bar_on_a_terminal(capsys):
    from tdist.bench.workers import Progress

    bar = Progress("bar", 2, 2, under_mpi=False, tty=True)
    bar.case_done("all_reduce", 4, {"tcp": 1e-5})
    bar.case_done("barrier", 0, {"tcp": 2e-5})
    err = capsys.readouterr().err
    assert err.startswith("\r[bench] world 2 [############............] 1/2 all_reduce 4 B")
    assert "\r[bench] world 2 [########################] 2/2 barrier" in err and err.endswith("\n")
    assert Progress("bar", 2, 2, under_mpi=True, tty=True).mode == "lines"  # mpirun forwards output by lines
    assert Progress("bar", 2, 2, under_mpi=False, tty=False).mode == "lines"
    quiet = Progress(None, 2, 2, under_mpi=False)
    quiet.case_done("all_reduce", 4, {"tcp": 1e-5})
    assert capsys.readouterr().err == ""


def test_smoke_every_op_without_mpi(tmp_path):
    proc = _run(
        [
            "--sizes",
            "64",
            "--world-sizes",
            "2",
            "--no-mpi",
            "--repeats",
            "1",
            "--sample-time",
            "0.005",
            "--warmup",
            "1",
            "--quiet",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"):
        assert f"{op}, 2 ranks" in proc.stdout
    assert "[bench]" not in proc.stderr  # --quiet: no progress


def test_core_overhead_mode(tmp_path):
    proc = _run(["--core-overhead", "--iters", "200", "--repeats", "2"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "core's own cost" in proc.stdout and "bridge's own cost" in proc.stdout


def test_recorder_overhead_mode(tmp_path):
    out = tmp_path / "recorder.json"
    proc = _run(["--recorder-overhead", "--iters", "200", "--repeats", "2", "--json", str(out)], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "turning the recorder on (on - off)" in proc.stdout
    [row] = json.loads(out.read_text())["results"]
    assert row["off_us"] > 0 and row["recorder_us"] > 0 and row["null_us"] > 0


@pytest.mark.slow
def test_ddp_mode(tmp_path):
    """torch's DDP on tdist-tcp and on torch's gloo (and without DDP), side by side."""
    out = tmp_path / "ddp.json"
    proc = _run(["--ddp", "--world-sizes", "2", "--repeats", "1", "--ddp-steps", "1", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "torch DDP training step, 4.2M parameters" in proc.stdout
    rows = json.loads(out.read_text())["results"]
    assert {r["backend"] for r in rows} == {"tdist-tcp", "gloo", "local"}
    assert all(r["world"] == 2 and r["step_s"] > 0 for r in rows)


@pytest.mark.slow
def test_recovery_mode(tmp_path):
    """``--recovery``: the shrink rows (tcp, gloo, and mpi under mpirun --with-ft ulfm where
    it can shrink) and the restart row, each with a time."""
    from tdist.bench.recovery import recovery_backends

    out = tmp_path / "recovery.json"
    proc = _run(["--recovery", "--json", str(out)], tmp_path, timeout=420)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tdistrun --max-restarts 1" in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["results"]
    shrinking = [("shrink", b) for b in recovery_backends(("tcp", "gloo", "mpi"))]
    assert [(r["way"], r["backend"]) for r in rows] == [*shrinking, ("restart", "tcp")]
    assert shrinking[:2] == [("shrink", "tcp"), ("shrink", "gloo")], shrinking
    assert all(r["recover_s"] > 0 for r in rows) and all(r["detect_s"] > 0 for r in rows[:-1]), rows


@pytest.mark.slow
def test_recovery_from_a_cut_link():
    """``--recovery --hosts 2``: the survivors on host 0 detect the cut host and train on,
    shrunken; each row has both times, in that order. On gloo, whose timeout names no
    rank, the cut ranks are declared failed only because they run on another host (their
    processes, alive in another network namespace, are not taken for local ones)."""
    from tdist.testing.cluster import unavailable_reason

    why = unavailable_reason()
    if why:
        pytest.skip(why)
    from tdist.bench.recovery_hosts import recovery_hosts_bench

    rows = recovery_hosts_bench(["tcp", "gloo"], hosts=2, per_host=2, timeout=240.0)
    assert [(r["way"], r["backend"], r["world"], r["hosts"]) for r in rows] == [
        ("cut", "tcp", 4, 2),
        ("cut", "gloo", 4, 2),
    ], rows
    assert all(0 < r["detect_s"] < r["recover_s"] for r in rows), rows


@pytest.mark.slow
def test_scale_mode(tmp_path):
    """``--scale``: real worlds on tcp and gloo, a simulated world of ranks as threads."""
    out = tmp_path / "scale.json"
    args = ["--scale", "--world-sizes", "2", "--sim-worlds", "4", "--sim-procs", "2", "--json", str(out)]
    proc = _run(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["kind"], r["backend"], r["world"]) for r in rows] == [
        ("real", "tcp", 2),
        ("real", "gloo", 2),
        ("sim", "tcp", 4),
    ]
    assert all(r["init_s"] > 0 and r["threads"] > 0 and r["fds"] > 0 and r["rss_kib"] > 0 for r in rows), rows
    assert all(r["own_s"] >= r["init_s"] - 0.01 and r["fds_store"] > 0 and len(r["init_samples"]) == 1 for r in rows), (
        rows
    )
    assert rows[2]["ranks_per_proc"] == 2
    assert "byte-compiled the sources of tdist" in proc.stderr and "from the last rank entering" in proc.stdout


def test_store_mode(tmp_path):
    out = tmp_path / "store.json"
    proc = _run(
        [
            "--store",
            "--store-clients",
            "2",
            "--store-ops",
            "50",
            "--store-keys",
            "10",
            "--store-load-clients",
            "6",
            "--store-load-procs",
            "2",
            "--store-load-rounds",
            "2",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "multi_get of 10 keys" in proc.stdout and "2 clients x 50 add" in proc.stdout
    assert "load: 6 clients connected at once from 2 processes" in proc.stdout and "get p99" in proc.stdout
    result = json.loads(out.read_text())["results"][0]
    assert result["load_clients"] == 6
    for kind in ("tdist", "torch"):
        assert result[kind]["multi_get_s"] > 0 and result[kind]["adds_per_s"] > 0
        for name in ("connect_s", "set_p50_s", "set_p99_s", "get_p50_s", "get_p99_s"):
            assert result[kind]["load_" + name] > 0, (kind, name)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from tdist.bench.plot import plot

    rows = annotate(
        [
            {"world": 2, "op": "all_reduce", "bytes": n, "backend": b, "time_s": t}
            for n in (4, 1024, 1 << 20)
            for b, t in (("tcp", 1e-5), ("gloo", 3e-4))
        ]
    )
    path = tmp_path / "busbw.png"
    plot(str(path), rows, ["tcp", "gloo"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_helpers(tmp_path):
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == 0.75 and bus_factor("reduce_scatter", 2) == 0.5
    assert bus_factor("all_to_all", 4) == 0.75 and bus_factor("broadcast", 4) == 1.0
    rows = annotate(
        [
            {"world": 2, "op": "all_reduce", "bytes": 1 << 20, "backend": "tcp", "time_s": 1e-3},
            {"world": 2, "op": "all_reduce", "bytes": 1 << 20, "backend": "gloo", "time_s": 4e-3},
        ]
    )
    assert rows[0]["busbw_GBps"] == pytest.approx((1 << 20) / 1e-3 / 1e9)
    text = table(rows, ["tcp", "gloo"])
    assert "1 MiB" in text and "0.25x" in text
    write_csv(str(tmp_path / "x.csv"), rows)
    assert parse_size("256K") == 256 << 10 and parse_size("4MiB") == 4 << 20 and parse_size("4") == 4
    assert default_sizes(4, 64, 4) == [4, 16, 64]


@pytest.mark.skipif(__import__("shutil").which("openssl") is None, reason="--tls makes its certificates with openssl")
def test_tls_compares_tcp_with_and_without_tls(tmp_path):
    out = tmp_path / "tls.json"
    proc = _run(
        ["--tls", "--no-mpi", "--sizes", "64K", "--repeats", "1", "--sample-time", "0.01", "--json", str(out)], tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tcp+tls/tcp" in proc.stdout
    rows = json.loads(out.read_text())["results"]
    assert {(r["backend"], r["op"], r["bytes"], r["world"]) for r in rows} == {
        ("tcp", "all_reduce", 65536, 2),
        ("tcp+tls", "all_reduce", 65536, 2),
    }


def test_link_bound():
    from tdist.bench.hosts import format_bounds, link_bound

    assert link_bound("all_reduce", 16 << 20, 2, 1e9) == pytest.approx(16 * 2**20 * 8 / 1e9)
    assert link_bound("all_reduce", 1 << 20, 4, 1e9) == pytest.approx(1.5 * 2**20 * 8 / 1e9)
    assert link_bound("broadcast", 1 << 20, 2, 1e9) is None and link_bound("all_reduce", 8, 1, 1e9) is None
    rows = [
        {"backend": b, "op": "all_reduce", "bytes": 16 << 20, "time_s": t, "hosts": 2, "link_rate_bps": 1e9}
        for b, t in (("tcp", 0.2), ("gloo", 0.4))
    ]
    text = format_bounds(rows, ["tcp", "gloo"])
    assert "bound 134.2 ms" in text and "tcp 1.49x" in text and "gloo 2.98x" in text
    assert format_bounds([dict(r, link_rate_bps=None) for r in rows], ["tcp"]) == ""


def test_hosts_mode_runs_on_a_simulated_cluster(tmp_path):
    from tdist.testing.cluster import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"simulated cluster unavailable: {reason}")
    out = tmp_path / "hosts.json"
    args = ["--hosts", "2", "--ranks-per-host", "2", "--sizes", "4,1M", "--link-rate", "10gbit"]
    proc = _run(args + ["--repeats", "1", "--sample-time", "0.01", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "simulated cluster: 2 hosts x 2 ranks, links 10gbit" in proc.stdout
    assert "link bound" in proc.stdout and "tcp/gloo" in proc.stdout and "tcp+flat/gloo" in proc.stdout
    rows = json.loads(out.read_text())["results"]
    assert {(r["backend"], r["bytes"], r["world"], r["hosts"]) for r in rows} == {
        (b, n, 4, 2) for b in ("tcp", "tcp+flat", "gloo") for n in (4, 1 << 20)
    }
    assert all(r["link_rate_bps"] == 1e10 and r["time_s"] > 0 for r in rows)
