"""torch's own utilities over tdist's groups -- DistributedSampler, DistributedDataParallel
(bitwise against torch's gloo), FSDP2, distributed checkpointing, ZeroRedundancyOptimizer,
torch.distributed.nn, Join, SyncBatchNorm: the kit's "torch" suite, for each --tdist-backend
and world size.

    .venv/bin/python -m pytest tests/test_torch_utilities.py --tdist-backend tcp
"""

from tdist.testing import collect

collect(globals(), suite="torch")
