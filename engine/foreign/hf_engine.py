"""Hugging Face transformers as a candidate engine: an implementation we did not write.

The model runs unchanged; forward hooks hand its states to the same recorder our
engine uses, and its returned cache gives the keys (after RoPE) and values:

    decoder layer  -> layer_input (its input), layer_output (its output)
    self_attn      -> attn_update: its output, followed through any module applied directly to it (the
                      post-norms of OLMo 2, Gemma, GLM-4), times Granite's residual_multiplier;
                      o_proj input -> attn_heads
    mlp            -> mlp_update, the same way;  mid = layer_input + attn_update, as the layer adds them
                      (absent, and said so in the trace, where the MLP reads the layer's input: a parallel block)
    cache.layers[l].keys / .values -> the cache, at each sample's valid positions (a sliding-window layer
                                       keeps only the rectangle's last W - 1 columns: those of them)
"""
from __future__ import annotations

import inspect
import os
from typing import NamedTuple

import torch

from ..models import cache_entries, model_cache
from ..models.dtypes import torch_dtype
from ..shared.errors import ConfigError, ModelLoadError
from ..models.gguf_loader import smollm2_path
from ..models.hf_names import hf_state_dict
from ..models.param_digests import module_digests, not_reported, stale_param, stale_param_layer
from ..models.routing import router_margin
from ..parallel import current
from ..calls import Placement, call_routing, forced_list, plan_calls
from ..decode import forward_facts, forward_starts, response_rows
from . import hf_ops


from .hf_release import LOWEST, _release_tuple, _sdpa_refusal, _tp_refusal, release  # noqa: F401 (read here)


def check(prep) -> None:
    """What the transformers engine runs (the model as transformers does); anything else is refused in one line."""
    run = prep.side.run
    found = release()
    if found is not None and _release_tuple(found) < LOWEST:
        raise ConfigError(f"the transformers engine runs transformers {'.'.join(map(str, LOWEST))} or later "
                          f"(found transformers {found}): pip install 'prefill-diff[hf]'")
    if run.options.attn_implementation == "sdpa" and (why := _sdpa_refusal(prep.snapshot.args)) is not None:
        raise ConfigError(why)
    if run.tp > 1 and (why := _tp_refusal()) is not None:
        raise ConfigError(why)
    if run.fault is not None and run.fault.name == "stale-param":
        stale_param_layer(run.fault, prep.snapshot.args.n_layers)
    if run.tp > 1 and not prep.snapshot.source.startswith("hf:"):
        raise ConfigError("transformers' tensor parallelism loads a checkpoint with from_pretrained: give "
                          f"--model hf:DIR (got model {prep.snapshot.source!r})")


