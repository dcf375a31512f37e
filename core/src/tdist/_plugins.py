"""Plugin loading: the lazily created plugin manager and the registries plugins fill.

Entry points in the group ``tdist`` are loaded on first use, each in isolation:
a plugin that fails to import, that was written for another major version of
the hook contract, that implements a hook the contract does not have (a
misspelled name), or whose registration hook raises, is recorded as not loaded
with its reason and never breaks ``import tdist`` or another plugin. Loading is
all or nothing per plugin: a refused plugin leaves no backend, init method or
hook behind. ``TDIST_DISABLED_PLUGINS`` (comma-separated entry-point names)
blocks named plugins.

Discovery reads each installed distribution's ``entry_points.txt`` and parses only those
that name the group, and a plugin's distribution name and version come from its
metadata's first lines (:func:`_discover`): every process pays this once, before its
rendezvous, and ``importlib.metadata``'s own ``entry_points()`` costs several times more.

The core calls hooks only through :class:`Plugins`' typed methods.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import pluggy
from tdist_autoload._shared import PREFIX as _TORCH_PREFIX  # "tdist-": the name torch and pip know a backend by

from . import hookspecs
from ._backend import BackendSpec
from ._errors import DistError

__all__ = [
    "BackendRegistry",
    "RendezvousRegistry",
    "RendezvousHandler",
    "WorkInfo",
    "PluginRecord",
    "Plugins",
    "plugins",
    "reset_plugins",
]

ENTRY_POINT_GROUP = "tdist"
DISABLE_ENV = "TDIST_DISABLED_PLUGINS"

_log = logging.getLogger("tdist")

RendezvousHandler = Callable[..., tuple]


class BackendRegistry:
    """Collects the :class:`BackendSpec` objects plugins register (names are lower-case).

    A plugin whose spec needs a probe of the machine (loading MPI, looking for a GPU)
    registers it with :meth:`add_deferred`: the probe then runs when the backend is
    first asked about, never because another backend's group was created.
    """

    def __init__(self) -> None:
        self._specs: dict[str, BackendSpec] = {}
        self._deferred: dict[str, tuple[str, Callable[[], BackendSpec]]] = {}
        self.current_plugin = ""

    def _check_new(self, name: str) -> None:
        if name in self._specs or name in self._deferred:
            first = self._specs[name].distribution if name in self._specs else self._deferred[name][0]
            raise DistError(f"backend {name!r} registered twice (by {first!r} and {self.current_plugin!r})")

    def add(self, spec: BackendSpec) -> None:
        """Register ``spec``; a name registered twice is an error naming both plugins."""
        name = spec.name.lower()
        self._check_new(name)
        self._specs[name] = self._owned(spec, self.current_plugin)

    def add_deferred(self, name: str, make_spec: Callable[[], BackendSpec]) -> None:
        """Register backend ``name``, whose spec ``make_spec()`` makes on first use (once).
        If ``make_spec`` raises, the backend is registered as unavailable with the error."""
        name = name.lower()
        self._check_new(name)
        self._deferred[name] = (self.current_plugin, make_spec)

    @staticmethod
    def _owned(spec: BackendSpec, plugin: str) -> BackendSpec:
        if spec.distribution and spec.name == spec.name.lower():
            return spec
        return dataclasses.replace(spec, name=spec.name.lower(), distribution=spec.distribution or plugin)

    def _resolve(self, name: str) -> None:
        plugin, make_spec = self._deferred.pop(name)
        try:
            spec = make_spec()
            if spec.name.lower() != name:
                raise DistError(f"the deferred spec of backend {name!r} is named {spec.name!r}")
        except Exception as exc:  # a broken probe makes the backend unavailable, not tdist unusable
            reason = f"probing the backend failed: {type(exc).__name__}: {exc}"
            spec = BackendSpec(name=name, factory=_unavailable(reason), operations={}, available=reason)
        self._specs[name] = self._owned(spec, plugin)

    def get(self, name: str) -> Optional[BackendSpec]:
        """The spec of backend ``name``; ``"tdist-<name>"`` (the name torch.distributed knows
        it by, and its distribution's) finds ``<name>`` too."""
        name = name.lower()
        if name.startswith(_TORCH_PREFIX) and name not in self._specs and name not in self._deferred:
            name = name[len(_TORCH_PREFIX) :]
        if name in self._deferred:
            self._resolve(name)
        return self._specs.get(name)

    def names(self) -> list[str]:
        return sorted({*self._specs, *self._deferred})

    def specs(self) -> list[BackendSpec]:
        return [spec for spec in map(self.get, self.names()) if spec is not None]

    def _snapshot(self) -> tuple[dict, dict]:
        return dict(self._specs), dict(self._deferred)

    def _restore(self, snapshot: tuple[dict, dict]) -> None:
        self._specs, self._deferred = dict(snapshot[0]), dict(snapshot[1])


def _unavailable(reason: str) -> Callable[..., Any]:
    def factory(**_kwargs: Any) -> Any:
        raise DistError(reason)

    return factory


class RendezvousRegistry:
    """Maps URL schemes (``env``, ``tcp``, ``file``, ...) to rendezvous handlers."""

    def __init__(self) -> None:
        self._handlers: dict[str, RendezvousHandler] = {}

    def add(self, scheme: str, handler: RendezvousHandler) -> None:
        scheme = scheme.lower()
        if scheme in self._handlers:
            raise DistError(f"init method scheme {scheme!r}:// registered twice")
        self._handlers[scheme] = handler

    def get(self, scheme: str) -> Optional[RendezvousHandler]:
        return self._handlers.get(scheme.lower())

    def schemes(self) -> list[str]:
        return sorted(self._handlers)


@dataclass
class WorkInfo:
    """What the work hooks observe about one operation (public as ``tdist.WorkInfo``).

    ``op``: the operation (``"all_reduce"``, ``"broadcast"``, ``"send"``, ``"recv"``, ...).
    ``group``: the group's name, ``"pg0"`` for the default group and ``"pgN"`` for the
    N-th ``new_group`` (the same name on every rank). ``group_ranks``: the group's global
    ranks in group-rank order; ``rank``: this process's global rank.
    ``seq`` numbers the group's operations of one kind, from 1: for a collective, the
    group's collective counter (the n-th collective of a group has ``seq`` n on every rank,
    so ``(group, seq)`` matches a collective across ranks); for ``send``/``recv``, this
    rank's own count of point-to-point operations in the group (not comparable between
    ranks). ``seq`` is 0 for an operation rejected before it was issued.
    ``shapes``: the shapes (``torch.Size``) of the tensors that describe the operation (the input, or the
    in-place tensor); ``dtype``: their dtype as ``str(torch.dtype)`` (``"torch.float32"``,
    ``""`` with no tensor); ``nbytes``: their total size in bytes.
    ``reduce_op``: the reduction's name (``"SUM"``, ``"AVG"``, ``"PREMUL_SUM"``, ...) for
    reducing collectives, else None. ``root``: the global rank of the source or
    destination of ``broadcast``/``reduce``/``gather``/``scatter``, else None.
    ``peer``: for ``send``/``recv``, the other side's global rank (None: a receive from
    any source); ``tag``: their tag (None for collectives).
    ``issued_at``: ``time.perf_counter()`` at issue (durations); ``issued_time``:
    ``time.time()`` at issue (comparable between processes of one host).
    """

    op: str
    group: str
    seq: int
    shapes: Sequence[tuple[int, ...]]
    dtype: str
    nbytes: int
    backend: str
    issued_at: float = field(default_factory=time.perf_counter)
    rank: int = -1
    group_ranks: tuple[int, ...] = ()
    reduce_op: Optional[str] = None
    root: Optional[int] = None
    peer: Optional[int] = None
    tag: Optional[int] = None
    issued_time: float = field(default_factory=time.time)


@dataclass
class PluginRecord:
    """One entry point: its name, distribution, version and load status."""

    name: str
    distribution: str
    version: str
    error: Optional[str] = None

    @property
    def loaded(self) -> bool:
        return self.error is None


def _direct_calls(hook: Any, *names: str) -> Optional[list[Callable[..., Any]]]:
    """The implementations of a per-operation ``hook`` (whose arguments are ``names``) as
    functions taking those arguments positionally, in pluggy's calling order: calling
    them saves pluggy's per-call cost. None when one of them is a wrapper (then pluggy
    calls them)."""
    impls = hook.get_hookimpls()
    if any(impl.hookwrapper or getattr(impl, "wrapper", False) for impl in impls):
        return None
    return [_positional(impl.function, tuple(impl.argnames), names) for impl in reversed(impls)]


def _positional(function: Callable[..., Any], takes: tuple[str, ...], names: tuple[str, ...]) -> Callable[..., Any]:
    """``function`` (which takes the subset ``takes`` of ``names``) called with all of ``names``."""
    if takes == names:
        return function
    return lambda *values: function(*[values[names.index(name)] for name in takes])


def _discover(group: str = ENTRY_POINT_GROUP) -> list[tuple[Any, str, str]]:
    """The entry points of ``group`` of the installed distributions, each with its
    distribution's name and version; a distribution installed twice counts once (the
    first on ``sys.path``, as ``importlib.metadata.entry_points`` has it)."""
    found: list[tuple[Any, str, str]] = []
    seen: set[str] = set()
    header = f"[{group}]"
    for dist in importlib.metadata.distributions():
        try:
            text = dist.read_text("entry_points.txt")
        except (OSError, UnicodeDecodeError):
            continue
        if not text or header not in text:
            continue
        name, version = _name_and_version(dist)
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        found.extend((ep, name, version) for ep in dist.entry_points if ep.group == group)
    return found


def _name_and_version(dist: Any) -> tuple[str, str]:
    """A distribution's name and version from the first lines of its metadata (the full
    parse by ``importlib.metadata`` costs about half a millisecond each)."""
    name = version = ""
    try:
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    except (OSError, UnicodeDecodeError):
        text = ""
    for line in text.splitlines():
        if not line:  # the end of the headers
            break
        key, _, value = line.partition(":")
        if key == "Name" and not name:
            name = value.strip()
        elif key == "Version" and not version:
            version = value.strip()
        if name and version:
            break
    if not name:
        name, version = getattr(dist, "name", "") or "", getattr(dist, "version", "") or ""
    return name, version


def _described(ep: Any) -> tuple[Any, str, str]:
    """A given entry point (not discovered: tests, embedding) with its distribution's name and version."""
    dist = getattr(ep, "dist", None)
    return ep, getattr(dist, "name", "") or "", getattr(dist, "version", "") or ""


def _disabled_names() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def _hook_names() -> list[str]:
    return [name for name in dir(hookspecs) if name.startswith("tdist_")]


def _unknown_hook_error(pm: pluggy.PluginManager) -> Optional[str]:
    """Why the plugin just registered with ``pm`` implements a hook the contract lacks, or None."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError:
        pass
    else:
        return None
    unknown = sorted(
        name
        for name in vars(pm.hook)
        if not name.startswith("_") and not getattr(pm.hook, name).has_spec() and getattr(pm.hook, name).get_hookimpls()
    )
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, _hook_names(), n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"implements {', '.join(hints)}, which tdist has no hook for (hooks: {', '.join(_hook_names())})"


def _version_error(plugin: Any) -> Optional[str]:
    declared = getattr(plugin, "TDIST_HOOKSPEC_VERSION", None)
    major, minor = hookspecs.HOOKSPEC_VERSION
    fits = f"this tdist accepts {major}.0 to {major}.{minor}"
    if declared is None:
        return f"does not declare TDIST_HOOKSPEC_VERSION ({fits})"
    try:
        got_major, got_minor = (int(part) for part in str(declared).split("."))
    except ValueError:
        return f"TDIST_HOOKSPEC_VERSION {declared!r} is not 'MAJOR.MINOR' ({fits})"
    if got_major != major or got_minor > minor:
        return f"written for hook contract {declared}, but {fits}"
    return None


class Plugins:
    """The loaded plugins and what they registered. Created by :func:`plugins`."""

    def __init__(self, entry_points: Optional[Iterable[Any]] = None) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        self._loaded: list[tuple[PluginRecord, Any]] = []
        eps = [_described(ep) for ep in entry_points] if entry_points is not None else _discover()
        disabled = _disabled_names()
        for ep, dist, version in eps:
            self._load(ep, dist, version, disabled)
        self.backends = BackendRegistry()
        self.rendezvous = RendezvousRegistry()
        for record, plugin in self._loaded:
            self._register_from(record, plugin)
        self._update_work_hooks()

    def _update_work_hooks(self) -> None:
        self._work_hooks = any(
            getattr(self._pm.hook, name).get_hookimpls()
            for name in ("tdist_work_issued", "tdist_work_completed", "tdist_work_failed")
        )
        self._issued = _direct_calls(self._pm.hook.tdist_work_issued, "info")
        self._completed = _direct_calls(self._pm.hook.tdist_work_completed, "info", "duration")
        self._group_hooks = any(
            getattr(self._pm.hook, name).get_hookimpls() for name in ("tdist_group_created", "tdist_group_destroyed")
        )

    def _load(self, ep: Any, dist: str, version: str, disabled: set[str]) -> None:
        record = PluginRecord(ep.name, dist, version)
        self.records.append(record)
        if ep.name in disabled:
            self._pm.set_blocked(ep.name)  # never imported; register() under this name is refused too
            record.error = f"disabled by {DISABLE_ENV}"
            return
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not break the others
            record.error = f"failed to import: {type(exc).__name__}: {exc}"
            return
        problem = _version_error(plugin)
        if problem:
            record.error = problem
            return
        record.error = self._add_to_manager(plugin, ep.name)
        if record.error is None:
            self._loaded.append((record, plugin))

    def _add_to_manager(self, plugin: Any, name: str) -> Optional[str]:
        """Register ``plugin``'s hooks with the plugin manager; why not, or None."""
        try:
            self._pm.register(plugin, name=name)
        except Exception as exc:
            return f"rejected by the plugin manager: {exc}"
        problem = _unknown_hook_error(self._pm)
        if problem:
            self._pm.unregister(plugin)
        return problem

    def _register_from(self, record: PluginRecord, plugin: Any) -> None:
        """Run the plugin's registration hooks; if one fails, undo everything the plugin
        registered (backends, init methods, hooks) and record why."""
        backends, schemes = self.backends._snapshot(), dict(self.rendezvous._handlers)
        for hook_name, registry in (
            ("tdist_register_backends", self.backends),
            ("tdist_register_rendezvous", self.rendezvous),
        ):
            impls = [impl for impl in getattr(self._pm.hook, hook_name).get_hookimpls() if impl.plugin is plugin]
            self.backends.current_plugin = record.distribution or record.name
            try:
                for impl in impls:
                    impl.function(registry=registry)
            except Exception as exc:
                record.error = f"{hook_name} failed: {type(exc).__name__}: {exc}"
                self.backends._restore(backends)
                self.rendezvous._handlers = schemes
                self._pm.unregister(plugin)
                return

    # ------------------------------------------------------------- typed calls
    @property
    def observes_work(self) -> bool:
        """True when some plugin implements a work hook (else the core skips them)."""
        return self._work_hooks

    def _notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call every observer of ``hook_name``; one that raises is logged and skipped, so it
        neither reaches the thread that completed the operation nor silences the others."""
        caller = getattr(self._pm.hook, hook_name)
        impls = caller.get_hookimpls()
        if any(impl.hookwrapper or getattr(impl, "wrapper", False) for impl in impls):  # pluggy must call
            calls: list[tuple[str, Callable[..., Any], dict[str, Any]]] = [("(all, with wrappers)", caller, kwargs)]
        else:  # pluggy's call order; each gets only the arguments it declares (older contracts declare fewer)
            calls = [
                (impl.plugin_name, impl.function, {k: kwargs[k] for k in impl.argnames}) for impl in reversed(impls)
            ]
        for name, call, arguments in calls:
            try:
                call(**arguments)
            except Exception:
                _log.exception("tdist: observer %s of plugin %r raised; ignored", hook_name, name)

    def work_issued(self, info: WorkInfo) -> None:
        if self._issued is None:
            self._notify("tdist_work_issued", info=info)
            return
        for function in self._issued:
            try:
                function(info)
            except Exception:
                _log.exception("tdist: observer tdist_work_issued %r raised; ignored", function)

    def work_completed(self, info: WorkInfo, duration: float) -> None:
        if self._completed is None:
            self._notify("tdist_work_completed", info=info, duration=duration)
            return
        for function in self._completed:
            try:
                function(info, duration)
            except Exception:
                _log.exception("tdist: observer tdist_work_completed %r raised; ignored", function)

    def work_failed(self, info: WorkInfo, error: BaseException, duration: float) -> None:
        self._notify("tdist_work_failed", info=info, error=error, duration=duration)

    def group_created(self, name: str, ranks: list[int], rank: int, backend: str) -> None:
        if self._group_hooks:
            self._notify("tdist_group_created", name=name, ranks=list(ranks), rank=rank, backend=backend)

    def group_destroyed(self, name: str, ranks: list[int], rank: int, backend: str) -> None:
        if self._group_hooks:
            self._notify("tdist_group_destroyed", name=name, ranks=list(ranks), rank=rank, backend=backend)

    def default_backend(self, device: str) -> Optional[str]:
        return self._pm.hook.tdist_default_backend(device=device)

    def register(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin object (for tests and embedding)."""
        if self._pm.is_blocked(name):
            raise DistError(f"plugin {name!r} refused: disabled by {DISABLE_ENV}")
        problem = _version_error(plugin)
        if problem:
            raise DistError(f"plugin {name!r} refused: {problem}")
        problem = self._add_to_manager(plugin, name)
        if problem:
            raise DistError(f"plugin {name!r} refused: {problem}")
        record = PluginRecord(name, name, "")
        self.records.append(record)
        self._register_from(record, plugin)
        self._update_work_hooks()
        if record.error:
            raise DistError(f"plugin {name!r} refused: {record.error}")

    def missing_backend_message(self, name: str) -> str:
        """The error text for a backend that is not installed or not loadable."""
        installed = ", ".join(self.backends.names()) or "none"
        broken = [r for r in self.records if r.error and r.name == name]
        if broken:
            return f"backend {name!r} is installed but could not be loaded: {broken[0].error} (installed: {installed})"
        distribution = name if name.lower().startswith(_TORCH_PREFIX) else _TORCH_PREFIX + name
        return f"backend {name!r} is not installed (installed: {installed}); pip install {distribution}"


_lock = threading.Lock()
_plugins: Optional[Plugins] = None


def plugins() -> Plugins:
    """The process-wide :class:`Plugins`, loading entry points on first call."""
    global _plugins
    if _plugins is None:
        with _lock:
            if _plugins is None:
                _plugins = Plugins()
    return _plugins


def reset_plugins() -> None:
    """Forget loaded plugins so the next :func:`plugins` call loads entry points again."""
    global _plugins
    with _lock:
        _plugins = None
