"""Collectives on picklable Python objects.

.. warning:: These functions use :mod:`pickle`. Unpickling runs arbitrary code:
   call them only inside a job whose every rank you trust. Tensors passed to the
   tensor collectives never go through pickle; only these ``*_object*`` functions do.
   With ``weights_only=True`` (as in torch) objects travel as ``torch.save`` bytes and are
   read with ``torch.load(weights_only=True)``, which loads tensors, containers and plain
   values only.

Objects travel as uint8 tensors over the group's backend, on CPU when the
backend serves CPU tensors, else on the current CUDA device.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Optional

from . import _collectives as coll
from . import _p2p as p2p
from ._groups import ProcessGroup, resolve_group, warn_not_member
from ._validate import peer_rank

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]


def _device(pg: ProcessGroup) -> Any:
    import torch

    return torch.device("cpu") if "cpu" in pg.backends else torch.device("cuda", torch.cuda.current_device())


def _encode(obj: Any, device: Any, weights_only: bool = False) -> Any:
    """``obj`` as a uint8 tensor on ``device``: pickled, or ``torch.save``'s bytes with ``weights_only``."""
    import torch

    if weights_only:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
    else:
        data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _decode(tensor: Any, size: int, weights_only: bool = False) -> Any:
    """The object of :func:`_encode`'s first ``size`` bytes in ``tensor``."""
    data = tensor[:size].cpu().numpy().tobytes()
    if weights_only:
        import torch

        return torch.load(io.BytesIO(data), weights_only=True)
    return pickle.loads(data)


def _sizes(n: int, device: Any) -> Any:
    import torch

    return torch.zeros(n, dtype=torch.int64, device=device)


def broadcast_object_list(
    object_list: list[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Any = None,
    group_src: Optional[int] = None,
    weights_only: bool = False,
) -> None:
    """Replace ``object_list``'s items on every rank with those of rank ``src`` (same length everywhere)."""
    pg = resolve_group(group)
    if pg is None:
        return warn_not_member("broadcast_object_list")
    device = device or _device(pg)
    root = group_src if group_src is not None else pg.group_rank(src if src is not None else pg.ranks[0], "src")
    root_is_me = root == pg.rank
    sizes = _sizes(len(object_list), device)
    payloads = [_encode(obj, device, weights_only) for obj in object_list] if root_is_me else []
    if root_is_me:
        for i, payload in enumerate(payloads):
            sizes[i] = payload.numel()
    coll.broadcast(sizes, group=group, group_src=root)
    import torch

    flat = torch.cat(payloads) if root_is_me else torch.empty(int(sizes.sum()), dtype=torch.uint8, device=device)
    coll.broadcast(flat, group=group, group_src=root)
    offset = 0
    for i, size in enumerate(sizes.tolist()):
        object_list[i] = _decode(flat[offset : offset + size], size, weights_only)
        offset += size
    return None


def _padded_payload(pg: ProcessGroup, obj: Any, group: Any, weights_only: bool) -> tuple[Any, list[int]]:
    """``obj`` encoded, zero-padded to the longest payload of the group; every rank's size."""
    device = _device(pg)
    payload = _encode(obj, device, weights_only)
    sizes = _sizes(pg.size, device)
    coll.all_gather_into_tensor(sizes, _sizes(1, device).fill_(payload.numel()), group=group)
    padded = payload.new_zeros(int(sizes.max()))
    padded[: payload.numel()] = payload
    return padded, sizes.tolist()


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, weights_only: bool = False) -> None:
    """``object_list[i]`` receives rank i's ``obj`` (``object_list`` has the group's size)."""
    pg = resolve_group(group)
    if pg is None:
        return warn_not_member("all_gather_object")
    if len(object_list) != pg.size:
        raise ValueError(f"all_gather_object: object_list has {len(object_list)} items, expected {pg.size}")
    padded, sizes = _padded_payload(pg, obj, group, weights_only)
    longest = padded.numel()
    gathered = padded.new_empty(longest * pg.size)
    coll.all_gather_into_tensor(gathered, padded, group=group)
    for i, size in enumerate(sizes):
        object_list[i] = _decode(gathered[i * longest : (i + 1) * longest], size, weights_only)
    return None


