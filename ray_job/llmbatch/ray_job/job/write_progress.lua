-- write_progress: write one attempt's progress fields, unless a later attempt of the batch has
-- already written to the hash or the dispatcher has closed it (the batch's terminal event is out):
-- the writer is then a stale attempt still running (a "zombie").
--
-- KEYS[1]  the batch's progress hash (JobSpec.progress_key, <prefix>:progress:<batch_id>)
-- ARGV[1]  the writer's attempt number
-- ARGV[2]  seconds the hash lives after this write (a zombie writing after the batch ended must not
--          leave a key behind for ever)
-- ARGV[3..] field, value, field, value, ... (the attempt field among them)
--
-- Returns 1 when written, 0 when a later attempt owns the hash or it is closed (nothing written).
if redis.call('HEXISTS', KEYS[1], 'closed') == 1 then
  return 0
end
local current = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0') or 0
if current > tonumber(ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
