"""The vLLM worker's op-level states (format 1.4, schema ``OP_TENSORS``) and op replay, on vLLM's own modules.

Loaded by its path by vllm_worker.py (as vllm_decode.py is) and run in vLLM's environment: it imports torch and
numpy and nothing of prefill-diff (it names the ops as dumps/schema.py does, in plain strings).

Capture (``install``): forward hooks on each recorded decoder layer's modules put their outputs into the worker's
step rows, under ``(layer, "op/NAME")``, so each step's rows are split by request as the layer states are (decode
steps included). The map from vLLM's modules onto the op names:

- ``attn_norm``: ``input_layernorm``'s normalised output (from layer 1 on vLLM fuses the residual add into it:
  ``(normed, residual sum)``, whose second item is the previous layer's output, a layer state already);
- ``q``, ``k``, ``v``: the fused ``qkv_proj`` output split by the attention's ``q_size``/``kv_size``;
  ``q_norm``, ``k_norm``: the per-head norms, where the model has them (Qwen3, Gemma 3);
- ``q_rope``, ``k_rope``: the rotary embedding's outputs. vLLM shares one ``rotary_emb`` module across layers
  (``get_rope`` caches it), so its hook records under the layer being run, set by each layer's pre-hook;
- ``attn_core``: the output projection's input; ``o_proj``: its output;
- ``attn_residual``, ``mlp_norm``: the norm before the MLP (``pre_feedforward_layernorm`` in Gemma's sandwich,
  else ``post_attention_layernorm``), fused add+norm: ``(normed, residual sum)``; unfused (Granite): its input
  and its output;
- ``gate``, ``up``: the fused ``gate_up_proj`` output split in halves; ``act_mul``: ``act_fn``'s output (the down
  projection's input); ``down``: ``down_proj``'s output. A mixture of experts' MLP has none of these.

Each op keeps its dtype: the rows travel as float32 (exact for bfloat16 and float16) with the dtype named.

Replay (``replay``): each op of vLLM's model run on the reference's input to it, shipped in as frames (the
worker's framing) and shipped back the same way; see ``replay_layer`` for what each op is given.
"""
from __future__ import annotations


import numpy as np
import torch

PREFIX = "op/"  # the worker's step-row key of an op: (layer, "op/NAME")
ATTN = ("attn_norm", "q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope", "attn_core", "o_proj")
MLP = ("attn_residual", "mlp_norm", "gate", "up", "act_mul", "down")
ATTN_CORE = ("vLLM's attention backend runs only inside a scheduled step (its forward context, attention "
             "metadata and paged cache), not on given Q, K and V")


def _out(x):
    """A module's output tensor: vLLM's linear layers return (output, bias)."""
    return x[0] if isinstance(x, tuple) else x


def mlp_norm_of(layer):
    """The norm in front of the MLP: Gemma's sandwich calls it ``pre_feedforward_layernorm``."""
    return getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm


def _mlp(layer):
    return getattr(layer, "block_sparse_moe", None) or layer.mlp


# -- capture --------------------------------------------------------------------------------------------------

