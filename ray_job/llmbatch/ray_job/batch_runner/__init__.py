"""The batch runner: the Serve application of the short path, which runs small batches in warm
replicas instead of a Ray job each (its runs, their store and its HTTP contract)."""
