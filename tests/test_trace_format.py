"""The trace as a contract: levels, lossless dtypes, chunking, gzip readable by h5dump, atomic writes,
old versions readable, inspect at every level, and a foreign engine (transformers) writing through hooks."""
from __future__ import annotations

import json

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from prefill_diff.dumps.reader import Trace, TraceError
from prefill_diff.dumps.schema import STAT_COLUMNS
from prefill_diff.jobs.sides import prepare_side, record_side
from prefill_diff.verify.report import compare_traces

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def levels(tmp_path_factory):
    d = tmp_path_factory.mktemp("levels")
    prep = prepare_side("batched-left")
    return {lv: record_side(prep, d / f"{lv}.h5", lv) for lv in ("full", "sampled", "stats")}


def test_three_levels_write_and_read_back(levels):
    with Trace(levels["full"]) as full:
        for lv in ("sampled", "stats"):
            with Trace(levels[lv]) as t:
                assert t.level == lv and t.n_layers == full.n_layers and t.samples == full.samples
                np.testing.assert_array_equal(t.inputs["valid_mask"], full.inputs["valid_mask"])
                np.testing.assert_array_equal(t.final["logits"], full.final["logits"])
                for i in range(t.n_layers):
                    assert t.layer(i).state("layer_output") is None  # no full tensors below full
                    np.testing.assert_array_equal(t.layer(i).cache_positions, full.layer(i).cache_positions)
                    np.testing.assert_array_equal(t.layer(i).stats("mid"), full.layer(i).stats("mid"))


def test_stats_match_the_full_tensors(levels):
    col = {k: i for i, k in enumerate(STAT_COLUMNS)}
    with Trace(levels["full"]) as t:
        for i in range(t.n_layers):
            st = t.layer(i).stats("attn_update")
            data = t.layer(i).state("attn_update")
            for s in range(t.n_samples):
                cols, _ = t.cells(s)
                x = data[s][cols].astype(np.float64)
                assert st[s, col["count"]] == x.size == st[s, col["finite"]]
                assert st[s, col["min"]] == x.min() and st[s, col["max"]] == x.max()
                assert st[s, col["mean"]] == pytest.approx(x.mean(), rel=1e-5, abs=1e-7)
                assert st[s, col["l2"]] == pytest.approx(np.sqrt((x * x).sum()), rel=1e-5)
                assert st[s, col["pad_count"]] == t.pad_cols(s).size * x.shape[1]


def test_sampled_values_are_the_declared_subset(levels):
    with Trace(levels["sampled"]) as t, Trace(levels["full"]) as full:
        toks = t.f["sampled/token_index"][:]
        for i in (0, t.n_layers - 1):
            ds = t.layer(i).sampled("layer_output")
            ch = ds.attrs["channels"]
            assert len(ch) == 32 and list(ch) == sorted(ch)
            for s in range(t.n_samples):
                want = [x for x in toks[s] if x >= 0]
                assert want[0] == 0 and want[-1] == t.lengths[s] - 1
                cols, ctoks = full.cells(s)
                where = dict(zip(ctoks.tolist(), cols.tolist()))
                ref = full.layer(i).state("layer_output")[s]
                for j, tok in enumerate(want):
                    np.testing.assert_array_equal(ds[s, j], ref[where[int(tok)], ch])


@pytest.mark.parametrize("level", ["sampled", "stats"])
def test_a_fault_is_still_localised_at_a_lower_level(levels, level, tmp_path):
    cand = record_side(prepare_side("fault:unmasked-padding"), tmp_path / "c.h5", level)
    with Trace(levels["full"]) as ref, Trace(cand) as c:
        rep = compare_traces(ref, c)
    fb = rep.first_break
    assert (fb.layer, fb.kind, fb.tensor) == (0, "value", "attn_update")
    assert set(fb.samples) <= {1, 2}
    assert any(level in s for s in rep.skipped)  # says which checks the level could not do
    with Trace(levels[level]) as a, Trace(levels["full"]) as b:
        assert compare_traces(b, a)  # a clean run at this level passes


def test_bf16_and_fp16_are_stored_losslessly(tmp_path):
    for preset, stored, source in (("bf16", "float32", "bfloat16"), ("fp16", "float16", "float16")):
        path = record_side(prepare_side(preset), tmp_path / f"{preset}.h5")
        with Trace(path) as t:
            ds = t.layer(1).state("mid")
            assert ds.dtype == np.dtype(stored) and t.source_dtype(ds) == source
            if source == "bfloat16":  # every stored float32 is a bfloat16: low 16 bits zero
                bits = ds[:].view(np.uint32)
                assert (bits & 0xFFFF).max() == 0
            assert t.source_dtype(t.layer(1).cache("keys")) == source


