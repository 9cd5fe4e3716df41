"""The converted-model cache (engine/model_cache.py): a cached model is bit-identical to a freshly converted one,
a damaged entry is reported and rebuilt, never used; the cache can be moved or turned off; a directory that is
not ours is refused and left as it was."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from prefill_diff.dumps.reader import Trace
from prefill_diff.engine import model_cache
from prefill_diff.engine.errors import ConfigError
from prefill_diff.engine.digest import digest_tensors
from prefill_diff.engine.snapshot import Snapshot
from prefill_diff.engine.sources import load_source
from prefill_diff.engine.spec import ModelSpec

sys.path.insert(0, str(Path(__file__).parent / "bench"))
from bench_model_cache import TINY as ARGS, write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A small llama GGUF (F32, tied embeddings) with SmolLM2's tokenizer metadata, so the loader builds a
    tokenizer from it as it does for real files."""
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(path)
    return path


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv(model_cache.ENV, str(d))
    return d


def _load(path):
    return load_source(ModelSpec(f"gguf:{path}"))  # not load_snapshot: that keeps one model per process


def _entries(cache_dir):
    return sorted(p.name for p in (cache_dir / "models").iterdir())


def _assert_same_snapshot(a, b):
    assert a.source == b.source and a.args == b.args
    assert set(a.state) == set(b.state)
    for k in a.state:
        assert a.state[k].dtype == b.state[k].dtype and torch.equal(a.state[k], b.state[k]), k
    assert a.weights_digest == b.weights_digest == digest_tensors(b.state)
    assert b.state["output.weight"] is b.state["tok_embeddings.weight"]  # tied, as the loader ties them
    text = "The capital of France is"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text) == [504, 3575, 282, 4649, 314]
    assert (a.tokenizer.vocab_size, a.tokenizer.pad_id) == (b.tokenizer.vocab_size, b.tokenizer.pad_id)
    assert a.tokenizer.decode([504, 3575]) == b.tokenizer.decode([504, 3575])


def test_cached_snapshot_is_bit_identical_to_a_fresh_conversion(tiny_gguf, cache_dir, monkeypatch, capsys):
    monkeypatch.setenv(model_cache.ENV, "off")
    fresh = _load(tiny_gguf)
    monkeypatch.setenv(model_cache.ENV, str(cache_dir))
    stored = _load(tiny_gguf)  # converts, stores
    digest = model_cache.file_sha256(tiny_gguf)
    assert _entries(cache_dir) == [f"{digest}-native"]
    entry = cache_dir / "models" / f"{digest}-native"
    assert {"manifest.json", "weights.safetensors", "tokenizer.json"} <= set(os.listdir(entry))
    calls = []
    monkeypatch.setattr("prefill_diff.engine.gguf_loader.load_gguf", lambda *a: calls.append(a))
    cached = _load(tiny_gguf)  # from the cache: the GGUF loader is not called
    assert calls == []
    _assert_same_snapshot(fresh, stored)
    _assert_same_snapshot(fresh, cached)
    assert capsys.readouterr().err == ""  # a sound entry is used silently


def test_transformers_model_from_the_cache_is_transformers_own_conversion(tiny_gguf, cache_dir, monkeypatch):
    """The transformers engine's entry holds what transformers' GGUF loader built, and loads back bit-identical."""
    from prefill_diff.engine.hf_engine import build_model
    snap = Snapshot(f"gguf:{tiny_gguf}", ARGS, {})
    monkeypatch.setenv(model_cache.ENV, "off")
    fresh = build_model(snap, "float32", "eager")
    monkeypatch.setenv(model_cache.ENV, str(cache_dir))
    build_model(snap, "float32", "eager")  # stores
    assert _entries(cache_dir) == [f"{model_cache.file_sha256(tiny_gguf)}-transformers"]
    cached = build_model(snap, "float32", "eager")
    a, b = fresh.state_dict(), cached.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ignore = ("quantization_config", "_name_or_path")  # the entry's weights are already dequantised
    assert {k: v for k, v in cached.config.to_diff_dict().items() if k not in ignore} == \
        {k: v for k, v in fresh.config.to_diff_dict().items() if k not in ignore}
    ids = torch.tensor([[504, 3575, 282, 4649, 314]])
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, cached(input_ids=ids).logits)
    bf16 = build_model(snap, "bfloat16", "eager")  # from the float32 entry, cast as transformers casts the GGUF
    monkeypatch.setenv(model_cache.ENV, "off")
    bf16_fresh = build_model(snap, "bfloat16", "eager")
    for k, v in bf16_fresh.state_dict().items():
        assert torch.equal(v, bf16.state_dict()[k]), k


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "extra file", "missing file", "manifest edited",
                                    "file is a link", "stale versions"])
