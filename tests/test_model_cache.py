"""The converted-model cache (engine/models/model_cache.py): a cached model is bit-identical to a freshly converted one,
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
from prefill_diff.engine.models import cache_entries, cache_listing, model_cache
from prefill_diff.engine.shared.errors import ConfigError
from prefill_diff.engine.models.digest import digest_tensors
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.sources import load_source
from prefill_diff.engine.models.spec import ModelSpec

sys.path.insert(0, str(Path(__file__).parent / "bench"))
from bench_model_cache import TINY as ARGS, write_tiny_gguf  # noqa: E402

pytestmark = pytest.mark.slow  # conversions of the SmolLM2 GGUF, cache entries across processes


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
    monkeypatch.setattr("prefill_diff.engine.models.gguf_loader.load_gguf", lambda *a: calls.append(a))
    cached = _load(tiny_gguf)  # from the cache: the GGUF loader is not called
    assert calls == []
    _assert_same_snapshot(fresh, stored)
    _assert_same_snapshot(fresh, cached)
    assert capsys.readouterr().err == ""  # a sound entry is used silently


def test_transformers_model_from_the_cache_is_transformers_own_conversion(tiny_gguf, cache_dir, monkeypatch):
    """The transformers engine's entry holds what transformers' GGUF loader built, and loads back bit-identical."""
    from prefill_diff.engine.foreign.hf_engine import build_model
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
    assert len(_entries(tmp_path / "opt")) == 1 and not (tmp_path / "env").exists()  # off: nothing stored
    model_cache.configure("off")  # the option sets the variable, so processes started from this one inherit it
    assert os.environ[model_cache.ENV] == "off"


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
    model_cache._store(models, name, digest, 1, lambda d: cache_entries.save_snapshot(snap, d))
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


# -- `prefill-diff cache`: listing and pruning, on entries made by cached() from small files (no real model)

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


def _restamp(entry, edit):
    """Edit an entry's manifest body and its sha256 to match, as another version of the code would write it."""
    m = json.loads((entry / "manifest.json").read_text())
    edit(m["body"])
    m["sha256"] = model_cache._body_sha256(m["body"])
    (entry / "manifest.json").write_text(json.dumps(m))


