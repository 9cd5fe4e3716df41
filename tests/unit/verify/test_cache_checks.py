"""verify/cache_checks.py: cache lengths and positions exactly, keys and values per (KV head, slot) within
tolerance, pre-RoPE keys rotated before they are compared, sliding-window layers on their last W - 1 slots."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from prefill_diff.verify import wording
from prefill_diff.verify.cache_checks import Slots, check_cache, layer_window, post_rotation, rotate_keys

from ._traces import HEAD_DIM, N_KV, TOL, context, element_rule, make_spec, record

INV = [1.0, 0.01]  # head_dim / 2 inverse frequencies


def naive_rope(keys, positions, inv, scale=1.0):
    """Rotate-half RoPE, one pair (i, i + d/2) at a time, in float64."""
    H, T, D = keys.shape
    half, out = D // 2, np.zeros((H, T, D))
    for h in range(H):
        for t in range(T):
            for i in range(half):
                a = positions[t] * inv[i]
                c, s = np.cos(a) * scale, np.sin(a) * scale
                x, y = float(keys[h, t, i]), float(keys[h, t, i + half])
                out[h, t, i], out[h, t, i + half] = x * c - y * s, y * c + x * s
    return out


def _check(ref_spec, cand_spec, levels=("full", "full")):
    ref, cand = record(ref_spec, levels[0], name="ref"), record(cand_spec, levels[1], name="cand")
    ctx = context(ref, cand)
    cache, tensors = check_cache(ctx, ref.layer(0), cand.layer(0))
    return cache, tensors, ctx


@pytest.mark.parametrize("args,layer,want", [
    ({}, 0, None),
    ({"sliding_window": 4}, 0, 4),  # no layer_types: every layer
    ({"sliding_window": 4, "layer_types": ["full", "sliding"]}, 1, 4),
    ({"sliding_window": 4, "layer_types": ["full", "sliding"]}, 0, None),
    ({"sliding_window": 4, "layer_types": ["sliding"]}, 1, None),  # beyond the list
    ({"sliding_window": 0}, 0, None),
    ({"sliding_window": True}, 0, None),  # a bool is no window
    ({"sliding_window": None}, 0, None),
])
def test_layer_window(args, layer, want):
    assert layer_window(SimpleNamespace(args=args), layer) == want


def test_slots_of_a_window_are_each_samples_last_w_minus_1():
    lengths = np.array([5, 2, 9])
    s = Slots(SimpleNamespace(cache_lengths=lengths), 4)
    assert s.n.tolist() == [3, 2, 3] and s.start.tolist() == [2, 0, 6]
    positions = np.arange(30).reshape(3, 10)
    assert s.of(positions, 2, 3).tolist() == [26, 27, 28]
    row = np.arange(2 * 10 * 1).reshape(2, 10, 1)
    assert s.row(row, 0, 3)[:, :, 0].tolist() == [[2, 3, 4], [12, 13, 14]]
    assert [s.holds_more(i) for i in range(3)] == [True, False, True]
    assert "W=4" in s.note() and "last 3 slots" in s.note()
    whole = Slots(SimpleNamespace(cache_lengths=lengths), None)
    assert whole.n.tolist() == lengths.tolist() and whole.start.tolist() == [0, 0, 0]
    assert not any(whole.holds_more(i) for i in range(3)) and whole.note() == ""


@pytest.mark.parametrize("scale", [1.0, 1.3])
def test_rotate_keys_is_rotate_half_rope(scale):
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 5, 6)).astype(np.float32)
    pos, inv = np.array([0, 1, 2, 7, 100]), np.array([1.0, 0.1, 0.01])
    got = rotate_keys(keys, pos, inv, scale)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, naive_rope(keys, pos, inv, scale), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[:, 0], keys[:, 0] * scale, rtol=1e-6)  # position 0: no rotation


def _trace(rotation="post", **model):
    args = {"sliding_window": model.pop("window")} if "window" in model else {}
    return SimpleNamespace(meta={"layout": {"key_rotation": rotation}}, model=model, args=args)


def test_post_rotation_rotates_only_pre_rope_keys_for_a_post_rope_side():
    keys = np.random.default_rng(1).standard_normal((N_KV, 3, HEAD_DIM)).astype(np.float32)
    pos = np.array([3, 4, 5])
    pre, post = _trace("pre", rope_inv_freq=INV), _trace("post")
    np.testing.assert_allclose(post_rotation(keys, pos, pre, post, 0), naive_rope(keys, pos, INV), rtol=1e-5,
                               atol=1e-6)
    assert post_rotation(keys, pos, pre, _trace("pre", rope_inv_freq=INV), 0) is keys  # both pre: as stored
    assert post_rotation(keys, pos, post, pre, 0) is keys  # already rotated


def test_post_rotation_uses_the_window_layers_own_base_and_longropes_long_factors():
    keys = np.random.default_rng(2).standard_normal((N_KV, 3, HEAD_DIM)).astype(np.float32)
    local = [0.5, 0.05]
    windowed = _trace("pre", rope_inv_freq=INV, rope_local_inv_freq=local, window=8)
    got = post_rotation(keys, np.array([0, 1, 2]), windowed, _trace(), 0)
    np.testing.assert_allclose(got, naive_rope(keys, [0, 1, 2], local), rtol=1e-5, atol=1e-6)
    long = {"inv_freq": [0.3, 0.003], "switch": 4, "attention_factor": 1.2}
    longrope = _trace("pre", rope_inv_freq=INV, rope_long=long)
    short = post_rotation(keys, np.array([0, 1, 3]), longrope, _trace(), 0)  # last position 3: 4 tokens, not past
    np.testing.assert_allclose(short, naive_rope(keys, [0, 1, 3], INV, 1.2), rtol=1e-5, atol=1e-6)
    past = post_rotation(keys, np.array([2, 3, 4]), longrope, _trace(), 0)  # 5 tokens: past the original length
    np.testing.assert_allclose(past, naive_rope(keys, [2, 3, 4], long["inv_freq"], 1.2), rtol=1e-5, atol=1e-6)


def test_identical_caches_pass():
    spec = make_spec(pad=[0, 2, 1])
    cache, tensors, _ = _check(spec, spec.relayout([1, 0, 0]))
    assert cache and cache.detail is None
    assert set(tensors) == {"cache_keys", "cache_values"}
    for t in tensors.values():
        assert t and t.level == "full" and t.max_abs == 0.0
        assert t.compared == sum(len(s) for s in spec.samples) * N_KV * HEAD_DIM


def test_a_skipped_write_is_a_length_break_at_the_first_differing_slot():
    """Candidate sample 2 lost slot 2 (positions 0, 1, 3 against 0, 1, 2, 3)."""
    ref = make_spec()
    cand = ref.copy()
    k, v, _ = cand.caches[0][2]
    keep = [0, 1, 3]
    cand.caches[0][2] = [k[:, keep], v[:, keep], np.array(keep)]
    cache, _, _ = _check(ref, cand)
    assert not cache.lengths_ok and (cache.sample, cache.position, cache.samples) == (2, 2, (2,))
    assert cache.detail == wording.cache_length_differs(2, 3, 4, 2)


def test_a_wrong_position_is_a_positions_break_naming_the_slot():
    ref = make_spec()
    cand = ref.copy()
    cand.caches[0][0][2] = np.array([0, 1, 2, 40, 4])
    cand.caches[0][2][2] = np.array([0, 9, 9, 3])
    cache, _, _ = _check(ref, cand)
    assert cache.lengths_ok and not cache.positions_ok
    assert (cache.sample, cache.position, cache.samples) == (0, 3, (0, 2))
    assert cache.detail == wording.cache_positions_differ(0, 3, 40, 3, 1, 5)


def test_values_out_of_tolerance_name_their_kv_heads():
    """Rows are (KV head, slot): a change at head 1, slot 2, dimension 3 is found there, the counts naive."""
    ref = make_spec()
    cand = ref.copy()
    rng = np.random.default_rng(4)
    cand.caches[0][1][1][1, 2, 3] += 0.25
    cand.caches[0][0][1][1] += (1e-4 * rng.standard_normal(cand.caches[0][0][1][1].shape)).astype(np.float32)
    cache, tensors, _ = _check(ref, cand)
    t = tensors["cache_values"]
    n_bad = sum(int(element_rule(ref.caches[0][s][1][h], cand.caches[0][s][1][h], TOL).sum())
                for s in range(3) for h in range(N_KV))
    assert cache and tensors["cache_keys"]
    assert not t and t.n_bad == n_bad >= 1 and t.kv_heads == (1,)
    assert t.worst == (1, 2, 3) and t.max_abs == pytest.approx(0.25, abs=1e-4)


def test_keys_stored_before_rope_are_compared_rotated():
    """A candidate that stores keys before RoPE (declaring so) holds the same cache as attention reads it;
    the same keys declared as rotated are a value break."""
    ref = make_spec()
    pre = make_spec(layout={"key_rotation": "pre"}, model={"rope_inv_freq": INV})
    for s, (k, v, pos) in enumerate(ref.caches[0]):
        pre.caches[0][s] = [k.copy(), v.copy(), pos.copy()]
        k[:] = naive_rope(k, pos, INV)  # the reference stores them rotated
    pre.states, pre.finals = ref.states, ref.finals
    cache, tensors, _ = _check(ref, pre)
    assert cache and tensors["cache_keys"] and tensors["cache_keys"].max_abs < 1e-5
    undeclared = pre.copy()
    undeclared.meta = ref.meta
    _, tensors, _ = _check(ref, undeclared)
    assert not tensors["cache_keys"] and tensors["cache_values"]


def _window(spec, W):
    spec.meta["model"]["args"]["sliding_window"] = W
    return spec


def test_a_window_layer_compares_the_last_w_minus_1_slots_whatever_each_side_keeps():
    """W = 3: the reference keeps the whole prompt, the candidate only each sample's last 2 slots."""
    ref = _window(make_spec(), 3)
    cand = ref.copy()
    for s, (k, v, pos) in enumerate(cand.caches[0]):
        cand.caches[0][s] = [k[:, -2:], v[:, -2:], pos[-2:]]
    ref.caches[0][0][0][0, 0, 0] += 7.0  # a slot the next token cannot read
    cache, tensors, _ = _check(ref, cand)
    assert cache and all(tensors.values())
    assert tensors["cache_keys"].compared == 3 * 2 * N_KV * HEAD_DIM
    cand.caches[0][0][0][1, 1, 2] += 1.0  # the candidate's last slot of sample 0: slot 4 of the reference's
    _, tensors, _ = _check(ref, cand)
    assert not tensors["cache_keys"] and tensors["cache_keys"].worst == (0, 4, 2)


