"""Names shared by the controller and the workers: environment variables, the
module under test, function references."""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Union

__all__ = [
    "DIST_MODULE_ENV",
    "dist_module",
    "dist_module_name",
    "is_tdist",
    "LazyDist",
    "dist",
    "fn_ref",
    "resolve_ref",
    "backend_name",
]

#: Which module the bodies exercise: ``tdist`` (default) or ``torch.distributed``
#: (to prove the test bodies against the reference implementation).
DIST_MODULE_ENV = "TDIST_TESTING_DIST_MODULE"
CONTROLLER_ENV = "TDIST_TESTING_CONTROLLER"
BACKEND_ENV = "TDIST_TESTING_BACKEND"
LAUNCHER_ENV = "TDIST_TESTING_LAUNCHER"
SYS_PATH_ENV = "TDIST_TESTING_SYS_PATH"
WORLD_SIZE_ENV = "TDIST_TESTING_WORLD_SIZE"
TOKEN_ENV = "TDIST_TESTING_TOKEN"


def dist_module_name() -> str:
    """The name of the module under test (``$TDIST_TESTING_DIST_MODULE``, default ``tdist``)."""
    return os.environ.get(DIST_MODULE_ENV, "").strip() or "tdist"


def dist_module() -> Any:
    """Import and return the module under test (``tdist`` or ``torch.distributed``)."""
    return importlib.import_module(dist_module_name())


def is_tdist() -> bool:
    """True when the module under test is tdist (not the torch.distributed reference).

    Bodies use it to gate the checks that go beyond torch.distributed's behaviour
    (error types, messages naming ranks) which tdist promises and torch does not.
    """
    return dist_module_name().split(".")[0] == "tdist"


def backend_name() -> str:
    """Inside a worker: the backend this world was started with."""
    return os.environ.get(BACKEND_ENV, "")


class LazyDist:
    """``dist``: the module under test, imported on first attribute access.

    Lets body modules write ``dist.all_reduce(...)`` as in the tutorial while the
    controller can import them (to collect tests) without importing the backend.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(dist_module(), name)

    def __repr__(self) -> str:
        return f"<module under test: {dist_module_name()}>"


dist = LazyDist()


def fn_ref(fn: Union[Callable[..., Any], str]) -> str:
    """``module:qualname`` of a module-level function (what workers import)."""
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"tdist.testing: {fn!r} is not a module-level function; workers import bodies by name")
    if module == "__main__":
        raise ValueError(
            f"tdist.testing: {qualname} is defined in __main__, which workers cannot import; "
            "put test bodies in an importable module"
        )
    return f"{module}:{qualname}"


def resolve_ref(ref: str) -> Callable[..., Any]:
    """Import ``module:qualname`` and return the object."""
    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
