"""Small real training programs on frameworks that pick the torch.distributed backend
themselves, run by tests/clients/test_clients.py under torchrun, 2 ranks, on CPU:

    torchrun --standalone --nproc-per-node 2 tests/clients/client_programs.py PROGRAM --backend B --out DIR

``B`` is a torch.distributed backend name: ``gloo`` (the reference: each framework
starts its own group, as it does by default) or a tdist backend (``tdist-tcp``), set up
the way docs/pages/guide/frameworks.md says for that framework: its own hook where it has
one (Lightning's and Fabric's ``DDPStrategy(process_group_backend=...)``), otherwise
``torch.distributed.init_process_group(B)`` before the framework starts (transformers'
``Trainer``, accelerate's ``Accelerator``). Plain torch programs (DDP + PowerSGD, DDP +
``torch.compile``) just name the backend.

Each rank saves ``DIR/rank<N>.pt``: its final parameters, the values the framework
synchronised across ranks (logged metrics, all_reduce/gather results) and what the
program saw of the group (torch's backend name, world size, the framework's view), for
the test to compare with gloo's bitwise.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

FEATURES, HIDDEN, OUTPUTS, SAMPLES, BATCH = 8, 32, 4, 32, 4
TIMEOUT = timedelta(seconds=60)  # every group's: a hang fails the program instead of waiting 30 minutes


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Linear(HIDDEN, OUTPUTS),
    )


def _dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(SAMPLES, FEATURES, generator=gen), torch.randn(SAMPLES, OUTPUTS, generator=gen))


def _own_shard(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's half of the data (plain torch programs)."""
    x, y = _dataset().tensors
    return x[rank::world], y[rank::world]


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _init_before_the_framework(backend: str) -> None:
    """The recipe for frameworks without a hook: start the group first; they keep it."""
    if backend != "gloo":
        dist.init_process_group(backend, timeout=TIMEOUT)


# ---------------------------------------------------------------------------- Lightning
def lightning_trainer(backend: str, out: str) -> dict[str, Any]:
    """Trainer, DDPStrategy(process_group_backend=...): ``self.log(..., sync_dist=True)`` in
    training and validation (Lightning reduces a mean with ReduceOp.AVG on every backend
    but one named "gloo", and runs validation under inference_mode there), and
    ``prepare_data`` (a torch gloo side group with monitored_barrier, whatever the backend)."""
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    seen: dict[str, Any] = {"prepare_data": 0}

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def prepare_data(self) -> None:
            seen["prepare_data"] += 1

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    pl.seed_everything(0)
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend=backend, timeout=TIMEOUT),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    loader = DataLoader(_dataset(), batch_size=BATCH)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    return {
        "params": _parameters(module.net),
        "synced": {k: v.detach().clone() for k, v in sorted(trainer.callback_metrics.items())},
        "view": {
            "torch_backend": str(dist.get_backend()),
            "world_size": trainer.world_size,
            "steps": trainer.global_step,
            "prepare_data": seen["prepare_data"],
        },
    }


def fabric(backend: str, out: str) -> dict[str, Any]:
    """Fabric with DDPStrategy(process_group_backend=...): setup, backward, all_reduce("mean")."""
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DDPStrategy

    fab = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend, timeout=TIMEOUT))
    fab.launch()
    fab.seed_everything(0)
    model = _model()
    model, optimizer = fab.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    loader = fab.setup_dataloaders(DataLoader(_dataset(), batch_size=BATCH))
    losses = []
    for _ in range(2):
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            fab.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(fab.all_reduce(loss.detach(), reduce_op="mean"))
    gathered = fab.all_gather(torch.tensor([float(fab.global_rank)]))
    return {
        "params": _parameters(model.module),
        "synced": {
            "losses": torch.stack(losses),
            "gathered": gathered,
            "broadcast": fab.broadcast(torch.tensor([fab.global_rank + 1.0])),
        },
        "view": {"torch_backend": str(dist.get_backend()), "world_size": fab.world_size, "steps": len(losses)},
    }


