"""transformers' op-level states (schema OP_TENSORS, ``--level ops``), captured from outside its model.

Each name is read where transformers computes it, per decoder layer:

    q, k, v        q_proj, k_proj, v_proj outputs (Phi-3's fused qkv_proj split by the model's sizes)
    q_norm, k_norm the attention's q_norm, k_norm outputs (Qwen3, Gemma 3: per head; OLMo 2: whole projection),
                   flattened to (B, S, heads·head_dim)
    q_rope, k_rope what the modeling module's ``apply_rotary_pos_emb`` returns, (B, heads, S, D) -> (B, S, heads·D):
                   the function is wrapped in that module for the forward, keyed on the layer being run (set by
                   the decoder layer's pre-hook)
    attn_core      o_proj's input;  o_proj its output
    gate, up       gate_proj, up_proj outputs (Phi-3's fused gate_up_proj split);  act_mul down_proj's input;
                   down its output
    attn_norm      the output of the layer's child that feeds the attention, when it reads the layer's input
    attn_residual  the residual sum the MLP side reads: the input of the child feeding the MLP (the
                   post-attention norm of a pre-norm layer, Gemma's pre-feedforward norm), or the MLP's own
                   input where nothing normalises it (OLMo 2's post-norm layer)
    mlp_norm       that child's output

found by data flow among the decoder layer's children, as hf_engine reads the layer's states. What a model does
not compute is declared absent with why (``declare_absent``), never filled from another op. Each layer's ops are
written when the layer ends, after hf_engine's own hook has written its states.
"""
from __future__ import annotations

import sys

import torch

from ..parallel import current

_ATTN = ("self_attn", "attention", "self_attention", "attn")
_MLP = ("mlp", "feed_forward", "block_sparse_moe", "ffn")


def _child(mod, names):
    return next((getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), torch.nn.Module)), None)


def class_name(mod) -> str:
    """The model's own class of ``mod``: FSDP2's fully_shard makes each sharded module an instance of a subclass
    ``FSDP<name>`` (torch.distributed's), named here by the class it subclasses."""
    return next(c.__name__ for c in type(mod).__mro__ if not c.__module__.startswith("torch.distributed"))


def _linear(mod, name):
    m = getattr(mod, name, None) if mod is not None else None
    return m if isinstance(m, torch.nn.Linear) else None


def _flat(x):
    x = x[0] if isinstance(x, tuple) else x
    return x.reshape(x.shape[0], x.shape[1], -1)  # (B, S, width)


class _Restore:
    """Puts a wrapped module-level function back; removed with the hooks' handles."""

    def __init__(self, module, name, original):
        self.module, self.name, self.original = module, name, original

    def remove(self):
        setattr(self.module, self.name, self.original)