def test_window_sides_that_both_keep_the_whole_prompt_must_agree_on_its_length():
    ref = _window(make_spec(), 3)
    cand = ref.copy()
    k, v, pos = cand.caches[0][0]
    cand.caches[0][0] = [k[:, :4], v[:, :4], pos[:4]]  # 4 of 5 slots: more than 2, fewer than the reference
    cache, _, _ = _check(ref, cand)
    assert not cache.lengths_ok and cache.sample == 0 and cache.position == 4
    assert "both sides keep more than its last 2 slots" in cache.detail


def test_window_caches_of_other_lengths_below_the_full_level_are_not_compared():
    ref = _window(make_spec(), 3)
    cand = ref.copy()
    for s, (k, v, pos) in enumerate(cand.caches[0]):
        cand.caches[0][s] = [k[:, -2:], v[:, -2:], pos[-2:]]
    cache, tensors, ctx = _check(ref, cand, levels=("full", "stats"))
    assert cache and wording.WINDOW_CACHE_NOT_FULL in ctx.skipped
    assert all(t.level == "none" for t in tensors.values())


def test_other_kv_head_shapes_are_a_shape_result():
    cache, tensors, _ = _check(make_spec(), make_spec(n_kv=1))
    assert tensors["cache_keys"].shape_detail == "cache keys: n_kv_heads x head_dim 2x4 vs 1x4"
    assert not tensors["cache_values"]


def test_a_lower_level_cache_is_compared_as_statistics():
    ref = make_spec()
    cand = ref.copy()
    cand.caches[0][1][0][0, 0, 0] += 3.0
    cache, tensors, _ = _check(ref, cand, levels=("full", "stats"))
    assert cache and tensors["cache_keys"].level == "stats"
    assert not tensors["cache_keys"] and tensors["cache_keys"].bad_samples == (1,) and tensors["cache_values"]
