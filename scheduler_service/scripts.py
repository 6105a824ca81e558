"""Lua scripts: every move of a request between states is one script, so a crash between two
commands can neither lose nor duplicate a request. Each script names every key it touches in
KEYS, and those keys share the ``{prefix}`` hash tag, so the scripts also run on Redis Cluster.
"""

from __future__ import annotations

# Shared Lua helpers. Tenant keys are built from a prefix inside the scripts: they carry the
# same hash tag as every other key a script touches, so they live in its slot on a cluster too.
# A new arrival joins its tenant's queue to the waiting set at max(its counter, the smallest
# waiting counter, or the virtual clock when none waits): an idle tenant comes back level with the
# others, never with banked credit (virtual token counters, see fair_share.py). A re-queued
# request rejoins at its tenant's own counter.
_TENANT_LIB = """
local function join_tenant(tq, waiting, counters, vclock, tenant, score, id, lift)
  if redis.call('ZCARD', tq) == 0 then
    local c = tonumber(redis.call('HGET', counters, tenant)) or 0
    local lo = redis.call('ZRANGE', waiting, 0, 0, 'WITHSCORES')
    local floor = tonumber(lo[2]) or tonumber(redis.call('GET', vclock)) or 0
    if lift and floor > c then
      c = floor
      redis.call('HSET', counters, tenant, c)
    end
    redis.call('ZADD', waiting, c, tenant)
  end
  redis.call('ZADD', tq, score, id)
end
local function leave_tenant(tq, waiting, tenant, id)
  redis.call('ZREM', tq, id)
  if redis.call('ZCARD', tq) == 0 then redis.call('ZREM', waiting, tenant) end
end
"""

# KEYS: req, pending, waiting, counters, vclock. ARGV: shed_limit, score, id, tenant_queue_prefix,
# tenant, field, value, ... The whole queue is refused at the request's shed limit (lower for
# lower priorities), so room stays for important work and nothing accepted is ever dropped.
ENQUEUE = _TENANT_LIB + """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[1]) then return -2 end
redis.call('HSET', KEYS[1], 'tenant', ARGV[5], unpack(ARGV, 6))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
join_tenant(ARGV[4] .. ARGV[5], KEYS[3], KEYS[4], KEYS[5], ARGV[5], ARGV[2], ARGV[3], true)
return 1
"""

# QUEUED -> ASSIGNED. KEYS: pending, req, running, tokens, waiting, counters, vclock, tenant_running.
# ARGV: id, executor, now_ms, owner, tenant_queue_prefix.
# The owner names this one assignment (executor and the link driving it): every later write
# must present it, so a stale driver of the same executor is fenced off. The tenant's counter is
# charged the request's expected cost once (a re-queued request is not charged again).
CLAIM = _TENANT_LIB + """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return false end
local t = redis.call('HGET', KEYS[2], 'tenant') or 'default'
leave_tenant(ARGV[5] .. t, KEYS[5], t, ARGV[1])
local cost = tonumber(redis.call('HGET', KEYS[2], 'fair_cost')) or 0
local c = tonumber(redis.call('HGET', KEYS[6], t)) or 0
if cost > 0 then
  c = tonumber(redis.call('HINCRBYFLOAT', KEYS[6], t, cost))
  redis.call('HSET', KEYS[2], 'fair_cost', '0')
  if redis.call('ZSCORE', KEYS[5], t) then redis.call('ZADD', KEYS[5], c, t) end
end
if c - cost > (tonumber(redis.call('GET', KEYS[7])) or 0) then redis.call('SET', KEYS[7], c - cost) end
redis.call('HINCRBY', KEYS[8], t, 1)
redis.call('HSET', KEYS[2], 'state', 'ASSIGNED', 'executor', ARGV[2], 'owner', ARGV[4])
redis.call('HSETNX', KEYS[2], 'assigned_ms', ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
local f = redis.call('HMGET', KEYS[2], 'prompt_ids', 'params', 'score', 'arrival_ms', 'assigned_ms',
  'first_token_ms', 'prompt_len', 'traceparent', 'priority', 'preemptions', 'deadline_ms', 'est_out')
local out = redis.call('LRANGE', KEYS[4], 0, -1)
return {f[1], f[2], f[3], f[4], f[5], f[6] or '', f[7], table.concat(out, ','), f[8] or '', t,
  f[9] or '0', f[10] or '0', f[11] or '0', f[12] or '0'}
"""