def test_one_chunk_per_layer_and_sample(levels):
    with Trace(levels["full"]) as t:
        ds = t.layer(0).state("layer_input")
        assert ds.chunks == (1, t.n_cols, ds.shape[2]) and ds.compression is None
        k = t.layer(0).cache("keys")
        assert k.chunks[0] == 1 and k.chunks[1:] == k.shape[1:]


def _h5dump():
    exe = shutil.which("h5dump")
    if exe is None and os.environ.get("PREFILL_DIFF_REQUIRE_H5DUMP"):
        pytest.fail("h5dump is required here (PREFILL_DIFF_REQUIRE_H5DUMP is set) but not installed")
    if exe is None:
        pytest.skip("h5dump (Debian's hdf5-tools) is not installed; .ci/run installs it")
    return exe


def test_h5dump_reads_a_gzip_trace(tmp_path, run_cli):
    exe = _h5dump()
    path = tmp_path / "gz.h5"
    assert run_cli("record", "batched-left", "-o", path, "--compression", "gzip").exit_code == 0
    with h5py.File(path) as f:
        assert f["layers/000/layer_input"].compression == "gzip"
        assert f["layers/000/layer_input"].shuffle
    head = subprocess.run([exe, "-H", str(path)], capture_output=True, text=True)
    assert head.returncode == 0, head.stderr
    assert 'DATASET "layer_output"' in head.stdout and 'ATTRIBUTE "format_version"' in head.stdout
    data = subprocess.run([exe, "-m", "%.9g", "-d", "/layers/003/layer_output", str(path)], capture_output=True, text=True)
    assert data.returncode == 0 and "DATA {" in data.stdout
    with Trace(path) as t:  # and our reader reads the same numbers
        first = float(t.layer(3).state("layer_output")[0, 0, 0])
    nums = data.stdout.split("DATA {", 1)[1].split(":", 1)[1].split(",", 1)[0]
    assert float(nums) == pytest.approx(first, rel=1e-6)


