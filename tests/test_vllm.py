"""The vllm engine: vLLM in its own environment, captured through hooks (engine/foreign/vllm_engine.py, vllm_worker.py).

The tests that run vLLM need an environment with it: PREFILL_DIFF_VLLM_PYTHON (the README's test line makes one
with `prefill-diff vllm-setup`), or vLLM in this one. In CI (CI=true) its absence is a failure, never a skip.
The layout probe and the worker's protocol are tested here without vLLM.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from prefill_diff.engine.foreign import vllm_probes, vllm_worker
from prefill_diff.engine.foreign.vllm_engine import ENV

pytestmark = pytest.mark.slow  # vLLM in its own environment and process


def _vllm_python() -> str | None:
    given = os.environ.get(ENV)
    if given:
        return given
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


@pytest.fixture(scope="module")
def vllm_python():
    py = _vllm_python()
    if py is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs every vLLM test: set {ENV} (the README's test line makes the environment)")
        pytest.skip(f"no vLLM environment ({ENV} unset and vLLM not installed here)")
    return py


def _cpu_has(*flags: str) -> bool:
    """Whether this CPU reports any of ``flags`` in /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(" + "|".join(flags) + r")\b", text))


def _cpu_runs_fp8_kv() -> bool:
    """Whether vLLM's CPU build can store an fp8 KV cache here (it needs AVX-512 or AMX)."""
    return _cpu_has("avx512f", "amx_tile")


def _json(res) -> dict:
    return json.loads(res.output)


# -- the cache layout probe, with fake kernels (no vLLM) -----------------------------------------------

B, H, D = 8, 2, 4


def _kernel(place):
    """A fake cache kernel storing element (slot offset, head, dim) of each token where ``place`` says, in the
    [heads, block_size, dim] view of a block's key (value) region, as vLLM's CPU backend hands it over."""
    def write(k, v, kc, vc, slots):
        for t, s in enumerate(slots.tolist()):
            block, off = divmod(s, kc.shape[2])
            for h in range(k.shape[1]):
                for d in range(k.shape[2]):
                    row, col = place(off, d)
                    kc[block, h, row, col] = k[t, h, d].to(kc.dtype)
                    vc[block, h, row, col] = v[t, h, d].to(vc.dtype)
    return write


