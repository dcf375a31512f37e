"""mkdocs hooks of the tdist docs.

* ``<!-- tdist:support-table -->`` in a page becomes the backend support table,
  generated at build time from what the *installed* backends declare
  (:func:`tdist._info.support_table` over every registered :class:`tdist.BackendSpec`);
  ``<!-- tdist:backend-notes -->`` the per-backend notes (distribution, availability,
  devices, description, options and declared limits from ``spec.extra``);
  ``<!-- tdist:plugins -->`` the installed plugins and their load status;
  ``<!-- tdist:init-methods -->`` the registered init-method schemes.
* Sphinx cross-reference roles left in docstrings (``:class:`X```) are shown as code.
"""

from __future__ import annotations

import re
from typing import Any

_MARKERS = ("support-table", "backend-notes", "plugins", "init-methods")


def _registry() -> Any:
    from tdist._plugins import plugins

    return plugins()


def _support_table() -> str:
    from tdist._info import support_table

    specs = _registry().backends.specs()
    if not specs:
        return "*No backend is installed in the environment that built these pages.*"
    devices = sorted({d for s in specs for d in s.devices}, key=lambda d: (d != "cpu", d))
    return support_table(specs, devices=devices)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _backend_notes() -> str:
    specs = _registry().backends.specs()
    if not specs:
        return ""
    out = []
    for spec in specs:
        state = "available" if spec.available is None else f"unavailable here: {spec.available}"
        out.append(f"### `{spec.name}`\n")
        out.append(f"- distribution: `{spec.distribution or '?'}`; {_cell(state)}")
        out.append(f"- devices: {', '.join(f'`{d}`' for d in spec.devices)}")
        if spec.description:
            out.append(f"- {_cell(spec.description)}")
        if spec.default_init_method:
            out.append(f"- default init method: `{spec.default_init_method}`")
        if spec.torch_bridge is None:
            out.append(f"- torch.distributed backend: `tdist-{spec.name}` ([torch's utilities](guide/torch.md))")
        else:
            out.append(f"- not usable by torch.distributed: {_cell(spec.torch_bridge)}")
        extra = dict(spec.extra or {})
        options = extra.pop("options", None)
        if options:
            out.append(f"- `pg_options` keys: {', '.join(f'`{o}`' for o in options)}")
        unsupported = extra.pop("unsupported", None)
        if unsupported:
            items = unsupported.items() if isinstance(unsupported, dict) else ((k, "") for k in unsupported)
            out.append("- declared unsupported:")
            for key, why in items:
                out.append(f"    - `{key}`" + (f": {_cell(why)}" if why else ""))
        for key, value in sorted(extra.items()):
            out.append(f"- `{key}`: {_cell(value)}")
        out.append("")
    return "\n".join(out)


def _plugins() -> str:
    rows = ["| entry point | distribution | version | status |", "| --- | --- | --- | --- |"]
    for record in _registry().records:
        status = "loaded" if record.loaded else f"not loaded: {record.error}"
        rows.append(f"| `{record.name}` | `{record.distribution or '-'}` | {record.version or ''} | {_cell(status)} |")
    return "\n".join(rows)


def _init_methods() -> str:
    return ", ".join(f"`{scheme}://`" for scheme in _registry().rendezvous.schemes())


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- tdist:" not in markdown:
        return markdown
    generators = {
        "support-table": _support_table,
        "backend-notes": _backend_notes,
        "plugins": _plugins,
        "init-methods": _init_methods,
    }
    for marker in _MARKERS:
        tag = f"<!-- tdist:{marker} -->"
        if tag in markdown:
            markdown = markdown.replace(tag, generators[marker]())
    return markdown


_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|mod|attr|exc|obj):<code>~?")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return _ROLE.sub("<code>", html)
