"""prefill-diff's commands: each parses its options, calls one function of the job package
``prefill_diff.jobs`` (``cache``: of ``engine/models/cache_listing.py``), renders the result.

The engine's modules import torch; they are imported only by the commands that run a side (through
``jobs``), so `--help`, `inspect` and `compare A.h5 B.h5` start without it.
"""
from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import signal
import sys
import textwrap
import time
from dataclasses import replace
from importlib import metadata

import click

from ..dumps import kernels, provenance
from ..dumps.inspect import summarize
from ..dumps.rank_merge import open_any  # a trace file, or a directory of rank traces (a tensor-parallel run)
from ..dumps.placement import completed_traces, n_completed, remove_partial_files
from ..engine.models import cache_listing  # light: no torch
from ..engine.shared.errors import INTERRUPT, PrefillDiffError
from ..engine.shared.untrusted import visible
from ..verify.formats.text import plain, print_line
from ..verify.wording import count
from .. import jobs
from .display import Progress, console, quiet_libraries
from .options import (ENVIRONMENT, LEVEL_CHOICE, GroupedCommand, calibration_options, model_cache_option,
                      model_options, report_options, tolerance_options)
from .outputs import (EXIT_BAD_INPUT, EXIT_INTERNAL, check_out_dir, check_output_file, check_outputs, emit,
                      write_text)
from .render import (cache_json_item, cache_notes, cache_table, cache_where, ledger_renderable, print_inspect,
                     pruned_lines)
from .terminal import (flush_stdout, reset_closed_stdout_status, silence_stdout, status_if_stdout_closes,
                       text_streams)


class BadInput(click.ClickException):
    exit_code = EXIT_BAD_INPUT


class Cli(click.Group):
    """Turns library errors into one clear line and exit status 2, in one place; every command's text (reports,
    machine output, error lines) goes through ``terminal.TextOut``."""
    command_class = GroupedCommand  # --help lists the shared options in sections

    def main(self, *args, **kwargs):
        with text_streams():
            return super().main(*args, **kwargs)

    def invoke(self, ctx):
        reset_closed_stdout_status()
        try:
            result = self._invoke(ctx)
        except SystemExit as e:  # sys.exit(verdict): what is still buffered is flushed under the same status
            if not flush_stdout():
                ctx.exit(status_if_stdout_closes())
            raise e
        if not flush_stdout():
            ctx.exit(status_if_stdout_closes())
        return result

    def _invoke(self, ctx):
        done_before = n_completed()
        try:
            result = super().invoke(ctx)
            if INTERRUPT["seen"]:  # the KeyboardInterrupt was swallowed (a GC callback) after the work was done
                raise KeyboardInterrupt
            return result
        except PrefillDiffError as e:
            raise BadInput(visible(str(e))) from None
        except KeyboardInterrupt:  # Ctrl-C (SIGINT) or SIGTERM: exit 128 + the signal's number (130, 143)
            n = len(remove_partial_files())
            done = completed_traces(done_before)  # this command's, not earlier ones' in the same process
            said = []
            if n:
                said.append(f"the trace being written was not kept ({n} partial file{'' if n == 1 else 's'} removed)")
            if done:
                said.append(f"complete trace{'' if len(done) == 1 else 's'} kept: {visible(', '.join(done))}")
            if not said:
                said.append("no trace was being written")
            signum = INTERRUPT.get("signal") or 2
            name = {2: "interrupted (Ctrl-C)", 15: "terminated (SIGTERM)"}.get(signum, f"stopped by signal {signum}")
            click.echo(f"{name}; " + "; ".join(said), err=True)
            ctx.exit(128 + signum)
        except click.ClickException as e:  # its message may quote a foreign value (a file name, an option)
            e.message = visible(e.message)
            raise
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except MemoryError:
            raise BadInput("not enough memory for this model and input on this machine "
                           "(a smaller model, fewer or shorter prompts, or a lower --level)") from None
        except BrokenPipeError:  # the reader of stdout went away (`| head -1`): write nothing more; the status
            silence_stdout()     # is the verdict's once it is known (a closed pipe never changes it), else 0
            ctx.exit(status_if_stdout_closes())
        except Exception as e:  # a bug, not bad input; or the environment refused (memory, disk)
            said = environment_failure(e)
            if said is not None:
                raise BadInput(visible(said)) from None
            if os.environ.get("PREFILL_DIFF_DEBUG"):
                raise
            click.echo(f"internal error: {type(e).__name__}: {visible(e)} (set PREFILL_DIFF_DEBUG=1 for the "
                       "traceback)", err=True)
            ctx.exit(EXIT_INTERNAL)


