-- webhook_enqueue: queue one delivery per endpoint of a batch event, each once (by delivery id).
--
-- KEYS[1]  <p>:webhook:due
-- KEYS[2i], KEYS[2i+1]  delivery i's hash (<p>:webhook:delivery:<id>) and done marker
--                       (<p>:webhook:done:<id>), for i = 1..n
-- ARGV[1]  now (unix ms)
-- ARGV[2..] per delivery, 7 values: id, tenant, endpoint id, event id, webhook type, event time
--           (unix s), batch id
-- A delivery already queued, dead, or delivered (its done marker) is left alone: the results topic
-- read again after a restart queues nothing twice. Returns how many were queued.
local now, queued = ARGV[1], 0
local n = (#ARGV - 1) / 7
for i = 1, n do
  local a = 1 + (i - 1) * 7
  local hash, done = KEYS[2 * i], KEYS[2 * i + 1]
  if redis.call('EXISTS', hash) == 0 and redis.call('EXISTS', done) == 0 then
    redis.call('HSET', hash, 'id', ARGV[a + 1], 'tenant', ARGV[a + 2], 'endpoint', ARGV[a + 3],
      'event_id', ARGV[a + 4], 'type', ARGV[a + 5], 'created_at', ARGV[a + 6], 'batch_id', ARGV[a + 7],
      'attempts', 0, 'queued_at', now)
    redis.call('ZADD', KEYS[1], now, ARGV[a + 1])
    queued = queued + 1
  end
end
return queued
