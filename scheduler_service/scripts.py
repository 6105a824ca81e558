"""Lua scripts: every move of a request between states is one script, so a crash between two
commands can neither lose nor duplicate a request. Each script names every key it touches in
KEYS, and those keys share the ``{prefix}`` hash tag, so the scripts also run on Redis Cluster.
"""

from __future__ import annotations

# KEYS: req, queue. ARGV: max_pending, score, id, field, value, ...
ENQUEUE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[1]) then return -2 end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return 1
"""

# QUEUED -> ASSIGNED. KEYS: queue, req, running, tokens. ARGV: id, executor, now_ms, owner.
# The owner names this one assignment (executor and the link driving it): every later write
# must present it, so a stale driver of the same executor is fenced off.
CLAIM = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return false end
redis.call('HSET', KEYS[2], 'state', 'ASSIGNED', 'executor', ARGV[2], 'owner', ARGV[4])
redis.call('HSETNX', KEYS[2], 'assigned_ms', ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
local f = redis.call('HMGET', KEYS[2], 'prompt_ids', 'params', 'score', 'arrival_ms', 'assigned_ms',
  'first_token_ms', 'prompt_len', 'traceparent')
local out = redis.call('LRANGE', KEYS[4], 0, -1)
return {f[1], f[2], f[3], f[4], f[5], f[6] or '', f[7], table.concat(out, ','), f[8] or ''}
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
if st[1] == 'ASSIGNED' then redis.call('HSET', KEYS[1], 'state', 'RUNNING') end
redis.call('HSETNX', KEYS[1], 'first_token_ms', ARGV[3])
return redis.call('RPUSH', KEYS[2], unpack(ARGV, 4))
"""

# Any live state -> FINISHED/CANCELLED/FAILED. KEYS: req, running, tokens, queue.
# ARGV: id, owner ('' = any), state, finish_reason, now_ms, ttl_s, error.
FINISH = """
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
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[6])
return 1
"""

# ASSIGNED/RUNNING -> QUEUED, keeping the tokens. KEYS: req, running, queue.
# ARGV: id, owner ('' = any), now_ms, kind ('preempt' or 'migrate'), max_migrations.
# Returns 1 re-queued, 2 a cancel was pending, 3 past the migration limit (the caller ends
# either), 0 not active, -1 owned by another executor.
REQUEUE = """
local st = redis.call('HMGET', KEYS[1], 'state', 'owner', 'score', 'cancel')
if st[1] ~= 'ASSIGNED' and st[1] ~= 'RUNNING' then redis.call('SREM', KEYS[2], ARGV[1]) return 0 end
if ARGV[2] ~= '' and st[2] ~= ARGV[2] then return -1 end
redis.call('SREM', KEYS[2], ARGV[1])
if st[4] == '1' then return 2 end
if ARGV[4] == 'migrate' then
  if redis.call('HINCRBY', KEYS[1], 'migrations', 1) > tonumber(ARGV[5]) then return 3 end
else
  redis.call('HINCRBY', KEYS[1], 'preemptions', 1)
end
redis.call('HSET', KEYS[1], 'state', 'QUEUED', 'executor', '', 'owner', '', 'requeued_ms', ARGV[3])
redis.call('ZADD', KEYS[3], st[3], ARGV[1])
return 1
"""

# Cancel. KEYS: req, queue, tokens. ARGV: id, now_ms, ttl_s.
# Returns {state, executor, token count, '1' if this call ended it}: QUEUED requests end here;
# running ones get a cancel flag and their executor's replica aborts them.
CANCEL = """
local st = redis.call('HMGET', KEYS[1], 'state', 'executor')
if not st[1] then return {'MISSING', '', 0, '0'} end
local n = redis.call('LLEN', KEYS[3])
if st[1] == 'QUEUED' then
  redis.call('ZREM', KEYS[2], ARGV[1])
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
