"""Tensor-parallel candidates (real torch.distributed process groups, gloo) and compiled layers.

Each spawned run costs seconds (two interpreters importing torch), so the recorded runs are shared
module fixtures: one tp2 run, one run per TP fault, one compiled run; everything else reuses or
tampers with copies of their files.
"""
from __future__ import annotations

import json
import shutil

import h5py
import numpy as np

from prefill_diff.dumps.schema import FORMAT_VERSION
import pytest

from prefill_diff.dumps.rank_merge import RankTrace, merge_stats, open_any
from prefill_diff.dumps.reader import Trace, TraceError
from prefill_diff.engine import parallel
from prefill_diff.engine.shared.errors import ConfigError
from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.jobs import compare_files
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.verify.report import compare_traces

pytestmark = pytest.mark.slow  # process groups: spawned tensor-parallel ranks, torchrun

STATES = ("layer_input", "attn_update", "mid", "mlp_update", "layer_output")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    cache = {}

    def get(source):
        if source not in cache:
            name = source.replace(":", "_")
            cache[source] = record_side(prepare_side(source), d / f"{name}.h5")
        return cache[source]
    return get


# -- sizes ------------------------------------------------------------------------------------------

def test_tp_sizes_that_do_not_divide_the_heads_are_refused_naming_them():
    smol = MODEL_PRESETS["synthetic"].replace(n_heads=9, n_kv_heads=3, dim=144)
    with pytest.raises(ConfigError, match=r"n_heads=9 and n_kv_heads=3 are not divisible by 2.*fit: 3"):
        parallel.check_tp(2, smol)
    parallel.check_tp(3, smol)  # heads fit; our engine also splits the MLP rows (its own check):
    from types import SimpleNamespace as NS
    from prefill_diff.engine.native import engine as native_engine
    run = NS(tp=3, fault=None, options=NS(compile=False))
    native_engine.check(NS(side=NS(run=run), snapshot=NS(args=smol.replace(hidden_dim=129))))
    with pytest.raises(ConfigError, match="hidden_dim=128"):
        native_engine.check(NS(side=NS(run=run), snapshot=NS(args=smol.replace(hidden_dim=128))))
    with pytest.raises(ConfigError, match=r"n_kv_heads=2 is not divisible by 4"):
        parallel.check_tp(4, MODEL_PRESETS["synthetic"])
    with pytest.raises(ConfigError, match="needs a tensor-parallel run"):
        parallel.check_tp(1, MODEL_PRESETS["synthetic"], fault="tp-kv-shard")


def test_bad_tp_is_refused_before_any_process_starts(tmp_path, run_cli, monkeypatch):
    def no_spawn(*a, **kw):
        raise AssertionError("a process was started")
    monkeypatch.setattr(parallel, "launch", no_spawn)
    cfg = tmp_path / "tp4.toml"
    cfg.write_text("[run]\ntp = 4\n")
    res = run_cli("run", "reference", str(cfg))
    assert res.exit_code == 2 and "tp=4 must divide both n_heads and n_kv_heads" in res.output
    assert "n_kv_heads=2" in res.output
    res = run_cli("run", "reference", "tp2", "--fail-fast")
    assert res.exit_code == 2 and "drop --fail-fast" in res.output
    res = run_cli("record", "tp2", "-o", str(tmp_path / "x.h5"), "--level", "sampled")
    assert res.exit_code == 2 and "--level sampled is not supported for tensor-parallel runs" in res.output


# -- one tp2 run ------------------------------------------------------------------------------------