def _cache_json(run_cli, *args):
    res = run_cli("cache", "--json", *args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_cache_lists_each_entry_with_its_source_size_last_use_and_state(cache_dir, tmp_path, run_cli):
    good = _entry(tmp_path, "good.gguf", n=300_000)
    stale = _entry(tmp_path, "stale.gguf", kind="transformers")
    damaged = _entry(tmp_path, "damaged.gguf")
    _restamp(stale, lambda body: body["versions"].__setitem__("gguf", "0.0.1"))
    _flip_a_byte(damaged / "weights.bin")
    _age(good, 3)
    res = run_cli("cache")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    total = sum(_du(e) for e in (good, stale, damaged))  # bytes on disk, as du counts them
    assert lines[0] == f"model cache {cache_dir}: 3 items, {_human(total)}"
    table = lines[:next(i for i, line in enumerate(lines) if line.startswith("total"))]
    row = {line.split()[1]: line.split() for line in table if line.split()[:1] in (["native"], ["transformers"])}
    assert row["good.gguf"][0] == "native" and row["good.gguf"][2:] == [*_human(_du(good)).split(), "3", "days",
                                                                       "ago", "intact"]
    assert row["stale.gguf"][0] == "transformers" and row["stale.gguf"][-1] == "stale"
    assert row["damaged.gguf"][-1] == "damaged"
    assert any(line.split()[0] == "total" for line in lines)
    assert "transformers stale.gguf is stale (made by other code: gguf 0.0.1 -> " in res.output
    assert "native damaged.gguf is damaged (weights.bin: sha256 differs from its manifest)" in res.output
    out = _cache_json(run_cli)
    items = {Path(i["source"]).name: i for i in out["items"]}
    assert out["cache"] == str(cache_dir) and out["total"] == total == sum(i["size"] for i in out["items"])
    assert {k: v["state"] for k, v in items.items()} == {"good.gguf": "intact", "stale.gguf": "stale",
                                                          "damaged.gguf": "damaged"}
    assert items["good.gguf"]["source"] == str(tmp_path / "good.gguf") and items["good.gguf"]["kind"] == "native"
    assert items["good.gguf"]["size"] == _du(good) > 300_000 and items["good.gguf"]["paths"] == [str(good)]
    assert items["good.gguf"]["used"].endswith("Z") and items["good.gguf"]["owner"] is None
    assert sorted(os.listdir(cache_dir / "models")) == sorted([good.name, stale.name, damaged.name])  # untouched


def _du(path) -> int:
    return sum(os.lstat(os.path.join(d, n)).st_blocks * 512 for d, dirs, files in os.walk(path)
               for n in dirs + files) + os.lstat(path).st_blocks * 512


def _human(n):
    from prefill_diff.cli.render import human_size
    return human_size(n)


def test_an_entry_written_before_sources_were_recorded_still_verifies_and_lists_by_digest(cache_dir, tmp_path,
                                                                                         run_cli):
    entry = _entry(tmp_path, "old.gguf")
    assert json.loads((entry / "manifest.json").read_text())["body"]["source"] == str(tmp_path / "old.gguf")
    _restamp(entry, lambda body: body.pop("source"))
    assert model_cache.cached(str(tmp_path / "old.gguf"), "native", lambda: 1 / 0, _save_bytes, _load_bytes)
    res = run_cli("cache")
    digest = entry.name.split("-")[0]
    assert f"sha256 {digest[:12]}…" in res.output and "intact" in res.output, res.output
    assert _cache_json(run_cli)["items"][0]["source"] is None


def test_cache_when_off_or_not_made_yet_says_so_and_creates_nothing(tmp_path, monkeypatch, run_cli):
    res = run_cli("cache", "--model-cache", "off")
    assert res.exit_code == 0 and res.output.startswith("the model cache is off")
    res = run_cli("cache", "prune", "--model-cache", "off")
    assert res.exit_code == 0 and "nothing to prune" in res.output
    assert _cache_json(run_cli, "--model-cache", "off") == {"cache": None, "models": None, "total": 0, "items": []}
    assert _cache_json(run_cli, "prune", "--model-cache", "off") == {"cache": None, "dry_run": False, "freed": 0,
                                                                     "left": 0, "removed": [], "kept": []}
    for args in (("cache",), ("cache", "list"), ("cache", "prune"), ("cache", "prune", "--all")):
        res = run_cli(*args, "--model-cache", tmp_path / "new")
        assert res.exit_code == 0, res.output
    assert not (tmp_path / "new").exists()
    assert run_cli("cache", "list", "--model-cache", tmp_path / "new").output == \
        f"model cache {tmp_path / 'new'}: empty\n"


@pytest.mark.parametrize("args", [("cache",), ("cache", "list", "--json"), ("cache", "prune", "--all")])
def test_cache_refuses_a_directory_that_is_not_ours_and_leaves_it_alone(args, tmp_path, run_cli):
    foreign = tmp_path / "photos"
    (foreign / "models" / ("0" * 64 + "-native")).mkdir(parents=True)
    (foreign / "holiday.jpg").write_bytes(b"\xff\xd8 not ours")
    res = run_cli(*args, "--model-cache", foreign)
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "is not a prefill-diff cache (no prefill-diff-cache.json)" in res.output
    assert sorted(p.name for p in foreign.rglob("*")) == ["0" * 64 + "-native", "holiday.jpg", "models"]


@pytest.mark.parametrize("args, refused", [
    (("--max-size", "2x"), "--max-size must be a size such as 500M, 2G, 2GiB or 2GB (got '2x')"),
    (("--older-than", "-1"), "--older-than must be a number of days >= 0 (got -1)"),
    (("--all", "--older-than", "3"), "--all removes every entry: drop --older-than and --max-size")])
def test_cache_prune_refuses_bad_options_in_one_line(args, refused, cache_dir, tmp_path, run_cli):
    entry = _entry(tmp_path, "a.gguf")
    res = run_cli("cache", "prune", *args)
    assert res.exit_code == 2 and res.output.strip().splitlines() == [f"Error: {refused}"], res.output
    assert entry.is_dir()


def test_parse_size_units():
    assert [cache_listing.parse_size(s) for s in ("0", "1536", "500M", "2G", "2GiB", "2GB", "1.5k", " 3 mib ")] == \
        [0, 1536, 500 << 20, 2 << 30, 2 << 30, 2 * 10**9, 1536, 3 << 20]


def test_cache_prune_removes_damaged_stale_and_leftovers_and_keeps_intact_entries(cache_dir, tmp_path, run_cli):
    good = _entry(tmp_path, "good.gguf")
    stale = _entry(tmp_path, "stale.gguf")
    damaged = _entry(tmp_path, "damaged.gguf")
    _restamp(stale, lambda body: body["versions"].__setitem__("format", -1))
    (damaged / "weights.bin").unlink()
    models = cache_dir / "models"
    (models / ".trash-0123").mkdir()  # a deletion that was killed halfway
    (models / ".trash-0123" / "weights.bin").write_bytes(b"x" * 5000)
    (models / "notes.txt").write_text("someone's file")  # not ours: never removed
    res = run_cli("cache", "prune", "--dry-run")
    assert res.exit_code == 0, res.output
    assert sorted(line.split()[3] for line in res.output.splitlines() if line.startswith("would remove")) == \
        [".trash-0123", "damaged.gguf", "stale.gguf"]
    assert "kept unknown notes.txt" in res.output and "would free" in res.output
    assert len(list(models.iterdir())) == 5  # a dry run removes nothing
    res = run_cli("cache", "prune")
    assert res.exit_code == 0, res.output
    assert "removed native stale.gguf" in res.output and "is stale (made by other code: format -1 -> 1)" in res.output
    assert "removed native damaged.gguf" in res.output and "kept unknown notes.txt" in res.output
    assert sorted(p.name for p in models.iterdir()) == sorted([good.name, "notes.txt"])
    assert res.output.splitlines()[-1].startswith("freed ")
    res = run_cli("cache", "prune")
    assert res.output.splitlines()[-1].startswith("nothing to remove; the model cache"), res.output


def test_cache_prune_older_than_and_max_size_remove_the_least_recently_used(cache_dir, tmp_path, run_cli):
    old, middle, new = (_entry(tmp_path, f"{n}.gguf", n=100_000) for n in ("old", "middle", "new"))
    _age(old, 40)
    _age(middle, 20)
    _age(new, 10)
    model_cache.cached(str(tmp_path / "old.gguf"), "native", lambda: 1 / 0, _save_bytes, _load_bytes)  # a use
    res = run_cli("cache", "--json", "prune", "--older-than", "15")
    gone = [Path(i["source"]).name for i in json.loads(res.output)["removed"]]
    assert res.exit_code == 0 and gone == ["middle.gguf"], res.output  # old.gguf was just used
    assert not middle.exists() and old.exists() and new.exists()
    sizes = {Path(i["source"]).name: i["size"] for i in _cache_json(run_cli)["items"]}
    res = run_cli("cache", "prune", "--max-size", str(sizes["old.gguf"] + sizes["new.gguf"] - 1))
    assert res.exit_code == 0 and "removed native new.gguf" in res.output, res.output
    assert "least recently used" in res.output and old.exists() and not new.exists()
    res = run_cli("cache", "prune", "--max-size", "1G")
    assert res.output.startswith("nothing to remove") and old.exists()
    res = run_cli("cache", "prune", "--all")
    assert res.exit_code == 0 and "removed native old.gguf" in res.output
    assert list((cache_dir / "models").iterdir()) == []


def test_cache_prune_never_follows_a_link(cache_dir, tmp_path, run_cli):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "weights.bin").write_bytes(b"precious")
    (outside / "manifest.json").write_text("{}")
    entry = _entry(tmp_path, "a.gguf")
    os.unlink(entry / "weights.bin")
    os.symlink(outside / "weights.bin", entry / "weights.bin")  # damaged: a link to a file outside
    linked = cache_dir / "models" / ("f" * 64 + "-native")
    os.symlink(outside, linked)  # damaged: an entry that is a link to a directory outside
    os.symlink(outside, cache_dir / "models" / ".trash-link")
    os.symlink(outside, cache_dir / "models" / ".tmp-link")
    _age(cache_dir / "models" / ".tmp-link", 2)  # no lock file: taken for abandoned after a day
    res = run_cli("cache", "prune")
    assert res.exit_code == 0, res.output
    assert list((cache_dir / "models").iterdir()) == []
    assert sorted(p.name for p in outside.iterdir()) == ["manifest.json", "weights.bin"]
    assert (outside / "weights.bin").read_bytes() == b"precious"


