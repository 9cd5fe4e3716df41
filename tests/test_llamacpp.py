"""llama.cpp as an engine (llama-cpp-python, pinned): its nodes against our engine, quantization, batching, faults."""
from __future__ import annotations

import ctypes
import json
import shutil

import numpy as np
import pytest

import gguf  # noqa: F401  (the test extras install both; a missing one must fail, never skip)
import llama_cpp  # noqa: F401

from prefill_diff.dumps.reader import Trace
from prefill_diff.engine.foreign import llamacpp_engine as lce
from prefill_diff.engine.foreign import llamacpp_library as llib
from prefill_diff.engine.config import load_side
from prefill_diff.engine.models.gguf_loader import smollm2_path
from prefill_diff.engine.shared.errors import ModelLoadError
from prefill_diff.verify.tolerance import default_policy

pytestmark = pytest.mark.slow  # llama.cpp runs of the SmolLM2 GGUF

FRANCE = "The capital of France is"


def _json(res) -> dict:
    return json.loads(res.output)


def _write_f32(src: str, dst: str) -> None:
    """SmolLM2's GGUF with every tensor dequantized to F32: the same metadata, tokenizer and row layout."""
    from gguf.quants import dequantize
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            w.add_file_type(gguf.LlamaFileType.ALL_F32)
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type).astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _edit_freq_base(path: str, value: float) -> float:
    """Edit rope.freq_base in place (as gguf-py's gguf_set_metadata does); returns the old value."""
    r = gguf.GGUFReader(path, "r+")
    f = r.fields["llama.rope.freq_base"]
    old = float(f.parts[f.data[0]][0])
    f.parts[f.data[0]][0] = value
    del r
    return old


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    d = tmp_path_factory.mktemp("llamacpp")
    f32 = d / "smol-f32.gguf"
    _write_f32(smollm2_path(), str(f32))
    edited = d / "smol-f32-edited.gguf"
    shutil.copy(f32, edited)
    old = _edit_freq_base(str(edited), 10000.0)
    assert old == 100000.0
    return {"dir": d, "f32": str(f32), "edited": str(edited)}


# -- SmolLM2 Q4_1 (the shipped GGUF) ----------------------------------------------------------------
def test_smollm2_q4_1_all_30_layers_and_both_rank_paris_first(run_cli, tmp_path):
    res = run_cli("run", "reference", "llama.cpp", "--model", "smollm2", "--prompt", FRANCE, "--out", tmp_path,
                  "--json", "-")
    rep = _json(res)
    assert len(rep["layers"]) == 30
    top = rep["final"]["top"][0]
    assert top["reference_text"][0] == " Paris" and top["candidate_text"][0] == " Paris"
    # quantized weights: judged with the int8-class policy, and the trace says why
    assert rep["policy"]["name"] == "int8"
    # no twin can run llama.cpp's Q8_1 activations: the header says the envelope is uncalibrated, and why
    assert rep["rule"].startswith("uncalibrated (our engine cannot run the candidate's precisions (float32 with "
                                  "Q4_1 weights); llama.cpp also quantizes activations to Q8 inside its matmuls"), \
        rep["rule"]
    assert "): fixed int8 envelope (" in rep["rule"]
    assert rep["candidate"]["quantized_weights_digest"].startswith("sha256:")
    assert rep["reference"]["quantized_weights_digest"] is None
    assert res.exit_code == 0, rep["verdict_line"]
    with Trace(tmp_path / "cand.h5") as t:
        llama = t.meta["record"]["llama_cpp"]
        assert llama["weight_quant"] == "Q4_1" and llama["weight_types"] == {"Q4_1": 210, "Q8_0": 1}
        assert t.meta["engine"]["weight_quant"] == "Q4_1"
        assert llama["flash_attn"] is False and llama["use_extra_bufts"] is False
        # internal consistency of the nodes read: mid = layer_input + attn_update, output = mid + mlp_update
        for layer in (0, 14, 29):
            v = t.layer(layer)
            x, a, m, f, o = (v.state(n)[0] for n in ("layer_input", "attn_update", "mid", "mlp_update",
                                                   "layer_output"))
            np.testing.assert_array_equal(m, (x + a).astype(np.float32))
            np.testing.assert_array_equal(o, (m + f).astype(np.float32))
        # llama.cpp's own logits (llama_get_logits_ith) rank " Paris" first
        assert t.meta["token_text"][str(int(t.final["topk_ids"][0, 0]))] == " Paris"


