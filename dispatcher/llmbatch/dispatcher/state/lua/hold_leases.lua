-- hold_leases: take (or extend) the leases a replica should hold and give back the others it holds.
--
-- KEYS[1..n]  <p>:lease:<name> of each lease
-- ARGV[1]     owner token      ARGV[2]  time to live (ms)
-- ARGV[2+i]   '1': hold KEYS[i], '0': give it back if held
-- Returns a list of n integers: 1 where the caller holds KEYS[i] afterwards, 0 elsewhere.
local token, ttl = ARGV[1], ARGV[2]
local held = {}
for i, key in ipairs(KEYS) do
  held[i] = 0
  if ARGV[2 + i] == '1' then
    if redis.call('SET', key, token, 'NX', 'PX', ttl) then
      held[i] = 1
    elseif redis.call('GET', key) == token then
      redis.call('PEXPIRE', key, ttl)
      held[i] = 1
    end
  elseif redis.call('GET', key) == token then
    redis.call('DEL', key)
  end
end
return held
