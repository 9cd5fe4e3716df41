"""Hugging Face transformers as a candidate engine: an implementation we did not write.

The model runs unchanged; forward hooks hand its states to the same recorder our
engine uses, and its returned cache gives the keys (after RoPE) and values:

    decoder layer  -> layer_input (its input), layer_output (its output)
    self_attn      -> attn_update (o_proj output);  o_proj input -> attn_heads
    mlp            -> mlp_update;  mid = layer_input + attn_update, as the layer adds them
    (post-norm families: post_attention_layernorm and post_feedforward_layernorm's outputs are the updates)
    cache.layers[l].keys / .values -> the cache, at each sample's valid positions
"""
from __future__ import annotations

import os

import torch

from . import cache_entries, model_cache
from .cache import torch_dtype
from .errors import ConfigError, ModelLoadError
from .gguf_loader import smollm2_path
from .hub import hf_state_dict
from .parallel import current
from .calls import Placement, plan_calls


def check(prep) -> None:
    """What the transformers engine runs (the model as transformers does); anything else is refused in one line."""
    run = prep.side.run
    if run.tp > 1 and not prep.snapshot.source.startswith("hf:"):
        raise ConfigError("transformers' tensor parallelism loads a checkpoint with from_pretrained: give "
                          f"--model hf:DIR (got model {prep.snapshot.source!r})")
    unsupported = []
    if run.batching not in ("unbatched", "left", "right"):
        unsupported.append(f"batching={run.batching}")
    if run.reuse is not None:
        unsupported.append("prefix reuse")
    if run.fault is not None:
        unsupported.append(f"fault {run.fault.name}")
    if run.cache.chunk_size:
        unsupported.append("chunked prefill")
    if run.numerical.weight_quant != "none":
        unsupported.append("weight quantisation")
    if run.numerical.compile:
        unsupported.append("compile = true")
    lay = run.cache.layout
    if lay.kind != "contiguous" or lay.key_rotation != "post" or lay.dtype not in (None, run.numerical.dtype):
        unsupported.append("a non-default cache layout")
    if unsupported:
        raise ConfigError("the transformers engine runs the model as transformers does; it does not support "
                          + ", ".join(unsupported) + " (use engine = \"native\" for those)")


def hf_config(args):
    """A transformers config for our ModelArgs: OLMo 2 with post-norms, Qwen3 with per-head QK-norm, Qwen2 with
    Q/K/V biases alone, else Llama (its attention_bias puts biases on Q/K/V and the output projection together,
    mlp_bias on the MLP). A combination no transformers class computes is refused."""
    from transformers import LlamaConfig, Olmo2Config, Qwen2Config, Qwen3Config  # optional: imported when used
    rope = {"rope_theta": args.rope_theta, "rope_type": "default", **dict(args.rope_scaling)}
    common = dict(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
                  num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                  num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, rms_norm_eps=args.norm_eps,
                  rope_parameters=rope, tie_word_embeddings=args.tie_embeddings,
                  max_position_embeddings=args.max_position)
    qwen2 = args.qkv_bias and not args.o_bias
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
    if olmo2 and (args.mlp_bias or args.qkv_bias != args.o_bias):
        why.append("OLMo 2 with MLP biases, or with Q/K/V biases apart from the output projection's")
    if why:
        raise ConfigError(f"no transformers model class computes {'; '.join(why)} (model {args.arch})")
    if olmo2:
        return Olmo2Config(attention_bias=args.o_bias, **common)
    if args.qk_norm == "head":
        return Qwen3Config(attention_bias=args.o_bias, **common)
    if qwen2:
        return Qwen2Config(**common)
    return LlamaConfig(attention_bias=args.o_bias, mlp_bias=args.mlp_bias, **common)


def build_model(snapshot, dtype: str, attn: str):
    """transformers' own model: its own loader for real checkpoints, our weights for synthetic models."""
    try:
        from transformers import AutoModelForCausalLM  # optional: imported when used
    except ImportError:
        raise ModelLoadError("the transformers engine needs transformers: pip install 'prefill-diff[hf]'") from None
    if snapshot.adapter is not None:
        raise ConfigError("the transformers engine does not apply our LoRA adapters")
    tdt = torch_dtype(dtype)
    src = snapshot.source
    tp = current()
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
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{src}: transformers cannot load it from safetensors "
                                 f"({str(e).splitlines()[0][:200]})") from None
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
    if tp is not None:
        _check_sharded(model, snapshot.args, tp.world)
    return model.eval()