class OpCapture:
    """Hooks recording the op-level states of the layers asked for into a worker ``Capture``'s step rows."""

    def __init__(self, cap, layers):
        self.cap, self.layer = cap, None  # the decoder layer being run (the shared rotary module's key)
        self.dtypes = {}  # op name -> its dtype as vLLM computed it
        self.missing = {}  # op name -> why no layer has the module it is read from
        wanted = set(range(len(cap.layers))) if layers is None else {int(x) for x in layers}
        ropes = {}
        for i, layer in enumerate(cap.layers):
            cap.handles.append(layer.register_forward_pre_hook(
                lambda mod, args, i=i: setattr(self, "layer", i if i in wanted else None)))
            if i in wanted:
                self._layer(i, layer, ropes)
        for rope in ropes.values():  # once per module: a shared one records under the layer being run
            cap.handles.append(rope.register_forward_hook(self._rope))

    def _put(self, i, name, x):
        if self.cap.recording and i is not None:
            self.dtypes[name] = str(x.dtype).replace("torch.", "")
            n = self.cap.step["n"]
            rows = x[:n].detach().reshape(n, -1).to(torch.float32)  # a copy: vLLM reuses its buffers
            self.cap.step_rows[(i, PREFIX + name)] = rows.cpu().numpy().copy()

    def _hook(self, module, fn):
        self.cap.handles.append(module.register_forward_hook(fn))

    def _has(self, owner, attr: str, ops: tuple, why: str):
        """``owner.attr``, or None, noting ``ops`` as missing with ``why`` (unless another layer has them)."""
        m = getattr(owner, attr, None)
        for name in ops:
            if m is None:
                self.missing.setdefault(name, why)
        return m

    def _layer(self, i, layer, ropes):
        put = self._put
        cls = type(layer).__name__
        self._hook(layer.input_layernorm, lambda mod, args, out: put(i, "attn_norm", _out(out)))
        attn = layer.self_attn
        qkv = self._has(attn, "qkv_proj", ("q", "k", "v"), f"vLLM's {cls} has no fused qkv_proj the worker reads")
        if qkv is not None:
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]

            def split(mod, args, out):
                for name, x in zip(("q", "k", "v"), _out(out).split(sizes, dim=-1)):
                    put(i, name, x)
            self._hook(qkv, split)
        for name in ("q_norm", "k_norm"):
            m = getattr(attn, name, None)
            if m is not None:
                self._hook(m, lambda mod, args, out, name=name: put(i, name, _out(out)))
        rope = self._has(attn, "rotary_emb", ("q_rope", "k_rope"), f"vLLM's {cls} has no rotary_emb module")
        if rope is not None:
            ropes[id(rope)] = rope
        o = attn.o_proj
        self.cap.handles.append(o.register_forward_pre_hook(lambda mod, args: put(i, "attn_core", args[0])))
        self._hook(o, lambda mod, args, out: put(i, "o_proj", _out(out)))
        self._hook(mlp_norm_of(layer), lambda mod, args, out: self._norm(i, args, out))
        mlp = _mlp(layer)
        if getattr(mlp, "gate_up_proj", None) is None:  # a mixture of experts: declared by the model's arguments
            return

        def halves(mod, args, out):  # a hook returns None: anything else would replace the module's output
            for name, x in zip(("gate", "up"), _out(out).chunk(2, dim=-1)):
                put(i, name, x)
        self._hook(mlp.gate_up_proj, halves)
        self._hook(mlp.act_fn, lambda mod, args, out: put(i, "act_mul", _out(out)))
        self._hook(mlp.down_proj, lambda mod, args, out: put(i, "down", _out(out)))

    def _norm(self, i, args, out):
        """Fused add+norm: (normed, residual sum); unfused: the residual sum is its input."""
        normed, residual = (out[0], out[1]) if isinstance(out, tuple) else (out, args[0])
        self._put(i, "attn_residual", residual)
        self._put(i, "mlp_norm", normed)

    def _rope(self, mod, args, out):
        self._put(self.layer, "q_rope", out[0])
        if out[1] is not None:
            self._put(self.layer, "k_rope", out[1])


def pack(states: dict, arrays: dict) -> dict:
    """A sample's op rows (``states[(layer, "op/NAME")]``: a list of step chunks) into ``arrays`` as
    ``op/LAYER/NAME`` (T, width); the header's ``ops``: [[layer, name], ...]."""
    done = []
    for (layer, key), chunks in states.items():
        if isinstance(key, str) and key.startswith(PREFIX):
            name = key[len(PREFIX):]
            arrays[f"{PREFIX}{layer}/{name}"] = np.concatenate(chunks, axis=0)
            done.append([layer, name])
    return {"ops": done}


def header(ops: OpCapture) -> dict:
    """The meta frame's part: each op's dtype, and why an op no layer has was not recorded."""
    return {"op_dtypes": ops.dtypes, "ops_missing": ops.missing}


# -- replay -------------------------------------------------------------------------------------------------

def replay(model, path: str, channel, dtype, read_frames) -> None:
    """Read the reference's inputs from the frames file ``path`` (a ``replay`` frame with the samples' positions,
    then one ``layer`` frame per layer with ``i/NAME`` arrays: sample i's reference tensor NAME), run each op of
    vLLM's layer on them in ``dtype``, send a ``replay`` frame per layer (``i/NAME``: sample i's replayed op), then
    ``replayed`` with what was not replayed and why, and how the ops ran. ``read_frames``: vllm_frames.py's reader."""
    layers = list(model.model.layers)
    not_replayed, notes, dtypes = {"attn_core": ATTN_CORE}, [], {}
    with open(path, "rb") as f:
        stream = read_frames(f)
        head, _ = next(stream)
        positions = [torch.as_tensor(p, dtype=torch.int64) for p in head["positions"]]
        for head, arrays in stream:
            layer = int(head["layer"])
            out = {}
            for i, pos in enumerate(positions):
                given = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.split("/", 1)[0] == str(i)}
                with torch.inference_mode():
                    got = replay_layer(layers[layer], given, pos, dtype, not_replayed)
                for name, x in got.items():
                    dtypes[name] = str(x.dtype).replace("torch.", "")
                    out[f"{i}/{name}"] = x.detach().to(torch.float32).cpu().numpy()
            channel.send({"type": "replay", "layer": layer}, out)
    if any(not _fused_mlp_norm(x) for x in layers):
        notes.append("attn_residual and mlp_norm are not replayed on layers whose norm before the MLP is not vLLM's "
                     "fused add+RMSNorm")
    notes.append("attn_norm replayed as vLLM's first layer runs it: input_layernorm on the layer input, unfused; "
                 "from layer 1 on vLLM's own forward fuses the residual add into it (fused_add_rms_norm)")
    notes.append("attn_residual and mlp_norm replayed as vLLM runs them: post_attention_layernorm(o_proj, "
                 "layer_input), the fused add+RMSNorm, both outputs")
    channel.send({"type": "replayed", "not_replayed": not_replayed, "notes": notes, "dtypes": dtypes})


