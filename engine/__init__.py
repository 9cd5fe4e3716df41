"""prefill-diff: engine."""