def _from_our_weights(auto, snapshot, tdt, attn):
    """A synthetic model: transformers' module built from its config, loaded with our weights."""
    model = auto.from_config(hf_config(snapshot.args), dtype=tdt, attn_implementation=attn)
    missing, unexpected = model.load_state_dict(
        {k: v.to(tdt) for k, v in hf_state_dict(snapshot.state).items()}, strict=False)
    missing = [m for m in missing if "rotary" not in m and not (snapshot.args.tie_embeddings and "lm_head" in m)]
    if missing or unexpected:
        raise ModelLoadError(f"weights do not fit transformers' model (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    if snapshot.args.tie_embeddings:
        model.tie_weights()
    return model


def _check_sharded(model, args, world: int) -> None:
    """Refuse a model transformers did not shard (it would run whole on every rank)."""
    k_w = model.model.layers[0].self_attn.k_proj.weight
    want = args.n_kv_heads // world * args.head_dim
    got = k_w.to_local().shape[0] if hasattr(k_w, "to_local") else k_w.shape[0]
    if got != want:
        raise ModelLoadError(f"transformers did not shard the model over {world} ranks (k_proj holds {got} "
                             f"rows per rank, expected {want})")


def _hooks(model, rec, states):
    def on_layer(i):
        def hook(mod, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            y = out[0] if isinstance(out, tuple) else out
            rec.state(i, "layer_input", x, 0)
            a = states.pop(("attn", i))
            rec.state(i, "attn_update", a, 0)
            rec.state(i, "mid", x + a, 0)
            rec.state(i, "mlp_update", states.pop(("mlp", i)), 0)
            rec.state(i, "layer_output", y, 0)
        return hook

    def keep(key):
        def hook(mod, args, out):
            states[key] = out[0] if isinstance(out, tuple) else out
        return hook

    def heads(i):
        def hook(mod, args):
            rec.state(i, "attn_heads", args[0], 0)
        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        # what each sub-layer adds to the residual: its output, or where the family normalises that output
        # (OLMo 2, Gemma: post_attention_layernorm and post_feedforward_layernorm) the norm's output
        post = hasattr(layer, "post_feedforward_layernorm")
        attn, mlp = ((layer.post_attention_layernorm, layer.post_feedforward_layernorm) if post else
                     (layer.self_attn, layer.mlp))
        handles.append(layer.register_forward_hook(on_layer(i), with_kwargs=True))
        handles.append(attn.register_forward_hook(keep(("attn", i))))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(heads(i)))
        handles.append(mlp.register_forward_hook(keep(("mlp", i))))
    handles.append(model.model.norm.register_forward_hook(keep("norm")))
    return handles


def forward_call(model, call, recorder) -> None:
    """One transformers forward over a padded rectangle, recorded through ``recorder`` (forward coordinates)."""
    ids, mask, pos = call.ids, call.mask, call.positions
    valid = mask.bool()
    tok = torch.where(valid, mask.cumsum(-1) - 1, torch.full_like(ids, -1))
    seq = torch.where(valid, torch.arange(ids.shape[0])[:, None].expand_as(ids), torch.full_like(ids, -1))
    recorder.inputs(ids, valid, pos, tok, seq)
    states = {}
    handles = _hooks(model, recorder, states)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.where(valid, ids, 0), attention_mask=mask, position_ids=pos, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    for layer, lc in enumerate(out.cache.layers):
        for b in range(ids.shape[0]):
            cols = valid[b].nonzero().flatten()
            recorder.cache(layer, b, lc.keys[b][:, cols], lc.values[b][:, cols], pos[b, cols])
    norm = states["norm"]
    for b in range(ids.shape[0]):
        c = int(valid[b].nonzero().flatten()[-1])
        recorder.final(b, norm[b, c], out.logits[b, c], (b, c), int(tok[b, c]))


def plan(prep, positions, pad: int, tp) -> None:
    """The calls of the run's batching, each one transformers forward."""
    prep.calls = plan_calls([list(t) for t in prep.tokens], positions, list(range(len(prep.tokens))),
                            prep.side.run.batching, pad)


def execute(prep, recorder):
    """Runs every call, then yields each layer (the forwards are done by then)."""
    run = prep.side.run
    check(prep)
    model = build_model(prep.snapshot, run.numerical.dtype, run.options.attn_implementation)
    for call in prep.calls:
        forward_call(model, call, Placement(recorder, call.runs, call.samples))
    for layer in range(prep.snapshot.args.n_layers):
        yield layer
    return prep.record
