"""prefill-diff: thin click commands over the library. Each command parses, calls one function, renders.

Heavy modules (torch, transformers) are imported inside commands, so `--help` and
`inspect` start fast.
"""
from __future__ import annotations

import os
import sys

import click

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


class BadInput(click.ClickException):
    exit_code = EXIT_BAD_INPUT


class Cli(click.Group):
    """Turns library errors into one clear line and exit status 2, in one place."""

    def invoke(self, ctx):
        from ..engine.errors import PrefillDiffError
        done_before = len(getattr(sys.modules.get("prefill_diff.dumps.recorder"), "_COMPLETED", ()))
        try:
            result = super().invoke(ctx)
            from ..engine.errors import INTERRUPT
            if INTERRUPT["seen"]:  # the KeyboardInterrupt was swallowed (a GC callback) after the work was done
                raise KeyboardInterrupt
            return result
        except PrefillDiffError as e:
            from ..engine.untrusted import visible
            raise BadInput(visible(str(e))) from None
        except KeyboardInterrupt:  # Ctrl-C (SIGINT) or SIGTERM: exit 128 + the signal's number (130, 143)
            from ..dumps.recorder import completed_traces, remove_partial_files
            from ..engine.errors import INTERRUPT
            from ..engine.untrusted import visible
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
            from ..engine.untrusted import visible
            e.message = visible(e.message)
            raise
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except MemoryError:
            raise BadInput("not enough memory for this model and input on this machine "
                           "(a smaller model, fewer or shorter prompts, or a lower --level)") from None
        except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as Unix tools do
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            ctx.exit(141)
        except Exception as e:  # a bug, not bad input
            if os.environ.get("PREFILL_DIFF_DEBUG"):
                raise
            from ..engine.untrusted import visible
            click.echo(f"internal error: {type(e).__name__}: {visible(e)} (set PREFILL_DIFF_DEBUG=1 for the "
                       "traceback)", err=True)
            ctx.exit(EXIT_INTERNAL)


def _console(stderr: bool = False):
    from rich.console import Console
    return Console(stderr=stderr, highlight=False)


def _shared(model, prompts, tokens):
    """--model/--prompt/--tokens -> (ModelSpec or None, Inputs or None)."""
    if not (model or prompts or tokens):
        return None, None  # and no engine import: comparing two trace files never loads torch
    from ..engine.config import Inputs
    from ..engine.errors import ConfigError
    from ..engine.snapshot import ModelSpec
    spec = ModelSpec(model) if model else None
    if prompts and tokens:
        raise ConfigError("give --prompt or --tokens, not both")
    from ..engine.untrusted import check_int64
    ids = []
    for t in tokens:
        parts = t.replace(" ", "").split(",")
        if parts and parts[-1] == "" and len(parts) > 1:
            parts = parts[:-1]  # one trailing comma, as in a pasted list
        row = []
        for i, x in enumerate(parts):
            if x == "":
                if len(parts) == 1:
                    break
                raise ConfigError(f"--tokens {t!r}: id {i} is empty (two commas in a row, or a leading comma)")
            try:
                v = int(x)
            except ValueError:
                raise ConfigError(f"--tokens takes comma-separated integers (got {t!r}; id {i} is {x!r})") from None
            row.append(check_int64(v, f"--tokens {t!r}: id {i}"))
        ids.append(tuple(row))
        if not ids[-1]:
            raise ConfigError(f"--tokens needs at least one id (got {t!r})")
    inputs = Inputs(token_ids=tuple(ids)) if ids else Inputs(prompts=tuple(prompts)) if prompts else None
    return spec, inputs


