"""Shared options as decorators, so every command spells them the same way."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import click

from ..engine.config import Inputs, check_model_source  # plain data: no torch
from ..engine.models import budget
from ..engine.shared.errors import ConfigError
from ..engine.shared.untrusted import check_int64
from ..engine.models.spec import ModelSpec
from ..engine.models.args import MODEL_PRESETS
from ..dumps.schema import RECORD_LEVELS, TOL_KINDS
from ..verify.tolerance import DTYPE_DEFAULTS, POLICY_ALIASES
from ..jobs import Judging, Tolerance
from .outputs import Reports

LEVEL_CHOICE = click.Choice(list(RECORD_LEVELS))

# The top-level --help's epilog: every environment variable the commands read (a test greps the code for them).
ENVIRONMENT = """\b
Environment variables:
  PREFILL_DIFF_CACHE   where converted GGUF models are kept, as --model-cache
                       (default $XDG_CACHE_HOME/prefill-diff, else
                       ~/.cache/prefill-diff; off: nowhere)
  XDG_CACHE_HOME       see PREFILL_DIFF_CACHE
  PREFILL_DIFF_NATIVE  0: do not use the compiled kernels (see --version)
  PREFILL_DIFF_MMAP    0: read traces without memory-mapping them
  PREFILL_DIFF_DEBUG   1: an internal error (exit 3) prints its traceback
  PREFILL_DIFF_VLLM_PYTHON the Python of the environment the vllm engine
                       runs in, unless [run.vllm] python names one
                       (prefill-diff vllm-setup makes one)
  COLUMNS              the report's width when stdout is not a terminal
                       (default 120)
  NO_COLOR             no colour in the report
  SOURCE_DATE_EPOCH    the time traces and JSON reports record (seconds since
                       1970-01-01 UTC, as reproducible builds set it)
  GITHUB_STEP_SUMMARY  a file: run and compare append the Markdown report to it
  GITHUB_ACTIONS       true: an ::error line for a failed verdict
