"""``tdist.nn``: data-parallel training over tdist (``torch.nn.parallel``'s
``DistributedDataParallel``, on any tdist backend, with communication hooks in
:mod:`tdist.nn.comm_hooks`). Importing it imports torch."""

from .comm_hooks import GradBucket
from .parallel import DDPStats, DistributedDataParallel

__all__ = ["DistributedDataParallel", "DDPStats", "GradBucket"]
