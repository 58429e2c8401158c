-- release_lease: give a lease back, only if the caller still holds it.
--
-- KEYS[1]  <p>:lease:<name>
-- ARGV[1]  owner token
-- Returns 1 when released, 0 otherwise.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
