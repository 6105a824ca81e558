"""Lua scripts of the request records (run by ``RequestRecords`` and ``StepPublisher``): every move
of a request between states is one script, so a crash between two commands can neither lose nor
duplicate a request. Each script names every key it touches in KEYS, and those keys share the
``{prefix}`` hash tag, so the scripts also run on Redis Cluster.
"""

from __future__ import annotations

# Shared Lua helpers. Tenant keys are built from a prefix inside the scripts: they carry the
# same hash tag as every other key a script touches, so they live in its slot on a cluster too.
# A new arrival joins its tenant's queue to the waiting set at max(its counter, the smallest
# waiting counter, or the virtual clock when none waits): an idle tenant comes back level with the
# others, never with banked credit (virtual token counters, see fair_share.py). So does a
# re-queued request (preempted, migrated): its tenant's counter stood still while it ran.
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
local function stop_running(running, tenant)
  -- A tenant with nothing running leaves the hash: it would otherwise keep every tenant ever seen.
  if redis.call('HINCRBY', running, tenant, -1) <= 0 then redis.call('HDEL', running, tenant) end
end
local function leave_tenant(tq, waiting, tenant, id)
  redis.call('ZREM', tq, id)
  if redis.call('ZCARD', tq) == 0 then redis.call('ZREM', waiting, tenant) end
end
"""

# A request whose record or token list holds another type than the schema says (a hand edit, a
# bug, a half-restored backup) cannot be moved by these scripts: a Redis command on it would fail
# the whole script, and with it every other request the call covers (a step's, a round's). The
# scripts report such a request as MALFORMED (-9) and leave it alone; QUARANTINE then ends it.
_GUARD_LIB = """
local function malformed(req, toks)
  local r = redis.call('TYPE', req).ok
  local t = redis.call('TYPE', toks).ok
  return (r ~= 'hash' and r ~= 'none') or (t ~= 'list' and t ~= 'none')
end
"""
MALFORMED = -9
CANCEL_PENDING = 3  # RECORD_STEP: tokens accepted, and a cancel waits for the executor to abort it

# Queue one request, or all the samples of one (all or none). KEYS: pending, waiting, counters,
# vclock, seen, then req_i per request. ARGV: shed_limit, tenant_queue_prefix, tenant, now_ms
# (the tenant's stamp in seen; '' where idle tenants are never forgotten, so none is kept),
# submission (a nonce the first record keeps), then per request: id, score, m, then m field/value
# strings. Refused (-1) when any of the records exists, and (-2) when the requests would take the
# queue past the shed limit (lower for lower priorities), so room stays for important work and
# nothing accepted is ever dropped. The same call run twice (its reply lost with a dropped
# connection, and the client library's retry) finds its own submission and answers 1 again.
ENQUEUE = (
    _TENANT_LIB
    + """
local count = #KEYS - 5
if redis.call('EXISTS', KEYS[6]) == 1 then
  local mine = redis.pcall('HGET', KEYS[6], 'submission')
  if type(mine) == 'string' and mine == ARGV[5] then return 1 end
  return -1
end
for i = 2, count do
  if redis.call('EXISTS', KEYS[5 + i]) == 1 then return -1 end
end
if redis.call('ZCARD', KEYS[1]) + count > tonumber(ARGV[1]) then return -2 end
local a = 6
for i = 1, count do
  local id, score, m = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  redis.call('HSET', KEYS[5 + i], 'tenant', ARGV[3], unpack(ARGV, a + 3, a + 2 + m))
  redis.call('ZADD', KEYS[1], score, id)
  join_tenant(ARGV[2] .. ARGV[3], KEYS[2], KEYS[3], KEYS[4], ARGV[3], score, id, true)
  a = a + 3 + m
end
if ARGV[4] ~= '' then redis.call('ZADD', KEYS[5], ARGV[4], ARGV[3]) end
return 1
"""
)

# QUEUED -> ASSIGNED. KEYS: pending, req, running, tokens, waiting, counters, vclock, tenant_running.
# ARGV: id, executor, now_ms, owner, tenant_queue_prefix, running caps (JSON: tenant -> cap).
# The owner names this one assignment (executor and the link driving it): every later write
# must present it, so a stale driver of the same executor is fenced off. The tenant's counter is
# charged the request's expected cost once (a re-queued request is not charged again). A tenant
# at its cap is refused here too: replicas that read its count before another's claim landed
# would each take it past the cap.
# Returns the request's fields, false if it is no longer queued (or its tenant is at its cap: it
# stays queued), or MALFORMED.
CLAIM = (
    _TENANT_LIB
    + _GUARD_LIB
    + """
