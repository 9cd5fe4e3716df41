/* One-pass reductions over rows of floats, for the recorder's statistics and the comparison's metrics.

   numpy needs one call, and one pass over the data, per quantity (a minimum, a maximum, a sum, a sum of
   squares, a checksum; a difference, a quotient, their extremes and three sums of squares); this module
   computes each group in one pass, with the GIL released. It is optional: built when a C compiler is
   at hand (pyproject.toml), otherwise dumps/kernels.py says so and the numpy code does the same work.

   Semantics kept from the numpy code (dumps/reductions.py slab_stats, verify/metrics.py _pass):
   - minima and maxima are NaN when any value is NaN (numpy's min/max), an infinity counts as a value;
   - the signed relative error's extremes ignore NaN (numpy's fmax/fmin) and are NaN when every quotient is;
   - differences and quotients are computed in the data's type, exactly as numpy does (IEEE; no fast-math);
   - a sum is taken in the data's type over runs of at most RUN values, the runs added in double;
   - the checksum is the wrapped 64-bit sum of each row's bytes as little-endian 8-byte words, the last word
     of a row zero-padded (so it composes over any split into rows), exactly as the numpy code computes it.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <sched.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

#define RUN 512 /* values summed in the data's type before the sum is carried on in double */

/* Rows mapped from a trace need not be aligned to their type: HDF5 places data at any byte (a row of float32
   at an odd offset is common). These types tell the compiler so; it then uses unaligned loads, which cost
   nothing on x86. A compiler without the attribute gets only aligned rows (get2d refuses the others, and the
   Python callers use numpy for them). */
#if defined(__GNUC__)
typedef float f32u __attribute__((aligned(1)));
typedef double f64u __attribute__((aligned(1)));
typedef uint16_t u16u __attribute__((aligned(1)));
#define UNALIGNED_OK 1
#else
typedef float f32u;
typedef double f64u;
typedef uint16_t u16u;
#define UNALIGNED_OK 0
#endif

/* ---- the comparison's pass: r (reference) and c (candidate) rows ------------------------------------ */

/* The extremes of some rows, raw: qmax stays -inf and qmin +inf when no quotient was a number; nan is set when a
   difference was NaN. Merged over rows in any order, then finished (finish_ext). */
typedef struct {
    double gmax, qmax, qmin;
    int nan;
} Ext;

#define ROW_PASS(NAME, T, TU, ABS)                                                                              \
    CLONES static void NAME(const char *r0, const char *c0, Py_ssize_t t0, Py_ssize_t t1, Py_ssize_t width,  \
                            Py_ssize_t r_stride, Py_ssize_t c_stride, double *rr, double *dd, double *cc,   \
                            double *dsum, Ext *e)                                                           \
    {                                                                                                       \
        T gmax = 0, qmax = -INFINITY, qmin = INFINITY;                                                      \
        int nan = 0;                                                                                        \
        for (Py_ssize_t t = t0; t < t1; t++) {                                                              \
            const TU *a = (const TU *)(r0 + t * r_stride), *b = (const TU *)(c0 + t * c_stride);           \
            double Rr = 0, Dd = 0, Cc = 0, Ds = 0;                                                          \
            for (Py_ssize_t i0 = 0; i0 < width; i0 += RUN) {                                                \
                Py_ssize_t i1 = i0 + RUN < width ? i0 + RUN : width;                                        \
                T srr = 0, sdd = 0, scc = 0, sds = 0;                                                       \
                _Pragma("omp simd reduction(+:srr,sdd,scc,sds) reduction(max:gmax,qmax) reduction(min:qmin) reduction(|:nan)") \
                for (Py_ssize_t i = i0; i < i1; i++) {                                                      \
                    T x = a[i], y = b[i], d = y - x, q = d / x, ad = ABS(d);                                \
                    srr += x * x;                                                                           \
                    scc += y * y;                                                                           \
                    sdd += d * d;                                                                           \
                    sds += ad;                                                                              \
                    gmax = ad > gmax ? ad : gmax;                                                           \
                    nan |= d != d;                                                                          \
                    qmax = q > qmax ? q : qmax;                                                             \
                    qmin = q < qmin ? q : qmin;                                                             \
                }                                                                                           \
                Rr += srr; Dd += sdd; Cc += scc; Ds += sds;                                                  \
            }                                                                                               \
            rr[t] = Rr; dd[t] = Dd; cc[t] = Cc; dsum[t] = Ds;                                               \
        }                                                                                                   \
        if (gmax > e->gmax) e->gmax = gmax;                                                                 \
        if (qmax > e->qmax) e->qmax = qmax;                                                                 \
        if (qmin < e->qmin) e->qmin = qmin;                                                                 \
        e->nan |= nan;                                                                                      \
    }

