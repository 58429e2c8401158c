-- mark_published: the terminal event of a batch is out; drop what served it and close its progress.
--
-- KEYS[1]  the batch hash      KEYS[2]  <p>:unpublished      KEYS[3]  <p>:progress:<id>
-- ARGV[1]  batch id            ARGV[2]  the terminal event id      ARGV[3]  now (unix s)
-- ARGV[4]  finished TTL (s)    ARGV[5]  terminal states (comma-separated)
-- Returns ok | conflict | missing.
local cur = redis.call('HMGET', KEYS[1], 'state', 'terminal_event_id')
if not cur[1] then redis.call('ZREM', KEYS[2], ARGV[1]); return 'missing' end
if not is_terminal(cur[1]) or cur[2] ~= ARGV[2] then return 'conflict' end
redis.call('HSET', KEYS[1], 'published', '1', 'published_at', ARGV[3])
-- the request body and the original record served launches and the dead letter: both are done
redis.call('HDEL', KEYS[1], 'request', 'origin')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
-- closed: an attempt still running (a stop that did not take) may write nothing more for this
-- lifecycle, neither progress nor shards nor a manifest (ray_job/write_progress.lua)
redis.call('HSET', KEYS[3], 'closed', ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[4])
return 'ok'
