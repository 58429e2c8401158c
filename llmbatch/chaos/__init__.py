"""The chaos suite: a workload of batch requests, faults injected while it runs, and a verdict.

:mod:`llmbatch.chaos.verdict` decides (pure); the runner that sends the workload and injects the
faults sits above it.
"""
