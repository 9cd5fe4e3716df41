"""Engines we did not write, recorded through their own hooks: transformers, llama.cpp and vLLM (whose worker
runs in vLLM's own environment, as a script)."""
