"""The registry of test bodies: ``@body(...)`` marks a module-level function as a
conformance body, run on every rank of a world; :func:`bodies` lists them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

__all__ = ["Body", "body", "bodies", "SUITES"]

#: The suites bodies belong to: the API conformance bodies, the tutorial programs and
#: torch's own utilities over the module's groups.
SUITES = ("conformance", "tutorial", "torch")

Requires = Union[Sequence[str], Callable[..., Sequence[str]]]


@dataclass
class Body:
    """A registered body and how to run it.

    ``params``: keyword-argument sets, one test each (``ids`` name them).
    ``min_world_size`` / ``max_world_size``: outside that range the test is skipped, saying why.
    ``requires``: capability keys (see :mod:`tdist.testing.capabilities`) the body
    needs, or a function of the body's kwargs returning them.
    ``reference_xfail``: why torch.distributed (the reference the kit is validated
    against) fails this body although tdist must pass it; applies only when the
    module under test is not tdist.
    ``tdist_only``: why the body cannot run against torch.distributed at all (it
    would hang there); the test is skipped with that reason in reference mode.
    ``check``: optional controller-side ``check(results, world_size, **kwargs)``.
    ``fatal_when_unsupported``: a backend lacking a required capability may abort the
    process instead of raising (gloo on an oversized message), so the body is not run
    there; the test is reported xfail, naming the capability and why.
    """

    fn: Callable[..., Any]
    name: str
    suite: str = "conformance"
    params: list[dict] = field(default_factory=lambda: [{}])
    ids: Optional[list[str]] = None
    min_world_size: int = 1
    max_world_size: Optional[int] = None
    requires: Requires = ()
    timeout: Optional[float] = None
    reference_xfail: Optional[str] = None
    tdist_only: Optional[str] = None
    check: Optional[Callable[..., None]] = None
    fatal_when_unsupported: bool = False
    doc: str = ""

    def required(self, kwargs: dict) -> list[str]:
        req = self.requires(**kwargs) if callable(self.requires) else self.requires
        return list(req or ())

    def skip_reason(self, world_size: int) -> Optional[str]:
        if world_size < self.min_world_size:
            return f"{self.name} needs at least {self.min_world_size} ranks (world size {world_size})"
        if self.max_world_size is not None and world_size > self.max_world_size:
            return f"{self.name} runs on at most {self.max_world_size} ranks (world size {world_size})"
        return None

    @property
    def ref(self) -> str:
        return f"{self.fn.__module__}:{self.fn.__qualname__}"


_REGISTRY: dict[str, Body] = {}


def _param_id(kwargs: dict) -> str:
    parts = []
    for value in kwargs.values():
        if isinstance(value, bool):
            parts.append(str(value).lower())
        else:
            parts.append(str(value))
    return "-".join(parts) or "default"


def body(
    fn: Optional[Callable[..., Any]] = None,
    *,
    suite: str = "conformance",
    params: Optional[Sequence[dict]] = None,
    ids: Optional[Sequence[str]] = None,
    min_world_size: int = 1,
    max_world_size: Optional[int] = None,
    requires: Requires = (),
    timeout: Optional[float] = None,
    reference_xfail: Optional[str] = None,
    tdist_only: Optional[str] = None,
    check: Optional[Callable[..., None]] = None,
    name: Optional[str] = None,
    fatal_when_unsupported: bool = False,
) -> Any:
    """Register a module-level function as a test body (usable bare or with options)."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r} (known: {SUITES})")

    def register(f: Callable[..., Any]) -> Callable[..., Any]:
        plist = [dict(p) for p in params] if params else [{}]
        b = Body(
            fn=f,
            name=name or f.__name__,
            suite=suite,
            params=plist,
            ids=list(ids) if ids else ([_param_id(p) for p in plist] if params else None),
            min_world_size=min_world_size,
            max_world_size=max_world_size,
            requires=requires,
            timeout=timeout,
            reference_xfail=reference_xfail,
            tdist_only=tdist_only,
            check=check,
            fatal_when_unsupported=fatal_when_unsupported,
            doc=(f.__doc__ or "").strip().splitlines()[0] if f.__doc__ else "",
        )
        key = f"{f.__module__}:{f.__qualname__}"
        _REGISTRY[key] = b
        f.__tdist_body__ = b  # type: ignore[attr-defined]
        return f

    return register(fn) if fn is not None else register


def bodies(suite: Optional[str] = None, modules: Optional[Sequence[str]] = None) -> list[Body]:
    """Registered bodies in definition order, optionally of one suite / some modules."""
    out = []
    for b in _REGISTRY.values():
        if suite is not None and b.suite != suite:
            continue
        if modules is not None and b.fn.__module__ not in modules:
            continue
        out.append(b)
    return out
