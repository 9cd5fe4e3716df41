"""The verdict: a typed report, its fixed wording, and machine formats (JSON, JUnit XML).

``Report`` is what the CLI renders and what CI reads. Its JSON keys are
stable and documented in docs/report-format.md.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple

from ..dumps.reader import Trace
from .breaks import Break
from .calibrate import precisions, same_precisions
from .comparator import Comparator, LayerResult
from .diagnose import diagnose
from .final import FinalResult
from .identity import differences, note
from .policy_file import default_policy_for
from .tolerance import Policy
from . import wording
from .wording import break_line

REPORT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Report:
    first_break: Break | None
    layers: tuple
    final: FinalResult | None
    policy: Policy
    n_layers: int
    notes: tuple = ()
    skipped: tuple = ()
    inconclusive: tuple = ()  # faults that cannot show on this model/inputs
    ref: dict = field(default_factory=dict)  # trace_summary of each side
    cand: dict = field(default_factory=dict)
    pairs: tuple = ()
    stopped_early: bool = False
    diagnosis: str | None = None
    token_text: dict | None = None  # str(token id) -> text, when the model has a tokenizer
    sample_tokens: tuple = ()  # the reference's token ids per sample
    calibration: str | None = None  # how values were judged, in words (the header's "rule")
    strict: bool = False  # --strict: an INCONCLUSIVE pass is a failure (verdict, exit status, JUnit, JSON)

    def token_at(self, sample: int | None, position: int | None) -> tuple[int, str | None] | None:
        """(id, text or None) of the reference's token at (sample, logical position), if known."""
        if sample is None or position is None or not 0 <= sample < len(self.sample_tokens):
            return None
        toks = self.sample_tokens[sample]
        if not 0 <= position < len(toks):
            return None
        i = int(toks[position])
        return i, (self.token_text or {}).get(str(i))

    def texts(self, ids) -> list | None:
        return None if not self.token_text else [self.token_text.get(str(int(i))) for i in ids]

    def line(self, b: Break) -> str:
        """break_line, with the token's text beside its position when the model has a tokenizer."""
        tok = self.token_at(b.sample, b.position)
        return break_line(b, None if tok is None or tok[1] is None else tok[1])

    def __bool__(self) -> bool:
        return self.first_break is None and not self.failed_strict

    @property
    def failed_strict(self) -> bool:
        """No break, but --strict holds an INCONCLUSIVE pass (a fault that cannot show here) as a failure."""
        return self.strict and self.first_break is None and bool(self.inconclusive)

    @property
    def incomparable(self) -> bool:
        """Two traces that cannot be compared at all (exit status 2), as opposed to a failed comparison."""
        return self.first_break is not None and self.first_break.kind == "metadata"

    @property
    def verdict(self) -> str:
        return "pass" if self else "fail"

    def verdict_line(self) -> str:
        if self.first_break is None:
            return wording.passed(len(self.layers), self.n_layers, inconclusive=bool(self.inconclusive),
                                  identity_differs=any(n.startswith("MODEL IDENTITY DIFFERS") for n in self.notes),
                                  strict=self.strict)
        return wording.failed(self.line(self.first_break))

    def as_dict(self) -> dict:
        fb = self.first_break
        return {
            "report_version": REPORT_VERSION,
            "verdict": self.verdict,
            "verdict_line": self.verdict_line(),
            "first_break": None if fb is None else {**fb.as_dict(), **self._token_fields(fb)},
            "diagnosis": self.diagnosis,
            "layers": [lr.as_dict() for lr in self.layers],
            "final": None if self.final is None else {
                "passed": bool(self.final),
                "tensors": {t.tensor: t.as_dict() for t in self.final.tensors},
                "top_ids_ok": self.final.top_ids_ok, "top_ids_detail": self.final.top_detail,
                "top": [{"sample": s, "reference": r, "candidate": c,
                         **({"reference_text": self.texts(r), "candidate_text": self.texts(c)} if self.token_text
                            else {})} for s, r, c in self.final.top],
                "gathered_token": [{"sample": s, "reference": r, "candidate": c, "last_valid": last}
                                   for s, r, c, last in self.final.gather]},
            "policy": self.policy.as_dict(),
            "rule": self.calibration,
            "notes": list(self.notes),
            "checks_not_done": list(self.skipped),
            "inconclusive": list(self.inconclusive),
            "stopped_early": self.stopped_early,
            "samples": [{"reference": r, "candidate": c} for r, c in self.pairs],
            "reference": self.ref,
            "candidate": self.cand,
        }

    def _token_fields(self, b: Break) -> dict:
        tok = self.token_at(b.sample, b.position)
        return {"token_id": None if tok is None else tok[0], "token_text": None if tok is None else tok[1]}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=False, default=_jsonable)


