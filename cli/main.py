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


GENEROUS_WIDTH = 120  # columns of the report when stdout is not a terminal and COLUMNS is unset (CI logs, pipes)


def _console(stderr: bool = False):
    """Rich console: the terminal's width; not a terminal: COLUMNS, else a fixed generous width."""
    from rich.console import Console
    c = Console(stderr=stderr, highlight=False)
    if not c.is_terminal and not os.environ.get("COLUMNS"):
        c = Console(stderr=stderr, highlight=False, width=GENEROUS_WIDTH)
    return c


def _quiet_libraries(quiet: bool) -> None:
    """No progress bars from transformers/huggingface_hub/tqdm with -q or when stderr is not a terminal.

    Set before transformers is imported (it reads the environment once); if it is already imported, told
    directly."""
    if quiet or not sys.stderr.isatty():
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        os.environ["TQDM_DISABLE"] = "1"
        if "transformers" in sys.modules:
            from transformers.utils import logging as tlog
            tlog.disable_progress_bar()


def _check_outputs(out: dict) -> None:
    """Report paths that can be found bad before any model loads: two reports on stdout, unwritable paths."""
    if out["json"] == "-" and out["junit"] == "-":
        raise BadInput("--json - and --junit - both ask for stdout; send one of them to a file")
    _check_reports(out["json"], out["junit"], out["plot"])


def _shared(model, prompts, tokens):
    """--model/--prompt/--tokens -> (ModelSpec or None, Inputs or None)."""
    if not (model or prompts or tokens):
        return None, None  # and no engine import: comparing two trace files never loads torch
    from ..engine.config import Inputs
    from ..engine.errors import ConfigError
    from ..engine.spec import ModelSpec
    spec = ModelSpec(model) if model else None
    if prompts and tokens:
        raise ConfigError("give --prompt or --tokens, not both")
    for i, p in enumerate(prompts):
        if not p.strip():
            raise ConfigError(f"--prompt number {i + 1} is empty (got {p!r}); give some text")
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


def _emit(report, out: dict, token_text=None, not_reached=()):
    """Write machine reports, print the human one, and exit with the verdict's status.

    ``not_reached``: layers a --fail-fast run never compared (JUnit marks them skipped).
    """
    from ..verify.junit import to_junit
    if out["json"] == "-":
        click.echo(report.to_json())
    elif out["json"]:
        _write(out["json"], report.to_json())
    if out["junit"] == "-":
        click.echo(to_junit(report, not_reached=not_reached), nl=False)
    elif out["junit"]:
        _write(out["junit"], to_junit(report, not_reached=not_reached))
    if out["plot"]:
        from ..verify.plot import plot_errors
        plot_errors(report, out["plot"])
    if "-" not in (out["json"], out["junit"]):
        from .render import print_report, verdict_text
        console = _console()
        if out["quiet"]:
            console.print(verdict_text(report, out["strict"]), soft_wrap=True)
        else:
            print_report(console, report, token_text, which=out["layers"], verbose=out["verbose"],
                         strict=out["strict"])
    if report.incomparable:
        sys.exit(EXIT_BAD_INPUT)  # incomparable traces (SPEC §4): reported, but not a tolerance verdict
    if out["strict"] and report.inconclusive:
        sys.exit(EXIT_FAIL)  # --strict: a fault that cannot show here is not a pass for a gate
    sys.exit(EXIT_PASS if report else EXIT_FAIL)


def _write(path, text):
    from ..engine.errors import PrefillDiffError
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise PrefillDiffError(f"cannot write {path}: {e.strerror}") from None


