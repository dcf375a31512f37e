"""Worker side of tests/test_ddp.py, and the single-process references it compares with.

Run as a worker of a job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)::

    python tests/ddp_scenarios.py --backend tcp --out DIR [--scenarios a,b]

Every scenario runs in one process group, one after the other; each rank saves
``{scenario: result}`` to ``DIR/rank<N>.pt`` (a failing scenario's result is
``{"error": traceback}``, and the next scenarios still run).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 16
FEATURES = 8


# --------------------------------------------------------------------------- models and data
def batch(
    step: int, size: int = BATCH, features: int = FEATURES, outputs: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, features, generator=gen), torch.randn(size, outputs, generator=gen)


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size)[rank]


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def deep_mlp(seed: int = 0, depth: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(FEATURES, 32)]
    for _ in range(depth):
        layers += [nn.Tanh(), nn.Linear(32, 32)]
    layers += [nn.Tanh(), nn.Linear(32, 4)]
    return nn.Sequential(*layers)


class BranchNet(nn.Module):
    """A trunk and two heads; ``never`` is used by no rank."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(FEATURES, 16)
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 4)
        self.never = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_a: bool = True) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head_a(h) if use_a else self.head_b(h)


class Counter(nn.Module):
    """A linear layer and a buffer that every forward bumps by a rank-dependent amount."""

    def __init__(self, seed: int, bump: float) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(FEATURES, 4)
        self.register_buffer("count", torch.full((3,), float(seed)))
        self.bump = bump

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += self.bump
        return self.lin(x)


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def grads_of(module: nn.Module) -> dict[str, object]:
    return {k: (None if v.grad is None else v.grad.detach().clone()) for k, v in module.named_parameters()}


class SGD:
    """SGD with momentum, as torch.optim.SGD(lr, momentum) computes it. Not torch.optim
    itself: its first construction imports torch._dynamo (seconds of CPU per process)."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9) -> None:
        self.params = list(params)
        self.lr, self.momentum = lr, momentum
        self.buffers: dict[int, torch.Tensor] = {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if i in self.buffers:
                self.buffers[i].mul_(self.momentum).add_(p.grad)
            else:
                self.buffers[i] = p.grad.clone()
            p.add_(self.buffers[i], alpha=-self.lr)


def sgd(module: nn.Module) -> SGD:
    return SGD(module.parameters())


# --------------------------------------------------------------------------- references (one process)
def reference_training(make_model=mlp, steps: int = 5) -> dict[str, torch.Tensor]:
    """SGD on the full batch: what every DDP replica should end with."""
    model = make_model()
    opt = sgd(model)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return params_of(model)


def reference_branches(world_size: int = 2, steps: int = 3) -> tuple[dict, dict]:
    """BranchNet where rank r uses head_a if r is even, else head_b: the loss is
    the mean of the ranks' losses. Returns (parameters, gradients of the last step)."""
    model = BranchNet()
    opt = sgd(model)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        losses = [
            F.mse_loss(model(shard(x, r, world_size), use_a=(r % 2 == 0)), shard(y, r, world_size))
            for r in range(world_size)
        ]
        (sum(losses) / world_size).backward()
        grads = grads_of(model)
        opt.step()
    return params_of(model), grads


