-- drop_orphans: remove the entries of one index whose batch does not belong there any more (its
-- hash is gone, or its state does not fit the index), each checked here, atomically, so an entry a
-- concurrent transition just made right is kept.
--
-- KEYS[1]     the index (sorted set)
-- KEYS[2..n]  the batch hashes of the entries to check, in ARGV[2..n]'s order
-- ARGV[1]     what the index holds: ready | delayed | deadlines | unpublished | state:<state>
-- ARGV[2..n-1] the entries (batch keys)
-- ARGV[n]     terminal states (comma-separated)
-- Every key it touches is declared in KEYS.
-- Returns the number of entries removed.
local kind, removed = ARGV[1], 0
for i = 2, #ARGV - 1 do
  local id, batch = ARGV[i], KEYS[i]
  local cur = redis.call('HMGET', batch, 'state', 'published')
  local state, orphan = cur[1], false
  if not state then
    orphan = true
  elseif kind == 'ready' or kind == 'delayed' then
    orphan = state ~= 'queued'
  elseif kind == 'deadlines' then
    orphan = is_terminal(state)
  elseif kind == 'unpublished' then
    -- a batch dead-lettered at intake was answered there: no terminal event goes out from here
    orphan = (not is_terminal(state)) or state == 'dead_lettered' or cur[2] == '1'
  elseif string.sub(kind, 1, 6) == 'state:' then
    orphan = state ~= string.sub(kind, 7)
  else
    return redis.error_reply('drop_orphans: unknown index kind ' .. kind)
  end
  if orphan then removed = removed + redis.call('ZREM', KEYS[1], id) end
end
return removed
