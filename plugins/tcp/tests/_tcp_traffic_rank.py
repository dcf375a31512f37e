"""One rank of ``test_tcp_store_traffic``: ``init_process_group("tcp")`` (env://) and one
all_reduce with every TCPStore request of the tcp backend counted (its keys start with
``tcp/``), with the bytes of their answers; prints ``TRAFFIC <json>``."""

import datetime
import json

import torch
from tdist._store.tcp_store import TCPStore

requests = 0
answered = 0
_request = TCPStore._request


def counting(self, cmd, args, wait=None):
    global requests, answered
    reply = _request(self, cmd, args, wait)
    if any(b"/tcp/" in a or a.startswith(b"tcp/") for a in args):
        requests += 1
        answered += len(reply[1])
    return reply


TCPStore._request = counting

import tdist  # noqa: E402

tdist.init_process_group("tcp", init_method="env://", timeout=datetime.timedelta(seconds=120))
tdist.all_reduce(torch.ones(4))
rank = tdist.get_rank()
print("TRAFFIC " + json.dumps({"rank": rank, "requests": requests, "bytes": answered}), flush=True)
tdist.destroy_process_group()
