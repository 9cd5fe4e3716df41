"""What a job takes and gives back, as types: how a candidate is judged (``Tolerance``, ``Judging``), what a job
returns (``Outcome``, ``Recorded``), and the progress callbacks a display hands it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from ..dumps.reader import Trace
from ..verify.calibrate import DEFAULT_FACTOR
from ..verify.policy_file import default_policy_for, policy_spec, resolve_policy, spec_sources
from ..verify.report import Report
from ..verify.tolerance import Policy

# label of a side ("reference", "candidate", "golden (float64)", "twin (…)") -> its per-layer callback, or None
SideProgress = Callable[[str], Callable[[int], None] | None]


def progress_for(progress: SideProgress | None, label: str):
    return None if progress is None else progress(label)


def phase(progress: SideProgress | None, label: str) -> None:
    """Tell the progress display (if it has a ``phase``) that a step between sides begins."""
    if progress is not None and hasattr(progress, "phase"):
        progress.phase(label)


@dataclass(frozen=True)
class Outcome:
    """A job's verdict, and where its traces are kept (None: temporary or in memory, removed)."""
    report: Report
    ref_path: str | None = None
    cand_path: str | None = None
    replays: bool = False  # the candidate's engine can rerun with routing forced (routing replay)

    def __repr__(self) -> str:  # the verdict, not every layer's metrics
        return f"Outcome({self.report.verdict_line()}, ref_path={self.ref_path!r}, cand_path={self.cand_path!r})"

    @property
    def not_reached(self) -> list[int]:
        """Layers a run that stopped at its first break never compared (JUnit marks them skipped)."""
        if not self.report.stopped_early:
            return []
        reached = {lr.layer for lr in self.report.layers}
        return [i for i in range(self.report.n_layers) if i not in reached]


@dataclass(frozen=True)
class Recorded:
    """What ``record`` wrote: the trace, and the golden and twin of ``twin_of``."""
    path: str
    level: str
    n_layers: int
    n_samples: int
    golden: str | None = None
    twin: str | None = None
    twin_label: str | None = None


# -- how a candidate is judged: the options of run and compare, as types ------------------------------------

@dataclass(frozen=True)
class Tolerance:
    """The declared tolerance: the tolerance options (--policy, --atol, --rtol, --ntol, --row-rtol, --tolerance).
    None of them given declares nothing (the baseline's own, else the traces' dtypes decide)."""
    policy: str | None = None
    atol: float | None = None
    rtol: float | None = None
    ntol: float | None = None
    row_rtol: float | None = None
    tolerance_file: str | None = None

    def spec(self) -> dict | None:
        """The declared policy as a spec to store and resolve (reads --tolerance's file), or None."""
        return policy_spec(**asdict(self))

    @property
    def declared(self) -> bool:
        return self.spec() is not None


@dataclass(frozen=True)
class Judging:
    """How the candidate is held to the reference: a declared ``tolerance`` or a calibrated verdict
    (``calibrate``: None automatic, True forced, False off; ``factor``: the noise factor), whether reference
    samples without a counterpart (``allow_subset``) or a different model (``allow_identity``) are accepted,
    whether the comparison stops at the first break (``fail_fast``), and whether it judges bits (``exact``)."""
    tolerance: Tolerance = field(default_factory=Tolerance)
    calibrate: bool | None = None
    factor: float = DEFAULT_FACTOR
    allow_subset: bool = False
    allow_identity: bool = False
    fail_fast: bool = False
    exact: bool = False  # the verdict is bit for bit (verify/exact.py)
    replay_ops: bool = False  # run: the candidate's ops replayed on the reference's inputs (jobs/replay.py)


JUDGED = Judging()  # the defaults: the tolerance of the traces' dtypes, calibrated where the precisions ask for it


# -- the tolerance: resolved once per comparison ------------------------------------------------------------

def resolve(declared: Tolerance | None, ref: Trace, cand: Trace) -> Policy:
    """The policy a comparison uses: the flags' (``declared``) if they declare one, else the tolerance the
    reference trace declares, else the defaults of the traces' dtypes."""
    spec = declared.spec() if declared is not None else None
    if spec is not None:
        return resolve_policy(spec, ref.meta, cand.meta, spec_sources(**asdict(declared)))
    return default_policy_for(ref.meta, cand.meta)
