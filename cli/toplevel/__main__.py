"""`python -m prefill_diff`: the prefill-diff command. This directory is the package prefill_diff itself (see
pyproject.toml's package-dir); it holds no other module, so prefill_diff stays a namespace over cli, engine,
dumps, verify and docs."""
from prefill_diff.cli.main import main

if __name__ == "__main__":
    main()
