"""Bit for bit (--exact): the bitwise metric against hand computations, and the exact verdict on recorded traces with
one bit changed where the test says: it names that tensor, layer, position and decode step, its share of equal
elements and its ULP distance; the tolerance verdict passes the same pair."""
from __future__ import annotations

import json
import math
import shutil

import h5py
import numpy as np
import pytest

from prefill_diff.verify.bitwise import SLAB, Bits, compare, ordered, percent

# -- the metric -----------------------------------------------------------------------------------------------


def test_adjacent_float32_values_are_one_ulp_apart_and_not_equal():
    a = np.array([1.0, -2.5, 3.0e-20, 7.0], dtype=np.float32)
    b = a.copy()
    b[1] = np.nextafter(b[1], np.float32(0))  # one representable value towards zero
    b[2] = np.nextafter(np.nextafter(b[2], np.float32(1)), np.float32(1))  # two up
    got = compare(a, b, "float32", "float32")
    assert (got.n, got.equal, got.max_ulp, got.first) == (4, 2, 2.0, 1)
    assert got.share == 0.5 and got.max_abs == pytest.approx(abs(float(a[1]) - float(b[1])))


def test_bfloat16_stored_as_float32_counts_ulps_of_bfloat16():
    """A bfloat16 value widened to float32 has its low 16 bits zero; the next bfloat16 above 1.0 is 1 + 2**-7."""
    a = np.array([1.0, 1.0, -0.5], dtype=np.float32)
    b = np.array([1.0 + 2.0 ** -7, 1.0 + 3 * 2.0 ** -7, -0.5], dtype=np.float32)
    got = compare(a, b, "bfloat16", "bfloat16")
    assert (got.equal, got.max_ulp) == (1, 3.0)
    assert got.words() == "33.3% bitwise equal, max 3 ULP (bfloat16)"


def test_float16_and_float64_ulps():
    a16 = np.array([1.0], dtype=np.float16)
    assert compare(a16, np.nextafter(a16, np.float16(2)), "float16", "float16").max_ulp == 1.0
    a64 = np.array([1.0, 2.0])
    assert compare(a64, np.nextafter(a64, 3.0), "float64", "float64").max_ulp == 1.0


def test_signed_zeros_differ_in_bits_but_not_in_ulps_and_crossing_zero_counts_both_sides():
    z = compare(np.array([0.0], np.float32), np.array([-0.0], np.float32), "float32", "float32")
    assert (z.equal, z.max_ulp) == (0, 0.0)
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    x = compare(np.array([tiny], np.float32), np.array([-tiny], np.float32), "float32", "float32")
    assert x.max_ulp == 2.0
    assert ordered(np.array([-1, 1], dtype=np.int32).view(np.int32), 32).tolist() == [-(2 ** 31 - 1), 1]


def test_nan_against_a_number_is_unbounded_the_same_nan_is_equal():
    a = np.array([np.nan, 1.0, np.inf], np.float32)
    same = compare(a, a.copy(), "float32", "float32")
    assert same.exact and same.max_ulp == 0.0
    other = compare(a, np.array([1.0, 1.0, 5.0], np.float32), "float32", "float32")
    assert other.equal == 1 and math.isinf(other.max_ulp)
    assert "unbounded" in other.words() and other.as_dict()["max_ulp_unbounded"] is True


def test_different_dtypes_compare_values_and_measure_the_coarser_ulp():
    a = np.array([1.0, 1.0], np.float32)
    b = np.array([1.0, 1.0 + 2.0 ** -7], np.float32)
    got = compare(a, b, "float32", "bfloat16")
    assert got.dtype == "float32 vs bfloat16" and got.equal == 1 and got.max_ulp == pytest.approx(1.0)
    zero = compare(np.array([0.0], np.float32), np.array([2.0 ** -133], np.float32), "bfloat16", "float32")
    assert zero.max_ulp == 1.0  # bfloat16's smallest subnormal is one value from 0
    near = compare(np.array([1.0], np.float32), np.array([1.0 + 2.0 ** -9], np.float32), "bfloat16", "float32")
    assert near.equal == 0 and near.max_ulp == 0.0  # rounds to the same bfloat16: not equal, no ULP apart


def test_a_share_never_rounds_a_difference_away():
    assert percent(1.0) == "100%"
    assert percent(0.9997) != "100.0%" and percent(0.99999) == "99.999%" and percent(0.5) == "50.0%"
    assert percent(1e-6) != "0.0%"


