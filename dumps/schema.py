"""The trace format declared once: its name and version, and every dataset it holds.

docs/trace-format.md is the prose contract; this module is its table in code. Each dataset is an
``Element``: where it lives (a path template), what it holds (the dtype the recorder writes, the dtype
kinds a reader accepts), its shape in named dimensions and the attributes it carries. The recorder
creates datasets through ``Element.create`` and the reader checks them through ``Element.problem``, so
a path, dtype or shape is written down here and nowhere else (as anndata pairs reader and writer per
element in its IOSpec registry). ``ELEMENTS`` lists them all; tests/test_schema.py holds every dataset
a recorded trace contains to one of them.

Named dimensions (a shape entry is one of these, or a number):

    S samples   C stored columns   N longest prompt   dim model width   W a state's width   R longest response
    vocab vocabulary size   k top ids kept   P sampled token slots   K sampled channels
    H KV heads   T longest cache   D head dimension   stat len(STAT_COLUMNS)
    A experts a token takes (top-k)   E experts
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

FORMAT_NAME = "prefill-diff-trace"
FORMAT_VERSION = "1.4"  # 1.1: tensor-parallel rank traces (meta.parallel, dataset placement attributes);
# 1.2: a mixture of experts' routing (layers/NNN/routing); 1.3: the recorded run in engine-neutral words
# (meta.side.run: the neutral settings, then one table of the engine's own options), each cell's phase, decode step
# and cache length (inputs/phase, step, cache_len), a response's logits (response/); 1.4: op-level states inside a
# layer (layers/NNN/ops/, meta.record.ops)
READABLE_MAJOR = (1,)  # the reader accepts any 1.x; a newer minor only adds optional items

LEVELS = ("full", "sampled", "stats")
OPS_LEVEL = "ops"  # a level to record at: full, plus the op-level states inside each layer (OP_TENSORS)
RECORD_LEVELS = LEVELS + (OPS_LEVEL,)
FULL_LEVELS = ("full", OPS_LEVEL)  # the levels that keep every row

from .h5write import new_dataset


@dataclass(frozen=True)
class LayerTensor:
    """One per-layer tensor the trace records and the comparison judges, declared once.

    ``name`` is the one name the verdict, the JSON report, ``inspect`` and the tables use; ``stored`` its
    dataset under the layer group (a state, or ``cache/keys``); ``words`` how a sentence names it; ``header``
    the table column's header (None: not a column) and ``priority`` (lower is dropped last when the terminal
    is narrow); ``tol_kind`` the tolerance kind that judges it; ``sublayer`` the part of the layer that
    computes it (where a break is blamed); ``width`` its row width in model sizes (``dim``, ``heads``:
    n_heads·head_dim, ``kv``: n_kv_heads·head_dim); ``required`` whether every trace records it; ``absentable``
    whether a layer that does not decompose into it (meta.absent_states) may leave it out.
    """
    name: str
    stored: str
    words: str
    tol_kind: str
    sublayer: str
    width: str = "dim"
    required: bool = True
    absentable: bool = False
    header: str | None = None
    priority: int = 0

    @property
    def is_cache(self) -> bool:
        return self.name.startswith(CACHE_PREFIX)


CACHE_PREFIX = "cache_"

# In the order a layer's values are compared (contract §2.3-§2.4): the input, the cache it writes, the
# attention sub-layer, the residual in between, the MLP sub-layer, the output.
LAYER_TENSORS = (
    LayerTensor("layer_input", "layer_input", "layer input", "residual", "residual",
                header="layer_\ninput", priority=6),
    LayerTensor("cache_keys", "cache/keys", "cache keys", "cache_keys", "attention", "kv",
                header="cache_\nkeys", priority=4),
    LayerTensor("cache_values", "cache/values", "cache values", "cache_values", "attention", "kv",
                header="cache_\nvalues", priority=5),
    LayerTensor("attn_update", "attn_update", "attention update", "attn_update", "attention", absentable=True,
                header="attn_\nupdate", priority=1),
    LayerTensor("attn_heads", "attn_heads", "per-head attention output", "attn_update", "attention", "heads",
                required=False),
    LayerTensor("mid", "mid", "residual between attention and MLP", "residual", "attention", absentable=True,
                header="mid", priority=3),
    LayerTensor("mlp_update", "mlp_update", "MLP update", "mlp_update", "mlp", absentable=True,
                header="mlp_\nupdate", priority=2),
    LayerTensor("layer_output", "layer_output", "layer output", "residual", "mlp", header="layer_\noutput"),
)
TENSOR = {t.name: t for t in LAYER_TENSORS}
# layer l's output is layer l+1's input (contract §2.3): an engine may hand the recorder the same tensor for both
CARRIED = ("layer_output", "layer_input")
VALUE_ORDER = tuple(t.name for t in LAYER_TENSORS)

# Per-layer residual-stream states (datasets directly under a layer group), in the order they are computed.
STATES = tuple(t.name for t in LAYER_TENSORS if not t.is_cache)
REQUIRED_STATES = tuple(t.name for t in LAYER_TENSORS if not t.is_cache and t.required)
ABSENTABLE = tuple(t.name for t in LAYER_TENSORS if t.absentable)  # meta.absent_states may name these
CACHE_TENSORS = tuple(t.stored.split("/", 1)[1] for t in LAYER_TENSORS if t.is_cache)
# Names of the per-layer statistics (stats/NAME, checksums/NAME, sampled/NAME): the states, then the cache.
STAT_TENSORS = STATES + tuple(CACHE_PREFIX + t for t in CACHE_TENSORS)

# The first-step output per sample the comparison judges as values (contract §2.7), with their kinds.
FINAL_TENSORS = ("logits", "norm_last")
FINAL_KIND = {"logits": "logits", "norm_last": "residual"}

# Tolerance kinds (each judges the tensors that name it as their tol_kind), in the order policies list them.
TOL_KINDS = ("residual", "attn_update", "mlp_update", "cache_keys", "cache_values", "logits", "router")
TOL_FIELDS = ("atol", "rtol", "ntol", "row_rtol")  # a kind's tolerance (verify.tolerance.Tolerance's fields)
TOL_KIND = {**{t.name: t.tol_kind for t in LAYER_TENSORS}, **FINAL_KIND,
            "router_logits": "router",  # a MoE layer's router scores: the noise a routing flip is judged against
            "response_logits": "logits"}  # the logits at a response's tokens (format 1.3)



@dataclass(frozen=True)
class OpTensor:
    """One op-level state inside a layer (format 1.4, recorded with ``--level ops``): an op's output, declared once.

    ``name`` is what the trace, the verdict and the tables call it; ``words`` how a sentence names it; ``width``
    its row width (``dim``, ``heads``: n_heads·head_dim, ``kv``: n_kv_heads·head_dim, ``inter``: the MLP's width);
    ``inputs`` the ops or layer states whose outputs it takes (what a replay feeds it from the reference); ``part``
    the sub-layer that computes it. Every engine maps its own modules onto these names (a fused op records each of
    its outputs under its own name); a name an engine cannot produce is declared absent, never filled from another.
    """
    name: str
    words: str
    width: str
    inputs: tuple
    part: str


# In the order a layer computes them (a pre-norm decoder layer: Llama, Qwen, Mistral, ...).
OP_TENSORS = (
    OpTensor("attn_norm", "attention input norm", "dim", ("layer_input",), "attention"),
    OpTensor("q", "Q projection", "heads", ("attn_norm",), "attention"),
    OpTensor("k", "K projection", "kv", ("attn_norm",), "attention"),
    OpTensor("v", "V projection", "kv", ("attn_norm",), "attention"),
    OpTensor("q_norm", "Q norm", "heads", ("q",), "attention"),
    OpTensor("k_norm", "K norm", "kv", ("k",), "attention"),
    OpTensor("q_rope", "rotary embedding of Q", "heads", ("q_norm",), "attention"),
    OpTensor("k_rope", "rotary embedding of K", "kv", ("k_norm",), "attention"),
    OpTensor("attn_core", "attention core (before the output projection)", "heads", ("q_rope", "k_rope", "v"),
             "attention"),
    OpTensor("o_proj", "output projection", "dim", ("attn_core",), "attention"),
    OpTensor("attn_residual", "residual sum after attention", "dim", ("layer_input", "o_proj"), "attention"),
    OpTensor("mlp_norm", "post-attention norm", "dim", ("attn_residual",), "mlp"),
    OpTensor("gate", "gate projection", "inter", ("mlp_norm",), "mlp"),
    OpTensor("up", "up projection", "inter", ("mlp_norm",), "mlp"),
    OpTensor("act_mul", "activation times up", "inter", ("gate", "up"), "mlp"),
    OpTensor("down", "down projection", "dim", ("act_mul",), "mlp"),
)
OP = {o.name: o for o in OP_TENSORS}
OP_NAMES = tuple(o.name for o in OP_TENSORS)

# Columns of every stats row: over the sample's valid cells, then over its computed padding cells.
STAT_COLUMNS = ("count", "finite", "min", "max", "mean", "l2", "pad_count", "pad_finite")

META_LIMIT = 16 * 1024 * 1024  # bytes of JSON a reader will parse from one attribute

# Attributes (names declared once; their meaning is in docs/trace-format.md)
ATTR_SOURCE_DTYPE = "source_dtype"  # on every tensor dataset: the engine's dtype before storing
ATTR_CHANNELS, ATTR_WIDTH = "channels", "width"  # on sampled/NAME: the stored channels of a W-wide tensor
ATTR_COLUMNS = "columns"  # on a layer's stats group: JSON list of STAT_COLUMNS
ATTR_SEED = "seed"  # on /sampled: the channel generator's seed
ATTR_HEAD_DIM, ATTR_N_KV_HEADS = "head_dim", "n_kv_heads"  # on a layer's cache group
LAYER_DIGITS = 3


def layer_group(layer: int) -> str:
    return f"layers/{layer:0{LAYER_DIGITS}d}"


_KIND_NAMES = {"f": "floating-point values", "iu": "integers", "u": "unsigned integers"}


@dataclass(frozen=True)
class Element:
    """One dataset of the trace.

    ``path`` is relative to the file's root, or to a layer group when ``in_layer``; ``{name}`` in it is a
    state or statistics name. ``dtype`` is what the recorder writes (None: the tensor's own float dtype);
    ``kinds`` the numpy dtype kinds a reader accepts. ``shape`` names each dimension (see the module
    docstring); ``levels`` are the levels at which the element MUST exist (empty: optional);
    ``fill`` the value of cells never written.
    """
    path: str
    kinds: str
    shape: tuple
    dtype: str | None = None
    levels: tuple = ()
    attrs: tuple = ()
    fill: float | int | None = None
    in_layer: bool = False

    def rel(self, name: str | None = None) -> str:
        """The path inside its group (the root, or a layer group)."""
        return self.path.format(name=name) if "{name}" in self.path else self.path

    def at(self, layer: int | None = None, name: str | None = None) -> str:
        """The path from the file's root."""
        return f"{layer_group(layer)}/{self.rel(name)}" if self.in_layer else self.rel(name)

    def shape_for(self, dims: dict) -> tuple:
        """The concrete shape, given the named dimensions."""
        return tuple(d if isinstance(d, int) else int(dims[d]) for d in self.shape)

    def create(self, group, dims: dict, name: str | None = None, dtype=None, *, data=None, leaf: bool = False,
               chunks=None, maxshape=None, gzip: bool = False):
        """Create this element with its declared shape, dtype and fill value: the one way a trace's datasets
        are made (dumps/h5write.py: new_dataset). Returns its low-level id.

        ``group`` (an h5py group or its low-level id) is the one its path is relative to (the root, or a layer
        group), or with ``leaf`` the group that holds it (a bare name skips a path lookup). ``dtype`` is
        required when the element declares none and no ``data`` gives it (the tensor's own); ``data`` is
        written at once. ``chunks``, ``maxshape``, ``gzip``: as h5py's create_dataset takes them."""
        rel = self.rel(name)
        if leaf:
            rel = rel.rpartition("/")[2]
        dt = np.dtype(self.dtype if self.dtype is not None else dtype if dtype is not None else data.dtype)
        if data is not None:
            data = np.ascontiguousarray(data, dtype=dt)
        return new_dataset(group, rel, self.shape_for(dims), dt, data, fill=self.fill, chunks=chunks,
                           maxshape=maxshape, gzip=gzip)

    def problem(self, ds, dims: dict) -> str | None:
        """Why ``ds`` (an h5py object or None) is not this element, or None if it is. A dimension missing from
        ``dims`` (unknown to the reader, e.g. a trace without model sizes) matches any length."""
        if ds is None or not hasattr(ds, "dtype") or not hasattr(ds, "shape"):
            return "is missing (or not a dataset)"
        if ds.dtype.kind not in self.kinds:
            return f"holds {ds.dtype}, not {_KIND_NAMES.get(self.kinds, self.kinds)}"
        want = tuple(d if isinstance(d, int) else dims.get(d) for d in self.shape)
        got = tuple(ds.shape)
        if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
            shown = ", ".join("?" if w is None else str(w) for w in want) + ("," if len(want) == 1 else "")
            return f"has shape {got}, expected ({shown})"
        return None


# -- root datasets ---------------------------------------------------------------------------------
TOKEN_IDS = Element("samples/token_ids", "iu", ("S", "N"), "int64", LEVELS, fill=-1)
LENGTHS = Element("samples/lengths", "iu", ("S",), "int64", LEVELS)
INPUTS = {  # the cells one prefill laid out per sample; fill: what a never-computed column holds
    "input_ids": Element("inputs/input_ids", "iu", ("S", "C"), "int64", LEVELS, fill=0),
    "valid_mask": Element("inputs/valid_mask", "iu", ("S", "C"), "uint8", LEVELS, fill=0),
    "computed": Element("inputs/computed", "iu", ("S", "C"), "uint8", LEVELS, fill=0),
    "positions": Element("inputs/positions", "iu", ("S", "C"), "int64", LEVELS, fill=0),
    "token_index": Element("inputs/token_index", "iu", ("S", "C"), "int64", LEVELS, fill=-1),
}
# what each cell's forward was (format 1.3; optional: a trace without them reads as prefill cells, cache length
# not said): its phase (PHASES), its decode step (-1 outside decode), the cache length its forward read (-1: not said)
ROWS = {
    "phase": Element("inputs/phase", "iu", ("S", "C"), "uint8", fill=0),
    "step": Element("inputs/step", "iu", ("S", "C"), "int64", fill=-1),
    "cache_len": Element("inputs/cache_len", "iu", ("S", "C"), "int64", fill=-1),
}
PHASES = ("prefill", "decode")
# a response's logits (format 1.3, with meta.record.response): per sample, the raw logits at each token whose next
# token is one of its response's (token_index -1: no such row), the figures RL frameworks compare
RESPONSE = {
    "token_index": Element("response/token_index", "iu", ("S", "R"), "int64", fill=-1),
    "logits": Element("response/logits", "f", ("S", "R", "vocab"), None, attrs=(ATTR_SOURCE_DTYPE,), fill=np.nan),
}
SAMPLED_TOKENS = Element("sampled/token_index", "iu", ("S", "P"), "int64", ("sampled",), fill=-1)
SAMPLED_GROUP = "sampled"  # carries ATTR_SEED
FINAL = {  # the first-step output per sample (contract §2.7)
    "norm_last": Element("final/norm_last", "f", ("S", "dim"), None, LEVELS, (ATTR_SOURCE_DTYPE,)),
    "logits": Element("final/logits", "f", ("S", "vocab"), None, LEVELS, (ATTR_SOURCE_DTYPE,)),
    "topk_ids": Element("final/topk_ids", "iu", ("S", "k"), "int64", LEVELS),
    "topk_logits": Element("final/topk_logits", "f", ("S", "k"), None),
    "gather_col": Element("final/gather_col", "iu", ("S",), "int64", LEVELS, fill=-1),
    "gather_token": Element("final/gather_token", "iu", ("S",), "int64", LEVELS, fill=-1),
    "written": Element("final/written", "iu", ("S",), "uint8"),  # 1 once final() ran for the sample
}

# -- per layer (paths relative to layers/NNN) ----------------------------------------------------------
STATE = Element("{name}", "f", ("S", "C", "W"), None, ("full",), (ATTR_SOURCE_DTYPE,), in_layer=True)
SAMPLED = Element("sampled/{name}", "f", ("S", "P", "K"), None, ("sampled",),
                  (ATTR_CHANNELS, ATTR_WIDTH, ATTR_SOURCE_DTYPE), fill=np.nan, in_layer=True)
STATS = Element("stats/{name}", "f", ("S", "stat"), "float64", LEVELS, in_layer=True)
STATS_GROUP = "stats"  # carries ATTR_COLUMNS
CHECKSUM = Element("checksums/{name}", "iu", ("S",), "int64", LEVELS, in_layer=True)
CHECKSUMS_GROUP = "checksums"
CACHE_GROUP = "cache"  # carries ATTR_HEAD_DIM, ATTR_N_KV_HEADS
CACHE_POSITIONS = Element("cache/positions", "iu", ("S", "T"), "int64", LEVELS, fill=-1, in_layer=True)
CACHE_LENGTHS = Element("cache/lengths", "iu", ("S",), "int64", LEVELS, fill=0, in_layer=True)
CACHE = Element("cache/{name}", "f", ("S", "H", "T", "D"), None, ("full",), (ATTR_SOURCE_DTYPE,), in_layer=True)
# an op-level state (format 1.4; OP_TENSORS), every stored cell, in its own float dtype (bfloat16 as float32, exactly)
OP_STATE = Element("ops/{name}", "f", ("S", "C", "W"), None, (), (ATTR_SOURCE_DTYPE,), fill=np.nan, in_layer=True)

# a mixture of experts' routing, per stored cell of a layer whose MLP has experts (format 1.2): the chosen experts
# by descending router probability, their weights as they scale the experts' outputs, the router's margin there
# (its k-th minus its (k+1)-th logit; +inf when every expert is taken), the RMS of its logits (the scale of their
# noise), and at the full level the router logits
ROUTING_GROUP = "routing"
ROUTING = {
    "ids": Element("routing/ids", "iu", ("S", "C", "A"), "int64", fill=-1, in_layer=True),
    "weights": Element("routing/weights", "f", ("S", "C", "A"), "float64", fill=np.nan, in_layer=True),
    "margin": Element("routing/margin", "f", ("S", "C"), "float64", fill=np.nan, in_layer=True),
    "scale": Element("routing/scale", "f", ("S", "C"), "float64", fill=np.nan, in_layer=True),
    "logits": Element("routing/logits", "f", ("S", "C", "E"), None, fill=np.nan, attrs=(ATTR_SOURCE_DTYPE,),
                      in_layer=True),
}

ELEMENTS = (TOKEN_IDS, LENGTHS, *INPUTS.values(), *ROWS.values(), *RESPONSE.values(), SAMPLED_TOKENS, *FINAL.values(), STATE, SAMPLED, STATS,
            CHECKSUM, CACHE_POSITIONS, CACHE_LENGTHS, CACHE, *ROUTING.values(), OP_STATE)

# the names each per-layer template may take
_NAMES = {STATE: STATES, SAMPLED: STAT_TENSORS, STATS: STAT_TENSORS, CHECKSUM: STAT_TENSORS, CACHE: CACHE_TENSORS,
          OP_STATE: OP_NAMES}


def element_of(path: str) -> tuple[Element, str | None] | None:
    """The element a dataset path (from the root, no leading slash) is an instance of, and its name; None if
    the schema declares no such dataset."""
    m = re.fullmatch(r"layers/(\d{%d})/(.+)" % LAYER_DIGITS, path)
    rel = m.group(2) if m else path
    for el in ELEMENTS:
        if el.in_layer != bool(m):
            continue
        if "{name}" not in el.path:
            if rel == el.path:
                return el, None
            continue
        head, _, tail = el.path.partition("{name}")
        if rel.startswith(head) and rel.endswith(tail):
            name = rel[len(head):len(rel) - len(tail)]
            if name in _NAMES[el]:
                return el, name
    return None
