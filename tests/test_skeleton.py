"""The model skeleton: the declared weights (engine/models/weights.py) are the real module tree's, and no torch._dynamo
import at start-up."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from prefill_diff.engine.models.args import MODEL_PRESETS
from prefill_diff.engine.models.weights import state_shapes
from prefill_diff.engine.native.model import Transformer
from prefill_diff.engine.native.skeleton import build, skeleton
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.synthetic import synthetic_state

ARGS = [MODEL_PRESETS["synthetic"], MODEL_PRESETS["seed-2.8"],
        MODEL_PRESETS["synthetic"].replace(qkv_bias=True, lm_head_bias=True, tie_embeddings=True)]
# every built-in model, and the variants none of them has: every bias, a shared expert beside a dense layer
VARIANTS = {**MODEL_PRESETS, "every-bias": MODEL_PRESETS["synthetic"].replace(
    qkv_bias=True, o_bias=True, mlp_bias=True, lm_head_bias=True, qk_norm="proj", norm_placement="sandwich"),
    "shared-expert-dense-layer": MODEL_PRESETS["synthetic:qwen2-moe"].replace(dense_layers=(1,), qk_norm="head")}


@pytest.mark.parametrize("args", ARGS, ids=["synthetic", "seed-2.8", "biases-tied"])
def test_state_shapes_are_those_of_an_initialised_model(args):
    real = Transformer(args)  # on the CPU, initialised: the slow way the skeleton avoids
    assert list(state_shapes(args).items()) == [(k, tuple(v.shape)) for k, v in real.state_dict().items()]
    assert all(p.is_meta for p in skeleton(args).parameters())
    assert torch.nn.init.normal_(torch.zeros(4)).abs().sum() > 0  # the initialisers are restored afterwards


@pytest.mark.parametrize("name", VARIANTS)
def test_the_declared_weights_are_those_our_model_registers(name):
    args = VARIANTS[name]
    assert list(state_shapes(args).items()) == [(k, tuple(v.shape)) for k, v in skeleton(args).state_dict().items()]


@pytest.mark.parametrize("args", ARGS, ids=["synthetic", "seed-2.8", "biases-tied"])
def test_synthetic_weights_are_drawn_in_the_model_state_order(args):
    """Independent of the skeleton: the same seeded draws over an initialised model's state dict."""
    g = torch.Generator().manual_seed(5)
    want = {}
    for name, t in Transformer(args).state_dict().items():
        shape = tuple(t.shape)
        if name == "output.weight" and args.tie_embeddings:
            continue
        r = torch.randn(shape, generator=g)
        want[name] = (1.0 + 0.1 * r if name.endswith("norm.weight") else r if name == "tok_embeddings.weight"
                      else 0.1 * r if name.endswith("bias") else r / shape[1] ** 0.5)
    got = synthetic_state(args, 5)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_built_model_runs_the_snapshot_weights():
    args = MODEL_PRESETS["seed-2.8"]
    state = synthetic_state(args, 1)
    model, qdigest = build(Snapshot("seed-2.8", args, state))
    assert qdigest is None
    for name, t in model.state_dict().items():
        assert torch.equal(t, state[name]), name


@pytest.mark.slow
def test_preparing_a_synthetic_run_imports_neither_dynamo_nor_inductor():
    """Issue 18: start-up. A compiled run imports them (engine/native/compiled.py); nothing else may."""
    code = ("import sys\nfrom prefill_diff.engine.config import load_side\nfrom prefill_diff.engine.prepared import "
            "prepare\nprepare(load_side('batched-left'))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor')))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_deterministic_flag_is_set_without_inductor():
    from prefill_diff.engine.prepared import set_deterministic
    before = torch.are_deterministic_algorithms_enabled()
    try:
        set_deterministic(True, compiling=False)
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        set_deterministic(False, compiling=False)
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before, warn_only=True)