# torch's words when an allocation fails: its CPU allocator, a size that overflows, CUDA's out of memory
_ALLOCATION = ("can't allocate memory", "Storage size calculation overflowed", "DefaultCPUAllocator",
               "out of memory", "not enough memory")


def environment_failure(e: BaseException) -> str | None:
    """One line for an error the environment caused (an allocation refused, a full disk, a file system that is
    read-only), naming what was refused; None for anything else (a bug)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, RuntimeError) and any(w in text for w in _ALLOCATION):
        return (f"not enough memory: an allocation was refused ({text[:300]}); a smaller model, fewer or shorter "
                "prompts, or a lower --level")
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG):
        where = f" writing {e.filename!r}" if e.filename else " (standard output, or a file being written)"
        return f"the file system refused the write{where}: {e.strerror or text} (errno {e.errno})"
    return None


def _version(ctx, param, value) -> None:
    """--version: torch's version is read from its installed metadata (importing torch takes seconds)."""
    if not value or ctx.resilient_parsing:
        return
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    click.echo(f"prefill-diff, version {provenance.version()}\n{kernels.describe()}\n"
               f"torch {torch_version}, Python {platform.python_version()}")
    ctx.exit()


@click.group(cls=Cli, epilog=ENVIRONMENT,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show the versions of prefill-diff, its compiled kernels, torch and Python, and exit.")
def cli():
    """Layer-by-layer verification of LLM prefill.

    Runs a reference and a candidate prefill, records every layer's residual stream,
    KV cache lengths and positions and the first-step logits to HDF5, and names the
    first layer that breaks tolerance, and how.

    Exit status: 0 within tolerance, 1 tolerance broken, 2 bad usage or bad input
    (including two traces that cannot be compared), 3 internal error (a bug),
    130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
    """


@cli.command()
@click.argument("ref")
@click.argument("cand")
@model_options
@tolerance_options
@report_options
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Keep the two traces in DIR as ref.h5 and cand.h5 (default: a temporary directory).")
@click.option("--level", type=LEVEL_CHOICE, default="full", show_default=True,
              help="Trace level for both sides (ops: full, plus each op's output inside every layer).")
@click.option("--force", is_flag=True, help="Overwrite traces already in --out.")
@click.option("--fail-fast", is_flag=True,
              help="Run both sides in lockstep, layer by layer, in memory; stop at the first break (no trace files).")
@click.option("--replay-ops", is_flag=True,
              help="After both runs, feed each of the candidate's ops the reference's input to it and compare bit "
                   "for bit: says which op differs itself and which only inherits a difference, with the cause "
                   "where it is known. Implies --exact and --level ops.")
@calibration_options
def run(ref, cand, what, tol, out, out_dir, level, force, fail_fast, replay_ops, judging):
    """Prefill REF and CAND, record both traces, compare them, report.

    REF and CAND are presets (see `prefill-diff presets`) or TOML config files. The model
    and prompts are shared by both sides unless a config file sets its own.

    \b
    Example:
        prefill-diff run reference batched-left
        prefill-diff run reference fault:unmasked-padding --json report.json
        prefill-diff run reference sdpa --calibrate
        prefill-diff run reference bf16
        prefill-diff run reference fault:gqa-mapping --fail-fast
    """
    check_outputs(out)
    quiet_libraries(out.verbose)
    spec, inputs = what.resolve()
    if fail_fast and out_dir:
        raise BadInput("--fail-fast keeps no traces; drop --out")
    if replay_ops:
        if fail_fast:
            raise BadInput("--replay-ops replays from the recorded traces; drop --fail-fast")
        if level not in ("full", "ops"):
            raise BadInput(f"--replay-ops records op-level states: it needs --level ops (got --level {level})")
        level, judging = "ops", replace(judging, exact=True, calibrate=False, replay_ops=True)
    check_out_dir(out_dir)
    with Progress(out.quiet) as prog:
        if fail_fast:
            prog.step("loading the model, running the sides layer by layer")
        outcome = jobs.run(ref, cand, spec, inputs, out_dir=out_dir, level=level, force=force,
                           judging=replace(judging, tolerance=tol, fail_fast=fail_fast),
                           progress=None if fail_fast else prog.sides())
    sys.exit(emit(outcome.report, out, console(), outcome.not_reached,
                  preface=f"traces: {outcome.ref_path} {outcome.cand_path}" if outcome.ref_path else None))


@cli.command()
@click.argument("config")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Trace file to write.")
@click.option("--level", type=LEVEL_CHOICE, default="full", show_default=True,
              help="full: every tensor; sampled: a declared subset plus statistics; stats: statistics only; ops: "
                   "full, plus each op's output inside every layer (the input norm, Q/K/V, rotary, attention core, "
                   "projections, MLP; docs/trace-format.md).")
@click.option("--compression", type=click.Choice(["none", "gzip"]), default="none", show_default=True,
              help="gzip (with shuffle) makes smaller files that every HDF5 tool reads.")
@click.option("--force", is_flag=True, help="Overwrite an existing trace.")
@click.option("--twin-of", "twin_of", default=None, metavar="PRECISION",
              help="Also record this trace's float64 golden (OUTPUT's stem + .golden.h5) and its twin at the "
                   "precisions of PRECISION, a preset or config (stem + .twin-KEY.h5), so that `compare` of this "
                   "baseline against a candidate of those precisions is calibrated.")
@click.option("-q", "--quiet", is_flag=True,
              help="No progress on stderr (by default a terminal shows a display, a pipe or file gets one line per "
                   "phase).")
@model_options
@tolerance_options
def record(config, output, level, compression, force, twin_of, quiet, what, tol):
    """Prefill CONFIG (a preset or TOML file) and write its trace to OUTPUT.

    The file appears only when complete: it is written under a temporary name and
    renamed at the end, so an interrupted run leaves nothing a reader would accept.
    Tolerance options are stored in the trace: `compare` uses them when this trace is
    the baseline and no tolerance is given on its command line.

    \b
    Example:
        prefill-diff record reference -o ref.h5
        prefill-diff record batched-left -o cand.h5 --level stats --compression gzip
        prefill-diff record reference -o base.h5 --twin-of bf16
    """
    if os.path.exists(output) and not force:  # found before the model loads
        raise BadInput(f"{output} exists; pass --force to overwrite it")
    quiet_libraries()
    jobs.check_tolerance(tol)  # a bad declaration (or an unreadable --tolerance file) before anything else
    check_output_file(output, "the trace", force=force)
    spec, inputs = what.resolve()
    con = console()

    def wrote(done: jobs.Recorded) -> None:  # the trace is complete: said before any golden and twin run
        print_line(con, plain(f"wrote {done.path} ({level}, {count(done.n_layers, 'layer')}, "
                              f"{count(done.n_samples, 'sample')})"))
    with Progress(quiet) as prog:
        done = jobs.record(config, output, spec, inputs, level=level, compression=compression, force=force,
                           tolerance=tol, twin_of=twin_of, progress=prog.sides(),
                           on_written=wrote)
    if done.golden is not None:
        print_line(con, plain(f"wrote {done.golden} (float64 golden)" + ("" if done.twin is None else
                                                                     f" and {done.twin} (twin in {done.twin_label})")))


@cli.command()
@click.argument("baseline", type=click.Path())
@click.argument("candidate")
@tolerance_options
@report_options
@model_options
@click.option("--fail-fast", is_flag=True, help="Stop at the first layer that breaks.")
@calibration_options
def compare(baseline, candidate, tol, out, what, fail_fast, judging):
    """Compare BASELINE.h5 with CANDIDATE (a trace, or a preset/config that is recorded first).

    --model, --prompt and --tokens apply only when CANDIDATE is recorded now; with two traces
    they are refused.

    \b
    Example:
        prefill-diff compare ref.h5 cand.h5 --json report.json --junit report.xml
        prefill-diff compare baseline.h5 batched-left
    """
    check_outputs(out)
    two_traces = jobs.is_trace(candidate)
    given = what.given()
    if two_traces and given:
        verb = "does" if len(given) == 1 else "do"
        raise BadInput(f"{' and '.join(given)} {verb} not apply when comparing two traces ({candidate} is a "
                       "trace file: its model and prompts are recorded in it); drop them")
    quiet_libraries(out.verbose)
    spec, inputs = what.resolve()
    with Progress(out.quiet) as prog:
        outcome = jobs.compare(baseline, candidate, spec, inputs,
                               judging=replace(judging, tolerance=tol, fail_fast=fail_fast), progress=prog.sides())
    sys.exit(emit(outcome.report, out, console(), outcome.not_reached))


@cli.command()
@click.argument("config", required=False)
@model_options
def ledger(config, what):
    """Print the shape ledger of contract §2.8 for CONFIG's model and inputs (one table per prefill call).

    With no CONFIG (and no --model) it shows the seed's table: model seed-2.8, one 12-token
    prompt (cache total 192 scalars). With CONFIG the model is the config's, else --model,
    else synthetic. Shapes are measured from a real prefill; a chunked config shows each
    chunk's call.

    \b
    Example:
        prefill-diff ledger
        prefill-diff ledger batched-left --model synthetic
    """
    quiet_libraries()
    spec, inputs = what.resolve()  # a bad --model or --tokens is said before torch is imported
    from ..engine.config import Inputs, load_side  # the engine (torch): imported only by commands that run it
    from ..engine.prepared import default_token_ids, prepare
    from ..engine.models.spec import ModelSpec
    from ..engine.registry import having
    if config is None:
        spec = spec or ModelSpec("seed-2.8")
        if inputs is None and spec.source == "seed-2.8":
            inputs = Inputs(token_ids=default_token_ids(20, (12,)))
    side = load_side(config or "reference", spec, inputs)
    if not side.run.info.ledger:
        raise BadInput(f"{config}: the shape ledger is measured by {having('ledger')}, and {config} runs "
                       f"{side.run.info.words}: give a preset or config of {having('ledger')}")
    prep = prepare(side)
    ledgers = prep.side.run.info.load().ledger(prep)  # measured by the side's engine (ours: engine/native/ledger.py)
    console().print(ledger_renderable(ledgers, prep.snapshot.source, prep.side.run.chunk_size))


@cli.command()
@click.argument("trace", type=click.Path())
@click.option("--layer", type=int, default=None, help="Only this layer.")
@click.option("--tensor", default=None, metavar="NAME",
              help="Only this tensor: layer_input, attn_update, attn_heads, mid, mlp_update, layer_output, "
                   "cache_keys, cache_values; or a final-stage tensor: logits, norm_last; or, in a trace recorded "
                   "at --level ops, an op: q, k, v, q_rope, attn_core, gate, ... (docs/trace-format.md).")
@click.option("--sample", type=int, default=None,
              help="Only this sample (with --layer and --tensor, or with --tensor logits|norm_last: its values).")
@click.option("--position", type=int, default=None, help="With --sample: only this token position's values.")
@click.option("--channel", default=None, metavar="C",
              help="Which channels' values to show: 37, 30-40 or 1,5,9 (default: the first 8).")
@click.option("--json", "json_path", default=None, is_flag=False, flag_value="-", metavar="FILE",
              help="Write the summary as JSON to FILE ('-' or no FILE: stdout).")
def inspect(trace, layer, tensor, sample, position, channel, json_path):
    """Summarise TRACE: model, run, inputs, per-layer statistics and finite counts, final top ids.

    Works on traces of every level, from the statistics each trace carries, and says what a
    level does not keep. Values: full traces hold every tensor; sampled traces a declared
    subset of positions and channels; stats traces only the final logits and norm_last.

    \b
    Example:
        prefill-diff inspect ref.h5
        prefill-diff inspect ref.h5 --layer 2 --tensor mlp_update --sample 1 --channel 30-37
        prefill-diff inspect ref.h5 --tensor logits --sample 0
    """
    if json_path not in (None, "-") and (json_path.endswith((".h5", ".hdf5")) or os.path.abspath(json_path) ==
                                         os.path.abspath(trace)):
        raise BadInput(f"--json {json_path}: a JSON summary is not written over a trace file (give a .json name)")
    with open_any(trace) as t:
        summary = summarize(t, layer, tensor, sample, position, channel)
    if json_path is not None:
        text = json.dumps(summary, indent=2, default=str)
        if json_path == "-":
            click.echo(text)
        else:
            write_text(json_path, text + "\n")
        return
    print_inspect(console(), summary)


@cli.command()
def presets():
    """List the built-in presets (execution paths), one line each.

    \b
    Example:
        prefill-diff presets
    """
    from ..engine.presets import PRESETS  # plain data: no torch
    width = max(len(name) for name in PRESETS)
    cols = shutil.get_terminal_size((0, 0)).columns if sys.stdout.isatty() else 0
    for name, (desc, _) in PRESETS.items():
        if cols and cols > width + 22:  # a terminal: wrap at word boundaries under the description
            click.echo(textwrap.fill(desc, cols - 1, initial_indent=f"{name:<{width}}  ",
                                     subsequent_indent=" " * (width + 2), break_long_words=False,
                                     break_on_hyphens=False))
        else:  # not a terminal: one plain line per preset, easy to grep
            click.echo(f"{name:<{width}}  {desc}")


@cli.command("vllm-setup")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--pip-arg", "pip_args", multiple=True, metavar="ARG",
              help="Pass ARG to pip (repeatable), e.g. --pip-arg=--extra-index-url=https://download.pytorch.org/"
                   "whl/cpu where the CPU build of torch is not on your package index.")
