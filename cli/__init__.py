"""prefill-diff: cli."""
