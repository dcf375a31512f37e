"""``tdist.breakpoint``: pdb on one rank while the others wait for it (real processes)."""

from __future__ import annotations

import textwrap

import pytest

from tdist.testing.processes import python_job

PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    import tdist as dist

    rank = int(os.environ["RANK"])
    if rank == 0:  # what a user types at the pdb prompt
        os.dup2(os.open(sys.argv[1], os.O_RDONLY), 0)
    dist.init_process_group("tcp")
    secret = 6 * 7
    started = time.monotonic()
    dist.breakpoint(rank=0)
    print(f"rank {rank} continued after {time.monotonic() - started:.2f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(120)
def test_breakpoint_stops_one_rank_and_the_others_wait(tmp_path):
    program, commands = tmp_path / "program.py", tmp_path / "commands"
    program.write_text(PROGRAM)
    commands.write_text("up\np secret\nimport time; time.sleep(1.5)\nc\n")
    rank0, rank1 = python_job([str(program), str(commands)], 2, timeout=90)
    assert rank0.returncode == 0 and rank1.returncode == 0, rank0.stderr[-2000:] + rank1.stderr[-2000:]
    assert "42" in rank0.stdout and "(Pdb)" in rank0.stdout, rank0.stdout
    assert "(Pdb)" not in rank1.stdout
    waited = float(rank1.stdout.split("continued after ")[1].split()[0])
    assert waited >= 1.0, f"rank 1 went on after {waited} s, while rank 0 was still in pdb"