def _emit(report, json_path, junit_path, plot_path, quiet, token_text=None):
    """Write machine reports, print the human one, and exit with the verdict's status."""
    from ..verify.junit import to_junit
    if json_path == "-":
        click.echo(report.to_json())
    elif json_path:
        _write(json_path, report.to_json())
    if junit_path:
        _write(junit_path, to_junit(report))
    if plot_path:
        from ..verify.plot import plot_errors
        plot_errors(report, plot_path)
    if json_path != "-":
        from .render import report_renderable, verdict_text
        console = _console()
        console.print(verdict_text(report) if quiet else report_renderable(report, token_text))
    if report.first_break is not None and report.first_break.stage == "metadata":
        sys.exit(EXIT_BAD_INPUT)  # incomparable traces (SPEC §4): reported, but not a tolerance verdict
    sys.exit(EXIT_PASS if report else EXIT_FAIL)


def _write(path, text):
    from ..engine.errors import PrefillDiffError
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise PrefillDiffError(f"cannot write {path}: {e.strerror}") from None


PLOT_FORMATS = (".png", ".svg", ".pdf")


def _writable_dir(d: str, what: str) -> None:
    """d exists, is a directory, and a file can be created in it (probed: permissions, read-only mounts, /proc)."""
    import tempfile
    from ..engine.errors import PrefillDiffError
    if not os.path.isdir(d):
        raise PrefillDiffError(f"cannot write {what}: {d} is not a directory" if os.path.exists(d) else
                               f"cannot write {what}: directory {d} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".prefill-diff-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PrefillDiffError(f"cannot write {what}: directory {d} is not writable ({e.strerror})") from None


def _check_output_file(path, what: str, force: bool = True) -> None:
    """An output file can be written where it is asked for; checked before any work, so no verdict is lost."""
    from ..engine.errors import PrefillDiffError
    if path is None or path == "-":
        return
    path = str(path)
    if os.path.isdir(path):
        raise PrefillDiffError(f"cannot write {what} {path}: it is a directory")
    if os.path.exists(path):
        if not force:
            from ..dumps.recorder import TraceExistsError
            raise TraceExistsError(f"{path} exists; pass --force to overwrite it")
        if not os.access(path, os.W_OK):
            raise PrefillDiffError(f"cannot write {what} {path}: permission denied")
        if what != "the trace":  # an existing report file (or /dev/stdout) is written in place
            return
    _writable_dir(os.path.dirname(os.path.abspath(path)), f"{what} {path}")


def _check_reports(json_path, junit_path, plot_path) -> None:
    from ..engine.errors import PrefillDiffError
    _check_output_file(json_path, "the JSON report")
    _check_output_file(junit_path, "the JUnit report")
    if plot_path is not None:
        ext = os.path.splitext(str(plot_path))[1].lower()
        if ext not in PLOT_FORMATS:
            raise PrefillDiffError(f"--plot {plot_path}: unsupported format {ext or '(no extension)'!r} "
                                   f"(use {', '.join(PLOT_FORMATS)})")
        _check_output_file(plot_path, "the plot")


def _check_out_dir(out_dir) -> None:
    """run --out DIR: created now (with parents) and probed, before any model is loaded."""
    from ..engine.errors import PrefillDiffError
    if out_dir is None:
        return
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise PrefillDiffError(f"--out {out_dir}: cannot create the directory ({e.strerror})") from None
    _writable_dir(out_dir, f"traces into --out {out_dir}")


def _progress(console, total_layers_hint=None):
    """A transient per-layer progress bar, hidden when stdout is not a terminal."""
    from rich.progress import BarColumn, Progress, TextColumn
    if not console.is_terminal:
        return None, None
    prog = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("layer {task.completed}"),
                    transient=True, console=console)
    return prog, lambda label: (lambda layer, _t=prog.add_task(label, total=total_layers_hint): prog.update(
        _t, completed=layer + 1))


from .options import LEVEL_CHOICE, model_options, report_options, tolerance_options  # noqa: E402


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="prefill-diff")
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
@click.option("--level", type=LEVEL_CHOICE, default="full", show_default=True, help="Trace level for both sides.")
@click.option("--force", is_flag=True, help="Overwrite traces already in --out.")
@click.option("--fail-fast", is_flag=True,
              help="Run both sides in lockstep, layer by layer, in memory; stop at the first break (no trace files).")