def test_a_damaged_entry_is_reported_and_rebuilt_never_used(damage, tiny_gguf, cache_dir, tmp_path, capsys):
    good = _load(tiny_gguf)
    entry = cache_dir / "models" / f"{model_cache.file_sha256(tiny_gguf)}-native"
    weights = entry / "weights.safetensors"
    outside = tmp_path / "outside.safetensors"
    if damage == "flipped byte":
        _flip_a_byte(weights)
    elif damage == "truncated":
        os.truncate(weights, os.path.getsize(weights) - 4)
    elif damage == "extra file":
        (entry / "notes.txt").write_text("x")
    elif damage == "missing file":
        (entry / "tokenizer.json").unlink()
    elif damage == "manifest edited":
        m = json.loads((entry / "manifest.json").read_text())
        m["body"]["meta"]["weights_digest"] = "sha256:" + "0" * 64
        (entry / "manifest.json").write_text(json.dumps(m))
    elif damage == "file is a link":  # same bytes, but a link out of the cache is never followed
        os.replace(weights, outside)
        os.symlink(outside, weights)
    elif damage == "stale versions":
        m = json.loads((entry / "manifest.json").read_text())
        m["body"]["versions"]["gguf"] = "0.0.1"
        m["sha256"] = model_cache._body_sha256(m["body"])
        (entry / "manifest.json").write_text(json.dumps(m))
    capsys.readouterr()
    again = _load(tiny_gguf)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(entry) in err[0] and err[0].endswith("rebuilding it"), err
    assert ("is stale" if damage == "stale versions" else "is damaged") in err[0]
    _assert_same_snapshot(good, again)
    assert _entries(cache_dir) == [entry.name]  # rebuilt, nothing left aside
    model_cache._verify(str(entry), model_cache.file_sha256(tiny_gguf))  # the new entry is sound
    _load(tiny_gguf)
    assert capsys.readouterr().err == ""
    if damage == "file is a link":
        assert outside.exists()  # the link was removed, not what it pointed at


def test_an_entry_that_is_a_link_out_of_the_cache_is_removed_not_followed(tiny_gguf, cache_dir, tmp_path, capsys):
    _load(tiny_gguf)
    entry = cache_dir / "models" / f"{model_cache.file_sha256(tiny_gguf)}-native"
    elsewhere = tmp_path / "elsewhere"
    os.replace(entry, elsewhere)
    os.symlink(elsewhere, entry)
    capsys.readouterr()
    _load(tiny_gguf)
    assert "is damaged (not a directory)" in capsys.readouterr().err
    assert not entry.is_symlink() and entry.is_dir()
    assert (elsewhere / "weights.safetensors").exists()  # untouched


