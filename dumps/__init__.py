"""prefill-diff: dumps."""
