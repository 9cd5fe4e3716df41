"""The response's log-probs on both sides, the figures RL frameworks log when a trainer recomputes a rollout.

Per response token t of a sample, each side's log-prob is the float32 log_softmax of its raw logits at the token
before t, taken at t's id: logp_ref(t) and logp_cand(t); Δ(t) = logp_cand(t) − logp_ref(t). Over every response
token both traces hold:

- ``mean_abs_dlogp``, ``max_abs_dlogp``: mean and largest |Δ| (verl's ``training/rollout_probs_diff`` family);
- ``mean_abs_dp``: mean |exp(logp_cand) − exp(logp_ref)|;
- ``k3_kl``: mean of exp(−Δ) − 1 + Δ, Schulman's k3 estimator of KL(cand ‖ ref) from the tokens' log-probs alone
  (≥ 0, 0 only where the log-probs agree; verl's ``rollout_corr/kl`` with the candidate as the sampler);
- ``pearson_p``: Pearson correlation of the two sides' token probabilities (None below two tokens or with no spread);
- ``log_ppl_diff``: mean(−logp_cand) − mean(−logp_ref), the difference of the log-perplexities.

``largest`` lists the tokens with the largest |Δ| (sample, position, id, both log-probs); ``chosen_by`` says who chose
the response's tokens (``given``, the ``candidate``'s greedy choice, or the recorded side's own: ``self``). The figures are reported,
never judged here: the logits they come from are judged as values (verify/final.py, ``response_logits``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LARGEST = 5  # tokens listed by |Δlogp|


@dataclass(frozen=True)
class LogprobResult:
    tokens: int
    mean_abs_dlogp: float
    max_abs_dlogp: float
    mean_abs_dp: float
    k3_kl: float
    pearson_p: float | None
    log_ppl_diff: float
    largest: tuple  # dicts: sample, position (of the response token), token_id, reference, candidate, delta
    chosen_by: str = "given"  # who chose the response's tokens (the candidate trace's record.response)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "chosen_by": self.chosen_by, "mean_abs_dlogp": self.mean_abs_dlogp, "max_abs_dlogp": self.max_abs_dlogp,
                "mean_abs_dp": self.mean_abs_dp, "k3_kl": self.k3_kl, "pearson_p": self.pearson_p,
                "log_ppl_diff": self.log_ppl_diff, "largest": [dict(d) for d in self.largest]}


def log_softmax(z: np.ndarray) -> np.ndarray:
    """Rows' log_softmax in float32, as the RL frameworks take it from the logits."""
    z = z.astype(np.float32)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def token_logprobs(response: dict, row: int, tokens) -> dict:
    """{position of the response token: its log-prob} for one trace row (``tokens``: that row's token ids)."""
    ti = response["token_index"][row]
    keep = ti >= 0
    if not keep.any():
        return {}
    lp = log_softmax(response["logits"][row][keep])
    nxt = ti[keep] + 1
    ids = np.asarray(tokens, dtype=np.int64)[nxt]
    return dict(zip(nxt.tolist(), lp[np.arange(len(nxt)), ids].tolist()))


def compare_logprobs(ref, cand, pairs) -> LogprobResult | None:
    """The figures over every response token both traces hold (None when they share none)."""
    if ref.response is None or cand.response is None:
        return None
    rows = []
    for rs, cs in pairs:
        a = token_logprobs(ref.response, rs, ref.samples[rs])
        b = token_logprobs(cand.response, cs, cand.samples[cs])
        rows += [(rs, p, int(ref.samples[rs][p]), a[p], b[p]) for p in sorted(a.keys() & b.keys())]
    if not rows:
        return None
    lr = np.array([r[3] for r in rows], dtype=np.float64)
    lc = np.array([r[4] for r in rows], dtype=np.float64)
    d = lc - lr
    pr, pc = np.exp(lr), np.exp(lc)
    pearson = None
    if len(rows) > 1 and pr.std() > 0 and pc.std() > 0:
        pearson = float(np.corrcoef(pr, pc)[0, 1])
    order = np.argsort(-np.abs(d), kind="stable")[:LARGEST]
    largest = tuple({"sample": rows[i][0], "position": rows[i][1], "token_id": rows[i][2],
                     "reference": rows[i][3], "candidate": rows[i][4], "delta": float(d[i])} for i in order)
    said = ((getattr(cand, "meta", {}).get("record") or {}).get("response") or {}).get("chosen_by")
    return LogprobResult(chosen_by=said or "given", tokens=len(rows), mean_abs_dlogp=float(np.abs(d).mean()),
                         max_abs_dlogp=float(np.abs(d).max()), mean_abs_dp=float(np.abs(pc - pr).mean()),
                         k3_kl=float(np.mean(np.exp(-d) - 1 + d)), pearson_p=pearson,
                         log_ppl_diff=float(np.mean(-lc) - np.mean(-lr)), largest=largest)
