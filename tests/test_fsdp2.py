"""The fsdp2 engine: transformers' model under torch FSDP2 (fully_shard, a mixed-precision policy), data parallel over
spawned gloo ranks, against transformers' own model loaded in bfloat16 (in this process).

Each fsdp2 run spawns its ranks (seconds: interpreters importing torch and transformers), so the recorded traces are
one module fixture: five launches in all (fsdp2 on two families, the cast load, one rank, a decode). The unit tests of
the options and of the merge (rank_tape) run without a process group.
"""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from prefill_diff.engine.config import Inputs
from prefill_diff.engine.foreign import rank_tape
from prefill_diff.engine.foreign.fsdp2_options import Fsdp2Options
from prefill_diff.engine.foreign.hf_options import TransformersOptions
from prefill_diff.engine.models.spec import ModelSpec
from prefill_diff.engine.shared.errors import ConfigError

INV_FREQ = "model.rotary_emb.inv_freq"
EXACT = ("--no-calibrate", "--atol", "0", "--rtol", "0", "--ntol", "0", "--json", "-")
RESPONSES = Inputs(responses=((5, 6, 7), (8,), (9, 10)))  # unequal: the ranks run unequal numbers of forwards


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """name -> trace path, recorded once: (preset or config, model, inputs)."""
    from prefill_diff.jobs.sides import prepare_side, record_side
    d = tmp_path_factory.mktemp("fsdp2")
    (d / "ranks1.toml").write_text('[run]\nengine = "fsdp2"\ndtype = "bfloat16"\n[run.fsdp2]\nranks = 1\n')
    (d / "decode.toml").write_text('[run]\nengine = "fsdp2"\ndtype = "bfloat16"\ndecode = true\n')
    (d / "hf-decode.toml").write_text('[run]\nengine = "transformers"\ndtype = "bfloat16"\ndecode = true\n')
    sources = {"hf": ("transformers-bf16", None, None), "fsdp2": ("fsdp2", None, None),
               "cast": ("fsdp2-cast", None, None), "ranks1": (str(d / "ranks1.toml"), None, None),
               "hf-qwen3": ("transformers-bf16", "synthetic:qwen3", None), "fsdp2-qwen3": ("fsdp2", "synthetic:qwen3", None),
               "hf-decode": (str(d / "hf-decode.toml"), None, RESPONSES), "decode": (str(d / "decode.toml"), None, RESPONSES)}
    cache = {}

    def get(name):
        if name not in cache:
            source, model, inputs = sources[name]
            prep = prepare_side(source, ModelSpec(model) if model else None, inputs)
            cache[name] = record_side(prep, d / f"{name}.h5")
        return cache[name]
    return get


def _compare(run_cli, ref, cand) -> dict:
    res = run_cli("compare", ref, cand, *EXACT)
    return json.loads(res.output)


def _max_abs(rep) -> list:
    """Every compared tensor's max abs difference: each layer's, then the final ones'."""
    out = [t["max_abs"] for layer in rep["layers"] for t in layer["tensors"].values() if t.get("compared")]
    return out + [t["max_abs"] for t in rep["final"]["tensors"].values() if t.get("compared")]


def _meta(path) -> dict:
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["meta"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["", "-qwen3"])
def test_fsdp2_in_bfloat16_is_bitwise_transformers_loaded_in_bfloat16(family, traces, run_cli):
    """fully_shard per layer and root, param_dtype bfloat16 over 2 ranks: every layer state, the cache and the logits
    exactly transformers' (dtype=bfloat16), on the built-in Llama and on a Qwen3 (QK-norm): a PASS at tolerance 0."""
    rep = _compare(run_cli, traces(f"hf{family}"), traces(f"fsdp2{family}"))
    assert rep["verdict"] == "pass", rep["verdict_line"]
    found = _max_abs(rep)
    assert len(found) > 4 * 5 and max(found) == 0.0


