-- retention_retire: before the collector deletes an expired lifecycle's results, forget its state.
--
-- KEYS[1]  <p>:retention:queue    KEYS[2]  <p>:retention:due
-- KEYS[3]  the batch hash         KEYS[4]  <p>:progress:<key>
-- KEYS[5]  the tenant's listed batches (<p>:tenant:<tenant>:batches)
-- KEYS[6]  the batch's tombstone (<p>:retention:gone:b|<tenant>|<batch_id>)
-- ARGV[1]  the member (b|<tenant>|<batch_id>|<lifecycle>)   ARGV[2]  the claim's token
-- ARGV[3]  the lifecycle ('' for a batch of before lifecycles)  ARGV[4]  the batch id
-- ARGV[5]  now (unix s): the tombstone's date if the member has no date in KEYS[2]
-- ARGV[6]  how long the tombstone is kept (s)
-- ARGV[7]  terminal states (comma-separated; last)
-- One atomic look decides, so a batch never loses what it runs on:
--   the hash shows this lifecycle not ended (an operator reopened it): nothing is touched and the
--     member leaves the index (its new end dates it again) -> running
--   the hash shows another lifecycle (the id was sent again after this one's record expired): that
--     batch's state stays; only this lifecycle's folder may go -> newer
--   else (this lifecycle ended, or its record expired already): the hash, its progress and its
--     listing go, and the tombstone is set -> retired
-- Returns running | newer | retired, or lost when the claim is no longer this caller's.
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not held or tonumber(held) ~= tonumber(ARGV[2]) then return 'lost' end
local cur = redis.call('HMGET', KEYS[3], 'state', 'lifecycle')
if cur[1] then
  local lifecycle = cur[2] or ''
  if lifecycle ~= ARGV[3] then return 'newer' end
  local terminal = false
  for t in string.gmatch(ARGV[#ARGV], '[^,]+') do if t == cur[1] then terminal = true end end
  if not terminal then
    redis.call('ZREM', KEYS[1], ARGV[1])
    redis.call('ZREM', KEYS[2], ARGV[1])
    return 'running'
  end
end
redis.call('DEL', KEYS[3], KEYS[4])
redis.call('ZREM', KEYS[5], ARGV[4])
-- the tombstone says when it expired: its date in the due zset
redis.call('SET', KEYS[6], redis.call('ZSCORE', KEYS[2], ARGV[1]) or ARGV[5], 'EX', ARGV[6])
return 'retired'
