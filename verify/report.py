"""The verdict: a typed report, its fixed wording, and machine formats (JSON, JUnit XML).

``Report`` is what the CLI renders and what CI reads. Its JSON keys are
stable and documented in docs/report-format.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from ..dumps.provenance import provenance
from ..dumps.reader import Trace
from .breaks import Break
from .calibrate import below_float32, precisions, same_precisions
from .comparator import Comparator, LayerResult
from .diagnose import diagnose
from .exact import BITS_BEFORE, ExactResult, compare_exact
from .op_hints import bits_hint
from .final import FinalResult
from .align import decode_steps
from .logprobs import LogprobResult, compare_logprobs
from .identity import differences, hint as identity_hint, note
from .parameters import notes as parameter_notes
from .policy_file import default_policy_for
from .tolerance import Policy
from . import wording
from .wording import break_line

REPORT_VERSION = 1


class Timing(NamedTuple):
    """Seconds the comparison took (JUnit's ``time``; not in the JSON, which stays reproducible byte for byte).

    setup: aligning the samples and the metadata checks; layers: each compared layer; final: the final stage.
    """
    setup: float = 0.0
    layers: tuple = ()
    final: float = 0.0

    @property
    def total(self) -> float:
        return self.setup + sum(self.layers) + self.final

    def layer(self, i: int) -> float:
        """The i-th compared layer's seconds (0 where unknown)."""
        return self.layers[i] if 0 <= i < len(self.layers) else 0.0


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
    identity: tuple = ()  # the model identity differences (verify/identity.py), each a dict
    unreplayed: tuple = ()  # explained routing flips whose samples were not compared from their layer on
    replayed: tuple = ()  # the cells a routing replay forced the reference's experts at (dicts)
    replayed_flips: int = 0  # the explained flips that led to it
    logprobs: LogprobResult | None = None  # the response's log-prob figures (verify/logprobs.py)
    decode_steps: dict = field(default_factory=dict)  # (reference sample, token index) -> a side's decode step there
    exact: ExactResult | None = None  # --exact: every tensor bit for bit (verify/exact.py); the verdict is its
    replay: object = None  # --replay-ops: the candidate's ops fed the reference's inputs (verify/op_replay.py)
    timing: Timing = field(default=Timing(), compare=False)  # seconds, for JUnit; two equal verdicts are equal
    provenance: dict = field(default_factory=provenance, compare=False)  # who made the report, how, when

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
        """break_line, with the token's text beside its position when the model has a tokenizer, and the decode
        step that computed it when a side decoded there."""
        tok = self.token_at(b.sample, b.position)
        return break_line(b, None if tok is None or tok[1] is None else tok[1],
                          self.decode_steps.get((b.sample, b.position)))

    def __bool__(self) -> bool:
        return self.first_break is None and not self.failed_strict and not self.unreplayed

    def __repr__(self) -> str:  # the verdict line; as_dict() has everything
        return f"Report({self.verdict_line()})"

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
        if self.first_break is None and self.unreplayed:
            return "inconclusive"
        return "pass" if self else "fail"

    @property
    def flips(self) -> list:
        """Every routing flip the layers found, in layer order."""
        return [f for lr in self.layers if lr.routing is not None for f in lr.routing.flips]

    def routing_summary(self) -> dict | None:
        """Counts of the routing flips (None: no layer compared routing)."""
        compared = [lr.routing for lr in self.layers if lr.routing is not None]
        if not compared:
            return None
        flips = self.flips
        return {"tokens_compared": sum(r.compared for r in compared),
                "flips": len(flips), "explained": sum(f.explained for f in flips),
                "blamed": sum(not f.explained for f in flips), "replayed_flips": self.replayed_flips,
                "replayed": list(self.replayed),
                "not_compared_samples": sorted({f.sample for f in self.unreplayed})}

    def verdict_line(self) -> str:
        if self.first_break is None and self.unreplayed:
            return wording.routing_inconclusive(self.unreplayed, len(self.layers), self.n_layers)
        if self.first_break is None:
            line = wording.passed(len(self.layers), self.n_layers, inconclusive=bool(self.inconclusive),
                                  identity_differs=any(n.startswith("MODEL IDENTITY DIFFERS") for n in self.notes),
                                  strict=self.strict, exact=self.exact is not None)
            return line + (wording.routing_replayed(self.replayed_flips, len(self.replayed)) if self.replayed else "")
        return wording.failed(self.line(self.first_break))

    def as_dict(self) -> dict:
        fb = self.first_break
        return {
            "report_version": REPORT_VERSION,
            "provenance": self.provenance,
            "verdict": self.verdict,
            "verdict_line": self.verdict_line(),
            "first_break": None if fb is None else {**fb.as_dict(), **self._token_fields(fb),
                                                    "decode_step": self.decode_steps.get((fb.sample, fb.position))},
            "logprobs": None if self.logprobs is None else self.logprobs.as_dict(),
            "exact": None if self.exact is None else self.exact.as_dict(),
            "replay": None if self.replay is None else self.replay.as_dict(),
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
            "routing": self.routing_summary(),
            "identity_differences": [{k: d[k] for k in ("key", "what", "reference", "candidate")}
                                     for d in self.identity],
            "stopped_early": self.stopped_early,
            "samples": [{"reference": r, "candidate": c} for r, c in self.pairs],
            "reference": self.ref,
            "candidate": self.cand,
        }

    def _token_fields(self, b: Break) -> dict:
        tok = self.token_at(b.sample, b.position)
        return {"token_id": None if tok is None else tok[0], "token_text": None if tok is None else tok[1]}

def trace_summary(t: Trace, file: str | None, in_memory: bool = False) -> dict:
    """A side of the report: ``file`` is the name the report shows (None: the trace is gone, or was never
    written: ``in_memory``)."""
    m = t.meta
    return {"file": file, "in_memory": in_memory, "level": t.level, "format_version": t.version,
            "origin": m.get("side", {}).get("origin"), "engine": m.get("engine"),
            "weights_digest": m.get("model", {}).get("weights_digest"),
            "truncated": m.get("model", {}).get("truncated"),
            "adapter": m.get("model", {}).get("adapter"),
            "quantized_weights_digest": (m.get("record") or {}).get("quantized_weights_digest"),
            "layout": m.get("layout"), "provenance": m.get("provenance"),
            "prefill": _prefill((m.get("record") or {}).get("prefill"))}


PREFILL_KEYS = ("sample", "tokens", "from_cache", "computed", "steps")


def _prefill(p: dict | None) -> dict | None:
    """A trace's ``record.prefill`` (checked by its reader) in the report's key order."""
    if not isinstance(p, dict):
        return None
    return {"token_budget": p.get("token_budget"), "budget_per": p.get("budget_per"),
            "samples": [{k: o.get(k) for k in PREFILL_KEYS} for o in p.get("samples") or ()]}


def record_notes(t: Trace, side: str) -> tuple[list, list]:
    """Notes from what the engine recorded: reuse decisions, invariant violations, compile time, kernels that
    round bfloat16 toward zero, unshowable faults."""
    rec = t.meta.get("record") or {}
    notes, inconclusive = [], []
    reuse = [o for o in rec.get("reuse") or () if isinstance(o, dict)]
    hits = [(o["sample"], o["prefix_len"], int(t.lengths[o["sample"]])) for o in reuse if o.get("hit")]
    if hits:
        notes.append(wording.cache_hits(side, hits))
    for o in reuse:
        if o.get("expected") and not o.get("hit"):  # a cache hit was the point of the run, and none happened
            inconclusive.append(wording.warm_missed(side, o["sample"], o["reason"]))
        elif o.get("forced") or not o.get("hit"):
            notes.append(wording.reuse_refused(side, o["sample"], o["reason"], forced=bool(o.get("forced"))))
    notes += [wording.invariant_broken(side, v) for v in rec.get("invariant_violations") or ()]
    timing = rec.get("timing") or {}
    if timing.get("compile_s") is not None:
        notes.append(wording.compile_time(side, timing["compile_s"], timing.get("prefill_s")))
    vllm = rec.get("vllm")
    if isinstance(vllm, dict) and vllm.get("bf16_rounding") == "truncate":
        notes.append(wording.truncating_kernels(side))
    fault = rec.get("fault") or {}
    if fault.get("cannot_show"):
        inconclusive.append(fault["cannot_show"])
    forced = rec.get("routing_forced")
    if isinstance(forced, list) and forced:  # a routing replay: this side's router was overruled
        notes.append(wording.routing_was_forced(side, len(forced)))
    return notes, inconclusive


class Files(NamedTuple):
    """The file names a report shows for its two sides (None: recorded into a temporary file, removed)."""
    ref: str | None
    cand: str | None


class Session:
    """Builds a Report incrementally, so a caller may stop after any layer (--fail-fast).

    policy: a resolved Policy; None takes ``default_policy_for(ref.meta, cand.meta)`` (the baseline's declared
    tolerance, else the dtype defaults). files: the names the report shows; None: the traces' own names
    (``in_memory``: traces that were never written). rule_note: the rule in words when the caller knows it
    better (a candidate that is its own twin); uncalibrated: why a comparison that calls for calibration is not.
    allow_identity: two different models compared on purpose (the difference is a note, not a failure).
    """

    def __init__(self, ref: Trace, cand: Trace, policy: Policy | None = None, calib=None,
                 allow_subset: bool = False, rule_note: str | None = None, *, files: Files | tuple | None = None,
                 uncalibrated: str | None = None, allow_identity: bool = False, in_memory: bool = False,
                 exact: bool = False):
        start = time.perf_counter()
        self.exact = exact
        self.ref, self.cand = ref, cand
        self.in_memory = in_memory
        self.files = Files(None, None) if in_memory else Files(ref.name, cand.name) if files is None else Files(*files)
        self.cmp = Comparator(ref, cand, default_policy_for(ref.meta, cand.meta) if policy is None else policy,
                              calib, allow_subset)
        self.layers: list[LayerResult] = []
        self.first_break = self.cmp.metadata_break()
        self.first_checked = None  # the first break of a layer or of the final stage
        # a coverage break is a failure but the matched samples are still compared
        self.metadata_failed = self.first_break is not None and self.first_break.kind == "metadata"
        self.identity = () if self.metadata_failed else tuple(differences(ref.meta, cand.meta))
        self.allow_identity = allow_identity
        self.extra_notes = []
        if self.identity and not allow_identity:  # a different model: a failure; the layers are still compared
            if self.first_break is not None:  # coverage: said as a note, the identity break comes first
                self.extra_notes.append(self.first_break.message)
            self.first_break = Break(stage="metadata", kind="identity",
                                     message=wording.identity_differs(self.identity))
        self.rule = rule_note or describe_rule(self.cmp, uncalibrated)
        if exact:  # the verdict judges bits; the tolerance still marks the tables
            self.rule = f"bit for bit (--exact): the first tensor whose bits part fails; the tables' marks: {self.rule}"
        self.seconds = Timing(setup=time.perf_counter() - start)

    def _checked(self, b: Break | None) -> None:
        if self.first_checked is None and b is not None:
            self.first_checked = b
            if self.first_break is None:
                self.first_break = b

    def add_layer(self, i: int) -> LayerResult:
        start = time.perf_counter()
        lr = self.cmp.layer(self.ref.layer(i), self.cand.layer(i))
        self.seconds = self.seconds._replace(layers=self.seconds.layers + (time.perf_counter() - start,))
        self.layers.append(lr)
        self._checked(lr.first_break)
        return lr

    def finish(self, stopped_early: bool = False) -> Report:
        final = None
        if not self.metadata_failed and not stopped_early:
            start = time.perf_counter()
            final = self.cmp.final()
            self.seconds = self.seconds._replace(final=time.perf_counter() - start)
            self._checked(final.first_break)
        if stopped_early and self.layers:
            self.cmp.ctx.skipped.add(wording.stopped_at(self.layers[-1].layer, self.ref.n_layers))
        notes, inconclusive = self._notes()
        cand_steps = decode_steps(self.cand, self.cmp.pairs, 1)
        steps = {**decode_steps(self.ref, self.cmp.pairs, 0), **cand_steps}
        exact = None
        if self.exact and not self.metadata_failed:
            exact = compare_exact(self.ref, self.cand, self.cmp.pairs, self.cmp.ctx.align.cells, steps)
            if self.first_break is None or self.first_break.kind in BITS_BEFORE:
                self.first_break = exact.brk() or self.first_break
        fb = self.first_break
        if fb is not None and fb.kind == "bits":
            hint = bits_hint(fb, self.ref.meta, self.cand.meta)
        elif fb is not None and fb.kind == "identity":  # under --exact, where bits first part is the break it reads
            checked = self.first_checked
            if exact is not None and (checked is None or checked.kind in BITS_BEFORE):
                checked = exact.brk() or checked
            hint = identity_hint(list(self.identity), checked, allowed=False)
        else:  # the traces are still open: some hints read them
            hint = diagnose(fb, self.cmp.pairs, final, self.ref, self.cand, self.cmp.policy, self.layers, cand_steps)
        return Report(first_break=fb, layers=tuple(self.layers), final=final, policy=self.cmp.policy,
                      n_layers=self.ref.n_layers, notes=tuple(notes), skipped=tuple(sorted(self.cmp.skipped)),
                      inconclusive=tuple(inconclusive),
                      ref=trace_summary(self.ref, self.files.ref, self.in_memory),
                      cand=trace_summary(self.cand, self.files.cand, self.in_memory), pairs=tuple(self.cmp.pairs),
                      stopped_early=stopped_early, diagnosis=hint,
                      token_text={**(self.cand.meta.get("token_text") or {}),
                                  **(self.ref.meta.get("token_text") or {})} or None,
                      sample_tokens=tuple(tuple(int(t) for t in s) for s in self.ref.samples),
                      calibration=self.rule, identity=self.identity, unreplayed=tuple(self.cmp.unreplayed),
                      timing=self.seconds, logprobs=compare_logprobs(self.ref, self.cand, self.cmp.pairs),
                      decode_steps=steps, exact=exact)

    def _notes(self) -> tuple[list, list]:
        """(notes, faults that cannot show): model identity (when allowed to differ), the comparison's own notes,
        what each side recorded."""
        notes = [note(d) for d in self.identity] if self.allow_identity else []
        notes += self.extra_notes + list(self.cmp.notes) + parameter_notes(self.ref.meta, self.cand.meta)
        inconclusive = []
        for t, side in ((self.ref, "reference"), (self.cand, "candidate")):
            n, i = record_notes(t, side)
            notes += n
            inconclusive += i
        if self.ref.level != self.cand.level:
            notes.append(wording.levels_differ(self.ref.level, self.cand.level))
        return notes, inconclusive


def describe_rule(cmp: Comparator, uncalibrated: str | None = None) -> str:
    """How values are judged, in words: the calibrated rule, the declared rule and where its terms came from, or
    the fixed envelope and why it is not calibrated (``uncalibrated``) where either side is below float32."""
    p = cmp.policy
    if cmp.calib is not None:
        return wording.calibrated_rule(cmp.calib, p.name)
    if any(not str(v).endswith("default") for v in p.sources.values()):
        return wording.declared_rule(p.rule())
    rp, cp = precisions(cmp.ref.meta), precisions(cmp.cand.meta)
    if uncalibrated or below_float32(rp) or below_float32(cp) or not same_precisions(rp, cp):
        return wording.envelope_rule(p.name, p.rule(), uncalibrated)
    return wording.same_precisions_rule(p.name, p.rule())


def compare_traces(ref: Trace, cand: Trace, policy: Policy | None = None, *, fail_fast: bool = False, calib=None,
                   allow_subset: bool = False, rule_note: str | None = None, files: Files | tuple | None = None,
                   uncalibrated: str | None = None, allow_identity: bool = False, exact: bool = False) -> Report:
    """Compare two traces; with fail_fast, stop at the first layer that breaks (see Session for the rest); with
    ``exact``, the verdict is bit for bit (verify/exact.py)."""
    s = Session(ref, cand, policy, calib, allow_subset, rule_note, files=files, uncalibrated=uncalibrated,
                allow_identity=allow_identity, exact=exact)
    if s.metadata_failed:
        return s.finish()
    for i in range(ref.n_layers):
        lr = s.add_layer(i)
        if fail_fast and lr.first_break is not None:
            return s.finish(stopped_early=i < ref.n_layers - 1)
    return s.finish()
