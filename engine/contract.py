"""The five preconditions of contract §2.1, checked before layer 0.

Each violation raises ``PreconditionError`` naming the rule and the offending values,
so a bad request fails before the model runs instead of giving a plausible answer.
"""
from __future__ import annotations

import torch

from .shared.errors import PreconditionError


def _integers(x: torch.Tensor, rule: str, what: str) -> None:
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise PreconditionError(rule, f"{what} must be integers (got dtype {x.dtype})")


def check_ids(input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
    """(1) every non-padding id is inside the vocabulary (and an id is an integer)."""
    _integers(input_ids, "2.1(1)", "token ids")
    bad = valid & ((input_ids < 0) | (input_ids >= vocab_size))
    if bool(bad.any()):
        b, i = (int(t) for t in bad.nonzero()[0])
        raise PreconditionError("2.1(1)", "every non-padding token id must be in [0, vocab_size) "
                                f"(sample {b}, position {i}: id {int(input_ids[b, i])}, vocab_size={vocab_size})")


def check_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(2) the validity mask G ∈ {0,1}^{B×n} agrees with the valid positions; returns G as bool."""
    if input_ids.dim() != 2:
        raise PreconditionError("2.1(2)", f"input_ids must be [B, n] (got shape {list(input_ids.shape)})")
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise PreconditionError("2.1(2)", "the validity mask must have the shape of input_ids "
                                f"(got mask {list(attention_mask.shape)}, ids {list(input_ids.shape)})")
    if attention_mask.dtype != torch.bool:
        bad = (attention_mask != 0) & (attention_mask != 1)
        if bool(bad.any()):
            b, i = (int(t) for t in bad.nonzero()[0])
            raise PreconditionError("2.1(2)", "the validity mask must hold only 0 and 1 "
                                    f"(sample {b}, position {i}: {attention_mask[b, i].item()})")
    valid = attention_mask.bool()
    empty = ~valid.any(1)
    if bool(empty.any()):
        raise PreconditionError("2.1(2)", "every sample needs at least one valid token "
                                f"(sample {int(empty.nonzero()[0, 0])} has none)")
    return valid


def check_contiguous(valid: torch.Tensor, seq: torch.Tensor) -> None:
    """(2) each sequence's valid tokens form one run: no padding inside a prompt."""
    B, n = valid.shape
    for b in range(B):
        for s in seq[b][valid[b]].unique().tolist():
            cols = (valid[b] & (seq[b] == s)).nonzero().flatten()
            holes = cols[1:] - cols[:-1] != 1
            if bool(holes.any()):
                at = int(cols[:-1][holes][0]) + 1
                raise PreconditionError("2.1(2)", "the validity mask must mark each prompt as one contiguous run "
                                        f"(sample {b}: a padding position {at} lies inside the prompt)")


def check_positions(positions: torch.Tensor, valid: torch.Tensor, seq: torch.Tensor, max_position: int) -> None:
    """(3) the position descriptor is defined for every valid position, increasing along each prompt."""
    if tuple(positions.shape) != tuple(valid.shape):
        raise PreconditionError("2.1(3)", "positions must have the shape of input_ids "
                                f"(got {list(positions.shape)}, ids {list(valid.shape)})")
    _integers(positions, "2.1(3)", "positions")
    bad = valid & ((positions < 0) | (positions >= max_position))
    if bool(bad.any()):
        b, i = (int(t) for t in bad.nonzero()[0])
        raise PreconditionError("2.1(3)", "every valid position needs a position id in [0, max_position) "
                                f"(sample {b}, position {i}: {int(positions[b, i])}, max_position={max_position})")
    for b in range(valid.shape[0]):
        for s in seq[b][valid[b]].unique().tolist():
            cells = (valid[b] & (seq[b] == s)).nonzero().flatten()
            p = positions[b, cells]
            down = p[1:] <= p[:-1]
            if bool(down.any()):
                j = int(down.nonzero()[0, 0])
                raise PreconditionError("2.1(3)", "position ids must increase along a prompt "
                                        f"(sample {b}, position {int(cells[j + 1])}: {int(p[j + 1])} "
                                        f"after {int(p[j])})")


def check_vocab(model, tokenizer_vocab_size: int | None) -> None:
    """(4) model, embedding, output vocabulary and tokenizer sizes are compatible."""
    V = model.args.vocab_size
    emb = model.tok_embeddings.weight.shape[0]
    out = getattr(model.output, "weight").shape[0]
    if emb != V or out != V:
        raise PreconditionError("2.1(4)", "embedding and output vocabularies must equal the model's vocab_size "
                                f"(got vocab_size={V}, embedding rows={emb}, output rows={out})")
    if tokenizer_vocab_size is not None and tokenizer_vocab_size > V:
        raise PreconditionError("2.1(4)", "the tokenizer's vocabulary must fit the model's "
                                f"(got tokenizer size={tokenizer_vocab_size}, vocab_size={V})")


def check_inference_mode(model, dropout_seed: int | None) -> None:
    """(5) dropout is off, or its random state is recorded."""
    if model.training and model.args.dropout > 0 and dropout_seed is None:
        raise PreconditionError("2.1(5)", "dropout must be off in inference, or its RNG seed recorded "
                                f"(got training mode with dropout={model.args.dropout} and no dropout_seed)")
