"""``--ddp``: a training step of torch's own DistributedDataParallel on ``tdist-tcp``
against the same step on torch's gloo, side by side in one run.

Each worker is a plain torch program: ``torch.distributed.init_process_group("tdist-tcp")``
(tdist's backend through torch's API), then ``torch.distributed.new_group(backend="gloo")``
(torch's own gloo between the same processes). Two replicas of one ~4.2M-parameter MLP
(4 x Linear(1024, 1024)) are wrapped in torch's DDP, one per group, and a third replica
runs without DDP (the compute alone); a step is forward,
MSE loss, backward (DDP's bucketed all-reduces overlap it) and an SGD update, on a batch
of ``batch`` rows per rank. Samples of ``steps`` steps alternate between the two groups,
``repeats`` times; a sample's time is the slowest rank's; medians are reported. Every
rank uses one intra-op thread (``torch.set_num_threads(1)``), so ranks do not compete
for cores inside a step.

    python -m tdist.bench --ddp                        # 2 and 4 ranks
    python -m tdist.bench --ddp --world-sizes 2 --repeats 9
"""

from __future__ import annotations

import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Optional

__all__ = ["ddp_bench", "format_ddp", "main", "WIDTH", "LAYERS"]

WIDTH, LAYERS = 1024, 4


def ddp_bench(
    world_sizes: list[int], steps: int = 5, repeats: int = 5, batch: int = 16, timeout: float = 900.0
) -> list[dict]:
    """Run the workers of each world size; one result per (world size, backend)."""
    from .runner import run_world

    cfg = {"steps": steps, "repeats": repeats, "batch": batch, "timeout": min(timeout, 300.0)}
    results: list[dict] = []
    for world in world_sizes:
        results.extend(run_world(world, cfg, False, timeout, worker_module="tdist.bench.ddp"))
    return results


def format_ddp(results: list[dict]) -> str:
    by_world: dict[int, dict[str, dict]] = {}
    for row in results:
        by_world.setdefault(row["world"], {})[row["backend"]] = row
    first = results[0]
    lines = [
        f"torch DDP training step, {first['params'] / 1e6:.1f}M parameters ({LAYERS} x Linear({WIDTH}, {WIDTH})), "
        f"batch {first['batch']} per rank, median of {first['repeats']} x {first['steps']} steps:",
        f"  {'ranks':>5}  {'tdist-tcp':>12}  {'torch gloo':>12}  {'ratio':>7}  {'no DDP':>12}  {'DDP cost ratio':>14}",
    ]
    for world, rows in sorted(by_world.items()):
        ours, gloo, local = (rows[name]["step_s"] for name in ("tdist-tcp", "gloo", "local"))
        cost = (ours - local) / (gloo - local) if gloo > local else float("nan")
        lines.append(
            f"  {world:>5}  {ours * 1e3:9.1f} ms  {gloo * 1e3:9.1f} ms  {ours / gloo:6.2f}x  "
            f"{local * 1e3:9.1f} ms  {cost:13.2f}x"
        )
    lines.append(
        "  (ratio: tdist-tcp's step time / gloo's, target <= 0.8x; no DDP: the same step without DDP, in\n"
        "   the same processes; DDP cost ratio: what DDP adds to it on tdist-tcp / on gloo)"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- worker side
def _model() -> Any:
    import torch

    torch.manual_seed(0)
    layers: list = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _slowest(torch_dist: Any, group: Any, seconds: float) -> float:
    import torch

    t = torch.tensor([seconds], dtype=torch.float64)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX, group=group)
    return float(t.item())


def run(cfg: dict, rank: int, world: int, under_mpi: bool = False) -> list[dict]:
    import torch
    import torch.distributed as torch_dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch_dist.init_process_group(
        "tdist-tcp",
        init_method=f"tcp://127.0.0.1:{cfg['ports']['tdist']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=float(cfg["timeout"])),
    )
    groups = {"tdist-tcp": torch_dist.group.WORLD, "gloo": torch_dist.new_group(backend="gloo"), "local": None}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], WIDTH, generator=gen)
    y = torch.randn(cfg["batch"], WIDTH, generator=gen)
    replicas = {}
    for name, group in groups.items():
        model = _model()
        wrapped = model if group is None else torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        replicas[name] = (wrapped, model)

    def step(name: str) -> None:
        ddp, model = replicas[name]
        F.mse_loss(ddp(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-1e-3)
                p.grad = None

    samples: dict[str, list[float]] = {name: [] for name in groups}
    for name in groups:
        for _ in range(3):
            step(name)
    gloo = groups["gloo"]  # the timing barriers and agreements use gloo, outside tdist's timed work
    for _ in range(cfg["repeats"]):
        for name in groups:
            torch_dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(cfg["steps"]):
                step(name)
            samples[name].append(_slowest(torch_dist, gloo, time.perf_counter() - start) / cfg["steps"])
    params = sum(p.numel() for p in replicas["gloo"][1].parameters())
    torch_dist.destroy_process_group()
    return [
        {
            "world": world,
            "backend": name,
            "step_s": statistics.median(s),
            "samples_s": s,
            "params": params,
            "batch": cfg["batch"],
            "steps": cfg["steps"],
            "repeats": cfg["repeats"],
        }
        for name, s in samples.items()
    ]


def main(argv: Optional[list[str]] = None) -> int:
    from .workers import serve

    return serve(run, argv, "[bench --ddp]")


if __name__ == "__main__":
    sys.exit(main())
