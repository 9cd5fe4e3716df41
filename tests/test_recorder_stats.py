"""The recorder's statistics against independent computations: slab_stats (blocked reductions in the data's
own dtype) against float64 sums done naively, the checksum against the bytes summed with Python integers,
bfloat16 widening against torch's conversion, and the final top-k against a full stable sort."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from prefill_diff.dumps import recorder, reductions, sampling
from prefill_diff.dumps.reader import Trace
from prefill_diff.dumps.recorder import Recorder
from prefill_diff.dumps.reductions import _BLOCK, slab_stats, top_ids, widen_bfloat16

pytestmark = pytest.mark.usefixtures("both_kernels")  # with the compiled kernels and without


def naive_checksum(a: np.ndarray) -> int:
    """Wrapped int64 sum of each row's bytes read as little-endian 8-byte words, rows zero-padded to 8 bytes."""
    rows = np.ascontiguousarray(a).reshape(a.shape[0], -1)
    total = 0
    for row in rows:
        raw = row.tobytes()
        raw += b"\0" * (-len(raw) % 8)
        total += sum(int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8))
    total &= (1 << 64) - 1
    return total - (1 << 64) if total >> 63 else total


def naive(values64: np.ndarray) -> tuple:
    """count, finite, min, max, sum, sum of squares and the sum of |x| (the scale of the sum's rounding)."""
    v = values64.ravel()
    fin = np.isfinite(v)
    return v.size, int(fin.sum()), v.min(), v.max(), v.sum(), (v * v).sum(), np.abs(v).sum()


def cancelling(shape, dtype, rng) -> np.ndarray:
    """Large offsets that cancel: rows alternately around +3e3 and -3e3, with a small signal on top."""
    x = rng.standard_normal(shape) * 0.5
    x += np.where(np.arange(shape[0])[:, None] % 2 == 0, 3e3, -3e3)
    return x.astype(dtype)


