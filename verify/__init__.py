"""prefill-diff: verify."""
