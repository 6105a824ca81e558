"""Forgetting tenants gone idle: the fairness counter and the length estimates Redis keeps per
tenant would otherwise grow with every tenant name ever sent (without auth, a client names its
own tenant).

The ENQUEUE script stamps a tenant in ``tenants:seen`` with each request it queues (unless
forgetting is off: the stamps would only grow); a tenant
stamped longer ago than ``request_level.forget_idle_tenants_s``, with nothing queued or running,
loses its counter, its estimates and its stamp, and comes back as a new tenant would: level with
the tenants waiting (its counter was lifted to them on return anyway, unless it had used more
than they had) and with ``max_tokens`` as its length estimate until it has new samples. Every
replica runs it; each call is one script, so replicas racing each other forget each tenant once.
"""

from __future__ import annotations

from typing import cast

import redis.asyncio as aioredis
from redis.typing import EncodableT

from common.clock import now_ms
from common.keys import KeySchema
from scheduler_service.estimator import estimator_fields

# KEYS: seen, waiting, running, counters, estimator. ARGV: stamped at or before (ms), most tenants
# to look at, now_ms, then the estimator's field names less the tenant name. A tenant stamped
# long ago yet still queued or running (one request that long in the system) is stamped now and
# looked at again later, so it does not fill every call. Returns {forgotten, looked at}.
FORGET_IDLE = """
local stale = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
local forgotten = 0
for _, t in ipairs(stale) do
  if redis.call('ZSCORE', KEYS[2], t) or redis.call('HEXISTS', KEYS[3], t) == 1 then
    redis.call('ZADD', KEYS[1], ARGV[3], t)
  else
    local fields = {}
    for i = 4, #ARGV do fields[#fields + 1] = t .. ARGV[i] end
    redis.call('HDEL', KEYS[4], t)
    redis.call('HDEL', KEYS[5], unpack(fields))
    redis.call('ZREM', KEYS[1], t)
    forgotten = forgotten + 1
  end
end
return {forgotten, #stale}
"""


class IdleTenants:
    def __init__(self, redis: aioredis.Redis, keys: KeySchema) -> None:
        self._keys = keys
        self._forget = redis.register_script(FORGET_IDLE)
        self._suffixes = estimator_fields("")

    async def forget(self, idle_s: float, per_call: int = 256) -> int:
        """Forget every tenant idle ``idle_s`` or longer, ``per_call`` at a time (one script each,
        so none holds Redis long); how many were forgotten."""
        keys = [
            self._keys.tenants_seen,
            self._keys.tenants_waiting,
            self._keys.tenant_running,
            self._keys.tenant_counters,
            self._keys.estimator,
        ]
        forgotten = 0
        while True:
            now = now_ms()
            args: list[EncodableT] = [now - int(idle_s * 1000), per_call, now, *self._suffixes]
            done, looked_at = cast(list[int], await self._forget(keys=keys, args=args))
            forgotten += done
            if looked_at < per_call:
                return forgotten
