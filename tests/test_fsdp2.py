"""The fsdp2 engine: transformers' model under torch FSDP2 (fully_shard, a mixed-precision policy), data parallel over
spawned gloo ranks, against transformers' own model loaded in bfloat16 (in this process).

Each fsdp2 run spawns its ranks (seconds: interpreters importing torch and transformers), so the recorded traces are
one module fixture, at the ops level where the states are prefills (op-level states, digests and states in one
launch): five launches (fsdp2 on two families, the cast load, one rank, a decode), and one more for
``run --replay-ops``. The unit tests of the options and of the merge (rank_tape) run without a process group.
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
    """name -> trace path, recorded once: (preset or config, model, inputs); prefills at the ops level."""
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
            cache[name] = record_side(prep, d / f"{name}.h5", level="full" if inputs else "ops")
        return cache[name]
    return get


def _compare(run_cli, ref, cand, *more) -> dict:
    res = run_cli("compare", ref, cand, *EXACT, *more)
    return json.loads(res.output)


def _exact(run_cli, ref, cand, *more) -> dict:
    return json.loads(run_cli("compare", ref, cand, "--exact", *more, "--json", "-").output)


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
    only), so the keys differ from layer 0 on (compared past the identity failure it is); the records say inv_freq's
    dtype on each side."""
    rep = _compare(run_cli, traces("hf"), traces("cast"), "--allow-identity-difference")
    assert rep["verdict"] == "fail" and max(_max_abs(rep)) > 0
    assert rep["first_break"]["layer"] == 0
    hf, cast, dtype_loaded = (_meta(traces(n))["record"] for n in ("hf", "cast", "fsdp2"))
    assert hf["transformers"]["buffers"][INV_FREQ] == "float32" and hf["transformers"]["load"] == "dtype"
    assert cast["fsdp2"]["buffers"][INV_FREQ] == "bfloat16" and cast["fsdp2"]["load"] == "cast"
    assert dtype_loaded["fsdp2"]["buffers"][INV_FREQ] == "float32"
    assert set(cast["fsdp2"]["parameters"]) == set(dtype_loaded["fsdp2"]["parameters"]) == {"bfloat16"}


OPS = ("attn_norm", "q", "k", "v", "q_rope", "k_rope", "attn_core", "o_proj", "attn_residual", "mlp_norm", "gate",
       "up", "act_mul", "down")


@pytest.mark.slow
@pytest.mark.parametrize("family, qk_norm", [("", ()), ("-qwen3", ("q_norm", "k_norm"))])
def test_fsdp2_records_every_op_bit_for_bit_as_transformers_does(family, qk_norm, traces, run_cli):
    """--level ops under FSDP2: each rank's hooks write the ops into its tape, replayed in plan order. --exact compares
    every op of every layer (none left out as unrecorded) and finds each bitwise transformers' own; the trace
    declares the same ops recorded and absent, with the same reasons."""
    rep = _exact(run_cli, traces(f"hf{family}"), traces(f"fsdp2{family}"))
    assert rep["verdict"] == "pass", rep["verdict_line"]
    ex = rep["exact"]
    assert "ops" not in ex["not_compared"] and ex["bitwise_equal"]
    assert len(ex["layers"]) == _meta(traces(f"fsdp2{family}"))["model"]["args"]["n_layers"]
    for layer in ex["layers"]:
        ops = {t["tensor"]: t for t in layer["tensors"] if t["op"]}
        assert sorted(ops) == sorted(OPS + qk_norm), layer["layer"]
        assert all(0 < t["compared"] == t["bitwise_equal"] for t in ops.values())
    hf, fsdp2 = (_meta(traces(n))["record"]["ops"] for n in (f"hf{family}", f"fsdp2{family}"))
    assert fsdp2 == hf and sorted(fsdp2["recorded"]) == sorted(OPS + qk_norm)


@pytest.mark.slow
def test_a_cast_load_is_an_identity_failure_and_its_bits_part_first_at_layer_0s_rotary(traces, run_cli):
    """The cast load's digests: every parameter as transformers' bfloat16 load holds it, the buffers in bfloat16, so
    the identity fails naming inv_freq. Compared anyway, bit for bit: Q, K, V equal, then the rotary (or the cached
    keys after it) parts first at layer 0, and the hint names inv_freq."""
    rep = _exact(run_cli, traces("hf"), traces("cast"))
    assert rep["verdict"] == "fail" and rep["first_break"]["kind"] == "identity"
    assert f"buffer {INV_FREQ}: float32 in the reference, bfloat16 in the candidate" in rep["first_break"]["message"]
    ref, cast = (_meta(traces(n))["parameters"]["tensors"] for n in ("hf", "cast"))
    assert [t for t in cast if t["kind"] == "parameter"] == [t for t in ref if t["kind"] == "parameter"]
    assert {t["name"]: t["dtype"] for t in cast if t["kind"] == "buffer"}[INV_FREQ] == "bfloat16"
    rep = _exact(run_cli, traces("hf"), traces("cast"), "--allow-identity-difference")
    fb = rep["first_break"]
    assert rep["verdict"] == "fail" and (fb["layer"], fb["kind"]) == (0, "bits")
    assert fb["tensor"] in ("q_rope", "k_rope", "cache_keys") and INV_FREQ in rep["diagnosis"]
    layer0 = {t["tensor"]: t for t in rep["exact"]["layers"][0]["tensors"]}
    assert all(layer0[n]["bitwise_equal"] == layer0[n]["compared"] > 0 for n in ("attn_norm", "q", "k", "v"))


