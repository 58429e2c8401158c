-- common: helpers prepended to the scripts that use them (transition, mark_published,
-- mark_dlt_written). is_terminal reads the terminal states from the script's LAST argument
-- (a comma-separated list), so every script using it passes that list last.
local function is_terminal(s)
  for t in string.gmatch(ARGV[#ARGV], '[^,]+') do if t == s then return true end end
  return false
end
local function hset_map(key, map)
  local flat = {}
  for k, v in pairs(map) do flat[#flat + 1] = k; flat[#flat + 1] = tostring(v) end
  if #flat > 0 then redis.call('HSET', key, unpack(flat)) end
end
