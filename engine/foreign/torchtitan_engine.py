"""TorchTitan's own model as a candidate engine: the trainer's forward, recorded through hooks.

The model is built from TorchTitan's own configs (its Qwen3 and Llama 3 TransformerBlocks, fused ``wqkv``,
RMSNorm, RoPE and flex attention) sized by our snapshot's ModelArgs, and loaded through TorchTitan's state-dict
adapter (``from_hf``) from the snapshot's weights under Hugging Face names. Parameters take the run's dtype; the
RoPE cache stays float32, as TorchTitan's mixed precision leaves buffers. It runs what a trainer runs: packed
documents without padding, split where the positions restart at 0 (``get_attention_masks``), no KV cache.

Where each state is read (``install_hooks``; ``hook_points`` is the one table of them):

    TransformerBlock          -> layer_input (its input), layer_output (its output)
    attention                 -> attn_update;  mid = layer_input + attn_update, as the block adds them
    feed_forward              -> mlp_update
    attention.wo (its input)  -> attn_heads
    inner_attention (inputs)  -> the cache: K after q/k-norm and RoPE, V, as the attention reads them (Llama 3's
                                 keys are rotated in TorchTitan's interleaved pair layout: put back in HF's)
    norm, the output          -> the final norm and the logits
"""
from __future__ import annotations

import torch

from ..calls import Placement, declare_ops_absent, plan_calls
from ..shared.op_replay import OP_NAMES
from ..decode import response_rows
from ..models.dtypes import torch_dtype
from ..models.hf_names import hf_state_dict
from ..shared.errors import ConfigError, ModelLoadError

FAMILIES = ("qwen3", "llama")  # TorchTitan's dense families the engine builds (its Qwen3, its Llama 3)


def _family_refusal(args) -> str | None:
    """Why TorchTitan's Qwen3 / Llama 3 classes cannot compute the model, or None."""
    family = "qwen3" if args.qk_norm == "head" else "llama"
    want_qk = {"qwen3": "head", "llama": "none"}
    why = []
    if args.arch not in FAMILIES:
        why.append(f"the {args.arch} family")
    if args.qk_norm != want_qk[family]:
        why.append(f"qk_norm={args.qk_norm!r}")
    if args.n_experts:
        why.append("a mixture of experts")
    for key in ("qkv_bias", "o_bias", "mlp_bias", "lm_head_bias"):
        if getattr(args, key):
            why.append(f"{key}=true")
    for key, plain in (("norm_placement", "pre"), ("norm_scale", "activation"), ("embed_scale", "none"),
                       ("hidden_act", "silu"), ("sliding_window", None), ("attn_softcap", None),
                       ("final_softcap", None), ("attention_multiplier", None), ("embedding_multiplier", 1.0),
                       ("residual_multiplier", 1.0), ("logits_scaling", 1.0)):
        if getattr(args, key) != plain:
            why.append(f"{key}={getattr(args, key)!r}")
    scaling = dict(args.rope_scaling).get("rope_type")
    if scaling is not None and not (family == "llama" and scaling == "llama3"):
        why.append(f"rope_type={scaling!r}")
    if why:
        return (f"the torchtitan engine builds TorchTitan's Qwen3 and Llama 3 models only (dense, no biases, "
                f"pre-norm, SwiGLU, no window): not {', '.join(why)} (model {args.arch})")
    return None


def check(prep) -> None:
    """What TorchTitan's language models compute; anything else is refused in one line."""
    why = _family_refusal(prep.snapshot.args)
    if why is not None:
        raise ConfigError(why)


def _rope(args, titan):
    scaling = dict(args.rope_scaling)
    if args.qk_norm == "head":
        return titan.CosSinRoPE.Config(dim=args.head_dim, max_seq_len=args.max_position, theta=args.rope_theta)
    extra = {}
    if scaling.get("rope_type") == "llama3":
        extra = dict(scaling="llama", scaling_factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                     high_freq_factor=scaling["high_freq_factor"],
                     original_max_position_embeddings=scaling["original_max_position_embeddings"])
    return titan.ComplexRoPE.Config(dim=args.head_dim, max_seq_len=args.max_position, theta=args.rope_theta,
                                    **extra)


