"""GitHub Actions: the first break as one ``::error`` workflow command, which the runner shows as an annotation.

The runner reads a command from one line of output. Its message is escaped as the Actions toolkit escapes
data (``%`` ``\\r`` ``\\n`` as %25 %0D %0A) and its properties as properties (``:`` and ``,`` too), so text from
a trace can neither end the line, start another command, nor close the properties early.
"""
from __future__ import annotations

from ...engine.shared.untrusted import visible
from ..report import Report
from ..wording import break_site


def escape_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(s: str) -> str:
    return escape_data(s).replace(":", "%3A").replace(",", "%2C")


def workflow_error(report: Report) -> str | None:
    """``::error title=…::verdict line%0Amessage%0Ahint: …`` for a failed verdict; None on a pass."""
    if report:
        return None
    fb = report.first_break
    where = ("INCONCLUSIVE (routing flips not replayed)" if report.unreplayed else "INCONCLUSIVE (strict)") \
        if fb is None else break_site(fb)
    lines = [report.verdict_line()]
    if fb is not None and fb.message and fb.message not in lines[0]:
        lines.append(fb.message)
    if fb is not None and report.diagnosis:
        lines.append("hint: " + report.diagnosis)
    if fb is None:  # --strict holds an INCONCLUSIVE pass as a failure: say which fault cannot show
        lines += ["INCONCLUSIVE: " + n for n in report.inconclusive]
        lines += [n for n in report.skipped if "not compared from layer" in n]  # samples a routing flip took out
    message = "\n".join(visible(x) for x in lines)  # visible: a newline in foreign text is written as \n
    return f"::error title={escape_property(visible('prefill-diff: ' + where))}::{escape_data(message)}"