def test_committed_v1_trace_stays_readable(run_cli, tmp_path):
    old = DATA / "trace-v1.0.h5"
    with Trace(old) as t:
        assert t.version == "1.0" and t.level == "full" and t.n_layers == 2
        assert t.args["vocab_size"] == 20
    res = run_cli("inspect", old)
    assert res.exit_code == 0 and "seed-2.8" in res.output
    res = run_cli("compare", old, old)
    assert res.exit_code == 0
    # today's engine still agrees with the committed baseline
    res = run_cli("compare", old, "reference", "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output


def test_committed_v12_moe_trace_stays_readable(run_cli, tmp_path):
    """Format 1.2: a mixture of experts' routing. Read, validated, compared with itself and with today's engine."""
    old = DATA / "trace-v1.2.h5"
    with Trace(old) as t:
        assert t.version == "1.2" and t.args["n_experts"] == 4 and t.args["n_active_experts"] == 2
        ids = t.layer(1).routing("ids")[()]
        assert ids.shape == (2, 6, 2) and ((ids >= 0) & (ids < 4) | (ids == -1)).all()
    res = run_cli("compare", old, old, "--json", tmp_path / "self.json")
    rep = json.loads((tmp_path / "self.json").read_text())
    assert res.exit_code == 0 and rep["routing"]["tokens_compared"] == 2 * 9 and rep["routing"]["flips"] == 0
    res = run_cli("compare", old, "reference", "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output


def test_inspect_every_level(levels, run_cli):
    import json
    for lv, path in levels.items():
        res = run_cli("inspect", path)
        assert res.exit_code == 0, res.output
        assert f"level {lv}" in res.output and "layer_output" in res.output
        res = run_cli("inspect", path, "--json", "--layer", 1, "--tensor", "mid", "--sample", 2)
        s = json.loads(res.output)
        assert s["level"] == lv and [r["layer"] for r in s["layers"]] == [1]
        assert list(s["layers"][0]["tensors"]) == ["mid"] and s["samples"][0]["sample"] == 2
        assert s["layers"][0]["tensors"]["mid"]["nonfinite"] == 0
        assert ("values" in s) == (lv in ("full", "sampled"))  # sampled: its declared subset (issue 17)
        assert (s["values"]["kind"].startswith("sampled level") if lv == "sampled" else
                lv != "stats" or "stats level: no values of mid" in " ".join(s["levels_note"]))
    res = run_cli("inspect", levels["full"], "--layer", 99)
    assert res.exit_code == 2 and "--layer must be in [0, 4)" in res.output


@pytest.mark.slow
def test_inspect_summary_shows_fault_reuse_and_invariant_violations(run_cli, tmp_path):
    for preset, want in (("fault:skip-kv", ("fault injected", "skip-kv", "invariant 1 (equal lengths")),
                         ("prefix-reuse", ("sample 0: prefix of 4 reused", "sample 2: prefix of 4 reused"))):
        path = tmp_path / "t.h5"
        assert run_cli("record", preset, "-o", path, "--force").exit_code == 0
        res = run_cli("inspect", path)
        out = " ".join(res.output.split())
        assert res.exit_code == 0 and all(w in out for w in want), out[:600]


@pytest.mark.slow
def test_inspect_does_not_import_torch(levels):
    code = ("import sys; from prefill_diff.cli.main import cli\n"
            "try:\n    cli(['inspect', sys.argv[1]], standalone_mode=False)\nexcept SystemExit: pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(levels["stats"])], capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "False False", out.stderr


def test_help_does_not_import_torch():
    code = ("import sys; from prefill_diff.cli.main import cli\n"
            "try:\n    cli(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


BIG = """
[model]
source = "synthetic"
n_layers = 16
dim = 256
head_dim = 32
n_heads = 8
n_kv_heads = 2
hidden_dim = 512
vocab_size = 256
[inputs]
token_ids = [{ids}, {ids}]
"""


def _wait_for_partial(tmp_path, proc, timeout=60.0):
    deadline = time.time() + timeout
    while not list(tmp_path.glob(".t.h5.partial-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)


@pytest.mark.slow
def test_killing_record_never_leaves_an_accepted_trace(tmp_path):
    """SIGKILL at random moments while the trace is being written (issue 8 repeats this many times)."""
    cfg = tmp_path / "big.toml"
    cfg.write_text(BIG.format(ids=list(range(1, 200))))
    target = tmp_path / "t.h5"
    rng = np.random.default_rng(0)
    killed_mid_write = 0
    for _ in range(int(os.environ.get("PREFILL_DIFF_KILLS", "4"))):
        proc = subprocess.Popen([sys.executable, "-m", "prefill_diff.cli.main", "record", str(cfg), "-o",
                                 str(target), "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_partial(tmp_path, proc)
        time.sleep(float(rng.uniform(0.0, 0.8)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if target.exists():  # it finished before the kill: then it must be complete and valid
            Trace(target).close()
            target.unlink()
        else:
            killed_mid_write += 1
        for partial in tmp_path.glob(".t.h5.partial-*"):
            try:  # a leftover temporary is unreadable or incomplete, unless the kill fell between
                Trace(partial).close()  # the final close and the rename: then it is whole, but not at the target
                assert not target.exists()
            except TraceError as e:
                assert any(w in str(e) for w in ("incomplete trace", "not a readable HDF5 file", "damaged trace"))
            partial.unlink()
    assert killed_mid_write >= 1


def start_big_record(tmp_path):
    """`record` of a large config into tmp_path/t.h5, returned once its partial file exists: (process, target)."""
    cfg = tmp_path / "big.toml"
    cfg.write_text(BIG.format(ids=list(range(1, 200))))
    target = tmp_path / "t.h5"
    proc = subprocess.Popen([sys.executable, "-m", "prefill_diff.cli.main", "record", str(cfg), "-o", str(target)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_partial(tmp_path, proc)
    return proc, target


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_removes_the_partial_file(tmp_path):
    proc, target = start_big_record(tmp_path)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "interrupted" in err and "Traceback" not in err
    assert not list(tmp_path.glob(".t.h5.partial-*"))
    if target.exists():  # the signal landed after the trace was moved into place: it is whole, and kept
        Trace(target).close()
        assert "complete trace kept" in err and "not kept" not in err


def test_transformers_recorded_through_hooks_matches_our_engine(tmp_path):
    """A foreign engine writes a conforming trace with the public Recorder API, transformers unchanged."""
    import torch
    from prefill_diff.dumps.recorder import Recorder
    from prefill_diff.engine.foreign.hf_engine import build_model, forward_call
    from prefill_diff.engine.calls import Placement

    prep = prepare_side("transformers")  # synthetic model, one sample at a time
    model = build_model(prep.snapshot, "float32", "eager")
    assert type(model).__module__.startswith("transformers.")
    path = tmp_path / "hf.h5"
    with Recorder(path) as rec:
        rec.begin([list(t) for t in prep.tokens], prep.n_cols, {"model": {"args": prep.snapshot.args.as_dict()},
                                                                "engine": {"name": "transformers",
                                                                           "dtype": "float32"}})
        for call in prep.calls:
            forward_call(model, call, Placement(rec, call.runs, call.samples))
        for layer in range(prep.snapshot.args.n_layers):
            rec.layer_done(layer)
    ref = record_side(prepare_side("reference"), tmp_path / "ref.h5")
    with Trace(ref) as a, Trace(path) as b:
        rep = compare_traces(a, b)
    assert rep, rep.verdict_line()
    assert rep.layers[0].tensor("attn_heads") is not None and rep.layers[0].tensor("attn_heads").compared > 0
    assert isinstance(torch.__version__, str)


@pytest.mark.parametrize("damage", ["truncate", "foreign", "missing_dataset", "missing_layer", "text"])
def test_bad_files_exit_2_with_one_line(levels, tmp_path, run_cli, damage):
    path = tmp_path / "bad.h5"
    shutil.copy(levels["full"], path)
    if damage == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3])
    elif damage == "foreign":
        path.unlink()
        with h5py.File(path, "w") as f:
            f.attrs["format"] = "something-else"
    elif damage == "missing_dataset":
        with h5py.File(path, "a") as f:
            del f["final/logits"]
    elif damage == "missing_layer":
        with h5py.File(path, "a") as f:
            del f["layers/002"]
    else:
        path.write_text("hello\n")
    for args in (("inspect", path), ("compare", levels["full"], path), ("compare", path, levels["full"])):
        res = run_cli(*args)
        assert res.exit_code == 2, (damage, args, res.output)
        lines = [l for l in res.output.splitlines() if l.strip()]
        assert len(lines) == 1 and str(path) in lines[0] and "Traceback" not in res.output, res.output
    expected = {"truncate": "not a readable HDF5 file", "foreign": "not a prefill-diff trace",
                "missing_dataset": "missing required dataset /final/logits",
                "missing_layer": "layer groups are incomplete (missing 002", "text": "not a readable HDF5 file"}
    assert expected[damage] in res.output


def test_compare_of_two_files_does_not_import_torch(levels):
    code = ("import sys; from prefill_diff.cli.main import cli\n"
            "try:\n    cli(['compare', sys.argv[1], sys.argv[2], '-q'])\nexcept SystemExit: pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(levels["full"]), str(levels["full"])],
                         capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr


def test_a_statistic_infinite_on_one_side_only_is_a_break(levels, tmp_path):
    """At the stats level, an l2 that overflowed on one side is a difference, not a non-finite pair to skip."""
    col = STAT_COLUMNS.index("l2")
    cand = tmp_path / "c.h5"
    shutil.copy(levels["stats"], cand)
    with h5py.File(cand, "a") as f:
        f["layers/001/stats/mlp_update"][0, col] = np.inf
    with Trace(levels["stats"]) as a, Trace(cand) as b:
        fb = compare_traces(a, b).first_break
        assert fb is not None and (fb.layer, fb.tensor, fb.kind) == (1, "mlp_update", "value")
    with Trace(cand) as b, Trace(cand) as b2:  # infinite on both sides: equal statistics
        assert compare_traces(b, b2)


def test_stats_level_names_the_side_whose_values_are_not_finite(levels, tmp_path):
    """Three non-finite values in the candidate's statistics are 'finite in the reference only', as at full level."""
    cand = tmp_path / "c.h5"
    shutil.copy(levels["stats"], cand)
    with h5py.File(cand, "a") as f:
        f["layers/002/stats/mid"][1, STAT_COLUMNS.index("finite")] -= 3
    with Trace(levels["stats"]) as a, Trace(cand) as b:
        forward, backward = compare_traces(a, b), compare_traces(b, a)
    fwd = forward.layers[2].tensor("mid").finite
    bwd = backward.layers[2].tensor("mid").finite
    assert (fwd.ref_only, fwd.cand_only) == (3, 0) and (bwd.ref_only, bwd.cand_only) == (0, 3)
    assert forward.first_break.layer == 2 and forward.first_break.kind == "finite_mask"
