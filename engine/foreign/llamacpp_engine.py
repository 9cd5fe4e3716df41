"""llama.cpp as an engine: its own kernels and quantized matmuls, read node by node (llama-cpp-python 0.3.36).

The model runs in llama.cpp unchanged. ``context_params.cb_eval`` is asked once per graph node; we
observe the nodes we need and copy each after it is computed (CPU backend, f32):

    inp_embd (layer 0) / l_out-(i-1)    -> layer_input
    the matmul by blk.i.attn_output    -> attn_update      kqv_out-i -> attn_heads (per-head output)
      (+ its bias, where the file has one)
    ffn_inp-i                          -> mid (the residual after attention)
    the matmul by blk.i.ffn_down       -> mlp_update (llama's "ffn_out-i" already has the residual added)
      (+ its bias, where the file has one)
    l_out-i                            -> layer_output
    Kcur-i / Vcur-i (last node of each name: keys after RoPE) -> the cache, rounded to the cache type
    result_norm, llama_get_logits_ith  -> final norm and logits at each sequence's last token

Keys come back in our (Hugging Face) layout: for "llama" GGUFs llama.cpp's RoPE works on adjacent
pairs of rows it permuted at conversion; our dim j is its dim 2j, our dim j + d_h/2 its dim 2j+1.
KV positions are llama.cpp's own (``llama_memory_seq_pos_min/max``).

``batching = "unbatched"`` prefills one sequence per context (a reference); ``"packed"`` puts every
prompt into one ``llama_batch`` as its own sequence (``seq_id``), in a unified KV cache: llama.cpp's
own batching (a candidate). Models that are not GGUF files are converted to one (gguf_writer).

Guarded here, so no user meets them: the default (native) build of llama.cpp segfaults on its first
decode on AMX machines (ggml's AMX matmul, an "extra buffer type"): models load with
``use_extra_bufts = False``. Two OpenMP threads on a busy machine can spin 40x slower:
``OMP_WAIT_POLICY=PASSIVE`` unless the user set it.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import mmap
import os
import shutil
import struct
import tempfile
from typing import NamedTuple

import numpy as np
import torch

from ..calls import Placement, plan_calls
from ..coords import SeqRun
from ..shared.errors import ConfigError, ModelLoadError, PrefillDiffError
from ..models.gguf_loader import smollm2_path
from ..models.gguf_writer import check_convertible, write_gguf

PINNED = "0.3.36"  # the ggml_tensor layout below is this version's; it is checked at run time as well
INSTALL = "pip install 'prefill-diff[llamacpp]' (builds llama.cpp from source: 6-11 minutes on 2 cores)"
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
CACHE_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}  # the rest are block-quantized: "int8"
FLASH = {True: 1, False: 0, "auto": -1}
_F32, _F16 = 0, 1


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of ggml as vendored by llama-cpp-python 0.3.36 (ggml.h)."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


_STATE = {"lib": None, "log": [], "log_cb": None, "ggml": None}


def load_library():
    """llama_cpp, imported once, with its log routed to a buffer (errors are quoted in ours)."""
    if _STATE["lib"] is not None:
        return _STATE["lib"]
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when the OpenMP runtime loads
    try:
        import llama_cpp  # optional (a native library): imported when a llama.cpp run starts
    except ImportError:
        raise ModelLoadError(f"the llama.cpp engine needs llama-cpp-python=={PINNED}: {INSTALL}") from None
    except OSError as e:
        raise ModelLoadError(f"llama-cpp-python is installed but its library does not load ({e})") from None
    log = _STATE["log"]

    @llama_cpp.llama_log_callback
    def on_log(level, text, user_data):  # keep warnings and errors (levels 3, 4 and their continuations)
        if level in (3, 4) or (level == 5 and log and log[-1][0]):
            log.append((True, (text or b"").decode("utf-8", "replace")))
            del log[:-40]
        elif level != 5:
            log.append((False, ""))
            del log[:-40]

    llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
    _STATE["log_cb"] = on_log  # the C side holds only a pointer: keep the callback alive
    llama_cpp.llama_backend_init()
    try:
        from llama_cpp._ggml import libggml
        libggml.ggml_get_name.restype = ctypes.c_char_p
        libggml.ggml_get_name.argtypes = [ctypes.c_void_p]
        libggml.ggml_nelements.restype = ctypes.c_int64
        libggml.ggml_nelements.argtypes = [ctypes.c_void_p]
        libggml.ggml_backend_buffer_is_host.restype = ctypes.c_bool
        libggml.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
        _STATE["ggml"] = libggml
    except (ImportError, OSError, AttributeError):
        _STATE["ggml"] = None  # the layout check below then relies on names and shapes alone
    _STATE["lib"] = llama_cpp
    return llama_cpp


def _log_tail() -> str:
    text = "".join(t for keep, t in _STATE["log"] if keep).strip().replace("\n", "; ")
    _STATE["log"].clear()
    return text[-400:] if text else "no message from llama.cpp"


def version() -> str | None:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def check(prep) -> None:
    """What the llama.cpp engine runs; anything else is refused in one line, before any work."""
    run, snap = prep.side.run, prep.snapshot
    num = run.numerical
    no = []
    if run.batching in ("left", "right"):
        raise ConfigError(f"the llama.cpp engine batches sequences without padding (batching={run.batching!r}): "
                          "use batching = \"packed\" (several seq_ids in one llama_batch) or \"unbatched\"")
    if run.reuse is not None:
        no.append("prefix reuse")
    if run.fault is not None:
        no.append(f"fault {run.fault.name}")
    if run.cache.chunk_size:
        no.append("chunked prefill (use n_batch / n_ubatch)")
    if num.dtype != "float32":
        no.append(f"dtype={num.dtype} (llama.cpp computes in float32; its weights' type is the GGUF's)")
    if num.weight_quant != "none":
        no.append("weight_quant (quantize the GGUF instead)")
    if num.kernel != "eager":
        no.append(f"kernel={num.kernel} (use flash_attn)")
    if num.training or num.dropout_seed is not None:
        no.append("training mode")
    lay = run.cache.layout
    if lay.kind != "contiguous" or lay.key_rotation != "post" or lay.dtype is not None:
        no.append("[cache] settings (use type_k / type_v)")
    if snap.adapter is not None:
        no.append("a LoRA adapter")
    if no:
        raise ConfigError("the llama.cpp engine runs the model as llama.cpp does; it does not support "
                          + ", ".join(no))
    if not (snap.source == "smollm2" or snap.source.startswith("gguf:")):
        check_convertible(snap)


# -- the GGUF that llama.cpp runs ---------------------------------------------------------------------
class GgufFile:
    """The file llama.cpp loads: the model's own GGUF, or a conversion written for this run."""

    def __init__(self, snapshot, gguf_type: str):
        self.tmpdir = None
        src = snapshot.source
        if src == "smollm2" or src.startswith("gguf:"):
            self.path = smollm2_path() if src == "smollm2" else src[5:]
            self.converted = None
        else:
            check_convertible(snapshot)
            self.tmpdir = tempfile.mkdtemp(prefix="prefill-diff-gguf-")
            self.path = os.path.join(self.tmpdir, "model.gguf")
            write_gguf(snapshot, self.path, gguf_type)
            self.converted = gguf_type
        self.describe = self._describe()

    def _describe(self) -> dict:
        """Architecture, weight types (counted over matrices) and, if quantized, a digest of those weights."""
        try:
            arch, tensors, data = gguf_index(self.path)
        except (ValueError, KeyError, IndexError, OSError) as e:  # struct.error is a ValueError
            raise ModelLoadError(f"{self.path}: not a GGUF file llama.cpp can run ({type(e).__name__}: {e})") from None
        counts, quant = {}, []
        float_types = {"F32", "F16", "BF16", "F64"}
        for t in tensors:
            if len(t["shape"]) < 2:
                continue
            counts[t["type"]] = counts.get(t["type"], 0) + 1
            if t["type"] not in float_types:
                quant.append(t)
        digest = None
        if quant:
            h = hashlib.sha256()
            with open(self.path, "rb") as f:
                for t in sorted(quant, key=lambda t: t["name"]):
                    h.update(f"{t['name']}|{t['type']}|{t['shape']}|".encode())
                    f.seek(data + t["offset"])
                    h.update(f.read(t["nbytes"]))
            digest = "sha256:" + h.hexdigest()
        names = set(counts)
        wdtype = ("float16" if "F16" in names else "bfloat16" if "BF16" in names else "float32")
        main = max((n for n in counts if n not in float_types), key=lambda n: counts[n], default=None)
        return {"arch": arch, "weight_types": dict(sorted(counts.items())), "weight_quant": main,
                "weights_dtype": wdtype, "quantized_weights_digest": digest}

    def close(self):
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


