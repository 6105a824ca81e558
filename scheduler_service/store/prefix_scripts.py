"""Lua scripts of the fleet's prefix-cache index: one set per executor of the block names it holds.

Only ``PrefixIndex`` runs them. Writes are fenced by the executor's lease: a replica that lost
the lease (its link about to be dropped) must not touch a set that the new holder's link rebuilds
from its own stream. A lease nobody holds fences nothing: no other link can be writing then.
"""

from __future__ import annotations

# Apply an executor's cache events, report by report, in order.
# KEYS: index set, lease. ARGV: holder, then per report: cleared ('1'/'0'), n, n stored names,
# m, m removed names. Returns 1, or 0 when another replica holds the lease (nothing written).
# SADD/SREM go in slices of 1,000 names: Lua's unpack() has a stack limit, and a first report
# after a restart lists every block the executor holds.
APPLY_EVENTS = """
local lease = redis.call('GET', KEYS[2])
if lease and lease ~= ARGV[1] then return 0 end
local function each(cmd, first, n)
  local last = first + n - 1
  while first <= last do
    local upto = math.min(first + 999, last)
    redis.call(cmd, KEYS[1], unpack(ARGV, first, upto))
    first = upto + 1
  end
end
local i = 2
while i <= #ARGV do
  if ARGV[i] == '1' then redis.call('DEL', KEYS[1]) end
  local n = tonumber(ARGV[i + 1])
  each('SADD', i + 2, n)
  i = i + 2 + n
  n = tonumber(ARGV[i])
  each('SREM', i + 1, n)
  i = i + 1 + n
end
return 1
"""

# Forget an executor's set (it died, or its link ended). KEYS: index set, lease. ARGV: holder.
# Returns 1, or 0 when another replica holds the lease: its link owns the set now.
DROP = """
local lease = redis.call('GET', KEYS[2])
if lease and lease ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

# How many of a queued request's block names, from the first on, each executor holds, and the
# prompt's marks: its names at positions 1, 2, 4, 8, ... (each names every block up to it).
# ``leading_run(record, sets)``: the request's record key and the executors' index sets; returns
# {block size the names were computed with (0: none stored), leading run of set 1, leading run of
# set 2, ..., mark 1, mark 2, ...} and how many names it looked up. A set that lacks the first name
# costs one SISMEMBER; one that has it is asked about every name in one SMISMEMBER (a Lua call per
# name cost about 1.5 us, twenty times a name's lookup inside one command). Of the names only the
# marks leave Redis, at most nine for the 256 names a record keeps. A set Redis cannot read as one
# holds nothing. Also run inside the admission read (``queue_scripts.ADMISSION_VIEW``).
LEADING_RUN_LIB = """
local function leading_run(record, sets)
  local raw = redis.call('HMGET', record, 'prefix', 'prefix_block')
  local out = {tonumber(raw[2]) or 0}
  for k = 1, #sets do out[k + 1] = 0 end
  if not raw[1] or out[1] == 0 then return out, 0 end
  local names = {}
  for name in string.gmatch(raw[1], '[^,]+') do names[#names + 1] = name end
  local mark, slot = 1, #sets + 2
  while mark <= #names do
    out[slot] = names[mark]
    slot = slot + 1
    mark = mark * 2
  end
  local checked = 0
  for k = 1, #sets do
    checked = checked + 1
    if #names > 0 and redis.pcall('SISMEMBER', sets[k], names[1]) == 1 then
      local held = redis.pcall('SMISMEMBER', sets[k], unpack(names))
      checked = checked + #names
      if not held.err then
        local run = 0
        while run < #names and held[run + 1] == 1 do run = run + 1 end
        out[k + 1] = run
      end
    end
  end
  return out, checked
end
"""

# One request's leading runs. KEYS: the request's record, then the executors' index sets.
LEADING_RUNS = (
    LEADING_RUN_LIB
    + """
local out = leading_run(KEYS[1], {unpack(KEYS, 2)})
return out
"""
)
