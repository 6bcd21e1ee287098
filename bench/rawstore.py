"""A prototype, not a product: kvtier's own store behind a raw byte stream instead of gRPC.

It answers ``bench.rawtcp``'s wire protocol from one asyncio event loop (as
``kvtier server`` runs grpc.aio) with kvtier's ``TieredStore`` over a
``RamTier``, keys scoped to the default tenant. Values are received straight
into a buffer that the RAM tier then keeps (``loop.sock_recv_into``) and sent
straight from the stored object (``loop.sock_sendall``): no framing and no
user-space copy on either side. ``kvtier bench tier --backends "...,kvtier RAM
raw stream"`` measures it next to the gRPC data path, to show what a raw-bytes
data port would gain (see docs/benchmarks.md, "Tier data path").

Run: ``python -m bench.rawstore HOST PORT``.
"""

from __future__ import annotations

import asyncio
import socket
import sys

from prometheus_client import CollectorRegistry

from bench.rawtcp import _GET_REPLY, _REQ
from kvtier.cacheserver.metrics import ServerMetrics
from kvtier.cacheserver.namespace import DEFAULT_TENANT, scoped
from kvtier.cacheserver.ram import RamTier
from kvtier.cacheserver.store import StorePolicy, TieredStore


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


async def _serve_connection(sock: socket.socket, store: TieredStore) -> None:
    loop = asyncio.get_running_loop()
    with sock:
        while True:
            try:
                head = await _recv_into(loop, sock, _REQ.size)
            except ConnectionError:
                return
            op, key_len, value_len = _REQ.unpack(head)
            key = scoped(DEFAULT_TENANT, bytes(await _recv_into(loop, sock, key_len)))
            if op == b"P":
                value = await _recv_into(loop, sock, value_len)
                await store.put(key, memoryview(value).toreadonly())  # type: ignore[arg-type]
                await loop.sock_sendall(sock, b"\x01")
            elif op == b"G":
                stored = await store.get(key)
                if stored is None:
                    await loop.sock_sendall(sock, _GET_REPLY.pack(0, 0))
                else:
                    view = memoryview(stored)
                    await loop.sock_sendall(sock, _GET_REPLY.pack(1, view.nbytes))
                    await loop.sock_sendall(sock, view)
            else:
                return


async def serve(host: str, port: int) -> None:
    store = TieredStore([RamTier(8 << 30)], StorePolicy(), ServerMetrics(CollectorRegistry()))
    store.start()
    loop = asyncio.get_running_loop()
    listener = socket.create_server((host, port))
    listener.setblocking(False)
    print("ready", flush=True)
    tasks = set()
    while True:
        sock, _ = await loop.sock_accept(listener)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = asyncio.create_task(_serve_connection(sock, store))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2])))
