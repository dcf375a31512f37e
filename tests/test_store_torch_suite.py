"""torch 2.13's own store tests (``test/distributed/test_store.py``, vendored unchanged in
tests/vendor/torch/torch_test_store.py) run against tdist's stores.

The adapter executes the vendored file with ``torch.distributed`` resolved to tdist (``import
tdist as dist``, the drop-in promise) and torch's internal test helpers resolved to small
equivalents below; every assertion is torch's. The test classes land in this module, where
pytest collects them. Tests that need a torch-only internal are skipped, each with its
reason (EXCLUDED below); everything else must pass.
"""

from __future__ import annotations

import builtins
import functools
import os
import shutil
import sys
import tempfile
import threading
import time
import types
import unittest
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import pytest

import tdist
from tdist._local import free_port

VENDORED = Path(__file__).parent / "vendor" / "torch" / "torch_test_store.py"

#: (class, test) -> why it cannot run on tdist. Inherited tests are skipped where defined.
EXCLUDED: Dict[Tuple[str, str], str] = {
    (
        "FileStoreTest",
        "test_init_pg_and_rpc_with_same_file",
    ): "needs torch.distributed.rpc (TensorPipe RPC), which tdist does not provide",
    (
        "TCPStoreTest",
        "test_init_pg_and_rpc_with_same_socket",
    ): "needs torch.distributed.rpc (TensorPipe RPC), which tdist does not provide",
    (
        "TCPStoreTest",
        "test_repr",
    ): "asserts the repr of torch's C++ socket classes (TCPClient(SocketImpl(fd=..., addr=...)))",
    (
        "PythonStoreTest",
        "test_set_get",
    ): "calls torch's C++ trampoline test dist._test_python_store (a C++ caller of a Python Store)",
    (
        "InitPgWithNonUvStore",
        "test_with_url_param",
    ): "reads torch's internal c10d._get_process_group_store to find which of torch's two servers runs",
    (
        "InitPgWithNonUvStore",
        "test_with_env_var",
    ): "reads torch's internal c10d._get_process_group_store to find which of torch's two servers runs",
    (
        "TestClientProtocol",
        "test_client_connect",
    ): "speaks torch's TCPStore wire protocol (VALIDATE 0x3C85F7CE, PING with the pid); tdist's store "
    "has its own, mutually authenticated, protocol",
}

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ torch's test helpers
class _Rank(threading.local):
    value = None


_THREAD_RANK = _Rank()


def _get_rank(group: Any = None) -> int:
    """tdist.get_rank, except inside a MultiThreadedTestCase thread: that thread's rank."""
    return _THREAD_RANK.value if _THREAD_RANK.value is not None else tdist.get_rank(group)


def _multi_threaded_test_case() -> type:
    """torch's MultiThreadedTestCase (made here, not at module level, where pytest would collect it)."""

    class MultiThreadedTestCase(unittest.TestCase):
        """torch's MultiThreadedTestCase, reduced to what the store tests use: each test method
        runs in ``world_size`` threads at once, ``dist.get_rank()`` being the thread's rank."""

        world_size = 2

        def __init__(self, method_name: str = "runTest") -> None:
            super().__init__(method_name)
            test = getattr(self, method_name, None)
            if test is not None:  # pytest also makes an instance for the default "runTest"
                setattr(self, method_name, functools.partial(self._run_threads, test))

        def _spawn_threads(self) -> None:
            """torch starts its threads here; ours start when the test method runs."""

        def _run_threads(self, test: Callable[[], None]) -> None:
            errors: list = []

            def body(rank: int) -> None:
                _THREAD_RANK.value = rank
                try:
                    test()
                except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread below
                    errors.append(exc)

            threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads), "a test thread did not finish within 30 s"
            if errors:
                raise errors[0]

    return MultiThreadedTestCase


def create_tcp_store(
    addr: str = "localhost",
    world_size: int = 1,
    is_master: bool = True,
    timeout: timedelta = timedelta(minutes=5),
    wait_for_workers: bool = True,
    jit_class: bool = False,
    use_libuv: bool = True,
) -> tdist.TCPStore:
    """torch's helper; the server picks its port (port 0) instead of probing for a free one."""
    return tdist.TCPStore(addr, 0, world_size, is_master, wait_for_workers=wait_for_workers, use_libuv=use_libuv)


def retry_on_connect_failures(func: Any = None, connect_errors: Any = ("Address already in use",)) -> Any:
    """torch's decorator: rerun a test whose RuntimeError names a connect failure (a few times)."""
    if func is None:
        return functools.partial(retry_on_connect_failures, connect_errors=connect_errors)
    errors = (connect_errors,) if isinstance(connect_errors, str) else tuple(connect_errors)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(3):
            try:
                return func(*args, **kwargs)
            except RuntimeError as error:
                if attempt == 2 or not any(e in str(error) for e in errors):
                    raise
                time.sleep(0.2)

    return wrapper