@pytest.mark.slow
def test_fsdp2_digests_every_parameter_gathered_from_its_shards_as_transformers_holds_it(traces, run_cli):
    """meta.parameters of fsdp2 (each parameter gathered whole from the ranks' shards, each buffer): name for name,
    dtype, shape and digest those of transformers' unsharded bfloat16 load, on two ranks and on one; the compare
    sees one model (no identity difference, every name matched: no note)."""
    ref, two, one = (_meta(traces(n))["parameters"] for n in ("hf", "fsdp2", "ranks1"))
    assert two["naming"] == "hf" and len(two["tensors"]) > 10
    assert two["tensors"] == ref["tensors"] and one["tensors"] == ref["tensors"]
    assert {t["name"]: t["dtype"] for t in two["tensors"] if t["kind"] == "buffer"}[INV_FREQ] == "float32"
    rep = _compare(run_cli, traces("hf"), traces("fsdp2"))
    assert rep["verdict"] == "pass" and rep["identity_differences"] == []
    assert not [n for n in rep["notes"] if "digests" in n]  # a note names only tensors on one side


@pytest.mark.slow
def test_run_replay_ops_on_fsdp2_replays_every_op_bitwise_and_says_where(run_cli):
    res = run_cli("run", "transformers-bf16", "fsdp2", "--replay-ops", "--json", "-")
    rep = json.loads(res.output)
    assert res.exit_code == 0 and rep["verdict"] == "pass", rep["verdict_line"]
    ops = [(layer["layer"], o["op"], o["verdict"]) for layer in rep["replay"]["layers"] for o in layer["ops"]]
    assert {(op, v) for _, op, v in ops} == {(op, "equal") for op in OPS} and len({n for n, _, _ in ops}) == 4
    assert rep["replay"]["engine"] == "fsdp2"
    assert rep["replay"]["notes"][0] == ("replayed on transformers' model loaded as fsdp2 loads it, outside the "
                                         "process group")


@pytest.mark.slow
def test_fsdp2_replay_of_the_cast_load_parts_from_the_reference_at_the_rotary_only(traces):
    """The replay builds the model as the side loads it: the cast load's replayed Q equals the reference's own, its
    replayed rotary (inv_freq in bfloat16) does not."""
    from prefill_diff.dumps.reader import Trace
    from prefill_diff.engine.foreign import fsdp2_engine
    from prefill_diff.jobs.replay import replay_input
    from prefill_diff.jobs.sides import prepare_side
    with Trace(traces("hf")) as ref:
        given = replay_input(ref)
        got = fsdp2_engine.replay_ops(prepare_side("fsdp2-cast"), given)
        same = {name: all(np.array_equal(got.out[(0, name)][i], given.tensor(0, name, i))
                          for i in range(len(given.samples))) for name in ("q", "k", "q_rope", "k_rope")}
    assert same == {"q": True, "k": True, "q_rope": False, "k_rope": False}


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


class _Ops:
    """A trace's op store as the replay sees it: ``absent`` logged in order, ``how``."""

    def __init__(self, log):
        self.log, self.how = log, {}

    def absent(self, name, why):
        self.log.seen.append(("ops.absent", (name, why)))


def test_a_tapes_op_request_answers_as_the_traces_and_its_absent_and_how_reach_the_trace_in_plan_order(tmp_path):
    """A rank's ``ops`` wants the layers the trace asked for; what it declares absent is replayed among the op writes
    in the plan's order, its ``how`` merged into the trace's; ``recorded`` lists the ops it wrote."""
    t0, t1 = rank_tape.RankTape(ops=True, ops_layers=[1]), rank_tape.RankTape(ops=True, ops_layers=[1])
    assert t0.ops.wants(1) and not t0.ops.wants(0) and rank_tape.RankTape().ops is None
    assert rank_tape.RankTape(ops=True).ops.wants(7)
    with t1.call(1):
        t1.ops.absent("q_norm", "no QK-norm")
        t1.op(1, "q", 1, 0, torch.ones(2, 4))
    with t0.call(0):
        t0.op(1, "k", 0, 0, torch.zeros(2, 4))
    t0.ops.how["q_rope"] = "rotated in float32"
    assert t0.ops.recorded == ["k"] and t1.ops.recorded == ["q"]
    t0.save(tmp_path / "r0.pt")
    t1.save(tmp_path / "r1.pt")
    log = _Log()
    log.ops = _Ops(log)
    rank_tape.replay([rank_tape.load(tmp_path / "r1.pt"), rank_tape.load(tmp_path / "r0.pt")], log)
    assert [(n, a[1]) for n, a in log.seen] == [("op", "k"), ("ops.absent", "no QK-norm"), ("op", "q")]
    assert log.ops.how == {"q_rope": "rotated in float32"}
