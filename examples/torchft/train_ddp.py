#!/usr/bin/env python
"""torchft's DDP example (``train_ddp.py`` of pytorch/torchft) on CPU, with tdist's
backend as torchft's process group.

What differs from torchft's own example: the process group (``--pg tdist-tcp``, the
default, is :class:`tdist.integrations.torchft.ProcessGroupTdist`; ``--pg gloo`` is
torchft's ``ProcessGroupGloo``, as torchft's example uses on CPU), the data (synthetic
CIFAR-shaped images from a fixed seed instead of downloading CIFAR-10), the model (its
CNN without the 1 GB "useless" embedding) and the end (``--steps``). Everything else is
torchft's: its ``Manager``, ``DistributedDataParallel`` and ``Optimizer``, and a
lighthouse that computes the quorum. Each replica group trains on batches of its own
(seeded by replica group and step), as torchft's ``DistributedSampler`` shards CIFAR-10
per replica group.

One process per replica group (replica groups of one rank, as torchft's DDP example
runs on CPU); start the lighthouse first::

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 &
    export TORCHFT_LIGHTHOUSE=http://localhost:29510
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 python examples/torchft/train_ddp.py &
    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 python examples/torchft/train_ddp.py

Kill one (``kill -9``) and start it again: the other keeps training, and the restarted
one heals from it (torchft fetches the model and optimizer state from a live replica)
and trains on with it. ``--kill-at N`` makes a replica SIGKILL itself once N steps are
committed, in the middle of the next step (after its forward pass, while the other is in
the gradient all-reduce; ``--kill-when between-steps``: before the next step starts);
``--restarts N`` runs the program under a supervisor that restarts it when it dies (as
torchelastic or torchx would). Each committed step prints a ``TORCHFT_STEP`` line with
its wall-clock time, each reconfiguration of the process group a ``TORCHFT_CONFIGURE``
line with its duration, and the end a ``TORCHFT_DONE`` line with a hash of the parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pg", default="tdist-tcp", help="tdist-<backend> (tdist-tcp, tdist-gloo, ...) or gloo (torchft's)")
    p.add_argument("--steps", type=int, default=20, help="train until this many steps are committed")
    p.add_argument("--batch", type=int, default=16, help="images per replica group per step")
    p.add_argument("--timeout", type=float, default=5.0, help="the process group's timeout, seconds")
    p.add_argument(
        "--kill-at",
        type=int,
        default=-1,
        help="SIGKILL this process once this many steps are committed (first attempt only)",
    )
    p.add_argument(
        "--kill-when",
        choices=("mid-step", "between-steps"),
        default="mid-step",
        help="mid-step: in the next step, after its forward pass, while the peers are in the all-reduce "
        "(default); between-steps: before the next step's quorum",
    )
    p.add_argument("--restarts", type=int, default=0, help="restart the program this many times when it dies")
    p.add_argument(
        "--end-with",
        type=int,
        default=0,
        help="after --steps, go on until a step is committed by this many replica groups together "
        "(so that a restarted one has rejoined)",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (a slower step)")
    return p.parse_args(argv)


def supervise(argv: list[str], restarts: int) -> int:
    """Run this program (without ``--restarts``) and start it again when it dies, up to
    ``restarts`` times, as a job scheduler would; its exit status otherwise."""
    child = [sys.executable, os.path.abspath(__file__), *argv]
    for attempt in range(restarts + 1):
        env = dict(os.environ, TORCHFT_EXAMPLE_ATTEMPT=str(attempt))
        code = subprocess.call(child, env=env)
        print(f"TORCHFT_EXIT {json.dumps({'attempt': attempt, 'code': code, 't': time.time()})}", flush=True)
        if code == 0:
            return 0
    return code


def make_pg(name: str, timeout: timedelta):
    if name == "gloo":
        from torchft import ProcessGroupGloo

        return ProcessGroupGloo(timeout=timeout)
    if name.startswith("tdist-"):
        from tdist.integrations.torchft import ProcessGroupTdist

        return ProcessGroupTdist(backend=name[len("tdist-") :], timeout=timeout)
    raise SystemExit(f"--pg: expected tdist-<backend> or gloo, got {name!r}")


def train(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as torch_dist
    from torch import nn, optim
    from torchft import DistributedDataParallel, Manager, Optimizer

    replica_group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    attempt = int(os.environ.get("TORCHFT_EXAMPLE_ATTEMPT", 0))
    torch.set_num_threads(1)

    # torchft's Manager needs the replica group's store (torchrun's agent serves one; a
    # replica group of one process serves its own).
    store = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    class Net(nn.Module):  # torchft's example CNN, without its 1 GB embedding
        def __init__(self) -> None:
            super().__init__()
            self.cnn = nn.Sequential(
                nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2, 2), nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2, 2)
            )
            self.classifier = nn.Sequential(
                nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.classifier(torch.flatten(self.cnn(x), 1))

    torch.manual_seed(0)  # torchft syncs the weights at step 0 anyway (init_sync)
    model = Net()

    def load_state_dict(state_dict: dict) -> None:
        model.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def report(tag: str, **fields: object) -> None:
        fields.update(replica=replica_group, attempt=attempt, t=time.time())
        print(f"{tag} {json.dumps(fields)}", flush=True)

    timeout = timedelta(seconds=args.timeout)
    pg = make_pg(args.pg, timeout)
    configure = pg.configure

    def timed_configure(store_addr: str, replica_id: str, rank: int, world_size: int, *rest: object) -> None:
        start = time.perf_counter()  # torchft calls it on every new quorum: abort, then a new group
        configure(store_addr, replica_id, rank, world_size, *rest)
        report("TORCHFT_CONFIGURE", world_size=world_size, seconds=time.perf_counter() - start)

    pg.configure = timed_configure
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{replica_group}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=30),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, optim.AdamW(ddp.parameters()))
    criterion = nn.CrossEntropyLoss()

    report("TORCHFT_START", pg=args.pg)

    def done() -> bool:
        if manager.current_step() < args.steps:
            return False
        return not args.end_with or (manager.current_step() > 0 and manager.num_participants() >= args.end_with)

    while not done():
        step = manager.current_step()
        # This replica group's batch of this step (the sampler's job in torchft's example).
        data = torch.Generator().manual_seed(1000 * step + replica_group)
        inputs = torch.randn(args.batch, 3, 32, 32, generator=data)
        labels = torch.randint(0, 10, (args.batch,), generator=data)

        if step == args.kill_at and attempt == 0 and args.kill_when == "between-steps":
            report("TORCHFT_KILL", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()  # starts the quorum (torchft reconfigures the process group here when it changed)
        loss = criterion(ddp(inputs), labels)
        if step == args.kill_at and attempt == 0 and args.kill_when == "mid-step":
            report("TORCHFT_KILL", step=step)
            os.kill(os.getpid(), signal.SIGKILL)  # the peer is in (or about to be in) the all-reduce
        loss.backward()  # the gradient all-reduce across replica groups, on the process group
        optimizer.step()  # commits the step only if every replica group succeeded
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if manager.current_step() > step:
            report("TORCHFT_STEP", step=manager.current_step(), participants=manager.num_participants())
        else:
            report("TORCHFT_FAILED", step=step, error=repr(manager.errored())[:300])

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().numpy().tobytes())
    report("TORCHFT_DONE", step=manager.current_step(), params=digest.hexdigest())
    manager.shutdown(wait=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.restarts:
        rest = [a for i, a in enumerate(argv) if a != "--restarts" and (i == 0 or argv[i - 1] != "--restarts")]
        rest = [a for a in rest if not a.startswith("--restarts=")]
        return supervise(rest, args.restarts)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
