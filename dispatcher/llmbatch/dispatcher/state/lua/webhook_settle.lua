-- webhook_settle: record how one claimed attempt of a delivery ended.
--
-- KEYS[1]  <p>:webhook:due     KEYS[2]  <p>:webhook:dead
-- KEYS[3]  the delivery's hash (<p>:webhook:delivery:<id>)   KEYS[4]  its done marker
-- ARGV[1]  delivery id   ARGV[2]  the claim's token (its score in due when claimed)
-- ARGV[3]  outcome: delivered | retry | dead | dropped
-- ARGV[4]  now (unix ms)  ARGV[5]  next attempt (unix ms; retry)  ARGV[6]  HTTP status ('' if none)
-- ARGV[7]  error text ('' if none)  ARGV[8]  done marker TTL (s)  ARGV[9]  dead delivery TTL (s)
-- Nothing happens unless the delivery is still claimed by this token (a replica whose lease ran out
-- and was overtaken settles nothing). Returns 1 if applied, else 0.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
local outcome = ARGV[3]
if outcome == 'retry' then
  redis.call('HINCRBY', KEYS[3], 'attempts', 1)
  redis.call('HSET', KEYS[3], 'last_status', ARGV[6], 'last_error', ARGV[7], 'last_at', ARGV[4])
  redis.call('ZADD', KEYS[1], ARGV[5], ARGV[1])
  return 1
end
redis.call('ZREM', KEYS[1], ARGV[1])
if outcome == 'delivered' then
  redis.call('DEL', KEYS[3])
  redis.call('SET', KEYS[4], ARGV[4], 'EX', tonumber(ARGV[8]))
elseif outcome == 'dead' then
  redis.call('HINCRBY', KEYS[3], 'attempts', 1)
  redis.call('HSET', KEYS[3], 'last_status', ARGV[6], 'last_error', ARGV[7], 'last_at', ARGV[4])
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[9]))
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[4]) - 1000 * tonumber(ARGV[9]))
else -- dropped: its endpoint is gone
  redis.call('DEL', KEYS[3])
end
return 1