ROW_PASS(row_pass_f32, float, f32u, fabsf)
ROW_PASS(row_pass_f64, double, f64u, fabs)

typedef void (*pass_fn)(const char *, const char *, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                        double *, double *, double *, double *, Ext *);

#define SHARED_CHUNK 16 /* rows claimed at a time when two threads share one slab */

/* Two threads share one slab: each claims SHARED_CHUNK rows at a time from state[0] and, after writing them and
   merging its extremes into its own slot, adds their number to state[1]. The caller that waits returns only when
   every row is done, so that its buffers may be reused; a helper that starts late finds no rows and touches
   nothing. Each row is computed whole by one thread, by the same code: the results do not depend on the split. */
static void run_shared(pass_fn f, const char *r0, const char *c0, Py_ssize_t rows, Py_ssize_t width,
                       Py_ssize_t r_stride, Py_ssize_t c_stride, double **out, int64_t *state, double *slot,
                       int wait)
{
    for (;;) {
        int64_t t0 = __atomic_fetch_add(&state[0], SHARED_CHUNK, __ATOMIC_RELAXED);
        if (t0 >= rows)
            break;
        int64_t t1 = t0 + SHARED_CHUNK < rows ? t0 + SHARED_CHUNK : rows;
        Ext e = {slot[0], slot[1], slot[2], slot[3] != 0};
        f(r0, c0, t0, t1, width, r_stride, c_stride, out[0], out[1], out[2], out[3], &e);
        slot[0] = e.gmax; slot[1] = e.qmax; slot[2] = e.qmin; slot[3] = e.nan;
        __atomic_fetch_add(&state[1], t1 - t0, __ATOMIC_RELEASE);
    }
    if (wait)
        while (__atomic_load_n(&state[1], __ATOMIC_ACQUIRE) < rows)
            sched_yield(); /* the other thread is inside its last chunk */
}

/* ---- the recorder's statistics of one block of rows --------------------------------------------------- */

typedef struct {
    double lo, hi, sum, sumsq;
    int nan;
    uint64_t checksum;
} Acc;

static inline uint64_t sum_words(const char *p, Py_ssize_t nbytes)
{
    /* nbytes from p as little-endian 8-byte words, the last zero-padded (little-endian: checked in kernels.py) */
    uint64_t s = 0;
    Py_ssize_t words = nbytes / 8, tail = nbytes % 8;
    for (Py_ssize_t i = 0; i < words; i++) {
        uint64_t w;
        memcpy(&w, p + 8 * i, 8);
        s += w;
    }
    if (tail) {
        uint64_t w = 0;
        memcpy(&w, p + 8 * words, (size_t)tail);
        s += w;
    }
    return s;
}

#define STATS(NAME, T, LOAD, ITEM)                                                                                \
    CLONES static void NAME(const char *p, Py_ssize_t rows, Py_ssize_t width, Py_ssize_t stride, Acc *acc)  \
    {                                                                                                       \
        T lo = INFINITY, hi = -INFINITY;                                                                    \
        int nan = 0;                                                                                        \
        double s = 0, ss = 0;                                                                               \
        uint64_t chk = 0;                                                                                   \
        for (Py_ssize_t t = 0; t < rows; t++) {                                                             \
            const void *row = p + t * stride;                                                               \
            for (Py_ssize_t i0 = 0; i0 < width; i0 += RUN) {                                                \
                Py_ssize_t i1 = i0 + RUN < width ? i0 + RUN : width;                                        \
                T su = 0, sq = 0;                                                                           \
                _Pragma("omp simd reduction(+:su,sq) reduction(min:lo) reduction(max:hi) reduction(|:nan)") \
                for (Py_ssize_t i = i0; i < i1; i++) {                                                      \
                    T x = LOAD(row, i);                                                                     \
                    su += x;                                                                                \
                    sq += x * x;                                                                            \
                    lo = x < lo ? x : lo;                                                                   \
                    hi = x > hi ? x : hi;                                                                   \
                    nan |= x != x;                                                                          \
                }                                                                                           \
                s += su;                                                                                    \
                ss += sq;                                                                                   \
                chk += sum_words((const char *)row + i0 * ITEM, (i1 - i0) * ITEM); /* while in L1 */        \
            }                                                                                               \
        }                                                                                                   \
        acc->lo = lo; acc->hi = hi; acc->sum = s; acc->sumsq = ss; acc->nan = nan; acc->checksum = chk;     \
    }

