-- webhook_claim: take up to ARGV[3] due deliveries for one attempt each.
--
-- KEYS[1]  <p>:webhook:due
-- ARGV[1]  now (unix ms)   ARGV[2]  the lease (ms)   ARGV[3]  how many at most
-- Each one taken is due again at now + lease (another replica tries it if this one dies mid-attempt);
-- that score is the claim's token: webhook_settle applies only while the score still holds it.
-- Returns a flat list: id, token, id, token, ...
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local token = tonumber(ARGV[1]) + tonumber(ARGV[2])
local out = {}
for _, id in ipairs(due) do
  redis.call('ZADD', KEYS[1], token, id)
  out[#out + 1] = id
  out[#out + 1] = tostring(token)
end
return out
