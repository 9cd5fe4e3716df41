"""The JSON report (--json): the report's own dictionary (``Report.as_dict``), as docs/report-format.md
describes it."""
from __future__ import annotations

import json

from ..report import Report


def to_json(report: Report) -> str:
    """The --json document: two-space indented, keys in the report's order; numpy numbers as floats."""
    return json.dumps(report.as_dict(), indent=2, sort_keys=False, default=_jsonable)


def _jsonable(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)
