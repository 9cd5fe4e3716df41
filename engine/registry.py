"""What each engine can compute, declared as data (no torch: the CLI reads it before any engine loads).

A calibrated verdict (verify/calibrate.py) needs two extra runs of the reference's execution path: the
*golden* in float64 and the *twin* at the candidate's precisions. Whether the reference's own engine can
make them, or ours must, is read from ``ENGINES[name].computes`` here, never from a special case for an
engine's name.

Precisions are the dicts of ``verify.calibrate.precisions``: ``dtype`` (weights and activations),
``weight_quant`` (``none``, our ``int8``, or a GGUF type such as ``Q4_1``), ``cache_dtype`` and
``int8_scales``.
"""
from __future__ import annotations

from dataclasses import dataclass

GOLDEN = {"dtype": "float64", "weight_quant": "none", "cache_dtype": "float64"}


@dataclass(frozen=True)
class Computes:
    """The precisions an engine runs on request.

    ``cache_dtypes`` None: its KV cache always has the activation dtype. An engine that runs only what its
    model file says (llama.cpp runs a GGUF's own weight types) declares nothing: it cannot make a twin.
    """
    dtypes: tuple = ()
    cache_dtypes: tuple | None = None
    weight_quants: tuple = ("none",)

    def runs(self, prec: dict) -> bool:
        dtype = prec.get("dtype")
        cache = prec.get("cache_dtype") or dtype
        if dtype not in self.dtypes or prec.get("weight_quant", "none") not in self.weight_quants:
            return False
        return cache == dtype if self.cache_dtypes is None else cache in self.cache_dtypes


@dataclass(frozen=True)
class EngineInfo:
    name: str
    computes: Computes
    why_not: str = ""  # said when a calibrated verdict needs precisions no engine of ours can run


FLOATS = ("float64", "float32", "bfloat16", "float16")
ENGINES = {
    "native": EngineInfo("native", Computes(FLOATS, FLOATS + ("int8",), ("none", "int8"))),
    "transformers": EngineInfo("transformers", Computes(FLOATS)),
    "llama.cpp": EngineInfo("llama.cpp", Computes(),
                            "llama.cpp also quantizes activations to Q8 inside its matmuls on quantized weights"),
}
OURS = "native"


def twin_maker(ref_engine: str, cand_prec: dict) -> str | None:
    """The engine that runs a calibrated comparison's golden and twin: the reference's own when it can run
    float64 and the candidate's precisions, else ours; None when ours cannot run them either."""
    for name in (ref_engine, OURS):
        info = ENGINES.get(name)
        if info is not None and info.computes.runs(GOLDEN) and info.computes.runs(cand_prec):
            return name
    return None

