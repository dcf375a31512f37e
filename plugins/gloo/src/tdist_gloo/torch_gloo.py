"""The parts of torch's C++ gloo binding this backend uses (torch's stubs list few of them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as td

__all__ = ["PG", "R", "c10d"]

c10d: Any = torch._C._distributed_c10d
#: ``torch.distributed.ProcessGroupGloo``
PG: Any = c10d.ProcessGroupGloo
#: torch's ReduceOp
R: Any = td.ReduceOp
