"""Model snapshots: immutable weights (and adapter) with content digests (SPEC §2).

A snapshot keeps float32 master weights under our module names. ``build`` makes a
runnable ``Transformer`` in a given precision; adapters (LoRA) and weight-only int8
quantisation are applied to the built model from outside, as gpt-fast does.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import budget
from .cache import torch_dtype
from .errors import ConfigError, ModelLoadError
from .model import MODEL_PRESETS, ModelArgs, Transformer

ACT_DTYPES = ("float64", "float32", "bfloat16", "float16")
ATTN_PROJ = ("wq", "wk", "wv", "wo")


def digest_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order; shared tensors count once."""
    h = hashlib.sha256()
    seen = set()
    for name in sorted(tensors):
        t = tensors[name]
        if t.data_ptr() in seen and t.numel():
            continue
        seen.add(t.data_ptr())
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())
    return "sha256:" + h.hexdigest()


@dataclass
class Adapter:
    """LoRA: low-rank deltas ΔW = scale·B·A on the attention projections."""
    id: str
    rank: int
    scale: float
    tensors: dict[str, torch.Tensor]  # "layers.{i}.{wq|wk|wv|wo}.A" (rank, in) and ".B" (out, rank)
    digest: str = ""

    def __post_init__(self):
        if not self.digest:
            self.digest = digest_tensors(self.tensors) + f"|rank={self.rank}|scale={self.scale}"

    def identity(self) -> dict:
        return {"id": self.id, "digest": self.digest, "rank": self.rank}


def seeded_adapter(args: ModelArgs, id: str, rank: int = 4, seed: int = 1, scale: float = 1.0) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    sizes = {"wq": (args.dim, args.n_heads * args.head_dim), "wk": (args.dim, args.n_kv_heads * args.head_dim),
             "wv": (args.dim, args.n_kv_heads * args.head_dim), "wo": (args.n_heads * args.head_dim, args.dim)}
    for i in range(args.n_layers):
        for w, (fan_in, fan_out) in sizes.items():
            tensors[f"layers.{i}.{w}.A"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"layers.{i}.{w}.B"] = torch.randn(fan_out, rank, generator=g) * 0.5 / rank ** 0.5
    return Adapter(id=id, rank=rank, scale=scale, tensors=tensors)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, A: torch.Tensor, B: torch.Tensor, scale: float):
        super().__init__()
        self.base = base
        self.A, self.B, self.scale = A, B, scale

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.A), self.B) * self.scale


def apply_adapter(model: Transformer, adapter: Adapter, dtype: torch.dtype) -> None:
    for i, block in enumerate(model.layers):
        for w in ATTN_PROJ:
            A = adapter.tensors[f"layers.{i}.{w}.A"].to(dtype)
            B = adapter.tensors[f"layers.{i}.{w}.B"].to(dtype)
            setattr(block.attention, w, LoRALinear(getattr(block.attention, w), A, B, adapter.scale))


class WeightOnlyInt8Linear(nn.Module):
    """int8 weights with one scale per output channel (gpt-fast's WeightOnlyInt8QuantHandler idea)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # (out,)
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x):
        y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_int8(model: Transformer) -> str:
    """Replace every nn.Linear by WeightOnlyInt8Linear; returns the quantised weights' digest."""
    tensors = {}
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                q = WeightOnlyInt8Linear(child)
                setattr(parent, name, q)
                full = f"{parent_name}.{name}".strip(".")
                tensors[full + ".weight"], tensors[full + ".scales"] = q.weight, q.scales.float()
    return digest_tensors(tensors)