@click.option("--calibrate", "calibrate", type=float, default=None, metavar="K", is_flag=False, flag_value=10.0,
              help="Also run REF in float64 and allow CAND K times REF's own error per layer and tensor "
                   "(default K=10): measured noise instead of a guessed tolerance.")
def run(ref, cand, model, prompts, tokens, tol, json_path, junit_path, plot_path, quiet, out_dir, level, force,
        fail_fast, calibrate):
    """Prefill REF and CAND, record both traces, compare them, report.

    REF and CAND are presets (see `prefill-diff presets`) or TOML config files. The model
    and prompts are shared by both sides unless a config file sets its own.

    \b
    Example:
        prefill-diff run reference batched-left
        prefill-diff run reference fault:unmasked-padding --json report.json
        prefill-diff run reference sdpa --calibrate
        prefill-diff run reference fault:gqa-mapping --fail-fast
    """
    from ..verify.pipeline import run_lockstep, run_pair
    _check_reports(json_path, junit_path, plot_path)
    spec, inputs = _shared(model, prompts, tokens)
    console = _console()
    if fail_fast:
        if out_dir or calibrate:
            raise BadInput("--fail-fast keeps no traces and does not calibrate; drop --out/--calibrate")
        outcome = run_lockstep(ref, cand, spec, inputs, level=level, policy_args=tol)
        _emit(outcome.report, json_path, junit_path, plot_path, quiet, outcome.token_text)
    _check_out_dir(out_dir)
    prog, progress = _progress(console)
    kw = dict(out_dir=out_dir, level=level, force=force, policy_args=tol, calibrate=calibrate)
    if prog is not None:
        with prog:
            outcome = run_pair(ref, cand, spec, inputs, progress=progress, **kw)
    else:
        outcome = run_pair(ref, cand, spec, inputs, **kw)
    if outcome.ref_path and not quiet and json_path != "-":
        from .render import plain
        console.print(plain(f"traces: {outcome.ref_path} {outcome.cand_path}", style="dim"))
    _emit(outcome.report, json_path, junit_path, plot_path, quiet, outcome.token_text)


@cli.command()
@click.argument("config")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Trace file to write.")
@click.option("--level", type=LEVEL_CHOICE, default="full", show_default=True,
              help="full: every tensor; sampled: a declared subset plus statistics; stats: statistics only.")
@click.option("--compression", type=click.Choice(["none", "gzip"]), default="none", show_default=True,
              help="gzip (with shuffle) makes smaller files that every HDF5 tool reads.")
@click.option("--force", is_flag=True, help="Overwrite an existing trace.")
@model_options
@tolerance_options
def record(config, output, level, compression, force, model, prompts, tokens, tol):
    """Prefill CONFIG (a preset or TOML file) and write its trace to OUTPUT.

    The file appears only when complete: it is written under a temporary name and
    renamed at the end, so an interrupted run leaves nothing a reader would accept.
    Tolerance options are stored in the trace: `compare` uses them when this trace is
    the baseline and no tolerance is given on its command line.

    \b
    Example:
        prefill-diff record reference -o ref.h5
        prefill-diff record batched-left -o cand.h5 --level stats --compression gzip
    """
    from ..verify.pipeline import prepare_side, record_side
    from ..verify.policy_file import policy_spec
    tol = policy_spec(**tol)
    _check_output_file(output, "the trace", force=force)  # before the model is loaded
    spec, inputs = _shared(model, prompts, tokens)
    prep = prepare_side(config, spec, inputs)
    console = _console()
    prog, progress = _progress(console, prep.snapshot.args.n_layers)
    if prog is not None:
        with prog:
            record_side(prep, output, level, force, compression, progress=progress("recording"), tolerance=tol)
    else:
        record_side(prep, output, level, force, compression, tolerance=tol)
    from .render import plain
    console.print(plain(f"wrote {output} ({level}, {prep.snapshot.args.n_layers} layers, {len(prep.tokens)} "
                        "samples)"))