def _moe_config(args, common: dict):
    """Mixtral (float32 top-k weights, always renormalised), Qwen2-MoE (Q/K/V biases, an optional gated shared
    expert) or Qwen3-MoE (per-head QK-norm); what none of them computes is refused."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    mixtral = args.moe_weight_dtype == "float32"
    qwen2 = args.qkv_bias and not args.o_bias and args.qk_norm == "none"
    qwen3 = args.qk_norm == "head" and not args.qkv_bias
    why = []
    if args.norm_placement != "pre" or args.norm_scale != "activation" or args.qk_norm == "proj" \
            or args.sliding_window is not None or args.attention_multiplier is not None or args.mlp_bias \
            or (args.embedding_multiplier, args.residual_multiplier, args.logits_scaling) != (1.0, 1.0, 1.0):
        why.append("experts with other norms, a window, Granite's multipliers or MLP biases")
    if mixtral and (args.qkv_bias or args.o_bias or args.qk_norm != "none" or args.shared_expert_dim
                    or args.dense_layers or args.moe_hidden_dim != args.hidden_dim or not args.norm_topk_prob):
        why.append("Mixtral's float32 expert weights with biases, QK-norm, a shared expert, dense layers, experts "
                   "of another width than the MLP's or top-k weights not renormalised")
    if not mixtral and not (qwen2 or qwen3):
        why.append("experts without Qwen2-MoE's Q/K/V biases or Qwen3-MoE's QK-norm")
    if qwen3 and args.shared_expert_dim:
        why.append("Qwen3-MoE with a shared expert")
    if why:
        raise ConfigError(f"no transformers model class computes {'; '.join(why)} (model {args.arch})")
    if mixtral:
        return MixtralConfig(num_local_experts=args.n_experts, num_experts_per_tok=args.n_active_experts, **common)
    moe = dict(num_experts=args.n_experts, num_experts_per_tok=args.n_active_experts,
               moe_intermediate_size=args.moe_hidden_dim, norm_topk_prob=args.norm_topk_prob,
               mlp_only_layers=list(args.dense_layers), decoder_sparse_step=1)
    if qwen2:
        return Qwen2MoeConfig(shared_expert_intermediate_size=args.shared_expert_dim, qkv_bias=True, **moe,
                              **common)
    return Qwen3MoeConfig(attention_bias=False, **moe, **common)


def hf_config(args):
    """A transformers config for our ModelArgs: OLMo 2 with post-norms, Qwen3 with per-head QK-norm, Qwen2 with
    Q/K/V biases alone, Granite with its multipliers, Mistral with a window on every layer, else Llama (its
    attention_bias puts biases on Q/K/V and the output projection together, mlp_bias on the MLP). A combination
    no transformers class computes is refused."""
    from transformers import (GraniteConfig, LlamaConfig, MistralConfig, Olmo2Config,  # optional: imported when
                              Phi3Config, Qwen2Config, Qwen3Config)                     # used
    rope = {"rope_theta": args.rope_theta, "rope_type": "default", **dict(args.rope_scaling)}
    common = dict(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
                  num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                  num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, rms_norm_eps=args.norm_eps,
                  rope_parameters=rope, tie_word_embeddings=args.tie_embeddings,
                  max_position_embeddings=args.max_position)
    if args.norm_placement == "sandwich":
        return _gemma_config(args, common)
    if args.n_experts:
        return _moe_config(args, common)
    qwen2 = args.qkv_bias and not args.o_bias
    granite = (args.attention_multiplier is not None or
               (args.embedding_multiplier, args.residual_multiplier, args.logits_scaling) != (1.0, 1.0, 1.0))
    window = args.sliding_window is not None
    why = []
    if args.o_bias and not args.qkv_bias:
        why.append("an output-projection bias without Q/K/V biases")
    if args.mlp_bias and (qwen2 or args.qk_norm != "none"):
        why.append("MLP biases " + ("with QK-norm" if args.qk_norm != "none" else "with Q/K/V biases alone"))
    if qwen2 and args.qk_norm != "none":
        why.append("QK-norm with Q/K/V biases but no output-projection bias")
    olmo2 = (args.norm_placement, args.qk_norm, args.norm_scale) == ("post", "proj", "float32")
    if not olmo2 and (args.norm_placement != "pre" or args.qk_norm == "proj" or args.norm_scale != "activation"):
        why.append(f"norm_placement={args.norm_placement} with qk_norm={args.qk_norm} and "
                   f"norm_scale={args.norm_scale} (OLMo 2 has post, proj and float32 together)")
    gemma = (args.norm_scale == "offset" or args.embed_scale != "none" or args.hidden_act != "silu"
             or args.attn_softcap is not None or args.final_softcap is not None or args.rope_local_theta is not None)
    if gemma:
        why.append("Gemma's (1 + w) norms, GeGLU, embedding scale, soft-caps or local RoPE base without its "
                   "sandwich norms")
    if olmo2 and (args.mlp_bias or args.qkv_bias != args.o_bias):
        why.append("OLMo 2 with MLP biases, or with Q/K/V biases apart from the output projection's")
    if granite and (qwen2 or args.qk_norm != "none" or olmo2 or window):
        why.append("Granite's multipliers with Q/K/V biases alone, QK-norm, post-norms or a sliding window")
    if window and (olmo2 or (not qwen2 and args.qk_norm == "none" and (args.qkv_bias or args.mlp_bias))):
        why.append("a sliding window with OLMo 2's norms or with Llama's biases")
    if window and args.layer_types and not (qwen2 or args.qk_norm == "head"):
        why.append("sliding and full layers mixed without Qwen2's biases or Qwen3's QK-norm (Mistral's window "
                   "is on every layer)")
    if why:
        raise ConfigError(f"no transformers model class computes {'; '.join(why)} (model {args.arch})")
    if window:
        kinds = [("sliding_attention" if args.window(i) else "full_attention") for i in range(args.n_layers)]
        common.update(sliding_window=args.sliding_window)
        if qwen2 or args.qk_norm == "head":
            common.update(use_sliding_window=True, layer_types=kinds)
    if olmo2:
        return Olmo2Config(attention_bias=args.o_bias, **common)
    if args.qk_norm == "head":
        return Qwen3Config(attention_bias=args.o_bias, **common)
    if qwen2:
        return Qwen2Config(**common)
    if args.arch == "phi3":
        if args.qkv_bias or args.mlp_bias or args.qk_norm != "none" or granite or args.layer_types:
            raise ConfigError("no transformers Phi-3 class computes biases, QK-norm, Granite's multipliers or "
                              "per-layer windows")
        scaling = dict(args.rope_scaling)
        return Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=args.sliding_window,
                          original_max_position_embeddings=scaling.get("original_max_position_embeddings",
                                                                       args.max_position),
                          **{**common, "rope_parameters": {k: list(v) if isinstance(v, tuple) else v
                                                           for k, v in rope.items()}})
    if granite:
        return GraniteConfig(attention_bias=args.o_bias, mlp_bias=args.mlp_bias,
                             attention_multiplier=args.head_dim ** -0.5 if args.attention_multiplier is None
                             else args.attention_multiplier, embedding_multiplier=args.embedding_multiplier,
                             residual_multiplier=args.residual_multiplier, logits_scaling=args.logits_scaling,
                             **common)
    if window:
        return MistralConfig(**common)
    return LlamaConfig(attention_bias=args.o_bias, mlp_bias=args.mlp_bias, **common)


def _gemma_config(args, common: dict):
    """Gemma 2 (no QK-norm) or Gemma 3 (per-head QK-norm, its local layers' own RoPE base)."""
    from transformers import Gemma2Config, Gemma3TextConfig
    want = dict(norm_scale="offset", embed_scale="sqrt_dim", hidden_act="gelu_pytorch_tanh", mlp_bias=False)
    why = [f"{k}={getattr(args, k)!r}" for k, v in want.items() if getattr(args, k) != v]
    if args.qk_norm not in ("none", "head") or args.qkv_bias != args.o_bias:
        why.append(f"qk_norm={args.qk_norm!r}, qkv_bias={args.qkv_bias}, o_bias={args.o_bias}")
    if args.qk_norm == "none" and args.rope_local_theta is not None:
        why.append("a local RoPE base without Gemma 3's QK-norm")
    if args.residual_multiplier != 1.0 or args.embedding_multiplier != 1.0 or args.logits_scaling != 1.0:
        why.append("Granite's multipliers")
    scalar = round((args.attn_scale or args.head_dim ** -0.5) ** -2)
    if scalar ** -0.5 != (args.attn_scale or args.head_dim ** -0.5):
        why.append(f"an attention scale ({args.attn_scale}) that is not an integer's inverse square root "
                   "(query_pre_attn_scalar)")
    if why:
        raise ConfigError(f"no transformers Gemma class computes sandwich norms with {'; '.join(why)} "
                          f"(model {args.arch})")
    kinds = [("sliding_attention" if args.window(i) else "full_attention") for i in range(args.n_layers)]
    common = {**common, "sliding_window": args.sliding_window or args.max_position, "layer_types": kinds,
              "query_pre_attn_scalar": scalar,
              "attn_logit_softcapping": args.attn_softcap, "final_logit_softcapping": args.final_softcap,
              "attention_bias": args.o_bias, "hidden_activation": args.hidden_act, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2}
    if args.qk_norm == "none":
        return Gemma2Config(**common)
    local = {"rope_type": "default", "rope_theta": args.rope_local_theta or args.rope_theta}
    return Gemma3TextConfig(**{**common, "rope_parameters": {"full_attention": common["rope_parameters"],
                                                             "sliding_attention": local}})


def build_model(snapshot, dtype: str, attn: str, load: str = "dtype", tensor_parallel: bool = True):
    """transformers' own model: its own loader for real checkpoints, our weights for synthetic models. ``load``
    (hf_options.LOADS): "dtype" loads the weights in ``dtype``, "cast" loads them in float32 and then casts the
    model, buffers included (RoPE's inv_freq), with ``model.to(dtype)``. ``tensor_parallel`` False: a process
    group this process is a rank of does not shard the model by heads (a data-parallel rank: engine/foreign/
    fsdp2_engine.py)."""
    try:
        from transformers import AutoModelForCausalLM  # optional: imported when used
    except ImportError:
        raise ModelLoadError("the transformers engine needs transformers: pip install 'prefill-diff[hf]'") from None
    cast = torch_dtype(dtype)
    tdt = cast if load == "dtype" else torch.float32
    src = snapshot.source
    tp = current() if tensor_parallel else None
    # tensor parallel (this process is one rank): transformers' own TP plan, with the size given explicitly —
    # tp_plan="auto" alone reads WORLD_SIZE and silently loads unsharded where it is not set
    dist = {}
    if tp is not None:
        from transformers.distributed import DistributedConfig
        dist = {"distributed_config": DistributedConfig(tp_size=tp.world)}
    if src.startswith("hf:"):
        try:  # safetensors only: transformers would otherwise fall back to a pickled pytorch_model.bin
            model = AutoModelForCausalLM.from_pretrained(src[3:], dtype=tdt, attn_implementation=attn,
                                                         local_files_only=True, use_safetensors=True, **dist)
        except (OSError, ValueError, KeyError) as e:  # KeyError: a config its release reads otherwise
            first = (str(e).splitlines() or [""])[0][:200]
            if isinstance(e, ValueError) and "attention implementation" in first:  # refused by the model class
                raise ConfigError(f"{src}: transformers cannot build it with attn_implementation={attn!r} "
                                  f"({first})") from None
            raise ModelLoadError(f"{src}: transformers {release()} cannot load it ({type(e).__name__}: {first})") \
                from None
    elif tp is not None:
        raise ConfigError(f"transformers' tensor parallelism needs --model hf:DIR (got {src!r})")
    elif src.startswith("gguf:") or src == "smollm2":
        path = smollm2_path() if src == "smollm2" else src[5:]
        kw = dict(dtype=tdt, attn_implementation=attn, local_files_only=True)
        model = model_cache.cached(  # transformers' own conversion of the GGUF, saved once
            path, "transformers",
            lambda: AutoModelForCausalLM.from_pretrained(os.path.dirname(path) or ".",
                                                         gguf_file=os.path.basename(path), **kw),
            cache_entries.save_hf_model,
            lambda entry: AutoModelForCausalLM.from_pretrained(entry.dir, use_safetensors=True, **kw))
    else:
        model = _from_our_weights(AutoModelForCausalLM, snapshot, tdt, attn)
    if snapshot.truncated_of is not None:  # --first-layers N: a checkpoint transformers loaded whole, cut here
        truncate(model, snapshot.args.n_layers)
    if tp is not None:
        _check_sharded(model, snapshot.args, tp.world)
    if load == "cast":
        model = model.to(cast)
    return model.eval()


def buffer_dtypes(model) -> dict:
    """{buffer name: dtype} of a model's buffers (RoPE's inv_freq among them): what a cast load changes."""
    return {name: str(b.dtype).removeprefix("torch.") for name, b in model.named_buffers()}


def _from_our_weights(auto, snapshot, tdt, attn):
    """A synthetic model: transformers' module built from its config, loaded with our weights."""
    try:
        model = auto.from_config(hf_config(snapshot.args), dtype=tdt, attn_implementation=attn)
    except ValueError as e:  # transformers refuses an attention implementation the family does not support
        raise ConfigError(f"transformers cannot build {snapshot.args.arch} with attn_implementation={attn!r} "
                          f"({str(e).splitlines()[0][:160]})") from None
    state = hf_state_dict(snapshot.state, fused=snapshot.args.arch == "phi3", arch=snapshot.args.arch,
                          in_memory=True)
    missing, unexpected = model.load_state_dict({k: v.to(tdt) for k, v in state.items()}, strict=False)
    missing = [m for m in missing if "rotary" not in m and not (snapshot.args.tie_embeddings and "lm_head" in m)]
    if missing or unexpected:
        raise ModelLoadError(f"weights do not fit transformers' model (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    if snapshot.args.tie_embeddings:
        model.tie_weights()
    return model


def truncate(model, n: int) -> None:
    """Keep a transformers causal LM's first ``n`` decoder layers (its final norm and head unchanged): the module
    list and the config its cache is built from (num_hidden_layers, layer_types)."""
    layers, _ = decoder(model)
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    name = "layers" if getattr(inner, "layers", None) is layers else "h"
    setattr(inner, name, torch.nn.ModuleList(list(layers)[:n]))
    for cfg in {id(c): c for c in (model.config, getattr(model.config, "text_config", model.config))}.values():
        cfg.num_hidden_layers = n
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = list(cfg.layer_types)[:n]


def _check_sharded(model, args, world: int) -> None:
    """Refuse a model transformers did not shard (it would run whole on every rank)."""
    k_w = model.model.layers[0].self_attn.k_proj.weight
    want = args.n_kv_heads // world * args.head_dim
    got = k_w.to_local().shape[0] if hasattr(k_w, "to_local") else k_w.shape[0]
    if got != want:
        raise ModelLoadError(f"transformers did not shard the model over {world} ranks (k_proj holds {got} "
                             f"rows per rank, expected {want})")


_ATTN = ("self_attn", "attention", "self_attention", "attn")  # a decoder layer's attention, by its usual names
_MLP = ("mlp", "feed_forward", "block_sparse_moe", "ffn")
_OUT = ("o_proj", "out_proj", "dense", "wo")  # the attention's output projection (its input: attn_heads)


class _Call(NamedTuple):
    name: str
    input: torch.Tensor | None
    output: torch.Tensor


def decoder(model):
    """(decoder layers, final norm) of a transformers causal LM, under the names its classes use."""
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    layers = getattr(inner, "layers", None) or getattr(inner, "h", None)
    norm = next((getattr(inner, n) for n in ("norm", "final_layernorm", "ln_f") if getattr(inner, n, None) is not None),
                None)
    if layers is None or norm is None:
        raise ModelLoadError(f"transformers' {type(model).__name__} has no decoder layers and final norm under the "
                             "names the engine reads (model.layers and model.norm, or their usual aliases)")
    return layers, norm


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _updates(x, calls: list[_Call], scale: float):
    """What the attention and the MLP add to the residual, followed by data flow: each sub-layer's output
    through any module applied directly to it (OLMo 2's and Gemma's post-norms, GLM-4's), times Granite's
    residual_multiplier; and whether the block is parallel (the MLP reads the layer's input, not U)."""
    def find(names):
        return next((i for i, c in enumerate(calls) if c.name in names), None)

    def follow(i):
        v = calls[i].output
        for c in calls[i + 1:]:
            if c.input is v:
                v = c.output
        return v if scale == 1.0 else v * scale

    ai, mi = find(_ATTN), find(_MLP)
    if ai is None or mi is None:
        raise ModelLoadError("a decoder layer without an attention or an MLP child under the usual names "
                             f"(children called: {[c.name for c in calls]})")
    from_x = {id(x)} | {id(c.output) for c in calls if c.input is x}
    return follow(ai), follow(mi), id(calls[mi].input) in from_x


def _router(layer):
    """A mixture of experts' router in a transformers decoder layer (its forward returns router logits, top-k
    weights and top-k ids), or None."""
    gate = getattr(getattr(layer, "mlp", None), "gate", None)
    return gate if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "num_experts") else None


def _routing_hook(i, gate, rec, cells, forced: dict, at=(0,)):
    """Records a router's choices over the forward's (B, S) cells (the call's from column ``at[0]``), forcing
    ``forced`` {(seq, tok): experts} first: the weights at a forced cell are the router's own probabilities there,
    renormalised as the model does."""
    k = gate.top_k
    renorm = bool(getattr(gate, "norm_topk_prob", True))  # Mixtral always renormalises

    def hook(mod, args, out):
        logits, scores, ids = out
        B = cells[0].shape[0]
        S = logits.shape[0] // B
        tok, seq = cells[0][:, at[0]:at[0] + S], cells[1][:, at[0]:at[0] + S]
        if forced:
            f = torch.full((B, S, k), -1, dtype=torch.long)
            for (sq, t), experts in forced.items():
                f[(seq == sq) & (tok == t)] = torch.as_tensor(experts, dtype=torch.long)
            f = f.reshape(-1, k)
            rows = (f >= 0).all(dim=-1)[:, None]
            w = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, f.clamp(min=0))
            if renorm:
                w = w / w.sum(dim=-1, keepdim=True)
            ids, scores = torch.where(rows, f, ids), torch.where(rows, w.to(scores.dtype), scores)
        margin, scale = router_margin(logits, k)
        rec.routing(i, ids.reshape(B, S, k), scores.reshape(B, S, k), margin.reshape(B, S), scale.reshape(B, S),
                    logits.reshape(B, S, -1), at[0])
        return (logits, scores, ids) if forced else None
    return hook