def gather_object(
    obj: Any,
    object_gather_list: Optional[list[Any]] = None,
    dst: Optional[int] = None,
    group: Any = None,
    group_dst: Optional[int] = None,
    weights_only: bool = False,
) -> None:
    """On rank ``dst`` (default: the group's first; or group rank ``group_dst``),
    ``object_gather_list[i]`` receives rank i's ``obj``. Only the destination unpickles."""
    pg = resolve_group(group)
    if pg is None:
        return warn_not_member("gather_object")
    root = peer_rank("gather_object", pg, "dst", dst, group_dst, default=0)
    padded, sizes = _padded_payload(pg, obj, group, weights_only)
    pieces = [padded.new_empty(padded.numel()) for _ in range(pg.size)] if pg.rank == root else None
    coll.gather(padded, pieces, group=group, group_dst=root)
    if pieces is not None:  # checked after the gather, so that the other ranks are not left waiting
        if object_gather_list is None or len(object_gather_list) != pg.size:
            raise ValueError(f"gather_object: object_gather_list must have {pg.size} items on the destination rank")
        object_gather_list[:] = [_decode(piece, size, weights_only) for piece, size in zip(pieces, sizes)]
    return None


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: Optional[list[Any]] = None,
    src: Optional[int] = None,
    group: Any = None,
    group_src: Optional[int] = None,
    weights_only: bool = False,
) -> None:
    """``scatter_object_output_list[0]`` receives item i of rank ``src``'s input list on rank i
    (``src`` default: the group's first; or group rank ``group_src``)."""
    pg = resolve_group(group)
    if pg is None:
        return warn_not_member("scatter_object_list")
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ValueError("scatter_object_list: scatter_object_output_list must be a non-empty list")
    root = peer_rank("scatter_object_list", pg, "src", src, group_src, default=0)
    items: list[Any] = list(scatter_object_input_list or []) if pg.rank == root else [None] * pg.size
    if pg.rank == root and len(items) != pg.size:
        raise ValueError(f"scatter_object_list: the source needs {pg.size} input objects, got {len(items)}")
    broadcast_object_list(items, pg.ranks[root], group=group, weights_only=weights_only)
    scatter_object_output_list[0] = items[pg.rank]
    return None


def send_object_list(
    object_list: list[Any],
    dst: Optional[int] = None,
    group: Any = None,
    device: Any = None,
    group_dst: Optional[int] = None,
    use_batch: bool = False,
    weights_only: bool = False,
) -> None:
    """Send the objects of ``object_list`` to rank ``dst`` (or group rank ``group_dst``), as
    tensors on ``device`` (default: CPU when the group serves it); see :func:`recv_object_list`.
    ``use_batch`` is accepted for torch compatibility: the two messages (sizes, then the
    pickled bytes) are sent in order either way."""
    pg = resolve_group(group)
    if pg is None:
        return warn_not_member("send_object_list")
    dst = pg.ranks[peer_rank("send_object_list", pg, "dst", dst, group_dst, allow_self=False)]
    device = device or _device(pg)
    payloads = [_encode(obj, device, weights_only) for obj in object_list]
    sizes = _sizes(len(object_list), device)
    for i, payload in enumerate(payloads):
        sizes[i] = payload.numel()
    p2p.send(sizes, dst, group=group)
    import torch

    p2p.send(torch.cat(payloads) if payloads else sizes.new_empty(0, dtype=torch.uint8), dst, group=group)


def recv_object_list(
    object_list: list[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Any = None,
    group_src: Optional[int] = None,
    use_batch: bool = False,
    weights_only: bool = False,
) -> int:
    """Fill ``object_list`` (same length as the sender's) with objects sent by ``src`` (or
    group rank ``group_src``; neither: any rank); returns the sender's global rank.
    ``device``, ``use_batch`` and ``weights_only`` (the sender's) as in :func:`send_object_list`."""
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("recv_object_list")
        return -1
    import torch

    if group_src is not None or src is not None:
        src = pg.ranks[peer_rank("recv_object_list", pg, "src", src, group_src, allow_self=False)]
    device = device or _device(pg)
    sizes = _sizes(len(object_list), device)
    sender = p2p.recv(sizes, src, group=group)
    flat = torch.empty(int(sizes.sum()), dtype=torch.uint8, device=device)
    p2p.recv(flat, sender, group=group)
    offset = 0
    for i, size in enumerate(sizes.tolist()):
        object_list[i] = _decode(flat[offset : offset + size], size, weights_only)
        offset += size
    return sender
