"""The dispatcher's domain, pure: batch states and their transitions, Redis key names, the batch record,
dead letters, result events with stable ids, scheduling scores, retry policy, coalescing.
"""