def _hooks(model, rec, states, absent: dict, cells=None, forced: dict | None = None, at=(0,)):
    """The hooks that record a forward; ``at[0]``: the first column the forward computes (a decode step's)."""
    layers, final_norm = decoder(model)
    scale = getattr(model.config, "residual_multiplier", 1.0)  # Granite scales each update as it adds it

    def on_layer(i):
        def hook(mod, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            a, m, parallel = _updates(x, states.pop(("calls", i)), scale)
            rec.state(i, "layer_input", x, at[0])
            rec.state(i, "attn_update", a, at[0])
            if parallel:  # attention and MLP both read the layer's input: U is not a state of this block
                absent["mid"] = (f"{hf_ops.class_name(mod)} adds attention and MLP to its input in parallel: there is "
                                 "no residual state between them")
            else:
                rec.state(i, "mid", x + a, at[0])
            rec.state(i, "mlp_update", m, at[0])
            rec.state(i, "layer_output", _first(out), at[0])
        return hook

    def called(i, name):
        def hook(mod, args, kwargs, out):
            inp = args[0] if args else kwargs.get("hidden_states")
            states.setdefault(("calls", i), []).append(_Call(name, inp, _first(out)))
        return hook

    def heads(i):
        def hook(mod, args):
            rec.state(i, "attn_heads", args[0], at[0])
        return hook

    def keep_norm(mod, args, out):
        states["norm"] = _first(out)

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(on_layer(i), with_kwargs=True))
        for name, child in layer.named_children():
            handles.append(child.register_forward_hook(called(i, name), with_kwargs=True))
        attn = next((getattr(layer, n) for n in _ATTN if hasattr(layer, n)), None)
        out_proj = next((getattr(attn, n) for n in _OUT if isinstance(getattr(attn, n, None), torch.nn.Linear)), None)
        if out_proj is not None:  # no output projection under a usual name: attn_heads is not recorded
            handles.append(out_proj.register_forward_pre_hook(heads(i)))
        gate = _router(layer)
        if gate is not None and cells is not None:
            handles.append(gate.register_forward_hook(_routing_hook(i, gate, rec, cells, (forced or {}).get(i), at)))
    handles.append(final_norm.register_forward_hook(keep_norm))
    return handles + hf_ops.capture(model, layers, rec, at)  # op-level states, when the trace records them


