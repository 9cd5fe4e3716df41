"""The model's own tokenizer (transformers' ``AutoTokenizer``), as every source hands it over: encode text without
special tokens, decode ids for reports.
"""
from __future__ import annotations

import os

from ..shared.errors import ModelLoadError


class Tokenizer:
    """The model's own tokenizer: encode text without special tokens, decode ids for reports."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = len(tok)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def hf_tokenizer(path: str):
    """The tokenizer saved in checkpoint directory ``path``, or None when it holds none."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                                  "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    try:
        return Tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except Exception as e:  # a broken tokenizer must not hide which file is bad
        raise ModelLoadError(f"hf:{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
