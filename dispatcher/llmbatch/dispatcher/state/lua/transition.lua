#!lua
-- transition: compare-and-set a batch's state and keep its indexes in step.
-- #!lua (no flags): refused whole when Redis is out of memory (see intake.lua).
--
-- KEYS[1]  the batch hash      KEYS[2]  <p>:ready      KEYS[3]  <p>:delayed
-- KEYS[4]  <p>:deadlines       KEYS[5]  <p>:unpublished
-- KEYS[6..] the state indexes <p>:state:<s> of the allowed from-states and the to-state, in ARGV[10]'s order
-- ARGV[1]  batch id            ARGV[2]  expected version ('' = any)
-- ARGV[3]  allowed from-states (comma-separated)
-- ARGV[4]  to-state            ARGV[5]  now (unix s)
-- ARGV[6]  fields to set (JSON object)          ARGV[7]  fields to delete (JSON array)
-- ARGV[8]  ready score ('' = the stored one)    ARGV[9]  not-before for a delayed retry ('' = now)
-- ARGV[10] the state names, in the order of KEYS[6..]      ARGV[11] terminal states (csv)
-- Every key it touches is declared in KEYS.
-- Returns {ok | conflict | missing, state, version}.
local batch, ready, delayed, deadlines, unpublished = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, to, now = ARGV[1], ARGV[4], ARGV[5]
local zsets = state_zsets(6, ARGV[10])
local cur = redis.call('HMGET', batch, 'state', 'version')
if not cur[1] then return {'missing', '', '0'} end
local state, version = cur[1], tonumber(cur[2] or '0')
if ARGV[2] ~= '' and tonumber(ARGV[2]) ~= version then return {'conflict', state, tostring(version)} end
local allowed = false
for s in string.gmatch(ARGV[3], '[^,]+') do if s == state then allowed = true end end
if not allowed or is_terminal(state) then return {'conflict', state, tostring(version)} end
for _, f in ipairs(cjson.decode(ARGV[7])) do redis.call('HDEL', batch, f) end
local sets = cjson.decode(ARGV[6])
sets['state'] = to
sets['version'] = tostring(version + 1)
if to ~= state then sets['state_at'] = now end
hset_map(batch, sets)
if to ~= state then
  redis.call('ZREM', zsets[state], id)
  redis.call('ZADD', zsets[to], now, id)
end
if to == 'queued' then
  local nb = ARGV[9]
  if nb ~= '' and tonumber(nb) > tonumber(now) then
    redis.call('ZREM', ready, id)
    redis.call('ZADD', delayed, nb, id)
  else
    local score = ARGV[8]
    if score == '' then score = redis.call('HGET', batch, 'ready_score') or now end
    redis.call('ZREM', delayed, id)
    redis.call('ZADD', ready, score, id)
  end
elseif state == 'queued' then
  redis.call('ZREM', ready, id)
  redis.call('ZREM', delayed, id)
end
if is_terminal(to) then
  redis.call('ZREM', deadlines, id)
  redis.call('ZADD', unpublished, now, id)
end
return {'ok', to, tostring(version + 1)}
