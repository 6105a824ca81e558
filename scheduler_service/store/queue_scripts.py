"""The Lua script behind one admission round's read of the queue (run by ``PendingQueue``).

Why one script: a round used to read the waiting tenants, then their queue heads, then the heads'
records, then how much of each prompt every executor caches, one round trip after the other,
each answer naming what the next asks for. On a loaded host every round trip waits for Redis and
then for the scheduler to be given a core again (2-5 ms each on two busy cores), and admission
latency is what a request that finds room waits before its executor sees it. Read here in one
call, a round costs this read and the claims.

Keys built inside the script (a tenant's queue, a head's record and token list, its sample 0's)
carry the same ``{prefix}`` hash tag as the keys it names, so on a Redis Cluster they live in its
slot, as for ``request_scripts``. Only reads: nothing here moves a request.
"""

from __future__ import annotations

from scheduler_service.store.prefix_scripts import LEADING_RUN_LIB

# KEYS: tenants waiting, pending, tenants running, then the index sets of the executors to ask
# about cached prefixes. ARGV: most tenants, most requests (``limit``), tenant queue prefix,
# request key prefix, '1' to read the tenants' running counts, heads per tenant to ask about
# cached prefixes, most heads to ask about in all, most names to look up in all, a random draw (a
# non-negative integer), the running caps (JSON: tenant -> cap), then the record's fields to read.
# Returns {queue length, {tenant, counter, ...} (smallest counters first, less tenants at their
# cap; where more tenants than fit tie at the last counter read, the draw picks which of them),
# per tenant {id, score,
# ...} (its ceil(limit / tenants) + 2 heads, at most limit), per head in that order {'' and its
# fields, token count, and for a later sample ``ID~k`` its sample 0's state, executor and token
# count} or {'!', the error} for a record Redis cannot read as the schema says, {tenant, running,
# ...} or {}, {id, leading run, ...} (``prefix_scripts.LEADING_RUN_LIB``)}. A sample 0 whose record
# cannot be read counts as gone.
# Cached prefixes are looked up breadth first, every tenant's first head, then every tenant's
# second, as fair order takes them, until either limit is spent: the name limit bounds how long
# the call holds Redis whatever the prompts' lengths and the number of executors.
ADMISSION_VIEW = (
    LEADING_RUN_LIB
    + """
local most = tonumber(ARGV[1])
local caps = cjson.decode(ARGV[10])
local capped = 0
local at_cap = {}  -- the tenants at their running cap, read once
local capped_names = {}
for name in pairs(caps) do capped_names[#capped_names + 1] = name end
-- In slices: Lua's unpack takes at most a few thousand values, and thousands of caps may be set.
for first = 1, #capped_names, 1000 do
  local last = math.min(first + 999, #capped_names)
  local counts = redis.call('HMGET', KEYS[3], unpack(capped_names, first, last))
  for i = first, last do
    if (tonumber(counts[i - first + 1]) or 0) >= caps[capped_names[i]] then
      at_cap[capped_names[i]] = true
      capped = capped + 1
    end
  end
end
-- Read as many more as there are tenants at their cap: they are left out below.
local want = most + capped
local tenants = redis.call('ZRANGE', KEYS[1], 0, want - 1, 'WITHSCORES')
if #tenants == 2 * want then
  -- A full read may stop inside a run of tenants tied at its last counter (idle tenants come
  -- back level with the smallest). A sorted set orders ties by name, so the same names would be
  -- read every round and the others never: take the tied ones from where the draw says.
  local last = tenants[#tenants]
  local inside = 0
  while inside < want and tenants[#tenants - 2 * inside] == last do inside = inside + 1 end
  local tied = redis.call('ZCOUNT', KEYS[1], last, last)
  if tied > inside then
    -- A window of the tied run from the drawn place, wrapping around its end: every tied tenant
    -- is read with the same chance, inside / tied.
    local offset = tonumber(ARGV[9]) % tied
    local drawn = redis.call('ZRANGE', KEYS[1], last, last, 'BYSCORE', 'LIMIT', offset, inside, 'WITHSCORES')
    if #drawn < 2 * inside then
      local rest = redis.call('ZRANGE', KEYS[1], last, last, 'BYSCORE', 'LIMIT', 0, inside - #drawn / 2, 'WITHSCORES')
      for i = 1, #rest do drawn[#drawn + 1] = rest[i] end
    end
    for i = 1, #drawn do tenants[#tenants - 2 * inside + i] = drawn[i] end
  end
end
if capped > 0 then
  -- A tenant at its running cap can be given nothing this round, and its counter stands still
  -- while it waits: kept among the smallest, such tenants would fill the read and hide the
  -- tenants that can run.
  local kept = {}
  for i = 1, #tenants, 2 do
    if #kept < 2 * most and not at_cap[tenants[i]] then
      kept[#kept + 1] = tenants[i]
      kept[#kept + 1] = tenants[i + 1]
    end
  end
  tenants = kept
end
local count = #tenants / 2
local heads, details, running, runs = {}, {}, {}, {}
local out = {redis.call('ZCARD', KEYS[2]), tenants, heads, details, running, runs}
if count == 0 then return out end
local limit = tonumber(ARGV[2])
local per = math.min(limit, math.ceil(limit / count) + 2)
local request, runs_each = ARGV[4], tonumber(ARGV[6])
local runs_left, names_left = tonumber(ARGV[7]), tonumber(ARGV[8])
local fields = {unpack(ARGV, 11)}
local sets = {unpack(KEYS, 4)}
local readable = {}  -- per tenant: ids of its heads with a record to look up, soonest first
for i = 1, count do
  local rows = redis.call('ZRANGE', ARGV[3] .. tenants[2 * i - 1], 0, per - 1, 'WITHSCORES')
  heads[i] = rows
  readable[i] = {}
  for j = 1, #rows, 2 do
    local id = rows[j]
    local record = request .. id
    local values = redis.pcall('HMGET', record, unpack(fields))
    local generated = redis.pcall('LLEN', record .. ':tokens')
    local row
    if values.err or type(generated) ~= 'number' then
      row = {'!', values.err or generated.err}
    else
      row = {''}
      for k = 1, #fields do row[k + 1] = values[k] end
      row[#fields + 2] = generated
      local first = string.match(id, '^(.+)~%d+$')
      if first then
        local state = redis.pcall('HMGET', request .. first, 'state', 'executor')
        local first_generated = redis.pcall('LLEN', request .. first .. ':tokens')
        if state.err then state = {false, false} end
        if type(first_generated) ~= 'number' then first_generated = 0 end
        row[#fields + 3] = state[1]
        row[#fields + 4] = state[2]
        row[#fields + 5] = first_generated
      end
      if values[1] and #readable[i] < runs_each then readable[i][#readable[i] + 1] = id end
    end
    details[#details + 1] = row
  end
end
if #sets > 0 then
  for depth = 1, runs_each do
    local more = false
    for i = 1, count do
      local id = readable[i][depth]
      if id and runs_left > 0 and names_left > 0 then
        local run, checked = leading_run(request .. id, sets)
        runs[#runs + 1] = id
        runs[#runs + 1] = run
        runs_left = runs_left - 1
        names_left = names_left - checked
        more = true
      end
    end
    if not more then break end
  end
end
if ARGV[5] == '1' then
  -- The waiting tenants read here only: the hash names every tenant running anything.
  local names = {}
  for i = 1, count do names[i] = tenants[2 * i - 1] end
  local counts = redis.call('HMGET', KEYS[3], unpack(names))
  for i = 1, count do
    if counts[i] then
      running[#running + 1] = names[i]
      running[#running + 1] = counts[i]
    end
  end
end
return out
"""
)
