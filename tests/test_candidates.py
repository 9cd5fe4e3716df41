"""Every candidate path agrees with `reference`; every fault changes exactly what §2.11 says, no more."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from prefill_diff.dumps.reader import Trace
from prefill_diff.engine.presets import PRESETS
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.verify.report import compare_traces
from prefill_diff.dumps.schema import TOL_KINDS
from prefill_diff.verify.tolerance import Policy, Tolerance

from conftest import spawning_presets, with_response  # noqa: E402

NON_FAULT = [p for p in PRESETS if not p.startswith("fault:") and p != "reference" and p not in spawning_presets()]
EXACT = Policy("exact", {k: Tolerance(0.0, 0.0) for k in TOL_KINDS})


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("cands")
    cache = {}

    def get(source, model=None, inputs=None):
        key = (source, model, inputs)
        if key not in cache:
            cache[key] = record_side(prepare_side(source, model, inputs), d / f"t{len(cache)}.h5")
        return cache[key]
    return get


def compare(a, b, policy=None):
    with Trace(a) as ra, Trace(b) as rb:
        return compare_traces(ra, rb, policy)


@pytest.mark.slow
@pytest.mark.parametrize("preset", NON_FAULT)
def test_every_candidate_agrees_with_reference(store, preset):
    inputs = with_response(preset)  # a decoding preset writes a response: both sides get one
    rep = compare(store("reference", None, inputs), store(preset, None, inputs))
    assert rep, f"{preset}: {rep.verdict_line()} ({rep.policy.name})"
    assert not rep.inconclusive
    assert len(rep.layers) == 4 and rep.final is not None


def test_bf16_fails_under_float32_policy_and_passes_under_its_own(store):
    from prefill_diff.verify.tolerance import dtype_policy
    strict = compare(store("reference"), store("bf16"), dtype_policy("float32"))
    assert not strict and strict.first_break.stage == "layer"
    assert compare(store("reference"), store("bf16"), dtype_policy("bfloat16"))


@pytest.mark.slow
def test_combined_config_batched_paged_chunked_bf16(store, tmp_path):
    cfg = tmp_path / "combo.toml"
    cfg.write_text('preset = "batched-left"\n[run]\nchunk_size = 3\ndtype = "bfloat16"\nkernel = "tiled"\n'
                   'block_size = 4\n[cache]\nkind = "paged"\npage_size = 2\n')
    rep = compare(store("reference"), store(str(cfg)))
    assert rep and rep.policy.name == "bfloat16", rep.verdict_line()
    with Trace(store(str(cfg))) as t:
        assert t.meta["layout"]["kind"] == "paged" and t.meta["engine"]["chunk_size"] == 3


def test_reuse_with_left_padded_batch_and_int8_per_head(store, tmp_path):
    cfg = tmp_path / "reuse.toml"
    cfg.write_text('preset = "prefix-reuse"\n[run]\nbatching = "left"\n[cache]\ndtype = "int8"\n'
                   'int8_scales = "per-head"\n')
    rep = compare(store("reference"), store(str(cfg)))
    assert rep, rep.verdict_line()
    with Trace(store(str(cfg))) as t:
        assert all(o["hit"] for o in t.meta["record"]["reuse"])
        assert t.meta["layout"]["int8_scales"] == "per-head"


def test_w8_records_source_and_quantised_digests(store):
    with Trace(store("w8")) as t, Trace(store("reference")) as r:
        assert t.meta["model"]["weights_digest"] == r.meta["model"]["weights_digest"]
        q = t.meta["record"]["quantized_weights_digest"]
        assert q.startswith("sha256:") and q != t.meta["model"]["weights_digest"]


def test_prefix_reuse_compares_prefix_as_cache_and_suffix_as_residuals(store):
    rep = compare(store("reference"), store("prefix-reuse"))
    assert rep
    assert any("positions 0..3 have residual states in the reference only" in n for n in rep.notes)
    with Trace(store("prefix-reuse")) as t:
        cols, toks = t.cells(0)
        assert toks[0] == 4 and int(t.layer(0).cache_lengths[0]) == 70
        assert t.inputs["positions"][0, 0] == 4  # the suffix continues from the reused positions


# -- faults: against the same execution without the fault, with zero tolerance ----------------------

def clean_of(fault: str) -> str:
    return {"fault:last-column": "batched-right", "fault:unmasked-padding": "batched-left",
            "fault:masked-row-softmax": "batched-left", "fault:position-restart": "prefix-reuse",
            "fault:adapter-mismatch": "prefix-reuse"}.get(fault, "reference")


def test_fault_last_column_changes_only_short_samples_final_logits(store):
    rep = compare(store("batched-right"), store("fault:last-column"), EXACT)
    assert all(rep.layers) and len(rep.layers) == 4
    fb = rep.first_break
    assert (fb.stage, fb.kind, fb.tensor) == ("final", "value", "logits")
    assert set(rep.final.tensor("logits").bad_samples) == {1, 2}  # sample 0 (70 tokens) fills the rectangle


def test_fault_skip_kv_changes_only_that_layers_cache_length(store):
    rep = compare(store("reference"), store("fault:skip-kv"), EXACT)
    assert all(rep.layers[:2]) and all(rep.layers[3:])
    fb = rep.layers[2].first_break
    assert (fb.kind, fb.sample, fb.position) == ("cache_length", 0, 69)
    for t in rep.layers[2].tensors:  # residual states untouched
        if not t.tensor.startswith("cache"):
            assert t.max_abs == 0.0
    assert rep.final and rep.first_break.layer == 2


def test_fault_position_restart_breaks_suffix_positions_from_layer_0(store):
    rep = compare(store("prefix-reuse"), store("fault:position-restart"), EXACT)
    fb = rep.first_break
    assert (fb.layer, fb.kind, fb.position) == (0, "cache_positions", 4)
    with Trace(store("fault:position-restart")) as t:
        pos = t.layer(0).cache_positions[0, :70].tolist()
    assert pos == [0, 1, 2, 3] + list(range(66))


def test_fault_gqa_mapping_changes_only_query_head_0_at_layer_0(store):
    rep = compare(store("reference"), store("fault:gqa-mapping"), EXACT)
    l0 = rep.layers[0]
    assert l0.tensor("cache_keys").max_abs == 0 and l0.tensor("cache_values").max_abs == 0
    assert l0.tensor("attn_heads").heads == (0,)
    fb = rep.first_break
    assert (fb.layer, fb.tensor, fb.heads) == (0, "attn_update", (0,))


def test_fault_gqa_mapping_cannot_show_with_one_kv_head(run_cli, tmp_path):
    import json
    res = run_cli("run", "reference", "fault:gqa-mapping", "--model", "seed-2.8", "--json", tmp_path / "r.json")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["inconclusive"] and "n_kv_heads=1" in rep["inconclusive"][0]
    assert "INCONCLUSIVE" in res.output


def test_fault_unmasked_padding_leaves_unpadded_sample_bit_identical(store):
    rep = compare(store("batched-left"), store("fault:unmasked-padding"), EXACT)
    fb = rep.first_break
    assert (fb.layer, fb.tensor) == (0, "attn_update") and set(fb.samples) == {1, 2}
    for lr in rep.layers:
        for t in lr.tensors:
            assert 0 not in t.bad_samples, (lr.layer, t.tensor)
    assert 0 not in rep.final.tensor("logits").bad_samples


def test_fault_adapter_mismatch_is_refused_on_metadata_and_forced(store):
    with Trace(store("fault:adapter-mismatch")) as t:
        outcomes = t.meta["record"]["reuse"]
    assert all(o["forced"] and "condition 1" in o["reason"] and "adapter" in o["reason"] for o in outcomes)
    rep = compare(store("prefix-reuse"), store("fault:adapter-mismatch"), EXACT)
    fb = rep.first_break
    assert (fb.layer, fb.kind, fb.tensor) == (0, "value", "cache_keys")
    assert fb.position < 4  # inside the reused prefix
    assert rep.layers[0].tensor("layer_input").max_abs == 0


def test_fault_masked_row_softmax_nan_in_padding_then_spread(store):
    rep = compare(store("batched-left"), store("fault:masked-row-softmax"), EXACT)
    fb = rep.first_break
    assert (fb.layer, fb.kind, fb.padding) == (0, "finite_mask", True)
    l0 = rep.layers[0]
    assert l0.tensor("attn_update").finite.cand_only == 0  # layer 0 valid rows still finite ...
    assert l0.tensor("attn_update").max_abs == 0
    l1 = rep.layers[1]
    assert l1.tensor("attn_update").finite.ref_only > 0  # ... then NaN spreads into valid rows
    assert not rep.final.tensor("logits").finite_ok


# -- paged cache and prefix-cache conditions -------------------------------------------------------

def test_paged_logical_reads_equal_contiguous():
    from prefill_diff.engine.native.kv_cache import CacheLayout, KVCache
    g = torch.Generator().manual_seed(0)
    caches = [KVCache(2, 3, CacheLayout(kind=k, dtype="float32", page_size=3), torch.float32)
              for k in ("contiguous", "paged")]
    for step in range(5):  # interleaved appends of random lengths, as chunked prefill does
        for seq in range(3):
            T = int(torch.randint(1, 5, (1,), generator=g))
            k, v = torch.randn(2, T, 4, generator=g), torch.randn(2, T, 4, generator=g)
            pos = torch.arange(T) + step * 10
            for c in caches:
                for layer in range(2):
                    c.write(layer, seq, k, v, k, pos)
    tables = caches[1].store.tables
    assert any(t != sorted(t) or t != list(range(t[0], t[0] + len(t))) for t in tables.values())  # scattered
    for layer in range(2):
        for seq in range(3):
            a, b = caches[0].read(layer, seq), caches[1].read(layer, seq)
            for x, y in zip(a, b):
                assert torch.equal(x, y)


def _meta(**over):
    base = {"weights_digest": "w", "adapter": None, "layers": "L", "position_numbering": "absolute, from 0",
            "rope": {"rope_theta": 1e4}, "mask_semantics": "causal", "cache_dtype": "float32",
            "key_rotation": "post", "layout_version": 1}
    return {**base, **over}


@pytest.mark.parametrize("key,value,condition", [
    ("weights_digest", "other", "condition 1"), ("adapter", {"id": "x"}, "condition 1"),
    ("layers", "L2", "condition 1"), ("position_numbering", "offset 5", "condition 2"),
    ("rope", {"rope_theta": 5e5}, "condition 2"), ("mask_semantics", "bidirectional", "condition 3"),
    ("cache_dtype", "int8", "condition 4"), ("key_rotation", "pre", "condition 4"),
])
def test_prefix_reuse_refused_for_each_metadata_condition(key, value, condition):
    from prefill_diff.engine.native.kv_cache import PrefixKV
    from prefill_diff.engine.native.reuse import PrefixCache
    pc = PrefixCache()
    kv = PrefixKV([(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2), torch.arange(2))], {})
    pc.insert([1, 2], kv, _meta(), "a")
    assert pc.lookup([1, 2, 3], 2, _meta(), "a").hit
    got = pc.lookup([1, 2, 3], 2, _meta(**{key: value}), "a")
    assert not got.hit and condition in got.reason and key in got.reason


def test_prefix_reuse_refused_when_boundary_cuts_a_segment():
    from prefill_diff.engine.native.kv_cache import PrefixKV
    from prefill_diff.engine.native.reuse import PrefixCache
    pc = PrefixCache()
    kv = PrefixKV([(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2), torch.arange(2))], {})
    pc.insert([1, 2], kv, _meta(), "a")
    got = pc.lookup([1, 2, 3, 4], 2, _meta(), "a", segments=[(1, 3)])
    assert not got.hit and "condition 5" in got.reason and "[1, 3)" in got.reason
    assert pc.lookup([1, 2, 3, 4], 2, _meta(), "a", segments=[(2, 4)]).hit  # a boundary on the edge is fine


def test_cross_tenant_reuse_refused_unless_policy_allows(store, tmp_path):
    from prefill_diff.engine.native.kv_cache import PrefixKV
    from prefill_diff.engine.native.reuse import PrefixCache
    kv = PrefixKV([(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2), torch.arange(2))], {})
    pc = PrefixCache()
    pc.insert([1, 2], kv, _meta(), "tenant-a", share=True)
    got = pc.lookup([1, 2, 3], 2, _meta(), "tenant-b")
    assert not got.hit and "tenant-a" not in got.reason  # the refusal does not reveal A's entry
    shared = PrefixCache(allow_cross_tenant=True)
    shared.insert([1, 2], kv, _meta(), "tenant-a", share=True)
    assert shared.lookup([1, 2, 3], 2, _meta(), "tenant-b").hit
    # end to end: a cache built by another tenant is not used, the run recomputes and still agrees
    cfg = tmp_path / "x.toml"
    cfg.write_text('preset = "prefix-reuse"\n[reuse]\ntenant = "b"\ncache_tenant = "a"\n')
    rep = compare(store("reference"), store(str(cfg)))
    assert rep and any("prefix reuse refused" in n for n in rep.notes)
    with Trace(store(str(cfg))) as t:
        assert not any(o["hit"] for o in t.meta["record"]["reuse"])


def test_reuse_segment_boundary_from_config(store, tmp_path):
    cfg = tmp_path / "seg.toml"
    cfg.write_text('preset = "prefix-reuse"\n[inputs]\ntoken_ids = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7]]\n'
                   'segments = [[[3, 6]], []]\n')
    with Trace(store(str(cfg))) as t:
        out = t.meta["record"]["reuse"]
    assert not out[0]["hit"] and "condition 5" in out[0]["reason"]
    assert out[1]["hit"]


def test_adapter_is_part_of_the_snapshot_identity(store, tmp_path):
    cfg = tmp_path / "lora.toml"
    cfg.write_text('[model]\nsource = "synthetic"\n[model.adapter]\nid = "demo"\nrank = 4\nseed = 3\n')
    plain = tmp_path / "plain.toml"
    plain.write_text('[model]\nsource = "synthetic"\n')
    with Trace(store(str(cfg))) as t, Trace(store(str(plain))) as p:
        ad = t.meta["model"]["adapter"]
        assert ad["id"] == "demo" and ad["digest"].startswith("sha256:") and ad["rank"] == 4
        assert t.meta["model"]["weights_digest"] == p.meta["model"]["weights_digest"]  # base weights unchanged
        assert not np.array_equal(t.final["logits"], p.final["logits"])  # but the adapter changes the model
    lora_fault = tmp_path / "lora-fault.toml"
    lora_fault.write_text('preset = "fault:adapter-mismatch"\n[model]\nsource = "synthetic"\n'
                          '[model.adapter]\nid = "demo"\nrank = 4\nseed = 3\n')
    with Trace(store(str(lora_fault))) as t:
        assert all(o["forced"] and "adapter" in o["reason"] for o in t.meta["record"]["reuse"])
    rep = compare(store(str(cfg)), store(str(lora_fault)))
    assert (rep.first_break.layer, rep.first_break.tensor) == (0, "cache_keys")


def test_readme_lists_every_preset():
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for name in PRESETS:
        assert f"`{name}`" in readme, name
