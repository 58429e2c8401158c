"""The batches' state in Redis: the store (every transition one Lua compare-and-set, each script a file of
lua/ with its KEYS/ARGV header), its index reads and its upkeep.
"""