# rows of up to several blocks, widths below, at and above the row-sum length, odd widths (padded checksum rows)
SHAPES = [(1, 1), (3, 5), (7, 33), (257, 1024), (700, 896), (5, 4096), (3, 3000), (2 * _BLOCK // 1024 + 3, 1024)]


@pytest.mark.parametrize("vecdot", [True, False], ids=["vecdot", "einsum"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,eps", [(np.float32, 2.0 ** -24), (np.float64, 2.0 ** -53), (np.float16, 2.0 ** -24)])
@pytest.mark.parametrize("data", ["normal", "cancelling"])
def test_slab_stats_agree_with_float64_sums(shape, dtype, eps, data, vecdot, monkeypatch):
    if vecdot and not reductions._HAS_VECDOT:
        pytest.skip("numpy < 2.0 has no vecdot")
    monkeypatch.setattr(reductions, "_HAS_VECDOT", vecdot)
    rng = np.random.default_rng(hash((shape, data)) % 2 ** 32)
    x = cancelling(shape, dtype, rng) if data == "cancelling" else (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    n, fin, mn, mx, s, ss, chk = slab_stats(x)
    w = naive(x.astype(np.float64))
    assert (n, fin) == w[:2] and (mn, mx) == (w[2], w[3])
    # rounding of a sum of m values in the data's dtype is at most about m·eps·sum|x|; 1024-value row sums
    # (in 8+ SIMD lanes) then float64: well under 256·eps. (The float32 tolerance allows 5e-4·rms of the mean.)
    assert abs(s - w[4]) <= 256 * eps * w[6]
    assert abs(ss - w[5]) <= 256 * eps * w[5]  # squares: the same rule, all terms positive
    assert chk == naive_checksum(x)


@pytest.mark.parametrize("shape", [(3, 5), (257, 1024), (2 * _BLOCK // 1024 + 3, 1024)])
def test_bfloat16_slab_stats_are_of_the_exact_values_and_checksum_their_bits(shape):
    rng = np.random.default_rng(7)
    t = torch.from_numpy(cancelling(shape, np.float32, rng)).to(torch.bfloat16)
    n, fin, mn, mx, s, ss, chk = slab_stats(t)
    w = naive(t.double().numpy())
    assert (n, fin, mn, mx) == w[:4]
    assert abs(s - w[4]) <= 256 * 2.0 ** -24 * w[6]
    assert abs(ss - w[5]) <= 256 * 2.0 ** -24 * w[5]
    assert chk == naive_checksum(t.view(torch.int16).numpy())


def test_widen_bfloat16_is_torchs_conversion_for_every_bit_pattern():
    bits = np.arange(-2 ** 15, 2 ** 15, dtype=np.int64).astype(np.int16)
    want = torch.from_numpy(bits.copy()).view(torch.bfloat16).float().numpy()
    got = widen_bfloat16(bits)
    assert got.dtype == np.float32
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0.0 and subnormals too
    out = np.empty(bits.size, dtype=np.uint32)
    assert np.array_equal(widen_bfloat16(bits, out)[~nan], want[~nan]) and widen_bfloat16(bits, out).base is not None


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, "bfloat16"])
@pytest.mark.parametrize("where", ["first block", "last block", "both"])
def test_non_finite_values_are_counted_in_any_block(dtype, where):
    R = 2 * _BLOCK // 512 + 5  # three blocks of 512-wide rows
    x = np.random.default_rng(3).standard_normal((R, 512)).astype(np.float32)
    if where in ("first block", "both"):
        x[2, 7], x[3, 1] = np.inf, -np.inf
    if where in ("last block", "both"):
        x[R - 1, 3] = np.nan
    t = torch.from_numpy(x).to(torch.bfloat16) if dtype == "bfloat16" else x.astype(dtype)
    n, fin, mn, mx, s, ss, chk = slab_stats(t)
    v = t.double().numpy() if dtype == "bfloat16" else t.astype(np.float64)
    assert n == v.size and fin == int(np.isfinite(v).sum())
    if where == "first block":
        assert (mn, mx) == (-np.inf, np.inf) and np.isnan(s) and ss == np.inf
    else:
        assert np.isnan(mn) and np.isnan(mx) and np.isnan(s) and np.isnan(ss)
    assert chk == naive_checksum(t.view(torch.int16).numpy() if dtype == "bfloat16" else t)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])  # (float16's widened sums cannot overflow)
def test_finite_values_whose_sums_overflow_their_dtype_are_summed_in_float64(dtype):
    x = np.full((300, 1024), 3e36, dtype=np.float32)
    x[::2] *= -0.5
    t = torch.from_numpy(x).to(torch.bfloat16) if dtype == "bfloat16" else x.astype(dtype)
    n, fin, mn, mx, s, ss, chk = slab_stats(t)
    w = naive(t.double().numpy() if dtype == "bfloat16" else t.astype(np.float64))
    assert fin == n == w[0] and (mn, mx) == (w[2], w[3])
    assert s == pytest.approx(w[4], rel=1e-12) and ss == pytest.approx(w[5], rel=1e-12)


def test_checksum_composes_over_row_splits_at_any_block_boundary():
    x = np.random.default_rng(5).standard_normal((2 * _BLOCK // 1000 + 9, 1001)).astype(np.float32)  # odd rows
    whole = slab_stats(x)[6]
    for cut in (1, _BLOCK // 1001, _BLOCK // 1001 + 1, x.shape[0] - 1):
        a, b = slab_stats(x[:cut])[6], slab_stats(x[cut:])[6]
        total = (a + b) & ((1 << 64) - 1)
        assert (total - (1 << 64) if total >> 63 else total) == whole


@pytest.mark.parametrize("k", [1, 3, 10, 64])
def test_top_ids_are_the_full_stable_sort_with_ties_by_lower_id(k):
    rng = np.random.default_rng(k)
    for z in (rng.standard_normal(500).astype(np.float32),
              rng.integers(-3, 4, 500).astype(np.float32),  # many ties, across the k-th place
              np.full(200, 1.5, dtype=np.float32),
              np.array([np.nan, 1.0, np.inf, -np.inf, np.nan, 1.0, 0.0] * 20, dtype=np.float32),
              rng.standard_normal(300).astype(np.float16)):
        want = np.argsort(-z.astype(np.float64), kind="stable")[:min(k, z.size)]
        assert np.array_equal(top_ids(z, min(k, z.size)), want)


@pytest.mark.parametrize("level", ["stats", "sampled", "full"])
def test_a_layer_written_after_each_sample_keeps_every_samples_statistics(tmp_path, level):
    """layer_done after every sample (an engine that records one sample at a time): the layer is rewritten in
    place and its statistics cover every sample, equal to those of one layer_done after all samples."""
    args = {"dim": 6, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 2, "vocab_size": 9}
    rng = np.random.default_rng(0)
    data = {(layer, s, name): rng.standard_normal((3, 6)).astype(np.float32) for layer in range(2) for s in range(2)
            for name in ("layer_input", "attn_update", "mid", "mlp_update", "layer_output")}
    kv = {(layer, s): rng.standard_normal((2, 1, 3, 2)).astype(np.float32) for layer in range(2) for s in range(2)}

    def record(path, per_sample: bool):
        with Recorder(path, level) as rec:
            rec.begin([[1, 2, 3], [4, 5, 6]], 3, {"model": {"args": args}, "engine": {"dtype": "float32"}})
            for s in range(2):
                rec.inputs(s, 0, np.arange(1, 4), np.ones(3, bool), np.arange(3), np.arange(3))
            for layer in range(2):
                for s in range(2):
                    for (lay, s_, name), x in data.items():
                        if (lay, s_) == (layer, s):
                            rec.state(layer, name, s, 0, x)
                    rec.cache(layer, s, *kv[(layer, s)], np.arange(3))
                    if per_sample:
                        rec.layer_done(layer)
                rec.layer_done(layer)
            for s in range(2):
                rec.final(s, np.zeros(6, np.float32), np.arange(9, dtype=np.float32), 2, 2)

    record(tmp_path / "once.h5", False)
    record(tmp_path / "each.h5", True)
    with Trace(tmp_path / "once.h5") as once, Trace(tmp_path / "each.h5") as each:
        for layer in range(2):
            assert np.array_equal(each.layer(layer).cache_positions, once.layer(layer).cache_positions)
            assert each.layer(layer).cache_lengths.tolist() == once.layer(layer).cache_lengths.tolist() == [3, 3]
            if level == "sampled":
                for name in ("mid", "cache_values"):
                    assert np.array_equal(each.layer(layer).sampled(name)[()], once.layer(layer).sampled(name)[()])
                    assert not np.isnan(each.layer(layer).sampled(name)[()]).any()
            for name in ("layer_input", "mid", "layer_output", "cache_keys", "cache_values"):
                got, want = each.layer(layer).stats(name), once.layer(layer).stats(name)
                assert np.array_equal(got, want) and (got[:, 0] == (18 if "cache" not in name else 6)).all()
                assert np.array_equal(each.layer(layer).checksum(name), once.layer(layer).checksum(name))
                if "cache" not in name:  # sample 0's, written before the layer was first done, are there
                    x = data[(layer, 0, name)]
                    assert got[0, 2] == x.min() and got[0, 3] == x.max()


def test_cache_statistics_over_head_rows_are_those_of_the_slots():
    """The cache's statistics are taken over its (H·T, D) rows without a copy when a D row is whole 8-byte
    words: the same checksum as the slots (T, H·D), every other statistic the same up to summation order."""
    rng = np.random.default_rng(2)
    for H, T, D, dtype in [(4, 37, 64, torch.float32), (2, 5, 3, torch.float32), (3, 9, 4, torch.bfloat16),
                           (2, 7, 6, torch.bfloat16), (4, 300, 128, torch.float16)]:
        t = torch.from_numpy(rng.standard_normal((H, T, D)).astype(np.float32)).to(dtype)
        slots = t.transpose(0, 1).reshape(T, H * D)
        got, want = slab_stats(reductions.slot_rows(t, T, H, D)), slab_stats(slots)
        assert got[:4] == want[:4] and got[6] == want[6]
        assert got[4] == pytest.approx(want[4], rel=1e-5, abs=1e-5) and got[5] == pytest.approx(want[5], rel=1e-6)
        bits = slots.view(torch.int16).numpy() if dtype == torch.bfloat16 else slots.numpy()
        assert got[6] == naive_checksum(bits)


def test_cache_statistics_of_a_view_of_slots_are_the_slots_without_a_copy():
    """A cache tensor that is a (H, T, D) view of a (T, H, D) array (how the engine's cache hands them) is reduced
    as its slots, in place: every statistic exactly that of the slots, whatever D."""
    rng = np.random.default_rng(3)
    for H, T, D, dtype in [(4, 37, 64, torch.float32), (2, 5, 3, torch.float32), (3, 9, 4, torch.bfloat16),
                           (2, 7, 6, torch.bfloat16), (4, 300, 128, torch.float16), (2, 6, 8, torch.float64)]:
        slots_3d = torch.from_numpy(rng.standard_normal((T, H, D)).astype(np.float32)).to(dtype)
        t = slots_3d.transpose(0, 1)  # (H, T, D), not contiguous
        assert not t.is_contiguous()
        rows = reductions.slot_rows(t, T, H, D)
        as_np = rows.view(torch.int16).numpy() if torch.is_tensor(rows) else rows
        assert np.shares_memory(as_np, slots_3d.view(torch.int16).numpy() if dtype == torch.bfloat16
                                else slots_3d.numpy())
        got, want = slab_stats(rows), slab_stats(slots_3d.reshape(T, H * D).clone())
        assert got == want


class _Spy:
    """slab_stats, counting the calls per slab identity."""

    def __init__(self, monkeypatch):
        self.calls = 0
        monkeypatch.setattr(recorder, "slab_stats", self)

    def __call__(self, x):
        self.calls += 1
        return slab_stats(x)


def _two_layers(tmp_path, between) -> tuple:
    """Record layer 0's layer_output x, run ``between(x)``, record it (or what it returns) as layer 1's
    layer_input; returns (trace statistics of layer 1's layer_input for sample 0, the tensor recorded)."""
    args = {"dim": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 2, "vocab_size": 9}
    rng = np.random.default_rng(4)
    with Recorder(tmp_path / "r.h5", "stats", force=True) as rec:
        rec.begin([[1, 2, 3, 4]], 4, {"model": {"args": args}, "engine": {"dtype": "float32"}})
        rec.inputs(0, 0, np.arange(1, 5), np.array([0, 1, 1, 1], bool), np.arange(4), np.array([-1, 0, 1, 2]))
        x = None
        for layer in range(2):
            for name in ("layer_input", "attn_update", "mid", "mlp_update", "layer_output"):
                if name == "layer_input" and x is not None:
                    x = between(x)
                else:
                    x = torch.from_numpy(rng.standard_normal((1, 4, 8)).astype(np.float32))
                if name == "layer_input" and layer == 1:
                    given = x[0].clone()
                rec.state(layer, name, 0, 0, x[0])
            rec.cache(layer, 0, *torch.zeros(2, 1, 3, 2), torch.arange(3))
            rec.layer_done(layer)
        rec.final(0, np.zeros(8, np.float32), np.arange(9, dtype=np.float32), 3, 2)
    with Trace(tmp_path / "r.h5") as t:
        return t.layer(1).stats("layer_input")[0], given


def _want_stats(x: torch.Tensor) -> np.ndarray:
    v = x[1:].double().numpy()  # column 0 is padding
    return np.array([v.size, v.size, v.min(), v.max(), v.mean(), np.sqrt((v * v).sum()), 8, 8])


@pytest.mark.parametrize("between", ["same", "changed in place", "another tensor"])
def test_layer_input_statistics_are_reused_only_for_the_very_same_unchanged_tensor(tmp_path, monkeypatch, between):
    spy = _Spy(monkeypatch)
    fn = {"same": lambda x: x, "changed in place": lambda x: x.mul_(-3.0),
          "another tensor": lambda x: x.clone() * 2}[between]
    got, given = _two_layers(tmp_path, fn)
    np.testing.assert_allclose(got, _want_stats(given), rtol=1e-6)
    # 2 layers x 5 states x (valid + padding slab) + 2 x 2 cache tensors, less the 2 slabs reused when the same
    assert spy.calls == 24 - (2 if between == "same" else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, "numpy"])
def test_sampled_gather_of_states_and_cache_slots_is_plain_indexing(dtype):
    """The sampled level's gather: rows by channels of a state, and of a cache tensor's slots (T, H·D) taken
    from its (H, T, D) layout without building the slots; bfloat16 widened exactly."""
    rng = np.random.default_rng(6)
    H, T, D = 4, 40, 16
    cache = torch.from_numpy(rng.standard_normal((H, T, D)).astype(np.float32))
    state = torch.from_numpy(rng.standard_normal((T, 96)).astype(np.float32))
    if dtype == "numpy":
        cache, state = cache.numpy(), state.numpy()
    else:
        cache, state = cache.to(dtype), state.to(dtype)
    rows = np.array([0, 3, 17, 39])
    for x, heads, width in ((state, None, 96), (cache, H, H * D)):
        ch = sampling.select_channels(width, 32, 0)
        assert len(ch) == 32 and (np.diff(ch) > 0).all()  # 32 distinct channels of the width
        as_rows = x if heads is None else (x.transpose(0, 1) if torch.is_tensor(x) else x.swapaxes(0, 1)).reshape(T, -1)
        if torch.is_tensor(as_rows):  # bfloat16 is stored as float32, other dtypes as they are
            as_rows = (as_rows.float() if as_rows.dtype == torch.bfloat16 else as_rows).numpy()
        want = as_rows[np.ix_(rows, ch)]
        got = sampling.gather(x, rows, ch, heads)
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_a_nan_minimum_or_maximum_stays_nan_whatever_is_added_before_or_after():
    """A tensor's running statistics over several slabs (prefill calls, chunks): one NaN value makes its minimum
    and maximum NaN, as numpy's min and max over the whole tensor would be, in either order; without NaN they
    are the extremes over every slab."""
    nan_slab = np.array([[1.0, np.nan]], np.float32)
    plain = np.array([[-5.0, 7.0]], np.float32)
    for order in ((nan_slab, plain), (plain, nan_slab)):
        st = reductions.RunningStats(2)
        for x in order:
            st.add(1, slab_stats(x))
        st.add(0, slab_stats(plain))
        st.add(0, slab_stats(plain * 2))
        t = st.table()
        assert np.isnan(t[1, 2]) and np.isnan(t[1, 3]) and t[1, 0] == 4 and t[1, 1] == 3
        assert t[0, 2] == -10.0 and t[0, 3] == 14.0 and t[0, 4] == pytest.approx(1.5)
