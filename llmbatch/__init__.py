"""llmbatch."""