def vllm_setup(directory, pip_args):
    """Make a virtual environment in DIRECTORY that runs the vllm engine (vLLM's CPU build).

    About 2 minutes and 3.4 GB. vLLM runs in an environment of its own (it pins its own transformers and
    changes process-wide state when imported); prefill-diff finds it through [run.vllm] python or the
    PREFILL_DIFF_VLLM_PYTHON variable, which this command prints. An environment that already has vLLM is
    left as it is.

    \b
    Example:
        prefill-diff vllm-setup .vllm-venv
        export PREFILL_DIFF_VLLM_PYTHON=$PWD/.vllm-venv/bin/python
        prefill-diff run vllm vllm-prefix-cache
    """
    from ..engine.foreign import vllm_env  # light: no torch, no vLLM
    python = vllm_env.setup(directory, pip_args, say=lambda s: click.echo(s, err=True))
    click.echo(f"export PREFILL_DIFF_VLLM_PYTHON={python}")


_CACHE_JSON = click.option("--json", "as_json", is_flag=True, help="Print the same as JSON on stdout.")


@cli.group(invoke_without_command=True)
@model_cache_option
@_CACHE_JSON
@click.pass_context
def cache(ctx, as_json):
    """List the converted-model cache (or `cache list`): one line per entry with its kind, the file it was
    converted from, its size on disk, when it was last used, and whether it verifies (intact, damaged, stale);
    temporary directories of conversions (writing, or abandoned by one that no longer runs); a total.

    Every entry is verified as a run would verify it (its files' sizes and sha256), which reads the whole
    cache. `cache prune` removes entries.

    \b
    Example:
        prefill-diff cache
        prefill-diff cache --json --model-cache /data/prefill-diff-cache
        prefill-diff cache prune --dry-run
        prefill-diff cache prune --older-than 30 --max-size 2G
    """
    ctx.meta["cache_json"] = as_json  # `cache --json prune` as `cache prune --json`
    if ctx.invoked_subcommand is None:
        _print_cache(as_json)


