"""The two stages: precompute (stage one) and train (stage two). Neither imports the other."""
