"""cli/options.py: the shared option decorators collect their click options into one typed object each
(Prefilled, Tolerance, Reports, Judging), and --tokens/--prompt are parsed with precise refusals."""
from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from prefill_diff.jobs import Judging, Tolerance
from prefill_diff.cli.options import (GroupedCommand, Prefilled, as_given, calibration_options, model_options,
                                      report_options, shared_inputs, tolerance_options)
from prefill_diff.cli.outputs import Reports
from prefill_diff.engine.models import budget
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.engine.shared.errors import ConfigError

SECTIONS = ["Options", "Model and prompts", "Tolerance", "Reports", "Calibration"]


def _probe():
    """A command with one option of its own and every shared group; returns (command, the kwargs it got)."""
    got = {}

    @click.command(cls=GroupedCommand)
    @click.option("--force", is_flag=True, help="An option of the command itself.")
    @model_options
    @tolerance_options
    @report_options
    @calibration_options
    def probe(**kw):
        got.update(kw)
    return probe, got


def _invoke(args):
    cmd, got = _probe()
    res = CliRunner().invoke(cmd, args)
    return res, got


def _mangled(raw: bytes) -> str:
    """An argument as Python decodes argv under a C/POSIX locale without UTF-8 mode: each byte > 127 a lone
    surrogate."""
    return raw.decode("ascii", "surrogateescape")


# -- the decorators, through a click command ------------------------------------------------------------------

def test_no_option_given_collects_the_defaults_into_four_objects():
    """Only what, tol, out, judging (and the command's own option) reach the command; the individual options
    do not, and the wrapped function keeps its name (functools.wraps: click names the command after it)."""
    cmd, got = _probe()
    res = CliRunner().invoke(cmd, [])
    assert res.exit_code == 0, res.output
    assert cmd.name == "probe"
    assert got == {
        "force": False,
        "what": Prefilled(model=None, prompts=(), tokens=()),
        "tol": Tolerance(policy=None, atol=None, rtol=None, ntol=None, row_rtol=None, tolerance_file=None),
        "out": Reports(json=None, junit=None, markdown=None, plot=None, quiet=False, verbose=False, layers="auto",
                       strict=False),
        "judging": Judging(calibrate=None, factor=4.0, allow_subset=False, allow_identity=False),
    }


def test_every_option_reaches_its_field():
    res, got = _invoke([
        "--force", "--model", "hf:/m", "--tokens", "5,6,7", "--tokens", "8",
        "--policy", "bfloat16", "--atol", "1e-3", "--rtol", "0.25", "--ntol", "2", "--row-rtol", "0.5",
        "--tolerance", "tol.toml",
        "--json", "-", "--junit", "r.xml", "--markdown", "r.md", "--plot", "p.png", "-q", "-v", "--layers", "all",
        "--strict",
        "--no-calibrate", "--noise-factor", "8", "--allow-subset", "--allow-identity-difference"])
    assert res.exit_code == 0, res.output
    assert got["force"] is True
    assert got["what"] == Prefilled("hf:/m", (), ("5,6,7", "8"))
    assert got["tol"] == Tolerance(policy="bfloat16", atol=0.001, rtol=0.25, ntol=2.0, row_rtol=0.5,
                                   tolerance_file="tol.toml")
    assert got["out"] == Reports(json="-", junit="r.xml", markdown="r.md", plot="p.png", quiet=True, verbose=True,
                                 layers="all", strict=True)
    assert got["judging"] == Judging(calibrate=False, factor=8.0, allow_subset=True, allow_identity=True)


def test_prompts_are_collected_in_order_as_given():
    res, got = _invoke(["--prompt", "first", "--prompt", "second one"])
    assert res.exit_code == 0, res.output
    assert got["what"] == Prefilled(None, ("first", "second one"), ())


@pytest.mark.parametrize("args,want", [([], None), (["--calibrate"], True), (["--no-calibrate"], False)])
def test_calibrate_is_automatic_forced_or_off(args, want):
    res, got = _invoke(args)
    assert res.exit_code == 0 and got["judging"].calibrate is want


@pytest.mark.parametrize("args,message", [
    (["--layers", "some"], "Invalid value for '--layers': 'some' is not one of 'auto', 'failing', 'all'."),
    (["--atol", "x"], "Invalid value for '--atol': 'x' is not a valid float."),
    (["--noise-factor", "K"], "Invalid value for '--noise-factor': 'K' is not a valid float."),
    (["--tokens"], "Option '--tokens' requires an argument."),
])
def test_bad_option_values_are_refused_before_the_command_runs(args, message):
    res, got = _invoke(args)
    assert res.exit_code == 2 and got == {}
    assert message in res.output