# Record tokens; ASSIGNED -> RUNNING on the first. KEYS: req, tokens. ARGV: owner, index, now_ms, id...
# Returns the new token count (also for an exact replay of the last write), -1 if the owner no longer
# holds the request, -2 if the index is not the next output position (a gap or a stale computation).
APPEND_TOKENS = """
local st = redis.call('HMGET', KEYS[1], 'state', 'owner')
if st[2] ~= ARGV[1] then return -1 end
local have = redis.call('LLEN', KEYS[2])
local index = tonumber(ARGV[2])
if have ~= index then
  -- A retried write whose first attempt landed (the reply was lost with the connection) is a
  -- success, so its event still gets published; anything else is a gap or a stale computation.
  local n = #ARGV - 3
  if have == index + n then
    local tail = redis.call('LRANGE', KEYS[2], index, have - 1)
    for i = 1, n do
      if tail[i] ~= ARGV[3 + i] then return -2 end
    end
    return have
  end
  return -2
end
if st[1] ~= 'ASSIGNED' and st[1] ~= 'RUNNING' then return -1 end
if st[1] == 'ASSIGNED' then
  -- First write since (re)assignment; only then can first_token_ms be missing (HSETNX keeps a
  -- resumed request's original), so steady decoding pays no extra command for it.
  redis.call('HSET', KEYS[1], 'state', 'RUNNING')
  redis.call('HSETNX', KEYS[1], 'first_token_ms', ARGV[3])
end
return redis.call('RPUSH', KEYS[2], unpack(ARGV, 4))
"""

# Any live state -> FINISHED/CANCELLED/FAILED. KEYS: req, running, tokens, pending, waiting,
# counters, tenant_running, estimator. ARGV: id, owner ('' = any), state, finish_reason, now_ms,
# ttl_s, error, tenant_queue_prefix, estimator_alpha.
# It also settles fairness (the tenant's counter is corrected from the expected output to the
# real one) and teaches the length estimator the real output length of a completed request.
FINISH = _TENANT_LIB + """
local st = redis.call('HMGET', KEYS[1], 'state', 'owner', 'executor')
if not st[1] then return -1 end
if st[1] == 'FINISHED' or st[1] == 'CANCELLED' or st[1] == 'FAILED' then
  -- 2: this very finish already landed (a retry); 0: something else ended it first.
  if st[1] == ARGV[3] and redis.call('HGET', KEYS[1], 'finish_reason') == ARGV[4] then return 2 end
  return 0
end
if ARGV[2] ~= '' and st[2] ~= ARGV[2] then return -1 end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'finish_reason', ARGV[4], 'finished_ms', ARGV[5], 'error', ARGV[7])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[1])
local f = redis.call('HMGET', KEYS[1], 'tenant', 'est_out', 'fair_out_w', 'est_key', 'fair_cost')
local t = f[1] or 'default'
if st[1] == 'QUEUED' then
  leave_tenant(ARGV[8] .. t, KEYS[5], t, ARGV[1])
elseif st[1] == 'ASSIGNED' or st[1] == 'RUNNING' then
  redis.call('HINCRBY', KEYS[7], t, -1)
end
local n = redis.call('LLEN', KEYS[3])
local est = tonumber(f[2])
if est and tonumber(f[5]) == 0 and tonumber(f[3]) then
  local c = redis.call('HINCRBYFLOAT', KEYS[6], t, (n - est) * tonumber(f[3]))
  if redis.call('ZSCORE', KEYS[5], t) then redis.call('ZADD', KEYS[5], c, t) end
end
if est and f[4] and (ARGV[4] == 'STOP' or ARGV[4] == 'LENGTH') then
  local k = f[4]
  local e = redis.call('HMGET', KEYS[8], k .. ':n', k .. ':mean', k .. ':err')
  local a = tonumber(ARGV[9])
  local err = math.abs(n - est)
  if e[1] then
    local mean = tonumber(e[2]) + a * (n - tonumber(e[2]))
    err = tonumber(e[3]) + a * (err - tonumber(e[3]))
    redis.call('HSET', KEYS[8], k .. ':mean', mean, k .. ':err', err)
  else
    redis.call('HSET', KEYS[8], k .. ':mean', n, k .. ':err', err)
  end
  redis.call('HINCRBY', KEYS[8], k .. ':n', 1)
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[6])
return 1
"""