def test_tp2_passes_and_each_rank_holds_its_heads_of_the_unsharded_run(runs):
    ref, cand = runs("reference"), runs("tp2")
    assert cand.endswith(".tp2")
    out = compare_files(ref, cand)
    assert out.report, out.report.verdict_line()
    with Trace(ref) as r, Trace(f"{cand}/rank0.h5") as r0, Trace(f"{cand}/rank1.h5") as r1:
        for rank, t in enumerate((r0, r1)):
            par = t.meta["parallel"]
            assert (par["rank"], par["world_size"], par["mesh"]) == (rank, 2, [2])
            assert par["query_heads"] == [2 * rank, 2 * rank + 2] and par["kv_heads"] == [rank, rank + 1]
            assert t.args["n_heads"] == 2 and par["model_args"]["n_heads"] == 4
            for layer in (0, 3):
                full, mine = r.layer(layer), t.layer(layer)
                # its query heads' attention output: the unsharded run's channels of those heads
                np.testing.assert_allclose(mine.state("attn_heads")[()],
                                           full.state("attn_heads")[:, :, 64 * rank:64 * rank + 64], atol=2e-5)
                np.testing.assert_allclose(mine.cache("keys")[()], full.cache("keys")[:, rank:rank + 1], atol=2e-5)
                np.testing.assert_allclose(mine.cache("values")[()], full.cache("values")[:, rank:rank + 1],
                                           atol=2e-5)
                np.testing.assert_allclose(mine.state("mlp_update")[()], full.state("mlp_update")[()], atol=2e-5)
                ds = mine.state("attn_heads")
                assert ds.attrs["placement"] == b"sharded" and int(ds.attrs["shard_axis"]) == 2
                assert (int(ds.attrs["shard_start"]), int(ds.attrs["shard_stop"])) == (64 * rank, 64 * rank + 64)
                assert mine.state("mid").attrs["placement"] == b"replicated"
        for layer in range(4):  # gloo's all-reduce hands both ranks the same bits
            for name in STATES:
                assert np.array_equal(r0.layer(layer).state(name)[()], r1.layer(layer).state(name)[()])


def test_rank_set_reads_as_one_logical_trace(runs):
    ref, cand = runs("reference"), runs("tp2")
    with Trace(ref) as r, open_any(cand) as t:
        assert isinstance(t, RankTrace) and t.version == FORMAT_VERSION  # rank traces arrived in 1.1
        assert t.args["n_heads"] == 4 and t.args["n_kv_heads"] == 2
        assert [x["query_heads"] for x in t.meta["parallel"]["ranks"]] == [[0, 2], [2, 4]]
        v, w = t.layer(1), r.layer(1)
        assert v.state("attn_heads").shape == w.state("attn_heads").shape
        assert v.cache("keys").shape == w.cache("keys").shape
        np.testing.assert_allclose(v.cache("values")[()], w.cache("values")[()], atol=2e-5)
        buf = t.read_row(v.state("attn_heads"), 2, "x")
        np.testing.assert_allclose(buf, w.state("attn_heads")[2], atol=2e-5)
        for name in ("attn_heads", "cache_keys"):  # merged shard statistics = statistics of the whole tensor
            got, want = v.stats(name), w.stats(name)
            assert np.array_equal(got[:, :2], want[:, :2])
            np.testing.assert_allclose(got[:, 2:6], want[:, 2:6], rtol=1e-4, atol=1e-5)
        assert t.layer(0).checksum("attn_heads") is not None