# --------------------------------------------------------------------------- scenarios (in a job)
def _train(ddp: nn.Module, rank: int, world_size: int, steps: int = 5) -> None:
    """SGD on each rank's shard of the batches reference_training uses."""
    opt = sgd(ddp)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(ddp(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        opt.step()


def scenario_equivalence(dist, DDP, rank: int, world_size: int, **ddp_kwargs) -> dict:
    model = mlp()
    ddp = DDP(model, **ddp_kwargs)
    _train(ddp, rank, world_size)
    views = all(p.grad is not None and p.grad.data_ptr() != 0 and p.grad._base is not None for p in model.parameters())
    return {"params": params_of(model), "buckets": len(ddp._buckets), "stats": ddp.stats.as_dict(), "grad_views": views}


def scenario_view(dist, DDP, rank, world_size):
    return scenario_equivalence(dist, DDP, rank, world_size, gradient_as_bucket_view=True)


def scenario_buckets(dist, DDP, rank: int, world_size: int) -> dict:
    model = deep_mlp()
    ddp = DDP(model, bucket_cap_mb=0.005)  # ~5 KiB: one 32x32 layer per bucket
    _train(ddp, rank, world_size)
    return {"params": params_of(model), "buckets": len(ddp._buckets), "stats": ddp.stats.as_dict()}


def scenario_no_sync(dist, DDP, rank: int, world_size: int) -> dict:
    """Each rank splits its shard into two micro-batches; the first backward runs under no_sync."""
    model = mlp()
    ddp = DDP(model)
    opt = sgd(ddp)
    calls = []
    for step in range(5):
        x, y = batch(step)
        xs, ys = shard(x, rank, world_size).chunk(2), shard(y, rank, world_size).chunk(2)
        opt.zero_grad()
        before = ddp.stats.allreduce_calls
        with ddp.no_sync():
            (F.mse_loss(ddp(xs[0]), ys[0]) / 2).backward()
        calls.append(ddp.stats.allreduce_calls - before)
        (F.mse_loss(ddp(xs[1]), ys[1]) / 2).backward()
        opt.step()
    return {"params": params_of(model), "calls_in_no_sync": calls, "stats": ddp.stats.as_dict()}


def scenario_unused_error(dist, DDP, rank: int, world_size: int) -> dict:
    """find_unused_parameters=False and a parameter without gradient: a clear error,
    and the group still works afterwards (twice, to see nothing is left pending)."""
    model = BranchNet()
    ddp = DDP(model)
    messages = []
    for step in range(2):
        x, y = batch(step)
        try:
            F.mse_loss(ddp(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
            messages.append(None)
        except RuntimeError as exc:
            messages.append(str(exc))
    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t)
    return {"messages": messages, "after": t}


def scenario_find_unused(dist, DDP, rank: int, world_size: int) -> dict:
    model = BranchNet()
    ddp = DDP(model, find_unused_parameters=True)
    opt = sgd(ddp)
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        out = ddp(shard(x, rank, world_size), use_a=(rank % 2 == 0))
        F.mse_loss(out, shard(y, rank, world_size)).backward()
        grads = grads_of(model)
        opt.step()
    return {"params": params_of(model), "grads": grads, "unused_last": [ddp._named_params[i][0] for i in ddp._unused]}


def scenario_buffers(dist, DDP, rank: int, world_size: int) -> dict:
    result = {}
    for broadcast_buffers in (True, False):
        model = Counter(seed=rank, bump=1.0 + 10 * rank)
        ddp = DDP(model, broadcast_buffers=broadcast_buffers)
        after_init = {"params": params_of(model), "count": model.count.clone()}
        x, _ = batch(0)
        with torch.no_grad():
            for _ in range(3):
                ddp(shard(x, rank, world_size))
        result[broadcast_buffers] = {
            "init": after_init,
            "count": model.count.clone(),
            "state_keys": sorted(ddp.state_dict()),
        }
    return result


def scenario_wrapper(dist, DDP, rank: int, world_size: int) -> dict:
    """The wrapper's surface: .module, state_dict/load_state_dict, train/eval, no_grad forward."""
    model = mlp()
    ddp = DDP(model)
    state = ddp.state_dict()
    same_values = all(torch.equal(state["module." + k], v) for k, v in model.state_dict().items())
    ddp.load_state_dict({k: torch.zeros_like(v) for k, v in state.items()})
    zeroed = all(bool((p == 0).all()) for p in model.parameters())
    ddp.eval()
    with torch.no_grad():
        ddp(torch.zeros(2, FEATURES))
    armed_after_no_grad = ddp._armed
    ddp.train()
    return {
        "module_is_model": ddp.module is model,
        "keys": sorted(state),
        "module_keys": sorted(model.state_dict()),
        "same_values": same_values,
        "zeroed": zeroed,
        "armed_after_no_grad": armed_after_no_grad,
        "training": (model.training, ddp.training),
    }


def scenario_hooks(dist, DDP, rank: int, world_size: int) -> dict:
    """The built-in communication hooks, each on a fresh replica trained as in "equivalence"."""
    from tdist.nn import comm_hooks

    result = {}
    for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        model = deep_mlp()
        ddp = DDP(model, bucket_cap_mb=0.005)
        ddp.register_comm_hook(None, getattr(comm_hooks, name))
        _train(ddp, rank, world_size)
        result[name] = {"params": params_of(model), "buckets": len(ddp._buckets), "stats": ddp.stats.as_dict()}
    return result


def scenario_custom_hook(dist, DDP, rank: int, world_size: int) -> dict:
    """A hook with state that records what GradBucket shows, sums without averaging and
    divides in its future's callback; registering a second hook is refused."""
    model = deep_mlp()
    ddp = DDP(model, bucket_cap_mb=0.005)
    seen: list = []

    def hook(state, bucket):
        grads, params = bucket.gradients(), bucket.parameters()
        state.append(
            {
                "index": bucket.index(),
                "is_last": bucket.is_last(),
                "numel": bucket.buffer().numel(),
                "shapes_match": [tuple(g.shape) for g in grads] == [tuple(p.shape) for p in params],
                "views": all(g.data_ptr() >= bucket.buffer().data_ptr() for g in grads),
            }
        )
        total = bucket.buffer().clone()
        work = dist.all_reduce(total, async_op=True)
        return work.get_future().then(lambda fut: [fut.value()[0] / world_size])

    ddp.register_comm_hook(seen, hook)
    try:
        ddp.register_comm_hook(None, hook)
        second = None
    except RuntimeError as exc:
        second = str(exc)
    _train(ddp, rank, world_size)
    return {"params": params_of(model), "seen": seen, "buckets": len(ddp._buckets), "second": second}


def scenario_failing_hook(dist, DDP, rank: int, world_size: int) -> dict:
    """A hook that raises (on every rank, before communicating): backward raises its error
    once every bucket is accounted for, and the wrapper and the group keep working."""
    model = mlp()
    ddp = DDP(model)
    calls = []

    def hook(state, bucket):
        calls.append(bucket.index())
        if len(calls) == 1:
            raise ValueError("hook refused bucket")
        return (
            dist.all_reduce(bucket.buffer().div_(world_size), async_op=True)
            .get_future()
            .then(lambda _: bucket.buffer())
        )

    ddp.register_comm_hook(None, hook)
    x, y = batch(0)
    try:
        F.mse_loss(ddp(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        raised = None
    except ValueError as exc:
        raised = str(exc)
    _train(ddp, rank, world_size, steps=1)
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t)
    return {"raised": raised, "after": t, "calls": len(calls), "buckets": len(ddp._buckets)}


SCENARIOS = {
    "wrapper": scenario_wrapper,
    "equivalence": scenario_equivalence,
    "view": scenario_view,
    "buckets": scenario_buckets,
    "no_sync": scenario_no_sync,
    "unused_error": scenario_unused_error,
    "find_unused": scenario_find_unused,
    "buffers": scenario_buffers,
    "hooks": scenario_hooks,
    "custom_hook": scenario_custom_hook,
    "failing_hook": scenario_failing_hook,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
    args = parser.parse_args(argv)
    import tdist as dist
    from tdist.nn import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {}
    try:
        for name in args.scenarios.split(","):
            try:
                results[name] = SCENARIOS[name](dist, DDP, rank, world_size)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
