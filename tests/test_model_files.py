"""Model files from strangers, full disks and memory limits: exit status 2 with the reason, never a crash.

Each case is a reproduction from the hostile battery (the model-files issue): a malformed config.json, a lying
safetensors header, GGUF metadata of the wrong type or range, a model too large for the memory or the address
space left, a full file system, an output name too long, a deleted working directory, argv in a C locale, two
runs into one --out, someone else's cache entry, a tensor-parallel rank killed or its port taken.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

PD = [sys.executable, "-m", "prefill_diff.cli.main"]


# -- models to break -------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """A tiny Llama checkpoint as transformers saves it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=128, tie_word_embeddings=False))
    d = tmp_path_factory.mktemp("hf") / "model"
    model.save_pretrained(d, safe_serialization=True)
    return d


def _copy(hf_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    return d


def _record(run_cli, model: str, tmp_path, *extra):
    return run_cli("record", "reference", "--model", model, "--tokens", "1,2,3", "-o", tmp_path / "x.h5", "--force",
                   *extra)


def _refused(res, *words):
    """Exit status 2, one line, no traceback, naming ``words``."""
    text = res.output.strip()
    assert res.exit_code == 2, (res.exit_code, text)
    assert "Traceback" not in text and "internal error" not in text, text
    for w in words:
        assert w in text, (w, text)


def _config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg, allow_nan=True))


# -- config.json ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, words", [
    ("[1, 2]", ("must hold a JSON object", "list")),
    ("null", ("must hold a JSON object",)),
    ('"x"', ("must hold a JSON object", "str")),
    ('{"hidden_size": NaN}', ("NaN is not a JSON number",)),
    ('{"a": ' * 100000 + "1" + "}" * 100000, ("not valid JSON",)),
])
def test_a_config_that_is_not_an_object_of_json_numbers_is_refused(hf_dir, tmp_path, run_cli, body, words):
    d = _copy(hf_dir, tmp_path)
    (d / "config.json").write_text(body)
    _refused(_record(run_cli, f"hf:{d}", tmp_path), *words)


@pytest.mark.parametrize("field, value, words", [
    ("architectures", 5, ("architectures=5", "a list of class names")),
    ("architectures", [["x"]], ("architectures=[[", "a list of class names")),
    ("max_position_embeddings", float("nan"), ("NaN is not a JSON number",)),
    ("max_position_embeddings", float("inf"), ("Infinity is not a JSON number",)),
    ("max_position_embeddings", "lots", ("max_position_embeddings='lots'", "a positive integer")),
    ("rms_norm_eps", "tiny", ("rms_norm_eps='tiny'", "a positive finite number")),
    ("rope_theta", "x", ("rope_theta='x'", "a positive finite number")),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "x"}, ("rope_theta as a positive finite number",)),
    ("rope_parameters", {"rope_type": "default", "rope_theta": {}}, ("rope_theta as a positive finite number",)),
    ("rope_parameters", {"rope_type": "linear", "factor": "two", "rope_theta": 1e4}, ("factor as a positive",)),
    ("rope_scaling", {"rope_type": "linear", "factor": "two"}, ("factor as a positive finite number",)),
    ("num_attention_heads", 0, ("num_attention_heads=0", "a positive integer")),
    ("num_hidden_layers", True, ("num_hidden_layers=true",)),
    ("tie_word_embeddings", "yes", ("tie_word_embeddings='yes'", "true or false")),
])
def test_each_config_field_of_the_wrong_type_or_range_is_named(hf_dir, tmp_path, run_cli, field, value, words):
    d = _copy(hf_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    if field == "rope_theta":
        cfg.pop("rope_parameters")
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg, allow_nan=True))
    _refused(_record(run_cli, f"hf:{d}", tmp_path), *words)


@pytest.mark.parametrize("field, value", [("hidden_size", 2 ** 40), ("vocab_size", 2 ** 62),
                                          ("num_hidden_layers", 100_000_000)])