@dataclass
class Snapshot:
    """Immutable weights + adapter + tokenizer, identified by digests."""
    source: str
    args: ModelArgs
    state: dict[str, torch.Tensor]  # float32 master weights, our names
    adapter: Adapter | None = None
    tokenizer: object | None = None
    _digest: str = field(default="", repr=False)

    @property
    def weights_digest(self) -> str:
        if not self._digest:
            self._digest = digest_tensors(self.state)
        return self._digest

    def identity(self) -> dict:
        """What prefix reuse and cache invariant 5 compare (seed §2.9 condition 1)."""
        return {"weights_digest": self.weights_digest,
                "adapter": None if self.adapter is None else self.adapter.identity(),
                "layers": json.dumps(self.args.as_dict(), sort_keys=True)}

    def with_adapter(self, adapter: Adapter | None) -> "Snapshot":
        return Snapshot(self.source, self.args, self.state, adapter, self.tokenizer, self._digest)

    def build(self, dtype: str = "float32", weight_quant: str = "none", training: bool = False):
        """A runnable model; returns (model, quantised weights digest or None)."""
        if dtype not in ACT_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(ACT_DTYPES)} (got {dtype!r})")
        with torch.device("meta"):
            model = Transformer(self.args)
        tdt = torch_dtype(dtype)
        state = {k: v.to(tdt) for k, v in self.state.items()}
        missing = set(model.state_dict()) - set(state)
        if self.args.tie_embeddings:
            missing.discard("output.weight")
        if missing:
            raise ModelLoadError(f"weights are missing tensors {sorted(missing)[:5]} (source {self.source})")
        model.load_state_dict(state, strict=False, assign=True)
        if self.args.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
        qdigest = None
        if self.adapter is not None:
            apply_adapter(model, self.adapter, tdt)
        if weight_quant == "int8":
            qdigest = quantize_int8(model)
        elif weight_quant != "none":
            raise ConfigError(f"weight_quant must be 'none' or 'int8' (got {weight_quant!r})")
        model.train(training)
        return model, qdigest


def synthetic_state(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights; norm weights near 1 so every sub-layer matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    state = {}
    for name, shape in shapes.items():
        if name == "output.weight" and args.tie_embeddings:
            continue
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "tok_embeddings.weight":
            state[name] = torch.randn(shape, generator=g)
        elif name.endswith("bias"):
            state[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            state[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


@dataclass(frozen=True)
class ModelSpec:
    """*What* model to prefill: a source plus, for the built-in synthetic models, seed and size overrides."""
    source: str = "synthetic"
    seed: int = 0
    overrides: tuple = ()  # sorted (ModelArgs field, value) pairs
    adapter: tuple = ()  # sorted (key, value) pairs: id, rank, seed, scale

    def describe(self) -> dict:
        return {"source": self.source, "seed": self.seed, "overrides": dict(self.overrides),
                "adapter": dict(self.adapter) or None}


_CACHE: dict[ModelSpec, Snapshot] = {}


def load_snapshot(spec: ModelSpec) -> Snapshot:
    """Resolve a model spec to a snapshot; loaded once per process."""
    if spec not in _CACHE:
        _CACHE.clear()  # keep one model's weights in memory, not every model ever asked for
        _CACHE[spec] = _load(spec)
    return _CACHE[spec]


def _load(spec: ModelSpec) -> Snapshot:
    src = spec.source
    if src in MODEL_PRESETS:
        args = MODEL_PRESETS[src].replace(**dict(spec.overrides)) if spec.overrides else MODEL_PRESETS[src]
        budget.check_model(args, src)  # before a single weight is allocated
        snap = Snapshot(src, args, synthetic_state(args, spec.seed))
    elif src.startswith(("hf:", "gguf:")) or src == "smollm2":
        if spec.overrides:
            raise ConfigError(f"model size overrides apply to synthetic models only (source {src!r})")
        from . import hub  # real checkpoints need optional packages; imported only here
        snap = hub.load(src)
    else:
        raise ConfigError("model source must be one of synthetic, seed-2.8, hf:<dir>, gguf:<file>, smollm2 "
                          f"(got {src!r})")
    if spec.adapter:
        a = dict(spec.adapter)
        unknown = sorted(set(a) - {"id", "rank", "seed", "scale"})
        if unknown:
            raise ConfigError(f"unknown adapter keys {unknown} (known: id, rank, seed, scale)")
        if int(a.get("rank", 4)) < 1:
            raise ConfigError(f"adapter rank must be a positive integer (got rank={a.get('rank')})")
        snap = snap.with_adapter(seeded_adapter(snap.args, str(a.get("id", "lora")), int(a.get("rank", 4)),
                                                int(a.get("seed", 1)), float(a.get("scale", 1.0))))
    return snap
