"""What the installed torch offers the bridge: the one place that knows how torch releases differ.

The bridge (the rest of :mod:`tdist._torch`) asks this module instead of comparing version
strings: each entry of :class:`TorchFeatures` is detected on the torch that is imported.
``missing`` lists what the bridge cannot work without; when it is not empty the bridge
does not attach (tdist's own API still works, see :func:`tdist._torch.mirror_world`). The
others adapt the bridge to a release: ``new_group``'s ``sort_ranks``, the ``asyncOp`` of
operation options, a second registration of one backend name, the flight recorder torch
attaches to every group (2.15), how torch.compile is told to leave tdist's code alone.

The range of torch releases tdist is tested on is :data:`tdist._version.TORCH_REQUIREMENT`;
a torch outside it is used when every feature is found, and ``python -m tdist info`` says so.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any, Optional

from .._version import TORCH_REQUIREMENT

__all__ = ["TorchFeatures", "features", "in_tested_range", "register_backend", "unattachable"]

#: torch's reduction operators the bridge maps to tdist's (``ReduceOp.RedOpType``).
_REDUCTIONS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM")
#: What torch's creator receives (``_DistributedBackendOptions``) and the bridge reads.
_CREATOR_OPTIONS = ("store", "group_rank", "group_size", "timeout", "group_id", "global_ranks_in_group")


@dataclass(frozen=True)
class TorchFeatures:
    """The installed torch as the bridge sees it."""

    version: str
    #: What the bridge needs and this torch lacks (empty: the bridge attaches).
    missing: tuple[str, ...]
    #: ``torch.distributed.new_group`` takes ``sort_ranks`` (a group whose rank order is not
    #: the global one can be mirrored).
    new_group_sort_ranks: bool
    #: torch's operation options carry ``asyncOp``: a blocking call is waited for
    #: by the backend; before, torch's Python waits on the returned Work itself.
    options_say_async: bool
    #: torch attaches its flight recorder to every group it makes unless the backend records
    #: on its own (torch 2.15+); tdist's backends do (tdist-debug), and torch's recorder
    #: cannot hook a group written in Python.
    flight_recorder_hook: bool
    #: torch.compile can be told, per code object and without a wrapper, to run a function
    #: and everything it calls eagerly (``torch._C._dynamo.eval_frame.set_code_exec_strategy``
    #: with ``FrameAction.SKIP``; see :mod:`tdist._torch.dynamo`).
    dynamo_skip: bool = False

    @property
    def attachable(self) -> bool:
        """Whether the bridge can make tdist's groups torch.distributed's."""
        return not self.missing

    def describe(self) -> str:
        """One line for ``python -m tdist info`` and for warnings."""
        tested = (
            "in the tested range"
            if in_tested_range(self.version)
            else f"outside tdist's tested range torch{TORCH_REQUIREMENT}"
        )
        if not self.attachable:
            return f"torch {self.version} ({tested}): the bridge cannot attach: lacks {', '.join(self.missing)}"
        return f"torch {self.version} ({tested}): the bridge attaches"


def _release(version: str) -> tuple[int, ...]:
    """``2.15.0+cu132`` -> (2, 15, 0); pre-release suffixes are dropped (``2.16.0a0`` -> (2, 16, 0))."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def in_tested_range(version: str) -> bool:
    """Whether torch ``version`` satisfies :data:`TORCH_REQUIREMENT` (``>=A.B,<C.D``)."""
    release = _release(version)
    for clause in TORCH_REQUIREMENT.split(","):
        bound = _release(clause.lstrip("<>="))
        if (clause.startswith(">=") and release < bound) or (clause.startswith("<") and release >= bound):
            return False
    return True


def _missing(td: Any) -> list[str]:
    """The hard requirements the bridge checks on ``torch.distributed`` ``td``."""
    missing = []

    class _Probe(td.ProcessGroup):  # what TorchProcessGroup does: a Python subclass made from (rank, size)
        pass

    try:
        _Probe(0, 1)
    except Exception as exc:  # noqa: BLE001 - any failure means the same: cannot subclass
        missing.append(f"ProcessGroup(rank, size) from a Python subclass ({type(exc).__name__}: {exc})")
    if not hasattr(td, "_Work"):
        missing.append("torch.distributed._Work (a Work written in Python)")
    register = getattr(getattr(td, "Backend", None), "register_backend", None)
    params = inspect.signature(register).parameters if register is not None else {}
    if not {"extended_api", "devices"} <= set(params):
        missing.append("Backend.register_backend(..., extended_api=, devices=)")
    kinds = getattr(getattr(td, "ReduceOp", None), "RedOpType", None)
    absent = [name for name in _REDUCTIONS if not hasattr(kinds, name)]
    if absent:
        missing.append(f"ReduceOp.RedOpType.{'/'.join(absent)}")
    options_type = getattr(td.distributed_c10d, "_DistributedBackendOptions", None)
    if options_type is None or not all(hasattr(options_type(), field) for field in _CREATOR_OPTIONS):
        missing.append(f"_DistributedBackendOptions with {', '.join(_CREATOR_OPTIONS)}")
    return missing


@functools.lru_cache(maxsize=None)
def features() -> TorchFeatures:
    """The installed torch's features (detected once per process; imports torch)."""
    import torch
    import torch.distributed as td

    if not td.is_available():
        missing = ["torch.distributed (this torch was built without it)"]
        return TorchFeatures(torch.__version__, tuple(missing), False, False, False)
    c10d = td.distributed_c10d
    return TorchFeatures(
        version=torch.__version__,
        missing=tuple(_missing(td)),
        new_group_sort_ranks="sort_ranks" in inspect.signature(td.new_group).parameters,
        options_say_async=hasattr(td.AllreduceOptions(), "asyncOp"),
        flight_recorder_hook=isinstance(getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None), set),
        dynamo_skip=_has_dynamo_skip(torch),
    )


def _has_dynamo_skip(torch: Any) -> bool:
    """Whether torch's C eval-frame hook takes a per-code strategy that skips a frame and its
    callees (read from ``torch._C``: importing ``torch._dynamo`` takes seconds)."""
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    action = getattr(eval_frame, "_FrameAction", None)
    needed = ("set_code_exec_strategy", "_FrameExecStrategy")
    return all(hasattr(eval_frame, name) for name in needed) and hasattr(action, "SKIP")


def register_backend(torch_name: str, creator: Any, devices: list[str]) -> None:
    """Register ``torch_name`` with torch.distributed (``extended_api``: the creator gets torch's
    options object), or set the devices of an earlier registration of it (older releases refuse
    a second ``register_backend`` of one name; tdist's autoloading registered it first)."""
    import torch.distributed as td

    try:
        td.Backend.register_backend(torch_name, creator, extended_api=True, devices=devices)
    except AssertionError:  # "... c10d backend already exist"
        if torch_name.upper() not in td.Backend._plugins:
            raise
        td.Backend.backend_capability[torch_name.lower()] = list(devices)
    if features().flight_recorder_hook:
        # torch attaches its flight recorder to a group unless its backend records on its own:
        # tdist's backends do (tdist-debug), and torch's recorder cannot hook a Python group.
        td.distributed_c10d._FR_SELF_RECORDING_BACKENDS.add(torch_name.lower())  # type: ignore[attr-defined]


def unattachable() -> Optional[str]:
    """Why the bridge cannot attach to this torch (naming the version and tested range), or None."""
    found = features()
    if found.attachable:
        return None
    return (
        f"torch {found.version} lacks what tdist's bridge to torch.distributed needs "
        f"({'; '.join(found.missing)}); tdist is tested with torch{TORCH_REQUIREMENT}"
    )