_WRITER = """
import os, sys, time
from prefill_diff.engine.models import cache_entries, model_cache

def save(value, directory):
    with open(os.path.join(directory, "weights.bin"), "wb") as f:
        f.write(value)
    print("writing", flush=True)
    while not os.path.exists(sys.argv[2]):  # a long conversion: until the test says go on
        time.sleep(0.05)
    return {}

model_cache.cached(sys.argv[1], "native", lambda: b"w" * 100000, save, lambda entry: None)
print("stored", flush=True)
"""


def _writer(tmp_path, source):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(source), str(tmp_path / "go")],
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    assert proc.stdout.readline() == "writing\n"
    return proc


def test_cache_prune_keeps_a_temporary_directory_while_its_conversion_runs(cache_dir, tmp_path, run_cli):
    (tmp_path / "a.gguf").write_bytes(b"gguf bytes")
    proc = _writer(tmp_path, tmp_path / "a.gguf")
    try:
        listed = _cache_json(run_cli)["items"]
        assert [(i["kind"], i["state"]) for i in listed] == [("temporary", "writing")]
        res = run_cli("cache", "prune", "--all")
        assert res.exit_code == 0 and "is being written by a running conversion" in res.output, res.output
        assert os.path.isdir(listed[0]["paths"][0])
        (tmp_path / "go").touch()
        assert proc.stdout.readline() == "stored\n"
    finally:
        proc.kill()
        proc.wait()
    assert [i["state"] for i in _cache_json(run_cli)["items"]] == ["intact"]  # the conversion completed


