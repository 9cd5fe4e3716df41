"""The vLLM worker's decode: a response written by vLLM's own decode steps, teacher-forced.

Loaded by its path by vllm_worker.py (as vllm_probes.py is) and run in vLLM's environment: it imports vLLM, torch
and nothing of prefill-diff. A request with a response runs with ``max_tokens = len(response) + 1`` and the
logits processor ``Force``, which leaves each of its steps one choice, the response's next token: the prompt is
prefilled as configured (prefix cache, chunked prefill), then each response token is fed back in a decode step of
its own, writing its K/V into the paged cache; the extra last step feeds the response's last token, so the cache
ends holding prompt + response, as one prefill of both would. vLLM's log-probs of the forced tokens come back
``raw_logprobs`` (the model's own distribution, before any processor): a processed log-prob of a forced token is
0 and says nothing.
"""
from __future__ import annotations

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

KEY = "prefill_diff_force"  # SamplingParams.extra_args: the token ids a request is forced to write
LOGPROBS_MODE = "raw_logprobs"


class Force(LogitsProcessor):
    """Per request of the persistent batch, the ids it must write: logits -inf but the forced id's, while the
    request has written fewer tokens than it is given (its running output list, which vLLM hands over by
    reference, says how many)."""

    def __init__(self, vllm_config, device, is_pin_memory: bool):
        self.rows = {}  # batch index -> (forced ids, the request's output token ids so far)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the argmax: greedy sampling must not skip it

    def update_state(self, update: BatchUpdate | None) -> None:
        if update is None:
            return
        for i in update.removed:
            self.rows.pop(i, None)
        for i, params, _, out in update.added:
            ids = (params.extra_args or {}).get(KEY) if params is not None else None
            if ids:
                self.rows[i] = (list(ids), out)
            else:
                self.rows.pop(i, None)
        for a, b, how in update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if how == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, (ids, out) in self.rows.items():
            k = len(out)
            if k < len(ids):
                keep = logits[i, ids[k]].clone()
                logits[i] = float("-inf")
                logits[i, ids[k]] = keep
        return logits


def engine_args(response: bool) -> dict:
    """LLM()'s arguments for a run with a response (none without): the forcing processor, raw log-probs."""
    return {"logits_processors": [Force], "logprobs_mode": LOGPROBS_MODE} if response else {}


def params(SamplingParams, response):
    """A request's sampling: one greedy token without a response; with one, its tokens forced and one more step
    that feeds its last token (what that step samples is not looked at), each forced token's raw log-prob
    returned (logprobs=0: the sampled token's alone)."""
    if not response:
        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    return SamplingParams(max_tokens=len(response) + 1, temperature=0.0, detokenize=False, logprobs=0,
                          extra_args={KEY: [int(t) for t in response]})


def response(i: int, logits: dict, output, p: int, resp, arrays: dict) -> dict:
    """A decoded sample's part of its frame: the logits predicting each response token (at token indices p-1 ..
    p+len(resp)-2, the prompt's last to the response's last but one) into ``arrays``; the header's ``written``
    (what vLLM wrote) and ``vllm_logprobs`` (its own log-prob of each)."""
    at = range(p - 1, p + len(resp) - 1)
    missing = [t for t in at if t not in logits]
    if missing:
        raise RuntimeError(f"vLLM decoded prompt {i} without the capture seeing the logits at tokens {missing}")
    arrays["response_logits"] = np.stack([logits[t] for t in at])
    ids, lps = written(output, resp)
    return {"written": ids, "vllm_logprobs": lps}


def written(output, response) -> tuple[list, list]:
    """What vLLM wrote for a forced request: its first len(response) token ids and their returned log-probs."""
    comp = output.outputs[0]
    ids = list(comp.token_ids)[:len(response)]
    lps = []
    for j, t in enumerate(ids):
        row = (comp.logprobs or [])[j] if comp.logprobs and j < len(comp.logprobs) else None
        lp = row.get(t) if row else None
        lps.append(float("nan") if lp is None else float(lp.logprob))
    return ids, lps


def shift_positions(positions, reqs, qsl, computed, decode_from) -> None:
    """The decode-position fault: a decode step's position id is the previous one (its token is rotated as the one
    before it); prefill rows are left alone."""
    for r, rid in enumerate(reqs):
        p = decode_from.get(rid)
        if p is not None and int(computed[r]) >= p:
            positions[qsl[r]:qsl[r + 1]] -= 1
