"""Each side's prefill as numbers (a trace's ``record.prefill``, the JSON report's ``reference.prefill`` and
``candidate.prefill``, one terminal line per side that reused a cache or took several steps): tokens served from a
cache, tokens computed, forward steps, and the token budget a step. Checked against the traces themselves: the
positions a sample computed (its residual states) and the columns the engine laid them out in."""
from __future__ import annotations

import json
import math
import shutil

import h5py
import numpy as np
import pytest

from prefill_diff.dumps.reader import Trace
from prefill_diff.engine.config import load_side


def _run(run_cli, tmp_path, cand: str):
    res = run_cli("run", "reference", cand, "--json", tmp_path / "r.json", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    return json.loads((tmp_path / "r.json").read_text()), res.output


@pytest.fixture(scope="module")
def reused(tmp_path_factory):
    """``run reference prefix-reuse``, recorded once: (its directory, the JSON report, the terminal output)."""
    from click.testing import CliRunner
    from prefill_diff.cli.main import cli
    d = tmp_path_factory.mktemp("prefix-reuse")
    res = CliRunner().invoke(cli, ["run", "reference", "prefix-reuse", "--json", str(d / "r.json"), "--out", str(d)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return d, json.loads((d / "r.json").read_text()), res.output


def _computed(trace: Trace, s: int) -> tuple[int, np.ndarray]:
    """(the first position the sample computed, the columns it computed them in), read from the trace."""
    cols, toks = trace.cells(s)
    return int(toks[0]), cols


def _check_against_trace(side: dict, path, chunk: int | None):
    with Trace(path) as t:
        assert [o["sample"] for o in side["samples"]] == list(range(t.n_samples))
        for o in side["samples"]:
            first, cols = _computed(t, o["sample"])
            assert o["tokens"] == int(t.lengths[o["sample"]])
            assert (o["from_cache"], o["computed"]) == (first, cols.size), o
            # a step computes one chunk of the call's columns (the whole call unchunked)
            assert o["steps"] == (len({int(c) // chunk for c in cols}) if chunk else 1), o


def test_prefix_reuse_says_per_sample_what_came_from_the_cache(reused):
    d, rep, out = reused
    k = load_side("prefix-reuse").run.reuse.prefix_len
    cand, ref = rep["candidate"]["prefill"], rep["reference"]["prefill"]
    assert (cand["token_budget"], cand["budget_per"]) == (None, None)
    assert [(o["from_cache"], o["steps"]) for o in cand["samples"]] == [(k, 1)] * 3, cand
    assert all(o["from_cache"] == 0 and o["computed"] == o["tokens"] for o in ref["samples"]), ref
    _check_against_trace(cand, d / "cand.h5", None)
    _check_against_trace(ref, d / "ref.h5", None)
    lines = [ln for ln in out.splitlines() if " prefill" in ln and ": sample 0:" in ln]
    assert lines == ["candidate prefill: " + "; ".join(
        f"sample {o['sample']}: {k} from cache + {o['computed']} computed, 1 step" for o in cand["samples"])], out


@pytest.mark.parametrize("batching", ["unbatched", pytest.param("left", marks=pytest.mark.slow),
                                      pytest.param("packed", marks=pytest.mark.slow)])
def test_a_chunked_run_says_its_budget_and_each_samples_steps(run_cli, tmp_path, batching):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'preset = "chunked"\n[run]\nbatching = "{batching}"\n')
    rep, out = _run(run_cli, tmp_path, cfg)
    chunk = load_side("chunked").run.chunk_size
    cand = rep["candidate"]["prefill"]
    assert (cand["token_budget"], cand["budget_per"]) == (chunk, "sample")
    assert rep["candidate"]["engine"]["chunk_size"] == chunk
    _check_against_trace(cand, tmp_path / "cand.h5", chunk)
    if batching == "unbatched":  # each sample alone: a step per chunk of its own tokens
        assert [o["steps"] for o in cand["samples"]] == [math.ceil(o["tokens"] / chunk) for o in cand["samples"]]
    line = next(ln for ln in out.splitlines() if ln.startswith("candidate prefill"))
    assert line.startswith(f"candidate prefill (budget {chunk} tokens of each sample a step): sample 0: 0 from "
                           f"cache + 70 computed, {cand['samples'][0]['steps']} steps;"), line
    assert not any(ln.startswith("reference prefill") for ln in out.splitlines())  # one step each: nothing to say


def test_a_plain_run_records_one_step_per_sample_and_prints_no_line(run_cli, tmp_path):
    rep, out = _run(run_cli, tmp_path, "packed")
    for side in ("reference", "candidate"):
        p = rep[side]["prefill"]
        assert [(o["from_cache"], o["computed"], o["steps"]) for o in p["samples"]] == \
            [(0, o["tokens"], 1) for o in p["samples"]], p
    assert " prefill" not in out


def _edit_meta(path, edit) -> None:
    with h5py.File(path, "a") as f:
        meta = json.loads(f.attrs["meta"])
        edit(meta)
        del f.attrs["meta"]
        f.attrs["meta"] = np.bytes_(json.dumps(meta).encode("utf-8"))


@pytest.mark.parametrize("edit, named", [
    (lambda p: p["samples"][0].update(computed=p["samples"][0]["computed"] + 1),
     "meta.record.prefill.samples[0] must have from_cache + computed = tokens"),
    (lambda p: p["samples"][1].update(tokens=10, computed=10 - p["samples"][1]["from_cache"]),
     "meta.record.prefill.samples[1].tokens must be sample 1's length"),
    (lambda p: p["samples"][2].update(sample=7), "meta.record.prefill.samples[2].sample must name one of the 3"),
    (lambda p: p["samples"][0].update(steps="1"), "meta.record.prefill.samples[0].steps must be an integer"),
    (lambda p: p.update(budget_per="token"), "meta.record.prefill.budget_per must be one of sample, step"),
])
def test_a_stranger_s_prefill_record_that_does_not_add_up_is_refused(run_cli, reused, tmp_path, edit, named):
    bad = tmp_path / "cand.h5"
    shutil.copy(reused[0] / "cand.h5", bad)
    _edit_meta(bad, lambda m: edit(m["record"]["prefill"]))
    res = run_cli("compare", reused[0] / "ref.h5", bad)
    assert res.exit_code == 2 and named in res.output, res.output