@pytest.mark.slow
def test_a_cast_load_differs_and_its_record_shows_inv_freq_in_bfloat16(traces, run_cli):
    """The loader trap: float32 then model.to(bfloat16) casts RoPE's inv_freq too (FSDP2's policy casts parameters
    only), so the keys differ from layer 0 on; the records say inv_freq's dtype on each side."""
    rep = _compare(run_cli, traces("hf"), traces("cast"))
    assert rep["verdict"] == "fail" and max(_max_abs(rep)) > 0
    assert rep["first_break"]["layer"] == 0
    hf, cast, dtype_loaded = (_meta(traces(n))["record"] for n in ("hf", "cast", "fsdp2"))
    assert hf["transformers"]["buffers"][INV_FREQ] == "float32" and hf["transformers"]["load"] == "dtype"
    assert cast["fsdp2"]["buffers"][INV_FREQ] == "bfloat16" and cast["fsdp2"]["load"] == "cast"
    assert dtype_loaded["fsdp2"]["buffers"][INV_FREQ] == "float32"
    assert set(cast["fsdp2"]["parameters"]) == set(dtype_loaded["fsdp2"]["parameters"]) == {"bfloat16"}


def _datasets(path) -> dict:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, (obj[()], dict(obj.attrs)))
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


@pytest.mark.slow
def test_the_merged_trace_is_laid_out_as_one_process_trace_and_one_rank_gives_the_same_bits(traces):
    """Two ranks' tapes merged: every sample, and every dataset (name, dtype, shape, bytes, attributes) that of
    transformers' unsharded trace and of a one-rank fsdp2 run; only the metadata says how it ran."""
    two, one, hf = _datasets(traces("fsdp2")), _datasets(traces("ranks1")), _datasets(traces("hf"))
    assert sorted(two) == sorted(one) == sorted(hf)
    for name in two:
        for other in (one, hf):
            assert _same(two[name][0], other[name][0]), name
            assert two[name][1].keys() == other[name][1].keys(), name
    meta2, meta1 = _meta(traces("fsdp2")), _meta(traces("ranks1"))
    assert [s["sample"] for s in meta2["record"]["prefill"]["samples"]] == [0, 1, 2]
    par = meta2["parallel"]
    assert (par["kind"], par["strategy"], par["world_size"], par["mesh_dims"]) == ("data", "fsdp2", 2, ["dp"])
    assert par["policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32", "reshard_after_forward": True}
    ranks = meta2["record"]["fsdp2"]["ranks"]  # samples 0, 2 on rank 0; sample 1 on rank 1, which idles once
    assert [(r["rank"], r["samples"], r["forwards"], r["idle_forwards"]) for r in ranks] == [(0, 2, 2, 0),
                                                                                           (1, 1, 1, 1)]
    assert meta1["parallel"]["world_size"] == 1 and len(meta1["record"]["fsdp2"]["ranks"]) == 1
    assert "parallel" not in _meta(traces("hf"))


@pytest.mark.slow
def test_fsdp2_decodes_as_transformers_does_bit_for_bit(traces, run_cli):
    """Responses of 3, 1 and 2 tokens written token by token: rank 0 runs 4 + 3 forwards, rank 1 2 and 5 idle ones
    (every forward all-gathers); each decode step's states and the response logits exactly transformers' decode."""
    rep = _compare(run_cli, traces("hf-decode"), traces("decode"))
    assert rep["verdict"] == "pass", rep["verdict_line"]
    assert max(_max_abs(rep)) == 0.0 and rep["logprobs"]
    ranks = _meta(traces("decode"))["record"]["fsdp2"]["ranks"]
    assert [(r["forwards"], r["idle_forwards"]) for r in ranks] == [(7, 0), (2, 5)]
    with h5py.File(traces("decode"), "r") as f:
        assert int(np.asarray(f["inputs/phase"]).max()) == 1  # decode rows are there


# -- fast: options, refusals, the merge ----------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, said", [
    ("ranks", 0, "ranks must be an integer from 1 to 64 (got ranks=0)"),
    ("ranks", True, "got ranks=True"),
    ("param_dtype", "float64", "param_dtype must be one of 'float32', 'bfloat16', 'float16' (got param_dtype='float64')"),
    ("reduce_dtype", "int8", "got reduce_dtype='int8'"),
    ("reshard_after_forward", 1, "got reshard_after_forward=1"),
    ("load", "float32", "load must be one of 'dtype', 'cast' (got load='float32')"),
    ("attn_implementation", "flash", "got attn_implementation='flash'")])
