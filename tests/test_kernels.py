"""The compiled kernels (dumps/_kernels.c) against the numpy code they replace and against float64 computed
naively: the comparison's row pass (verify/metrics.py) and the recorder's statistics (dumps/recorder.py), on
special values, odd widths, strided rows and every bfloat16 pattern. tests/test_metrics.py and
tests/test_recorder_stats.py also run whole, once with the kernels and once without (conftest.both_kernels)."""
from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from prefill_diff.dumps import kernels, reductions
from prefill_diff.verify import metrics

K = kernels.compiled()
need = pytest.mark.skipif(K is None and os.environ.get("PREFILL_DIFF_REQUIRE_NATIVE") != "1",
                          reason=f"{kernels.describe()} (CI requires them: PREFILL_DIFF_REQUIRE_NATIVE=1)")
SPECIAL = [0.0, -0.0, np.nan, np.inf, -np.inf, 3e38, -3e38, 2e20, 1e-40, -1.5e19, 1.0, -2.5]


def test_built_where_required():
    """CI sets PREFILL_DIFF_REQUIRE_NATIVE=1: a build that failed (the extension is optional) fails here."""
    if os.environ.get("PREFILL_DIFF_REQUIRE_NATIVE") == "1":
        assert K is not None, kernels.describe()
    assert kernels.describe().startswith("compiled kernels: ")


def test_an_in_place_build_is_not_older_than_its_source():
    """The extension is optional: a build that fails (a compile error after an edit of _kernels.c) leaves the
    previous in-place build loaded, silently. An editable install's module must be newer than its source."""
    import glob
    src = os.path.join(os.path.dirname(kernels.__file__), "_kernels.c")
    for built in glob.glob(os.path.join(os.path.dirname(kernels.__file__), "_kernels*.so")):
        if os.path.exists(src):
            assert os.path.getmtime(built) >= os.path.getmtime(src), \
                f"{built} is older than {src}: rebuild it (pip install -e .) and read the compiler's errors"


def test_turned_off_by_environment():
    code = "from prefill_diff.dumps import kernels; print(kernels.compiled() is None, kernels.describe())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PREFILL_DIFF_NATIVE": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True compiled kernels: turned off (PREFILL_DIFF_NATIVE=0)"