def test_slabs_find_the_first_difference_past_the_first_slab():
    a = np.zeros(SLAB + 10, np.float32)
    b = a.copy()
    b[SLAB + 3] = 1.0
    got = Bits()
    got.add(a, b, "float32", "float32")
    assert got.first == SLAB + 3 and got.n == SLAB + 10 and got.equal == SLAB + 9


# -- the verdict on traces with one bit changed ----------------------------------------------------------------

PROMPTS = ((5, 6, 7, 8, 9, 10, 11), (3, 4, 5), (20, 21, 22, 23, 24))
RESPONSES = ((31, 32, 33), (35, 36, 37), (39, 40, 41))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two recordings of the same run at --level ops (bitwise equal: one engine, one process), with and without a
    response decoded (the decode preset), and one at the stats level."""
    from click.testing import CliRunner
    from prefill_diff.cli.main import cli
    d = tmp_path_factory.mktemp("exact")
    ids = ", ".join(f"[{', '.join(map(str, p))}]" for p in PROMPTS)
    resp = ", ".join(f"[{', '.join(map(str, r))}]" for r in RESPONSES)
    (d / "decode.toml").write_text(f'[run]\nbatching = "left"\ndecode = true\n[inputs]\ntoken_ids = [{ids}]\n'
                                   f"responses = [{resp}]\n")
    out = {}
    for name, source, level in (("a", "batched-left", "ops"), ("b", "batched-left", "ops"),
                                ("plain", "batched-left", "full"), ("stats", "batched-left", "stats"),
                                ("da", str(d / "decode.toml"), "ops"), ("db", str(d / "decode.toml"), "ops")):
        path = d / f"{name}.h5"
        res = CliRunner().invoke(cli, ["record", source, "-o", str(path), "--level", level, "-q"],
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
        out[name] = path
    return out


def _changed(src, tmp_path, dataset: str, index: tuple) -> str:
    """A copy of trace ``src`` with the lowest mantissa bit of one element flipped (one ULP)."""
    dst = tmp_path / f"changed-{dataset.replace('/', '-')}.h5"
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        ds = f[dataset]
        index = tuple(i + ds.shape[k] if i < 0 else i for k, i in enumerate(index))
        v = np.array(ds[index], dtype=ds.dtype)
        v.view(np.int32 if ds.dtype == np.float32 else np.int64)[...] ^= 1
        ds[index] = v
    return str(dst)


def _exact(run_cli, ref, cand, *more):
    res = run_cli("compare", ref, cand, "--exact", "--json", "-", *more)
    return res.exit_code, json.loads(res.output)


def test_two_recordings_of_one_run_are_bitwise_equal(recorded, run_cli):
    code, rep = _exact(run_cli, recorded["a"], recorded["b"])
    assert code == 0 and rep["verdict"] == "pass" and "bitwise equal" in rep["verdict_line"]
    ex = rep["exact"]
    assert ex["bitwise_equal"] and ex["first"] is None
    names = {t["tensor"] for t in ex["layers"][0]["tensors"]}
    assert {"q", "q_rope", "attn_core", "down", "cache_keys", "layer_output"} <= names
    assert all(t["share_equal"] == 1.0 for lb in ex["layers"] for t in lb["tensors"])


@pytest.mark.parametrize("dataset, index, layer, tensor", [
    ("layers/002/ops/q_rope", (1, -1, 3), 2, "q_rope"),  # columns from the end: left padding keeps them valid
    ("layers/000/ops/attn_norm", (0, -3, 0), 0, "attn_norm"),
    ("layers/003/layer_output", (2, -2, 5), 3, "layer_output"),
    ("layers/001/ops/down", (0, -4, 1), 1, "down"),
])
def test_one_ulp_in_one_tensor_is_the_first_break_naming_it(recorded, run_cli, tmp_path, dataset, index, layer,
                                                             tensor):
    cand = _changed(recorded["b"], tmp_path, dataset, index)
    code, rep = _exact(run_cli, recorded["a"], cand)
    assert code == 1 and rep["verdict"] == "fail"
    first = rep["exact"]["first"]
    assert (first["layer"], first["tensor"], first["max_ulp"]) == (layer, tensor, 1)
    assert first["compared"] - first["bitwise_equal"] == 1
    fb = rep["first_break"]
    assert (fb["kind"], fb["layer"], fb["tensor"], fb["sample"]) == ("bits", layer, tensor, index[0])
    with h5py.File(cand) as f:  # the cell's token index: left padding moves columns, not positions
        assert fb["position"] == int(f["inputs/token_index"][index[0], index[1] + f["inputs/token_index"].shape[1]])
    assert f"layer {layer} {tensor}" in rep["verdict_line"] and "max 1 ULP" in rep["verdict_line"]
    firsts = [lb["first_part"] for lb in rep["exact"]["layers"]]
    assert firsts[:layer] == [None] * layer and firsts[layer] == tensor
    # within tolerance: the same pair passes without --exact
    res = run_cli("compare", recorded["a"], cand, "--json", "-")
    assert res.exit_code == 0 and json.loads(res.output)["verdict"] == "pass"


def test_a_cache_key_and_the_final_logits_are_compared_bit_for_bit(recorded, run_cli, tmp_path):
    cand = _changed(recorded["b"], tmp_path, "layers/001/cache/keys", (1, 0, 2, 3))
    _, rep = _exact(run_cli, recorded["a"], cand)
    fb = rep["first_break"]
    assert (fb["layer"], fb["tensor"], fb["sample"], fb["position"]) == (1, "cache_keys", 1, 2)
    cand = _changed(recorded["b"], tmp_path, "final/logits", (2, 17))
    code, rep = _exact(run_cli, recorded["a"], cand)
    assert code == 1 and rep["first_break"]["stage"] == "final" and rep["first_break"]["tensor"] == "logits"
    assert rep["exact"]["layers"] and all(lb["first_part"] is None for lb in rep["exact"]["layers"])


def test_a_decoded_row_names_its_decode_step(recorded, run_cli, tmp_path):
    with h5py.File(recorded["db"]) as f:
        step, tok = f["inputs/step"][0], f["inputs/token_index"][0]
        col = int(np.flatnonzero(step == 2)[0])
        pos = int(tok[col])
    cand = _changed(recorded["db"], tmp_path, "layers/001/ops/gate", (0, col, 0))
    code, rep = _exact(run_cli, recorded["da"], cand)
    assert code == 1
    assert rep["exact"]["first"]["decode_step"] == 2 and rep["first_break"]["position"] == pos
    assert "(decode step 2)" in rep["verdict_line"]
    cand = _changed(recorded["db"], tmp_path, "response/logits", (1, 1, 4))
    _, rep = _exact(run_cli, recorded["da"], cand)
    assert rep["first_break"]["tensor"] == "response_logits" and rep["first_break"]["sample"] == 1


def test_ops_recorded_on_one_side_only_are_said_and_the_states_still_judged(recorded, run_cli, tmp_path):
    code, rep = _exact(run_cli, recorded["a"], recorded["plain"])
    assert code == 0 and "ops" in rep["exact"]["not_compared"]
    assert "candidate" in rep["exact"]["not_compared"]["ops"]
    cand = _changed(recorded["plain"], tmp_path, "layers/002/mid", (0, 1, 0))
    code, rep = _exact(run_cli, recorded["a"], cand)
    assert code == 1 and rep["first_break"]["tensor"] == "mid"


def test_exact_refuses_what_cannot_be_compared_bit_for_bit(recorded, run_cli):
    res = run_cli("compare", recorded["a"], recorded["stats"], "--exact")
    assert res.exit_code == 2 and "full traces" in res.output and "Traceback" not in res.output
    res = run_cli("run", "reference", "batched-left", "--exact", "--level", "stats")
    assert res.exit_code == 2 and "--level full or ops" in res.output
    res = run_cli("run", "reference", "batched-left", "--exact", "--calibrate")
    assert res.exit_code == 2 and "--exact" in res.output
    res = run_cli("run", "reference", "llama.cpp", "--replay-ops")
    assert res.exit_code == 2 and "cannot replay" in res.output


def test_inspect_shows_an_op_and_says_which_ops_a_trace_holds(recorded, run_cli):
    res = run_cli("inspect", recorded["a"], "--layer", "1", "--tensor", "q_rope", "--sample", "0", "--channel", "0-3")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "values of q_rope, layer 1, sample 0" in text
    assert "op-level states recorded: attn_norm, q, k, v, q_rope" in text
    assert "absent: k_norm, q_norm (the model has no QK-norm)" in text
    with h5py.File(recorded["a"]) as f:
        col = int(np.flatnonzero(f["inputs/valid_mask"][0])[0])
        first = float(f["layers/001/ops/q_rope"][0, col, 0])
    assert f"{first:.4g}"[:5] in res.output
    res = run_cli("inspect", recorded["plain"], "--layer", "1", "--tensor", "q_rope", "--sample", "0")
    assert res.exit_code == 0 and "record with --level ops" in res.output