def test_merge_stats_of_shards_is_the_stats_of_the_whole():
    from prefill_diff.dumps.reductions import RunningStats, slab_stats
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    x[1, 2, 6] = np.inf
    whole, parts = RunningStats(2), [RunningStats(2), RunningStats(2)]
    for s in range(2):
        whole.add(s, slab_stats(x[s]))
        parts[0].add(s, slab_stats(np.ascontiguousarray(x[s, :, :4])))
        parts[1].add(s, slab_stats(np.ascontiguousarray(x[s, :, 4:])))
    got, want = merge_stats([p.table() for p in parts]), whole.table()
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_inspect_and_compare_open_a_rank_set(runs, run_cli):
    cand = runs("tp2")
    res = run_cli("inspect", cand, "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["parallel"]["world_size"] == 2 and summary["model"]["args"]["n_heads"] == 4
    res = run_cli("compare", runs("reference"), cand, "-q")
    assert res.exit_code == 0 and "PASSED" in res.output
    res = run_cli("compare", cand, runs("reference"), "-q")  # a rank set as the baseline, too
    assert res.exit_code == 0 and "PASSED" in res.output


def _copy(src, tmp_path):
    dst = tmp_path / "copy.tp2"
    shutil.copytree(src, dst)
    return dst


def test_shards_that_do_not_tile_are_a_shape_break(runs, tmp_path):
    d = _copy(runs("tp2"), tmp_path)
    with h5py.File(d / "rank1.h5", "r+") as f:  # rank 1 claims rank 0's heads: overlap, and a gap
        f["layers/002/attn_heads"].attrs["shard_start"] = 0
        f["layers/002/attn_heads"].attrs["shard_stop"] = 64
    rep = compare_files(runs("reference"), d).report
    fb = rep.first_break
    assert (fb.kind, fb.layer, fb.tensor) == ("shape", 2, "attn_heads"), rep.verdict_line()
    assert "do not tile its 128 channels" in fb.message and "64..128 held by no rank" in fb.message


def test_replicas_that_disagree_are_a_rank_divergence_naming_the_ranks(runs, tmp_path):
    d = _copy(runs("tp2"), tmp_path)
    with h5py.File(d / "rank1.h5", "r+") as f:
        ds = f["layers/002/mlp_update"]
        x = ds[()]
        x[1, 3, 5] += 1e-2
        ds[...] = x
    rep = compare_files(runs("reference"), d).report
    fb = rep.first_break
    assert (fb.kind, fb.layer, fb.tensor, fb.sample, fb.position) == ("rank_divergence", 2, "mlp_update", 1, 3)
    assert "ranks 0 and 1 of the candidate disagree on replicated mlp_update" in fb.message
    assert "Tensor-parallel ranks hold different values" in rep.diagnosis
    # rank 0 is the one the logical trace shows: against the reference it still agrees, so only this check sees it
    assert rep.layers[2].tensor("mlp_update").n_bad == 0


def test_stats_level_rank_sets_compare_and_divergent_checksums_are_caught(runs, tmp_path):
    d = _copy(runs("tp2"), tmp_path)
    for r in range(2):  # the same run at the stats level: drop every full tensor
        with h5py.File(d / f"rank{r}.h5", "r+") as f:
            f.attrs["level"] = np.bytes_(b"stats")
            for i in range(4):
                g = f[f"layers/{i:03d}"]
                for name in STATES + ("attn_heads", "cache/keys", "cache/values"):
                    del g[name]
    rep = compare_files(runs("reference"), d).report
    assert rep, rep.verdict_line()
    assert rep.layers[1].tensor("attn_heads") is None or rep.layers[1].tensor("attn_heads").level == "stats"
    with h5py.File(d / "rank1.h5", "r+") as f:
        ds = f["layers/002/checksums/mid"]
        ds[0] = ds[0] + 1
    rep = compare_files(runs("reference"), d).report
    fb = rep.first_break
    assert (fb.kind, fb.layer, fb.tensor, fb.sample) == ("rank_divergence", 2, "mid", 0), rep.verdict_line()
    assert "checksums differ" in fb.message


def test_broken_rank_sets_are_refused_naming_the_file(runs, tmp_path, run_cli):
    d = _copy(runs("tp2"), tmp_path)
    (d / "rank1.h5").unlink()
    with pytest.raises(TraceError, match=r"missing rank1.h5"):
        open_any(d)
    res = run_cli("inspect", str(d))
    assert res.exit_code == 2 and "missing rank1.h5" in res.output
    d2 = tmp_path / "mixed.tp2"
    shutil.copytree(runs("tp2"), d2)
    with h5py.File(d2 / "rank1.h5", "r+") as f:
        meta = json.loads(f.attrs["meta"])
        meta["parallel"]["run_id"] = "another"
        f.attrs["meta"] = np.bytes_(json.dumps(meta).encode())
    with pytest.raises(TraceError, match="belongs to another run"):
        open_any(d2)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match="not a set of rank traces"):
        open_any(empty)


# -- faults -----------------------------------------------------------------------------------------

def test_fault_missing_allreduce_breaks_layer0_attention_update_as_rank_divergence(runs):
    rep = compare_files(runs("reference"), runs("fault:tp-missing-allreduce")).report
    fb = rep.first_break
    assert (fb.stage, fb.kind, fb.layer, fb.tensor) == ("layer", "rank_divergence", 0, "attn_update")
    assert fb.sublayer == "attention" and "ranks 0 and 1" in fb.message
    assert "not being all-reduced" in rep.diagnosis
    assert rep.layers[0].tensor("cache_keys").n_bad == 0  # what comes before the projection still agrees


def test_fault_kv_shard_breaks_layer0_attention_naming_the_ranks_heads(runs):
    rep = compare_files(runs("reference"), runs("fault:tp-kv-shard")).report
    fb = rep.first_break
    assert (fb.stage, fb.kind, fb.layer, fb.tensor) == ("layer", "value", 0, "attn_update")
    assert fb.heads == (2, 3)
    assert rep.layers[0].tensor("cache_keys").n_bad == 0 and rep.layers[0].tensor("cache_values").n_bad == 0
    assert any("query heads 2,3 are rank 1's (it holds query heads 2..3 and KV head 1)" in n for n in rep.notes)
    assert "rank 1" in rep.diagnosis and "another rank's KV shard" in rep.diagnosis