class GgufIndex(NamedTuple):
    """What a GGUF header says about the weights: architecture, tensor infos, offset of the data section."""
    arch: str | None
    tensors: list[dict]
    data_offset: int


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Header:
    """A cursor over a GGUF header: reads strings and integers, skips values without building them."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.at = buf, path, 24

    def unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        n, = self.unpack("<Q")
        self.at += n
        return self.buf[self.at - n:self.at].decode("utf-8", "replace")

    def skip(self, vtype: int) -> None:
        if vtype in _SCALAR_SIZES:
            self.at += _SCALAR_SIZES[vtype]
        elif vtype == _STRING:
            self.string()
        elif vtype == _ARRAY:
            etype, count = self.unpack("<IQ")
            if etype in _SCALAR_SIZES:
                self.at += _SCALAR_SIZES[etype] * count
            else:
                for _ in range(count):
                    self.skip(etype)
        else:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {vtype}")


def gguf_index(path: str) -> GgufIndex:
    """Architecture, tensor infos and data offset from a GGUF header, without parsing metadata values.

    gguf.GGUFReader builds every metadata field (tens of seconds for a 49k-token vocabulary on a busy
    machine); this walks the header once, skipping the values, as the GGUF format allows.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # gguf is optional: imported when used
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # only the header pages are read
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file")
    _, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    h = _Header(buf, path)
    arch, alignment = None, 32
    for _ in range(n_kv):
        key = h.string()
        vtype, = h.unpack("<I")
        if key == "general.architecture" and vtype == _STRING:
            arch = h.string()
        elif key == "general.alignment" and vtype == _UINT32:
            alignment, = h.unpack("<I")
        else:
            h.skip(vtype)
    tensors = []
    for _ in range(n_tensors):
        name = h.string()
        nd, = h.unpack("<I")
        dims = h.unpack(f"<{nd}Q")
        ttype, offset = h.unpack("<IQ")
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        tensors.append({"name": name, "shape": tuple(reversed(dims)), "type": GGMLQuantizationType(ttype).name,
                        "offset": offset, "nbytes": int(np.prod(dims)) // block * size})
    at = h.at
    buf.close()
    return GgufIndex(arch=arch, tensors=tensors, data_offset=-(-at // alignment) * alignment)


# -- capture ------------------------------------------------------------------------------------------
def _layer_name(name: str):
    base, sep, idx = name.rpartition("-")
    if sep and idx.isdigit():
        return base, int(idx)
    return name, None


class Capture:
    """The cb_eval callback: which nodes to observe, and their values per micro-batch (ubatch)."""

    WANT = {"ffn_inp", "l_out", "kqv_out", "Kcur", "Vcur"}

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.cur: dict = {}
        self.ubatches: list[dict] = []
        self.error: BaseException | None = None
        self.softmax_seen = False  # a "kq_soft_max" node: attention without flash attention
        self.checked = False
        self.pending: dict = {}  # node address -> key, decided when asked

    def _key(self, t: GgmlTensor, addr: int):
        name = t.name.decode("utf-8", "replace")
        base, layer = _layer_name(name)
        if base == "kq_soft_max":
            self.softmax_seen = True
        if layer is not None and base in self.WANT:
            return (base, layer)
        if name == "result_norm":
            return (name, None)
        src0 = t.src[0]
        if src0 and not name.startswith("result"):
            s = GgmlTensor.from_address(src0).name.decode("utf-8", "replace")
            if s == "token_embd.weight":  # the embedding lookup ("inp_embd"/"embd"; tied output is "result_output")
                return ("inp_embd", None)
            # o_proj and the MLP's down projection: the matmul by the weight, then (a later node, which wins) the
            # addition of the bias where the model has one
            src1 = t.src[1]
            s1 = GgmlTensor.from_address(src1).name.decode("utf-8", "replace") if src1 else ""
            for which in (s, s1):
                if which.startswith("blk.") and which.endswith((".ffn_down.weight", ".ffn_down.bias")):
                    return ("ffn_down", int(which.split(".")[1]))
                if which.startswith("blk.") and which.endswith((".attn_output.weight", ".attn_output.bias")):
                    return ("attn_out", int(which.split(".")[1]))
        return None

    def _check_layout(self, t: GgmlTensor, addr: int) -> None:
        """The struct read above must be this ggml's: compare with ggml's own accessors."""
        ggml = _STATE["ggml"]
        ok = 0 <= t.type < 64 and all(n >= 1 for n in t.ne) and t.data
        if ok and ggml is not None:
            ok = (ggml.ggml_get_name(addr) or b"") == t.name and ggml.ggml_nelements(addr) == int(np.prod(list(t.ne)))
        if not ok:
            raise ModelLoadError(f"llama-cpp-python {version()} lays out struct ggml_tensor differently from "
                                 f"{PINNED}, the version this tool reads: pip install 'llama-cpp-python=={PINNED}'")
        self.checked = True

    def __call__(self, addr, ask, user_data):
        try:
            t = GgmlTensor.from_address(addr)
            if ask:
                key = self._key(t, addr)
                if key is None:
                    return False
                self.pending[addr] = key
                return True
            key = self.pending.pop(addr, None)
            if key is None:
                return True
            if not self.checked:
                self._check_layout(t, addr)
            a = read_tensor(t)  # (ne3, ne2, ne1, ne0); rows are tokens
            # the last node of a name wins (Kcur-i after RoPE): K/V as (tokens, heads, d_h), others (tokens, width)
            self.cur[key] = a.reshape(-1, a.shape[2], a.shape[3]) if key[0] in ("Kcur", "Vcur") else \
                a.reshape(-1, a.shape[3])
            if key[0] == "result_norm":
                self.ubatches.append(self.cur)
                self.cur = {}
            return True
        except BaseException as e:  # never let an exception cross into C; abort the computation instead
            self.error = e
            return False


def read_tensor(t: GgmlTensor) -> np.ndarray:
    """Copy a computed node out of host memory, honouring its strides (views included); numpy axis order."""
    if t.type not in (_F32, _F16):
        raise PrefillDiffError(f"llama.cpp node {t.name.decode()!r} has ggml type {t.type}, not f32 or f16")
    ggml = _STATE["ggml"]
    if ggml is not None and t.buffer and not ggml.ggml_backend_buffer_is_host(t.buffer):
        raise PrefillDiffError(f"llama.cpp node {t.name.decode()!r} is not in host memory (a GPU backend?)")
    dt = np.dtype(np.float32 if t.type == _F32 else np.float16)
    ne, nb = list(t.ne), list(t.nb)
    span = sum((n - 1) * s for n, s in zip(ne, nb)) + dt.itemsize
    buf = (ctypes.c_char * span).from_address(t.data)
    a = np.ndarray(shape=tuple(reversed(ne)), dtype=dt, buffer=buf, strides=tuple(reversed(nb)))
    return np.array(a, dtype=np.float32)


def _cache_round(x: np.ndarray, ggml_type: str) -> np.ndarray:
    """What the cache stores of rows x (tokens, H_kv*d_h), as written by ggml (round to nearest even)."""
    if ggml_type == "f32":
        return x
    if ggml_type == "f16":
        return x.astype(np.float16)
    if ggml_type == "bf16":
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        r = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) & np.uint32(0xFFFF0000)).view(np.float32)
        return np.where(np.isnan(x), x, r)
    import gguf  # optional: imported when used
    from gguf.quants import dequantize, quantize  # blocks of 32 along each row, as the cache stores them
    qt = getattr(gguf.GGMLQuantizationType, ggml_type.upper())
    return dequantize(quantize(np.ascontiguousarray(x, dtype=np.float32), qt), qt).reshape(x.shape)


# -- running ------------------------------------------------------------------------------------------
def _threads(n: int) -> int:
    """n, or automatic: the CPUs this process may use that the machine's load leaves free, 1 to 4.

    The thread count does not change llama.cpp's results (each output row is one thread's dot product;
    tested), only its speed: on an oversubscribed machine every extra OpenMP thread waits at each node's
    barrier for a CPU (2 threads were 3x slower than 1 on a 2-CPU machine at load 8).
    """
    if n:
        return n
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    try:
        busy = max(0.0, os.getloadavg()[0] - 1.0)  # this process's own run counts as one
    except OSError:
        busy = 0.0
    return max(1, min(4, cpus, int(cpus - busy + 0.5)))


class Model:
    """A llama.cpp model loaded from a GGUF file (CPU only, no extra buffer types: see the module notes)."""

    def __init__(self, path: str, snapshot):
        lib = self.lib = load_library()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = False  # ggml's AMX path segfaults on the first decode on AMX machines
        self.ptr = lib.llama_model_load_from_file(path.encode(), mp)
        if not self.ptr:
            raise ModelLoadError(f"{snapshot.source}: llama.cpp cannot load {path} ({_log_tail()})")
        a = snapshot.args
        vocab = lib.llama_model_get_vocab(self.ptr)
        theirs = {"n_layers": lib.llama_model_n_layer(self.ptr), "dim": lib.llama_model_n_embd(self.ptr),
                  "n_heads": lib.llama_model_n_head(self.ptr), "n_kv_heads": lib.llama_model_n_head_kv(self.ptr),
                  "vocab_size": lib.llama_vocab_n_tokens(vocab)}
        diff = [f"{k} {getattr(a, k)} (ours) vs {v} (llama.cpp)" for k, v in theirs.items() if getattr(a, k) != v]
        if diff:
            self.close()
            raise ModelLoadError(f"{snapshot.source}: llama.cpp reads another model from {path}: " + "; ".join(diff))

    def close(self):
        if self.ptr:
            self.lib.llama_model_free(self.ptr)
            self.ptr = None


def _context(model: Model, cfg, n_tokens: int, n_seqs: int, threads: int, cb):
    """A llama.cpp context for one call: every sequence in one unified KV cache, CPU only, cb_eval set."""
    lib = model.lib
    cp = lib.llama_context_default_params()
    cp.n_ctx = max(256, -(-n_tokens // 256) * 256)
    cp.n_batch = cfg.n_batch
    cp.n_ubatch = min(cfg.n_ubatch, cfg.n_batch)
    cp.n_seq_max = n_seqs
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = FLASH[cfg.flash_attn]
    cp.type_k, cp.type_v = GGML_TYPES[cfg.type_k], GGML_TYPES[cfg.type_v]
    cp.kv_unified = True  # one stream: ubatches are consecutive tokens of the batch (split_simple)
    cp.offload_kqv = cp.op_offload = False
    cp.no_perf = True
    cp.cb_eval = cb
    cp.cb_eval_user_data = None
    ctx = lib.llama_init_from_model(model.ptr, cp)
    if not ctx:
        raise ConfigError(f"llama.cpp refused the context settings ({_log_tail()})")
    return ctx


def _decode(lib, ctx, batch, chunk, cap: Capture) -> None:
    """One llama_decode of stream entries (seq, token, position), logits requested for every row."""
    for j, (s, t, p) in enumerate(chunk):
        batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, p, 1
        batch.seq_id[j][0] = s
        batch.logits[j] = 1  # every row: otherwise the last layer keeps only the output rows
    batch.n_tokens = len(chunk)
    rc = lib.llama_decode(ctx, batch)
    if cap.error is not None:
        raise cap.error
    if rc != 0:
        raise ConfigError(f"llama_decode refused the batch (status {rc}): {_log_tail()}")


def run_call(model: Model, cfg, seqs, n_vocab: int, n_layers: int, threads: int | None = None):
    """One llama.cpp context: ``seqs`` is a list of (token ids, positions), each its own seq_id.

    Returns (Capture with the ubatches, logits per sequence at its last token, resolved flash flag,
    cache positions per sequence from llama.cpp's memory).
    """
    lib = model.lib
    stream = [(s, int(t), int(p)) for s, (ids, pos) in enumerate(seqs) for t, p in zip(ids, pos)]
    n = len(stream)
    cap = Capture(n_layers)
    cb = lib.ggml_backend_sched_eval_callback(cap)  # referenced until the context is freed
    ctx = _context(model, cfg, n, len(seqs), threads or _threads(cfg.n_threads), cb)
    batch = lib.llama_batch_init(min(n, cfg.n_batch), 0, 1)
    last = {s: i for i, (s, _, _) in enumerate(stream)}  # stream index of each sequence's last token
    logits, cache_pos = {}, []
    try:
        for c0 in range(0, n, cfg.n_batch):
            chunk = stream[c0:c0 + cfg.n_batch]
            _decode(lib, ctx, batch, chunk, cap)
            for s, i in last.items():
                if c0 <= i < c0 + len(chunk):
                    ptr = lib.llama_get_logits_ith(ctx, i - c0)
                    logits[s] = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()
        mem = lib.llama_get_memory(ctx)
        for s in range(len(seqs)):
            lo, hi = lib.llama_memory_seq_pos_min(mem, s), lib.llama_memory_seq_pos_max(mem, s)
            cache_pos.append(np.arange(lo, hi + 1, dtype=np.int64) if hi >= lo >= 0 else np.zeros(0, np.int64))
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        del cb
    return cap, logits, not cap.softmax_seen, cache_pos


def _stack(cap: Capture, key, n: int, layer: int) -> np.ndarray:
    parts = []
    for i, ub in enumerate(cap.ubatches):
        if key not in ub:
            raise PrefillDiffError(f"llama.cpp computed no {key[0]} node for layer {layer} in micro-batch {i} "
                                   "(a model graph this tool does not know)")
        parts.append(ub[key])
    x = np.concatenate(parts, axis=0)  # ubatches are consecutive runs of the batch's tokens
    if x.shape[0] != n:
        raise PrefillDiffError(f"llama.cpp's {key[0]} nodes of layer {layer} hold {x.shape[0]} rows for {n} tokens")
    return x


def _ours(k: np.ndarray, permuted: bool) -> np.ndarray:
    """(tokens, H, d_h) in llama.cpp's layout -> ours: llama dim 2j is our dim j, 2j+1 is j + d_h/2."""
    return np.concatenate([k[..., 0::2], k[..., 1::2]], axis=-1) if permuted else k


class CallCells:
    """Where a call's sequences sit: stream order (how llama.cpp got them) <-> the call's (row, column)."""

    def __init__(self, call):
        ids, valid = call.ids, call.mask.bool()
        seq = (call.segments if call.segments is not None
               else torch.arange(ids.shape[0])[:, None].expand_as(ids)).clone()
        self.valid, self.seq = valid, torch.where(valid, seq, torch.full_like(ids, -1))
        self.tok = torch.full_like(ids, -1)
        self.runs: list[SeqRun] = []  # in stream order
        for s in range(len(call.samples)):
            cells = (self.seq == s).nonzero()
            r, c0, c1 = int(cells[0, 0]), int(cells[0, 1]), int(cells[-1, 1]) + 1
            self.tok[r, c0:c1] = torch.arange(c1 - c0)
            self.runs.append(SeqRun(row=r, seq=s, c0=c0, c1=c1))
        self.shape, self.n = tuple(ids.shape), sum(c1 - c0 for _, _, c0, c1 in self.runs)

    def sequences(self, call) -> list:
        """(token ids, positions) per sequence, for llama.cpp."""
        return [(call.ids[r, c0:c1].tolist(), call.positions[r, c0:c1].tolist()) for r, _, c0, c1 in self.runs]

    def grid(self, rows: np.ndarray) -> np.ndarray:
        """Stream rows (n, width) -> (B, W, width) in the call's cells."""
        out = np.zeros((*self.shape, rows.shape[1]), dtype=rows.dtype)
        at = 0
        for r, _, c0, c1 in self.runs:
            out[r, c0:c1] = rows[at:at + c1 - c0]
            at += c1 - c0
        return out


def _emit_layer(placement, cells: CallCells, cap: Capture, layer: int, prev, cache_pos, cfg, permuted: bool):
    """One layer's states and cache to the recorder; returns the layer output (the next layer's input)."""
    n = cells.n
    out = _stack(cap, ("l_out", layer), n, layer)
    states = {"layer_input": prev, "attn_update": _stack(cap, ("attn_out", layer), n, layer),
              "mid": _stack(cap, ("ffn_inp", layer), n, layer),
              "mlp_update": _stack(cap, ("ffn_down", layer), n, layer), "layer_output": out,
              "attn_heads": _stack(cap, ("kqv_out", layer), n, layer)}
    for name, x in states.items():
        placement.state(layer, name, cells.grid(x.reshape(n, -1)), 0)
    k = _stack(cap, ("Kcur", layer), n, layer)  # (tokens, H_kv, d_h), llama's layout
    v = _stack(cap, ("Vcur", layer), n, layer)
    k = _ours(_cache_round(k.reshape(n, -1), cfg.type_k).reshape(k.shape), permuted)
    v = _cache_round(v.reshape(n, -1), cfg.type_v).reshape(v.shape)
    at = 0
    for r, s, c0, c1 in cells.runs:
        T, p = c1 - c0, cache_pos[s]
        if p.shape[0] != T:
            raise PrefillDiffError(f"llama.cpp's cache of sequence {s} holds positions {p.tolist()[:8]} "
                                   f"for {T} tokens")
        placement.cache(layer, s, np.ascontiguousarray(k[at:at + T].swapaxes(0, 1)),  # (H_kv, T, d_h)
                        np.ascontiguousarray(v[at:at + T].swapaxes(0, 1)), p)
        at += T
    return out


def emit_call(call, placement, cells: CallCells, cap: Capture, logits: dict, cache_pos, n_layers: int, cfg,
              permuted: bool) -> None:
    """Hand one context's nodes to the recorder, in the call's (row, column) coordinates."""
    placement.inputs(call.ids, cells.valid, call.positions, cells.tok, cells.seq)
    prev = _stack(cap, ("inp_embd", None), cells.n, 0)
    for layer in range(n_layers):
        prev = _emit_layer(placement, cells, cap, layer, prev, cache_pos, cfg, permuted)
    norm = _stack(cap, ("result_norm", None), cells.n, n_layers)
    at = 0
    for r, s, c0, c1 in cells.runs:
        at += c1 - c0
        placement.final(s, norm[at - 1], logits[s], (r, c1 - 1), c1 - c0 - 1)


def _run_meta(recorder, prep, gfile: GgufFile, cfg, flash_on: bool, threads: int) -> None:
    """What the trace must say about this run: the weight precision and cache type that set its tolerance."""
    desc = gfile.describe
    dtype = desc["weights_dtype"]
    if flash_on and dtype == "float32":
        dtype = "float16"  # flash attention casts K and V to f16 on the CPU backend
    cache = "float32" if cfg.type_k == cfg.type_v == "f32" else _coarser(cfg.type_k, cfg.type_v)
    prep.record["quantized_weights_digest"] = desc["quantized_weights_digest"]
    prep.record["llama_cpp"] = {
        "version": version(), "gguf": gfile.path if gfile.converted is None else None,
        "converted_from_snapshot": gfile.converted, "arch": desc["arch"], "weight_types": desc["weight_types"],
        "weight_quant": desc["weight_quant"], "flash_attn": flash_on, "flash_attn_setting": cfg.flash_attn,
        "type_k": cfg.type_k, "type_v": cfg.type_v, "n_ubatch": cfg.n_ubatch, "n_batch": cfg.n_batch,
        "n_threads": threads, "kv_unified": True, "use_extra_bufts": False}
    meta = recorder.meta
    recorder.update_meta(engine={**meta.get("engine", {}), "dtype": dtype, "activations": "float32",
                                 "weight_quant": desc["weight_quant"], "flash_attn": flash_on},
                         layout={**meta.get("layout", {}), "dtype": cache,
                                 "llama_cpp_types": [cfg.type_k, cfg.type_v]},
                         record=dict(prep.record))


def plan(prep, positions, pad: int, tp) -> None:
    """The calls of the run's batching (one sequence each, or all as seq_ids of one batch); llama.cpp's library
    is loaded now, so that a missing or broken install is said before either side runs."""
    prep.calls = plan_calls([list(t) for t in prep.tokens], positions, list(range(len(prep.tokens))),
                            prep.side.run.batching, pad)
    load_library()


def execute(prep, recorder):
    """Runs every call, hands the nodes over, then yields each layer."""
    check(prep)
    snap, cfg = prep.snapshot, prep.side.run.options
    load_library()
    threads = _threads(cfg.n_threads)
    gfile = GgufFile(snap, cfg.gguf_type)
    model, flash = None, set()
    try:
        model = Model(gfile.path, snap)
        permuted = gfile.describe["arch"] == "llama"
        for call in prep.calls:
            cells = CallCells(call)
            cap, logits, fl, cache_pos = run_call(model, cfg, cells.sequences(call), snap.args.vocab_size,
                                                  snap.args.n_layers, threads)
            flash.add(fl)
            emit_call(call, Placement(recorder, call.runs, call.samples), cells, cap, logits, cache_pos,
                      snap.args.n_layers, cfg, permuted)
            del cap
    finally:
        if model is not None:
            model.close()
        gfile.close()
    _run_meta(recorder, prep, gfile, cfg, True in flash, threads)
    for layer in range(snap.args.n_layers):
        yield layer
    return prep.record


def _coarser(*types: str) -> str:
    order = ("int8", "float16", "bfloat16", "float32")
    names = [CACHE_DTYPE.get(t, "int8") for t in types]
    return min(names, key=order.index)