def test_flash_against_no_flash_on_q4_1_reports_where_they_part(run_cli, tmp_path):
    """Both sides llama.cpp on the same quantized weights: under the float32 policy the report names layer 0,
    where the f16 cache and flash attention first change what attention reads."""
    res = run_cli("run", "llama.cpp", "llama.cpp-flash", "--model", "smollm2", "--prompt", FRANCE,
                  "--policy", "float32", "--json", "-")
    rep = _json(res)
    assert res.exit_code == 1, rep["verdict_line"]
    fb = rep["first_break"]
    assert fb["layer"] == 0 and fb["tensor"] == "cache_keys", rep["verdict_line"]
    assert len(rep["layers"]) == 30
    # flash attention alone (an f32 cache on both sides) parts at layer 0's attention output
    flash = tmp_path / "flash-f32.toml"
    flash.write_text('preset = "llama.cpp-flash"\n[run.llamacpp]\ntype_k = "f32"\ntype_v = "f32"\n')
    res = run_cli("run", "llama.cpp", flash, "--model", "smollm2", "--prompt", FRANCE, "--policy", "float32",
                  "--json", "-")
    rep = _json(res)
    assert res.exit_code == 1, rep["verdict_line"]
    fb = rep["first_break"]
    assert fb["layer"] == 0 and fb["tensor"] in ("attn_update", "attn_heads"), rep["verdict_line"]
    assert rep["layers"][0]["tensors"]["cache_keys"]["max_abs"] == 0  # the keys are the same, attention is not


# -- F32 GGUF made from SmolLM2: float32 agreement, and the edited-metadata fault ---------------------
def test_f32_gguf_passes_under_the_float32_policy(run_cli, ggufs):
    res = run_cli("run", "reference", "llama.cpp", "--model", f"gguf:{ggufs['f32']}", "--prompt", FRANCE,
                  "--json", "-")
    rep = _json(res)
    assert res.exit_code == 0, rep["verdict_line"]
    assert rep["policy"]["name"] == "float32" and len(rep["layers"]) == 30
    assert rep["candidate"]["quantized_weights_digest"] is None
    assert rep["final"]["top"][0]["candidate_text"][0] == " Paris"


def test_edited_freq_base_breaks_at_layer_0_on_cache_keys(run_cli, ggufs):
    cand = ggufs["dir"] / "edited.toml"
    cand.write_text(f'preset = "llama.cpp"\n[model]\nsource = "gguf:{ggufs["edited"]}"\n')
    args = ("run", "reference", cand, "--model", f"gguf:{ggufs['f32']}", "--prompt", FRANCE, "--json", "-")
    rep = _json(res := run_cli(*args))
    assert res.exit_code == 1, rep["verdict_line"]
    assert rep["first_break"]["kind"] == "identity"  # another model: a failure by itself
    assert rep["verdict_line"] == "FAILED | identity | rope_theta (RoPE base) 100000.0 in the reference, " \
                                  "10000.0 in the candidate"
    lb = rep["layers"][0]["first_break"]  # the layers are still compared: where the difference shows
    assert (lb["tensor"], lb["kind"]) == ("cache_keys", "value") and lb["position"] > 0  # position 0 is not rotated
    assert "rope_theta differs (reference 100000.0 vs candidate 10000.0)" in rep["diagnosis"]
    # the same weights: the digests agree, only the metadata differs
    assert rep["reference"]["weights_digest"] == rep["candidate"]["weights_digest"]
    rep = _json(res := run_cli(*args, "--allow-identity-difference"))
    fb = rep["first_break"]
    assert (fb["layer"], fb["tensor"], fb["kind"]) == (0, "cache_keys", "value"), rep["verdict_line"]
    assert any(n.startswith("MODEL IDENTITY DIFFERS: rope_theta") for n in rep["notes"])