def test_native_names_our_engine_only():
    """'native' is our engine (engine/native/, engine = "native"); the compiled kernels are dumps/kernels.py over
    dumps/_kernels.c, and no module of the four packages is named for 'native' (the switch users know,
    PREFILL_DIFF_NATIVE, keeps its name)."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    named = [p.relative_to(root).as_posix() for d in ("cli", "engine", "dumps", "verify") for p in (root / d).rglob("*")
             if "native" in p.stem and p.suffix in (".py", ".c")]
    assert not named, named
    assert (root / "engine" / "native" / "engine.py").exists() and kernels.__name__ == "prefill_diff.dumps.kernels"


def same(a: float, b: float) -> bool:
    return (np.isnan(a) and np.isnan(b)) or a == b


def rows_of(shape, dtype, rng, special: float = 0.0, strided: bool = False) -> tuple:
    """(r, c): c = r plus noise; a fraction ``special`` of both sides' elements replaced by SPECIAL values;
    ``strided``: views into wider arrays (rows not adjacent)."""
    T, W = shape
    r = rng.standard_normal(shape)
    c = r + 1e-3 * rng.standard_normal(shape)
    for x in (r, c):
        hit = rng.random(shape) < special
        x[hit] = rng.choice(SPECIAL, size=int(hit.sum()))
    r, c = r.astype(dtype), c.astype(dtype)
    if strided:
        wide_r, wide_c = np.zeros((T, W + 5), dtype), np.zeros((T, W + 9), dtype)
        wide_r[:, 2:2 + W], wide_c[:, 3:3 + W] = r, c
        r, c = wide_r[:, 2:2 + W], wide_c[:, 3:3 + W]
    return r, c


def kernel_pass(r, c):
    T = r.shape[0]
    out = [np.empty(T) for _ in range(4)]
    ext = K.row_pass(r, c, *out)
    return out, ext


@need
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 1500), (64, 1024), (2, 513)])
@pytest.mark.parametrize("special", [0.0, 0.01, 0.3])
@pytest.mark.parametrize("strided", [False, True])
def test_row_pass_matches_numpy(dtype, shape, special, strided):
    """Extremes exactly as numpy's (IEEE difference and quotient in the data's type; NaN rules of max, fmax,
    fmin); row sums within rounding of float64 sums."""
    rng = np.random.default_rng(zlib.crc32(repr((shape, special, strided, np.dtype(dtype).str)).encode()))
    r, c = rows_of(shape, dtype, rng, special, strided)
    (rr, dd, cc, dsum), (gmax, qmax, qmin) = kernel_pass(r, c)
    with np.errstate(all="ignore"):
        ref = metrics._numpy_pass(np.ascontiguousarray(r), np.ascontiguousarray(c))
        d = c - r
        q = d / r
    assert same(gmax, ref.gmax) and same(gmax, float(np.max(np.abs(d))))
    assert same(qmax, ref.qmax) and same(qmin, ref.qmin)
    assert same(qmax, float(np.fmax.reduce(q, axis=None))) and same(qmin, float(np.fmin.reduce(q, axis=None)))
    r64, c64, d64 = r.astype(np.float64), c.astype(np.float64), d.astype(np.float64)
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    with np.errstate(all="ignore"):
        for got, want, scale in ((rr, r64 * r64, r64 * r64), (cc, c64 * c64, c64 * c64), (dd, d64 * d64, d64 * d64),
                                 (dsum, np.abs(d64), np.abs(d64))):
            want, scale = want.sum(axis=1), scale.sum(axis=1)
            fin = np.isfinite(want) & (scale < 1e37 if dtype == np.float32 else np.isfinite(scale))
            np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=0)
            assert (~np.isfinite(got[~np.isfinite(want)])).all()  # a NaN or infinity shows in the row's sum


@need
def test_row_pass_quotients_all_nan():
    """Every quotient 0/0: the extremes are NaN, as fmax/fmin of all-NaN; the largest difference is 0."""
    z = np.zeros((3, 40), np.float32)
    _, (gmax, qmax, qmin) = kernel_pass(z, z.copy())
    assert gmax == 0.0 and np.isnan(qmax) and np.isnan(qmin)
    r = np.zeros((2, 20), np.float32)
    c = r.copy()
    c[1, 7] = -1.0  # -1/0 = -inf: a quotient, so no NaN
    _, (gmax, qmax, qmin) = kernel_pass(r, c)
    assert gmax == 1.0 and qmax == -np.inf and qmin == -np.inf


@need
def test_row_pass_refuses_what_it_cannot_read():
    a = np.zeros((4, 8), np.float32)
    out = [np.empty(4) for _ in range(4)]
    with pytest.raises(ValueError, match="one type and shape"):
        K.row_pass(a, a.astype(np.float64), *out)
    with pytest.raises(ValueError, match="one type and shape"):
        K.row_pass(a, np.zeros((4, 9), np.float32), *out)
    with pytest.raises(ValueError, match="contiguous rows"):
        K.row_pass(a[:, ::2], a[:, ::2], *out)
    with pytest.raises(ValueError, match="float64 buffer of 4"):
        K.row_pass(a, a, np.empty(3), *out[1:])
    with pytest.raises(ValueError, match="one type and shape"):
        K.row_pass(a.astype(np.int32), a.astype(np.int32), *out)


@need
@settings(max_examples=examples(60), deadline=None)
@given(st.integers(1, 6), st.integers(1, 700), st.sampled_from([np.float32, np.float64]),
       st.lists(st.sampled_from(SPECIAL), max_size=6), st.integers(0, 2 ** 31))
def test_row_pass_property(T, W, dtype, specials, seed):
    rng = np.random.default_rng(seed)
    r, c = rows_of((T, W), dtype, rng)
    for v in specials:
        (r if rng.random() < 0.5 else c)[rng.integers(T), rng.integers(W)] = v
    _, (gmax, qmax, qmin) = kernel_pass(r, c)
    with np.errstate(all="ignore"):
        ref = metrics._numpy_pass(r, c)
    assert same(gmax, ref.gmax) and same(qmax, ref.qmax) and same(qmin, ref.qmin)


def numpy_stats(a, bfloat16=False):
    return reductions._numpy_stats(a, a.size, bfloat16=bfloat16)


@need
@pytest.mark.parametrize("dtype", [np.float32, np.float64, "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 3), (4, 5), (7, 1031), (256, 64), (2, 4096)])
@pytest.mark.parametrize("strided", [False, True])
def test_stats_match_numpy(dtype, shape, strided):
    """Minimum, maximum and checksum exactly the numpy code's (the checksum composes over rows whose byte length
    is not a multiple of 8); sums within rounding of float64."""
    rng = np.random.default_rng(sum(shape) + strided)
    x = (rng.standard_normal(shape) * 40).astype(np.float32 if dtype == "bfloat16" else dtype)
    if dtype == "bfloat16":
        a = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
        values = reductions.widen_bfloat16(a).astype(np.float64)
    else:
        a, values = x, x.astype(np.float64)
    if strided:
        wide = np.zeros((shape[0], shape[1] + 3), a.dtype)
        wide[:, 1:1 + shape[1]] = a
        a = wide[:, 1:1 + shape[1]]
    bf = dtype == "bfloat16"
    lo, hi, s, ss, chk = K.stats(a, bf)
    want = numpy_stats(np.ascontiguousarray(a), bf)
    assert (lo, hi, chk) == (want[2], want[3], want[6])
    assert lo == values.min() and hi == values.max()
    rtol = 1e-5 if dtype != np.float64 else 1e-12
    np.testing.assert_allclose(s, values.sum(), rtol=0, atol=rtol * np.abs(values).sum())
    np.testing.assert_allclose(ss, (values * values).sum(), rtol=rtol)


@need
def test_stats_non_finite_and_empty():
    a = np.array([[1.0, np.nan, -np.inf, 2.0]], np.float32)
    lo, hi, s, ss, _ = K.stats(a, False)
    assert np.isnan(lo) and np.isnan(hi) and np.isnan(s)
    a = np.array([[1.0, np.inf, -3.0]], np.float64)
    lo, hi, s, ss, _ = K.stats(a, False)
    assert (lo, hi, s, ss) == (-3.0, np.inf, np.inf, np.inf)
    assert K.stats(np.zeros((0, 4), np.float32), False)[:2] == (np.inf, -np.inf)
    # what slab_stats makes of them with the kernels: the numpy code's answer (it recounts non-finite values)
    for x in (np.array([[1.0, np.nan, -np.inf, 2.0]], np.float32), np.full((2, 3), 3e38, np.float32)):
        got, want = reductions.slab_stats(x), numpy_stats(x)
        assert np.allclose(np.array(got[:6], float), np.array(want[:6], float), equal_nan=True) and got[6] == want[6]


@need
def test_stats_every_bfloat16_pattern():
    """All 65536 patterns, one row each of 8: NaN patterns make min and max NaN; the rest exact."""
    bits = np.arange(65536, dtype=np.uint16).view(np.int16).reshape(-1, 8)
    values = reductions.widen_bfloat16(bits)
    for i in range(0, bits.shape[0], 512):
        blk, v = bits[i:i + 512], values[i:i + 512]
        lo, hi, _, _, chk = K.stats(blk, True)
        want = numpy_stats(blk, True)
        assert chk == want[6]
        if np.isnan(v).any():
            assert np.isnan(lo) and np.isnan(hi)
        else:
            assert (lo, hi) == (float(v.min()), float(v.max()))


@need
def test_stats_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="bfloat16 patterns"):
        K.stats(np.zeros((2, 2), np.int16), False)
    with pytest.raises(ValueError, match="bfloat16 patterns"):
        K.stats(np.zeros((2, 2), np.float32), True)
    with pytest.raises(ValueError, match="contiguous rows"):
        K.stats(np.zeros((2, 4), np.float32)[:, ::2], False)


def test_version_says_whether_the_kernels_are_used():
    from click.testing import CliRunner

    from prefill_diff.cli.main import cli
    out = CliRunner().invoke(cli, ["--version"])
    assert out.exit_code == 0 and kernels.describe() in out.output


def shared_call(r, c, threads: int, late_helper: bool = False):
    """row_pass over a slab shared through one state by ``threads`` callers (the last one waits), optionally with
    a helper that starts only after the slab is done; returns the outputs, each caller's slot and the state."""
    import threading
    T = r.shape[0]
    out = [np.full(T, -1.0) for _ in range(4)]
    state = np.zeros(2, np.int64)
    slots = np.array([[0.0, -np.inf, np.inf, 0.0]] * (threads + late_helper))
    helpers = [threading.Thread(target=K.row_pass, args=(r, c, *out, state, slots[i], False))
               for i in range(threads - 1)]
    for h in helpers:
        h.start()
    K.row_pass(r, c, *out, state, slots[threads - 1], True)
    done = [o.copy() for o in out]  # what the waiting caller may use the moment it returns
    for h in helpers:
        h.join()
    if late_helper:
        before = slots[-1].copy()
        assert K.row_pass(r, c, *out, state, slots[-1], False) is None
        assert np.array_equal(slots[-1], before) and all(np.array_equal(o, d, equal_nan=True)
                                                          for o, d in zip(out, done))  # touched nothing
    return done, slots, state


