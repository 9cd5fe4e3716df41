"""The model's whole identity beyond its shapes, compared between two traces.

Shapes (``align.ARCH_KEYS``) decide whether two traces can be compared at all. The keys here do not
change a tensor's shape but do change what the model computes: two traces that differ in one of them do
not run the same model, so the comparison fails with an ``identity`` break (the layers are still compared
and shown), unless the user compares different models on purpose (``--allow-identity-difference``: a note).

Values are compared at the precision their source stores them: a GGUF file stores its float metadata
(``norm_eps``, ``rope_theta``, RoPE scaling factors) as float32, so 1e-5 from a config.json and the
9.999999747e-06 a GGUF holds are one value.
"""
from __future__ import annotations

import numpy as np

from . import parameters

ANYWHERE = "anywhere"  # a difference shows at the first layer it changes (weights: whose weights differ)
# key -> (what it is, where a difference first shows: (layer 0 tensors), "final" or ANYWHERE)
IDENTITY_KEYS = {
    "arch": ("architecture family", ("cache_keys", "cache_values", "attn_update")),
    "rope_theta": ("RoPE base", ("cache_keys", "attn_update", "attn_heads")),
    "rope_scaling": ("RoPE scaling", ("cache_keys", "attn_update", "attn_heads")),
    "norm_eps": ("RMSNorm epsilon", ("cache_keys", "cache_values", "attn_update", "attn_heads")),
    "hidden_act": ("MLP activation", ("mlp_update",)),
    "qkv_bias": ("Q/K/V bias", ("cache_keys", "cache_values", "attn_update", "attn_heads")),
    "qk_norm": ("QK-norm", ("cache_keys", "attn_update", "attn_heads")),
    "o_bias": ("attention output bias", ("attn_update",)),
    "mlp_bias": ("MLP biases", ("mlp_update",)),
    "norm_placement": ("norm placement", ("cache_keys", "cache_values", "attn_update", "attn_heads")),
    "norm_scale": ("RMSNorm weight rounding", ("cache_keys", "cache_values", "attn_update", "attn_heads")),
    "sliding_window": ("sliding window", ANYWHERE),
    "layer_types": ("which layers use the sliding window", ANYWHERE),
    "attention_multiplier": ("attention score scale", ("attn_update", "attn_heads")),
    "embedding_multiplier": ("embedding multiplier", ("layer_input", "cache_keys", "cache_values")),
    "residual_multiplier": ("residual multiplier", ("attn_update",)),
    "logits_scaling": ("logits scaling", "final"),
    "lm_head_bias": ("unembedding bias", "final"),
    "tie_embeddings": ("tied embeddings", "final"),
    "embed_scale": ("embedding scale", ("layer_input", "cache_keys", "cache_values")),
    "attn_softcap": ("attention soft-cap", ("attn_update", "attn_heads")),
    "final_softcap": ("final-logit soft-cap", "final"),
    "rope_local_theta": ("RoPE base of the window layers", ANYWHERE),
    "n_experts": ("number of experts", ANYWHERE),
    "n_active_experts": ("experts per token", ANYWHERE),
    "moe_hidden_dim": ("expert MLP width", ANYWHERE),
    "norm_topk_prob": ("top-k weights renormalised", ANYWHERE),
    "moe_weight_dtype": ("precision of the expert weights", ANYWHERE),
    "shared_expert_dim": ("shared expert width", ANYWHERE),
    "dense_layers": ("dense layers among the experts", ANYWHERE),
}
# ModelArgs fields that are not identity keys, and why: a size shows as a shape break; the rest do not change
# what a prefill computes
NOT_IDENTITY = {"dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size",  # sizes
                "max_position", "tokenizer_vocab_size", "dropout", "attention_rule"}
ADAPTER_FIRST = ("cache_keys", "cache_values", "attn_update", "attn_heads")  # LoRA on wq, wk, wv, wo


def stores_float32(meta: dict) -> bool:
    """The model's float metadata came from a GGUF file, which stores it as float32."""
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    spec = model.get("spec") if isinstance(model.get("spec"), dict) else {}
    source = str(spec.get("source") or model.get("source") or "")
    return source.startswith("gguf:") or source == "smollm2"