def _skip_if_win32() -> Callable[[Any], Any]:
    return unittest.skipIf(sys.platform == "win32", "not on Windows")


def _modules() -> Dict[str, types.ModuleType]:
    """The modules the vendored file imports, by name."""
    import torch
    import torch.distributed.rpc as torch_rpc

    dist = types.ModuleType("torch.distributed (tdist)")
    dist.__dict__.update({k: getattr(tdist, k) for k in dir(tdist) if not k.startswith("__")})
    dist.get_rank = _get_rank
    dist.rpc = torch_rpc  # only the excluded RPC tests use it
    dist.distributed_c10d = types.ModuleType("torch.distributed.distributed_c10d (not provided by tdist)")
    common_utils = types.ModuleType("torch.testing._internal.common_utils (tdist adapter)")
    common_utils.__dict__.update(
        ACCELERATOR_TYPE=None,
        ADDRESS_IN_USE="Address already in use",
        CONNECT_TIMEOUT="connect() timed out.",
        load_tests=None,
        retry_on_connect_failures=retry_on_connect_failures,
        run_tests=unittest.main,
        TestCase=unittest.TestCase,
        instantiate_parametrized_tests=lambda cls: cls,
        find_free_port=lambda: free_port("localhost"),
    )
    common_distributed = types.ModuleType("torch.testing._internal.common_distributed (tdist adapter)")
    common_distributed.__dict__.update(
        MultiThreadedTestCase=_multi_threaded_test_case(),
        create_tcp_store=create_tcp_store,
        skip_if_win32=_skip_if_win32,
        tp_transports=lambda: None,
    )
    internal = types.ModuleType("torch.testing._internal")
    internal.common_utils, internal.common_distributed = common_utils, common_distributed
    testing = types.ModuleType("torch.testing")
    testing._internal = internal

    class TorchFacade(types.ModuleType):
        """``torch`` for the vendored file: the real one, with ``distributed`` and ``testing`` replaced."""

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    facade = TorchFacade("torch (tdist adapter)")
    facade.distributed, facade.testing = dist, testing
    return {
        "torch": facade,
        "torch.distributed": dist,
        "torch.distributed.distributed_c10d": dist.distributed_c10d,
        "torch.distributed.rpc": torch_rpc,
        "torch.testing": testing,
        "torch.testing._internal": internal,
        "torch.testing._internal.common_utils": common_utils,
        "torch.testing._internal.common_distributed": common_distributed,
    }


def _load(tmp: str) -> types.ModuleType:
    """Execute the vendored file with the modules above; its temporary files go to ``tmp``."""
    modules = _modules()

    def import_(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and name in modules:
            return modules[name] if fromlist else modules["torch"]
        return builtins.__import__(name, globals, locals, fromlist, level)

    module = types.ModuleType("torch_test_store")
    module.__file__ = str(VENDORED)
    module.__dict__["__builtins__"] = dict(builtins.__dict__, __import__=import_)
    code = compile(VENDORED.read_text(), str(VENDORED), "exec")
    saved = tempfile.tempdir
    tempfile.tempdir = tmp  # the class bodies create a FileStore on a temporary file at import
    try:
        exec(code, module.__dict__)
    finally:
        tempfile.tempdir = saved
    for (cls_name, test), why in EXCLUDED.items():
        cls = module.__dict__[cls_name]
        setattr(cls, test, unittest.skip(f"torch-only: {why}")(getattr(cls, test)))
    return module


_TMP = tempfile.mkdtemp(prefix="tdist-torch-store-tests-")
_VENDORED_MODULE = _load(_TMP)
for _name, _obj in vars(_VENDORED_MODULE).items():
    if isinstance(_obj, type) and issubclass(_obj, unittest.TestCase) and _obj.__module__ == "torch_test_store":
        globals()[_name] = _obj
del _name, _obj


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Each test: temporary files under tmp_path, no store token, and the environment restored
    (torch's tests set MASTER_ADDR, RANK, ... and leave them)."""
    saved = dict(os.environ)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    os.environ.pop(tdist._store.tcp_store.TOKEN_ENV, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module", autouse=True)
def _release_class_stores() -> Any:
    """Close the stores the vendored class bodies opened at import, and their temporary files."""
    yield
    waiting = _VENDORED_MODULE.TestMultiThreadedWait
    for name in ("file_store", "hash_store", "tcp_store", "tcp_store_uv"):
        getattr(waiting, name).close()
    shutil.rmtree(_TMP, ignore_errors=True)
