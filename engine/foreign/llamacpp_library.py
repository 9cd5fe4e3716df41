"""llama-cpp-python, loaded once (its log kept for our messages), and the graph nodes read out of it with ctypes.

``Capture`` is the ``cb_eval`` callback llama.cpp asks once per graph node: it picks the nodes the engine records
(by their names and their weights' names) and copies each computed one out of host memory through the
``ggml_tensor`` struct of the pinned version, checked against ggml's own accessors on the first node.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import os

import numpy as np

from ..shared.errors import ModelLoadError, PrefillDiffError

PINNED = "0.3.36"  # the ggml_tensor layout below is this version's; it is checked at run time as well
INSTALL = "pip install 'prefill-diff[llamacpp]' (builds llama.cpp from source: 6-11 minutes on 2 cores)"
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


def log_tail() -> str:
    """The warnings and errors llama.cpp logged since the last call (the last 400 characters), for our messages."""
    text = "".join(t for keep, t in _STATE["log"] if keep).strip().replace("\n", "; ")
    _STATE["log"].clear()
    return text[-400:] if text else "no message from llama.cpp"


def version() -> str | None:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


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