def titan_config(args, attention: str):
    """TorchTitan's model config for our ModelArgs, with its state-dict adapter class: Qwen3 (per-head q/k-norm,
    cos/sin RoPE) or Llama 3 (complex RoPE, llama3 scaling), both with TorchTitan's fused wqkv."""
    from torchtitan.models import common as titan
    from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
    qwen3 = args.qk_norm == "head"
    if qwen3:
        from torchtitan.models.qwen3 import Qwen3Model as Model, Qwen3StateDictAdapter as Adapter, \
            Qwen3TransformerBlock as Block
    else:
        from torchtitan.models.llama3 import Llama3Model as Model, Llama3StateDictAdapter as Adapter, \
            Llama3TransformerBlock as Block

    def norm(n):
        return titan.RMSNorm.Config(normalized_shape=n, eps=args.norm_eps)

    rope = _rope(args, titan)
    layers = [Block.Config(
        attention_norm=norm(args.dim), ffn_norm=norm(args.dim),
        attention=make_gqa_config(dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                                  head_dim=args.head_dim, wqkv_param_init={}, wo_param_init={},
                                  inner_attention=get_attention_config(attention), fuse_qkv=True, rope=rope,
                                  qk_norm=norm(args.head_dim) if qwen3 else None),
        feed_forward=make_ffn_config(dim=args.dim, hidden_dim=args.hidden_dim, w1_param_init={},
                                     w2w3_param_init={}))
        for _ in range(args.n_layers)]
    cfg = Model.Config(vocab_size=args.vocab_size, dim=args.dim, norm=norm(args.dim),
                       enable_weight_tying=args.tie_embeddings,
                       tok_embeddings=titan.Embedding.Config(num_embeddings=args.vocab_size, embedding_dim=args.dim),
                       lm_head=titan.Linear.Config(in_features=args.dim, out_features=args.vocab_size),
                       layers=layers)
    return cfg, Adapter


