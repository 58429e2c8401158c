-- promote_due: move queued batches whose retry backoff has elapsed from delayed to ready.
--
-- KEYS[1]  <p>:delayed      KEYS[2]  <p>:ready
-- ARGV[1]  now (unix s)     ARGV[2]  most to move      ARGV[3]  batch hash prefix (<p>:batch:)
-- Also reads each moved batch's hash (NOT declared in KEYS).
-- Returns how many were due.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(due) do
  redis.call('ZREM', KEYS[1], id)
  local cur = redis.call('HMGET', ARGV[3] .. id, 'state', 'ready_score')
  if cur[1] == 'queued' then redis.call('ZADD', KEYS[2], cur[2] or ARGV[1], id) end
end
return #due