@cli.command()
@click.argument("baseline", type=click.Path(dir_okay=False))
@click.argument("candidate")
@tolerance_options
@report_options
@model_options
@click.option("--fail-fast", is_flag=True, help="Stop at the first layer that breaks.")
def compare(baseline, candidate, tol, json_path, junit_path, plot_path, quiet,
            model, prompts, tokens, fail_fast):
    """Compare BASELINE.h5 with CANDIDATE (a trace, or a preset/config that is recorded first).

    \b
    Example:
        prefill-diff compare ref.h5 cand.h5 --json report.json --junit report.xml
        prefill-diff compare baseline.h5 batched-left
    """
    from ..verify.pipeline import compare_with
    _check_reports(json_path, junit_path, plot_path)
    spec, inputs = _shared(model, prompts, tokens)
    outcome = compare_with(baseline, candidate, spec, inputs, fail_fast=fail_fast,
                           policy_args=tol)
    _emit(outcome.report, json_path, junit_path, plot_path, quiet, outcome.token_text)


@cli.command()
@click.argument("config", required=False)
@model_options
def ledger(config, model, prompts, tokens):
    """Print the shape ledger of seed §2.8 for CONFIG's model and inputs.

    With no CONFIG it shows the seed's table: model seed-2.8, one 12-token prompt
    (cache total 192 scalars). Shapes are measured from a real prefill.

    \b
    Example:
        prefill-diff ledger
        prefill-diff ledger batched-left --model synthetic
    """
    from ..engine.config import Inputs, load_side
    from ..engine.ledger import ledger as build
    from ..engine.runner import default_token_ids, prepare
    from ..engine.snapshot import ModelSpec
    from .render import ledger_renderable
    spec, inputs = _shared(model, prompts, tokens)
    if config is None:
        spec = spec or ModelSpec("seed-2.8")
        if inputs is None and spec.source == "seed-2.8":
            inputs = Inputs(token_ids=default_token_ids(20, (12,)))
    side = load_side(config or "reference", spec, inputs)
    prep = prepare(side)
    _console().print(ledger_renderable(build(prep), prep.snapshot.source))


@cli.command()
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--layer", type=int, default=None, help="Only this layer.")
@click.option("--tensor", default=None, metavar="NAME",
              help="Only this tensor: layer_input, attn_update, attn_heads, mid, mlp_update, layer_output, "
                   "cache_keys, cache_values.")
@click.option("--sample", type=int, default=None, help="Only this sample (with --layer and --tensor: its values).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(trace, layer, tensor, sample, as_json):
    """Summarise TRACE: model, run, inputs, per-layer statistics and finite counts, final top ids.

    Works on traces of every level, from the statistics each trace carries.

    \b
    Example:
        prefill-diff inspect ref.h5
        prefill-diff inspect ref.h5 --layer 2 --tensor mlp_update --sample 1
    """
    from ..dumps.inspect import summarize
    from ..dumps.reader import Trace
    with Trace(trace) as t:
        summary = summarize(t, layer, tensor, sample)
    if as_json:
        import json
        click.echo(json.dumps(summary, indent=2, default=str))
        return
    from .render import inspect_renderable
    _console().print(inspect_renderable(summary))


@cli.command()
def presets():
    """List the built-in presets (execution paths), one line each.

    \b
    Example:
        prefill-diff presets
    """
    from ..engine.config import PRESETS
    width = max(len(name) for name in PRESETS)
    for name, (desc, _) in PRESETS.items():  # plain lines, never wrapped: easy to grep
        click.echo(f"{name:<{width}}  {desc}")


def _on_signal(signum, frame):
    from ..engine.errors import INTERRUPT  # light: no torch, no h5py
    INTERRUPT["seen"] = True
    INTERRUPT["signal"] = signum
    raise KeyboardInterrupt


_on_sigint = _on_signal


def main():
    import signal
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)  # timeout, kill and CI cancellation: cleaned up like Ctrl-C
    cli(prog_name="prefill-diff")


if __name__ == "__main__":
    main()
