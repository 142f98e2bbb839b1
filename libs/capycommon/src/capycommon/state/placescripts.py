"""The Lua scripts of request places (`capycommon.state.places`): each runs whole inside
Redis, so a take, a move between an owner's fields, a request joining or leaving the queue,
and an owner's keep are each one step over the places hashes, the waiting hash and the
owners' sorted set, which no other client's command splits.
"""

from __future__ import annotations

from capycommon.state.pipe import Script

# Lua shared by the scripts: Redis's clock; whether an owner lives (and refreshing it); how
# many live; a count lowered, its field dropped at zero; the counts of a places hash summed
# over its live owners (cut-at-stop places over every owner): generation, running (with the
# cuts), cuts that settle when idle, cuts that settle at the stop, spares.
_LIB = """
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function alive(owners, owner, at)
  local expiry = redis.call('ZSCORE', owners, owner)
  return expiry and tonumber(expiry) > at
end
local function refresh(owners, owner, ttl, at)
  redis.call('ZADD', owners, at + tonumber(ttl), owner)
end
local function live(owners, at)
  return redis.call('ZCOUNT', owners, '(' .. tostring(at), '+inf')
end
local function lower(key, field, n)
  local left = (tonumber(redis.call('HGET', key, field)) or 0) - n
  if left > 0 then
    redis.call('HSET', key, field, left)
  else
    redis.call('HDEL', key, field)
  end
end
local function count(places, owners, at)
  local fields = redis.call('HGETALL', places)
  local generation, running, idle, stop, spare = 0, 0, 0, 0, 0
  local live = {}
  for i = 1, #fields, 2 do
    local kind, owner = string.match(fields[i], '^(%a+):(.+)$')
    local value = tonumber(fields[i + 1])
    if fields[i] == 'generation' then
      generation = value
    elseif kind == 'stop' then
      stop = stop + value
    elseif kind then
      if live[owner] == nil then live[owner] = alive(owners, owner, at) end
      if live[owner] then
        if kind == 'spare' then
          spare = spare + value
        else
          running = running + value
          if kind == 'idle' then idle = idle + value end
        end
      end
    end
  end
  return {generation, running + stop, idle, stop, spare}
end
"""

# KEYS: the instance record, the places hash, the owners. ARGV: generation, limit, owner,
# owner TTL. Returns the live owners, this one included (taken), 0 (all places taken, spares
# too) or -1 (not ready at that generation).
TAKE = (
    _LIB
    + """
local raw = redis.call('GET', KEYS[1])
if not raw then return -1 end
local record = cjson.decode(raw)
if record['state'] ~= 'ready' or tostring(record['generation']) ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[2], 'generation') ~= ARGV[1] then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'generation', ARGV[1])
end
local at = now()
refresh(KEYS[3], ARGV[3], ARGV[4], at)
local held = count(KEYS[2], KEYS[3], at)
if held[2] + held[5] >= tonumber(ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[2], 'run:' .. ARGV[3], 1)
return live(KEYS[3], at)
"""
)

# KEYS: the places hash. ARGV: generation, owner, places to move, the field they leave (run,
# idle, stop or spare) and the field they join ("" for none: given back). Nothing changes for
# another generation (a stop settled them).
MOVE = (
    _LIB
    + """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
lower(KEYS[1], ARGV[4] .. ':' .. ARGV[2], tonumber(ARGV[3]))
if ARGV[5] ~= '' then redis.call('HINCRBY', KEYS[1], ARGV[5] .. ':' .. ARGV[2], ARGV[3]) end
return 1
"""
)

# KEYS: the waiting hash, the owners. ARGV: deployment, owner, the most waiting for the
# deployment, the most waiting in all, owner TTL. Returns 1 (it waits) or 0 (queue full).
JOIN = (
    _LIB
    + """
local at = now()
refresh(KEYS[2], ARGV[2], ARGV[5], at)
local fields = redis.call('HGETALL', KEYS[1])
local here, total, live = 0, 0, {}
for i = 1, #fields, 2 do
  local deployment, owner = string.match(fields[i], '^(%S+) (%S+)$')
  if live[owner] == nil then live[owner] = alive(KEYS[2], owner, at) end
  if live[owner] then
    total = total + tonumber(fields[i + 1])
    if deployment == ARGV[1] then here = here + tonumber(fields[i + 1]) end
  end
end
if here >= tonumber(ARGV[3]) or total >= tonumber(ARGV[4]) then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[1] .. ' ' .. ARGV[2], 1)
return 1
"""
)

