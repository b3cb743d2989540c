"""checkpoint."""