def test_off_disables_the_cache(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(model_cache.ENV, "off")
    assert model_cache.root() is None
    _load(tiny_gguf)
    assert not (tmp_path / "xdg").exists()


def test_the_default_place_and_the_environment_variable(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.delenv(model_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache.root() == str(tmp_path / "xdg" / "prefill-diff")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache.root() == str(tmp_path / "home" / ".cache" / "prefill-diff")
    monkeypatch.setenv(model_cache.ENV, str(tmp_path / "moved"))
    _load(tiny_gguf)
    assert (tmp_path / "moved" / model_cache.MARKER).is_file()
    assert len(_entries(tmp_path / "moved")) == 1 and not (tmp_path / "home").exists()


def _copy(path, tmp_path, name):
    """The GGUF under another name: a model source the CLI's process has not loaded yet (it keeps one)."""
    shutil.copyfile(path, tmp_path / name)
    return f"gguf:{tmp_path / name}"


def test_the_model_cache_option_moves_it_and_turns_it_off(tiny_gguf, tmp_path, monkeypatch, run_cli):
    monkeypatch.setenv(model_cache.ENV, str(tmp_path / "env"))  # the option wins over the variable
    res = run_cli("record", "reference", "--model", _copy(tiny_gguf, tmp_path, "a.gguf"), "--tokens", "5,6,7",
                  "-o", tmp_path / "a.h5", "--model-cache", tmp_path / "opt")
    assert res.exit_code == 0, res.output
    assert len(_entries(tmp_path / "opt")) == 1 and not (tmp_path / "env").exists()
    res = run_cli("record", "reference", "--model", _copy(tiny_gguf, tmp_path, "b.gguf"), "--tokens", "5,6,7",
                  "-o", tmp_path / "b.h5", "--model-cache", "off")
    assert res.exit_code == 0, res.output
    assert os.environ[model_cache.ENV] == "off" and not (tmp_path / "env").exists()


def test_a_directory_that_is_not_ours_is_refused_and_left_alone(tiny_gguf, tmp_path, monkeypatch, run_cli):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"\xff\xd8 not ours")
    (foreign / "models").mkdir()
    monkeypatch.setenv(model_cache.ENV, str(foreign))
    with pytest.raises(ConfigError, match="is not a prefill-diff cache"):
        _load(tiny_gguf)
    res = run_cli("record", "reference", "--model", _copy(tiny_gguf, tmp_path, "c.gguf"), "--tokens", "5,6,7",
                  "-o", tmp_path / "a.h5", "--model-cache", foreign)
    assert res.exit_code == 2 and "is not a prefill-diff cache" in res.output
    assert not (tmp_path / "a.h5").exists()
    assert sorted(p.name for p in foreign.iterdir()) == ["holiday.jpg", "models"]
    assert list((foreign / "models").iterdir()) == []


def test_a_losing_concurrent_writer_keeps_the_winners_entry(tiny_gguf, cache_dir):
    """Two runs that convert at once: the second rename fails on the first one's entry; its copy is discarded."""
    snap = _load(tiny_gguf)
    models = str(cache_dir / "models")
    digest = model_cache.file_sha256(tiny_gguf)
    name = f"{digest}-native"
    before = (cache_dir / "models" / name / "manifest.json").read_bytes()
    model_cache._store(models, name, digest, 1, lambda d: model_cache.save_snapshot(snap, d))
    assert _entries(cache_dir) == [name]  # no temporary directory left behind
    assert (cache_dir / "models" / name / "manifest.json").read_bytes() == before
    model_cache._verify(os.path.join(models, name), digest)


def _datasets(path) -> dict:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    with Trace(str(path)) as t:
        return out, t.model


def test_smollm2_traces_are_identical_with_and_without_the_cache(tmp_path):
    """The first run converts (the uncached path) and stores; the second, a new process, loads both engines
    from the cache: every recorded tensor, and the model identity with its weights digest, are the same."""
    env = {**os.environ, model_cache.ENV: str(tmp_path / "cache")}
    for run in ("first", "second"):
        res = subprocess.run([sys.executable, "-m", "prefill_diff.cli.main", "run", "reference", "transformers",
                              "--model", "smollm2", "--prompt", "The capital of France is", "--out", tmp_path / run,
                              "-q"], env=env, capture_output=True, text=True)
        assert res.returncode == 0 and res.stderr == "", res.stdout + res.stderr
    assert sorted(e.rsplit("-", 1)[1] for e in _entries(tmp_path / "cache")) == ["native", "transformers"]
    for side in ("ref.h5", "cand.h5"):
        (a, ma), (b, mb) = _datasets(tmp_path / "first" / side), _datasets(tmp_path / "second" / side)
        assert set(a) == set(b) and len(a) > 100
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k], equal_nan=True), (side, k)
        assert ma == mb and ma["weights_digest"].startswith("sha256:")


