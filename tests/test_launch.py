"""tdistrun / python -m tdist.launch: environment (as torchrun sets it), arguments,
torchrun's options (restarts, several nodes, log files and filters), output prefixes,
failure propagation and clean shutdown (no orphan processes).

The launcher runs in a subprocess (its own session, killed if a test fails);
the worker scripts are written to tmp_path and need neither torch nor a backend.
Real tdist programs under torchrun and tdistrun are in test_torchrun.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tdist.testing import free_port
from tdist.testing.processes import JOB_MARKER, JobResult, base_env, kill_session, pid_alive, run_job

pytestmark = pytest.mark.timeout(90)

LAUNCH = [sys.executable, "-m", "tdist.launch"]
TDISTRUN = [sys.executable, "-c", "import sys; from tdist.launch import main; sys.exit(main())"]
ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TDIST_STORE_PREFIX",
)

REPORT = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in %r}}))
""" % (ENV_KEYS,)


def write(tmp_path: Path, name: str, code: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


def launch(args, timeout: float = 60, env=None, cwd=None, launcher=LAUNCH) -> JobResult:
    """Run the launcher to completion; its whole session is killed past ``timeout``."""
    return run_job([[*launcher, *args]], [env or base_env()], timeout, cwd)[0]


def reports(stdout: str) -> dict[int, dict]:
    """{rank from the prefix: the JSON the worker printed}."""
    found = {}
    for line in stdout.splitlines():
        assert line.startswith("[rank "), f"unprefixed line: {line!r}"
        prefix, _, payload = line.partition("] ")
        found[int(prefix[len("[rank ") :])] = json.loads(payload)
    return found


def wait_for_lines(path: Path, count: int, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            lines = path.read_text().split()
            if len(lines) >= count:
                return lines
        time.sleep(0.05)
    raise AssertionError(
        f"{path}: expected {count} lines within {timeout} s, got {path.read_text() if path.exists() else 'no file'}"
    )


def all_dead(pids, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


# --------------------------------------------------------------------------- environment and arguments
def test_sets_env_and_passes_local_rank(tmp_path):
    script = write(tmp_path, "report.py", REPORT)
    res = launch(["--nproc_per_node", "3", script, "a", "--flag"])
    assert res.returncode == 0, res.stderr
    found = reports(res.stdout)
    assert sorted(found) == [0, 1, 2]
    ports = {found[r]["env"]["MASTER_PORT"] for r in found}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536  # the port the agent's store listens on
    prefixes = {found[r]["env"]["TDIST_STORE_PREFIX"] for r in found}
    assert len(prefixes) == 1 and prefixes.pop().startswith("tdist/")
    for rank, rep in found.items():
        assert rep["argv"] == [f"--local_rank={rank}", "a", "--flag"]
        env = rep["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        # one node and no --master-port: torchrun's private c10d rendezvous on "localhost:0"
        assert env["MASTER_ADDR"] == "localhost" and env["GROUP_RANK"] == "0"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_use_env_and_dashed_spellings(tmp_path):
    script = write(tmp_path, "report.py", REPORT)
    port = str(free_port())
    res = launch(["--nproc-per-node=2", "--use-env", "--master-port", port, "--master-addr", "localhost", script, "x"])
    assert res.returncode == 0, res.stderr
    found = reports(res.stdout)
    for rank, rep in found.items():
        assert rep["argv"] == ["x"]  # no --local_rank with --use_env
        assert rep["env"]["LOCAL_RANK"] == str(rank)
        assert rep["env"]["MASTER_PORT"] == port and rep["env"]["MASTER_ADDR"] == "localhost"
        assert rep["env"]["TORCHELASTIC_RUN_ID"] == "none"  # static rendezvous: torchrun's default id


def test_local_rank_argument_spellings(tmp_path):
    """tdistrun passes no argument (torchrun); python -m tdist.launch passes --local_rank=N;
    --local-rank-arg picks the spelling with either."""
    script = write(tmp_path, "report.py", REPORT)
    cases = [  # tdistrun without the option: test_tdistrun_console_script
        (TDISTRUN, ["--local-rank-arg", "local_rank"], ["--local_rank=1"]),
        (LAUNCH, ["--local-rank-arg", "local-rank"], ["--local-rank=1"]),
    ]
    for launcher, options, expected in cases:
        res = launch(["--nproc-per-node", "2", *options, script, "y"], launcher=launcher)
        assert res.returncode == 0, res.stderr
        assert reports(res.stdout)[1]["argv"] == [*expected, "y"], (launcher, options)


def test_two_nodes_static_rendezvous(tmp_path):
    """--nnodes 2: two launchers (two "nodes" on this host) meet at --master-addr/--master-port,
    which node 0's agent holds from its start; ranks follow --node-rank."""
    script = write(tmp_path, "report.py", REPORT)
    port = str(free_port())
    commands = [
        [
            *LAUNCH,
            "--nnodes",
            "2",
            "--node_rank",
            str(node),
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            "--use_env",
            script,
        ]
        for node in (0, 1)
    ]
    found = {}
    for node, res in enumerate(run_job(commands, [base_env()] * 2, timeout=60)):
        assert res.returncode == 0, res.stderr
        node_reports = reports(res.stdout)
        assert sorted(node_reports) == [2 * node, 2 * node + 1]
        found.update(node_reports)
    for rank, rep in found.items():
        env = rep["env"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank % 2) and env["GROUP_RANK"] == str(rank // 2)
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == port
    assert len({rep["env"]["TDIST_STORE_PREFIX"] for rep in found.values()}) == 1  # both nodes use one prefix


def test_module_mode(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(REPORT)
    env = base_env(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    res = launch(["--nproc_per_node", "2", "-m", "mypkg.job", "--lr", "0.1"], env=env)
    assert res.returncode == 0, res.stderr
    found = reports(res.stdout)
    assert found[1]["argv"] == ["--local_rank=1", "--lr", "0.1"]


def test_run_path_and_nproc_per_node_auto(tmp_path):
    """--run-path runs the script with runpy.run_path; --nproc-per-node auto starts one worker
    per CPU here (no accelerator), as torchrun decides. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (torchrun: a free port for rank 0 to bind later) is ignored: the workers use the agent's store."""
    from torch.distributed.run import determine_local_world_size

    script = write(tmp_path, "report.py", REPORT)
    res = launch(
        ["--nproc-per-node", "auto", "--run-path", script, "z"],
        launcher=TDISTRUN,
        env=base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
    )
    assert res.returncode == 0, res.stderr
    found = reports(res.stdout)
    assert sorted(found) == list(range(determine_local_world_size("auto")))
    assert all(rep["argv"] == ["z"] for rep in found.values())
    assert all(rep["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True" for rep in found.values())
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is ignored" in res.stderr


def test_bad_arguments_fail_before_starting_anything():
    res = launch(["--no_python", "/bin/true"])
    assert res.returncode == 2 and "--use_env" in res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize(
    "options,message",
    [
        (["--nnodes", "2", "--node_rank", "2"], "--node_rank 2 is out of range"),
        (["--nnodes", "2:1"], "need 0 < MIN <= MAX"),
        (["--nnodes", "1:2:3"], "must be N or MIN:MAX"),
        (["--nproc-per-node", "0"], "must be at least 1"),
        (["--redirects", "7"], "--redirects '7'"),
        (["--local-ranks-filter", "0,x"], "--local-ranks-filter must be local ranks"),
        (["--use-env", "--local-rank-arg", "local-rank"], "contradict"),
        (["--max-restarts", "-1"], "must not be negative"),
        (["--no-python", "-m"], "cannot be used together"),
    ],
)
def test_bad_options_are_refused(options, message, capsys):
    from tdist.launch import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args([*options, "script.py"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_option_spellings():
    """torch.distributed.launch's underscores and torchrun's dashes name the same options."""
    from tdist.launch import parse_args

    for spelling in (["--no_prefix", "--grace_period", "2"], ["--no-prefix", "--grace-period", "2"]):
        args = parse_args([*spelling, "script.py"])
        assert args.no_prefix and args.grace_period == 2.0


# --------------------------------------------------------------------------- output
def test_prefixes_stdout_and_stderr_lines(tmp_path):
    script = write(
        tmp_path,
        "talk.py",
        """
        import os, sys
        rank = os.environ["RANK"]
        for i in range(3):
            print(f"out {i} from {rank}")
        print(f"err from {rank}", file=sys.stderr)
        sys.stdout.write("no newline at the end")
    """,
    )
    res = launch(["--nproc_per_node", "2", script])
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        for i in range(3):
            assert f"[rank {rank}] out {i} from {rank}\n" in res.stdout
        assert f"[rank {rank}] no newline at the end\n" in res.stdout
        assert f"[rank {rank}] err from {rank}\n" in res.stderr
    assert all(line.startswith("[rank ") for line in res.stdout.splitlines())


def test_no_prefix(tmp_path):
    script = write(
        tmp_path,
        "talk.py",
        """
        import os, sys
        sys.stdout.write("plain out %s\\n" % os.environ["RANK"])
        sys.stderr.write("plain err %s\\n" % os.environ["RANK"])
    """,
    )
    res = launch(["--nproc_per_node", "2", "--no_prefix", script])
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["plain out 0", "plain out 1"]
    assert sorted(res.stderr.splitlines()) == ["plain err 0", "plain err 1"]


TALK = """
import os, sys
rank = os.environ["RANK"]
print(f"out from {rank}")
print(f"err from {rank}", file=sys.stderr)
"""


def log_files(log_dir: Path, name: str) -> dict[int, str]:
    """{local rank: text} of ``<log_dir>/<run id>_*/attempt_0/<local rank>/<name>``."""
    (run_dir,) = log_dir.iterdir()
    attempt = run_dir / "attempt_0"
    return {int(d.name): (d / name).read_text() for d in attempt.iterdir() if (d / name).exists()}


def test_local_ranks_filter(tmp_path):
    script = write(tmp_path, "talk.py", TALK)
    res = launch(["--nproc-per-node", "3", "--local-ranks-filter", "1", script], launcher=TDISTRUN)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "[rank 1] out from 1\n"
    assert "[rank 1] err from 1\n" in res.stderr and "from 0" not in res.stderr and "from 2" not in res.stderr


def test_redirects_and_tee_write_log_files(tmp_path):
    """--redirects 3: both streams only to <log-dir>/<run>/attempt_0/<local rank>/std{out,err}.log;
    --tee 1: stdout to its file and (prefixed) to the console, stderr to the console only."""
    script = write(tmp_path, "talk.py", TALK)
    redirected = tmp_path / "redirected"
    res = launch(["--nproc-per-node", "2", "--redirects", "3", "--log-dir", str(redirected), script], launcher=TDISTRUN)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and "from" not in res.stderr
    assert log_files(redirected, "stdout.log") == {0: "out from 0\n", 1: "out from 1\n"}
    assert log_files(redirected, "stderr.log") == {0: "err from 0\n", 1: "err from 1\n"}

    teed = tmp_path / "teed"
    res = launch(["--nproc-per-node", "2", "--tee", "1", "--log-dir", str(teed), script], launcher=TDISTRUN)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[rank 0] out from 0", "[rank 1] out from 1"]
    assert "[rank 0] err from 0\n" in res.stderr
    assert log_files(teed, "stdout.log") == {0: "out from 0\n", 1: "out from 1\n"}
    assert log_files(teed, "stderr.log") == {}


def _json_objects(text: str) -> list[dict]:
    """The JSON objects printed one after the other in ``text``: workers that share a pipe
    may write one's newline after the other's object (print writes the two separately)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return found
        obj, at = decoder.raw_decode(text, at)
        found.append(obj)


def test_variables_as_torchrun_sets_them(tmp_path):
    """Every variable torchrun gives its workers, tdistrun gives too, with the same values
    (those that name this run's files, ids and ports aside)."""
    script = write(tmp_path, "env.py", "import json, os; print(json.dumps(dict(os.environ)))")
    options = ["--nproc-per-node", "2", "--max-restarts", "2", "--role", "trainer", "--log-dir", str(tmp_path)]
    torchrun = [sys.executable, "-c", "import sys; from torch.distributed.run import main; sys.exit(main())"]
    ours = launch([*options, script], launcher=TDISTRUN)
    assert ours.returncode == 0, ours.stderr
    theirs = launch([*options, script], launcher=torchrun)
    assert theirs.returncode == 0, theirs.stderr
    by_rank = {env["RANK"]: env for env in _json_objects(theirs.stdout)}
    base = base_env()
    varying = {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_PORT", JOB_MARKER}  # the harness's per job
    for rank, mine in reports(ours.stdout).items():
        torch_env = by_rank[str(rank)]
        added = {k for k in torch_env if base.get(k) != torch_env[k]}
        assert {"TORCHELASTIC_RESTART_COUNT", "ROLE_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"} <= added
        assert added <= set(mine), added - set(mine)
        assert {k: mine[k] for k in added - varying} == {k: torch_env[k] for k in added - varying}
        assert mine["ROLE_NAME"] == "trainer" and mine["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert mine["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{rank}/error.json")


# --------------------------------------------------------------------------- restarts
FLAKY = """
import json, os, sys
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"attempt {attempt} of {os.environ['TORCHELASTIC_MAX_RESTARTS']} restarts", flush=True)
if rank == "1" and (attempt == "0" or "--always" in sys.argv):
    if "--always" in sys.argv:  # what torch's @record writes for an exception
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": "ValueError: boom", "extraInfo": {"timestamp": "0"}}}, f)
    sys.exit(4)
"""


def test_max_restarts_restarts_the_whole_group(tmp_path):
    """rank 1 fails in attempt 0; the agent stops rank 0 too, starts both again with
    TORCHELASTIC_RESTART_COUNT=1, and the job succeeds. A worker that keeps failing ends
    the job with its exit status once the restarts are spent, and its error file's message."""
    script = write(tmp_path, "flaky.py", FLAKY)
    res = launch(["--nproc-per-node", "2", "--max-restarts", "1", script], launcher=TDISTRUN)
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] attempt 1 of 1 restarts" in res.stdout
    assert "[rank 1] attempt 0 of 1 restarts" in res.stdout
    assert "rank 1 (local rank 1" in res.stderr and "failed with exit code 4" in res.stderr
    assert "restarting the worker group (restart 1 of 1)" in res.stderr

    res = launch(["--nproc-per-node", "2", "--max-restarts", "1", script, "--always"], launcher=TDISTRUN)
    assert res.returncode == 4
    assert res.stdout.count("[rank 1] attempt") == 2
    assert "tdistrun: root cause: rank 1 failed with exit code 4 after 1 restart(s): ValueError: boom" in res.stderr


# --------------------------------------------------------------------------- failures and signals
SLEEPER = """
import os, signal, subprocess, sys, time
rank = int(os.environ["RANK"])
pids = [os.getpid()]
if "--child" in sys.argv:  # a grandchild of the launcher, in the worker's session
    pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]).pid)
if "--ignore-term" in sys.argv and rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[-1], "a") as f:
    f.write("".join(f"{p}\\n" for p in pids))
print("started", flush=True)
if "--fail" in sys.argv and rank == 1:
    time.sleep(1.5)
    print("rank 1 fails now", file=sys.stderr, flush=True)
    sys.exit(3)
if "--kill-self" in sys.argv and rank == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    time.sleep(120)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(0)
"""


def test_failing_worker_stops_the_others_and_its_code_propagates(tmp_path):
    script = write(tmp_path, "sleeper.py", SLEEPER)
    pids_file = tmp_path / "pids"
    start = time.monotonic()
    res = launch(
        ["--nproc_per_node", "3", "--grace-period", "2", "--use_env", script, "--fail", "--child", str(pids_file)]
    )
    elapsed = time.monotonic() - start
    assert res.returncode == 3, res.stderr
    assert "rank 1" in res.stderr and "exit code 3" in res.stderr
    assert "[rank 1] rank 1 fails now" in res.stderr
    assert elapsed < 30
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) >= 2
    assert all_dead(pids), [p for p in pids if pid_alive(p)]


def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    script = write(tmp_path, "sleeper.py", SLEEPER)
    pids_file = tmp_path / "pids"
    start = time.monotonic()
    res = launch(
        ["--nproc_per_node", "2", "--grace_period", "1", "--use_env", script, "--fail", "--ignore-term", str(pids_file)]
    )
    assert res.returncode == 3
    assert "SIGKILL" in res.stderr and "rank(s) [0]" in res.stderr
    assert time.monotonic() - start < 30
    assert all_dead([int(p) for p in pids_file.read_text().split()])


def test_worker_killed_by_a_signal(tmp_path):
    script = write(tmp_path, "sleeper.py", SLEEPER)
    res = launch(
        ["--nproc_per_node", "2", "--grace_period", "1", "--use_env", script, "--kill-self", str(tmp_path / "pids")]
    )
    assert res.returncode == 128 + signal.SIGKILL
    assert "rank 1" in res.stderr and "SIGKILL" in res.stderr


def _start_and_wait(tmp_path, extra, count):
    script = write(tmp_path, "sleeper.py", SLEEPER)
    pids_file = tmp_path / "pids"
    proc = subprocess.Popen(
        [
            *LAUNCH,
            "--nproc_per_node",
            "2",
            "--grace_period",
            "3",
            "--log-dir",
            str(tmp_path / "logs"),
            "--use_env",
            script,
            *extra,
            str(pids_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=base_env(),
        start_new_session=True,
    )
    try:
        pids = [int(p) for p in wait_for_lines(pids_file, count)]
    except BaseException:
        kill_session(proc.pid)
        proc.communicate()
        raise
    return proc, pids


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_is_forwarded_and_leaves_no_orphans(tmp_path, signum):
    proc, pids = _start_and_wait(tmp_path, ["--child"], 4)
    try:
        time.sleep(0.3)  # let the workers reach their sleep (and KeyboardInterrupt handler)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        kill_session(proc.pid)
    assert proc.returncode == 128 + signum, err
    assert signal.Signals(signum).name in err
    if signum == signal.SIGINT:
        assert out.count("interrupted") == 2, out  # the workers got the SIGINT itself
    assert all_dead(pids), [p for p in pids if pid_alive(p)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_workers_die_with_a_killed_launcher(tmp_path):
    proc, pids = _start_and_wait(tmp_path, [], 2)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        assert all_dead(pids), [p for p in pids if pid_alive(p)]
    finally:
        for pid in pids:
            kill_session(pid)


def test_tdistrun_console_script(tmp_path):
    tdistrun = Path(sys.executable).parent / "tdistrun"
    if not tdistrun.exists():
        pytest.skip("tdistrun is not installed (pip install -e core)")
    script = write(tmp_path, "report.py", REPORT)
    res = subprocess.run(
        [str(tdistrun), "--nproc_per_node", "2", script, "w"],
        capture_output=True,
        text=True,
        env=base_env(),
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    found = reports(res.stdout)
    assert sorted(found) == [0, 1]
    assert found[1]["argv"] == ["w"]  # as torchrun: LOCAL_RANK only, no --local_rank argument
