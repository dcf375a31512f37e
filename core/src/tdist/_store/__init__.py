"""Key-value stores: the :class:`Store` interface (torch.distributed.Store's API) and its
in-process, file and TCP implementations."""

from .base import QueueEmptyError, Store
from .file_store import FileStore
from .hash_store import HashStore
from .prefix_store import PrefixStore
from .tcp_store import TCPStore, TCPStoreServer
from .torch_adapters import TorchStore, as_torch_store, from_torch_store

__all__ = [
    "Store",
    "QueueEmptyError",
    "HashStore",
    "PrefixStore",
    "FileStore",
    "TCPStore",
    "TCPStoreServer",
    "TorchStore",
    "as_torch_store",
    "from_torch_store",
]