@cache.command("list")
@model_cache_option
@_CACHE_JSON
def cache_list(as_json):
    """List the converted-model cache's entries, sizes and states (the same as `prefill-diff cache`).

    \b
    Example:
        prefill-diff cache list
        prefill-diff cache list --json
    """
    _print_cache(as_json or click.get_current_context().meta.get("cache_json"))


def _print_cache(as_json: bool) -> None:
    now = time.time()
    found = cache_listing.listing(now)
    if as_json:
        click.echo(json.dumps({"cache": found.root, "models": found.models, "total": found.total,
                               "items": [cache_json_item(i) for i in found.items]}, indent=2))
        return
    con = console()
    con.print(cache_where(found), soft_wrap=True)
    if found.items:
        table, _ = cache_table(found, now, con.width)
        con.print(table)
        for line in cache_notes(found):
            con.print(line, soft_wrap=True)


@cache.command("prune")
@model_cache_option
@click.option("--all", "everything", is_flag=True, help="Remove every entry.")
@click.option("--older-than", type=float, default=None, metavar="DAYS",
              help="Remove the entries not used for more than DAYS days.")
@click.option("--max-size", default=None, metavar="SIZE",
              help="Remove the least recently used entries until the cache holds at most SIZE: 500M, 2G, 2GiB "
                   "(powers of 1024) or 2GB (powers of 1000).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@_CACHE_JSON
def cache_prune(everything, older_than, max_size, dry_run, as_json):
    """Remove damaged and stale entries, and temporary directories whose conversion no longer runs; with
    --all, --older-than or --max-size, intact entries too.

    Removes only what is inside the cache's own models/ directory, never following a link. It never removes
    another user's files, an entry a run is loading, a temporary directory whose conversion is running, or
    anything prefill-diff did not make: those are listed as kept, with the reason.

    \b
    Example:
        prefill-diff cache prune
        prefill-diff cache prune --older-than 30
        prefill-diff cache prune --max-size 2G --dry-run
        prefill-diff cache prune --all
    """
    if everything and (older_than is not None or max_size is not None):
        raise BadInput("--all removes every entry: drop --older-than and --max-size")
    limit = None if max_size is None else cache_listing.parse_size(max_size)
    pruned = cache_listing.prune(everything=everything, older_than=older_than, max_size=limit, dry_run=dry_run)
    if as_json or click.get_current_context().meta.get("cache_json"):
        click.echo(json.dumps({
            "cache": pruned.found.root, "dry_run": dry_run, "freed": pruned.freed, "left": pruned.left,
            "removed": [cache_json_item(d.item, d.why) for d in pruned.decisions if d.removed],
            "kept": [cache_json_item(d.item, d.why) for d in pruned.decisions if not d.removed]}, indent=2))
        return
    if pruned.found.root is None:
        click.echo("the model cache is off (--model-cache off or PREFILL_DIFF_CACHE=off): nothing to prune")
        return
    con = console()
    for line in pruned_lines(pruned, limit):
        con.print(line, soft_wrap=True)


@cli.command()
@click.argument("name", required=False)
def docs(name):
    """List the documents installed with prefill-diff and where they are, or print document NAME.

    Hints and notes cite them, e.g. contract.md §2.11 (the table of faults and the
    layer where each first shows): `prefill-diff docs contract` prints it.

    \b
    Example:
        prefill-diff docs
        prefill-diff docs contract
    """
    from .docs import find, installed, title
    if name is not None:
        click.echo(find(name).read_text(encoding="utf-8"), nl=False)
        return
    found = installed()
    width = max(map(len, found), default=0)
    for stem, path in found.items():
        click.echo(f"{stem:<{width}}  {path}  {title(path)}")


def _on_signal(signum, frame):
    INTERRUPT["seen"] = True
    INTERRUPT["signal"] = signum
    raise KeyboardInterrupt


def _unraisable(hook):
    """A KeyboardInterrupt raised by the signal handler inside a callback Python cannot propagate from (a weakref
    or GC callback) is not printed as an "Exception ignored" traceback: INTERRUPT records it, and the command
    ends as interrupted once its work returns (Cli.invoke). Anything else is reported as before."""
    def report(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and INTERRUPT["seen"]:
            return
        hook(unraisable)
    return report


def main():
    try:  # torch's libraries fail to load (oneMKL aborts with a FATAL ERROR) from a deleted working directory
        os.getcwd()
    except OSError:
        click.echo("Error: the working directory no longer exists (it was deleted or moved away): cd to one that "
                   "does, then run again", err=True)
        sys.exit(EXIT_BAD_INPUT)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)  # timeout, kill and CI cancellation: cleaned up like Ctrl-C
    sys.unraisablehook = _unraisable(sys.unraisablehook)
    cli(prog_name="prefill-diff")


if __name__ == "__main__":
    main()
