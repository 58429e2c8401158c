"""llmbatch/stack."""
