"""Usage errors, config errors and listings are answered without importing torch (which takes seconds): each
command runs in a fresh interpreter and the test reads which heavy modules it imported."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "llama_cpp", "gguf")

# Invokes the CLI in this fresh process, then prints its exit status, its output and the heavy modules loaded.
SCRIPT = """
import json, sys
from click.testing import CliRunner
from prefill_diff.cli.main import cli
res = CliRunner().invoke(cli, json.loads(sys.argv[1]))
print(json.dumps({"code": res.exit_code, "output": res.output,
                  "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


def invoke_fresh(*args) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([str(a) for a in args])], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


CONFIGS = {
    "unknown key": ('[run]\nbatchin = "left"\n', "unknown key [run] batchin (did you mean batching?)"),
    "bad dtype": ('[run]\ndtype = "bf16"\n', "[run] dtype must be one of"),
    "bad model size": ("[model]\nn_kv_heads = 3\n", "n_heads must be divisible by n_kv_heads"),
    "bad cache kind": ('[cache]\nkind = "page"\n', "[cache] kind must be one of"),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
@pytest.mark.parametrize("command", ["run", "record"])
def test_a_config_error_is_said_without_importing_torch(tmp_path, case, command):
    body, said = CONFIGS[case]
    cfg = tmp_path / "c.toml"
    cfg.write_text(body)
    args = ("run", "reference", cfg) if command == "run" else ("record", cfg, "-o", tmp_path / "t.h5")
    got = invoke_fresh(*args)
    assert got["code"] == 2 and said in got["output"], got
    assert got["heavy"] == [], got


@pytest.mark.parametrize("args, said", [
    (("run", "reference", "batched-left", "--tokens", "1,2,x"), "--tokens takes comma-separated integers"),
    (("ledger", "--tokens", "1,2,x"), "--tokens takes comma-separated integers"),
    (("ledger", "--model", "synthetic:qwn2"), "did you mean synthetic:qwen2?"),
    (("run", "reference", "batched-left", "--model", "synthetic:qwn2"), "did you mean synthetic:qwen2?"),
    (("run", "reference", "batched-lft"), "did you mean batched-left?"),
    (("record", "fault:gqa-maping", "-o", "{tmp}/t.h5"), "did you mean fault:gqa-mapping?"),
    (("compare", "{data}/trace-v1.2.h5", "{tmp}/missing.h5"), "no such file: {tmp}/missing.h5"),
])
def test_a_usage_error_is_said_without_importing_torch(tmp_path, args, said):
    from pathlib import Path
    fill = {"tmp": tmp_path, "data": Path(__file__).parent / "data"}
    got = invoke_fresh(*(a.format(**fill) for a in args))
    assert got["code"] == 2 and said.format(**fill) in got["output"], got
    assert got["heavy"] == [], got


def test_presets_lists_every_preset_without_importing_torch():
    from prefill_diff.engine.presets import PRESETS
    got = invoke_fresh("presets")
    assert got["code"] == 0
    assert [line.split()[0] for line in got["output"].splitlines()] == list(PRESETS)
    assert got["heavy"] == [], got
