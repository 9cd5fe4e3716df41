"""Property: no model file makes the tool crash or hang. A valid config.json, safetensors header and GGUF file are
mutated field by field (type, range, size, absence), and each mutant is recorded by the tool as a subprocess:
exit status 0, 1 or 2 (recorded, a verdict, or refused with a reason), never 3 (an internal error), never a
signal, never longer than HANG seconds. Several hundred mutants: this module takes minutes (marked slow).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_model_files import hf_dir, write_gguf  # noqa: F401  (hf_dir is a fixture)

pytestmark = pytest.mark.slow

HANG = 60  # seconds: a case that runs longer is a hang
# values of the wrong type, out of range, or of absurd size, for any field
HOSTILE = [None, -1, 0, 2 ** 31, 2 ** 63, 1e308, -1.5, "x", [], [1, "a"], {"a": 1}, True, "é" * 4096]
CASES_AT_LEAST = 500  # the floor for one CI run


def _run(model: str, out: str) -> tuple[int | str, str]:
    cmd = [sys.executable, "-m", "prefill_diff.cli.main", "record", "reference", "--model", model, "--tokens",
           "1,2,3", "-o", out, "--force"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG, errors="replace")
    except subprocess.TimeoutExpired:
        return "hang", f"ran past {HANG} s"
    return res.returncode, (res.stderr.strip().splitlines() or [""])[-1][:300]


def _config_mutants(base: dict) -> list:
    out = [(f"config.json without {k}", {kk: v for kk, v in base.items() if kk != k}) for k in base]
    for k in base:
        for v in HOSTILE:
            out.append((f"config.json {k}={json.dumps(v)[:30]}", {**base, k: v}))
    return out


def _safetensors_mutants(raw: bytes) -> list:
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    out = []
    for length in (0, 1, 7, n - 1, n + 1, len(raw), 2 ** 31, 2 ** 63):
        out.append((f"safetensors header length {length}", struct.pack("<Q", length) + raw[8:]))
    for t in names[:2]:
        for field in ("dtype", "shape", "data_offsets"):
            for v in HOSTILE[:10] + ["F99", [2 ** 62, 2 ** 62], [0, 2 ** 40], [-4, 4]]:
                h = json.loads(json.dumps(header))
                h[t][field] = v
                body = json.dumps(h).encode()
                blob = struct.pack("<Q", len(body)) + body + data
                out.append((f"safetensors {t} {field}={json.dumps(v)[:30]}", blob))
        h = {k: v for k, v in header.items() if k != t}
        body = json.dumps(h).encode()
        out.append((f"safetensors without {t}", struct.pack("<Q", len(body)) + body + data))
    for cut in (8, 8 + n // 2, 8 + n, len(raw) // 2, len(raw) - 1):
        out.append((f"safetensors cut at {cut}", raw[:cut]))
    return out


def _gguf_mutants() -> list:
    import gguf
    T = gguf.GGUFValueType
    keys = ["llama.block_count", "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
            "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.freq_base",
            "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size"]
    values = [("two", T.STRING), ([2, 2], T.ARRAY), (0, T.UINT32), (-16, T.INT32), (2 ** 63, T.UINT64),
              (float("nan"), T.FLOAT32), (1.5, T.FLOAT32), (True, T.BOOL), (100_000_000, T.UINT32)]
    return [(f"gguf {k}={v!r:.20}", {k: (v, t)}) for k in keys for v, t in values]


def test_no_mutated_model_file_crashes_or_hangs_the_tool(hf_dir, tmp_path):  # noqa: F811
    base = json.loads((hf_dir / "config.json").read_text())
    raw = (hf_dir / "model.safetensors").read_bytes()
    jobs = []
    for i, (name, cfg) in enumerate(_config_mutants(base)):
        d = tmp_path / f"c{i}"
        shutil.copytree(hf_dir, d)
        (d / "config.json").write_text(json.dumps(cfg, allow_nan=True))
        jobs.append((name, f"hf:{d}"))
    for i, (name, blob) in enumerate(_safetensors_mutants(raw)):
        d = tmp_path / f"s{i}"
        shutil.copytree(hf_dir, d)
        (d / "model.safetensors").write_bytes(blob)
        jobs.append((name, f"hf:{d}"))
    for i, (name, meta) in enumerate(_gguf_mutants()):
        jobs.append((name, f"gguf:{write_gguf(tmp_path / f'g{i}.gguf', meta)}"))
    assert len(jobs) >= CASES_AT_LEAST, len(jobs)
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda j: _run(j[1], str(tmp_path / f"out-{abs(hash(j[0]))}.h5")), jobs))
    bad = [(name, code, said) for (name, _), (code, said) in zip(jobs, results) if code not in (0, 1, 2)]
    counts = {c: sum(1 for code, _ in results if code == c) for c in (0, 1, 2)}
    print(f"{len(jobs)} mutants: {counts[0]} recorded, {counts[1]} verdict 1, {counts[2]} refused, {len(bad)} bad")
    assert not bad, "\n".join(f"{name}: exit {code}: {said}" for name, code, said in bad[:40])
    assert counts[2] >= len(jobs) // 2  # most mutants are refused: the mutations do reach the checks
