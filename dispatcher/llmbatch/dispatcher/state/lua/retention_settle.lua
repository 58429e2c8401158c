-- retention_settle: the collector is done with one claimed thing, or puts it off.
--
-- KEYS[1]  <p>:retention:due      KEYS[2]  <p>:retention:queue
-- KEYS[3]  (with ARGV[3] 'gone') the thing's tombstone, <p>:retention:gone:<name>
-- ARGV[1]  the member      ARGV[2]  the claim's token (its score in the queue)
-- ARGV[3]  done | defer | gone
-- ARGV[4]  defer: when to take it again (unix s); gone: when it expired (unix s)
-- ARGV[5]  gone: how long the tombstone is kept (s)
-- done removes the member; gone removes it and leaves the tombstone (reads then answer expired);
-- defer scores it again in the queue only (its expiry, in the due zset, stands).
-- Returns ok, or lost when the claim is no longer this caller's (the member is left alone).
local held = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not held or tonumber(held) ~= tonumber(ARGV[2]) then return 'lost' end
if ARGV[3] == 'defer' then
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
  return 'ok'
end
if ARGV[3] == 'gone' then redis.call('SET', KEYS[3], ARGV[4], 'EX', ARGV[5]) end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 'ok'
