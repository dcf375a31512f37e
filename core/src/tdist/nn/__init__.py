"""``tdist.nn``: data-parallel training over tdist (``torch.nn.parallel``'s
``DistributedDataParallel``, on any tdist backend). Importing it imports torch."""

from .parallel import DDPStats, DistributedDataParallel

__all__ = ["DistributedDataParallel", "DDPStats"]