# -- the locks that let `prefill-diff cache prune` leave running conversions and loading runs alone


def _save_bytes(value, directory):
    with open(os.path.join(directory, "weights.bin"), "wb") as f:
        f.write(value)
    return {"n": len(value)}


def _load_bytes(entry):
    with open(os.path.join(entry.dir, "weights.bin"), "rb") as f:
        return f.read()


def _entry(tmp_path, name, kind="native", n=200_000):
    """A cache entry of ``n`` bytes converted from a small file ``name``, as a run stores it; returns its path."""
    src = tmp_path / name
    src.write_bytes(name.encode() * 10)
    model_cache.cached(str(src), kind, lambda: os.urandom(n), _save_bytes, _load_bytes)
    return Path(model_cache.root()) / "models" / f"{model_cache.file_sha256(src)}-{kind}"

def _age(path, days):
    t = os.lstat(path).st_mtime - days * 86400
    os.utime(path, (t, t), follow_symlinks=False)


def test_an_entry_records_its_source_and_a_use_marks_it_used(cache_dir, tmp_path):
    entry = _entry(tmp_path, "a.gguf")
    assert json.loads((entry / "manifest.json").read_text())["body"]["source"] == str(tmp_path / "a.gguf")
    _age(entry, 5)
    assert model_cache.cached(str(tmp_path / "a.gguf"), "native", lambda: 1 / 0, _save_bytes, _load_bytes)
    assert abs(os.path.getmtime(entry) - time.time()) < 60


@pytest.mark.parametrize("meanwhile", ["removed", "replaced"])
def test_a_run_whose_entry_was_pruned_while_it_waited_converts_it_again(meanwhile, cache_dir, tmp_path):
    """A run waits while a prune removes the entry it wants, then converts: it never loads an entry it holds no
    lock on (one another run stored meanwhile could be pruned under it)."""
    import fcntl
    import threading
    entry = _entry(tmp_path, "a.gguf", n=1000)
    fd = os.open(entry / "manifest.json", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a prune is removing the entry
    got = []
    run = threading.Thread(target=lambda: got.append(model_cache.cached(
        str(tmp_path / "a.gguf"), "native", lambda: b"fresh", _save_bytes, _load_bytes)))
    run.start()
    run.join(0.5)
    assert run.is_alive()  # the run waits for the prune
    models, digest = str(cache_dir / "models"), entry.name.split("-")[0]
    model_cache._delete(models, str(entry))
    if meanwhile == "replaced":  # another run stored the entry again
        model_cache._store(models, entry.name, digest, 1, lambda d: _save_bytes(b"other", d))
    os.close(fd)
    run.join(10)
    assert got == [b"fresh"]  # converted again
    assert (entry / "weights.bin").read_bytes() == (b"fresh" if meanwhile == "removed" else b"other")


def test_a_writer_whose_new_lock_file_was_taken_by_a_prune_makes_another(cache_dir, tmp_path, monkeypatch):
    import fcntl
    real, calls = fcntl.flock, []

    def pruned_first(fd, op):  # a prune locked and removed the lock file between its creation and our lock
        if not calls:
            os.unlink(os.readlink(f"/proc/self/fd/{fd}"))
        calls.append(op)
        return real(fd, op)
    monkeypatch.setattr(model_cache.fcntl, "flock", pruned_first)
    models = str(cache_dir / "models")
    os.makedirs(models)
    tmp, fd = model_cache._new_lock(models)
    try:
        assert len(calls) == 2 and os.path.exists(tmp + model_cache.LOCK_SUFFIX)
        assert os.listdir(models) == [os.path.basename(tmp) + model_cache.LOCK_SUFFIX]
    finally:
        os.close(fd)
