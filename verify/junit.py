"""JUnit XML: one test case per layer and per final check; failures carry the first-break message.

A metadata break (two traces that cannot be compared, exit 2) is an ``error``, not a failure; layers a
--fail-fast run never reached are ``skipped``; a property whose value is unknown says so in words.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET

from ..engine.errors import visible
from .report import Report


def to_junit(report: Report, suite: str = "prefill-diff", not_reached=()) -> str:
    cases = []  # (name, None | ("failure"|"error"|"skipped", message, text))
    hint = "\nhint: " + visible(report.diagnosis) if report.diagnosis else ""
    fb0 = report.first_break
    if fb0 is not None and fb0.stage == "metadata":  # incomparable traces are an error; missing samples a failure
        cases.append(("metadata", ("error" if fb0.kind == "metadata" else "failure", visible(report.line(fb0)),
                                   visible(fb0.message) + hint)))
    for lr in report.layers:
        fb = lr.first_break
        cases.append((f"layer {lr.layer:03d}", None if fb is None else ("failure", visible(report.line(fb)), visible(fb.message) + hint)))
    for i in not_reached:
        cases.append((f"layer {i:03d}", ("skipped", "not reached: --fail-fast stopped at the first break", "")))
    if report.final is not None:  # each final check fails on its own result, not only the first break
        for name, fb in report.final.breaks:
            cases.append((f"final {name}", None if fb is None else ("failure", visible(report.line(fb)), visible(fb.message) + hint)))
    elif report.stopped_early:
        cases.append(("final", ("skipped", "not reached: --fail-fast stopped at the first break", "")))
    if report.failed_strict:  # --strict: a fault that cannot show here fails the gate, as the verdict says
        cases.append(("inconclusive (strict)", ("failure", visible(report.verdict_line()),
                                                "\n".join(visible(n) for n in report.inconclusive))))
    count = {k: sum(1 for _, c in cases if c and c[0] == k) for k in ("failure", "error", "skipped")}
    root = ET.Element("testsuites", name=suite, tests=str(len(cases)), failures=str(count["failure"]),
                      errors=str(count["error"]), skipped=str(count["skipped"]))
    ts = ET.SubElement(root, "testsuite", name=visible(f"{suite}: {report.ref.get('origin')} vs {report.cand.get('origin')}"),
                       tests=str(len(cases)), failures=str(count["failure"]), errors=str(count["error"]),
                       skipped=str(count["skipped"]))
    props = ET.SubElement(ts, "properties")
    verdict = report.verdict + (" (strict: INCONCLUSIVE)" if report.failed_strict else
                                " (INCONCLUSIVE)" if report.inconclusive else "")
    for k, v in (("verdict", verdict), ("verdict_line", report.verdict_line()), ("policy", report.policy.name),
                 ("rule", report.calibration),
                 ("reference", report.ref.get("file") or "trace not kept"),
                 ("candidate", report.cand.get("file") or "trace not kept"),
                 ("reference_origin", report.ref.get("origin")), ("candidate_origin", report.cand.get("origin"))):
        if v is not None:
            ET.SubElement(props, "property", name=k, value=visible(v))
    for name, c in cases:
        tc = ET.SubElement(ts, "testcase", classname=suite, name=name)
        if c is None:
            continue
        kind, message, text = c
        if kind == "skipped":
            ET.SubElement(tc, "skipped", message=message)
            continue
        el = ET.SubElement(tc, kind, message=message,
                           type="IncomparableTraces" if kind == "error" else "ToleranceBroken")
        el.text = text
    out = list(report.notes) + ["INCONCLUSIVE: " + n for n in report.inconclusive] + \
        ["not checked: " + n for n in report.skipped]
    if out:
        ET.SubElement(ts, "system-out").text = "\n".join(visible(x) for x in out)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
