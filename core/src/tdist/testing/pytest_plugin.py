"""pytest plugin of the tdist conformance kit (entry point ``pytest11: tdist``).

Options::

    --tdist-backend NAME        backend to test; repeatable (default: every installed, available one)
    --tdist-world-sizes 1,2,4   world sizes (default 1,2,4)
    --tdist-launcher auto|env|mpi   how worlds start (auto: as the spec's launcher says)
    --tdist-dist-module NAME    module under test (default: $TDIST_TESTING_DIST_MODULE or tdist);
                                torch.distributed validates the kit itself
    --tdist-init-method URL     init_method of pooled worlds (default env://)
    --tdist-body-timeout S      seconds one body may take before its world is killed (default 60)
    --tdist-pg-timeout S        process-group timeout of pooled worlds (default 30)

Fixtures:

``tdist_world``      a started :class:`~tdist.testing.World`, parametrized over
                     (backend, world size), session-scoped: its processes run
                     every test of that parameter, then are shut down
``tdist_scenario``   a :class:`~tdist.testing.scenarios.ScenarioContext` per backend
                     (failure scenarios spawn their own one-off worlds)
``tdist_body_timeout``  the ``--tdist-body-timeout`` value
``tdist_cluster``    a started simulated cluster (:class:`tdist.testing.cluster.Cluster`),
                     one per test: 2 hosts, or the arguments of
                     ``@pytest.mark.tdist_cluster(hosts=3, rate="1gbit", delay=0.001)``;
                     closed after the test, skipped where namespaces are unavailable

Third party, three lines (``test_mybackend.py``)::

    from tdist.testing import collect
    collect(globals())                      # the conformance bodies
    collect(globals(), suite="failures")    # and the failure scenarios

then ``pytest test_mybackend.py --tdist-backend mybackend``; or, with no file
at all, ``pytest --pyargs tdist.testing.suite --tdist-backend mybackend``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest

from ._common import DIST_MODULE_ENV, dist_module_name
from .scenarios import ScenarioContext
from .world import World, WorldStartError

__all__ = ["WorldPool", "default_backends"]


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("tdist", "tdist conformance kit")
    group.addoption(
        "--tdist-backend",
        action="append",
        dest="tdist_backends",
        default=None,
        metavar="NAME",
        help="backend to run the conformance suite against (repeatable; default: all available)",
    )
    group.addoption(
        "--tdist-world-sizes",
        dest="tdist_world_sizes",
        default=None,
        metavar="N,N,...",
        help="comma-separated world sizes (default: 1,2,4)",
    )
    group.addoption(
        "--tdist-launcher",
        dest="tdist_launcher",
        default="auto",
        choices=("auto", "env", "mpi"),
        help="how worlds start: one process per rank (env) or one mpirun (mpi); auto: as the backend's BackendSpec.launcher says",
    )
    group.addoption(
        "--tdist-dist-module",
        dest="tdist_dist_module",
        default=None,
        metavar="MODULE",
        help="module under test (default $TDIST_TESTING_DIST_MODULE or tdist; torch.distributed validates the kit)",
    )
    group.addoption(
        "--tdist-init-method",
        dest="tdist_init_method",
        default="env://",
        metavar="URL",
        help="init_method for the pooled worlds (default env://)",
    )
    group.addoption(
        "--tdist-body-timeout",
        dest="tdist_body_timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a body may run before its world is killed (default 60)",
    )
    group.addoption(
        "--tdist-pg-timeout",
        dest="tdist_pg_timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="process-group timeout of the pooled worlds (default 30)",
    )


def pytest_configure(config: Any) -> None:
    module = config.getoption("tdist_dist_module", None)
    if module:
        os.environ[DIST_MODULE_ENV] = module
    config.addinivalue_line("markers", "tdist_world: the test runs a body in every rank of a tdist World")
    config.addinivalue_line("markers", "slow: multi-process scenarios that take several seconds")
    config.addinivalue_line(
        "markers",
        "tdist_cluster(hosts=2, rate=None, delay=0.0, delay_line=None): "
        "arguments of the tdist_cluster fixture's Cluster",
    )
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): per-test time limit (needs pytest-timeout)")
    config._tdist_pool = WorldPool(config)


def pytest_unconfigure(config: Any) -> None:
    pool = getattr(config, "_tdist_pool", None)
    if pool is not None:
        pool.close_all()


def default_backends() -> list[str]:
    """Every installed and available backend of the module under test (tdist), else ["tcp"]."""
    if dist_module_name().split(".")[0] != "tdist":
        return ["gloo"]
    try:
        import tdist

        listing = getattr(tdist, "available_backends", None)
        names = list(listing()) if listing is not None else []
    except Exception:
        names = []
    return names or ["tcp"]


def spec_launcher(backend: str) -> Optional[str]:
    """How ``backend``'s worlds start: its :attr:`tdist.BackendSpec.launcher` (``"mpirun"`` or None);
    for torch.distributed's own backends, ``"mpirun"`` for ``mpi``."""
    if dist_module_name().split(".")[0] != "tdist":
        return "mpirun" if backend.lower() == "mpi" else None
    import tdist

    try:
        return tdist.get_backend_spec(backend).launcher
    except tdist.DistError:  # not installed: the world reports that when it starts
        return None