static inline float load_f32(const void *row, Py_ssize_t i) { return ((const f32u *)row)[i]; }
static inline double load_f64(const void *row, Py_ssize_t i) { return ((const f64u *)row)[i]; }
static inline float load_bf16(const void *row, Py_ssize_t i)
{
    uint32_t u = (uint32_t)((const u16u *)row)[i] << 16; /* a bfloat16 is the top half of a float32 */
    float f;
    memcpy(&f, &u, 4);
    return f;
}

STATS(stats_f32, float, load_f32, 4)
STATS(stats_f64, double, load_f64, 8)
STATS(stats_bf16, float, load_bf16, 2)

/* ---- argument checks: buffers of the expected format, rank and layout ---------------------------------- */

static char kind(const Py_buffer *v)
{
    /* the one-letter struct code of a native little-endian scalar format ("f", "<f", "=d"...), else '?' */
    const char *f = v->format ? v->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    return f[0] != '\0' && f[1] == '\0' ? f[0] : '?';
}

static int get2d(PyObject *obj, Py_buffer *v, const char *what, int writable)
{
    if (PyObject_GetBuffer(obj, v, PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    int misaligned = ((uintptr_t)v->buf | (uintptr_t)v->strides[0]) % (uintptr_t)v->itemsize != 0;
    if (v->ndim != 2 || v->strides[1] != v->itemsize || v->strides[0] < 0 || (misaligned && !UNALIGNED_OK)) {
        PyErr_Format(PyExc_ValueError, "%s: a 2-D buffer with contiguous rows is needed", what);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static int get_vec(PyObject *obj, Py_buffer *v, const char *what, const char *codes, const char *type,
                   Py_ssize_t n)
{
    /* a writable contiguous buffer of n 8-byte values whose struct code is one of codes */
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return -1;
    char k = kind(v);
    if (k == '?' || strchr(codes, k) == NULL || v->itemsize != 8 || v->len != n * 8) {
        PyErr_Format(PyExc_ValueError, "%s: a contiguous %s buffer of %zd values is needed", what, type, n);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(row_pass_doc,
"row_pass(r, c, rr, dd, cc, dsum) -> (max |c - r|, max (c - r)/r, min (c - r)/r)\n"
"row_pass(r, c, rr, dd, cc, dsum, state, slot, wait) -> None\n\n"
"r, c: float32 or float64 rows (T, W), the same type; rr, dd, cc, dsum: float64 (T,) filled with each row's\n"
"sum of r*r, (c-r)^2, c*c and |c - r|. The first extreme is NaN if any difference is; the quotient's\n"
"extremes ignore NaN and are NaN when every quotient is.\n\n"
"With state (int64 [next row, rows done], zeros) and slot (float64 [0, -inf, inf, 0]), two threads share the\n"
"rows: each merges its raw extremes (max |c - r|, max and min quotient, NaN seen) into its own slot; the one\n"
"called with wait true returns when every row is done (verify/metrics.py finishes the two slots).");

static PyObject *row_pass(PyObject *self, PyObject *args)
{
    PyObject *ro, *co, *o[4], *so = NULL, *lo = NULL;
    int wait = 0;
    if (!PyArg_ParseTuple(args, "OOOOOO|OOp:row_pass", &ro, &co, &o[0], &o[1], &o[2], &o[3], &so, &lo, &wait))
        return NULL;
    if ((so == NULL) != (lo == NULL)) {
        PyErr_SetString(PyExc_TypeError, "row_pass: state and slot go together");
        return NULL;
    }
    Py_buffer r, c, out[4], st, sl;
    int got = 0, shared = 0;
    PyObject *result = NULL;
    if (get2d(ro, &r, "r", 0) < 0)
        return NULL;
    if (get2d(co, &c, "c", 0) < 0)
        goto done_r;
    char k = kind(&r);
    if (k != kind(&c) || (k != 'f' && k != 'd') || r.shape[0] != c.shape[0] || r.shape[1] != c.shape[1]) {
        PyErr_SetString(PyExc_ValueError, "r and c: float32 or float64 rows of one type and shape are needed");
        goto done;
    }
    for (; got < 4; got++)
        if (get_vec(o[got], &out[got], "rr, dd, cc, dsum", "d", "float64", r.shape[0]) < 0)
            goto done;
    if (so != NULL) {
        if (get_vec(so, &st, "state", "qlQL", "int64", 2) < 0)
            goto done;
        if (get_vec(lo, &sl, "slot", "d", "float64", 4) < 0) {
            PyBuffer_Release(&st);
            goto done;
        }
        shared = 1;
    }
    pass_fn f = k == 'f' ? row_pass_f32 : row_pass_f64;
    double *bufs[4] = {out[0].buf, out[1].buf, out[2].buf, out[3].buf};
    Ext e = {0, -INFINITY, INFINITY, 0};
    Py_BEGIN_ALLOW_THREADS
    if (shared)
        run_shared(f, r.buf, c.buf, r.shape[0], r.shape[1], r.strides[0], c.strides[0], bufs, st.buf, sl.buf, wait);
    else
        f(r.buf, c.buf, 0, r.shape[0], r.shape[1], r.strides[0], c.strides[0], bufs[0], bufs[1], bufs[2], bufs[3], &e);
    Py_END_ALLOW_THREADS
    if (shared) {
        PyBuffer_Release(&sl);
        PyBuffer_Release(&st);
        result = Py_NewRef(Py_None);
    } else {
        int none = e.qmax < e.qmin; /* no quotient was a number: both stayed at their start */
        result = Py_BuildValue("(ddd)", e.nan ? NAN : e.gmax, none ? NAN : e.qmax, none ? NAN : e.qmin);
    }
done:
    while (got > 0)
        PyBuffer_Release(&out[--got]);
    PyBuffer_Release(&c);
done_r:
    PyBuffer_Release(&r);
    return result;
}

PyDoc_STRVAR(stats_doc,
"stats(a, bfloat16) -> (min, max, sum, sum of squares, checksum)\n\n"
"a: rows (R, W) of float32 or float64, or with bfloat16 true, 16-bit integers holding bfloat16 bit patterns.\n"
"min and max are NaN if any value is; the checksum is the signed 64-bit wrapped sum of each row's 8-byte\n"
"words (the last zero-padded).");

static PyObject *stats(PyObject *self, PyObject *args)
{
    PyObject *ao;
    int bf16;
    if (!PyArg_ParseTuple(args, "Op:stats", &ao, &bf16))
        return NULL;
    Py_buffer a;
    if (get2d(ao, &a, "a", 0) < 0)
        return NULL;
    char k = kind(&a);
    int ok = bf16 ? (k == 'h' || k == 'H') && a.itemsize == 2 : (k == 'f' || k == 'd');
    if (!ok) {
        PyBuffer_Release(&a);
        PyErr_SetString(PyExc_ValueError, "a: float32 or float64 rows, or 16-bit bfloat16 patterns, are needed");
        return NULL;
    }
    Acc acc = {0};
    Py_ssize_t rows = a.shape[0], width = a.shape[1];
    Py_BEGIN_ALLOW_THREADS
    if (bf16)
        stats_bf16(a.buf, rows, width, a.strides[0], &acc);
    else
        (k == 'f' ? stats_f32 : stats_f64)(a.buf, rows, width, a.strides[0], &acc);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&a);
    if (rows * width == 0)
        acc.lo = INFINITY, acc.hi = -INFINITY;
    else if (acc.nan)
        acc.lo = acc.hi = NAN;
    return Py_BuildValue("(ddddL)", acc.lo, acc.hi, acc.sum, acc.sumsq, (long long)(int64_t)acc.checksum);
}

static PyMethodDef methods[] = {
    {"row_pass", row_pass, METH_VARARGS, row_pass_doc},
    {"stats", stats, METH_VARARGS, stats_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                     "One-pass reductions over rows of floats (see dumps/kernels.py).", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "unaligned_ok", UNALIGNED_OK) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
