"""Model-facing helpers that both stages share (no teacher loading here)."""