class Progress:
    """One transient progress display on stderr for every long step; nothing when stderr is not a terminal.

    ``step(label)`` shows an indeterminate pulse (model load, compare); ``side(label)`` returns the
    per-layer callback the pipeline calls, with the layer total once the recorder knows it.
    """

    def __init__(self, quiet: bool = False):
        self.console = _console(stderr=True)
        self.prog = None
        if not quiet and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as P, SpinnerColumn, TextColumn
            self.prog = P(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          transient=True, console=self.console)
        self._task = None

    def __enter__(self):
        if self.prog is not None:
            self.prog.__enter__()
        return self

    def __exit__(self, *exc):
        if self.prog is not None:
            self.prog.__exit__(*exc)

    def step(self, label: str) -> None:
        if self.prog is None:
            return
        if self._task is not None:
            self.prog.remove_task(self._task)
        self._task = self.prog.add_task(label, total=None)

    def side(self, label: str, after: str | None = None):
        """The per-layer callback of one side's recording (None without a display); ``after``: the step shown
        once its last layer is done."""
        if self.prog is None:
            return None
        self.step(f"{label}: layers")
        task = self._task

        def on_layer(layer):
            self.prog.update(task, completed=layer + 1)
            t = next((x for x in self.prog.tasks if x.id == task), None)
            if after and t is not None and t.total is not None and layer + 1 >= t.total:
                self.step(after)

        def set_total(n):
            self.prog.update(task, total=n)
        on_layer.set_total = set_total
        return on_layer


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
    _check_output_file(json_path, "--json (the JSON report)")
    _check_output_file(junit_path, "--junit (the JUnit report)")
    if plot_path is not None:
        ext = os.path.splitext(str(plot_path))[1].lower()
        if ext not in PLOT_FORMATS:
            raise PrefillDiffError(f"--plot {plot_path}: unsupported format {ext or '(no extension)'!r} "
                                   f"(use {', '.join(PLOT_FORMATS)})")
        _check_output_file(plot_path, "--plot (the plot)")


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




from .options import (LEVEL_CHOICE, calibration_options, model_options, report_options,  # noqa: E402
                      tolerance_options)


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
@calibration_options
def run(ref, cand, model, prompts, tokens, tol, out, out_dir, level, force, fail_fast, calibrate, factor,
        allow_subset):
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
    from ..verify.pipeline import run_lockstep, run_pair
    _check_outputs(out)
    _quiet_libraries(out["quiet"])
    spec, inputs = _shared(model, prompts, tokens)
    cal = dict(calibrate=calibrate, factor=factor, allow_subset=allow_subset)
    if fail_fast:
        if out_dir:
            raise BadInput("--fail-fast keeps no traces; drop --out")
        with Progress(out["quiet"]) as prog:
            prog.step("loading the model, running the sides layer by layer")
            outcome = run_lockstep(ref, cand, spec, inputs, level=level, policy_args=tol, **cal)
        rep = outcome.report
        reached = {lr.layer for lr in rep.layers}
        _emit(rep, out, outcome.token_text,
              not_reached=[i for i in range(rep.n_layers) if i not in reached] if rep.stopped_early else ())
    after = {"reference": "recording the candidate", "candidate": "comparing (or recording the golden and twin)",
             "golden (float64)": "recording the twin, or comparing"}
    _check_out_dir(out_dir)
    kw = dict(out_dir=out_dir, level=level, force=force, policy_args=tol, **cal)
    with Progress(out["quiet"]) as prog:
        prog.step("loading the model and preparing both sides")
        progress = (lambda label: prog.side(label, after.get(label, "comparing"))) if prog.prog is not None else None
        outcome = run_pair(ref, cand, spec, inputs, progress=progress, **kw)
    if outcome.ref_path and not out["quiet"] and "-" not in (out["json"], out["junit"]):
        from .render import plain
        _console().print(plain(f"traces: {outcome.ref_path} {outcome.cand_path}", style="dim"), soft_wrap=True)
    _emit(outcome.report, out, outcome.token_text)


@cli.command()
@click.argument("config")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Trace file to write.")
@click.option("--level", type=LEVEL_CHOICE, default="full", show_default=True,
              help="full: every tensor; sampled: a declared subset plus statistics; stats: statistics only.")