def test_a_memory_bomb_in_config_json_is_refused_from_the_config_alone(hf_dir, tmp_path, run_cli, field, value):
    """Estimated before a weight is read: no allocation, no minutes of building (it took 37 s or more)."""
    d = _copy(hf_dir, tmp_path)
    _config(d, **{field: value})
    _refused(_record(run_cli, f"hf:{d}", tmp_path), "needs about", "refused before allocating")


# -- safetensors ------------------------------------------------------------------------------------------

def _safetensors(d):
    raw = (d / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_st(path, header, data, length=None):
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)


def _edit(key, value):
    def edit(h, t0, t1):
        h[t0][key] = value(h, t0, t1) if callable(value) else value
    return edit


ST_CASES = {
    "huge header length": (None, 2 ** 60, "header length"),
    "header past the end": (None, "past", "is more than the file's"),
    "not JSON": (b"{not json", None, "not UTF-8 JSON"),
    "not UTF-8": (b'{"a": "\xff"}', None, "not UTF-8 JSON"),
    "overlapping": (_edit("data_offsets", lambda h, t0, t1: h[t1]["data_offsets"]), None, "overlap"),
    "reversed": (_edit("data_offsets", lambda h, t0, t1: h[t0]["data_offsets"][::-1]), None, "running backwards"),
    "out of range": (_edit("data_offsets", [10 ** 9, 10 ** 9 + 4]), None, "outside the file's"),
    "shape and bytes disagree": (_edit("shape", [1]), None, "its data_offsets span"),
    "unknown dtype": (_edit("dtype", "F99"), None, "dtype 'F99'"),
    "negative shape": (_edit("shape", [-1, 4]), None, "non-negative integers"),
    "huge shape": (_edit("shape", [2 ** 62, 2 ** 62]), None, "its data_offsets span"),
}


@pytest.mark.parametrize("case", sorted(ST_CASES))
def test_a_lying_safetensors_header_is_refused_before_any_tensor_is_read(hf_dir, tmp_path, run_cli, case):
    d = _copy(hf_dir, tmp_path)
    header, data = _safetensors(d)
    edit, length, words = ST_CASES[case]
    t0, t1 = [k for k in header if k != "__metadata__"][:2]
    if callable(edit):
        edit(header, t0, t1)
        body = header
    else:
        body = edit if edit is not None else header
    if length == "past":
        length = len(json.dumps(header).encode()) + len(data) + 1
    _write_st(d / "model.safetensors", body, data, length)
    _refused(_record(run_cli, f"hf:{d}", tmp_path), "model.safetensors", words)


def test_a_truncated_or_empty_safetensors_file_is_refused(hf_dir, tmp_path, run_cli):
    d = _copy(hf_dir, tmp_path)
    st = d / "model.safetensors"
    raw = st.read_bytes()
    st.write_bytes(raw[:-100])
    _refused(_record(run_cli, f"hf:{d}", tmp_path), "outside the file's")
    st.write_bytes(b"")
    _refused(_record(run_cli, f"hf:{d}", tmp_path), "too short for a safetensors file")


@pytest.mark.parametrize("kind", ["fifo", "directory", "link to a directory"])
def test_a_weight_file_that_is_not_a_regular_file_is_refused_without_blocking(hf_dir, tmp_path, run_cli, kind):
    """A FIFO named model.safetensors used to hang the tool; a directory ended in 'No such device'."""
    d = _copy(hf_dir, tmp_path)
    st = d / "model.safetensors"
    if kind == "fifo":
        st.unlink()
        os.mkfifo(st)
    elif kind == "directory":
        (d / "x.safetensors").mkdir()
    else:
        st.unlink()
        st.symlink_to(d)
    _refused(_record(run_cli, f"hf:{d}", tmp_path), "is not a regular file")


def test_two_shards_defining_one_tensor_are_refused(hf_dir, tmp_path, run_cli):
    """Which one the model held depended on the order of reading: the last silently won."""
    d = _copy(hf_dir, tmp_path)
    shutil.copy(d / "model.safetensors", d / "model-2.safetensors")
    _refused(_record(run_cli, f"hf:{d}", tmp_path), "is defined twice", "model-2.safetensors", "model.safetensors")


# -- GGUF metadata ---------------------------------------------------------------------------------------