# -- compiled ---------------------------------------------------------------------------------------

def test_compiled_layers_pass_and_report_compile_time_apart(runs):
    ref, cand = runs("reference"), runs("compiled")
    with Trace(ref) as r, Trace(cand) as c:
        rep = compare_traces(r, c)
        assert rep, rep.verdict_line()
        timing = c.meta["record"]["timing"]
        assert timing["compile_s"] > 0 and timing["prefill_s"] > 0
        assert any(n.startswith(f"candidate: torch.compile took {timing['compile_s']:.1f} s") for n in rep.notes)
        # really compiled: the layers' outputs are not the eager engine's bits (inductor fuses the MLP)
        assert any(not np.array_equal(r.layer(i).state("mlp_update")[()], c.layer(i).state("mlp_update")[()])
                   for i in range(4))
    from prefill_diff.engine.prepared import prepare
    from prefill_diff.engine.config import load_side
    prep = prepare(load_side("compiled"))
    assert all(hasattr(b.feed_forward, "_compiled_call_impl") and b.feed_forward._compiled_call_impl is not None
               for b in prep.engine.model.layers)


# -- transformers' own tensor parallelism ----------------------------------------------------------------

def test_transformers_tp2_on_a_llama_checkpoint_passes_and_really_shards(tmp_path, run_cli):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         tie_word_embeddings=False, max_position_embeddings=512))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "llama")
    res = run_cli("run", "reference", "transformers-tp2", "--model", f"hf:{tmp_path / 'llama'}", "--out",
                  tmp_path / "out", "-q")
    assert res.exit_code == 0 and "PASSED" in res.output, res.output
    with Trace(tmp_path / "out" / "cand.tp2" / "rank1.h5") as t:
        assert t.meta["engine"]["name"] == "transformers" and t.meta["parallel"]["rank"] == 1
        assert t.layer(0).state("attn_heads").shape[2] == 32 and t.layer(0).cache("keys").shape[1] == 1
    with Trace(tmp_path / "out" / "ref.h5") as r, Trace(tmp_path / "out" / "cand.tp2" / "rank1.h5") as t:
        np.testing.assert_allclose(t.layer(1).cache("keys")[()], r.layer(1).cache("keys")[:, 1:2], atol=2e-5)


_RANK_MAIN = """\
import sys
from prefill_diff.jobs.sides import record_this_rank
from prefill_diff.engine.config import load_side
print(record_this_rank(load_side(sys.argv[1]), sys.argv[2]))
"""


@pytest.mark.slow
def test_record_this_rank_under_torchrun_writes_a_rank_set_judged_as_one_trace(runs, tmp_path):
    """record_this_rank, the documented torchrun entry point (docs/scaling.md): two ranks that torchrun starts
    (torch.distributed.run --standalone, env:// rendezvous) each write their rank trace; the set is judged as
    one logical trace against the unsharded reference, and a set recorded with a rank fault breaks where the
    spawned run's does."""
    import os
    import subprocess
    import sys
    script = tmp_path / "rank_main.py"
    script.write_text(_RANK_MAIN)

    def launch(config, out):
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(script), config, str(out)], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        assert sorted(os.listdir(out)) == ["rank0.h5", "rank1.h5"]
        # each rank prints its path; torchrun forwards both ranks' output, whose lines may run together
        assert str(out / "rank0.h5") in res.stdout and str(out / "rank1.h5") in res.stdout, res.stdout
        return out
    good = compare_files(runs("reference"), launch("tp2", tmp_path / "run.tp2")).report
    assert good and good.first_break is None and len(good.layers) == 4
    with open_any(str(tmp_path / "run.tp2")) as t:
        assert t.meta["parallel"]["world_size"] == 2 and t.meta["parallel"]["run_id"]  # torchrun's run id
    bad = compare_files(runs("reference"), launch("fault:tp-kv-shard", tmp_path / "bad.tp2")).report
    fb = bad.first_break
    assert not bad and (fb.kind, fb.layer, fb.tensor, fb.heads) == ("value", 0, "attn_update", (2, 3))


def test_record_this_rank_refuses_a_torchrun_world_that_is_not_the_runs_tp(tmp_path, monkeypatch):
    from prefill_diff.jobs.sides import record_this_rank
    from prefill_diff.engine.config import load_side
    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="torchrun started 3 processes, the run asks for tp=2"):
        record_this_rank(load_side("tp2"), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written