def forward_call(model, call, recorder, routing: dict | None = None, record_routing: bool = False,
                 decode_from: dict | None = None, logits_from: dict | None = None) -> dict:
    """A padded rectangle through transformers, recorded through ``recorder`` (forward coordinates): one forward,
    or with ``decode_from`` ({row: token index}) the prompts in one forward, then one forward per column against
    the model's own cache (its decode: past_key_values, the attention mask so far, the step's position ids).
    ``logits_from`` ({row: token index}): the logits from that token on are recorded too (a response's). Returns
    {state: why} for the states its layers do not have. ``routing``: experts to force, {layer: {(row, token
    index): experts}} (routing replay)."""
    ids, mask, pos = call.ids, call.mask, call.positions
    valid, tok, seq = _cells(call)
    recorder.inputs(ids, valid, pos, tok, seq)
    n = ids.shape[1]
    starts = forward_starts(tok, seq, n, n, decode_from or {})
    if len(starts) > 1:
        recorder.steps(*forward_facts(tok, seq, starts, decode_from))
    states, absent, at = {}, {}, [0]
    handles = _hooks(model, recorder, states, absent, (tok, seq) if record_routing else None, routing, at)
    logits, norm, cache = [], [], None
    given = cache_argument(model)
    try:
        with torch.no_grad():
            for a, b in zip(starts, starts[1:] + [n]):
                at[0] = a
                out = model(input_ids=torch.where(valid, ids, 0)[:, a:b], attention_mask=mask[:, :b],
                            position_ids=pos[:, a:b], use_cache=True, **({given: cache} if cache is not None else {}))
                cache = returned_cache(out)
                logits.append(out.logits)
                norm.append(states["norm"])
    finally:
        for h in handles:
            h.remove()
    logits, norm = torch.cat(logits, 1), torch.cat(norm, 1)  # (B, n, V), (B, n, dim)
    for b, t0 in (logits_from or {}).items():  # a response's rows: the logits before each of its tokens
        cols = (valid[b] & (tok[b] >= t0) & (tok[b] < int(tok[b].max()))).nonzero().flatten()
        recorder.response_logits(b, tok[b, cols], logits[b, cols])
    for layer, lc in enumerate(cache.layers):
        first = ids.shape[1] - lc.keys.shape[2]  # a sliding-window layer keeps only the last W - 1 columns
        for b in range(ids.shape[0]):
            cols = valid[b].nonzero().flatten()
            cols = cols[cols >= first]
            recorder.cache(layer, b, lc.keys[b][:, cols - first], lc.values[b][:, cols - first], pos[b, cols])
    for b in range(ids.shape[0]):
        c = int(valid[b].nonzero().flatten()[-1])
        recorder.final(b, norm[b, c], logits[b, c], (b, c), int(tok[b, c]))
    return absent


