"""torch.compile and tdist: what Dynamo traces, and what it must leave to run as it is.

While a compiled function runs, Dynamo compiles every Python frame it enters -- the eager
parts after a graph break included -- unless the frame's code says otherwise. Two kinds of
tdist code must not be compiled:

* the bridge's methods that torch's C++ calls (a functional collective that runs eagerly
  reaches ``TorchProcessGroup.allreduce`` through pybind's trampoline): there ``self`` is a
  torch ProcessGroup, an object Dynamo refuses to inspect (an internal error, not a graph
  break);
* tdist's communication functions (``tdist.all_reduce``, ``Work.wait``, stores, ...): they
  and the backends they call are sockets and threads, nothing a graph can hold.

:func:`prepare` marks them as ``torch.compiler.disable`` (recursive) marks a function, but
on the function itself, without a wrapper, so a call costs nothing more outside
torch.compile: a call inside a compiled function is a clean graph break, and it runs
eagerly with everything it calls. tdist's queries (:data:`TRACEABLE`) stay traceable:
Dynamo folds them into constants, as it folds torch.distributed's. ``tdist.group.WORLD``
is a plain attribute (:class:`tdist._groups.GroupMember`), so Dynamo sees the torch
ProcessGroup that tdist's groups are when bridged, and traces torch.distributed's
functions and the functional collectives on it as on torch's own groups.
"""

from __future__ import annotations

import inspect
import types
import warnings
from typing import Any, Iterable, Iterator

import torch

from .._bridge import public_api
from .._groups import tdist_side
from .features import features
from .process_group import TorchProcessGroup
from .work import BridgeWork

__all__ = ["TRACEABLE", "prepare", "run_eagerly"]

#: tdist's public functions Dynamo traces: queries whose answers it folds into constants.
TRACEABLE = frozenset(
    {
        "is_initialized",
        "get_rank",
        "get_world_size",
        "get_backend",
        "get_global_rank",
        "get_group_rank",
        "get_process_group_ranks",
        "get_node_local_rank",
        "is_torchelastic_launched",
        "make_premul_sum",
        "supports_complex",
    }
)

_REASON = (
    "tdist's communication functions run eagerly under torch.compile; torch.distributed's "
    "collectives and the functional collectives on tdist's groups are traced into the graph"
)
_failed = False  # run_eagerly raised once: this torch's hook is not what it expects


def _functions(obj: Any) -> Iterator[types.FunctionType]:
    """The Python functions of ``obj``: itself, or every method and property accessor that a
    class, its tdist bases and its subclasses (a backend's ``Work``) define."""
    if isinstance(obj, types.FunctionType):
        yield obj
        return
    family = [k for k in obj.__mro__ if k.__module__.startswith("tdist")] + _subclasses(obj)
    for klass in family:
        for member in vars(klass).values():
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            accessors = (member.fget, member.fset) if isinstance(member, property) else (member,)
            yield from (f for f in accessors if isinstance(f, types.FunctionType))


def _subclasses(cls: type) -> list[type]:
    """Every subclass of ``cls``, direct or not."""
    direct: list[type] = cls.__subclasses__()
    return [found for sub in direct for found in (sub, *_subclasses(sub))]


def run_eagerly(objects: Iterable[Any]) -> None:
    """Mark the functions of ``objects`` (functions or classes, see :func:`_functions`):
    Dynamo graph-breaks at a call to one and runs it, and everything it calls, uncompiled."""
    eval_frame: Any = torch._C._dynamo.eval_frame
    action = eval_frame._FrameAction
    skip = eval_frame._FrameExecStrategy(action.SKIP, action.SKIP)  # this frame, and the frames it calls
    for obj in objects:
        for fn in _functions(obj):
            if getattr(fn, "_torchdynamo_disable", False):
                continue  # marked already
            eval_frame.set_code_exec_strategy(fn.__code__, skip)
            # what torch.compiler.disable sets on its wrapper: the trace breaks at the call
            fn._torchdynamo_disable = True  # type: ignore[attr-defined]
            fn._torchdynamo_disable_recursive = True  # type: ignore[attr-defined]
            fn._torchdynamo_disable_msg = _REASON  # type: ignore[attr-defined]


def prepare() -> None:
    """Mark tdist's communication API, its ``Work`` and stores (the subclasses of the
    backends loaded by now included) and the bridge's classes. Called for each group the
    bridge mirrors (what is marked already is passed over); does nothing on a torch without
    the means (``features().dynamo_skip``, or the hook raised), where Dynamo traces them as
    any Python."""
    global _failed
    if _failed or not features().dynamo_skip:
        return
    tdist = public_api()  # the package's namespace, which ``import tdist`` gave the bridge
    public = [vars(tdist)[name] for name in tdist.__all__ if name in vars(tdist) and name not in TRACEABLE]
    functions = [obj for obj in public if inspect.isfunction(obj) and obj.__module__.startswith("tdist")]
    try:
        run_eagerly([*functions, tdist_side, tdist.Work, tdist.Store, TorchProcessGroup, BridgeWork])
    except Exception as exc:  # noqa: BLE001 - torch's private hook changed: the bridge itself still works
        _failed = True
        warnings.warn(
            f"tdist: cannot mark tdist's code for torch.compile on torch {features().version} "
            f"({type(exc).__name__}: {exc}); compiled functions may trace into tdist's calls",
            stacklevel=2,
        )
