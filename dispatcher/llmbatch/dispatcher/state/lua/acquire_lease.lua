-- acquire_lease: take (or extend) a named lease, e.g. the tracker loop's leadership.
--
-- KEYS[1]  <p>:lease:<name>
-- ARGV[1]  owner token      ARGV[2]  time to live (ms)
-- Returns 1 when the caller holds the lease, 0 otherwise.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]); return 1 end
return 0
