"""The shared leaf of every package: it imports nothing of ours and nothing heavy, so the engine, the trace
format, the verdict and the CLI may all import it (tests/test_layering.py).

errors: the named exceptions (exit status 2) and the interrupt flag; untrusted: text and files from strangers;
precisions: every precision's name, declared once.
"""