@click.option("--compression", type=click.Choice(["none", "gzip"]), default="none", show_default=True,
              help="gzip (with shuffle) makes smaller files that every HDF5 tool reads.")
@click.option("--force", is_flag=True, help="Overwrite an existing trace.")
@click.option("--twin-of", "twin_of", default=None, metavar="PRECISION",
              help="Also record this trace's float64 golden (OUTPUT's stem + .golden.h5) and its twin at the "
                   "precisions of PRECISION, a preset or config (stem + .twin-KEY.h5), so that `compare` of this "
                   "baseline against a candidate of those precisions is calibrated.")
@model_options
@tolerance_options
def record(config, output, level, compression, force, twin_of, model, prompts, tokens, tol):
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
    from ..verify.pipeline import prepare_side, record_side
    from ..verify.policy_file import policy_spec
    if os.path.exists(output) and not force:  # found before the model loads
        raise BadInput(f"{output} exists; pass --force to overwrite it")
    _quiet_libraries(False)
    tol = policy_spec(**tol)
    _check_output_file(output, "the trace", force=force)  # before the model is loaded
    spec, inputs = _shared(model, prompts, tokens)
    if twin_of is not None and level != "full":
        raise BadInput(f"--twin-of records full golden and twin traces; it needs --level full (got {level})")
    with Progress() as prog:
        prog.step("loading the model")
        prep = prepare_side(config, spec, inputs)
        output = record_side(prep, output, level, force, compression, progress=prog.side("recording", "writing"),
                             tolerance=tol)  # a tensor-parallel side writes a directory of rank traces
    from .render import plain
    console = _console()
    console.print(plain(f"wrote {output} ({level}, {prep.snapshot.args.n_layers} layers, {len(prep.tokens)} "
                       "samples)"), soft_wrap=True)
    if twin_of is not None:
        from ..engine.config import load_side, precision_of
        from ..verify.calibrate import precision_key, precision_label, same_precisions, sibling_paths
        from ..verify.pipeline import record_calibration
        prec = precision_of(load_side(twin_of, spec, inputs).run)
        same = same_precisions(prec, precision_of(prep.side.run))
        golden, twin = sibling_paths(str(output))
        twin = twin.format(key=precision_key(prec))
        got = record_calibration(prep.side, prec, os.path.dirname(str(output)) or ".", twin_is_ref=same,
                                 force=force, snapshot=prep.snapshot, golden_path=golden, twin_path=twin)
        console.print(plain(f"wrote {got[0]} (float64 golden)" + ("" if got[1] is None else
                                                                 f" and {got[1]} (twin in {precision_label(prec)})")),
                      soft_wrap=True)


@cli.command()
@click.argument("baseline", type=click.Path())
@click.argument("candidate")
@tolerance_options
@report_options
@model_options
@click.option("--fail-fast", is_flag=True, help="Stop at the first layer that breaks.")
@calibration_options
def compare(baseline, candidate, tol, out, model, prompts, tokens, fail_fast, calibrate, factor, allow_subset):
    """Compare BASELINE.h5 with CANDIDATE (a trace, or a preset/config that is recorded first).

    --model, --prompt and --tokens apply only when CANDIDATE is recorded now; with two traces
    they are refused.

    \b
    Example:
        prefill-diff compare ref.h5 cand.h5 --json report.json --junit report.xml
        prefill-diff compare baseline.h5 batched-left
    """
    from ..verify.pipeline import compare_with
    _check_outputs(out)
    if os.path.isfile(candidate) and not candidate.endswith(".toml"):
        given = [f for f, v in (("--model", model), ("--prompt", prompts), ("--tokens", tokens)) if v]
        if given:
            verb = "does" if len(given) == 1 else "do"
            raise BadInput(f"{' and '.join(given)} {verb} not apply when comparing two traces ({candidate} is a "
                           "trace file: its model and prompts are recorded in it); drop them")
    _quiet_libraries(out["quiet"])
    spec, inputs = _shared(model, prompts, tokens)
    with Progress(out["quiet"]) as prog:
        prog.step("comparing" if os.path.isfile(candidate) and not candidate.endswith(".toml")
                  else f"recording {candidate} with the baseline's model and prompts, then comparing")
        outcome = compare_with(baseline, candidate, spec, inputs, fail_fast=fail_fast, policy_args=tol,
                               calibrate=calibrate, factor=factor, allow_subset=allow_subset)
    rep = outcome.report
    reached = {lr.layer for lr in rep.layers}
    _emit(rep, out, outcome.token_text,
          not_reached=[i for i in range(rep.n_layers) if i not in reached] if rep.stopped_early else ())


