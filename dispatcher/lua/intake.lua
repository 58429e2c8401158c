#!lua
-- intake: create a batch (or dedupe it, or reopen a dead-lettered / replayed-failed one).
-- #!lua (no flags): Redis refuses the whole script when it is out of memory (a script without
-- the line is refused only at its first deny-oom command, and any write before it, e.g. a DEL,
-- let the rest through: an intake under OOM would then succeed and fill Redis further).
--
-- KEYS[1]  the batch hash            <p>:batch:<key> (see dispatcher/keys.py: the id, or <tenant>/<id>)
-- ARGV[1]  batch id
-- ARGV[2]  dedupe marker key ('' = none; set for non-queued intakes)
-- ARGV[3]  now (unix s)
-- ARGV[4]  ready score (priority, then age)
-- ARGV[5]  deadline (unix s, '' = none)
-- ARGV[6]  replay id ('' = not a replay)
-- ARGV[7]  initial state (queued, or dead_lettered for a rejected request)
-- ARGV[8]  the batch fields as JSON
-- Constants of the script (replaced when it is loaded: fewer arguments per call): @PREFIX@ (the key
-- prefix), @DEDUPE_TTL@, @FINISHED_TTL@.
-- Also touches, by name from the prefix (NOT declared in KEYS: not Redis-Cluster safe):
--   <p>:state:<state>, <p>:ready, <p>:delayed, <p>:deadlines, <p>:unpublished, <p>:progress:<id>,
--   the marker key.
-- Returns {outcome, state, version, generation}; outcome: created | reopened | duplicate | dup_event.
local P, DEDUPE_TTL, FINISHED_TTL = '@PREFIX@', '@DEDUPE_TTL@', '@FINISHED_TTL@'
local id, marker, now, initial = ARGV[1], ARGV[2], ARGV[3], ARGV[7]
local batch = KEYS[1]
local sprefix, ready, deadlines = P .. ':state:', P .. ':ready', P .. ':deadlines'
if marker ~= '' and redis.call('EXISTS', marker) == 1 then
  local cur = redis.call('HMGET', batch, 'state', 'version', 'generation')
  return {'dup_event', cur[1] or '', cur[2] or '0', cur[3] or '0'}
end
local fields = cjson.decode(ARGV[8])
local cur = redis.call('HMGET', batch, 'state', 'version', 'generation', 'replay_id', 'source', 'event_id')
local version, generation, outcome, prev_attempt = 0, 0, 'created', nil
if cur[1] then
  local state = cur[1]
  version = tonumber(cur[2] or '0')
  generation = tonumber(cur[3] or '0')
  local reopen = false
  if initial == 'queued' then
    if state == 'dead_lettered' then
      reopen = true
    elseif state == 'failed' and ARGV[6] ~= '' and ARGV[6] ~= (cur[4] or '') then
      reopen = true
    end
  end
  if not reopen then
    -- the same event again (redelivery, producer retry) or another event for a known batch
    local same = cur[5] == fields['source'] and cur[6] == fields['event_id'] and (cur[4] or '') == ARGV[6]
    return {same and 'dup_event' or 'duplicate', state, tostring(version), tostring(generation)}
  end
  prev_attempt = redis.call('HGET', batch, 'attempt') or '0'
  -- the lifecycle (results prefix, submission ids) is kept, so a replay may resume its shards
  local prev_lifecycle = redis.call('HGET', batch, 'lifecycle')
  if prev_lifecycle then fields['lifecycle'] = prev_lifecycle end
  redis.call('ZREM', sprefix .. state, id)
  redis.call('ZREM', P .. ':unpublished', id)
  redis.call('ZREM', ready, id)
  redis.call('ZREM', P .. ':delayed', id)
  redis.call('DEL', batch, P .. ':progress:' .. id)
  generation = generation + 1
  outcome = 'reopened'
end
if outcome == 'created' then
  -- a new lifecycle: a progress hash left by an old one (its record gone) must not fence it out
  redis.call('DEL', P .. ':progress:' .. id)
end
fields['state'] = initial
fields['version'] = tostring(version + 1)
fields['generation'] = tostring(generation)
fields['state_at'] = now
if ARGV[6] ~= '' then fields['replay_id'] = ARGV[6] end
if prev_attempt then
  -- attempt numbers (and so Ray submission ids) keep counting across a reopen
  fields['attempt'] = prev_attempt
  fields['attempt_base'] = prev_attempt
end
local flat = {}
for k, v in pairs(fields) do flat[#flat + 1] = k; flat[#flat + 1] = tostring(v) end
redis.call('HSET', batch, unpack(flat))
redis.call('ZADD', sprefix .. initial, now, id)
if initial == 'queued' then
  redis.call('ZADD', ready, ARGV[4], id)
  if ARGV[5] ~= '' then redis.call('ZADD', deadlines, ARGV[5], id) end
else
  redis.call('EXPIRE', batch, FINISHED_TTL)
end
if marker ~= '' then redis.call('SET', marker, id, 'EX', DEDUPE_TTL) end
return {outcome, initial, tostring(version + 1), tostring(generation)}