def _jsonable(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def trace_summary(t: Trace, file: str | None) -> dict:
    """A side of the report: ``file`` is the name the report shows (None: the trace is gone)."""
    m = t.meta
    return {"file": file, "level": t.level, "format_version": t.version,
            "origin": m.get("side", {}).get("origin"), "engine": m.get("engine"),
            "weights_digest": m.get("model", {}).get("weights_digest"),
            "adapter": m.get("model", {}).get("adapter"),
            "quantized_weights_digest": (m.get("record") or {}).get("quantized_weights_digest"),
            "layout": m.get("layout")}


def record_notes(t: Trace, side: str) -> tuple[list, list]:
    """Notes from what the engine recorded: reuse decisions, invariant violations, unshowable faults."""
    rec = t.meta.get("record") or {}
    notes, inconclusive = [], []
    for o in rec.get("reuse") or ():
        if o.get("forced") or not o.get("hit"):
            notes.append(wording.reuse_refused(side, o["sample"], o["reason"], forced=bool(o.get("forced"))))
    notes += [wording.invariant_broken(side, v) for v in rec.get("invariant_violations") or ()]
    fault = rec.get("fault") or {}
    if fault.get("cannot_show"):
        inconclusive.append(fault["cannot_show"])
    return notes, inconclusive


class Files(NamedTuple):
    """The file names a report shows for its two sides (None: recorded into a temporary file, removed)."""
    ref: str | None
    cand: str | None


class Session:
    """Builds a Report incrementally, so a caller may stop after any layer (--fail-fast).

    policy: a resolved Policy; None takes ``default_policy_for(ref.meta, cand.meta)`` (the baseline's declared
    tolerance, else the dtype defaults). files: the names the report shows; None: the traces' own names.
    """

    def __init__(self, ref: Trace, cand: Trace, policy: Policy | None = None, calib=None,
                 allow_subset: bool = False, rule_note: str | None = None, *, files: Files | tuple | None = None):
        self.ref, self.cand = ref, cand
        self.files = Files(ref.name, cand.name) if files is None else Files(*files)
        self.cmp = Comparator(ref, cand, default_policy_for(ref.meta, cand.meta) if policy is None else policy,
                              calib, allow_subset)
        self.layers: list[LayerResult] = []
        self.first_break = self.cmp.metadata_break()
        # a coverage break is a failure but the matched samples are still compared
        self.metadata_failed = self.first_break is not None and self.first_break.kind == "metadata"
        self.rule = rule_note or describe_rule(self.cmp)

    def add_layer(self, i: int) -> LayerResult:
        lr = self.cmp.layer(self.ref.layer(i), self.cand.layer(i))
        self.layers.append(lr)
        if self.first_break is None and lr.first_break is not None:
            self.first_break = lr.first_break
        return lr

    def finish(self, stopped_early: bool = False) -> Report:
        final = None
        if not self.metadata_failed and not stopped_early:
            final = self.cmp.final()
            if self.first_break is None and final.first_break is not None:
                self.first_break = final.first_break
        notes, inconclusive = self._notes()
        hint = diagnose(self.first_break, self.cmp.pairs, final, self.ref, self.cand)  # the traces are still open
        return Report(first_break=self.first_break, layers=tuple(self.layers), final=final, policy=self.cmp.policy,
                      n_layers=self.ref.n_layers, notes=tuple(notes), skipped=tuple(sorted(self.cmp.skipped)),
                      inconclusive=tuple(inconclusive), ref=trace_summary(self.ref, self.files.ref),
                      cand=trace_summary(self.cand, self.files.cand), pairs=tuple(self.cmp.pairs),
                      stopped_early=stopped_early, diagnosis=hint,
                      token_text={**(self.cand.meta.get("token_text") or {}),
                                  **(self.ref.meta.get("token_text") or {})} or None,
                      sample_tokens=tuple(tuple(int(t) for t in s) for s in self.ref.samples),
                      calibration=self.rule)

    def _notes(self) -> tuple[list, list]:
        """(notes, faults that cannot show): model identity, the comparison's own notes, what each side recorded."""
        notes = [note(d) for d in differences(self.ref.meta, self.cand.meta)] + list(self.cmp.notes)
        inconclusive = []
        for t, side in ((self.ref, "reference"), (self.cand, "candidate")):
            n, i = record_notes(t, side)
            notes += n
            inconclusive += i
        rd, cd = self.ref.meta.get("model", {}), self.cand.meta.get("model", {})
        if rd.get("weights_digest") != cd.get("weights_digest"):
            notes.append(wording.weights_differ(rd.get("weights_digest"), cd.get("weights_digest")))
        if self.ref.level != self.cand.level:
            notes.append(wording.levels_differ(self.ref.level, self.cand.level))
        return notes, inconclusive


def describe_rule(cmp: Comparator) -> str:
    """How values are judged, in words: the calibrated rule, or the fixed rule and where its terms came from."""
    p = cmp.policy
    if cmp.calib is not None:
        return wording.calibrated_rule(cmp.calib, p.name)
    if any(not str(v).endswith("default") for v in p.sources.values()):
        return wording.declared_rule(p.rule())
    if not same_precisions(precisions(cmp.ref.meta), precisions(cmp.cand.meta)):
        return wording.envelope_rule(p.name, p.rule())
    return wording.same_precisions_rule(p.name, p.rule())


def compare_traces(ref: Trace, cand: Trace, policy: Policy | None = None, *, fail_fast: bool = False, calib=None,
                   allow_subset: bool = False, rule_note: str | None = None,
                   files: Files | tuple | None = None) -> Report:
    """Compare two traces; with fail_fast, stop at the first layer that breaks (see Session for the rest)."""
    s = Session(ref, cand, policy, calib, allow_subset, rule_note, files=files)
    if s.metadata_failed:
        return s.finish()
    for i in range(ref.n_layers):
        lr = s.add_layer(i)
        if fail_fast and lr.first_break is not None:
            return s.finish(stopped_early=i < ref.n_layers - 1)
    return s.finish()
