"""JUnit XML: one test case per layer and per final check, in a ``testsuites`` root that CI systems read.

The first break's case carries its line, its message and the hint; every later case that breaks is a failure
too (CI systems count them), with a one-line message citing the first break. A failure's ``type`` is the
break's kind as the JSON names it (``value``, ``cache_length``, ``coverage``, …). A ``metadata`` break (two
traces that cannot be compared, exit 2) is an ``error``; layers a --fail-fast run never reached are
``skipped``; a property whose value is unknown is left out. ``time`` is the seconds each case's comparison
took (``Report.timing``; 0 where unknown), written as a plain decimal.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import NamedTuple

from ...engine.shared.untrusted import visible
from .. import wording
from ..breaks import Break
from ..report import Report

NOT_REACHED = "not reached: --fail-fast stopped at the first break"


class Case(NamedTuple):
    """One test case: its outcome (None: passed; "failure", "error" or "skipped") and what it says."""
    name: str
    outcome: str | None = None
    message: str = ""
    text: str = ""
    type: str = ""
    seconds: float = 0.0


def to_junit(report: Report, suite: str = "prefill-diff", not_reached=()) -> str:
    cases = _cases(report, not_reached)
    counts = {k: str(sum(1 for c in cases if c.outcome == k)) for k in ("failure", "error", "skipped")}
    totals = dict(tests=str(len(cases)), failures=counts["failure"], errors=counts["error"],
                  skipped=counts["skipped"], time=_seconds(report.timing.total))
    root = ET.Element("testsuites", name=suite, **totals)
    ts = ET.SubElement(root, "testsuite", name=visible(f"{suite}: {_side(report.ref)} vs {_side(report.cand)}"),
                       **totals)
    _properties(ET.SubElement(ts, "properties"), report)
    for c in cases:
        tc = ET.SubElement(ts, "testcase", classname=suite, name=c.name, time=_seconds(c.seconds))
        if c.outcome == "skipped":
            ET.SubElement(tc, "skipped", message=c.message)
        elif c.outcome is not None:
            ET.SubElement(tc, c.outcome, message=c.message, type=c.type).text = c.text
    out = list(report.notes) + ["INCONCLUSIVE: " + n for n in report.inconclusive] + \
        ["not checked: " + n for n in report.skipped]
    if out:
        ET.SubElement(ts, "system-out").text = "\n".join(visible(x) for x in out)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _cases(report: Report, not_reached) -> list[Case]:
    """The metadata case (if it broke), one case per layer, the layers never reached, the final checks, --strict."""
    fb0, t = report.first_break, report.timing
    cases = []
    if fb0 is not None and fb0.stage == "metadata":  # incomparable traces are an error; missing samples a failure
        cases.append(_case(report, "metadata", fb0, t.setup, error=fb0.kind == "metadata"))
    cases += [_case(report, f"layer {lr.layer:03d}", _layer_break(report, lr), t.layer(i))
              for i, lr in enumerate(report.layers)]
    cases += [Case(f"layer {i:03d}", "skipped", NOT_REACHED) for i in not_reached]
    if report.final is not None:  # each final check fails on its own result, not only the first break
        checks = _final_checks(report)
        cases += [_case(report, f"final {name}", fb, t.final / len(checks)) for name, fb in checks]
    elif report.stopped_early:
        cases.append(Case("final", "skipped", NOT_REACHED))
    if report.failed_strict:  # --strict: a fault that cannot show here fails the gate, as the verdict says
        cases.append(Case("inconclusive (strict)", "failure", visible(report.verdict_line()),
                          "\n".join(visible(n) for n in report.inconclusive), "inconclusive"))
    if report.unreplayed and report.first_break is None:  # routing flips within noise, not replayed: not a pass
        cases.append(Case("routing", "failure", visible(report.verdict_line()),
                          "\n".join(visible(n) for n in report.skipped if "not compared from layer" in n),
                          "inconclusive"))
    return cases


def _layer_break(report: Report, lr) -> Break | None:
    """A layer's break: its own, else under --exact the first tensor whose bits part there (the report's first break
    itself where that is it)."""
    if lr.first_break is not None or report.exact is None:
        return lr.first_break
    fb0 = report.first_break
    if fb0 is not None and fb0.kind == "bits" and fb0.stage == "layer" and fb0.layer == lr.layer:
        return fb0
    return report.exact.layer_break(lr.layer)


def _final_checks(report: Report) -> list[tuple[str, Break | None]]:
    """(name, break) of each final check; the first break, when final, stands in its check's place (it may be
    the twin's own break, check 2, which no candidate check carries), or is added as a case of its own."""
    fb0 = report.first_break
    checks = [(name, fb) for name, fb in report.final.breaks]
    if fb0 is None or fb0.stage != "final":
        return checks
    at = "top ids" if fb0.kind == "top_ids" else fb0.tensor
    if at not in [name for name, _ in checks]:
        return checks + [(at or fb0.kind, fb0)]
    return [(name, fb0 if name == at else fb) for name, fb in checks]


def _case(report: Report, name: str, fb: Break | None, seconds: float, error: bool = False) -> Case:
    """A case of one comparison step: passed, the first break (its line, message and hint), or a later break."""
    if fb is None:
        return Case(name, seconds=seconds)
    outcome, line, first = "error" if error else "failure", report.line(fb), report.first_break
    if first is None or fb is first:
        hint = "\nhint: " + visible(report.diagnosis) if report.diagnosis else ""
        return Case(name, outcome, visible(line), visible(fb.message) + hint, fb.kind, seconds)
    return Case(name, outcome, visible(wording.after_first_break(first, line)), visible(fb.message), fb.kind, seconds)


def _properties(props, report: Report) -> None:
    verdict = report.verdict + (" (strict: INCONCLUSIVE)" if report.failed_strict else
                                " (INCONCLUSIVE)" if report.inconclusive else "")
    for k, v in (("verdict", verdict), ("verdict_line", report.verdict_line()), ("policy", report.policy.name),
                 ("rule", report.calibration),
                 ("reference", report.ref.get("file") or "trace not kept"),
                 ("candidate", report.cand.get("file") or "trace not kept"),
                 ("reference_origin", report.ref.get("origin")), ("candidate_origin", report.cand.get("origin"))):
        if v is not None:
            ET.SubElement(props, "property", name=k, value=visible(v))
    if report.exact is not None:  # --exact: where bits first part, as a dashboard keys it
        ex = report.exact.as_dict()
        first = ex["first"] or {}
        for k, v in (("exact_bitwise_equal", ex["bitwise_equal"]), ("exact_first_layer", first.get("layer")),
                     ("exact_first_tensor", first.get("tensor")), ("exact_first_share_equal", first.get("share_equal")),
                     ("exact_first_max_ulp", first.get("max_ulp"))):
            if v is not None:
                ET.SubElement(props, "property", name=k, value=repr(v) if isinstance(v, float) else str(v))
    for k, v in (report.logprobs.as_dict() if report.logprobs is not None else {}).items():
        if k not in ("largest", "chosen_by") and v is not None:  # the response's log-prob figures, as RL dashboards name them
            ET.SubElement(props, "property", name=f"logprobs_{k}", value=repr(v) if isinstance(v, float) else str(v))


def _side(d: dict) -> str:
    """A side as the suite's name gives it: its trace file when kept, else its origin (preset or config)."""
    return str(d.get("file") or d.get("origin") or "?")


def _seconds(x: float) -> str:
    """A plain decimal (xs:decimal, as Surefire's schema and every consumer read it): never an exponent."""
    return f"{max(float(x), 0.0):.6f}"