def spec_mpirun_args(backend: str) -> list[str]:
    """What ``mpirun`` needs for ``backend``'s declared features: its spec's
    ``extra["mpirun_args"]`` (tdist-mpi: ``--with-ft ulfm`` where MPI has fault tolerance)."""
    if dist_module_name().split(".")[0] != "tdist":
        return []
    import tdist

    try:
        return [str(arg) for arg in (tdist.get_backend_spec(backend).extra or {}).get("mpirun_args", ())]
    except tdist.DistError:
        return []


class WorldPool:
    """The session's worlds, one per (backend, world size), started on first use."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.worlds: dict[tuple, World] = {}
        self.failed: dict[tuple, BaseException] = {}

    # ----------------------------------------------------------------- options
    def backends(self) -> list[str]:
        names = self.config.getoption("tdist_backends", None)
        if names:
            out: list[str] = []
            for item in names:
                out += [n.strip() for n in item.split(",") if n.strip()]
            return out
        return default_backends()

    def world_sizes(self) -> list[int]:
        raw = self.config.getoption("tdist_world_sizes", None) or "1,2,4"
        try:
            sizes = [int(x) for x in str(raw).split(",") if x.strip()]
        except ValueError:
            raise pytest.UsageError(f"--tdist-world-sizes: expected comma-separated integers, got {raw!r}") from None
        if not sizes or any(s < 1 for s in sizes):
            raise pytest.UsageError(f"--tdist-world-sizes: sizes must be >= 1, got {raw!r}")
        return sizes

    def launcher(self, backend: str) -> str:
        choice = self.config.getoption("tdist_launcher", "auto") or "auto"
        if choice == "auto":
            return "mpi" if spec_launcher(backend) == "mpirun" else "env"
        return choice

    def world_kwargs(self, backend: str) -> dict:
        launcher = self.launcher(backend)
        return {
            "launcher": launcher,
            "init_method": self.config.getoption("tdist_init_method", "env://"),
            "pg_timeout": self.config.getoption("tdist_pg_timeout", 30.0),
            "dist_module": dist_module_name(),
            "mpirun_args": spec_mpirun_args(backend) if launcher == "mpi" else [],
        }

    # ----------------------------------------------------------------- worlds
    def get(self, backend: str, world_size: int) -> World:
        key = (backend, world_size)
        if key in self.failed:
            raise self.failed[key]
        world = self.worlds.get(key)
        if world is None:
            world = World(backend, world_size, **self.world_kwargs(backend))
            self.worlds[key] = world
        try:
            world.start()
        except WorldStartError as exc:
            self.failed[key] = exc
            raise
        return world

    def release(self, backend: str, world_size: int) -> None:
        world = self.worlds.pop((backend, world_size), None)
        if world is not None:
            world.close()

    def close_all(self) -> None:
        for key in list(self.worlds):
            self.release(*key)


def _pool(config: Any) -> WorldPool:
    pool = getattr(config, "_tdist_pool", None)
    if pool is None:
        pool = config._tdist_pool = WorldPool(config)
    return pool


def pytest_generate_tests(metafunc: Any) -> None:
    pool = _pool(metafunc.config)
    if "tdist_world" in metafunc.fixturenames:
        keys = [(b, n) for b in pool.backends() for n in pool.world_sizes()]
        metafunc.parametrize("tdist_world", keys, indirect=True, scope="session", ids=[f"{b}-ws{n}" for b, n in keys])
    if "tdist_scenario" in metafunc.fixturenames:
        names = pool.backends()
        metafunc.parametrize("tdist_scenario", names, indirect=True, scope="session", ids=names)


def pytest_collection_modifyitems(config: Any, items: list) -> None:
    """Skip, at collection, the generated tests that cannot run for their world size
    (or at all against the torch.distributed reference), so reports point at them."""
    from ._collect import static_skip_reason

    module = dist_module_name()
    for item in items:
        fn = getattr(item, "function", None)
        target = getattr(fn, "_tdist_body", None) or getattr(fn, "_tdist_scenario", None)
        if target is None:
            continue
        callspec = getattr(item, "callspec", None)
        param = callspec.params.get("tdist_world") if callspec is not None else None
        world_size = param[1] if isinstance(param, tuple) else None
        reason = static_skip_reason(target, world_size, module)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tdist_world(request: Any) -> Any:
    """A started World for (backend, world size); shut down when the session moves on."""
    backend, world_size = getattr(request, "param", (None, None))
    if backend is None or world_size is None:
        pytest.fail("tdist_world is parametrized by the tdist plugin (pytest_generate_tests)", pytrace=False)
    pool = _pool(request.config)
    world = pool.get(backend, world_size)
    yield world
    pool.release(backend, world_size)


@pytest.fixture(scope="session")
def tdist_scenario(request: Any) -> ScenarioContext:
    backend = getattr(request, "param", None)
    if backend is None:
        pytest.fail("tdist_scenario is parametrized by the tdist plugin (pytest_generate_tests)", pytrace=False)
    pool = _pool(request.config)
    kwargs = pool.world_kwargs(backend)
    return ScenarioContext(
        backend=backend,
        dist_module=kwargs.pop("dist_module"),
        launcher=kwargs.pop("launcher"),
        world_kwargs={"init_method": kwargs["init_method"], "mpirun_args": kwargs["mpirun_args"]},
    )


@pytest.fixture(scope="session")
def tdist_body_timeout(request: Any) -> float:
    return float(request.config.getoption("tdist_body_timeout", 60.0))


@pytest.fixture
def tdist_cluster(request: Any) -> Any:
    """A started :class:`~tdist.testing.cluster.Cluster` (2 hosts unless
    ``@pytest.mark.tdist_cluster(...)`` gives its arguments), closed after the test,
    also when it fails; the test is skipped, saying why, where this machine cannot
    make namespaces."""
    from .cluster import Cluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"simulated cluster unavailable: {reason}")
    marker = request.node.get_closest_marker("tdist_cluster")
    with Cluster(*(marker.args if marker else ()), **(marker.kwargs if marker else {})) as cluster:
        yield cluster


def pytest_report_header(config: Any) -> Optional[str]:
    pool = getattr(config, "_tdist_pool", None)
    if pool is None:
        return None
    try:
        backends = pool.backends()
        sizes = pool.world_sizes()
    except Exception as exc:  # pragma: no cover - reported by generate_tests too
        return f"tdist: {exc}"
    return f"tdist: module under test {dist_module_name()}; backends {backends}; world sizes {sizes}"
