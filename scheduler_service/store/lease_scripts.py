"""Lua scripts of the executor leases: which scheduler replica drives which executor.

Apart from ``request_scripts.py`` (the request state machine): a lease names an executor, not a
request, and only ``FleetRegistry`` runs them, for the dispatcher's discovery.
"""

from __future__ import annotations

# Renew each lease we still hold: one call for every executor a replica drives. A lease that
# lapsed (Redis away longer than its TTL, or this replica stalled) and that no replica took since
# is taken again while its executor is still registered: nobody else drives it. One another
# replica took is not, nor one whose executor a replica reaped meanwhile (took, re-queued its work,
# forgot and let go); one a replica took to drive and let go came with a Run stream that superseded
# this replica's, which ends the link anyway. KEYS: leases, then the executors' registry. ARGV:
# holder, ttl_ms, then the executor ids, in the leases' order. Returns 1 (renewed) or 0 per lease.
RENEW_LEASES = """
local renewed = {}
local registry = KEYS[#KEYS]
for i = 1, #KEYS - 1 do
  local lease = KEYS[i]
  local holder = redis.call('GET', lease)
  if holder == ARGV[1] then
    renewed[i] = redis.call('PEXPIRE', lease, ARGV[2])
  elseif not holder and redis.call('ZSCORE', registry, ARGV[2 + i]) then
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