def test_flash_with_an_f16_cache_is_calibrated_and_catches_an_edited_freq_base(run_cli, ggufs):
    """llama.cpp's defaults (flash attention, f16 KV cache) on an F32 GGUF: its precisions are ones our engine can
    run, so it gets a float64 golden and a twin like ours. The honest run passes; a freq_base of 50000 instead
    of 100000 moves layer 0's keys far beyond the twin's noise (the fixed float16 envelope passed it)."""
    honest = _json(run_cli("run", "reference", "llama.cpp-flash", "--model", f"gguf:{ggufs['f32']}", "--prompt",
                           FRANCE, "--json", "-"))
    assert honest["verdict"] == "pass", honest["verdict_line"]
    assert honest["rule"].startswith("calibrated: each row within 4x the noise of the reference's path in float16")
    ratios = [t["calibrated"]["max_ratio"] for lr in honest["layers"] for t in lr["tensors"].values()]
    assert len(ratios) == 30 * 8 and max(ratios) < 2  # llama.cpp's error stays below our fp16 twin's noise
    half = ggufs["dir"] / "smol-f32-50k.gguf"
    shutil.copy(ggufs["f32"], half)
    assert _edit_freq_base(str(half), 50000.0) == 100000.0
    cand = ggufs["dir"] / "flash-50k.toml"
    cand.write_text(f'preset = "llama.cpp-flash"\n[model]\nsource = "gguf:{half}"\n')
    args = ("run", "reference", cand, "--model", f"gguf:{ggufs['f32']}", "--prompt", FRANCE, "--json", "-")
    rep = _json(run_cli(*args))
    assert rep["first_break"]["kind"] == "identity", rep["verdict_line"]
    rep = _json(run_cli(*args, "--allow-identity-difference"))
    fb = rep["first_break"]
    assert (fb["layer"], fb["tensor"], fb["check"]) == (0, "cache_keys", "change"), rep["verdict_line"]
    assert fb["noise_ratio"] > 20
    assert _json(run_cli(*args, "--allow-identity-difference", "--no-calibrate"))["verdict"] == "pass"


# -- converted models: every tensor against our engine, float32 -----------------------------------------
@pytest.mark.parametrize("model", ["synthetic", "seed-2.8", "qkv-bias"])
def test_converted_models_agree_with_our_engine_in_float32(model, run_cli, tmp_path):
    """A synthetic Llama (Q/K rows permuted in the GGUF: keys un-permuted back), a tiny one, and a Qwen2-style
    model with QKV bias (written as qwen2: rows kept) — three prompts of unequal lengths, one at a time."""
    args = ["--model", model] if model != "qkv-bias" else []
    cand = "llama.cpp"
    ref = "reference"
    if model == "qkv-bias":
        for name, preset in (("ref", "reference"), ("cand", "llama.cpp")):
            (tmp_path / f"{name}.toml").write_text(f'preset = "{preset}"\n[model]\nqkv_bias = true\n')
        ref, cand = tmp_path / "ref.toml", tmp_path / "cand.toml"
    res = run_cli("run", ref, cand, *args, "--json", "-")
    rep = _json(res)
    assert res.exit_code == 0, rep["verdict_line"]
    assert rep["policy"]["name"] == "float32"
    names = set(rep["layers"][0]["tensors"])
    assert {"layer_input", "attn_update", "attn_heads", "mid", "mlp_update", "layer_output", "cache_keys",
            "cache_values"} <= names


def test_keys_without_unpermuting_fail_at_layer_0(run_cli, monkeypatch):
    """The un-permutation is needed and checked: leave llama.cpp's row order and the keys break."""
    monkeypatch.setattr(lce, "_ours", lambda k, permuted: k)
    res = run_cli("run", "reference", "llama.cpp", "--json", "-")
    rep = _json(res)
    assert res.exit_code == 1
    assert (rep["first_break"]["layer"], rep["first_break"]["tensor"]) == (0, "cache_keys")


def test_batched_sequences_and_small_ubatches_agree_with_one_at_a_time(run_cli, tmp_path):
    """llama.cpp's own batching (seq_ids in one batch, unified cache), and micro-batches of 4 tokens in
    decode calls of 8: the nodes of every micro-batch are stitched back in order."""
    res = run_cli("run", "reference", "llama.cpp-batched", "--out", tmp_path, "--json", "-")
    rep = _json(res)
    assert res.exit_code == 0, rep["verdict_line"]
    with Trace(tmp_path / "cand.h5") as t:
        assert t.inputs["valid_mask"].shape[0] == 3 and t.meta["engine"]["batching"] == "packed"
    small = tmp_path / "small.toml"
    small.write_text('preset = "llama.cpp-batched"\n[run.llamacpp]\nn_ubatch = 4\nn_batch = 8\n')
    res = run_cli("run", "reference", small, "--json", "-")
    assert res.exit_code == 0, _json(res)["verdict_line"]