def capture(model, layers, rec, at) -> list:
    """Hooks recording every op-level state of the forwards run while they are in place, through ``rec`` from
    column ``at[0]``; [] when the trace records none, or when this process is one rank of a tensor-parallel group (a
    rank computes its own heads' share of each op). Each handle has ``remove``."""
    ops = getattr(getattr(rec, "recorder", None), "ops", None)
    if ops is None:
        return []
    tp = current()
    tp = tp is not None and "tp" in tuple(getattr(tp.mesh, "mesh_dim_names", None) or ("tp",))
    declare_absent(ops, layers, tp)
    if tp:
        return []
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q_w, kv_w = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    running = [None]  # the decoder layer being run
    handles, pending = [], []

    def put(i, name, x):  # written when the layer ends, after hf_engine's hook has written the layer's states
        pending.append((i, name, _flat(x), at[0]))

    def flush():
        for args in pending:
            rec.op(*args)
        pending.clear()

    def out_hook(i, *names, split=None):
        def hook(mod, args, out):
            parts = [out] if split is None else list(torch.split(out, split, dim=-1))
            for name, x in zip(names, parts):
                put(i, name, x)
        return hook

    def in_hook(i, name):
        def hook(mod, args):
            put(i, name, args[0])
        return hook

    def pre_layer(i):
        def hook(mod, args):
            running[0] = i
        return hook

    last = max((i for i in range(len(layers)) if ops.wants(i)), default=None)
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_layer(i)))
        if not ops.wants(i):
            continue
        handles.extend(_data_flow(i, layer, put, flush, ops if i == last else None))
        attn, mlp = _child(layer, _ATTN), _child(layer, _MLP)
        for name, op in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o_proj"),
                         ("q_norm", "q_norm"), ("k_norm", "k_norm")):
            m = getattr(attn, name, None) if attn is not None else None
            if isinstance(m, torch.nn.Module):
                handles.append(m.register_forward_hook(out_hook(i, op)))
        if (m := _linear(attn, "qkv_proj")) is not None:  # Phi-3
            handles.append(m.register_forward_hook(out_hook(i, "q", "k", "v", split=(q_w, kv_w, kv_w))))
        if (m := _linear(attn, "o_proj")) is not None:
            handles.append(m.register_forward_pre_hook(in_hook(i, "attn_core")))
        for name, op in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            if (m := _linear(mlp, name)) is not None:
                handles.append(m.register_forward_hook(out_hook(i, op)))
        if (m := _linear(mlp, "gate_up_proj")) is not None:  # Phi-3: gate, then up
            handles.append(m.register_forward_hook(out_hook(i, "gate", "up", split=m.out_features // 2)))
        if (m := _linear(mlp, "down_proj")) is not None:
            handles.append(m.register_forward_pre_hook(in_hook(i, "act_mul")))
    module = _modeling_module(layers)
    if module is not None:
        original = module.apply_rotary_pos_emb

        def rotary(q, k, *args, **kwargs):
            q_rot, k_rot = original(q, k, *args, **kwargs)
            if running[0] is not None and ops.wants(running[0]):
                put(running[0], "q_rope", q_rot.transpose(1, 2))  # (B, heads, S, D) -> (B, S, heads, D)
                put(running[0], "k_rope", k_rot.transpose(1, 2))
            return q_rot, k_rot
        module.apply_rotary_pos_emb = rotary
        handles.append(_Restore(module, "apply_rotary_pos_emb", original))
    return handles


def _modeling_module(layers):
    """The modeling module whose attention calls ``apply_rotary_pos_emb`` by its global name, or None."""
    attn = _child(layers[0], _ATTN) if len(layers) else None
    module = sys.modules.get(type(attn).__module__) if attn is not None else None
    return module if callable(getattr(module, "apply_rotary_pos_emb", None)) else None


def _data_flow(i, layer, put, flush, ops=None) -> list:
    """Hooks on the layer's children and the layer itself: after the layer, attn_norm, attn_residual and mlp_norm
    by which child's output feeds which (see the module docstring), then every op of the layer is written. With
    ``ops`` (the last layer recorded), those of the three that no layer recorded are declared absent, with why."""
    calls = []

    def called(name):
        def hook(mod, args, kwargs, out):
            calls.append((name, args[0] if args else kwargs.get("hidden_states"), out[0] if isinstance(out, tuple)
                          else out))
        return hook

    def done(mod, args, kwargs, out):
        x = args[0] if args else kwargs["hidden_states"]
        seen, feeds = list(calls), {}
        calls.clear()
        for name, inp, out_ in seen:
            feeds.setdefault(name, (inp, out_))
        attn_in = next((feeds[n][0] for n in _ATTN if n in feeds), None)
        mlp_in = next((feeds[n][0] for n in _MLP if n in feeds), None)
        norm_in = {id(o): inp for _, inp, o in seen}  # a child's output -> its input
        if attn_in is not None and attn_in is not x and norm_in.get(id(attn_in)) is x:
            put(i, "attn_norm", attn_in)
        parallel = mlp_in is None or mlp_in is x or mlp_in is attn_in or norm_in.get(id(mlp_in)) is x
        if not parallel and id(mlp_in) in norm_in:  # (a parallel block's MLP reads the layer's input: no sum)
            put(i, "attn_residual", norm_in[id(mlp_in)])
            put(i, "mlp_norm", mlp_in)
        elif not parallel:
            put(i, "attn_residual", mlp_in)
        flush()
        cls = class_name(mod)
        why = {"attn_norm": f"{cls}'s attention reads the layer's input itself (no input norm)",
               "mlp_norm": f"{cls}'s MLP reads the residual sum itself (no norm before it)",
               "attn_residual": f"{cls} adds attention and MLP to its input in parallel: no residual sum between"}
        for name, reason in why.items() if ops is not None else ():
            if name not in ops.recorded:
                ops.absent(name, reason)

    handles = [layer.register_forward_hook(done, with_kwargs=True)]
    for name, child in layer.named_children():
        handles.append(child.register_forward_hook(called(name), with_kwargs=True))
    return handles


_ROPE = "computes cos/sin in float32 and rounds them to the activation dtype before rotating"
# how transformers computes an op where its modeling code makes the rounding known, in the words our engine uses for
# the same computation (meta.record.ops.how: the hints compare them)
OPS_HOW = {"q_rope": _ROPE, "k_rope": _ROPE, "attn_residual": "adds the attention output to the residual in the "
           "activation dtype, then normalises the rounded sum"}


def declare_absent(ops, layers, tp: bool) -> None:
    """Say why each op a forward of this model cannot record is absent, before any is recorded: what the modules
    the capture reads lack (QK-norm, apply_rotary_pos_emb, a dense MLP on any wanted layer). The norms and the
    residual sum found by data flow are said after the last layer (``_data_flow``). A tensor-parallel rank records
    none (``tp``)."""
    if tp:
        for name in ops.declared()["absent"]:
            ops.absent(name, "a tensor-parallel rank computes its own heads' share of each op")
        return
    dec = layers[0]
    attn, cls = _child(dec, _ATTN), class_name(dec)
    why = {}
    if getattr(attn, "q_norm", None) is None:
        why.update(q_norm=f"{cls} has no QK-norm", k_norm=f"{cls} has no QK-norm")
    if _modeling_module(layers) is None:
        why.update(dict.fromkeys(("q_rope", "k_rope"), f"{type(attn).__name__}'s module has no apply_rotary_pos_emb "
                                                       "to read the rotary embedding from"))
    dense = [i for i, layer in enumerate(layers) if ops.wants(i) and _linear(_child(layer, _MLP), "down_proj")]
    if not dense:
        why.update(dict.fromkeys(("gate", "up", "act_mul", "down"), f"{cls}'s MLP is a mixture of experts: it has no "
                                 "single gate, up or down projection"))
    for name, reason in why.items():
        if name not in ops.recorded:
            ops.absent(name, reason)
    ops.how.update(OPS_HOW)
