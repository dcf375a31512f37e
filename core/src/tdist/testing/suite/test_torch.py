"""torch's utilities (DDP, FSDP2, DCP, ZeRO, Join, SyncBatchNorm, ...) over the backend's groups."""

from tdist.testing import collect

collect(globals(), suite="torch")
