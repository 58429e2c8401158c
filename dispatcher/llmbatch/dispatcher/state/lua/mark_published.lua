-- mark_published: the terminal event of a batch is out; drop what served it and close its progress.
--
-- KEYS[1]  the batch hash      KEYS[2]  <p>:unpublished      KEYS[3]  <p>:progress:<id>
-- KEYS[4]  the tenant's enqueued tokens (<p>:quota:<tenant>:tokens): the batch's quota_tokens go back
-- KEYS[5]  <p>:retention:due   KEYS[6]  <p>:retention:queue  (the retention index: dispatcher.state.retention)
-- KEYS[7]  (optional) the tenant's usage hash of the day the batch ended (<p>:usage:<tenant>:<yyyymmdd>)
-- KEYS[8]  (with KEYS[7]) <p>:usage:tenants
-- ARGV[1]  batch id            ARGV[2]  the terminal event id      ARGV[3]  now (unix s)
-- ARGV[4]  finished TTL (s)    ARGV[5]  the tenant ('' without KEYS[7])
-- ARGV[6]  how long the usage hash is kept (s)
-- ARGV[7]  the batch's retention member without its lifecycle (b|<tenant>|<batch_id>|): the
--          script adds the lifecycle field
-- ARGV[8]  when the batch ended (unix s; '' for now)
-- ARGV[9]  terminal states (comma-separated; last)
-- The first time a lifecycle's terminal event is marked published, its usage (from the batch's
-- outcome) is added to the usage hash, under <model>|<state>|<counter>: once per lifecycle, in the same
-- script as the mark, so the usage record is exact. Then too, a batch kept for retention_s (a field
-- of its hash) gets its lifecycle into the retention index, due retention_s after it ended, and the
-- hash remembers when (results_expire_at). Returns counted (marked now) | ok (marked before)
-- | conflict | missing.
local cur = redis.call('HMGET', KEYS[1], 'state', 'terminal_event_id')
if not cur[1] then redis.call('ZREM', KEYS[2], ARGV[1]); return 'missing' end
if not is_terminal(cur[1]) or cur[2] ~= ARGV[2] then return 'conflict' end
local first = redis.call('HGET', KEYS[1], 'published') ~= '1'
if first then
  -- the batch's enqueued tokens go back to its tenant (counted at intake; never below zero)
  local held = tonumber(redis.call('HGET', KEYS[1], 'quota_tokens') or '0') or 0
  if held > 0 and redis.call('DECRBY', KEYS[4], held) <= 0 then redis.call('DEL', KEYS[4]) end
end
if first and KEYS[7] then
  local model = redis.call('HGET', KEYS[1], 'model') or ''
  local ok, o = pcall(cjson.decode, redis.call('HGET', KEYS[1], 'outcome') or '{}')
  if not ok or type(o) ~= 'table' then o = {} end
  local counts = type(o.counts) == 'table' and o.counts or {}
  local usage = type(o.usage) == 'table' and o.usage or {}
  local function n(v) v = tonumber(v); if v and v > 0 then return math.floor(v) end return 0 end
  local base = model .. '|' .. cur[1] .. '|'
  redis.call('HINCRBY', KEYS[7], base .. 'batches', 1)
  redis.call('HINCRBY', KEYS[7], base .. 'requests', n(counts.total))
  redis.call('HINCRBY', KEYS[7], base .. 'completed', n(counts.completed))
  redis.call('HINCRBY', KEYS[7], base .. 'failed', n(counts.failed))
  redis.call('HINCRBY', KEYS[7], base .. 'prompt_tokens', n(usage.prompt_tokens))
  redis.call('HINCRBY', KEYS[7], base .. 'completion_tokens', n(usage.completion_tokens))
  redis.call('EXPIRE', KEYS[7], ARGV[6])
  redis.call('SADD', KEYS[8], ARGV[5])
end
local keep = tonumber(redis.call('HGET', KEYS[1], 'retention_s') or '')
if first and keep and keep > 0 then
  local due = (tonumber(ARGV[8]) or tonumber(ARGV[3])) + keep
  local member = ARGV[7] .. (redis.call('HGET', KEYS[1], 'lifecycle') or '')
  redis.call('ZADD', KEYS[5], due, member)
  redis.call('ZADD', KEYS[6], due, member)
  redis.call('HSET', KEYS[1], 'results_expire_at', tostring(due))
end
redis.call('HSET', KEYS[1], 'published', '1', 'published_at', ARGV[3])
-- the request body and the original record served launches and the dead letter: both are done
redis.call('HDEL', KEYS[1], 'request', 'origin')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
-- closed: an attempt still running (a stop that did not take) may write nothing more for this
-- lifecycle, neither progress nor shards nor a manifest (ray_job/job/write_progress.lua)
redis.call('HSET', KEYS[3], 'closed', ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[4])
if first then return 'counted' end
return 'ok'
