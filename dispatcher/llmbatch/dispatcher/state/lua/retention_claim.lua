-- retention_claim: take up to ARGV[3] expired things for the collector, one at a time each.
--
-- KEYS[1]  <p>:retention:queue
-- ARGV[1]  now (unix s)   ARGV[2]  the lease (s)   ARGV[3]  how many at most
-- Each one taken is due again in the queue at now + lease (another replica takes it over if this one
-- dies mid-way); that score is the claim's token: retention_settle and retention_retire act only while
-- the score still holds it. <p>:retention:due (what reads show) keeps the time it expires.
-- Returns a flat list: member, token, member, token, ...
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local token = tostring(tonumber(ARGV[1]) + tonumber(ARGV[2]))
local out = {}
for _, member in ipairs(due) do
  redis.call('ZADD', KEYS[1], token, member)
  out[#out + 1] = member
  out[#out + 1] = token
end
return out