def same(r, c, float32: bool) -> bool:
    """r == c, floats compared as float32 when either side's source stores them so."""
    if isinstance(r, dict) and isinstance(c, dict):
        return r.keys() == c.keys() and all(same(r[k], c[k], float32) for k in r)
    numbers = (int, float)
    if float32 and isinstance(r, numbers) and isinstance(c, numbers) and not isinstance(r, bool) \
            and not isinstance(c, bool) and (isinstance(r, float) or isinstance(c, float)):
        with np.errstate(over="ignore"):
            return bool(np.float32(r) == np.float32(c))
    return r == c


def _shown(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_shown(x)}" for k, x in sorted(v.items())) + "}" if v else "none"
    if isinstance(v, str):
        return repr(v)  # foreign text: quoted, control characters escaped
    return "none" if v is None else str(v)


def _adapter(a) -> str:
    if not a:
        return "none"
    digest = str(a.get("digest", "?"))
    return f"{a.get('id', '?')!r} (digest {digest[:19]}…, rank {a.get('rank', '?')})"


def differences(ref_meta: dict, cand_meta: dict) -> list[dict]:
    """[{key, what, reference, candidate, first}] for every identity key that differs (absent keys: skipped,
    a trace from another writer may not record them)."""
    rm, cm = ref_meta.get("model") or {}, cand_meta.get("model") or {}
    ra, ca = rm.get("args") or {}, cm.get("args") or {}
    f32 = stores_float32(ref_meta) or stores_float32(cand_meta)
    out = []
    for key, (what, first) in IDENTITY_KEYS.items():
        if key not in ra or key not in ca:
            continue
        r, c = ra[key], ca[key]
        if key == "rope_scaling":
            r, c = dict(r or {}), dict(c or {})
        if not same(r, c, f32):
            out.append({"key": key, "what": what, "reference": _shown(r), "candidate": _shown(c), "first": first})
    r, c = rm.get("weights_digest"), cm.get("weights_digest")
    if r and c and r != c:
        out.append({"key": "weights_digest", "what": "weights", "reference": f"{str(r)[:19]}…",
                    "candidate": f"{str(c)[:19]}…", "first": ANYWHERE})
    r, c = rm.get("adapter"), cm.get("adapter")
    if ("adapter" in rm or "adapter" in cm) and (
            (r or {}).get("id"), (r or {}).get("digest")) != ((c or {}).get("id"), (c or {}).get("digest")):
        out.append({"key": "adapter", "what": "LoRA adapter", "reference": _adapter(r), "candidate": _adapter(c),
                    "first": ADAPTER_FIRST})
    return out + parameters.differences(ref_meta, cand_meta)


def note(d: dict) -> str:
    if "says" in d:
        return f"MODEL IDENTITY DIFFERS: {d['says']}: the two sides do not run the same model"
    return (f"MODEL IDENTITY DIFFERS: {d['key']} ({d['what']}) is {d['reference']} in the reference, "
            f"{d['candidate']} in the candidate: the two sides do not run the same model")


ALLOW = "pass --allow-identity-difference to compare different models on purpose"


def hint(diffs: list[dict], fb, allowed: bool = True) -> str | None:
    """The diagnosis when the identities differ: the difference, and whether ``fb`` (the first break of a
    layer or of the final stage, or None) sits where that difference first shows."""
    if not diffs:
        return None
    if fb is None or fb.stage == "metadata":
        text = ("The two sides do not run the same model (" + "; ".join(
            d.get("says") or f"{d['key']} {d['reference']} vs {d['candidate']}" for d in diffs) +
                "), although no layer or final "
                "check broke tolerance: the difference does not show on these inputs at this tolerance")
        return text + ("." if allowed else f"; {ALLOW}.")
    where = (f"layer-{fb.layer} {fb.tensor}" if fb.stage == "layer" else f"final {fb.tensor}") + " break"
    parts = []
    for d in diffs:
        first = d["first"]
        fits = first == ANYWHERE or ((fb.stage == "final") if first == "final" else
                                     (fb.stage == "layer" and fb.layer == 0 and fb.tensor in first))
        says = d.get("says") or f"{d['key']} differs (reference {d['reference']} vs candidate {d['candidate']})"
        parts.append(f"{says}: consistent with the {where}" if fits else
                     f"{says}: it would first show at " +
                     ("the final logits" if first == "final" else f"layer 0 {'/'.join(first)}") +
                     f", the first break is the {where}")
    return ("The two sides do not run the same model: " + "; ".join(parts) +
            ". Make the configurations agree before reading the break as a numeric or kernel difference"
            + ("." if allowed else f", or {ALLOW}."))