@need
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("special", [0.0, 0.05])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_shared_rows_give_what_one_call_gives(dtype, special, threads):
    """Each row is computed whole by one thread with the same code: the per-row sums are identical to a single
    call's, and the slots' merged extremes equal its extremes, however the rows fell to the threads."""
    rng = np.random.default_rng(threads + int(special * 100))
    r, c = rows_of((333, 257), dtype, rng, special)
    (rr, dd, cc, dsum), ext = kernel_pass(r, c)
    done, slots, state = shared_call(r, c, threads, late_helper=True)
    assert state[1] == r.shape[0] and state[0] >= r.shape[0]
    for got, want in zip(done, (rr, dd, cc, dsum)):
        assert np.array_equal(got, want, equal_nan=True)
    saved = metrics.SHARE_BYTES
    try:
        metrics.SHARE_BYTES = 1
        s = metrics._pass(r, c)  # the module's own sharing, with its executor
    finally:
        metrics.SHARE_BYTES = saved
    assert same(s.gmax, ext[0]) and same(s.qmax, ext[1]) and same(s.qmin, ext[2])
    assert np.array_equal(s.dd, dd, equal_nan=True) and np.array_equal(s.rr, rr, equal_nan=True)
    gmax = slots[:, 0].max()
    assert same(np.nan if slots[:, 3].any() else gmax, ext[0])


