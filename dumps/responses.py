"""A response's rows as a trace keeps them (format 1.3): the raw logits at each token whose next token is one of
a sample's response tokens, the figures the log-prob comparison of RL frameworks is made of (verify/logprobs.py).
The job says which samples have a response and how long (``meta.record.response``); the engine hands over the
logits (``Recorder.response_logits``), and a trace that declares a response and lacks its rows is not written.
"""
from __future__ import annotations

import numpy as np

from .trace_file import RecorderError


class ResponseRows:
    """Per sample, the token indices and raw logits of its response rows, kept in memory until written."""

    def __init__(self, n_samples: int, declared, vocab: int):
        self.want = {int(o["sample"]): (int(o["prompt"]), int(o["response"])) for o in declared}
        self.R = max((r for _, r in self.want.values()), default=0)
        self.vocab = vocab
        self.token_index = np.full((n_samples, self.R), -1, dtype=np.int64)
        self.logits: np.ndarray | None = None  # (S, R, vocab) in the engine's float dtype, once one arrives
        self.source: str | None = None

    def add(self, sample: int, token_index: np.ndarray, logits: np.ndarray, source: str) -> None:
        if sample not in self.want:
            raise RecorderError(f"response_logits: sample {sample} has no response (meta.record.response)")
        prompt, n = self.want[sample]
        token_index = np.asarray(token_index, dtype=np.int64).reshape(-1)
        if logits.shape != (token_index.size, self.vocab):
            raise RecorderError(f"response_logits(sample {sample}): logits must be ({token_index.size}, {self.vocab})"
                                f" (got {tuple(logits.shape)})")
        slot = token_index - (prompt - 1)  # the logits at token prompt - 1 predict the response's first token
        if ((slot < 0) | (slot >= n)).any():
            raise RecorderError(f"response_logits(sample {sample}): token indices must be in [{prompt - 1}, "
                                f"{prompt + n - 2}] (got {token_index.min()}..{token_index.max()})")
        if self.logits is None:
            self.logits = np.full((self.token_index.shape[0], self.R, self.vocab), np.nan, dtype=logits.dtype)
            self.source = source
        self.token_index[sample, slot] = token_index
        self.logits[sample, slot] = logits

    def datasets(self):
        """(name, data, source dtype) of what to write: nothing for a trace without a response."""
        if not self.want:
            return ()
        logits = self.logits if self.logits is not None else np.full((*self.token_index.shape, self.vocab), np.nan,
                                                                      dtype=np.float32)
        return (("token_index", self.token_index, None), ("logits", logits, self.source))

    def check_complete(self) -> None:
        """Every declared response row was recorded."""
        for s, (_, n) in sorted(self.want.items()):
            got = int((self.token_index[s] >= 0).sum())
            if got != n:
                raise RecorderError(f"sample {s} declares a response of {n} tokens but the logits before {n - got} "
                                    "of them were never recorded (response_logits; the trace was not written)")