def test_f16_conversion_is_judged_as_float16(run_cli, tmp_path):
    cfg = tmp_path / "f16.toml"
    cfg.write_text('preset = "llama.cpp"\n[run.llamacpp]\ngguf_type = "f16"\n')
    res = run_cli("run", "reference", cfg, "--json", "-")
    rep = _json(res)
    assert rep["policy"]["name"] == "float16"
    assert res.exit_code == 0, rep["verdict_line"]
    # and the f16 weights really differ from float32: the float32 policy fails them
    res = run_cli("run", "reference", cfg, "--policy", "float32", "--json", "-")
    assert res.exit_code == 1


def test_policy_follows_the_weight_type_and_the_cache():
    f32 = {"engine": {"dtype": "float32"}, "layout": {"dtype": "float32"}, "record": {}}
    q4 = {"engine": {"dtype": "float32"}, "layout": {"dtype": "float32"},
          "record": {"quantized_weights_digest": "sha256:x"}}
    f16cache = {"engine": {"dtype": "float16"}, "layout": {"dtype": "float16"}, "record": {}}
    assert default_policy(f32, f32).name == "float32"
    assert default_policy(f32, q4).name == "int8"
    assert default_policy(f32, f16cache).name == "float16"


# -- guards -----------------------------------------------------------------------------------------
def test_models_load_without_extra_buffer_types(monkeypatch, run_cli):
    """The AMX segfault: every model is loaded with use_extra_bufts = False, CPU only."""
    lib = llib.load_library()
    seen = []
    real = lib.llama_model_load_from_file

    def spy(path, params):
        seen.append((params.use_extra_bufts, params.n_gpu_layers))
        return real(path, params)
    monkeypatch.setattr(lib, "llama_model_load_from_file", spy)
    res = run_cli("run", "reference", "llama.cpp", "--model", "seed-2.8", "-q")
    assert res.exit_code == 0, res.output
    assert seen == [(False, 0)]


def test_struct_layout_matches_this_ggml():
    """Our ctypes struct ggml_tensor against ggml's own accessors (name offset, ne), and a wrong one refused."""
    llib.load_library()
    t = llib.GgmlTensor()
    t.type, t.name = 0, b"probe-3"
    for i, n in enumerate((4, 3, 2, 1)):
        t.ne[i] = n
    buf = (ctypes.c_float * 24)()
    t.data = ctypes.addressof(buf)
    cap = llib.Capture(1)
    cap._check_layout(t, ctypes.addressof(t))
    assert cap.checked

    class Shifted(ctypes.Structure):  # one field short: name and ne land elsewhere
        _fields_ = [f for f in llib.GgmlTensor._fields_ if f[0] != "buffer"]
    s = Shifted()
    s.type, s.name, s.data = 0, b"probe-3", ctypes.addressof(buf)
    for i in range(4):
        s.ne[i] = 1
    with pytest.raises(ModelLoadError, match="lays out struct ggml_tensor differently"):
        llib.Capture(1)._check_layout(s, ctypes.addressof(s))


