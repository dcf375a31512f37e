"""Turn registered bodies and scenarios into pytest tests.

A test module needs only::

    from tdist.testing import collect
    collect(globals())                       # or suite="tutorial" / "failures"

and is run with the plugin's options (``--tdist-backend NAME``,
``--tdist-world-sizes 1,2,4``). Each body becomes one test function
``test_<body>``, parametrized by the body's keyword sets and by the
``tdist_world`` fixture (one world per backend and size, started once).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ._registry import Body, bodies
from .capabilities import capabilities
from .scenarios import Scenario, ScenarioContext, scenarios
from .world import World, failures_first

__all__ = [
    "collect",
    "collect_conformance",
    "collect_tutorial",
    "collect_failures",
    "run_body",
    "run_scenario",
    "static_skip_reason",
]

#: Seconds pytest-timeout allows a test beyond the body's own timeout (a world restart fits).
_TIMEOUT_SLACK = 150.0
DEFAULT_BODY_TIMEOUT = 60.0
#: Seconds the other ranks get to finish once one rank's body has raised, before the world is
#: stopped (they are usually blocked in a collective waiting for that rank).
FAIL_FAST = 3.0


def _is_tdist(module_name: str) -> bool:
    return module_name.split(".")[0] == "tdist"


def _timeout_mark(pytest: Any, seconds: float) -> Any:
    return pytest.mark.timeout(seconds)


def run_body(world: World, b: Body, kwargs: dict, *, body_timeout: Optional[float] = None) -> list:
    """Run body ``b`` in ``world`` the way the generated tests do: skip outside its world
    sizes, expect a clean error (xfail) for undeclared capabilities, xfail known
    deviations of the torch.distributed reference, else require success."""
    __tracebackhide__ = True
    import pytest

    reason = b.skip_reason(world.world_size)
    if reason:
        pytest.skip(reason)
    reference = not _is_tdist(world.dist_module)
    if b.tdist_only and reference:
        pytest.skip(f"reference run ({world.dist_module}): {b.tdist_only}")
    timeout = b.timeout or body_timeout or DEFAULT_BODY_TIMEOUT
    caps = capabilities(world.backend, world.dist_module)
    missing = [(key, caps.reason(key)) for key in b.required(kwargs) if not caps.supports(key)]
    if missing and b.fatal_when_unsupported:
        pytest.xfail(
            f"unsupported: {'; '.join(r or k for k, r in missing)} (not run: the violation aborts the process)"
        )
    if missing:
        outcomes = world.try_run(b.fn, timeout=timeout, fail_fast=FAIL_FAST, **kwargs)
        failures = failures_first(outcomes)
        keys = ", ".join(k for k, _ in missing)
        if not failures:
            pytest.fail(
                f"{world.backend!r} declares {keys} unsupported ({caps.source}), but {b.name} passed: "
                "the declaration is wrong",
                pytrace=False,
            )
        unclean = [f for f in failures if f.kind not in ("error", "stopped")]
        if unclean:
            raise world.error_for(b.ref, outcomes)
        pytest.xfail(f"unsupported: {'; '.join(r or k for k, r in missing)} -> raised {failures[0].headline}")
    if b.reference_xfail and reference:
        outcomes = world.try_run(b.fn, timeout=timeout, fail_fast=FAIL_FAST, **kwargs)
        failures = failures_first(outcomes)
        if failures:
            pytest.xfail(f"reference {world.dist_module} deviates: {b.reference_xfail} ({failures[0].headline})")
        return outcomes
    results = world.run(b.fn, timeout=timeout, fail_fast=FAIL_FAST, **kwargs)
    if b.check is not None:
        b.check(results, world.world_size, **kwargs)
    return results


def run_scenario(ctx: ScenarioContext, sc: Scenario, kwargs: dict) -> None:
    """Run failure scenario ``sc`` (capabilities and reference deviations as in :func:`run_body`)."""
    __tracebackhide__ = True
    import pytest

    reference = not ctx.strict
    if ctx.launcher in sc.not_with:
        pytest.skip(f"launcher {ctx.launcher!r}: {sc.not_with[ctx.launcher]}")
    if sc.tdist_only and reference:
        pytest.skip(f"reference run ({ctx.dist_module}): {sc.tdist_only}")
    caps = capabilities(ctx.backend, ctx.dist_module)
    missing = [(key, caps.reason(key)) for key in sc.requires if not caps.supports(key)]
    if missing:
        # Declared unsupported: still run it; a failure is expected (xfail), a pass is fine.
        try:
            sc.fn(ctx, **kwargs)
        except AssertionError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            pytest.xfail(f"unsupported: {'; '.join(r or k for k, r in missing)} ({first})")
        return
    if sc.reference_xfail and reference:
        try:
            sc.fn(ctx, **kwargs)
        except AssertionError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            pytest.xfail(f"reference {ctx.dist_module} deviates: {sc.reference_xfail} ({first})")
        return
    sc.fn(ctx, **kwargs)


def _make_body_test(pytest: Any, b: Body) -> Any:
    if b.params == [{}] and not b.ids:

        def test(tdist_world: World, tdist_body_timeout: float) -> None:
            __tracebackhide__ = True
            run_body(tdist_world, b, {}, body_timeout=tdist_body_timeout)

    else:

        def test(tdist_world: World, tdist_body_timeout: float, body_kwargs: dict) -> None:  # type: ignore[misc]
            __tracebackhide__ = True
            run_body(tdist_world, b, body_kwargs, body_timeout=tdist_body_timeout)

        test = pytest.mark.parametrize("body_kwargs", b.params, ids=b.ids)(test)
    test.__name__ = f"test_{b.name}"
    test.__qualname__ = test.__name__
    test.__doc__ = b.doc or None
    test.__module__ = "tdist.testing.generated"
    test._tdist_body = b  # type: ignore[attr-defined]  # read by the plugin's collection hook
    limit = (b.timeout or DEFAULT_BODY_TIMEOUT) + _TIMEOUT_SLACK
    return _timeout_mark(pytest, limit)(pytest.mark.tdist_world(test))


def _make_scenario_test(pytest: Any, sc: Scenario) -> Any:
    if sc.params == [{}]:

        def test(tdist_scenario: ScenarioContext) -> None:
            run_scenario(tdist_scenario, sc, {})

    else:

        def test(tdist_scenario: ScenarioContext, scenario_kwargs: dict) -> None:  # type: ignore[misc]
            run_scenario(tdist_scenario, sc, scenario_kwargs)

        test = pytest.mark.parametrize("scenario_kwargs", sc.params, ids=sc.ids)(test)
    test.__name__ = f"test_{sc.name}"
    test.__qualname__ = test.__name__
    test.__doc__ = sc.doc or None
    test._tdist_scenario = sc  # type: ignore[attr-defined]
    return _timeout_mark(pytest, sc.timeout + 60)(pytest.mark.slow(test))


def static_skip_reason(b: Any, world_size: Optional[int], dist_module: str) -> Optional[str]:
    """Why a body/scenario cannot run here at all (known before running it), else None."""
    if world_size is not None and isinstance(b, Body):
        reason = b.skip_reason(world_size)
        if reason:
            return reason
    if getattr(b, "tdist_only", None) and not _is_tdist(dist_module):
        return f"reference run ({dist_module}): {b.tdist_only}"
    return None


def collect(
    namespace: dict,
    *,
    suite: str = "conformance",
    modules: Optional[Sequence[str]] = None,
    select: Optional[Sequence[str]] = None,
    exclude: Sequence[str] = (),
) -> list[str]:
    """Add one pytest test per body of ``suite`` ("conformance", "tutorial" or
    "failures") to ``namespace`` (a test module's ``globals()``); return their names.

    ``modules``: only bodies defined in these modules; ``select``/``exclude``: body names.
    Third-party bodies registered with :func:`tdist.testing.body` in imported
    modules are collected too.
    """
    import pytest

    from . import conformance  # noqa: F401  (registers the built-in bodies)

    names = []
    if suite == "failures":
        for sc in scenarios():
            if (select and sc.name not in select) or sc.name in exclude:
                continue
            name = f"test_{sc.name}"
            namespace[name] = _make_scenario_test(pytest, sc)
            names.append(name)
        return names
    for b in bodies(suite, modules):
        if (select and b.name not in select) or b.name in exclude:
            continue
        name = f"test_{b.name}"
        if name in namespace and not getattr(namespace[name], "__module__", "").startswith("tdist.testing"):
            continue  # the test module defines its own test of that name: keep it
        namespace[name] = _make_body_test(pytest, b)
        names.append(name)
    return names


def collect_conformance(namespace: dict, **kwargs: Any) -> list[str]:
    """:func:`collect` of the API conformance bodies."""
    return collect(namespace, suite="conformance", **kwargs)


def collect_tutorial(namespace: dict, **kwargs: Any) -> list[str]:
    """:func:`collect` of the tutorial programs."""
    return collect(namespace, suite="tutorial", **kwargs)


def collect_failures(namespace: dict, **kwargs: Any) -> list[str]:
    """:func:`collect` of the failure scenarios (one-off worlds)."""
    return collect(namespace, suite="failures", **kwargs)