def write_gguf(path, meta: dict | None = None):
    """A two-layer Llama GGUF with SmolLM2's tokenizer metadata; ``meta``: key -> (value, GGUFValueType) replacing
    or adding metadata."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    from prefill_diff.engine.models.gguf_loader import smollm2_path
    T = gguf.GGUFValueType
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=128, tie_word_embeddings=True))
    values = {"llama.block_count": (2, T.UINT32), "llama.context_length": (128, T.UINT32),
              "llama.embedding_length": (32, T.UINT32), "llama.feed_forward_length": (64, T.UINT32),
              "llama.attention.head_count": (2, T.UINT32), "llama.attention.head_count_kv": (1, T.UINT32),
              "llama.rope.freq_base": (10000.0, T.FLOAT32), "llama.attention.layer_norm_rms_epsilon": (1e-6, T.FLOAT32),
              "llama.vocab_size": (49152, T.UINT32), **(meta or {})}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (value, kind) in values.items():
        if kind == T.ARRAY:
            w.add_key_value(key, value, kind, sub_type=T.UINT32)
        else:
            w.add_key_value(key, value, kind)
    for name, f in gguf.GGUFReader(smollm2_path()).fields.items():
        if name.startswith("tokenizer."):
            if f.types[0] == T.ARRAY:
                w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1])
            else:
                w.add_key_value(name, f.contents(), f.types[0])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for k, v in model.state_dict().items():
        v = v.detach().numpy().astype(np.float32)
        if k == "lm_head.weight":
            continue
        if k in ("model.embed_tokens.weight", "model.norm.weight"):
            w.add_tensor("token_embd.weight" if "embed" in k else "output_norm.weight", v)
            continue
        _, _, i, *rest = k.split(".")
        w.add_tensor(f"blk.{i}.{names['.'.join(rest[:-1])]}.{rest[-1]}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_cases():
    import gguf
    T = gguf.GGUFValueType
    return {
        "block_count as a string": ({"llama.block_count": ("two", T.STRING)}, "llama.block_count='two'"),
        "block_count as an array": ({"llama.block_count": ([2, 2], T.ARRAY)}, "llama.block_count=an array"),
        "head_count 0": ({"llama.attention.head_count": (0, T.UINT32)}, "llama.attention.head_count=0"),
        "epsilon as a string": ({"llama.attention.layer_norm_rms_epsilon": ("tiny", T.STRING)}, "epsilon='tiny'"),
        "epsilon NaN": ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), T.FLOAT32)}, "epsilon=nan"),
        "vocab_size 2**63": ({"llama.vocab_size": (2 ** 63, T.UINT64)}, "llama.vocab_size=9223372036854775808"),
        "negative embedding_length": ({"llama.embedding_length": (-16, T.INT32)}, "llama.embedding_length=-16"),
        "block_count 1e8": ({"llama.block_count": (100_000_000, T.UINT32)}, "refused before allocating"),
        "a 1 MB key": ({"llama." + "k" * (1 << 20): (1, T.UINT32)}, "is not one our engine implements"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", ["block_count as a string", "block_count as an array", "head_count 0",
                                  "epsilon as a string", "epsilon NaN", "vocab_size 2**63",
                                  "negative embedding_length", "block_count 1e8", "a 1 MB key"])
def test_gguf_metadata_of_the_wrong_type_or_range_is_named(tmp_path, run_cli, case):
    meta, words = _gguf_cases()[case]
    path = write_gguf(tmp_path / "m.gguf", meta)
    res = _record(run_cli, f"gguf:{path}", tmp_path)
    _refused(res, words)
    assert len(res.output) < 1000  # a 1 MB key name is shortened, not printed whole


@pytest.mark.slow
def test_the_valid_gguf_the_cases_start_from_records(tmp_path, run_cli):
    """The mutations above change one value of a file that is otherwise accepted."""
    path = write_gguf(tmp_path / "m.gguf")
    res = _record(run_cli, f"gguf:{path}", tmp_path)
    assert res.exit_code == 0, res.output


# -- memory limits ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_an_address_space_limit_is_an_estimate_refusal_not_an_allocator_crash(tmp_path):
    """Under an address-space limit (prlimit --as) the estimate compares with the address space still free (the
    limit less VmSize): exit 2 before allocating, where torch's DefaultCPUAllocator used to end it with exit 3."""
    import resource
    tokens = ",".join(str(i % 90 + 1) for i in range(6000))
    cmd = [*PD, "record", "reference", "--tokens", tokens, "-o", str(tmp_path / "x.h5")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120,  # as `prlimit --as=2GiB` sets it
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)))
    assert res.returncode == 2, res.stderr
    assert "address-space limit (RLIMIT_AS)" in res.stderr and "refused before allocating" in res.stderr
    assert not (tmp_path / "x.h5").exists()


