"""Our engine against Hugging Face transformers' LlamaForCausalLM on the same weights (no download)."""
from __future__ import annotations

import pytest
import torch
import transformers  # installed by the README's test line: a missing one fails, never skips

from conftest import Capture, padded
from prefill_diff.engine.foreign.hf_engine import returned_cache
from prefill_diff.engine.models.hf_names import hf_state_dict
from prefill_diff.engine.models.args import ModelArgs
from prefill_diff.engine.native.prefill import Engine, NumericalConfig
from prefill_diff.engine.models.snapshot import Snapshot
from prefill_diff.engine.models.synthetic import synthetic_state


ARGS = ModelArgs(dim=96, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=16, hidden_dim=160, vocab_size=128,
                 rope_theta=10000.0, norm_eps=1e-5)


def hf_model(args: ModelArgs, state: dict, attn: str = "eager"):
    """transformers' own class for the family: Olmo2ForCausalLM with post-norms, Qwen3ForCausalLM with QK-norm,
    Qwen2ForCausalLM with Q/K/V biases alone, else LlamaForCausalLM (its attention_bias and mlp_bias as the
    model has them)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Olmo2Config, Olmo2ForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
    if args.norm_placement == "post":
        config_cls, model_cls, extra = Olmo2Config, Olmo2ForCausalLM, {"attention_bias": args.o_bias}
    elif args.qk_norm == "head":
        config_cls, model_cls, extra = Qwen3Config, Qwen3ForCausalLM, {"attention_bias": args.o_bias}
    elif args.qkv_bias and not args.o_bias:
        config_cls, model_cls, extra = Qwen2Config, Qwen2ForCausalLM, {}
    else:
        config_cls, model_cls = LlamaConfig, LlamaForCausalLM
        extra = {"attention_bias": args.o_bias, "mlp_bias": args.mlp_bias}
    cfg = config_cls(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
                      num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                      num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, rms_norm_eps=args.norm_eps,
                      rope_theta=args.rope_theta, tie_word_embeddings=False, attn_implementation=attn, **extra)
    model = model_cls(cfg).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(state), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def hf_run(model, ids, mask, pos):
    """Per-layer residual states via forward hooks; cache and logits from the output."""
    states = {}

    def on_layer(i):
        def hook(mod, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            states[(i, "layer_input")] = x.detach()
            states[(i, "layer_output")] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    def keep(i, name):
        def hook(mod, args, out):
            states[(i, name)] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        # the updates are what each sub-layer adds to the residual: OLMo 2 normalises them first
        post = hasattr(layer, "post_feedforward_layernorm")
        attn, mlp = ((layer.post_attention_layernorm, layer.post_feedforward_layernorm) if post else
                     (layer.self_attn, layer.mlp))
        handles.append(layer.register_forward_hook(on_layer(i), with_kwargs=True))
        handles.append(attn.register_forward_hook(keep(i, "attn_update")))
        handles.append(mlp.register_forward_hook(keep(i, "mlp_update")))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return states, out


FAMILIES = {
    "llama": ARGS,
    "qwen3": ARGS.replace(qk_norm="head", arch="qwen3"),
    "qwen3 with attention_bias": ARGS.replace(qk_norm="head", qkv_bias=True, o_bias=True, arch="qwen3"),
    "llama with attention_bias and mlp_bias": ARGS.replace(qkv_bias=True, o_bias=True, mlp_bias=True),
    "olmo2": ARGS.replace(qk_norm="proj", norm_placement="post", norm_scale="float32", arch="olmo2"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_agrees_with_transformers_left_padded_batch(family):
    args = FAMILIES[family]
    state = synthetic_state(args, seed=11)
    snap = Snapshot("test", args, state)
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43, 38, 32], [79, 50, 28, 84, 19, 71, 69]]
    ids, mask, pos = padded(prompts, "left")
    cap = Capture()
    ours = Engine(snap, NumericalConfig(dtype="float32")).prefill(ids, mask, pos, recorder=cap)
    states, out = hf_run(hf_model(args, state), ids, mask, pos)
    valid = mask.bool()
    atol, rtol = 1e-5, 1e-5
    for layer in range(args.n_layers):
        for name in ("layer_input", "attn_update", "mlp_update", "layer_output"):
            a, b = cap.states[(layer, name)][valid], states[(layer, name)][valid]
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=f"layer {layer} {name}")
        hf_cache = returned_cache(out).layers[layer]
        for s, p in enumerate(prompts):
            k, v, positions = cap.caches[(layer, s)]
            n = ids.shape[1]
            torch.testing.assert_close(k, hf_cache.keys[s, :, n - len(p):], atol=atol, rtol=rtol)
            torch.testing.assert_close(v, hf_cache.values[s, :, n - len(p):], atol=atol, rtol=rtol)
            assert positions.tolist() == list(range(len(p)))
    hf_last = out.logits[:, -1]  # left padding: every sample's last valid token is the last column
    torch.testing.assert_close(ours.next_logits, hf_last, atol=atol, rtol=rtol)
    assert ours.next_logits.argmax(-1).tolist() == hf_last.argmax(-1).tolist()


def test_engine_agrees_with_transformers_qkv_bias_untied_sdpa():
    args = ARGS.replace(qkv_bias=True)
    state = synthetic_state(args, seed=5)
    snap = Snapshot("test", args, state)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    ids, mask, pos = padded(prompts, "left")
    ours = Engine(snap, NumericalConfig(kernel="sdpa")).prefill(ids, mask, pos)
    _, out = hf_run(hf_model(args, state, "sdpa"), ids, mask, pos)
    torch.testing.assert_close(ours.next_logits, out.logits[:, -1], atol=1e-5, rtol=1e-5)