def _fused_mlp_norm(layer) -> bool:
    return not hasattr(layer, "pre_feedforward_layernorm") and not hasattr(layer, "residual_multiplier")


def replay_layer(layer, given: dict, positions, dtype, not_replayed: dict) -> dict:
    """One sample's ops of one layer, each on the reference's input (``given[NAME]``: (T, width) float32, cast to
    ``dtype``) through vLLM's own module: attn_norm = input_layernorm(layer_input) (unfused); q, k, v =
    qkv_proj(attn_norm) split; q_norm/k_norm = the per-head norms on q/k; q_rope, k_rope = rotary_emb(positions,
    q_norm or q, k_norm or k); o_proj(attn_core); attn_residual, mlp_norm = post_attention_layernorm(o_proj,
    layer_input) fused; gate, up = gate_up_proj(mlp_norm) split; act_mul = act_fn(cat(gate, up)); down =
    down_proj(act_mul). An op whose input the reference did not record is said in ``not_replayed``."""
    def t(*names):
        got = [given.get(n) for n in names]
        for n, g in zip(names, got):
            if g is None:
                return None
        return [torch.from_numpy(np.ascontiguousarray(g)).to(dtype) for g in got]

    def need(ops, *names):
        x = t(*names)
        if x is None:
            for op in ops:
                not_replayed.setdefault(op, "the reference recorded no " + " or ".join(
                    n for n in names if n not in given))
        return x

    out, attn = {}, layer.self_attn
    if (x := need(("attn_norm",), "layer_input")) is not None:
        out["attn_norm"] = _out(layer.input_layernorm(x[0]))
    qkv = getattr(attn, "qkv_proj", None)
    if qkv is None:
        for op in ("q", "k", "v"):
            not_replayed.setdefault(op, f"vLLM's {type(layer).__name__} has no fused qkv_proj")
    elif (x := need(("q", "k", "v"), "attn_norm")) is not None:
        for name, y in zip(("q", "k", "v"), _out(qkv(x[0])).split([attn.q_size, attn.kv_size, attn.kv_size], -1)):
            out[name] = y
    qk = [n for n in ("q_norm", "k_norm") if getattr(attn, n, None) is not None]
    for name in {"q_norm", "k_norm"} - set(qk):
        not_replayed.setdefault(name, f"vLLM's {type(attn).__name__} has no {name} (the model has no QK-norm)")
    for name in qk:
        if (x := need((name,), name[0])) is not None:
            y = x[0]
            out[name] = _out(getattr(attn, name)(y.view(y.shape[0], -1, attn.head_dim))).reshape(y.shape[0], -1)
    if (x := need(("q_rope", "k_rope"), *(qk or ("q", "k")))) is not None:
        q, k = attn.rotary_emb(positions, x[0].clone(), x[1].clone())  # in place on its inputs
        out["q_rope"], out["k_rope"] = q, k
    if (x := need(("o_proj",), "attn_core")) is not None:
        out["o_proj"] = _out(attn.o_proj(x[0]))
    if _fused_mlp_norm(layer):
        if (x := need(("attn_residual", "mlp_norm"), "o_proj", "layer_input")) is not None:
            normed, residual = layer.post_attention_layernorm(x[0].clone(), x[1].clone())
            out["attn_residual"], out["mlp_norm"] = residual, normed
    else:
        for op in ("attn_residual", "mlp_norm"):
            not_replayed.setdefault(op, f"vLLM's {type(layer).__name__} has no fused add+norm before its MLP")
    mlp = _mlp(layer)
    if getattr(mlp, "gate_up_proj", None) is None:
        for op in ("gate", "up", "act_mul", "down"):
            not_replayed.setdefault(op, "a mixture of experts' MLP has no single gate, up or down projection")
        return out
    if (x := need(("gate", "up"), "mlp_norm")) is not None:
        out["gate"], out["up"] = _out(mlp.gate_up_proj(x[0])).chunk(2, dim=-1)
    if (x := need(("act_mul",), "gate", "up")) is not None:
        out["act_mul"] = _out(mlp.act_fn(torch.cat(x, dim=-1)))
    if (x := need(("down",), "act_mul")) is not None:
        out["down"] = _out(mlp.down_proj(x[0]))
    return out
