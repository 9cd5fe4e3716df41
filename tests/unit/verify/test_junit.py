"""verify/formats/junit.py: the JUnit XML, parsed back with xml.etree and checked against the Report it was
written from: one test case per layer and per final check, failures where the report breaks (the first with
its message and hint, later ones citing it), an error for traces that cannot be compared, skipped cases for
layers never reached, counts that match the cases, plain-decimal times and escaped foreign text."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import replace

import numpy as np
import pytest

from prefill_diff.verify.formats.junit import to_junit
from prefill_diff.verify.report import Timing, compare_traces

from ._traces import make_spec, policy, record

CANNOT_SHOW = "the injected fault cannot show on this model"
FINALS = ["final logits", "final norm_last", "final top ids"]


def _compare(ref_spec, cand_spec, ref_name="ref", cand_name="cand", **kw):
    return compare_traces(record(ref_spec, name=ref_name), record(cand_spec, name=cand_name), policy(), **kw)


def _parse(report, **kw):
    """(testsuite element, {case name: case element}, outcome of each case in order), after checking that the
    counts on both suite elements are those of the cases."""
    root = ET.fromstring(to_junit(report, **kw))
    assert root.tag == "testsuites" and root.get("name") == "prefill-diff"
    (suite,) = root.findall("testsuite")
    cases = suite.findall("testcase")
    outcomes = []
    for tc in cases:
        kids = [k.tag for k in tc]
        assert len(kids) <= 1 and tc.get("classname") == "prefill-diff"
        outcomes.append(kids[0] if kids else None)
    want = {"tests": len(cases), "failures": outcomes.count("failure"), "errors": outcomes.count("error"),
            "skipped": outcomes.count("skipped")}
    for el in (root, suite):
        assert {k: int(el.get(k)) for k in want} == want
        assert el.get("time") == root.get("time")
    names = [tc.get("name") for tc in cases]
    assert len(set(names)) == len(names)
    return suite, dict(zip(names, cases)), dict(zip(names, outcomes))


def _props(suite) -> dict:
    return {p.get("name"): p.get("value") for p in suite.find("properties")}


def _drop_last_sample(spec):
    out = spec.copy()
    out.samples, out.pad, out.start, out.finals = out.samples[:-1], out.pad[:-1], out.start[:-1], out.finals[:-1]
    out.states = {k: v[:-1] for k, v in out.states.items()}
    out.caches = {k: v[:-1] for k, v in out.caches.items()}
    return out


def test_a_pass_is_one_passing_case_per_layer_and_final_check():
    spec = make_spec(n_layers=3)
    report = _compare(spec, spec.copy())
    suite, cases, outcomes = _parse(report)
    assert list(cases) == ["layer 000", "layer 001", "layer 002"] + FINALS
    assert set(outcomes.values()) == {None}
    assert suite.get("name") == "prefill-diff: ref vs cand"
    props = _props(suite)
    assert props["verdict"] == "pass" and props["policy"] == "test"
    assert props["reference"] == "ref" and props["candidate"] == "cand"
    assert props["verdict_line"].startswith("PASSED | 3/3 layers")
    assert "reference_origin" not in props and "candidate_origin" not in props  # unknown: left out
    assert suite.find("system-out") is None


def test_the_first_break_is_a_failure_with_its_line_message_and_hint():
    ref = make_spec(n_layers=3)
    cand = ref.copy()
    cand.row("mid", 1, 2, layer=1)[3] += 0.5
    report = _compare(ref, cand)
    suite, cases, outcomes = _parse(report)
    assert outcomes == {"layer 000": None, "layer 001": "failure", "layer 002": None, **dict.fromkeys(FINALS)}
    f = cases["layer 001"].find("failure")
    fb = report.first_break
    assert (fb.layer, fb.tensor, fb.sample, fb.position, fb.channel) == (1, "mid", 1, 2, 3)
    assert f.get("type") == "value"
    assert f.get("message").startswith("layer 1 mid | sample 1 pos 2 | max_abs=5.0e-01")
    assert report.diagnosis
    assert f.text == f"{fb.message}\nhint: {report.diagnosis}"
    assert _props(suite)["verdict"] == "fail"
    assert _props(suite)["verdict_line"] == "FAILED | " + f.get("message")


def test_later_breaks_are_failures_too_citing_the_first():
    ref = make_spec(n_layers=3)
    cand = ref.copy()
    cand.row("mid", 1, 2, layer=1)[3] += 0.5
    cand.row("layer_output", 0, 4, layer=2)[1] -= 2.0
    report = _compare(ref, cand)
    _, cases, outcomes = _parse(report)
    assert [n for n, o in outcomes.items() if o] == ["layer 001", "layer 002"]
    later = cases["layer 002"].find("failure")
    brk = report.layers[2].first_break
    assert (brk.tensor, brk.sample, brk.position, brk.channel) == ("layer_output", 0, 4, 1)
    assert later.get("type") == "value"
    assert later.get("message").startswith("after the first break at layer 1 mid: layer 2 layer_output | sample 0 "
                                           "pos 4")
    assert later.text == brk.message  # no hint: that belongs to the first break


def test_each_final_check_fails_on_its_own_result():
    ref = make_spec(n_layers=2)
    cand = ref.copy()
    low = int(np.argmin(cand.finals[2][1]))  # the least likely id: the top ids stay as they are
    cand.finals[2][1][low] += 0.5
    report = _compare(ref, cand)
    _, cases, outcomes = _parse(report)
    assert outcomes == {"layer 000": None, "layer 001": None, "final logits": "failure", "final norm_last": None,
                        "final top ids": None}
    f = cases["final logits"].find("failure")
    assert f.get("type") == "value" and f.get("message").startswith("final logits | sample 2")
    assert f.text.startswith(report.first_break.message)


def test_traces_that_cannot_be_compared_are_one_error_case():
    report = _compare(make_spec(), make_spec(dim=12))
    suite, cases, outcomes = _parse(report)
    assert outcomes == {"metadata": "error"}
    e = cases["metadata"].find("error")
    assert e.get("type") == "metadata"
    assert "dim 8 vs 12" in e.get("message") and e.text.startswith(report.first_break.message)
    assert _props(suite)["verdict"] == "fail"


def test_a_reference_sample_missing_from_the_candidate_is_a_failure_and_the_layers_are_still_compared():
    ref = make_spec(n_layers=2)
    report = _compare(ref, _drop_last_sample(ref))
    _, cases, outcomes = _parse(report)
    assert outcomes == {"metadata": "failure", "layer 000": None, "layer 001": None, **dict.fromkeys(FINALS)}
    f = cases["metadata"].find("failure")
    assert f.get("type") == "coverage" and "(not compared): sample 2" in f.get("message")


def test_layers_a_fail_fast_run_never_reached_are_skipped():
    ref = make_spec(n_layers=4)
    cand = ref.copy()
    cand.row("attn_update", 0, 0, layer=1)[0] += 1.0
    report = _compare(ref, cand, fail_fast=True)
    assert len(report.layers) == 2 and report.stopped_early and report.final is None
    _, cases, outcomes = _parse(report, not_reached=[2, 3])
    assert outcomes == {"layer 000": None, "layer 001": "failure", "layer 002": "skipped", "layer 003": "skipped",
                        "final": "skipped"}
    for name in ("layer 002", "layer 003", "final"):
        assert cases[name].find("skipped").get("message") == "not reached: --fail-fast stopped at the first break"
        assert cases[name].get("time") == "0.000000"


def test_strict_holds_an_inconclusive_pass_as_a_failure_case():
    ref = make_spec()
    cand = ref.copy()
    cand.meta["record"] = {"fault": {"cannot_show": CANNOT_SHOW}}
    report = _compare(ref, cand)
    assert report.inconclusive == (CANNOT_SHOW,)
    suite, _, outcomes = _parse(report)
    assert set(outcomes.values()) == {None}
    assert _props(suite)["verdict"] == "pass (INCONCLUSIVE)"
    assert suite.find("system-out").text == "INCONCLUSIVE: " + CANNOT_SHOW
    suite, cases, outcomes = _parse(replace(report, strict=True))
    assert [n for n, o in outcomes.items() if o] == ["inconclusive (strict)"]
    f = cases["inconclusive (strict)"].find("failure")
    assert f.get("type") == "inconclusive" and f.text == CANNOT_SHOW
    assert f.get("message").startswith("FAILED (strict)")
    assert _props(suite)["verdict"] == "fail (strict: INCONCLUSIVE)"


def test_notes_and_checks_not_done_go_to_system_out():
    spec = make_spec()
    report = replace(_compare(spec, spec.copy()), notes=("first note", "second\x07note"), skipped=("no cache",))
    suite, _, _ = _parse(report)
    assert suite.find("system-out").text == "first note\nsecond\\x07note\nnot checked: no cache"


def test_times_are_plain_decimals_of_each_cases_seconds():
    """Six decimals, never an exponent, never negative; the final checks share the final stage's seconds."""
    spec = make_spec(n_layers=3)
    report = replace(_compare(spec, spec.copy()),
                     timing=Timing(setup=1e-9, layers=(1.5e-7, 2.0, 12345.25), final=3e-6))
    suite, cases, _ = _parse(report)
    assert {n: c.get("time") for n, c in cases.items()} == {
        "layer 000": "0.000000", "layer 001": "2.000000", "layer 002": "12345.250000",
        **dict.fromkeys(FINALS, "0.000001")}
    assert suite.get("time") == "12347.250003"  # 1e-9 + 1.5e-7 + 2 + 12345.25 + 3e-6
    report = replace(report, timing=Timing(setup=-1.0, layers=(-2.0,), final=0.0))
    suite, cases, _ = _parse(report)
    assert suite.get("time") == "0.000000" and cases["layer 000"].get("time") == "0.000000"
    assert cases["layer 001"].get("time") == "0.000000"  # unknown: 0


