-- tracker_members: say this replica is live (or leaving) and read the live replicas, on Redis' clock.
--
-- KEYS[1]  <p>:lease:<name>:members (zset: member token -> when its entry expires, ms)
-- ARGV[1]  member token        ARGV[2]  time to live (ms)       ARGV[3]  '1': leaving, '0': live
-- Returns the live members' tokens (expired entries are removed first).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ttl * 2)
end
return redis.call('ZRANGE', KEYS[1], 0, -1)
