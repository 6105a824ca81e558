"""Lua scripts of the executor leases: which scheduler replica drives which executor.

Apart from ``request_scripts.py`` (the request state machine): a lease names an executor, not a
request, and only ``FleetRegistry`` runs them, for the dispatcher's discovery.
"""

from __future__ import annotations

# Renew each lease we still hold: one call for every executor a replica drives. A lease that
# lapsed (Redis away longer than its TTL, or this replica stalled) and that no replica took since
# is taken again: nobody else drives the executor. One another replica took is not; and one it
# took and let go meanwhile came with a Run stream that superseded this replica's, which ends the
# link anyway. KEYS: leases. ARGV: holder, ttl_ms. Returns 1 (renewed) or 0 per lease, in order.
RENEW_LEASES = """
local renewed = {}
for i, lease in ipairs(KEYS) do
  local holder = redis.call('GET', lease)
  if holder == ARGV[1] then
    renewed[i] = redis.call('PEXPIRE', lease, ARGV[2])
  elseif not holder then
    redis.call('SET', lease, ARGV[1], 'PX', ARGV[2])
    renewed[i] = 1
  else
    renewed[i] = 0
  end
end
return renewed
"""

# Release a lease only if we hold it. KEYS: lease. ARGV: holder.
RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
