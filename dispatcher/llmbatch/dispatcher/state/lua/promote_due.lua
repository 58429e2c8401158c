-- promote_due: move queued batches whose retry backoff has elapsed from delayed to ready.
--
-- KEYS[1]  <p>:delayed      KEYS[2]  <p>:ready
-- KEYS[3..] the hashes of the batches to look at (<p>:batch:<key>), in the order of ARGV[2..]
-- ARGV[1]  now (unix s)     ARGV[2..] those batches' keys (the caller read them from <p>:delayed)
-- A batch no longer in delayed, or not due yet, is left alone. Every key it touches is declared in KEYS.
-- Returns how many were due.
local now, due = tonumber(ARGV[1]), 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', KEYS[1], id)
  if score and tonumber(score) <= now then
    due = due + 1
    redis.call('ZREM', KEYS[1], id)
    local cur = redis.call('HMGET', KEYS[i + 1], 'state', 'ready_score')
    if cur[1] == 'queued' then redis.call('ZADD', KEYS[2], cur[2] or ARGV[1], id) end
  end
end
return due