def _all_text(el) -> list[str]:
    out = [el.text or "", el.tail or "", *el.attrib.values()]
    for kid in el:
        out += _all_text(kid)
    return out


def test_foreign_text_is_escaped_and_the_xml_stays_well_formed():
    """A trace name and a token's text with XML markup, a terminal escape, BEL and a newline: parsed back, the
    markup is literal text and every control character is a visible escape (\\x1b, \\x07, \\n)."""
    ref = make_spec(n_layers=1, token_text={"10": "tok\x1b[31m\n</failure>"})
    cand = ref.copy()
    cand.row("mid", 1, 2)[3] += 0.5  # sample 1's token 2 is id 10
    hostile = 'ref\x1b]0;pwned\x07</testsuite><x a="&'
    report = _compare(ref, cand, ref_name=hostile)
    suite, cases, _ = _parse(report)
    shown = 'ref\\x1b]0;pwned\\x07</testsuite><x a="&'
    assert suite.get("name") == f"prefill-diff: {shown} vs cand"
    assert _props(suite)["reference"] == shown
    message = cases["layer 000"].find("failure").get("message")
    assert message.startswith("layer 0 mid | sample 1 pos 2 'tok\\x1b[31m\\n</failure>' | ")
    for text in _all_text(suite):
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", text), text


@pytest.mark.parametrize("char", ["\uffff", "\ufffe"])
def test_characters_xml_cannot_hold_do_not_break_the_document(char):
    spec = make_spec()
    report = _compare(spec, spec.copy(), ref_name=f"ref{char}.h5")
    suite, _, _ = _parse(report)
    assert suite.get("name").startswith("prefill-diff: ref")