# KEYS: the waiting hash, the owners. Returns each deployment and its waiting requests, as
# live owners hold them, flat: name, count, name, count, ...
WAITING = (
    _LIB
    + """
local at = now()
local fields = redis.call('HGETALL', KEYS[1])
local totals, live, found = {}, {}, {}
for i = 1, #fields, 2 do
  local deployment, owner = string.match(fields[i], '^(%S+) (%S+)$')
  if owner then
    if live[owner] == nil then live[owner] = alive(KEYS[2], owner, at) end
    if live[owner] then totals[deployment] = (totals[deployment] or 0) + tonumber(fields[i + 1]) end
  end
end
for deployment, n in pairs(totals) do
  found[#found + 1] = deployment
  found[#found + 1] = n
end
return found
"""
)

# KEYS: the waiting hash. ARGV: its field (`<deployment> <owner>`).
LEAVE = _LIB + "lower(KEYS[1], ARGV[1], 1)"

# KEYS: the owners, the waiting hash, then the places hash of each deployment. Returns the
# live owners, this one included. ARGV: owner,
# owner TTL, then for each deployment its name, the generation of the owner's places (0: it
# holds none), its run, idle, stop and spare counts, and its waiting requests. Refreshes the
# owner, forgets expired owners (with their waiting requests and all but their cut-at-stop
# places), and writes the owner's counts as they are: a places hash Redis lost, or left at an
# older generation, starts again at the owner's.
KEEP = (
    _LIB
    + """
local at = now()
local owner = ARGV[1]
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', at)
refresh(KEYS[1], owner, ARGV[2], at)
for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
  if not alive(KEYS[1], string.match(field, ' (%S+)$'), at) then
    redis.call('HDEL', KEYS[2], field)
  end
end
for i = 3, #KEYS do
  local base = 3 + (i - 3) * 7
  local deployment, generation = ARGV[base], ARGV[base + 1]
  for _, field in ipairs(redis.call('HKEYS', KEYS[i])) do
    local kind, other = string.match(field, '^(%a+):(.+)$')
    if kind and kind ~= 'stop' and not alive(KEYS[1], other, at) then
      redis.call('HDEL', KEYS[i], field)
    end
  end
  local current = redis.call('HGET', KEYS[i], 'generation')
  if generation ~= '0' and (not current or tonumber(current) < tonumber(generation)) then
    redis.call('DEL', KEYS[i])
    redis.call('HSET', KEYS[i], 'generation', generation)
    current = generation
  end
  for j, kind in ipairs({'run', 'idle', 'stop', 'spare'}) do
    if current == generation and ARGV[base + 1 + j] ~= '0' then
      redis.call('HSET', KEYS[i], kind .. ':' .. owner, ARGV[base + 1 + j])
    else
      redis.call('HDEL', KEYS[i], kind .. ':' .. owner)
    end
  end
  if ARGV[base + 6] ~= '0' then
    redis.call('HSET', KEYS[2], deployment .. ' ' .. owner, ARGV[base + 6])
  else
    redis.call('HDEL', KEYS[2], deployment .. ' ' .. owner)
  end
end
return live(KEYS[1], at)
"""
)

# KEYS: the places hash, the owners. Returns generation, running, settle_when_idle,
# settle_at_stop and spare as live owners hold them.
READ = _LIB + "return count(KEYS[1], KEYS[2], now())"


TAKE_SCRIPT = Script.of(TAKE)
MOVE_SCRIPT = Script.of(MOVE)
JOIN_SCRIPT = Script.of(JOIN)
LEAVE_SCRIPT = Script.of(LEAVE)
KEEP_SCRIPT = Script.of(KEEP)
