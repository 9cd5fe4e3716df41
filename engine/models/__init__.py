"""Model sources and loaders: what to prefill (spec.py), where its weights come from (synthetic, Hugging Face
directories, GGUF files), the checks a stranger's file passes before it is read, memory estimates, and the cache
of converted models."""
