"""Programs written for torch.distributed, run by tests/test_torch_bridge.py in real
processes (under torchrun, or with RANK/WORLD_SIZE/MASTER_* set as a launcher would).

    python tests/torch_programs.py train --backend tdist-tcp --out DIR
    python tests/torch_programs.py disagree --out DIR --port PORT
    python tests/torch_programs.py side --out DIR

``train`` is a plain torch program that never imports tdist: torch's extension
autoloading registered ``tdist-<name>``; it trains torch's DistributedDataParallel with a
DistributedSampler and compares with one process on the full data. ``disagree`` starts
a world whose ranks name different backends, through tdist's API and through torch's.
``side`` keeps torch's default group on torch's gloo and makes a side group on
``tdist-tcp`` (tdist itself is never initialised): collectives and the group's
``monitored_barrier`` work on it.
Each rank writes what it saw to ``DIR/rank<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

FEATURES, OUTPUTS, SAMPLES, STEPS = 8, 4, 32, 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUTPUTS))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(SAMPLES, FEATURES, generator=gen), torch.randn(SAMPLES, OUTPUTS, generator=gen)


def _sgd(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.1)
            p.grad = None


def train(backend: str) -> dict:
    result = {
        "tdist_imported_before_init": "tdist" in sys.modules,
        "registered": f"{backend.upper()}" in dist.Backend._plugins,
    }
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _data()
    sampler = DistributedSampler(range(SAMPLES), shuffle=False)
    mine = torch.tensor(list(sampler))
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for _ in range(STEPS):
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        _sgd(model)
    reference = _model()
    for _ in range(STEPS):
        F.mse_loss(reference(x), y).backward()
        _sgd(reference)
    pairs = zip(model.parameters(), reference.parameters())
    result["max_diff"] = max(float((a - b).abs().max()) for a, b in pairs)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, rank)
    result["gathered"] = everyone
    pair = dist.new_group([0, 1])
    t = torch.ones(2)
    dist.all_reduce(t, group=pair)
    result["pair_sum"] = t.tolist()
    result["torch_backend"] = str(dist.get_backend())
    import tdist  # the creator imported it: its API now works on the same group

    result["tdist_backend"] = tdist.get_backend()
    result["same_world"] = tdist.group.WORLD is dist.group.WORLD
    result["tdist_rank_of_pair"] = tdist.get_rank(pair)
    dist.destroy_process_group()
    result["tdist_initialized_after_destroy"] = tdist.is_initialized()
    result["rank"] = rank
    return result


def disagree(port: int) -> dict:
    import tdist

    rank = int(os.environ["RANK"])
    result: dict = {"rank": rank}
    timeout = timedelta(seconds=60)
    try:
        tdist.init_process_group("tcp" if rank == 0 else "gloo", timeout=timeout)
        result["tdist"] = "initialized"
    except tdist.DistError as exc:
        result["tdist"] = str(exc)
    try:
        dist.init_process_group(
            "tdist-tcp" if rank == 0 else "tdist-gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timeout,
        )
        result["torch"] = "initialized"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["torch"] = f"{type(exc).__name__}: {exc}"
    return result


def side() -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group(backend="tdist-tcp")
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t, group=group)
    group.monitored_barrier(timedelta(seconds=30))
    result = {"rank": dist.get_rank(), "sum": t.tolist(), "backend": str(dist.get_backend(group))}
    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("train", "disagree", "side"))
    parser.add_argument("--backend", default="tdist-tcp")
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    modes = {"train": lambda: train(args.backend), "disagree": lambda: disagree(args.port), "side": side}
    result = modes[args.mode]()
    with open(os.path.join(args.out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