def test_an_allocation_torch_refuses_anyway_is_exit_2_with_its_size(tmp_path, run_cli, hf_dir, monkeypatch):
    """With the estimate turned off, the allocator's own refusal is still the environment's, not a bug. (A config
    whose sizes imply a huge tensor is refused before anything is allocated, by its tensors' shapes: the
    allocator's words are made to come from loading the model.)"""
    from prefill_diff.engine import prepared

    def refuse(spec):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you "
                           "tried to allocate 36893488147419103232 bytes.")
    monkeypatch.setattr(prepared, "load_snapshot", refuse)
    d = _copy(hf_dir, tmp_path)
    res = _record(run_cli, f"hf:{d}", tmp_path, "--ignore-memory-estimate")
    _refused(res, "not enough memory")
    assert "36893488147419103232 bytes" in res.output


def test_a_config_implying_a_huge_tensor_is_refused_by_its_shapes_before_allocating(tmp_path, run_cli, hf_dir):
    d = _copy(hf_dir, tmp_path)
    _config(d, vocab_size=2 ** 62)
    res = _record(run_cli, f"hf:{d}", tmp_path, "--ignore-memory-estimate")
    _refused(res, "the config implies (4611686018427387904, 32)")


# -- full disks -------------------------------------------------------------------------------------------

@pytest.fixture
def small_fs(tmp_path):
    """run(script, size): ``script`` (sh) with a tmpfs of ``size`` mounted at $SMALL, inside a user and mount
    namespace (no root needed); skipped, saying so, where the kernel refuses unprivileged namespaces."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"this kernel refuses an unprivileged mount namespace ({probe.stderr.strip()}): no small file "
                    "system to fill")
    where = tmp_path / "small"
    where.mkdir()

    def run(script: str, size: str = "300k") -> subprocess.CompletedProcess:
        body = f'SMALL={where} && mount -t tmpfs -o size={size} tmpfs "$SMALL" && export SMALL && {script}'
        return subprocess.run(["unshare", "-rm", "sh", "-c", body], capture_output=True, text=True, timeout=300)
    return run


def _pd(*args) -> str:
    return " ".join([sys.executable, "-m", "prefill_diff.cli.main", *args])


@pytest.mark.slow
def test_a_full_disk_is_said_before_the_trace_is_started_never_a_segfault(small_fs):
    """HDF5 crashed the process (SIGSEGV) after a failed write: the space is checked from the trace's sizes."""
    res = small_fs(_pd("record", "reference", "-o", '"$SMALL/x.h5"') + '; echo "exit=$?"; ls -A "$SMALL"')
    assert "exit=2" in res.stdout, res.stdout + res.stderr
    assert "not enough space for the trace" in res.stderr and "MiB free" in res.stderr, res.stderr
    assert res.stdout.strip().endswith("exit=2")  # nothing left in the file system: no partial file


@pytest.mark.slow
def test_a_full_tmpdir_under_run_and_a_full_report_disk_are_exit_2_leaving_nothing(small_fs):
    res = small_fs("TMPDIR=$SMALL " + _pd("run", "reference", "batched-left") + '; echo "exit=$?"')
    assert "exit=2" in res.stdout and "not enough space for the trace" in res.stderr, res.stdout + res.stderr
    res = small_fs(_pd("run", "reference", "batched-left", "-q", "--json", '"$SMALL/r.json"') +
                    '; echo "exit=$?"; ls -A "$SMALL"', size="12k")
    assert "exit=2" in res.stdout and "cannot write" in res.stderr and "No space left" in res.stderr, res.stderr
    assert res.stdout.strip().endswith("exit=2")  # no truncated report left behind


