"""JUnit XML: one test case per layer and per final check; failures carry the first-break message."""
from __future__ import annotations

import xml.etree.ElementTree as ET

from .report import Report, break_line


def to_junit(report: Report, suite: str = "prefill-diff") -> str:
    cases = []
    for lr in report.layers:
        fb = lr.first_break
        cases.append((f"layer {lr.layer:03d}", None if fb is None else (break_line(fb), fb.message)))
    if report.first_break is not None and report.first_break.stage == "metadata":
        fb = report.first_break
        cases.insert(0, ("metadata", (break_line(fb), fb.message)))
    if report.final is not None:
        for t in report.final.tensors:
            fb = report.final.first_break
            mine = fb is not None and fb.tensor == t.tensor
            cases.append((f"final {t.tensor}", (break_line(fb), fb.message) if mine else None))
        fb = report.final.first_break
        cases.append(("final top ids", (break_line(fb), fb.message) if fb is not None and fb.kind == "top_ids"
                      else None))
    failures = sum(1 for _, f in cases if f)
    root = ET.Element("testsuites", name=suite, tests=str(len(cases)), failures=str(failures))
    ts = ET.SubElement(root, "testsuite", name=f"{suite}: {report.ref.get('origin')} vs {report.cand.get('origin')}",
                       tests=str(len(cases)), failures=str(failures), errors="0", skipped="0")
    props = ET.SubElement(ts, "properties")
    for k, v in (("verdict", report.verdict), ("policy", report.policy.name),
                 ("reference", report.ref.get("file")), ("candidate", report.cand.get("file"))):
        ET.SubElement(props, "property", name=k, value=str(v))
    for name, failure in cases:
        tc = ET.SubElement(ts, "testcase", classname=suite, name=name)
        if failure:
            f = ET.SubElement(tc, "failure", message=failure[0], type="ToleranceBroken")
            f.text = failure[1] + ("\nhint: " + report.diagnosis if report.diagnosis else "")
    if report.notes:
        ET.SubElement(ts, "system-out").text = "\n".join(report.notes)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