"""


def _compose(*decorators, section: str | None = None):
    """Apply ``decorators`` (click options) as one; ``section``: the --help heading their options are listed
    under (GroupedCommand)."""
    def apply(f):
        for d in reversed(decorators):
            f = d(f)
            if section is not None:
                f.__click_params__[-1].help_section = section
        return f
    return apply


class GroupedCommand(click.Command):
    """--help lists a command's own options first, then each shared group under its heading (Model and
    prompts, Tolerance, Reports, Calibration)."""

    def format_options(self, ctx, formatter):
        groups: dict[str, list] = {}
        for p in self.get_params(ctx):
            record = None if isinstance(p, click.Argument) else p.get_help_record(ctx)
            if record is not None:
                groups.setdefault(getattr(p, "help_section", "Options"), []).append(record)
        for title, records in sorted(groups.items(), key=lambda g: g[0] != "Options"):
            with formatter.section(title):
                formatter.write_dl(records)


def _memory_check(ctx, param, value):
    budget.CHECK["enabled"] = not value
    return value


def _model_cache(ctx, param, value):
    if value is not None:
        from ..engine.models import model_cache  # light: no torch
        model_cache.configure(value)
    return value


model_cache_option = click.option(
    "--model-cache", default=None, expose_value=False, callback=_model_cache, metavar="DIR|off",
    help="Where converted GGUF models are kept, so later runs skip parsing and dequantising (default: "
         "$PREFILL_DIFF_CACHE, else $XDG_CACHE_HOME/prefill-diff or ~/.cache/prefill-diff); off: convert every run.")


# --help's lists, made from the tables they name, so that a family or a policy added is listed
_FAMILIES = [name.split(":", 1)[1] for name in MODEL_PRESETS if name.startswith("synthetic:")]
_BUILT_IN = [name for name in MODEL_PRESETS if name != "synthetic" and ":" not in name]
MODEL_HELP = (f"The model to prefill: synthetic (default); synthetic:FAMILY at the same sizes, FAMILY one of "
              f"{', '.join(_FAMILIES)}; {', '.join(_BUILT_IN)}; hf:DIR, gguf:FILE or smollm2 (a config file's own "
              "[model] wins).")
POLICY_HELP = (f"Tolerance policy by precision: {', '.join(DTYPE_DEFAULTS)}, or an alias: {', '.join(POLICY_ALIASES)} "
               "(default: the coarser precision of the two traces compared).")


def model_options(f):
    """--model, --prompt, --tokens, --response, --response-ids: *what* to prefill (in run and compare, for both
    sides) unless a config sets its own, as one ``what`` (Prefilled)."""
    @functools.wraps(f)
    def collect(*args, model, prompts, tokens, responses, response_ids, response_tokens, first_layers, **kw):
        return f(*args, what=Prefilled(model, prompts, tokens, responses, response_ids, response_tokens, first_layers),
                 **kw)
    return _compose(
        click.option("--ignore-memory-estimate", is_flag=True, expose_value=False, callback=_memory_check,
                     help="Build the model even if its estimated memory exceeds what this machine has available."),
        click.option("--model", "model", default=None, metavar="SOURCE", help=MODEL_HELP),
        model_cache_option,
        click.option("--first-layers", "first_layers", type=int, default=None, metavar="N",
                     help="Run only the model's first N layers, the final norm and unembedding after layer N-1 (in "
                          "run and compare, for the reference and the candidate alike): a quick alignment of two "
                          "engines; the trace and the report's header say so."),
        click.option("--prompt", "prompts", multiple=True, metavar="TEXT",
                     help="A text prompt to prefill (repeatable; a config file's own [inputs] win); needs a "
                          "model with a tokenizer."),
        click.option("--tokens", "tokens", multiple=True, metavar="IDS",
                     help="A prompt as comma-separated token ids (repeatable), e.g. --tokens 5,6,7."),
        click.option("--response", "responses", multiple=True, metavar="TEXT",
                     help="A response after the prompt (repeatable: one per prompt, or one for all): prompt + "
                          "response is prefilled, or with [run] decode = true (preset decode) the response is "
                          "written token by token, and a comparison judges its log-probs."),
        click.option("--response-ids", "response_ids", multiple=True, metavar="IDS",
                     help="A response as comma-separated token ids (repeatable, as --response)."),
        click.option("--response-tokens", "response_tokens", type=int, default=None, metavar="N",
                     help="A response of N tokens chosen greedily after each prompt by the candidate (record: by "
                          "the configuration recorded); the reference replays exactly those tokens, and the traces "
                          "say who chose them."),
        section="Model and prompts",
    )(collect)


def tolerance_options(f):
    """--policy, --atol, --rtol, --ntol, --row-rtol, --tolerance: the declared tolerance, as one ``tol``
    (prefill_diff.jobs: Tolerance).

    An element passes when |cand - ref| <= atol + rtol·|ref| + ntol·rms(ref row), or when its whole
    row is within row_rtol relative L2 error.
    """
    @functools.wraps(f)
    def collect(*args, policy, atol, rtol, ntol, row_rtol, tolerance_file, **kw):
        return f(*args, tol=Tolerance(policy=policy, atol=atol, rtol=rtol, ntol=ntol, row_rtol=row_rtol,
                                      tolerance_file=tolerance_file), **kw)
    return _compose(
        click.option("--policy", default=None, metavar="DTYPE", help=POLICY_HELP),
        click.option("--atol", type=float, default=None, help="Absolute tolerance for every tensor kind."),
        click.option("--rtol", type=float, default=None, help="Relative tolerance for every tensor kind."),
        click.option("--ntol", type=float, default=None,
                     help="Tolerance in units of the RMS of the reference vector at each position."),
        click.option("--row-rtol", type=float, default=None,
                     help="Accept a whole row (one position's vector) within this relative L2 error (0: off)."),
        click.option("--tolerance", "tolerance_file", type=click.Path(dir_okay=False), default=None,
                     help=f"TOML policy file: [residual] atol=..., rtol=..., ntol=...; kinds: {', '.join(TOL_KINDS)}."),
        section="Tolerance",
    )(collect)


def report_options(f):
    """--json, --junit, --markdown, --plot, -q, -v, --layers, --strict: where the verdict goes and how much of it.

    They reach the command as one ``out`` (cli/outputs.py: Reports).
    """
    @functools.wraps(f)
    def collect(*args, json_path, junit_path, markdown_path, plot_path, quiet, verbose, layers, strict, **kw):
        return f(*args, out=Reports(json=json_path, junit=junit_path, markdown=markdown_path, plot=plot_path,
                                    quiet=quiet, verbose=verbose, layers=layers, strict=strict), **kw)
    return _compose(
        click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), default=None,
                     metavar="FILE", help="Write the JSON report to FILE ('-' for stdout)."),
        click.option("--junit", "junit_path", type=click.Path(dir_okay=False, allow_dash=True), default=None,
                     metavar="FILE",
                     help="Write a JUnit XML report to FILE ('-' for stdout; one test case per layer and final "
                          "check)."),
        click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, allow_dash=True), default=None,
                     metavar="FILE",
                     help="Write a Markdown summary to FILE ('-' for stdout): verdict, first break and hint, layer "
                          "table, final top ids, notes (a pull-request comment; $GITHUB_STEP_SUMMARY gets the same "
                          "on GitHub Actions)."),
        click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                     help="Write a PNG of the error per layer and sub-layer with the allowed error (needs "
                          "matplotlib)."),
        click.option("-q", "--quiet", is_flag=True, help="Print only the verdict line (no progress on stderr)."),
        click.option("-v", "--verbose", is_flag=True,
                     help="Also print every metric per tensor (mean abs, cosine, max rel, count out of tolerance, "
                          "worst element, would-pass values) for the failing layer, and the model loaders' own "
                          "progress bars and messages (transformers, gguf)."),
        click.option("--layers", type=click.Choice(["auto", "failing", "all"]), default="auto", show_default=True,
                     help="Rows of the layer table: all; only failing layers; auto: all up to 12 layers, else the "
                          "first break's neighbourhood and a summary."),
        click.option("--strict", is_flag=True,
                     help="Exit 1 when the verdict is INCONCLUSIVE (the injected fault cannot show), for gates."),
        section="Reports",
    )(collect)


def calibration_options(f):
    """--calibrate/--no-calibrate, --noise-factor, --allow-subset, --allow-identity-difference: how a candidate is
    held to the reference, as one ``judging`` (prefill_diff.jobs: Judging; its tolerance and fail_fast are the
    command's to add)."""
    @functools.wraps(f)
    def collect(*args, calibrate, factor, allow_subset, allow_identity, exact, **kw):
        if exact and calibrate:
            raise click.UsageError("--exact judges bits, not noise: drop --calibrate")
        return f(*args, judging=Judging(calibrate=False if exact else calibrate, factor=factor,
                                        allow_subset=allow_subset, allow_identity=allow_identity, exact=exact), **kw)
    return _compose(
        click.option("--calibrate/--no-calibrate", "calibrate", default=None,
                     help="Judge values against measured noise: also record the reference's path in float64 (the "
                          "golden) and at the candidate's precisions (the twin); each row of the candidate may "
                          "carry at most K times the twin's error. Default: on when either side computes below "
                          "float32 or their precisions differ, and no tolerance is given; --no-calibrate uses the "
                          "fixed per-dtype envelope.",
                     show_default=False),
        click.option("--noise-factor", "factor", type=float, default=4.0, show_default=True, metavar="K",
                     help="Calibrated comparisons: the candidate's row error may be at most K x the twin's."),
        click.option("--allow-subset", is_flag=True,
                     help="Compare only the reference samples the candidate has (the report says how many were "
                          "skipped); without it a reference sample with no counterpart is a failure."),
        click.option("--allow-identity-difference", "allow_identity", is_flag=True,
                     help="Compare two different models on purpose: a difference of weights, RoPE, norm, "
                          "activation, biases, tied embeddings or adapter is a note, not a failure."),
        click.option("--exact", is_flag=True,
                     help="Bit for bit: the verdict fails at the first tensor (layer state, cache, or op with "
                          "--level ops) whose bits part from the reference's, naming it, its layer, position and "
                          "decode step, the share of elements bitwise equal and the largest ULP distance; the "
                          "report lists per layer the first tensor where bits part. Needs full traces."),
        section="Calibration",
    )(collect)


def as_given(arg: str) -> str:
    """A command-line argument as the bytes the OS gave, read as UTF-8: under a C or POSIX locale without UTF-8
    mode Python decodes argv as ASCII, each byte above 127 a lone surrogate (surrogateescape), so valid UTF-8
    text arrives mangled. Bytes that are not UTF-8 stay escaped, each alone (and a prompt refuses them by
    byte offset)."""
    try:
        return os.fsencode(arg).decode("utf-8", "surrogateescape")
    except (UnicodeError, ValueError):
        return arg


@dataclass(frozen=True)
class Prefilled:
    """What --model, --prompt and --tokens ask to prefill, as given (``resolve()`` checks and builds it)."""
    model: str | None = None
    prompts: tuple = ()
    tokens: tuple = ()
    responses: tuple = ()
    response_ids: tuple = ()
    response_tokens: int | None = None
    first_layers: int | None = None

    def given(self) -> list[str]:
        """The options given, by name."""
        return [f for f, v in (("--model", self.model), ("--prompt", self.prompts), ("--tokens", self.tokens),
                               ("--response", self.responses), ("--response-ids", self.response_ids),
                               ("--response-tokens", self.response_tokens), ("--first-layers", self.first_layers)) if v]

    def resolve(self):
        """(ModelSpec or None, Inputs or None)."""
        return shared_inputs(self.model, self.prompts, self.tokens, self.responses, self.response_ids,
                             self.response_tokens, self.first_layers)


def shared_inputs(model, prompts, tokens, responses=(), response_ids=(), response_tokens=None,
                  first_layers=None):
    """--model/--prompt/--tokens/--response/--response-ids/--response-tokens -> (ModelSpec or None, Inputs or
    None)."""
    if not (model or prompts or tokens or responses or response_ids or response_tokens is not None
            or first_layers is not None):
        return None, None
    if model:
        check_model_source(model, "--model")
    spec = (ModelSpec(model or "synthetic", first_layers=first_layers) if model or first_layers is not None
            else None)
    if prompts and tokens:
        raise ConfigError("give --prompt or --tokens, not both")
    prompts = [as_given(p) for p in prompts]
    for i, p in enumerate(prompts):
        if not p.strip():
            raise ConfigError(f"--prompt number {i + 1} is empty (got {p!r}); give some text")
    if sum(map(bool, (responses, response_ids, response_tokens is not None))) > 1:
        raise ConfigError("give one of --response, --response-ids and --response-tokens")
    if response_tokens is not None and not 1 <= response_tokens <= 4096:
        raise ConfigError(f"--response-tokens must be from 1 to 4096 (got {response_tokens})")
    responses = [as_given(p) for p in responses]
    for i, p in enumerate(responses):
        if not p.strip():
            raise ConfigError(f"--response number {i + 1} is empty (got {p!r}); give some text")
    ids = [_ids(t, "--tokens") for t in tokens]
    inputs = Inputs(token_ids=tuple(ids)) if ids else Inputs(prompts=tuple(prompts)) if prompts else Inputs()
    if responses or response_ids or response_tokens:
        inputs = replace(inputs, response_texts=tuple(responses), response_tokens=response_tokens,
                         responses=tuple(_ids(t, "--response-ids") for t in response_ids) or None)
    return spec, (None if inputs == Inputs() else inputs)


def _ids(t: str, flag: str) -> tuple:
    """A comma-separated list of token ids, as --tokens and --response-ids take it."""
    parts = t.replace(" ", "").split(",")
    if parts and parts[-1] == "" and len(parts) > 1:
        parts = parts[:-1]  # one trailing comma, as in a pasted list
    row = []
    for i, x in enumerate(parts):
        if x == "":
            if len(parts) == 1:
                break
            raise ConfigError(f"{flag} {t!r}: id {i} is empty (two commas in a row, or a leading comma)")
        try:
            v = int(x)
        except ValueError:
            raise ConfigError(f"{flag} takes comma-separated integers (got {t!r}; id {i} is {x!r})") from None
        row.append(check_int64(v, f"{flag} {t!r}: id {i}"))
    if not row:
        raise ConfigError(f"{flag} needs at least one id (got {t!r})")
    return tuple(row)
