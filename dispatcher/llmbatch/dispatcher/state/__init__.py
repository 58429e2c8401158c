"""The batches' state in Redis: the store (every transition one Lua compare-and-set, each script a file of
lua/ with its KEYS/ARGV header): intake, its record reads, transitions, index reads and upkeep.
"""
