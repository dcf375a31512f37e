"""One rank of ``test_store_init_traffic``: ``init_process_group`` (env://) with every TCPStore
request counted, by what it is for; prints ``TRAFFIC <json>``."""

import collections
import datetime
import json
import sys

from tdist._store.tcp_protocol import NAMES
from tdist._store.tcp_store import TCPStore

counts: "collections.Counter[str]" = collections.Counter()
keys: "dict[str, list[str]]" = collections.defaultdict(list)
_request = TCPStore._request


def _part(args) -> str:
    blob = b"|".join(args)
    if b"tdist/incarnation" in blob:
        return "incarnation"
    if b"tdist/init/" in blob:
        return "join"
    if b"/proc/" in blob:
        return "process"
    return "other"


def counting(self, cmd, args, wait=None):
    part = _part(args)
    counts[part] += 1
    if len(keys[part]) < 40:
        keys[part].append(NAMES[cmd] + " " + b"|".join(a for a in args if b"/" in a)[:80].decode("utf-8", "replace"))
    return _request(self, cmd, args, wait)


TCPStore._request = counting

import tdist  # noqa: E402

tdist.init_process_group(sys.argv[1], init_method="env://", timeout=datetime.timedelta(seconds=120))
init = dict(counts)
rank = tdist.get_rank()
tdist.destroy_process_group()
print("TRAFFIC " + json.dumps({"rank": rank, "init": init, "keys": keys}), flush=True)
