-- mark_dlt_written: the late dead letter of a failed batch is written.
--
-- KEYS[1]  the batch hash
-- ARGV[1]  the terminal event id      ARGV[2]  now (unix s)      ARGV[3]  terminal states (csv)
-- Returns ok | conflict | missing.
local cur = redis.call('HMGET', KEYS[1], 'state', 'terminal_event_id')
if not cur[1] then return 'missing' end
if not is_terminal(cur[1]) or cur[2] ~= ARGV[1] then return 'conflict' end
redis.call('HSET', KEYS[1], 'dlt_written', '1', 'dlt_written_at', ARGV[2])
return 'ok'
