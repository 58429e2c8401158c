#!lua
-- intake: create a batch (or dedupe it, or reopen a dead-lettered / replayed-failed one).
-- #!lua (no flags): Redis refuses the whole script when it is out of memory (a script without
-- the line is refused only at its first deny-oom command, and any write before it, e.g. a DEL,
-- let the rest through: an intake under OOM would then succeed and fill Redis further).
--
-- KEYS[1]  the batch hash            <p>:batch:<key> (see dispatcher/keys.py: the id, or <tenant>/<id>)
-- KEYS[2]  its progress hash       <p>:progress:<key>
-- KEYS[3]  its dedupe marker       <p>:event:<source>:<id> (written only when ARGV[2] is '1')
-- KEYS[4]  <p>:ready     KEYS[5]  <p>:delayed     KEYS[6]  <p>:deadlines     KEYS[7]  <p>:unpublished
-- KEYS[8]  the tenant's listed batches <p>:tenant:<tenant>:batches (id -> accepted, unix ms)
-- KEYS[9]  <p>:tenants
-- KEYS[10] the tenant's enqueued tokens <p>:quota:<tenant>:tokens (dispatcher/domain/quota.py)
-- KEYS[11..] the state indexes it may touch, <p>:state:<queued|dead_lettered|failed>, in ARGV[9]'s order
-- ARGV[1]  batch id
-- ARGV[2]  '1': dedupe by the marker (non-queued intakes); '': by the batch's source and event id
-- ARGV[3]  now (unix s)
-- ARGV[4]  ready score (priority, then the nearest deadline)
-- ARGV[5]  deadline (unix s, '' = none)
-- ARGV[6]  replay id ('' = not a replay)
-- ARGV[7]  initial state (queued, or dead_lettered for a rejected request)
-- ARGV[8]  the batch fields as JSON
-- ARGV[9]  the state names, in the order of KEYS[11..]
-- ARGV[10] terminal states (csv). Not read here: common.lua's is_terminal reads a script's LAST
--          argument, which for this script is ARGV[14]; call it here only after moving this list last
-- ARGV[11] the tenant whose list shows the batch ('' = none: the API lists its own)
-- ARGV[12] the batch id as its tenant knows it
-- ARGV[13] the batch's estimated tokens (a queued intake adds them to KEYS[10] and keeps them in its
--          hash as quota_tokens)    ARGV[14] the tenant's limit ('' = none)
-- Constants of the script (replaced when it is loaded: fewer arguments per call): @DEDUPE_TTL@,
-- @FINISHED_TTL@. Every key it touches is declared in KEYS (Redis-Cluster safe when the key prefix
-- holds a hash tag, e.g. {llmbatch}).
-- Returns {outcome, state, version, generation}; outcome: created | reopened | duplicate | dup_event
-- | over_quota (the batch's tokens would pass the tenant's limit: nothing written; state, version and
-- generation are then the tokens enqueued, the estimate and the limit).
local DEDUPE_TTL, FINISHED_TTL = '@DEDUPE_TTL@', '@FINISHED_TTL@'
local id, by_marker, now, initial = ARGV[1], ARGV[2] == '1', ARGV[3], ARGV[7]
local batch, progress, marker = KEYS[1], KEYS[2], KEYS[3]
local ready, delayed, deadlines, unpublished = KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local zsets = state_zsets(11, ARGV[9])
local quota, estimate, limit = KEYS[10], tonumber(ARGV[13]) or 0, ARGV[14]
-- nil when the batch fits (or has no limit), else the answer refusing it; `held`: what an old
-- lifecycle being reopened still holds (given back as it is reopened)
local function over_quota(held)
  if initial ~= 'queued' or limit == '' then return nil end
  local used = (tonumber(redis.call('GET', quota) or '0') or 0) - held
  if used + estimate > tonumber(limit) then
    return {'over_quota', tostring(used), tostring(estimate), limit}
  end
  return nil
end
if by_marker and redis.call('EXISTS', marker) == 1 then
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
  local old = redis.call('HMGET', batch, 'quota_tokens', 'published')
  local held = 0
  if old[2] ~= '1' then held = tonumber(old[1] or '0') or 0 end
  local refused = over_quota(held)
  if refused then return refused end
  if held > 0 then redis.call('DECRBY', quota, held) end
  prev_attempt = redis.call('HGET', batch, 'attempt') or '0'
  -- the lifecycle (results prefix, submission ids) is kept, so a replay may resume its shards
  local prev_lifecycle = redis.call('HGET', batch, 'lifecycle')
  if prev_lifecycle then fields['lifecycle'] = prev_lifecycle end
  redis.call('ZREM', zsets[state], id)
  redis.call('ZREM', unpublished, id)
  redis.call('ZREM', ready, id)
  redis.call('ZREM', delayed, id)
  redis.call('DEL', batch, progress)
  generation = generation + 1
  outcome = 'reopened'
end
if outcome == 'created' then
  local refused = over_quota(0)
  if refused then return refused end
  -- a new lifecycle: a progress hash left by an old one (its record gone) must not fence it out
  redis.call('DEL', progress)
end
fields['state'] = initial
fields['version'] = tostring(version + 1)
fields['generation'] = tostring(generation)
fields['state_at'] = now
if initial == 'queued' then fields['quota_tokens'] = tostring(estimate) end
if ARGV[6] ~= '' then fields['replay_id'] = ARGV[6] end
if prev_attempt then
  -- attempt numbers (and so Ray submission ids) keep counting across a reopen
  fields['attempt'] = prev_attempt
  fields['attempt_base'] = prev_attempt
end
local flat = {}
for k, v in pairs(fields) do flat[#flat + 1] = k; flat[#flat + 1] = tostring(v) end
redis.call('HSET', batch, unpack(flat))
redis.call('ZADD', zsets[initial], now, id)
if initial == 'queued' and ARGV[11] ~= '' then
  redis.call('ZADD', KEYS[8], math.floor(tonumber(now) * 1000), ARGV[12])  -- ms: the API's ids' precision
  redis.call('SADD', KEYS[9], ARGV[11])
end
if initial == 'queued' then
  if estimate > 0 then redis.call('INCRBY', quota, estimate) end
  redis.call('ZADD', ready, ARGV[4], id)
  if ARGV[5] ~= '' then redis.call('ZADD', deadlines, ARGV[5], id) end
else
  redis.call('EXPIRE', batch, FINISHED_TTL)
end
if by_marker then redis.call('SET', marker, id, 'EX', DEDUPE_TTL) end
return {outcome, initial, tostring(version + 1), tostring(generation)}
