-- common: helpers prepended to the scripts that use them (intake, transition, mark_published,
-- mark_dlt_written). is_terminal reads the terminal states from the script's LAST argument
-- (a comma-separated list), so every script using it passes that list last. state_zsets maps each
-- state to its index zset, declared in KEYS from position `first` on, in the order of the state
-- names in `csv` (dispatcher/keys.py all_state_indexes): a script names no key KEYS does not hold.
local function is_terminal(s)
  for t in string.gmatch(ARGV[#ARGV], '[^,]+') do if t == s then return true end end
  return false
end
local function hset_map(key, map)
  local flat = {}
  for k, v in pairs(map) do flat[#flat + 1] = k; flat[#flat + 1] = tostring(v) end
  if #flat > 0 then redis.call('HSET', key, unpack(flat)) end
end
local function state_zsets(first, csv)
  local zsets, i = {}, first
  for s in string.gmatch(csv, '[^,]+') do zsets[s] = KEYS[i]; i = i + 1 end
  return setmetatable(zsets, {__index = function(_, s) error('no state index declared for ' .. tostring(s)) end})
end