@cli.command()
@click.argument("config", required=False)
@model_options
def ledger(config, model, prompts, tokens):
    """Print the shape ledger of seed §2.8 for CONFIG's model and inputs (one table per prefill call).

    With no CONFIG (and no --model) it shows the seed's table: model seed-2.8, one 12-token
    prompt (cache total 192 scalars). With CONFIG the model is the config's, else --model,
    else synthetic. Shapes are measured from a real prefill; a chunked config shows each
    chunk's call.

    \b
    Example:
        prefill-diff ledger
        prefill-diff ledger batched-left --model synthetic
    """
    from ..engine.config import Inputs, load_side
    from ..engine.ledger import ledger as build
    from ..engine.runner import default_token_ids, prepare
    from ..engine.spec import ModelSpec
    from .render import ledger_renderable
    spec, inputs = _shared(model, prompts, tokens)
    if config is None:
        spec = spec or ModelSpec("seed-2.8")
        if inputs is None and spec.source == "seed-2.8":
            inputs = Inputs(token_ids=default_token_ids(20, (12,)))
    side = load_side(config or "reference", spec, inputs)
    prep = prepare(side)
    _console().print(ledger_renderable(build(prep), prep.snapshot.source, prep.side.run.cache.chunk_size))


@cli.command()
@click.argument("trace", type=click.Path())
@click.option("--layer", type=int, default=None, help="Only this layer.")
@click.option("--tensor", default=None, metavar="NAME",
              help="Only this tensor: layer_input, attn_update, attn_heads, mid, mlp_update, layer_output, "
                   "cache_keys, cache_values; or a final-stage tensor: logits, norm_last.")
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
    from ..dumps.inspect import summarize
    from ..dumps.ranks import open_any  # a trace file, or a directory of rank traces (a tensor-parallel run)
    if json_path not in (None, "-") and (json_path.endswith((".h5", ".hdf5")) or os.path.abspath(json_path) ==
                                         os.path.abspath(trace)):
        raise BadInput(f"--json {json_path}: a JSON summary is not written over a trace file (give a .json name)")
    with open_any(trace) as t:
        summary = summarize(t, layer, tensor, sample, position, channel)
    if json_path is not None:
        import json
        text = json.dumps(summary, indent=2, default=str)
        if json_path == "-":
            click.echo(text)
        else:
            _write(json_path, text + "\n")
        return
    from .render import print_inspect
    print_inspect(_console(), summary)


@cli.command()
def presets():
    """List the built-in presets (execution paths), one line each.

    \b
    Example:
        prefill-diff presets
    """
    import shutil
    import textwrap
    from ..engine.config import PRESETS
    width = max(len(name) for name in PRESETS)
    cols = shutil.get_terminal_size((0, 0)).columns if sys.stdout.isatty() else 0
    for name, (desc, _) in PRESETS.items():
        if cols and cols > width + 22:  # a terminal: wrap at word boundaries under the description
            click.echo(textwrap.fill(desc, cols - 1, initial_indent=f"{name:<{width}}  ",
                                     subsequent_indent=" " * (width + 2), break_long_words=False,
                                     break_on_hyphens=False))
        else:  # not a terminal: one plain line per preset, easy to grep
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
