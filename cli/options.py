"""Shared options as decorators, so every command spells them the same way."""
from __future__ import annotations

import click

LEVEL_CHOICE = click.Choice(["full", "sampled", "stats"])


def _compose(*decorators):
    def apply(f):
        for d in reversed(decorators):
            f = d(f)
        return f
    return apply


def _memory_check(ctx, param, value):
    from ..engine import budget  # light: no torch
    budget.CHECK["enabled"] = not value
    return value


def model_options(f):
    """--model, --prompt, --tokens: *what* to prefill, shared by both sides unless a config sets its own."""
    return _compose(
        click.option("--ignore-memory-estimate", is_flag=True, expose_value=False, callback=_memory_check,
                     help="Build the model even if its estimated memory exceeds what this machine has available."),
        click.option("--model", "model", default=None, metavar="SOURCE",
                     help="synthetic (default), seed-2.8, hf:DIR, gguf:FILE or smollm2."),
        click.option("--prompt", "prompts", multiple=True, metavar="TEXT",
                     help="A text prompt (repeatable); needs a model with a tokenizer."),
        click.option("--tokens", "tokens", multiple=True, metavar="IDS",
                     help="A prompt as comma-separated token ids (repeatable), e.g. --tokens 5,6,7."),
    )(f)


def tolerance_options(f):
    """--policy, --atol, --rtol, --ntol, --row-rtol, --tolerance: the declared tolerance, as one ``tol`` dict.

    An element passes when |cand - ref| <= atol + rtol·|ref| + ntol·rms(ref row), or when its whole
    row is within row_rtol relative L2 error.
    """
    import functools

    @functools.wraps(f)
    def collect(*args, policy, atol, rtol, ntol, row_rtol, tolerance_file, **kw):
        return f(*args, tol=dict(policy=policy, atol=atol, rtol=rtol, ntol=ntol, row_rtol=row_rtol,
                                 tolerance_file=tolerance_file), **kw)
    return _compose(
        click.option("--policy", default=None, metavar="DTYPE",
                     help="Tolerance policy by dtype: float64, float32, bfloat16, float16, int8 "
                          "(default: the coarser dtype of the two sides)."),
        click.option("--atol", type=float, default=None, help="Absolute tolerance for every tensor kind."),
        click.option("--rtol", type=float, default=None, help="Relative tolerance for every tensor kind."),
        click.option("--ntol", type=float, default=None,
                     help="Tolerance in units of the RMS of the reference vector at each position."),
        click.option("--row-rtol", type=float, default=None,
                     help="Accept a whole row (one position's vector) within this relative L2 error (0: off)."),
        click.option("--tolerance", "tolerance_file", type=click.Path(dir_okay=False), default=None,
                     help="TOML policy file: [residual] atol=..., rtol=..., ntol=...; kinds: residual, "
                          "attn_update, mlp_update, cache_keys, cache_values, logits."),
    )(collect)


def report_options(f):
    """--json, --junit, --quiet: where the verdict goes besides the terminal."""
    return _compose(
        click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), default=None,
                     help="Write the JSON report to FILE ('-' for stdout)."),
        click.option("--junit", "junit_path", type=click.Path(dir_okay=False), default=None,
                     help="Write a JUnit XML report to FILE (one test case per layer and final check)."),
        click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
                     help="Write a PNG of max abs error per layer and sub-layer (needs matplotlib)."),
        click.option("-q", "--quiet", is_flag=True, help="Print only the verdict line."),
    )(f)