# ASSIGNED/RUNNING -> QUEUED, keeping the tokens. KEYS: req, running, pending, waiting, counters,
# vclock, tenant_running. ARGV: id, owner ('' = any), now_ms, kind ('preempt' or 'migrate'),
# max_migrations, tenant_queue_prefix.
# Returns 1 re-queued, 2 a cancel was pending, 3 past the migration limit (the caller ends
# either), 0 not active, -1 owned by another executor.
REQUEUE = _TENANT_LIB + """
local st = redis.call('HMGET', KEYS[1], 'state', 'owner', 'score', 'cancel', 'tenant')
if st[1] ~= 'ASSIGNED' and st[1] ~= 'RUNNING' then redis.call('SREM', KEYS[2], ARGV[1]) return 0 end
if ARGV[2] ~= '' and st[2] ~= ARGV[2] then return -1 end
redis.call('SREM', KEYS[2], ARGV[1])
if st[4] == '1' then return 2 end
if ARGV[4] == 'migrate' then
  if redis.call('HINCRBY', KEYS[1], 'migrations', 1) > tonumber(ARGV[5]) then return 3 end
else
  redis.call('HINCRBY', KEYS[1], 'preemptions', 1)
end
local t = st[5] or 'default'
redis.call('HINCRBY', KEYS[7], t, -1)
redis.call('HSET', KEYS[1], 'state', 'QUEUED', 'executor', '', 'owner', '', 'requeued_ms', ARGV[3])
redis.call('ZADD', KEYS[3], st[3], ARGV[1])
-- No lift: a preempted or migrated request is not a new arrival, and its tenant keeps its credit.
join_tenant(ARGV[6] .. t, KEYS[4], KEYS[5], KEYS[6], t, st[3], ARGV[1], false)
return 1
"""

# Cancel. KEYS: req, pending, tokens, waiting. ARGV: id, now_ms, ttl_s, tenant_queue_prefix.
# Returns {state, executor, token count, '1' if this call ended it}: QUEUED requests end here;
# running ones get a cancel flag and their executor's replica aborts them.
CANCEL = _TENANT_LIB + """
local st = redis.call('HMGET', KEYS[1], 'state', 'executor', 'tenant')
if not st[1] then return {'MISSING', '', 0, '0'} end
local n = redis.call('LLEN', KEYS[3])
if st[1] == 'QUEUED' then
  redis.call('ZREM', KEYS[2], ARGV[1])
  leave_tenant(ARGV[4] .. (st[3] or 'default'), KEYS[4], st[3] or 'default', ARGV[1])
  redis.call('HSET', KEYS[1], 'state', 'CANCELLED', 'finish_reason', 'CANCELLED', 'finished_ms', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
  return {'CANCELLED', '', n, '1'}
end
if st[1] == 'ASSIGNED' or st[1] == 'RUNNING' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  return {st[1], st[2], n, '0'}
end
return {st[1], '', n, '0'}
"""

# Renew a lease only if we still hold it. KEYS: lease. ARGV: holder, ttl_ms.
RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# Release a lease only if we hold it. KEYS: lease. ARGV: holder.
RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
