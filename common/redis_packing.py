"""Commands packed by hiredis' C packer on redis-py's asyncio connections.

redis-py's asyncio connection packs every command in Python, argument by argument. For Baton's
step scripts (a few hundred arguments per call: keys, token ids, stream fields) that was the
largest single cost in the scheduler's report handling. hiredis (already the reply parser)
produces byte-identical commands about six times faster (hiredis comes with ``redis[hiredis]``).
Anything hiredis cannot pack falls back to redis-py's own packer, so its errors stay redis-py's.
"""

from __future__ import annotations

from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis.typing import EncodableT


class _CPacking:
    def pack_command(self, *args: EncodableT) -> list[bytes]:
        # As redis-py does: a command name given with spaces ("CLIENT ID") is several arguments.
        if isinstance(args[0], str):
            args = (*args[0].encode().split(), *args[1:])
        elif isinstance(args[0], bytes) and b" " in args[0]:
            args = (*args[0].split(), *args[1:])
        try:
            return [hiredis.pack_command(cast(Any, args))]
        except TypeError:
            return super().pack_command(*args)  # type: ignore[misc]


class HiredisConnection(_CPacking, aioredis.Connection):
    pass


class HiredisSSLConnection(_CPacking, aioredis.SSLConnection):
    pass


class HiredisUnixConnection(_CPacking, aioredis.UnixDomainSocketConnection):
    pass


_FASTER: dict[type[Any], type[Any]] = {
    aioredis.Connection: HiredisConnection,
    aioredis.SSLConnection: HiredisSSLConnection,
    aioredis.UnixDomainSocketConnection: HiredisUnixConnection,
}


def use_c_packing(pool: aioredis.ConnectionPool) -> aioredis.ConnectionPool:
    """``pool``, making its new connections pack commands with hiredis."""
    pool.connection_class = _FASTER.get(pool.connection_class, pool.connection_class)
    return pool