@pytest.mark.slow
def test_a_full_model_cache_runs_without_the_cache(tmp_path, small_fs):
    path = write_gguf(tmp_path / "m.gguf")
    res = small_fs("PREFILL_DIFF_CACHE=$SMALL/c " + _pd("record", "reference", "--model", f"gguf:{path}",
                                                         "--tokens", "1,2,3", "-o", str(tmp_path / "x.h5")) +
                    '; echo "exit=$?"; ls -A "$SMALL/c/models"', size="200k")
    assert "exit=0" in res.stdout and "running without it" in res.stderr, res.stdout + res.stderr
    assert res.stdout.strip().endswith("exit=0")  # no half-written entry


@pytest.mark.slow
def test_stdout_on_a_full_device_is_exit_2():
    res = subprocess.run(" ".join(PD + ["presets"]) + " > /dev/full", shell=True, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "No space left on device" in res.stderr, res.stderr
    assert "internal error" not in res.stderr


# -- paths and environment ---------------------------------------------------------------------------------

def test_an_output_name_too_long_is_refused_before_any_work(tmp_path, run_cli):
    res = run_cli("record", "reference", "-o", tmp_path / ("a" * 256))
    _refused(res, "its file name is 256 bytes", "more than the 255")
    res = run_cli("run", "reference", "batched-left", "--json", tmp_path / ("j" * 256))
    _refused(res, "--json", "its file name is 256 bytes")


@pytest.mark.slow
def test_a_legal_name_whose_temporary_sibling_would_be_too_long_is_written(tmp_path, run_cli):
    out = tmp_path / ("b" * 240)
    assert run_cli("record", "reference", "-o", out).exit_code == 0
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == [out.name]
    out = tmp_path / ("c" * 250)
    res = run_cli("record", "tp2", "-o", out)
    assert res.exit_code == 0 and out.is_dir(), res.output


def test_a_deleted_working_directory_is_one_line(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    res = subprocess.run(f"cd {gone} && rmdir {gone} && {' '.join(PD)} presets", shell=True, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "working directory no longer exists" in res.stderr, res.stderr
    assert "FATAL" not in res.stderr


@pytest.mark.slow
def test_utf8_argv_under_a_c_locale_is_read_as_the_bytes_given(tmp_path):
    """LC_ALL=C without UTF-8 mode: Python decodes argv as ASCII with surrogate escapes; the bytes are UTF-8."""
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    out = tmp_path / "x.h5"
    cmd = PD + ["record", "reference", "--model", "smollm2", "--prompt", "héllo wörld", "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    from prefill_diff.dumps.reader import Trace
    with Trace(out) as t:
        assert t.meta["side"]["inputs"]["prompts"] == ["héllo wörld"] and t.meta["texts"] == ["héllo wörld"]
    bad = subprocess.run(PD + ["record", "reference", "--model", "smollm2", "--prompt", b"h\xffllo", "-o", str(out),
                               "--force"], capture_output=True, env=env, timeout=300)
    assert bad.returncode == 2 and b"not valid UTF-8 text (byte 0xff at byte offset 1)" in bad.stderr, bad.stderr


def test_two_runs_into_one_out_directory_at_once_are_refused(tmp_path, run_cli):
    """They judged each other's traces: the second waits for nobody, it is refused while the first holds it."""
    from prefill_diff.jobs import OUT_LOCK
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / OUT_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a run in progress
        res = run_cli("run", "reference", "batched-left", "--out", out, "--force")
        _refused(res, "is being written by another prefill-diff run")
    finally:
        os.close(fd)
    assert run_cli("run", "reference", "batched-left", "--out", out, "--force").exit_code == 0


# -- engine options ------------------------------------------------------------------------------------------

def test_llamacpp_threads_beyond_ggml_are_refused(tmp_path, run_cli):
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "llama.cpp"\n[run.llamacpp]\nn_threads = 10000\n')
    _refused(run_cli("record", cfg, "-o", tmp_path / "x.h5"), "n_threads", "512", "10000")
    cfg.write_text('preset = "llama.cpp"\n[run.llamacpp]\nn_batch = 4294967296\n')
    _refused(run_cli("record", cfg, "-o", tmp_path / "x.h5"), "n_batch", "2147483647")


def test_vllm_kv_cache_space_joins_the_estimate(tmp_path, run_cli):
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "vllm"\n[run.vllm]\nkv_cache_mib = 900000\n')
    _refused(run_cli("record", cfg, "-o", tmp_path / "x.h5"), "kv_cache_mib = 900000", "refused before allocating")


# -- the converted-model cache ---------------------------------------------------------------------------

@pytest.mark.slow
def test_an_abandoned_conversion_is_reclaimed_and_a_running_one_is_not(tmp_path, run_cli, monkeypatch):
    import gguf

    from prefill_diff.engine.models import model_cache
    monkeypatch.setenv("PREFILL_DIFF_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf")
    assert _record(run_cli, f"gguf:{path}", tmp_path).exit_code == 0  # makes the cache
    models = tmp_path / "cache" / "models"
    dead, alive = models / ".tmp-dead", models / ".tmp-alive"
    for d in (dead, alive):
        d.mkdir()
        (d / "weights.safetensors").write_bytes(b"x" * 4096)
        (models / (d.name + model_cache.LOCK_SUFFIX)).touch()
    fd = os.open(models / (alive.name + model_cache.LOCK_SUFFIX), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a conversion still running in another process
        theta = {"llama.rope.freq_base": (5000.0, gguf.GGUFValueType.FLOAT32)}  # another file: a conversion
        other = write_gguf(tmp_path / "other.gguf", theta)
        assert _record(run_cli, f"gguf:{other}", tmp_path).exit_code == 0  # a conversion: it reclaims
        assert not dead.exists() and not (models / (dead.name + model_cache.LOCK_SUFFIX)).exists()
        assert alive.is_dir()
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_cache_entry_others_may_write_is_never_used(tmp_path, run_cli, monkeypatch):
    """Weights edited and the manifest recomputed by someone else: not trusted, converted afresh (said once)."""
    from prefill_diff.engine.models import sources
    monkeypatch.setenv("PREFILL_DIFF_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf")
    assert _record(run_cli, f"gguf:{path}", tmp_path).exit_code == 0
    entry = next(p for p in (tmp_path / "cache" / "models").iterdir() if not p.name.startswith("."))
    os.chmod(entry, 0o777)
    sources._CACHE.clear()  # the process keeps the last model loaded: the next run must look in the cache
    res = _record(run_cli, f"gguf:{path}", tmp_path)
    assert res.exit_code == 0 and res.output.count("writable by others") == 1, res.output
    os.chmod(entry, 0o700)
    from prefill_diff.engine.models import model_cache
    me = os.getuid()
    monkeypatch.setattr(model_cache.os, "getuid", lambda: me + 1)  # as another user sees our entry
    sources._CACHE.clear()
    res = _record(run_cli, f"gguf:{path}", tmp_path)
    assert res.exit_code == 0 and "not by you" in res.output, res.output


# -- tensor-parallel ranks -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_taken_rendezvous_port_is_one_line(tmp_path, run_cli, monkeypatch):
    import socket

    from prefill_diff.engine import parallel
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setattr(parallel, "free_port", lambda: s.getsockname()[1])
        res = run_cli("record", "tp2", "-o", tmp_path / "t")
    _refused(res, "could not open the rendezvous port", "run again")
    assert not (tmp_path / "t").exists() and not list(tmp_path.glob(".*"))


def test_a_rank_killed_by_a_signal_is_one_line(tmp_path):
    from torch.multiprocessing.spawn import ProcessExitedException

    from prefill_diff.jobs.sides import _raise_rank_error
    from prefill_diff.engine.shared.errors import PrefillDiffError
    exc = ProcessExitedException("process 1 terminated with signal SIGKILL", error_index=1, error_pid=99,
                                 exit_code=-9, signal_name="SIGKILL")
    with pytest.raises(PrefillDiffError, match="rank 1 was killed by SIGKILL"):
        _raise_rank_error(str(tmp_path), 2, exc)