def test_cache_prune_removes_the_temporary_directory_of_a_killed_conversion(cache_dir, tmp_path, run_cli):
    (tmp_path / "a.gguf").write_bytes(b"gguf bytes")
    proc = _writer(tmp_path, tmp_path / "a.gguf")
    proc.kill()
    proc.wait()
    listed = _cache_json(run_cli)["items"]
    assert [(i["kind"], i["state"]) for i in listed] == [("temporary", "abandoned")]
    assert [Path(p).name.endswith(".lock") for p in listed[0]["paths"]] == [False, True]
    assert "temporary .tmp-" in run_cli("cache").output and "was left by a conversion that is no longer running" \
        in run_cli("cache").output
    res = run_cli("cache", "prune")
    assert res.exit_code == 0 and "removed temporary .tmp-" in res.output, res.output
    assert list((cache_dir / "models").iterdir()) == []


def test_a_temporary_directory_without_a_lock_is_removed_only_a_day_old(cache_dir, tmp_path, run_cli):
    tmp = cache_dir / "models" / ".tmp-k2v9x0a1"  # as an earlier version's mkdtemp named it
    _entry(tmp_path, "a.gguf")
    tmp.mkdir()
    res = run_cli("cache", "prune")
    assert "kept temporary .tmp-k2v9x0a1" in res.output and tmp.is_dir(), res.output
    _age(tmp, 1.5)
    res = run_cli("cache", "prune")
    assert "removed temporary .tmp-k2v9x0a1" in res.output and not tmp.exists(), res.output


def test_cache_prune_keeps_an_entry_a_run_is_loading(cache_dir, tmp_path):
    src = tmp_path / "a.gguf"
    _entry(tmp_path, "a.gguf")
    seen = model_cache.cached(str(src), "native", lambda: 1 / 0, _save_bytes,
                              lambda entry: cache_listing.prune(everything=True))  # prune while it is loaded
    assert [(d.removed, d.why) for d in seen.decisions] == [(False, "is in use by a running prefill-diff")]
    assert cache_listing.prune(everything=True).freed > 0  # and once the run has loaded it, it can go


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


def test_cache_lists_another_users_entries_and_never_removes_them(cache_dir, tmp_path, monkeypatch, run_cli):
    stale = _entry(tmp_path, "theirs.gguf")
    _restamp(stale, lambda body: body["versions"].__setitem__("format", -1))
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)  # every file is now another user's
    out = _cache_json(run_cli)["items"]
    assert out[0]["owner"] and str(os.getuid()) in out[0]["owner"]
    res = run_cli("cache")
    assert "is owned by" in res.output and "not by you" in res.output and "owner" in res.output, res.output
    res = run_cli("cache", "prune", "--all")
    assert res.exit_code == 0 and "kept native theirs.gguf" in res.output and "not by you: not removed" in res.output
    assert stale.is_dir()


def test_cache_does_not_import_torch(cache_dir, tmp_path):
    _entry(tmp_path, "a.gguf")
    code = ("import sys; from prefill_diff.cli.main import cli\n"
            "for args in (['cache'], ['cache', 'list', '--json'], ['cache', 'prune', '--dry-run']):\n"
            "    try:\n        cli(args, standalone_mode=False)\n    except SystemExit: pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "False False", out.stdout + out.stderr
    assert "intact" in out.stdout


def test_cache_shows_a_file_name_as_plain_text(cache_dir, tmp_path, run_cli):
    entry = _entry(tmp_path, "[bold]x\x1b[31m.gguf")
    _restamp(entry, lambda body: body["versions"].__setitem__("format", -1))
    for args in (("cache",), ("cache", "prune", "--dry-run")):
        res = run_cli(*args)
        assert "[bold]x\\x1b[31m.gguf" in res.output and "\x1b" not in res.output, res.output