# ---------------------------------------------------------------------------- plain torch
def powersgd(backend: str, out: str) -> dict[str, Any]:
    """DDP with torch's PowerSGD communication hook (rank-1 approximation after 2 plain steps)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd_hook

    dist.init_process_group(backend, timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = powersgd_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5
    )
    ddp.register_comm_hook(state, powersgd_hook.powerSGD_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = _own_shard(rank, world)
    steps = 6
    for _ in range(steps):
        F.mse_loss(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "params": _parameters(model),
        "synced": {},
        "view": {"torch_backend": str(dist.get_backend()), "world_size": world, "steps": steps, "iter": state.iter},
    }


def compiled(backend: str, out: str) -> dict[str, Any]:
    """DDP + torch.compile: dynamo's DDPOptimizer, AOTAutograd's backward, DDP's reducer on
    the compiled graph's gradients. Backend "aot_eager" (CLIENTS_COMPILE_BACKEND=inductor
    compiles C++ kernels too: the same parameters, bitwise, and a few seconds more)."""
    dist.init_process_group(backend, timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    step_model = torch.compile(ddp, backend=os.environ.get("CLIENTS_COMPILE_BACKEND", "aot_eager"))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = _own_shard(rank, world)
    steps = 4
    for _ in range(steps):
        F.mse_loss(step_model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "params": _parameters(model),
        "synced": {},
        "view": {"torch_backend": str(dist.get_backend()), "world_size": world, "steps": steps},
    }


# ---------------------------------------------------------------------------- Hugging Face
def transformers_trainer(backend: str, out: str) -> dict[str, Any]:
    """transformers' Trainer (use_cpu=True) on a tiny GPT-2 built from a config (no download);
    its ``ddp_backend`` takes a fixed list and accelerate forces gloo on CPU, so the group is
    started first (accelerate keeps an initialised group)."""
    _init_before_the_framework(backend)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (SAMPLES, 12), generator=gen)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        max_steps=6,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        ddp_timeout=int(TIMEOUT.total_seconds()),
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "params": _parameters(model),
        "synced": {"logged_losses": torch.tensor(losses, dtype=torch.float64)},
        "view": {
            "torch_backend": str(dist.get_backend()),
            "world_size": args.world_size,
            "parallel_mode": str(args.parallel_mode),
            "wrapped": type(trainer.model_wrapped).__name__,
            "steps": trainer.state.global_step,
        },
    }


def accelerate_loop(backend: str, out: str) -> dict[str, Any]:
    """accelerate's Accelerator(cpu=True): prepare, backward, gather, reduce. On CPU it
    accepts only gloo or mpi (``ValueError: Your assigned backend ... is not available``),
    so the group is started first (accelerate keeps an initialised group)."""
    _init_before_the_framework(backend)
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=TIMEOUT)])
    set_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(_dataset(), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, steps = [], 0
    for _ in range(2):
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()))
            steps += 1
    mean = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), reduction="mean")
    return {
        "params": _parameters(accelerator.unwrap_model(model)),
        "synced": {"gathered_losses": torch.stack(losses), "mean": mean},
        "view": {
            "torch_backend": str(dist.get_backend()),
            "world_size": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "wrapped": type(model).__name__,
            "steps": steps,
        },
    }


PROGRAMS: dict[str, Callable[[str, str], dict[str, Any]]] = {
    "lightning-trainer": lightning_trainer,
    "fabric": fabric,
    "powersgd": powersgd,
    "compile": compiled,
    "transformers": transformers_trainer,
    "accelerate": accelerate_loop,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("program", choices=sorted(PROGRAMS))
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = PROGRAMS[args.program](args.backend, args.out)
    rank = int(os.environ["RANK"])
    torch.save(result, os.path.join(args.out, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
