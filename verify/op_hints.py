"""Why two engines' bits part at an op, where the cause is known from the engines' code (the hint of a ``bits``
break and of a replayed op that differs itself)."""
from __future__ import annotations

GEMMS = ("q", "k", "v", "o_proj", "gate", "up", "down")
NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm")
ROTARY = ("q_rope", "k_rope", "cache_keys")


def how(meta: dict) -> dict:
    """{op name: how the engine computes it}, as its trace declares (meta.record.ops.how)."""
    got = ((meta.get("record") or {}).get("ops") or {}).get("how") or {}
    return got if isinstance(got, dict) else {}


def buffer_dtypes(meta: dict) -> dict:
    """{buffer name: dtype} of the model as the engine held it (meta.parameters), e.g. RoPE's inv_freq."""
    tensors = (meta.get("parameters") or {}).get("tensors") or []
    return {t.get("name"): t.get("dtype") for t in tensors if isinstance(t, dict) and t.get("kind") == "buffer"}


def inv_freq_cast(ref_meta: dict, cand_meta: dict) -> str | None:
    """A RoPE inv_freq buffer whose dtype differs between the two sides, in words."""
    r, c = buffer_dtypes(ref_meta), buffer_dtypes(cand_meta)
    for name in r:
        if name.endswith("inv_freq") and name in c and r[name] != c[name]:
            return (f"RoPE's {name} is {r[name]} in the reference and {c[name]} in the candidate: a model loaded in "
                    "float32 and then cast casts its buffers too (load it with its dtype, or keep inv_freq float32)")
    return None


def op_cause(name: str, layer: int | None, ref_meta: dict, cand_meta: dict) -> str | None:
    """The known cause of bits parting at op (or state) ``name``, or None: RoPE's inv_freq cast, else how each
    engine says it computes the op (meta.record.ops.how) where the two differ, else the op's kind."""
    cast = inv_freq_cast(ref_meta, cand_meta)
    if cast and name in ROTARY + ("attn_core", "attn_heads"):
        return cast
    key = "q_rope" if name == "cache_keys" else name
    r, c = how(ref_meta).get(key), how(cand_meta).get(key)
    if (r or c) and r != c:
        return "; ".join(f"{side} {what}" for side, what in (("the reference", r), ("the candidate", c)) if what)
    if name in GEMMS:
        return "a GEMM kernel: the matrix multiply accumulates in another order or precision"
    if name in NORMS + ("attn_residual",):
        return "an RMSNorm or residual sum that rounds at another point (e.g. a cast to the activation dtype before " \
            "the weight multiply, or a fused add+norm that normalises the unrounded sum)"
    if name in ("attn_core", "attn_heads"):
        return "the attention kernel: its softmax and weighted sum accumulate in another order (eager, SDPA, flash)"
    if name in ROTARY:
        return "the rotary embedding: cos/sin computed or rounded in another precision"
    if name == "layer_input" and layer == 0:
        return "the embeddings differ (their weights, dtype or scale)"
    return cast


def bits_hint(b, ref_meta: dict, cand_meta: dict) -> str | None:
    """The hint of an exact verdict's break: where bits first part, and the known cause there."""
    cause = op_cause(b.tensor or "", b.layer, ref_meta, cand_meta)
    where = f"layer {b.layer} {b.tensor}" if b.layer is not None else f"final {b.tensor}"
    head = f"bits first part at {where}; every tensor before it is bitwise equal"
    return f"{head}. Known cause: {cause}." if cause else head + ". --replay-ops tells an op that differs itself " \
        "from one that only inherits a difference."