@pytest.mark.parametrize("option", ["--json", "--junit", "--markdown", "--plot"])
def test_a_report_path_that_is_a_directory_is_refused(option, tmp_path):
    res, got = _invoke([option, str(tmp_path)])
    assert res.exit_code == 2 and got == {}
    assert f"Invalid value for '{option}': File '{tmp_path}' is a directory." in res.output


def test_ignore_memory_estimate_switches_the_budget_check_and_is_not_passed(monkeypatch):
    monkeypatch.setitem(budget.CHECK, "enabled", None)
    res, got = _invoke([])
    assert res.exit_code == 0 and budget.CHECK["enabled"] is True
    res, got = _invoke(["--ignore-memory-estimate"])
    assert res.exit_code == 0 and budget.CHECK["enabled"] is False
    assert "ignore_memory_estimate" not in got and set(got) == {"force", "what", "tol", "out", "judging"}


def test_model_cache_configures_the_cache_and_is_not_passed(monkeypatch):
    from prefill_diff.engine.models import model_cache
    calls = []
    monkeypatch.setattr(model_cache, "configure", calls.append)
    res, got = _invoke([])
    assert res.exit_code == 0 and calls == []
    res, got = _invoke(["--model-cache", "off"])
    assert res.exit_code == 0 and calls == ["off"]
    assert "model_cache" not in got


def _help_sections(text: str) -> dict:
    """Option -> the heading of the --help section it is listed under."""
    where, section = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            section = line[:-1]
        elif line.startswith("  -"):
            for word in line.split():
                if word.startswith("-"):
                    where[word.rstrip(",")] = section
                elif not word.startswith("/"):
                    break
    return where


def test_help_lists_the_commands_own_options_first_then_each_group_under_its_heading():
    res, _ = _invoke(["--help"])
    assert res.exit_code == 0
    headings = [ln[:-1] for ln in res.output.splitlines() if ln and not ln.startswith((" ", "Usage")) and
                ln.endswith(":")]
    assert headings == SECTIONS
    where = _help_sections(res.output)
    assert where["--force"] == where["--help"] == "Options"
    for opt in ("--model", "--prompt", "--tokens", "--model-cache", "--ignore-memory-estimate"):
        assert where[opt] == "Model and prompts", opt
    for opt in ("--policy", "--atol", "--rtol", "--ntol", "--row-rtol", "--tolerance"):
        assert where[opt] == "Tolerance", opt
    for opt in ("--json", "--junit", "--markdown", "--plot", "-q", "--quiet", "-v", "--verbose", "--layers",
                "--strict"):
        assert where[opt] == "Reports", opt
    for opt in ("--calibrate", "--no-calibrate", "--noise-factor", "--allow-subset", "--allow-identity-difference"):
        assert where[opt] == "Calibration", opt


# -- Prefilled and shared_inputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("what,want", [
    (Prefilled(), []),
    (Prefilled("synthetic"), ["--model"]),
    (Prefilled(None, ("hi",), ()), ["--prompt"]),
    (Prefilled("m", ("hi",), ("1",)), ["--model", "--prompt", "--tokens"]),
    (Prefilled(None, (), ("1,2",)), ["--tokens"]),
])
def test_given_names_the_options_given(what, want):
    assert what.given() == want


def test_nothing_given_resolves_to_nothing():
    assert shared_inputs(None, (), ()) == (None, None)
    assert Prefilled().resolve() == (None, None)


def test_a_model_alone_is_a_spec_without_inputs():
    spec, inputs = shared_inputs("synthetic:qwen3", (), ())
    assert spec == ModelSpec("synthetic:qwen3") and spec.source == "synthetic:qwen3" and inputs is None


@pytest.mark.parametrize("tokens,want", [
    (("5,6,7",), ((5, 6, 7),)),
    ((" 5, 6 ,7 ",), ((5, 6, 7),)),
    (("5,6,7,",), ((5, 6, 7),)),  # one trailing comma, as in a pasted list
    (("0",), ((0,),)),
    (("9223372036854775807",), ((2 ** 63 - 1,),)),
    (("-9223372036854775808",), ((-2 ** 63,),)),
    (("3,4", "10"), ((3, 4), (10,))),
])
def test_tokens_are_comma_separated_integers_one_sample_per_option(tokens, want):
    spec, inputs = Prefilled(None, (), tokens).resolve()
    assert spec is None
    assert inputs.token_ids == want and inputs.prompts == ()