def _cells(call):
    """(valid, token index, sequence) of each cell of a call's rectangle (B, n); -1 at padding."""
    valid = call.mask.bool()
    tok = torch.where(valid, call.mask.cumsum(-1) - 1, torch.full_like(call.ids, -1))
    rows = torch.arange(call.ids.shape[0])[:, None].expand_as(call.ids)
    return valid, tok, torch.where(valid, rows, torch.full_like(call.ids, -1))


def forwards(call, decode_from: dict | None = None) -> int:
    """How many model forwards ``forward_call`` runs for ``call``: one, or the prompts' and one per decode step."""
    _, tok, seq = _cells(call)
    n = call.ids.shape[1]
    return len(forward_starts(tok, seq, n, n, decode_from or {}))


def cache_argument(model) -> str:
    """The name a model's forward takes the cache so far under: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (5.24 to 5.39 still take the old name, with a deprecation message)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out):
    """The KV cache a transformers forward returns: the output field is ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (5.24 still answers the old name, with a deprecation message)."""
    fields = getattr(type(out), "__dataclass_fields__", {})
    return out.cache if "cache" in fields else out.past_key_values


def plan(prep, positions, pad: int, tp) -> None:
    """The calls of the run's batching, each one transformers forward."""
    prep.calls = plan_calls([list(t) for t in prep.tokens], positions, list(range(len(prep.tokens))),
                            prep.side.run.batching, pad)