@need
def test_shared_quotients_all_nan_and_refused_arguments():
    z = np.zeros((40, 8), np.float32)
    saved = metrics.SHARE_BYTES
    try:
        metrics.SHARE_BYTES = 1
        s = metrics._pass(z, z.copy())
    finally:
        metrics.SHARE_BYTES = saved
    assert s.gmax == 0.0 and np.isnan(s.qmax) and np.isnan(s.qmin)
    out = [np.empty(40) for _ in range(4)]
    with pytest.raises(TypeError, match="go together"):
        K.row_pass(z, z, *out, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="state"):
        K.row_pass(z, z, *out, np.zeros(2, np.int32), np.zeros(4), True)
    with pytest.raises(ValueError, match="slot"):
        K.row_pass(z, z, *out, np.zeros(2, np.int64), np.zeros(3), True)


@need
def test_the_waiting_caller_returns_only_when_every_row_is_done():
    """Every row claimed, the last chunk not finished by the other thread: the caller with wait blocks until
    that chunk is counted done (its buffers are reused the moment it returns)."""
    import threading
    r = np.ones((64, 8), np.float32)
    out = [np.zeros(64) for _ in range(4)]
    state = np.array([64, 48], np.int64)  # all rows handed out; 16 still being computed elsewhere
    slot = np.array([0.0, -np.inf, np.inf, 0.0])
    waiter = threading.Thread(target=K.row_pass, args=(r, r, *out, state, slot, True))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # still waiting for the 16 rows
    state[1] += 16
    waiter.join(10)
    assert not waiter.is_alive() and (slot == [0.0, -np.inf, np.inf, 0.0]).all()  # it computed no row itself


@need
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_at_any_byte_offset(dtype):
    """Rows mapped from a trace often start at an odd byte (HDF5 aligns nothing): the kernels read them as they
    read aligned rows, and the comparison's pass gives the numpy pass's results."""
    rng = np.random.default_rng(3)
    r, c = rows_of((9, 37), dtype, rng, 0.05)
    item = np.dtype(dtype).itemsize
    raw = np.zeros(2 * r.nbytes + 16, np.uint8)
    mr = np.frombuffer(raw.data, dtype=dtype, count=r.size, offset=1).reshape(r.shape)
    mc = np.frombuffer(raw.data, dtype=dtype, count=c.size, offset=3 + r.nbytes).reshape(c.shape)
    raw[1:1 + r.nbytes] = np.frombuffer(r.tobytes(), np.uint8)
    raw[3 + r.nbytes:3 + r.nbytes + c.nbytes] = np.frombuffer(c.tobytes(), np.uint8)
    assert not mr.flags.aligned and not mc.flags.aligned and item > 1
    (rr, dd, cc, dsum), ext = kernel_pass(mr, mc)
    (rr2, dd2, cc2, dsum2), ext2 = kernel_pass(r, c)
    assert all(same(a, b) for a, b in zip(ext, ext2))
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip((rr, dd, cc, dsum), (rr2, dd2, cc2, dsum2)))
    s, want = metrics._pass(mr, mc), metrics._numpy_pass(r, c)
    assert same(s.gmax, want.gmax) and same(s.qmax, want.qmax) and same(s.qmin, want.qmin)
    got, exp = K.stats(mr, False), numpy_stats(np.ascontiguousarray(r))
    assert got[4] == exp[6] and (np.isnan(got[0]) or got[0] == exp[2])