def test_fsdp2_options_are_refused_naming_the_key_and_the_value(key, value, said):
    with pytest.raises(ConfigError) as e:
        Fsdp2Options(**{key: value})
    assert said in str(e.value) and "\n" not in str(e.value)


def test_the_transformers_engine_takes_the_same_load_option():
    from prefill_diff.engine.foreign import hf_options, hf_record
    assert TransformersOptions(load="cast").load == "cast" and hf_record.LOADS == hf_options.LOADS
    with pytest.raises(ConfigError, match=r"load must be one of 'dtype', 'cast' \(got load='fp32'\)"):
        TransformersOptions(load="fp32")


@pytest.mark.parametrize("table, said", [
    ("[run.fsdp2]\nranks = 0", "ranks must be an integer from 1 to 64 (got ranks=0)"),
    ("[run.fsdp2]\nload = \"fp32\"", "load must be one of 'dtype', 'cast' (got load='fp32')"),
    ("[run.fsdp2]\nparam_dtype = \"float16\"", "param_dtype must be the run's dtype"),
    ("tp = 2", "does not shard over tensor-parallel ranks")])
def test_a_bad_fsdp2_config_exits_2_in_one_line(table, said, run_cli, tmp_path):
    cfg = tmp_path / "bad.toml"
    run = "[run]\nengine = \"fsdp2\"\ndtype = \"bfloat16\"\n"
    cfg.write_text(run + table + "\n" if table.startswith("[") else run.replace("\n", f"\n{table}\n", 1))
    res = run_cli("run", "reference", cfg)
    assert res.exit_code == 2 and said in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


class _Log:
    """A recorder that keeps what it was told, in order."""

    def __init__(self):
        self.seen = []

    def __getattr__(self, name):
        return lambda *args: self.seen.append((name, args))


def test_replay_writes_each_ranks_calls_in_the_plans_order_with_their_own_values(tmp_path):
    """Rank 0 ran calls 0 and 2, rank 1 call 1: the replay is call 0, 1, 2, whatever the ranks' order, with the values
    as they were when written (a tensor changed afterwards in the rank does not change its tape)."""
    r0, r1 = rank_tape.RankTape(), rank_tape.RankTape()
    x = torch.arange(4.0)
    with r0.call(2):
        r0.state(0, "layer_input", 2, 0, x)
    with r0.call(0):
        r0.inputs(0, 0, x, x, x, x)
    x += 100  # the rank's buffer, reused
    with r1.call(1):
        r1.final(1, x, x, 3, 3)
    r0.save(tmp_path / "r0.pt", absent={})
    r1.save(tmp_path / "r1.pt", absent={})
    log = _Log()
    rank_tape.replay([rank_tape.load(tmp_path / "r1.pt"), rank_tape.load(tmp_path / "r0.pt")], log)
    assert [n for n, _ in log.seen] == ["inputs", "final", "state"]
    assert log.seen[0][1][2].tolist() == [0.0, 1.0, 2.0, 3.0] and log.seen[1][1][1].tolist() == [100.0, 101.0,
                                                                                                102.0, 103.0]


def test_replay_refuses_a_call_two_ranks_ran_and_a_tape_takes_only_writes():
    a, b = rank_tape.RankTape(), rank_tape.RankTape()
    for t in (a, b):
        with t.call(0):
            t.state(0, "mid", 0, 0, torch.zeros(1))
    with pytest.raises(RuntimeError, match="call 0 of the plan was run by two ranks"):
        rank_tape.replay([{"calls": a.calls}, {"calls": b.calls}], _Log())
    with pytest.raises(AttributeError, match="not begin"):
        a.begin
    with pytest.raises(RuntimeError, match="outside any call"):
        a.state(0, "mid", 0, 0, torch.zeros(1))
