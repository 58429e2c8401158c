"""Running batches (the leader's work): launching, tracking in flight, outcomes and results, finished jobs'
cleanup, keeping the engines deployed.
"""