@pytest.mark.parametrize("toml, message", [
    ('[run.llamacpp]\nflash_attn = true\n', '[run.llamacpp] sets options of engine = "llama.cpp"'),
    # configs written before each engine had its own table: one line naming the new key
    ('preset = "llama.cpp"\n[run]\nflash_attn = true\n', 'set it in its own table, [run.llamacpp] flash_attn = true'),
    ('preset = "llama.cpp"\n[run]\nbatching = "left"\n', 'batches sequences without padding'),
    ('preset = "llama.cpp"\n[run.llamacpp]\ntype_v = "q8_0"\n', 'needs flash attention for a quantized V cache'),
    ('preset = "llama.cpp"\n[run.llamacpp]\ntype_k = "q3_k"\n', 'type_k must be one of'),
    ('preset = "llama.cpp"\n[run.llamacpp]\nn_ubatch = 0\n', 'n_ubatch must be an integer from 1 to 2147483647'),
    ('preset = "llama.cpp"\n[run.llamacpp]\nn_batch = 4294967296\n', 'n_batch must be an integer from 1 to'),
    ('preset = "llama.cpp"\n[run]\ntp = 2\n', 'the llama.cpp engine does not shard over tensor-parallel ranks'),
    ('preset = "llama.cpp"\n[run]\ndtype = "bfloat16"\n', 'llama.cpp computes in float32'),
    ('preset = "llama.cpp"\n[model]\nrope_scaling = { rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0, '
     'high_freq_factor = 4.0, original_max_position_embeddings = 64 }\n', 'cannot run a model with RoPE scaling'),
])
def test_bad_llamacpp_settings_are_one_line_exit_2(toml, message, run_cli, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    res = run_cli("run", "reference", cfg)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


def test_missing_llama_cpp_python_is_a_clear_error(monkeypatch, run_cli):
    import sys
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setitem(llib._STATE, "lib", None)
    res = run_cli("run", "reference", "llama.cpp", "--model", "seed-2.8")
    assert res.exit_code == 2
    assert "pip install 'prefill-diff[llamacpp]'" in res.output


def test_presets_say_how_they_differ_from_llamacpp_defaults():
    for name in ("llama.cpp", "llama.cpp-flash", "llama.cpp-batched"):
        run = load_side(name).run
        assert run.engine == "llama.cpp"
    assert load_side("llama.cpp").run.options.flash_attn is False
    assert load_side("llama.cpp-flash").run.options.type_k == "f16"
    assert load_side("llama.cpp-batched").run.batching == "packed"
    from prefill_diff.engine.foreign.llamacpp_options import LlamaCppOptions
    d = LlamaCppOptions()
    assert (d.flash_attn, d.type_k, d.type_v, d.n_ubatch, d.n_batch) == ("auto", "f16", "f16", 512, 2048)


def test_thread_count_does_not_change_the_results(run_cli, tmp_path):
    """Why n_threads may follow the machine's load: one and two threads give identical tensors."""
    for n in (1, 2):
        (tmp_path / f"t{n}.toml").write_text(f'preset = "llama.cpp-batched"\n[run.llamacpp]\nn_threads = {n}\n')
    res = run_cli("run", tmp_path / "t1.toml", tmp_path / "t2.toml", "--json", "-")
    rep = _json(res)
    assert res.exit_code == 0, rep["verdict_line"]
    assert all(t["max_abs"] == 0 for lr in rep["layers"] for t in lr["tensors"].values())
    assert all(t["max_abs"] == 0 for t in rep["final"]["tensors"].values())


def test_hf_checkpoint_is_converted_and_agrees(run_cli, tmp_path):
    """hf:DIR runs in llama.cpp too (converted to an F32 GGUF with its tied embeddings)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         rope_theta=50000.0))
    model.save_pretrained(tmp_path / "hf")
    res = run_cli("run", "reference", "llama.cpp", "--model", f"hf:{tmp_path / 'hf'}", "--json", "-")
    rep = _json(res)
    assert res.exit_code == 0, rep["verdict_line"]
    assert rep["policy"]["name"] == "float32" and len(rep["layers"]) == 2


# -- decode: one llama_decode per response token ------------------------------------------------------------

def test_decode_calls_put_each_decoded_token_alone():
    stream = [(0, 5, 0), (0, 6, 1), (0, 7, 2), (0, 8, 3), (1, 9, 0), (1, 10, 1), (1, 11, 2)]
    assert lce.decode_calls(stream, 2048, {0: 2, 1: 2}) == [0, 2, 3, 4, 6]
    assert lce.decode_calls(stream, 2, {}) == [0, 2, 4, 6]


@pytest.mark.parametrize("batching", ["unbatched", "packed"])
def test_llama_cpp_decode_passes_against_one_prefill_at_every_response_position(batching, run_cli, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'preset = "llama.cpp-decode"\n[run]\nbatching = "{batching}"\n')
    res = run_cli("run", "reference", cfg, "--response-ids", "31,32,33,34", "--json", tmp_path / "r.json",
                  "--out", tmp_path)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert res.exit_code == 0 and rep["verdict"] == "pass", res.output
    assert rep["logprobs"]["tokens"] == 12 and rep["final"]["tensors"]["response_logits"]["compared"] > 0
    with Trace(tmp_path / "cand.h5") as t:
        for s in range(3):
            dec = t.rows["step"][s] >= 0
            assert t.rows["step"][s][dec].tolist() == [0, 1, 2, 3]
            assert (t.rows["cache_len"][s][dec] == t.lengths[s] - 3 + np.arange(4)).all()


def test_llama_cpp_decode_of_a_text_response_on_smollm2(run_cli, tmp_path):
    """The GGUF's own llama.cpp, one prefill against its decode: the same tokens, the same cache."""
    res = run_cli("run", "llama.cpp", "llama.cpp-decode", "--model", "smollm2", "--response", " Paris, the city.",
                  "--json", tmp_path / "r.json")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert res.exit_code == 0 and rep["verdict"] == "pass", res.output
    assert rep["logprobs"]["tokens"] > 3 and rep["logprobs"]["pearson_p"] > 0.99
