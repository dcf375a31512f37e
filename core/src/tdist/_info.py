"""``python -m tdist info``: installed plugins, backend availability and the
support table, generated live from what the installed backends declare."""

from __future__ import annotations

from typing import Sequence

from tdist_autoload._shared import BRIDGE_ENV, bridge_disabled

from ._backend import ANY_SOURCE_OP, OPERATIONS, BackendSpec
from ._plugins import Plugins, plugins

__all__ = ["support_table", "info_text"]

YES, NO = "✓", "✘"


def support_table(specs: Sequence[BackendSpec], devices: Sequence[str] = ("cpu", "cuda")) -> str:
    """torch.distributed's 2017 docs' table (operation × backend × device) as Markdown, and a last row:
    whether torch.distributed can use the backend (``tdist-<name>``, see ``BackendSpec.torch_bridge``)."""
    header = ["Backend"] + [f"`{s.name}` {d.upper() if d == 'cpu' else 'GPU'}" for s in specs for d in devices]
    rows = [header, ["---"] * len(header)]
    for operation in (*OPERATIONS, ANY_SOURCE_OP):
        label = "recv (any source)" if operation == ANY_SOURCE_OP else operation
        rows.append([label] + [YES if s.supports(operation, d) else NO for s in specs for d in devices])
    # whether torch.distributed can use the backend (as tdist-<name>, and as its default group)
    rows.append(
        ["torch.distributed"]
        + [YES if s.torch_bridge is None and d in s.devices else NO for s in specs for d in devices]
    )
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def torch_text() -> str:
    """Lines on torch: the supported range, the torch found, whether the bridge attaches."""
    from ._version import TORCH_REQUIREMENT

    lines = [f"torch supported: torch{TORCH_REQUIREMENT}"]
    try:
        from ._torch.features import features
    except ImportError as exc:  # tdist without torch
        return "\n".join([*lines, f"torch found: none ({exc})"])
    found = features()
    lines.append(f"torch found: {found.describe()}")
    if bridge_disabled():
        lines.append(f"torch bridge: off ({BRIDGE_ENV}=0)")
    elif found.attachable:
        lines.append("torch bridge: on (tdist's groups are torch.distributed's; torch knows tdist-<name>)")
    else:
        lines.append("torch bridge: cannot attach (tdist's own API works; torch's utilities do not see its groups)")
    return "\n".join(lines)


def info_text(registry: Plugins | None = None) -> str:
    registry = registry or plugins()
    lines = [torch_text(), "", "Plugins:"]
    for record in registry.records:
        status = "loaded" if record.loaded else f"not loaded: {record.error}"
        lines.append(f"  {record.name:<20} {record.distribution or '-'} {record.version or ''}  [{status}]")
    lines += ["", "Backends:"]
    for spec in registry.backends.specs():
        state = "available" if spec.available is None else f"unavailable: {spec.available}"
        lines.append(f"  {spec.name:<8} {state}  (devices: {', '.join(spec.devices)}; from {spec.distribution})")
        if spec.description:
            lines.append(f"           {spec.description}")
    lines += ["", "Init methods: " + ", ".join(f"{s}://" for s in registry.rendezvous.schemes()), ""]
    lines += ["Support table:", support_table(registry.backends.specs())]
    return "\n".join(lines)
