"""JUnit XML: one test case per layer and per final check; failures carry the first-break message."""
from __future__ import annotations

import xml.etree.ElementTree as ET

from ..engine.untrusted import visible
from .report import Report


def to_junit(report: Report, suite: str = "prefill-diff") -> str:
    cases = []
    for lr in report.layers:
        fb = lr.first_break
        cases.append((f"layer {lr.layer:03d}",
                      None if fb is None else (visible(report.line(fb)), visible(fb.message))))
    if report.first_break is not None and report.first_break.stage == "metadata":
        fb = report.first_break
        cases.insert(0, ("metadata", (visible(report.line(fb)), visible(fb.message))))
    if report.final is not None:  # each final check fails on its own result, not only the first break
        for name, fb in report.final.breaks:
            cases.append((f"final {name}", None if fb is None else (visible(report.line(fb)), visible(fb.message))))
    failures = sum(1 for _, f in cases if f)
    root = ET.Element("testsuites", name=suite, tests=str(len(cases)), failures=str(failures))
    ts = ET.SubElement(root, "testsuite", name=visible(f"{suite}: {report.ref.get('origin')} vs {report.cand.get('origin')}"),
                       tests=str(len(cases)), failures=str(failures), errors="0", skipped="0")
    props = ET.SubElement(ts, "properties")
    for k, v in (("verdict", report.verdict), ("policy", report.policy.name),
                 ("reference", report.ref.get("file")), ("candidate", report.cand.get("file"))):
        ET.SubElement(props, "property", name=k, value=visible(v))
    for name, failure in cases:
        tc = ET.SubElement(ts, "testcase", classname=suite, name=name)
        if failure:
            f = ET.SubElement(tc, "failure", message=failure[0], type="ToleranceBroken")
            f.text = failure[1] + ("\nhint: " + visible(report.diagnosis) if report.diagnosis else "")
    if report.notes:
        ET.SubElement(ts, "system-out").text = "\n".join(visible(n) for n in report.notes)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