def generate(prep, n: int) -> tuple:
    """Each sample's next ``n`` tokens as transformers' model chooses them greedily (argmax), one forward of the
    sequence so far per token."""
    opts = prep.side.run.options
    model = build_model(prep.snapshot, prep.side.run.dtype, opts.attn_implementation, opts.load)
    out = []
    with torch.no_grad():
        for toks in prep.tokens:
            ids = torch.tensor([list(toks)])
            for _ in range(n):
                z = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0, -1]
                ids = torch.cat([ids, torch.argmax(z).view(1, 1)], 1)
            out.append(tuple(ids[0, len(toks):].tolist()))
    return tuple(out)


def execute(prep, recorder):
    """Runs every call, then yields each layer (the forwards are done by then)."""
    run = prep.side.run
    check(prep)
    model = build_model(prep.snapshot, run.dtype, run.options.attn_implementation, run.options.load)
    prep.record["transformers"] = {"load": run.options.load, "buffers": buffer_dtypes(model)}
    if run.fault is not None and run.fault.name == "stale-param":
        layer = stale_param_layer(run.fault, prep.snapshot.args.n_layers)
        stale_param(model, f"model.layers.{layer}.self_attn.k_proj.weight")
    # the model as transformers holds it: named_parameters (tied weights once) and named_buffers (RoPE's inv_freq)
    recorder.update_meta(parameters=not_reported("a tensor-parallel rank holds a shard of each weight")
                         if run.tp > 1 else module_digests(model, "hf"))
    absent = {}
    if prep.routing:  # routing replay: the trace says where its router was overruled
        prep.record["routing_forced"] = forced_list(prep.routing)
    # routing is recorded for the mixtures of experts our engine implements (softmax routers whose sizes the trace
    # declares); a foreign MoE (sigmoid or grouped routers: DeepSeek-V3, GLM-4-MoE, OLMoE) records its states only
    moe = prep.snapshot.foreign is None and prep.snapshot.args.n_experts > 0
    for call in prep.calls:
        absent.update(forward_call(model, call, Placement(recorder, call.runs, call.samples),
                                   call_routing(prep.routing, call.samples), record_routing=moe,
                                   **response_rows(prep, call)))
    if absent:  # the trace says which states this model's layers do not have, and why
        recorder.update_meta(absent_states=absent)
    for layer in range(prep.snapshot.args.n_layers):
        yield layer
    return prep.record