if malformed(KEYS[2], KEYS[4]) then return -9 end
local t = redis.call('HGET', KEYS[2], 'tenant') or 'default'
local cap = cjson.decode(ARGV[6])[t]
if cap and (tonumber(redis.call('HGET', KEYS[8], t)) or 0) >= cap then return false end
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return false end
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
  'first_token_ms', 'prompt_len', 'traceparent', 'priority', 'preemptions', 'deadline_ms', 'est_out',
  'cached_tokens', 'prefix_root')
local out = redis.call('LRANGE', KEYS[4], 0, -1)
return {f[1], f[2], f[3], f[4], f[5], f[6] or '', f[7], table.concat(out, ','), f[8] or '', t,
  f[9] or '0', f[10] or '0', f[11] or '0', f[12] or '0', f[13] or '', f[14] or ''}
"""
)

# Record tokens; ASSIGNED -> RUNNING on the first. append_tokens(req, tokens, owner, index, now_ms,
# argv, first, last, cached) pushes argv[first..last]; ``cached`` (nil or '' when unknown) is the
# prompt tokens the admission found in its executor's prefix cache, kept from the request's first
# token on. Returns the new token count (also for an exact replay
# of the last write), -1 if the owner no longer holds the request, -2 if the index is not the next
# output position (a gap or a stale computation); and, after an accepted write, whether a cancel is
# pending (CANCEL flagged the request while it ran: its executor still has to abort it).
_APPEND_LIB = """
local function append_tokens(req, toks, owner, index, now, argv, first, last, cached)
  local st = redis.call('HMGET', req, 'state', 'owner', 'cancel')
  if st[2] ~= owner then return -1 end
  local have = redis.call('LLEN', toks)
  if have ~= index then
    -- A retried write whose first attempt landed (the reply was lost with the connection) is a
    -- success, so its event still gets published; anything else is a gap or a stale computation.
    local n = last - first + 1
    if have == index + n then
      local tail = redis.call('LRANGE', toks, index, have - 1)
      for i = 1, n do
        if tail[i] ~= argv[first + i - 1] then return -2 end
      end
      return have, st[3] == '1'
    end
    return -2
  end
  if st[1] ~= 'ASSIGNED' and st[1] ~= 'RUNNING' then return -1 end
  if st[1] == 'ASSIGNED' then
    -- First write since (re)assignment; only then can first_token_ms be missing (HSETNX keeps a
    -- resumed request's original), so steady decoding pays no extra command for it.
    redis.call('HSET', req, 'state', 'RUNNING')
    redis.call('HSETNX', req, 'first_token_ms', now)
    if cached and cached ~= '' then redis.call('HSETNX', req, 'cached_tokens', cached) end
  end
  return redis.call('RPUSH', toks, unpack(argv, first, last)), st[3] == '1'
end
"""

# Any live state -> FINISHED/CANCELLED/FAILED. finish(k, id, owner ('' = any), state, finish_reason,
# now_ms, ttl_s, error, tenant_queue_prefix, estimator_alpha), where k holds the keys req, running,
# tokens, pending, waiting, counters, tenant_running, estimator.
# It also settles fairness (the tenant's counter is corrected from the expected output to the
# real one) and teaches the length estimator the real output length of a completed request.
# Returns 1 ended here, 2 this very finish already landed (a retry), 0 something else ended it
# first, -1 no such request or another owner holds it.
_FINISH_LIB = """
local function finish(k, id, owner, state, reason, now, ttl, err_msg, prefix, alpha)
  local st = redis.call('HMGET', k[1], 'state', 'owner', 'executor')
  if not st[1] then return -1 end
  if st[1] == 'FINISHED' or st[1] == 'CANCELLED' or st[1] == 'FAILED' then
    if st[1] == state and redis.call('HGET', k[1], 'finish_reason') == reason then return 2 end
    return 0
  end
  if owner ~= '' and st[2] ~= owner then return -1 end
  redis.call('HSET', k[1], 'state', state, 'finish_reason', reason, 'finished_ms', now, 'error', err_msg)
  redis.call('ZREM', k[4], id)
  redis.call('SREM', k[2], id)
  local f = redis.call('HMGET', k[1], 'tenant', 'est_out', 'fair_out_w', 'est_key', 'fair_cost')
  local t = f[1] or 'default'
  if st[1] == 'QUEUED' then
    leave_tenant(prefix .. t, k[5], t, id)
  elseif st[1] == 'ASSIGNED' or st[1] == 'RUNNING' then
    stop_running(k[7], t)
  end
  local n = redis.call('LLEN', k[3])
  local est = tonumber(f[2])
  if est and tonumber(f[5]) == 0 and tonumber(f[3]) then
    local c = redis.call('HINCRBYFLOAT', k[6], t, (n - est) * tonumber(f[3]))
    if redis.call('ZSCORE', k[5], t) then redis.call('ZADD', k[5], c, t) end
  end
  if est and f[4] and (reason == 'STOP' or reason == 'LENGTH') then
    local ek = f[4]
    local e = redis.call('HMGET', k[8], ek .. ':n', ek .. ':mean', ek .. ':err')
    local a = tonumber(alpha)
    local err = math.abs(n - est)
    if e[1] then
      local mean = tonumber(e[2]) + a * (n - tonumber(e[2]))
      err = tonumber(e[3]) + a * (err - tonumber(e[3]))
      redis.call('HSET', k[8], ek .. ':mean', mean, ek .. ':err', err)
    else
      redis.call('HSET', k[8], ek .. ':mean', n, ek .. ':err', err)
    end
    redis.call('HINCRBY', k[8], ek .. ':n', 1)
  end
  redis.call('EXPIRE', k[1], ttl)
  redis.call('EXPIRE', k[3], ttl)
  return 1
end
"""

# KEYS: req, tokens. ARGV: owner, index, now_ms, id... See append_tokens; MALFORMED for a
# malformed request.
APPEND_TOKENS = (
    _GUARD_LIB
    + _APPEND_LIB
    + """
if malformed(KEYS[1], KEYS[2]) then return -9 end
return append_tokens(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV, 4, #ARGV)
"""
)

# KEYS: req, running, tokens, pending, waiting, counters, tenant_running, estimator. ARGV: id,
# owner ('' = any), state, finish_reason, now_ms, ttl_s, error, tenant_queue_prefix,
# estimator_alpha, the state it must be in ('' = any active one; 0 otherwise). See finish;
# MALFORMED for a malformed request.
FINISH = (
    _TENANT_LIB
    + _GUARD_LIB
    + _FINISH_LIB
    + """
if malformed(KEYS[1], KEYS[3]) then return -9 end
if ARGV[10] ~= '' and redis.call('HGET', KEYS[1], 'state') ~= ARGV[10] then return 0 end
return finish(KEYS, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9])
"""
)

# One executor step for all its requests in one call: APPEND_TOKENS then FINISH for each, in
# order. A finish runs only where its tokens were accepted: a record behind the executor (a write
# lost with a Redis that restarted from an older AOF, or failed over) must not end with a hole in
# its output and no final event. The caller re-queues such a request from what Redis holds. A
# completing finish that brings no tokens is held to the same rule: its index must be the count.
# KEYS: running, pending, waiting, counters, tenant_running, estimator, then req_i, tokens_i (and
# stream_i when publishing) per request. ARGV: append_owner, finish_owner ('' = any), now_ms,
# ttl_s, tenant_queue_prefix, estimator_alpha, publish ('1': XADD here), then per request: id,
# index, n, n token ids, state ('' = not finishing), finish_reason, error, cached prompt tokens
# ('' unless the admission's first tokens; see append_tokens), and when publishing m then m stream
# field/value strings. Returns {append_i, finish_i, entry_i, ...}: each result as
# its own script's (0 where a request had no tokens or did not finish; a finish skipped because
# its step was refused repeats that refusal), and the stream entry id
# of an accepted event when publishing ('' otherwise); a request whose tokens were accepted, that
# does not finish and that a cancel is pending for gets CANCEL_PENDING as its finish result (the
# caller aborts it on its executor: the abort a cancel sends can miss a request that was being
# claimed or admitted just then). A malformed request (its stream too, when
# publishing) gets MALFORMED for both results and is not touched; the others are recorded as usual.
# Publishing in the script saves the second round trip, but only a single Redis can do it: on a
# cluster the streams live in other slots (outside the hash tag) and the caller XADDs afterwards.
RECORD_STEP = (
    _TENANT_LIB
    + _GUARD_LIB
    + _APPEND_LIB
    + _FINISH_LIB
    + """
local out = {}
local a = 8
local publish = ARGV[7] == '1'
local stride = publish and 3 or 2
local k = {'', KEYS[1], '', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]}
for w = 1, (#KEYS - 6) / stride do
  local base = 6 + stride * (w - 1)
  local req, toks = KEYS[base + 1], KEYS[base + 2]
  local id, index, n = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local bad = malformed(req, toks)
  if publish and not bad then
    local s = redis.call('TYPE', KEYS[base + 3]).ok
    bad = s ~= 'stream' and s ~= 'none'
  end
  local appended, cancelling = 0, false
  local state, reason = ARGV[a + 3 + n], ARGV[a + 4 + n]
  local final = state ~= ''
  if bad then
    appended = -9
  elseif n > 0 then
    local cached = ARGV[a + 6 + n]
    appended, cancelling = append_tokens(req, toks, ARGV[1], index, ARGV[3], ARGV, a + 3, a + 2 + n, cached)
  elseif final and (reason == 'STOP' or reason == 'LENGTH') and redis.call('LLEN', toks) ~= index then
    appended = -2
  end
  a = a + 3 + n
  local finished = 0
  if bad then
    finished = -9
  elseif appended < 0 then
    finished = appended
  elseif final then
    k[1], k[3] = req, toks
    finished = finish(k, id, ARGV[2], ARGV[a], ARGV[a + 1], ARGV[3], ARGV[4], ARGV[a + 2], ARGV[5], ARGV[6])
  elseif cancelling then
    finished = 3
  end
  a = a + 4
  local entry = ''
  if publish then
    local m = tonumber(ARGV[a])
    local ok = (n == 0 and appended == 0 or appended > 0) and (not final or finished == 1 or finished == 2)
    if ok then
      entry = redis.call('XADD', KEYS[base + 3], '*', unpack(ARGV, a + 1, a + m))
      if final then redis.call('EXPIRE', KEYS[base + 3], ARGV[4]) end
    end
    a = a + 1 + m
  end
  out[#out + 1] = appended
  out[#out + 1] = finished
  out[#out + 1] = entry
end
return out
"""
)

# ASSIGNED/RUNNING -> QUEUED, keeping the tokens. KEYS: req, running, pending, waiting, counters,
# vclock, tenant_running, tokens, estimator. ARGV: id, owner ('' = any), now_ms, kind ('preempt',
# 'migrate', 'handover' for one a planned stop moves, 'unclaim' for a claim that no executor was ever
# told of, or 'orphan' for a request its driver had done with when Redis lost its end; the last three
# count as neither), max_migrations,
# tenant_queue_prefix, executor, ttl_s, estimator_alpha, error (for one past the migration limit).
# A request recorded on another executor than the one whose running set named it (re-queued and
# claimed elsewhere since) is not touched there: the stale entry goes. A pending cancel ends the
# request CANCELLED, and one past the migration limit FAILED with the error, here, in the same
# step, so no crash between two calls can leave it in no queue and no running set.
# Returns 1 re-queued, 2 ended as cancelled, 3 ended past the migration limit (the caller
# publishes the final event of either), 0 not active there, -1 owned by another link, MALFORMED.
REQUEUE = (
    _TENANT_LIB
    + _GUARD_LIB
    + _FINISH_LIB
    + """
if malformed(KEYS[1], KEYS[8]) then return -9 end
local st = redis.call('HMGET', KEYS[1], 'state', 'owner', 'score', 'cancel', 'tenant', 'executor')
if st[1] ~= 'ASSIGNED' and st[1] ~= 'RUNNING' or st[6] ~= ARGV[7] then
  redis.call('SREM', KEYS[2], ARGV[1])
  return 0
end
if ARGV[2] ~= '' and st[2] ~= ARGV[2] then return -1 end
redis.call('SREM', KEYS[2], ARGV[1])
local k = {KEYS[1], KEYS[2], KEYS[8], KEYS[3], KEYS[4], KEYS[5], KEYS[7], KEYS[9]}
if st[4] == '1' then
  finish(k, ARGV[1], '', 'CANCELLED', 'CANCELLED', ARGV[3], ARGV[8], '', ARGV[6], ARGV[9])
  return 2
end
if ARGV[4] == 'migrate' then
  if redis.call('HINCRBY', KEYS[1], 'migrations', 1) > tonumber(ARGV[5]) then
    finish(k, ARGV[1], '', 'FAILED', 'ERROR', ARGV[3], ARGV[8], ARGV[10], ARGV[6], ARGV[9])
    return 3
  end
elseif ARGV[4] == 'preempt' then
  redis.call('HINCRBY', KEYS[1], 'preemptions', 1)
end
local t = st[5] or 'default'
stop_running(KEYS[7], t)
redis.call('HSET', KEYS[1], 'state', 'QUEUED', 'executor', '', 'owner', '', 'requeued_ms', ARGV[3])
redis.call('ZADD', KEYS[3], st[3], ARGV[1])
-- Lifted as an arrival is: a tenant with nothing waiting comes back level with those waiting, or
-- its counter, left behind while its request ran and others were served, would be banked credit.
join_tenant(ARGV[6] .. t, KEYS[4], KEYS[5], KEYS[6], t, st[3], ARGV[1], true)
return 1
"""
)

# Cancel. KEYS: req, pending, tokens, waiting, counters. ARGV: id, now_ms, ttl_s,
# tenant_queue_prefix. Returns {state, executor, token count, '1' if this call ended it}: QUEUED
# requests end here (one that ran before, and so was charged its expected output, has its tenant's
# charge corrected to what it produced, as a finish corrects it); running ones get a cancel flag
# and their executor's replica aborts them; {'MALFORMED', ...} for a malformed request.
CANCEL = (
    _TENANT_LIB
    + _GUARD_LIB
    + """
if malformed(KEYS[1], KEYS[3]) then return {'MALFORMED', '', 0, '0'} end
local st = redis.call('HMGET', KEYS[1], 'state', 'executor', 'tenant', 'est_out', 'fair_out_w', 'fair_cost')
if not st[1] then return {'MISSING', '', 0, '0'} end
local n = redis.call('LLEN', KEYS[3])
if st[1] == 'QUEUED' then
  local t = st[3] or 'default'
  redis.call('ZREM', KEYS[2], ARGV[1])
  leave_tenant(ARGV[4] .. t, KEYS[4], t, ARGV[1])
  local est = tonumber(st[4])
  if est and tonumber(st[6]) == 0 and tonumber(st[5]) then
    local c = redis.call('HINCRBYFLOAT', KEYS[5], t, (n - est) * tonumber(st[5]))
    if redis.call('ZSCORE', KEYS[4], t) then redis.call('ZADD', KEYS[4], c, t) end
  end
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
)

# Any request -> FAILED, whatever its keys hold: the way out for a MALFORMED one. A record or
# token list of the wrong type is deleted, the request leaves the queues (its tenant's too, named
# by the record or, when that is unreadable, by the caller) and its executor's running set, and a
# fresh record says FAILED with the error, under the usual TTL. KEYS: req, tokens, pending,
# waiting, tenant_running, and the executor's running set when the caller knows it. ARGV: id,
# tenant ('' = unknown), tenant_queue_prefix, now_ms, ttl_s, error. Returns 1 ended here, 0 it
# had already ended with well-formed keys.
QUARANTINE = (
    _TENANT_LIB
    + """
local id, tenant = ARGV[1], ARGV[2]
local state = ''
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  local st = redis.call('HMGET', KEYS[1], 'state', 'tenant', 'executor')
  state = st[1] or ''
  if st[2] then tenant = st[2] elseif tenant == '' then tenant = 'default' end
  local ended = state == 'FINISHED' or state == 'CANCELLED' or state == 'FAILED'
  local t = redis.call('TYPE', KEYS[2]).ok
  if ended and (t == 'list' or t == 'none') then return 0 end
else
  redis.call('DEL', KEYS[1])
end
local t = redis.call('TYPE', KEYS[2]).ok
if t ~= 'list' and t ~= 'none' then redis.call('DEL', KEYS[2]) end
redis.call('ZREM', KEYS[3], id)
if tenant ~= '' and redis.call('TYPE', ARGV[3] .. tenant).ok == 'zset' then
  leave_tenant(ARGV[3] .. tenant, KEYS[4], tenant, id)
end
if state == 'ASSIGNED' or state == 'RUNNING' then stop_running(KEYS[5], tenant) end
if KEYS[6] then redis.call('SREM', KEYS[6], id) end
redis.call('HSET', KEYS[1], 'state', 'FAILED', 'finish_reason', 'ERROR', 'finished_ms', ARGV[4], 'error', ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return 1
"""
)
