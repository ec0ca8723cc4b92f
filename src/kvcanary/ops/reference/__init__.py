"""Vectorised torch twins of the ops (CPU and any torch device)."""