@pytest.mark.parametrize("text,message", [
    ("5,,6", "--tokens '5,,6': id 1 is empty (two commas in a row, or a leading comma)"),
    (",5", "--tokens ',5': id 0 is empty (two commas in a row, or a leading comma)"),
    ("5,6,,", "--tokens '5,6,,': id 2 is empty (two commas in a row, or a leading comma)"),
    ("5,x", "--tokens takes comma-separated integers (got '5,x'; id 1 is 'x')"),
    ("5.0", "--tokens takes comma-separated integers (got '5.0'; id 0 is '5.0')"),
    ("7;8", "--tokens takes comma-separated integers (got '7;8'; id 0 is '7;8')"),
    ("", "--tokens needs at least one id (got '')"),
    (" ", "--tokens needs at least one id (got ' ')"),
    (",", "--tokens needs at least one id (got ',')"),
    ("1,9223372036854775808",
     "--tokens '1,9223372036854775808': id 1 is 9223372036854775808, outside the 64-bit integer range"),
    ("-9223372036854775809",
     "--tokens '-9223372036854775809': id 0 is -9223372036854775809, outside the 64-bit integer range"),
])
def test_bad_tokens_are_refused_naming_the_option_the_text_and_the_id(text, message):
    with pytest.raises(ConfigError) as e:
        shared_inputs(None, (), ("1,2", text))
    assert str(e.value) == message


def test_prompt_and_tokens_together_are_refused():
    with pytest.raises(ConfigError) as e:
        shared_inputs(None, ("hello",), ("1,2",))
    assert str(e.value) == "give --prompt or --tokens, not both"


@pytest.mark.parametrize("prompts,message", [
    (("",), "--prompt number 1 is empty (got ''); give some text"),
    (("hello", " \t\n"), "--prompt number 2 is empty (got ' \\t\\n'); give some text"),
])
def test_an_empty_prompt_is_refused_by_its_number(prompts, message):
    with pytest.raises(ConfigError) as e:
        shared_inputs(None, prompts, ())
    assert str(e.value) == message


def test_prompts_become_inputs_in_order():
    spec, inputs = shared_inputs("synthetic", ("hello", "wörld ✓"), ())
    assert spec.source == "synthetic"
    assert inputs.prompts == ("hello", "wörld ✓") and inputs.token_ids == ()


# -- as_given: argv bytes read as UTF-8 ------------------------------------------------------------------------

@pytest.mark.parametrize("arg,want", [
    (_mangled("café".encode()), "café"),
    (_mangled("日本語 ✓".encode()), "日本語 ✓"),
    ("plain ascii", "plain ascii"),
    ("already decoded é", "already decoded é"),
    (_mangled(b"\xff\xfe"), "\udcff\udcfe"),  # not UTF-8: left escaped
])
def test_as_given_reads_the_argument_bytes_as_utf8(arg, want):
    assert as_given(arg) == want


def test_a_mangled_prompt_from_the_command_line_resolves_to_its_text():
    """--prompt arrives as Python decoded it; resolve() re-reads it as the UTF-8 the user typed."""
    res, got = _invoke(["--prompt", _mangled("naïve ☃".encode())])
    assert res.exit_code == 0, res.output
    _, inputs = got["what"].resolve()
    assert inputs.prompts == ("naïve ☃",)


def test_a_prompt_that_is_not_utf8_is_refused_by_byte_offset():
    with pytest.raises(ConfigError, match=r"is not valid UTF-8 text \(byte 0xff at byte offset 2\)"):
        shared_inputs(None, (_mangled(b"ab\xff"),), ())


def test_a_bad_byte_after_valid_utf8_is_refused_at_its_own_offset():
    """b'caf\\xc3\\xa9 \\xff': 'café ' is valid UTF-8 (6 bytes); the invalid byte is 0xff at offset 6."""
    with pytest.raises(ConfigError) as e:
        shared_inputs(None, (_mangled(b"caf\xc3\xa9 \xff"),), ())
    assert "(byte 0xff at byte offset 6)" in str(e.value)


def test_shared_option_help_sections_are_set_on_the_options_themselves():
    """_compose tags each option of a group with its section (what GroupedCommand sorts on)."""
    @model_options
    def f(**kw):
        pass
    assert {p.opts[0]: p.help_section for p in f.__click_params__} == {
        "--ignore-memory-estimate": "Model and prompts", "--model": "Model and prompts",
        "--model-cache": "Model and prompts", "--first-layers": "Model and prompts", "--prompt": "Model and prompts", "--tokens": "Model and prompts",
        "--response": "Model and prompts", "--response-ids": "Model and prompts",
        "--response-tokens": "Model and prompts"}