LAYOUTS = {
    "plain": lambda off, d: (off, d),
    "keys transposed": lambda off, d: divmod(d * B + off, D),  # [dim, block_size] inside the block
    "pairs packed": lambda off, d: divmod((off // 2) * 2 * D + d * 2 + off % 2, D),  # VNNI-like interleave
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_probe_learns_the_kernels_layout_and_reads_the_cache_back(name, dtype):
    write = _kernel(LAYOUTS[name])
    lk, lv = vllm_probes.learn_layout(write, B, H, D, dtype)
    assert lk.shape == (B, H, D) and sorted(lk.flatten().tolist()) == list(range(B * H * D))
    # a sequence of 13 positions over two non-adjacent blocks, read back through the block table
    g = torch.Generator().manual_seed(0)
    n, blocks = 13, [3, 1]
    keys = torch.randn(n, H, D, generator=g).to(dtype).to(torch.float32)  # values the cache can hold exactly
    values = torch.randn(n, H, D, generator=g).to(dtype).to(torch.float32)
    cache = torch.zeros((5, H, 2 * B, D), dtype=dtype)
    kc, vc = cache.chunk(2, dim=2)
    slots = torch.tensor([blocks[p // B] * B + p % B for p in range(n)])
    write(keys, values, kc, vc, slots)
    got_k = vllm_probes.read_cache(kc, blocks, n, lk, lambda x: x.to(torch.float32))
    got_v = vllm_probes.read_cache(vc, blocks, n, lv, lambda x: x.to(torch.float32))
    np.testing.assert_array_equal(got_k, keys.permute(1, 0, 2).numpy())  # (heads, positions, dim)
    np.testing.assert_array_equal(got_v, values.permute(1, 0, 2).numpy())


def test_a_kernel_the_probe_does_not_understand_is_refused():
    def lossy(k, v, kc, vc, slots):  # every element lands on one place: no bijection
        for s in slots.tolist():
            block, _ = divmod(s, kc.shape[2])
            kc[block, 0, 0, 0] = k[0, 0, 0]
            vc[block, 0, 0, 0] = v[0, 0, 0]
    with pytest.raises(RuntimeError):
        vllm_probes.learn_layout(lossy, B, H, D, torch.float32)


def _rotary(rounding, neox):
    """A fake rotary kernel with vLLM's signature: float32 arithmetic on a bfloat16 table, then ``rounding``."""
    r = 32
    inv = 1.0 / (10000.0 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    f = torch.arange(512, dtype=torch.float32)[:, None] * inv
    table = torch.cat((f.cos(), f.sin()), dim=-1)

    def rotate(pos, q, k):
        cos, sin = table[pos].to(torch.bfloat16).float().chunk(2, dim=-1)
        x = q.float()
        x1, x2 = (x[:, :r // 2], x[:, r // 2:r]) if neox else (x[:, 0:r:2], x[:, 1:r:2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        o = torch.cat((o1, o2), -1) if neox else torch.stack((o1, o2), -1).flatten(-2)
        out = q.clone()
        out[:, :r] = rounding(o)
        return out, k
    return rotate, table


ROUNDINGS = {
    "nearest": lambda o: o.to(torch.bfloat16),
    "truncate": lambda o: (o.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16),
    "other": lambda o: (o.to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16),  # one step further out
}


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rounding", sorted(ROUNDINGS))
def test_the_probe_learns_how_a_kernel_rounds_to_bfloat16(rounding, neox):
    rotate, table = _rotary(ROUNDINGS[rounding], neox)
    assert vllm_probes.learn_rounding(rotate, table, 48, neox) == rounding  # partial rotary: 32 of 48 dims


def test_frames_round_trip_and_a_truncated_frame_is_refused(tmp_path):
    import io
    from prefill_diff.engine.foreign.vllm_engine import WorkerFailed, frames
    buf = io.BytesIO()
    ch = vllm_worker.Channel(buf)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    ch.send({"type": "sample", "index": 0}, {"x": a, "e": np.zeros((0, 4), np.float32)})
    ch.send({"type": "done"})
    got = list(frames(io.BytesIO(buf.getvalue())))
    assert got[0][0]["type"] == "sample" and np.array_equal(got[0][1]["x"], a) and got[0][1]["e"].shape == (0, 4)
    assert got[1][0] == {"type": "done"}
    with pytest.raises(WorkerFailed, match="ended inside an array"):
        list(frames(io.BytesIO(buf.getvalue()[:-60])))


@pytest.mark.parametrize("module", [vllm_worker, vllm_probes], ids=["worker", "probes"])
def test_the_worker_imports_nothing_of_ours(module):
    """The worker, and the file beside it that it loads by path: both run in vLLM's environment."""
    import ast
    tree = ast.parse(open(module.__file__, encoding="utf-8").read())
    names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + \
        [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in names if m.startswith(("prefill_diff", "."))] and \
        not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))


def test_the_worker_loads_its_probes_by_path_outside_any_package(tmp_path):
    """As vLLM's interpreter runs it (-I: no script directory or package on the import path), from elsewhere."""
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('w', sys.argv[1]); "
            "w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w); print(w.probes.__file__)")
    got = subprocess.run([sys.executable, "-I", "-c", code, vllm_worker.__file__], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == os.path.abspath(vllm_probes.__file__)


# -- finding vLLM, and refusals before anything runs (no vLLM needed) --------------------------------------

def test_no_vllm_anywhere_is_one_line_naming_both_ways(run_cli, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else
                        importlib.machinery.PathFinder.find_spec(name))
    res = run_cli("run", "reference", "vllm")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "[run.vllm] python" in res.output and ENV in res.output and "prefill-diff vllm-setup" in res.output


def test_a_wrong_python_path_is_one_line(run_cli, monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path / "nope" / "python"))
    res = run_cli("run", "reference", "vllm")
    assert res.exit_code == 2 and f"{ENV} must be an executable Python interpreter" in res.output
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'preset = "vllm"\n[run.vllm]\npython = "{tmp_path / "missing"}"\n')
    res = run_cli("run", "reference", cfg)
    assert res.exit_code == 2 and "[run.vllm] python must be an executable" in res.output


def test_an_environment_without_vllm_is_one_line(run_cli, monkeypatch):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this environment has vLLM")
    monkeypatch.setenv(ENV, sys.executable)  # ours: no vLLM in it
    res = run_cli("run", "reference", "vllm")
    assert res.exit_code == 2 and "cannot import vLLM" in res.output and "vllm-setup" in res.output


@pytest.mark.parametrize("toml, says", [
    ('[run.vllm]\nengine_args = { model = "x" }\n', "engine_args may not set model (set by [model] source)"),
    ('[run.vllm]\nengine_args = { trust_remote_code = true }\n', "trust_remote_code"),
    ('[run.vllm]\nengine_args = { dtype = "half" }\n', "dtype (set by [run] dtype)"),
    ('[run.vllm]\nwarm = true\n', "warm = true fills vLLM's prefix cache: it needs prefix_caching = true"),
    ('[run]\nbatching = "left"\n', "vLLM never pads"),
    ('[run]\ndtype = "float64"\n', "vLLM runs float32, bfloat16 or float16"),
    ('[run]\ntp = 2\n', "does not shard over tensor-parallel ranks"),
    ('[fault]\nname = "gqa-mapping"\n', "cannot inject fault gqa-mapping (it injects: cache-write, position-restart, "
                                          "decode-position)"),
    ('[reuse]\nprefix_len = 4\n', "vLLM's own prefix cache"),
])
def test_what_vllm_cannot_run_is_refused_before_anything_starts(toml, says, run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "never-started"))  # refused before the interpreter is even looked at
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "vllm"\n' + toml)
    res = run_cli("run", "reference", cfg)
    assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_the_interpreter_is_never_read_from_a_trace():
    from prefill_diff.engine.config import load_side, run_from_dict
    side = load_side("vllm")
    d = side.run.as_dict()
    assert "python" not in d["vllm"]
    d["vllm"]["python"] = "/tmp/evil/python"  # a stranger's trace
    assert run_from_dict(d, "trace").options.python is None


# -- vLLM itself ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["vllm", "vllm-chunked", "vllm-prefix-cache", "vllm-bf16", "vllm-fp8-kv"])
def test_each_vllm_preset_passes_against_the_reference(preset, vllm_python, run_cli, tmp_path):
    res = run_cli("run", "reference", preset, "--json", tmp_path / "report.json", "--out", tmp_path)
    if preset == "vllm-fp8-kv" and not _cpu_runs_fp8_kv():
        # vLLM's CPU build stores fp8 caches only with AVX-512 or AMX: its refusal is one line, exit 2, no trace
        assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
        assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in res.output, res.output
        assert not (tmp_path / "cand.h5").exists()
        return
    rep = json.loads((tmp_path / "report.json").read_text())  # the terminal report is res.output
    assert res.exit_code == 0, rep["verdict_line"]
    assert len(rep["layers"]) == 4 and not rep["inconclusive"]
    if preset in ("vllm-bf16", "vllm-fp8-kv"):  # below float32: judged against measured noise, with a twin of
        # the candidate's precisions run by our engine (the reference preset is ours)
        assert rep["rule"].startswith("calibrated:") and "bfloat16" in rep["rule"], rep["rule"]
        assert rep["policy"]["calibration"]["golden"] == "float64", rep["policy"]
    else:  # float32: vLLM agrees with our engine within the fixed float32 rule
        assert rep["rule"].startswith("fixed float32 rule"), rep["rule"]
    from prefill_diff.dumps.reader import Trace
    with Trace(tmp_path / "cand.h5") as t:
        v = t.meta["record"]["vllm"]
        assert v["version"] and v["effective"]["block_size"] == 32 and len(v["samples"]) == 3
        if preset == "vllm-chunked":  # the 70- and 45-token prompts take several steps each
            steps = {s["sample"]: s["steps"] for s in v["samples"]}
            assert steps[0] >= 3 and steps[1] >= 2, steps
        if preset == "vllm-prefix-cache":
            hits = {s["sample"]: s["num_cached_tokens"] for s in v["samples"]}
            assert hits == {0: 64, 1: 32, 2: 0}, hits
            assert any("tokens from the prefix cache: sample 0 64 of 70, sample 1 32 of 45" in n
                       for n in rep["notes"]), rep["notes"]
        _check_prefill(rep, t, preset, res.output)


def _check_prefill(rep: dict, t, preset: str, out: str) -> None:
    """The JSON's candidate.prefill against what vLLM did: the positions each sample computed (its trace's
    residual states), vLLM's own count of cached tokens and its scheduler's steps, its effective budget."""
    p, v = rep["candidate"]["prefill"], t.meta["record"]["vllm"]
    assert p["token_budget"] == v["effective"]["max_num_batched_tokens"] and p["budget_per"] == "step", p
    assert rep["candidate"]["engine"]["chunk_size"] is None  # vLLM's chunks are its scheduler's, said in prefill
    by_vllm = {o["sample"]: o for o in v["samples"]}
    for o in p["samples"]:
        _, toks = t.cells(o["sample"])
        assert o["tokens"] == int(t.lengths[o["sample"]]) and o["computed"] == toks.size, o
        assert o["from_cache"] == int(toks[0]) == by_vllm[o["sample"]]["num_cached_tokens"], o
        assert o["steps"] == by_vllm[o["sample"]]["steps"] >= -(-o["computed"] // p["token_budget"]), o
    said = [ln for ln in out.splitlines() if ln.startswith("candidate prefill")]
    if preset == "vllm-chunked":  # a 32-token budget: the 70- and 45-token prompts over several steps
        assert p["token_budget"] == 32 and [o["steps"] > 1 for o in p["samples"]] == [True, True, False], p
        assert said and said[0].startswith("candidate prefill (budget 32 tokens a step, shared): sample 0: 0 from "
                                           f"cache + 70 computed, {p['samples'][0]['steps']} steps;"), out
    elif preset == "vllm-prefix-cache":
        assert [(o["from_cache"], o["computed"]) for o in p["samples"]] == [(64, 6), (32, 13), (0, 9)], p
        assert said and "sample 0: 64 from cache + 6 computed, 1 step; sample 1: 32 from cache + 13 computed" in \
            said[0], out
    else:
        assert all(o["from_cache"] == 0 for o in p["samples"]), p
        if preset == "vllm-fp8-kv":
            assert t.meta["layout"]["dtype"] == "fp8_e4m3"
        if preset == "vllm":
            assert v["bf16_rounding"] is None
        if preset == "vllm-bf16":  # its x86 CPU kernels round toward zero without AVX512-BF16, and the report says so
            assert v["bf16_rounding"] in (("truncate",) if not _cpu_has("avx512_bf16") else ("nearest", "truncate"))
            said = any("round float32 to bfloat16 toward zero" in n for n in rep["notes"])
            assert said == (v["bf16_rounding"] == "truncate"), rep["notes"]


def test_cold_against_warm_vllm_against_itself(vllm_python, run_cli):
    rep = _json(res := run_cli("run", "vllm", "vllm-prefix-cache", "--json", "-"))
    assert res.exit_code == 0, rep["verdict_line"]
    assert rep["rule"].startswith("fixed float32 rule")
    # the reused positions are compared as cache entries, the computed suffix as residuals
    assert any("positions 0..63 have residual states in the reference only" in n for n in rep["notes"])


@pytest.mark.parametrize("fault, where", [
    ("fault:vllm-cache-write", (2, "cache_keys", "value")),  # the middle layer, sample 0's last slot
    ("fault:vllm-position-restart", (0, "cache_positions", "cache_positions")),  # §2.11 row 3, after a real hit
])
def test_faults_inside_vllm_are_localised(fault, where, vllm_python, run_cli):
    rep = _json(res := run_cli("run", "reference", fault, "--json", "-"))
    fb = rep["first_break"]
    assert res.exit_code == 1 and (fb["layer"], fb["tensor"], fb["kind"]) == where, rep["verdict_line"]
    assert fb["sample"] == 0


@pytest.mark.parametrize("family", ["synthetic:qwen3", "synthetic:llama-biased", "synthetic:mistral",
                                    "synthetic:gemma2", "synthetic:gemma3", "synthetic:granite", "synthetic:phi3"])
def test_vllm_runs_the_dense_families(family, vllm_python, run_cli):
    """Qwen3's QK-norm, Llama's attention and MLP biases, Mistral's sliding window, Gemma's sandwich norms,
    soft-caps and (Gemma 3) window and full layers in two KV cache groups, Granite's multipliers and Phi-3's fused
    projections, as vLLM's own classes compute them; the built-in prompts (70, 45 and 9 tokens) are longer than
    the windows (8)."""
    rep = _json(res := run_cli("run", "reference", "vllm", "--model", family, "--json", "-"))
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert len(rep["layers"]) == 4 and rep["rule"].startswith("fixed float32 rule")


@pytest.mark.parametrize("family", ["synthetic:mixtral", "synthetic:qwen2-moe", "synthetic:qwen3-moe"])
def test_vllm_runs_the_mixtures_of_experts_and_records_its_routing(family, vllm_python, run_cli, tmp_path):
    """vLLM's fused MoE layers (Qwen2-MoE's gated shared expert, Qwen3-MoE's dense last layer) against our engine
    in float32: the same experts at every token of every MoE layer, and the values within the float32 rule."""
    rep = _json(res := run_cli("run", "reference", "vllm", "--model", family, "--json", "-", "--out", tmp_path))
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    from prefill_diff.dumps.reader import Trace
    from prefill_diff.engine.models.args import MODEL_PRESETS
    args = MODEL_PRESETS[family]
    moe = [i for i in range(args.n_layers) if args.moe(i)]
    n_tokens = 0
    with Trace(tmp_path / "ref.h5") as ref, Trace(tmp_path / "cand.h5") as cand:
        for i in range(args.n_layers):
            assert (cand.layer(i).routing("ids") is None) == (i not in moe), i
        for s in range(ref.n_samples):
            (rc, rt), (cc, ct) = ref.cells(s), cand.cells(s)
            assert np.array_equal(rt, ct)  # both unbatched: every token computed, in order
            n_tokens += len(rc)
            for i in moe:  # vLLM's own choices, in descending weight, and its router logits at the full level
                r, c = ref.layer(i), cand.layer(i)
                ids_r, ids_c = r.routing("ids")[s][rc], c.routing("ids")[s][cc]
                assert np.array_equal(np.sort(ids_r, -1), np.sort(ids_c, -1)), (s, i)
                assert (np.diff(c.routing("weights")[s][cc], axis=-1) <= 0).all()
                np.testing.assert_allclose(c.routing("logits")[s][cc], r.routing("logits")[s][rc], atol=1e-4)
    assert rep["routing"]["tokens_compared"] == n_tokens * len(moe) and rep["routing"]["flips"] == 0, rep["routing"]


def test_vllm_bf16_flips_on_a_near_tie_are_inconclusive_never_pass(near_tie, vllm_python, run_cli):
    """vLLM cannot be told which experts to take: an explained flip takes its sample out of the comparison from
    that layer on, and the verdict is INCONCLUSIVE (exit status 1)."""
    rep = _json(res := run_cli("run", "reference", "vllm-bf16", "--model", near_tie, "--json", "-"))
    assert res.exit_code == 1 and rep["verdict"] == "inconclusive", rep["verdict_line"]
    r = rep["routing"]
    assert r["flips"] >= 1 and r["explained"] == r["flips"] and not r["blamed"] and not r["replayed"], r
    assert r["not_compared_samples"] and "not rerun with the reference's routing" in rep["verdict_line"]


def test_a_hugging_face_checkpoint_against_vllm(vllm_python, run_cli, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         tie_word_embeddings=False, max_position_embeddings=512))
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    rep = _json(res := run_cli("run", "reference", "vllm", "--model", f"hf:{tmp_path / 'hf'}", "--json", "-"))
    assert res.exit_code == 0 and len(rep["layers"]) == 3, rep["verdict_line"]


def test_vllm_refusals_and_crashes_are_one_line_exit_2_without_leftovers(vllm_python, run_cli, tmp_path):
    out = tmp_path / "t.h5"
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "vllm"\n[run.vllm]\nengine_args = { max_num_batched_tokenz = 8 }\n')
    res = run_cli("record", cfg, "-o", out)
    assert res.exit_code == 2 and "'max_num_batched_tokenz'" in res.output and "did you mean" in res.output
    res = run_cli("record", "vllm", "--model", "seed-2.8", "-o", out)  # head_dim 4: vLLM's CPU attention refuses
    assert res.exit_code == 2 and "vLLM" in res.output and len(res.output.strip().splitlines()) == 1, res.output
    crash = tmp_path / "crashing-python"  # vLLM dies in its first engine step
    crash.write_text(f"#!/bin/sh\ncase \"$2\" in *vllm_worker.py) ;; *) exec {vllm_python} \"$@\";; esac\n"
                     f"exec {vllm_python} -c 'import os, signal, sys, runpy\n"
                     "from vllm.v1.engine.llm_engine import LLMEngine\n"
                     "LLMEngine.step = lambda self: os.kill(os.getpid(), signal.SIGKILL)\n"
                     "sys.argv = sys.argv[1:]\n"
                     "runpy.run_path(sys.argv[0], run_name=\"__main__\")' \"$2\" \"$3\"\n")
    crash.chmod(crash.stat().st_mode | stat.S_IXUSR)
    cfg.write_text(f'preset = "vllm"\n[run.vllm]\npython = "{crash}"\n')
    res = run_cli("record", cfg, "-o", out)
    assert res.exit_code == 2 and "killed by SIGKILL" in res.output, res.output
    assert not out.exists() and not list(tmp_path.glob(".t.h5*"))  # no trace, no partial file
    left = subprocess.run(["pgrep", "-f", "vllm_worker.py"], capture_output=True, text=True).stdout.split()
    assert not left, left  # no orphan worker


def test_an_hf_overrides_change_is_a_model_identity_difference(vllm_python, run_cli, tmp_path):
    """The trace records the model config vLLM really ran: an override of the RoPE base is another model."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "vllm"\n[run.vllm]\nengine_args = { hf_overrides = { rope_parameters = '
                   '{ rope_theta = 20000.0, rope_type = "default" } } }\n')
    rep = _json(res := run_cli("run", "reference", cfg, "--json", "-"))
    assert res.exit_code == 1 and rep["first_break"]["kind"] == "identity", rep["verdict_line"]
    assert [d["key"] for d in rep["identity_differences"]] == ["rope_theta"]
    assert rep["layers"][0]["first_break"]["tensor"] == "cache_keys"


# -- vLLM's own decode steps, teacher-forced -------------------------------------------------------------------

RESPONSE = "31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46"  # 16 tokens after each built-in prompt (70, 45, 9)


def test_vllm_decode_passes_against_one_prefill_at_every_response_position(vllm_python, run_cli, tmp_path):
    """vLLM writes the response in its own decode steps (a logits processor forces each token): float32 passes
    against our engine's one prefill of prompt + response at every position, the cache after the last step."""
    from prefill_diff.dumps.reader import Trace
    res = run_cli("run", "reference", "vllm-decode", "--response-ids", RESPONSE, "--json", tmp_path / "r.json",
                  "--out", tmp_path)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert res.exit_code == 0 and rep["verdict"] == "pass", res.output
    assert rep["rule"].startswith("fixed float32 rule")
    lp = rep["logprobs"]
    assert lp["tokens"] == 48 and lp["max_abs_dlogp"] < 1e-4 and lp["k3_kl"] < 1e-8, lp
    assert rep["final"]["tensors"]["response_logits"]["compared"] > 0
    with Trace(tmp_path / "cand.h5") as t:
        for s, p in enumerate((70, 45, 9)):
            tok = t.inputs["token_index"][s]
            valid = tok >= 0
            dec = valid & (tok >= p)
            assert dec.sum() == 16 and (t.rows["phase"][s][dec] == 1).all() and (t.rows["phase"][s][valid & ~dec] == 0).all()
            assert t.rows["step"][s][dec].tolist() == list(range(16))
            assert t.rows["cache_len"][s][dec].tolist() == [p + i + 1 for i in range(16)]  # vLLM's seq_lens
            assert (t.rows["cache_len"][s][valid & ~dec] == p).all()  # the prompt in one step
            assert t.response["token_index"][s].tolist() == list(range(p - 1, p + 15))
        v = t.meta["record"]["vllm"]
        assert [o["steps"] for o in v["samples"]] == [17, 17, 17]  # one prefill step, sixteen decode steps
        # vLLM's own log-probs of the forced tokens are the captured logits' (raw, never the processed 0)
        assert v["logprobs"]["mode"] == "raw_logprobs" and v["logprobs"]["tokens"] == 48
        assert v["logprobs"]["max_abs_diff"] < 1e-5, v["logprobs"]


@pytest.mark.parametrize("model", ["synthetic:qwen3", "synthetic:qwen3-moe"])
def test_vllm_decode_passes_on_qwen3_and_a_mixture_of_experts(model, vllm_python, run_cli, tmp_path):
    """Qwen3's QK-norm and Qwen3-MoE's routing, decoded by vLLM: every response position within float32
    tolerance, a mixture of experts' routing compared at every token its layers route, decode steps included."""
    rep = _json(res := run_cli("run", "reference", "vllm-decode", "--model", model, "--response-ids",
                               "31,32,33,34,35,36", "--json", "-"))
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert rep["logprobs"]["tokens"] == 18 and rep["logprobs"]["max_abs_dlogp"] < 1e-4
    if model.endswith("moe"):
        tokens = sum(o["tokens"] for o in rep["reference"]["prefill"]["samples"])  # prompts + responses
        assert rep["routing"]["tokens_compared"] == 3 * tokens and rep["routing"]["flips"] == 0, rep["routing"]


def test_vllm_decode_bf16_is_calibrated_and_passes(vllm_python, run_cli, tmp_path):
    rep = _json(res := run_cli("run", "reference", "vllm-decode-bf16", "--response-ids", "31,32,33,34", "--json", "-"))
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    assert rep["rule"].startswith("calibrated:") and "bfloat16" in rep["rule"], rep["rule"]
    assert 1e-4 < rep["logprobs"]["max_abs_dlogp"] < 0.1, rep["logprobs"]


def test_vllm_decode_position_fault_breaks_at_layer_0_at_a_decode_step(vllm_python, run_cli):
    rep = _json(res := run_cli("run", "reference", "fault:vllm-decode-position", "--response-ids", "31,32,33,34",
                               "--json", "-"))
    fb = rep["first_break"]
    assert res.exit_code == 1 and (fb["stage"], fb["layer"], fb["kind"]) == ("layer", 0, "cache_positions"), \
        rep["verdict_line"]
    assert fb["decode_step"] is not None and fb["position"] == (70, 45, 9)[fb["sample"]] + fb["decode_step"]


def test_vllm_as_a_one_prefill_side_of_a_response_is_refused_in_one_line(vllm_python, run_cli):
    res = run_cli("run", "reference", "vllm", "--response-ids", "31,32")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "decode = true (preset vllm-decode)" in res.output, res.output