def build_model(snapshot, dtype: str, options):
    """TorchTitan's model with the snapshot's weights (through its adapter's from_hf), parameters in ``dtype``;
    each block compiled as TorchTitan's trainer does when ``options.compile``."""
    args = snapshot.args
    cfg, adapter = titan_config(args, options.attention)
    model = cfg.build()
    hf = hf_state_dict(snapshot.state, arch=args.arch, in_memory=True)
    state = adapter(cfg, None).from_hf(dict(hf))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (args.tie_embeddings and m == "tok_embeddings.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"weights do not fit TorchTitan's model (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    tdt = torch_dtype(dtype)
    for p in model.parameters():  # buffers (the RoPE cache) stay float32, as under TorchTitan's mixed precision
        p.data = p.data.to(tdt)
    model.eval()
    if options.compile:
        for block in model.layers.values():
            block.compile(backend="inductor", fullgraph=True)
    return model


def _interleaved_to_half(k: torch.Tensor) -> torch.Tensor:
    """Llama 3's keys from TorchTitan's layout (rotation pairs adjacent: x0 y0 x1 y1 ...; its adapter permutes
    q_proj/k_proj so) to Hugging Face's (x0 x1 ... y0 y1 ...), over the last dim."""
    return k.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def hook_points(block) -> dict:
    """The states read inside one TransformerBlock: name -> (module, when, what). ``when``: "pre" (its
    inputs) or "post" (its output); ``what`` takes (args, output) and returns the tensor(s) to keep."""
    attn = block.attention
    return {
        "layer_input": (block, "pre", lambda a, o: a[0]),
        "layer_output": (block, "post", lambda a, o: o),
        "attn_update": (attn, "post", lambda a, o: o),
        "mlp_update": (block.feed_forward, "post", lambda a, o: o),
        "attn_heads": (attn.wo, "pre", lambda a, o: a[0]),
        "kv": (attn.inner_attention, "pre", lambda a, o: (a[1], a[2])),  # (B, L, H_kv, d_h) each
    }


def install_hooks(model, kept: dict) -> list:
    """Hooks that keep every hook point's tensor of the next forward in ``kept`` {(layer, name): tensor}, and
    the final norm's output under ("final", "norm"). Returns their handles."""
    handles = []

    def pre(key, what):
        def hook(mod, args, kwargs):
            kept[key] = what(args, None)
        return hook

    def post(key, what):
        def hook(mod, args, out):
            kept[key] = what(args, out)
        return hook

    for i, block in enumerate(model.layers.values()):
        for name, (mod, when, what) in hook_points(block).items():
            if when == "pre":
                handles.append(mod.register_forward_pre_hook(pre((i, name), what), with_kwargs=True))
            else:
                handles.append(mod.register_forward_hook(post((i, name), what)))
    handles.append(model.norm.register_forward_hook(post(("final", "norm"), lambda a, o: o)))
    return handles


def _cells(call):
    """Per cell of the call (B, n): its sequence (index into call.samples) and token index, -1 for padding."""
    seq = torch.full(call.ids.shape, -1, dtype=torch.long)
    tok = torch.full(call.ids.shape, -1, dtype=torch.long)
    for run in call.runs:
        seq[run.row, run.c0:run.c1] = call.samples.index(run.sample)
        tok[run.row, run.c0:run.c1] = run.t0 + torch.arange(run.c1 - run.c0)
    return seq, tok


def forward_call(model, call, recorder, permuted: bool, logits_from: dict | None = None, **_) -> None:
    """One call (a packed row or one sequence) through TorchTitan's model, recorded through ``recorder`` (the
    call's coordinates)."""
    ids, pos = call.ids, call.positions
    seq, tok = _cells(call)
    valid = seq >= 0
    recorder.inputs(ids, valid, pos, tok, seq)
    kept = {}
    handles = install_hooks(model, kept)
    try:
        with torch.no_grad():
            logits = model(ids, pos, model.get_attention_masks(pos))  # (B, n, V)
    finally:
        for h in handles:
            h.remove()
    for i in range(len(model.layers)):
        x, a = kept[(i, "layer_input")], kept[(i, "attn_update")]
        for name in ("layer_input", "attn_update", "mlp_update", "layer_output", "attn_heads"):
            recorder.state(i, name, kept[(i, name)], 0)
        recorder.state(i, "mid", x + a, 0)
        k, v = kept[(i, "kv")]
        if permuted:
            k = _interleaved_to_half(k)
        for run in call.runs:
            q, cols = call.samples.index(run.sample), slice(run.c0, run.c1)
            recorder.cache(i, q, k[run.row, cols].transpose(0, 1), v[run.row, cols].transpose(0, 1),
                           pos[run.row, cols])
    norm = kept[("final", "norm")]
    for run in call.runs:
        q, c = call.samples.index(run.sample), run.c1 - 1
        if logits_from and q in logits_from:  # a response's rows: the logits before each of its tokens
            cols = torch.arange(run.c0, run.c1)
            cols = cols[(tok[run.row, cols] >= logits_from[q]) & (cols < c)]
            recorder.response_logits(q, tok[run.row, cols], logits[run.row, cols])
        recorder.final(q, norm[run.row, c], logits[run.row, c], (run.row, c), int(tok[run.row, c]))


def plan(prep, positions, pad: int, tp) -> None:
    """The calls of the run's batching: every prompt packed into one row, or one forward each."""
    prep.calls = plan_calls([list(t) for t in prep.tokens], positions, list(range(len(prep.tokens))),
                            prep.side.run.batching, pad)


def execute(prep, recorder):
    """Runs every call, then yields each layer (the forwards are done by then)."""
    run = prep.side.run
    check(prep)
    model = build_model(prep.snapshot, run.dtype, run.options)
    declare_ops_absent(recorder, prep.snapshot.args, dict.fromkeys(
        OP_NAMES, "the torchtitan engine hooks TorchTitan's blocks at the layer states only (registry op_states)"))
    permuted = prep.snapshot.args.qk_norm != "head"  # Llama 3: its adapter permutes q/k for complex RoPE
    for call in prep.calls:
        forward_call(model, call, Placement(recorder, call.runs, call.samples), permuted,
                     **response_rows(prep, call))
    for layer in range(prep.snapshot.args.n_layers):
        yield layer
    return prep.record
