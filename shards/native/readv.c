/* shards._readv: a batch's members from the shard files into the batch tensors, and their XXH3-64,
 * in one call that holds no GIL.
 *
 * The plan (which bytes of which file go where, which member each run belongs to, the checksum the
 * index recorded for it) is built with numpy by shards/readinto.py; this file only carries it out:
 * one preadv per stretch of a file (runs at most READ_THROUGH bytes apart, at most READ_CAP bytes
 * beyond the stretch's first run, the bytes in between going to a scratch buffer), and each member
 * hashed right after the preadv that completes it, while its bytes are still in the core's cache;
 * for a batch that is not compact, each member is then widened into the batch tensor's dtype
 * (convert(): what the field kinds' widen_host does, named by shards.readinto.CONVERSIONS). The
 * pure-Python executor in shards/readinto.py reads and checks the same way with os.preadv and
 * xxhash (and widens after the read); tests/test_native_read.py compares the two.
 *
 * Why C: from Python every preadv and every hash of more than 64 KiB is a hand-over of the GIL;
 * with two read threads a batch of 16 samples of 360 KiB made ~60 of them, and the threads spent
 * more time waiting for the GIL than copying (2 read threads were slower than 1). Here a batch is
 * one release of the GIL: two threads copy and hash in parallel.
 *
 * Nothing here raises for a damaged sample: status[m] says 0 (read, checksum equal or not
 * checked), 1 (checksum mismatch; got[m] holds the XXH3-64 of the bytes read) or 2 (the file ended
 * before the member's last byte). OSError for a failing preadv (EIO...), ValueError for a plan that
 * would write outside its buffers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include "xxhash/xxhash.h"
#if defined(SHARDS_XXH_DISPATCH)
#include "xxhash/xxh_x86dispatch.h" /* XXH3_64bits -> the AVX2/AVX512 code where the CPU has it */
#endif

#define MAX_IOV 1024
/* the calling convention of read_members; shards/readinto.py uses the module only when it matches
 * (an extension built from older sources, before `pip install -e .` ran again, is left unused) */
#define API_VERSION 2

typedef struct {
    Py_buffer view;
    int held;
} Buf;

/* A C-contiguous buffer of exactly `count` elements of `size` bytes (writable when asked). */
static int
get_array(PyObject *obj, Buf *b, Py_ssize_t size, Py_ssize_t count, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, &b->view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    b->held = 1;
    if (count >= 0 && b->view.len != size * count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, b->view.len, size * count);
        return -1;
    }
    if (count < 0 && b->view.len % size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items", what,
                     b->view.len, size);
        return -1;
    }
    return 0;
}

static void
release(Buf *bufs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (bufs[i].held) {
            PyBuffer_Release(&bufs[i].view);
            bufs[i].held = 0;
        }
}

/* preadv until `total` bytes were read or the file ends (a shorter count); -1 with errno on error.
 * `iov` is modified. */
static int64_t
read_all(int fd, struct iovec *iov, int niov, int64_t start, int64_t total)
{
    int64_t done = 0;
    while (done < total) {
        ssize_t got = preadv(fd, iov, niov, (off_t)(start + done));
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (got == 0)
            break;
        done += got;
        while (niov && (size_t)got >= iov->iov_len) { /* drop the buffers filled */
            got -= (ssize_t)iov->iov_len;
            iov++;
            niov--;
        }
        if (niov && got) { /* cut the one half filled */
            iov->iov_base = (char *)iov->iov_base + got;
            iov->iov_len -= (size_t)got;
        }
    }
    return done;
}

/* Widening of a run from the stored dtype (in the staging buffer, still in cache: the member was just
 * read and hashed) into the batch tensor's dtype: what shards.kinds' widen_host does for a batch that is
 * not compact (shards.readinto.CONVERSIONS names them). Every conversion is exact. */
enum { CONV_NONE = 0, CONV_I16_F32 = 1, CONV_F16_F32 = 2, CONV_BF16_F32 = 3, CONV_I16_I64 = 4, CONV_I32_I64 = 5 };
static const int conv_in[] = {0, 2, 2, 2, 2, 4}, conv_out[] = {0, 4, 4, 4, 8, 8};

/* IEEE half -> float (exact; subnormals, inf and NaN included) */
static inline float
half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F)
        bits = sign | 0x7F800000 | (man << 13);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man)
        bits = sign;
    else { /* subnormal: normalise */
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define HAVE_F16C_PATH 1
__attribute__((target("avx,f16c"))) static void
f16_f32_f16c(const uint16_t *in, float *out, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
    for (; i < n; i++)
        out[i] = half_to_float(in[i]);
}

/* Large outputs with non-temporal stores: a batch tensor of several MB does not stay in cache, and a
 * plain store first reads each line it writes (twice the memory traffic). */
__attribute__((target("avx2,f16c"))) static void
f16_f32_stream(const uint16_t *in, float *out, size_t n)
{
    size_t i = 0;
    for (; i < n && ((uintptr_t)(out + i) & 31); i++)
        out[i] = half_to_float(in[i]);
    for (; i + 8 <= n; i += 8)
        _mm256_stream_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
    for (; i < n; i++)
        out[i] = half_to_float(in[i]);
}

__attribute__((target("avx2"))) static void
i16_f32_stream(const int16_t *in, float *out, size_t n, float s)
{
    size_t i = 0;
    for (; i < n && ((uintptr_t)(out + i) & 31); i++)
        out[i] = (float)in[i] * s;
    __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(in + i)));
        _mm256_stream_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), vs));
    }
    for (; i < n; i++)
        out[i] = (float)in[i] * s;
}
#endif

static int has_f16c = 0, has_avx2 = 0;
#define STREAM_MIN 16384 /* elements: below, plain stores (the output may be read soon, from cache) */

static void
convert(int op, double scale, const char *in, char *out, size_t n)
{
    size_t i;
    switch (op) {
    case CONV_I16_F32: {
#ifdef HAVE_F16C_PATH
        if (has_avx2 && n >= STREAM_MIN) {
            i16_f32_stream((const int16_t *)in, (float *)out, n, (float)scale);
            break;
        }
#endif
        const int16_t *a = (const int16_t *)in;
        float *b = (float *)out, s = (float)scale;
        for (i = 0; i < n; i++)
            b[i] = (float)a[i] * s;
        break;
    }
    case CONV_F16_F32: {
#ifdef HAVE_F16C_PATH
        if (has_f16c && has_avx2 && n >= STREAM_MIN) {
            f16_f32_stream((const uint16_t *)in, (float *)out, n);
            break;
        }
        if (has_f16c) {
            f16_f32_f16c((const uint16_t *)in, (float *)out, n);
            break;
        }
#endif
        const uint16_t *a = (const uint16_t *)in;
        float *b = (float *)out;
        for (i = 0; i < n; i++)
            b[i] = half_to_float(a[i]);
        break;
    }
    case CONV_BF16_F32: {
        const uint16_t *a = (const uint16_t *)in;
        uint32_t *b = (uint32_t *)out;
        for (i = 0; i < n; i++)
            b[i] = (uint32_t)a[i] << 16;
        break;
    }
    case CONV_I16_I64: {
        const int16_t *a = (const int16_t *)in;
        int64_t *b = (int64_t *)out;
        for (i = 0; i < n; i++)
            b[i] = a[i];
        break;
    }
    case CONV_I32_I64: {
        const int32_t *a = (const int32_t *)in;
        int64_t *b = (int64_t *)out;
        for (i = 0; i < n; i++)
            b[i] = a[i];
        break;
    }
    }
}

PyDoc_STRVAR(read_members_doc,
"read_members(fd, off, n, buf, dst, buffers, last, want, check, status, got, read_through, read_cap, convs=None)\n"
"\n"
"Copy the runs of a batch from files into buffers and check each member's XXH3-64, holding no GIL.\n"
"\n"
"Runs (sorted by file, then offset; each member's runs consecutive): fd int32, off int64 (byte\n"
"in the file), n int64 (bytes), buf int32 (index into `buffers`, a tuple of writable buffers),\n"
"dst int64 (byte in that buffer). Members: last int64 (index of the member's last run, ascending),\n"
"want uint64 (the recorded XXH3-64), check uint8 (1: compare), and the outputs status int8\n"
"(0 ok, 1 checksum mismatch, 2 file ended inside the member) and got uint64 (the XXH3-64 of the\n"
"bytes read, where checked). convs: None, or per buffer None or (out, op, scale): once a member is read\n"
"(and checked), its runs in that buffer are widened into the writable buffer `out` at the same element\n"
"index (op: 1 int16->float32 times scale, 2 float16->float32, 3 bfloat16 bits->float32, 4 int16->int64,\n"
"5 int32->int64). Returns how many members have a nonzero status.");

static PyObject *
read_members(PyObject *self, PyObject *args)
{
    PyObject *o_fd, *o_off, *o_n, *o_buf, *o_dst, *o_bufs, *o_last, *o_want, *o_check, *o_status, *o_got;
    PyObject *o_convs = Py_None;
    long long read_through, read_cap;
    if (!PyArg_ParseTuple(args, "OOOOOO!OOOOOLL|O", &o_fd, &o_off, &o_n, &o_buf, &o_dst, &PyTuple_Type, &o_bufs,
                          &o_last, &o_want, &o_check, &o_status, &o_got, &read_through, &read_cap, &o_convs))
        return NULL;
    if (read_through < 0 || read_cap < 0) {
        PyErr_SetString(PyExc_ValueError, "read_through and read_cap must be >= 0");
        return NULL;
    }
    Buf a[11];
    memset(a, 0, sizeof a);
    Py_ssize_t nbufs = PyTuple_GET_SIZE(o_bufs);
    Buf *out = PyMem_Calloc(nbufs ? (size_t)nbufs : 1, sizeof(Buf));
    Buf *wide = PyMem_Calloc(nbufs ? (size_t)nbufs : 1, sizeof(Buf)); /* conversion targets */
    int *op = PyMem_Calloc(nbufs ? (size_t)nbufs : 1, sizeof(int));
    double *scale = PyMem_Calloc(nbufs ? (size_t)nbufs : 1, sizeof(double));
    char *scratch = PyMem_Malloc((size_t)read_through + 1);
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * MAX_IOV);
    PyObject *result = NULL;
    if (!out || !wide || !op || !scale || !scratch || !iov) {
        PyErr_NoMemory();
        goto done;
    }
    if (get_array(o_fd, &a[0], 4, -1, 0, "fd") < 0)
        goto done;
    Py_ssize_t nseg = a[0].view.len / 4;
    if (get_array(o_off, &a[1], 8, nseg, 0, "off") < 0 || get_array(o_n, &a[2], 8, nseg, 0, "n") < 0 ||
        get_array(o_buf, &a[3], 4, nseg, 0, "buf") < 0 || get_array(o_dst, &a[4], 8, nseg, 0, "dst") < 0 ||
        get_array(o_last, &a[5], 8, -1, 0, "last") < 0)
        goto done;
    Py_ssize_t nmem = a[5].view.len / 8;
    if (get_array(o_want, &a[6], 8, nmem, 0, "want") < 0 || get_array(o_check, &a[7], 1, nmem, 0, "check") < 0 ||
        get_array(o_status, &a[8], 1, nmem, 1, "status") < 0 || get_array(o_got, &a[9], 8, nmem, 1, "got") < 0)
        goto done;
    for (Py_ssize_t i = 0; i < nbufs; i++)
        if (get_array(PyTuple_GET_ITEM(o_bufs, i), &out[i], 1, -1, 1, "buffers") < 0)
            goto done;
    if (o_convs != Py_None) {
        if (!PyTuple_Check(o_convs) || PyTuple_GET_SIZE(o_convs) != nbufs) {
            PyErr_SetString(PyExc_ValueError, "convs: a tuple with one entry per buffer");
            goto done;
        }
        for (Py_ssize_t i = 0; i < nbufs; i++) {
            PyObject *c = PyTuple_GET_ITEM(o_convs, i), *o_out;
            if (c == Py_None)
                continue;
            if (!PyArg_ParseTuple(c, "Oid", &o_out, &op[i], &scale[i]))
                goto done;
            if (op[i] < CONV_I16_F32 || op[i] > CONV_I32_I64) {
                PyErr_Format(PyExc_ValueError, "convs[%zd]: unknown conversion %d", i, op[i]);
                goto done;
            }
            if (get_array(o_out, &wide[i], 1, -1, 1, "convs") < 0)
                goto done;
        }
    }
    const int32_t *fd = a[0].view.buf, *buf = a[3].view.buf;
    const int64_t *off = a[1].view.buf, *n = a[2].view.buf, *dst = a[4].view.buf, *last = a[5].view.buf;
    const uint64_t *want = a[6].view.buf;
    const uint8_t *check = a[7].view.buf;
    int8_t *status = a[8].view.buf;
    uint64_t *got = a[9].view.buf;
    /* the plan may only write inside its buffers, and its members must cover the runs in order */
    for (Py_ssize_t j = 0; j < nseg; j++) {
        if (buf[j] < 0 || buf[j] >= nbufs || n[j] < 0 || off[j] < 0 || dst[j] < 0 ||
            dst[j] > out[buf[j]].view.len - n[j]) {
            PyErr_Format(PyExc_ValueError, "run %zd (buffer %d, bytes %lld..%lld) lies outside its buffer", j,
                         (int)buf[j], (long long)dst[j], (long long)(dst[j] + n[j]));
            goto done;
        }
        int c = op[buf[j]];
        if (c && (dst[j] % conv_in[c] || n[j] % conv_in[c] ||
                  (dst[j] + n[j]) / conv_in[c] > wide[buf[j]].view.len / conv_out[c])) {
            PyErr_Format(PyExc_ValueError, "run %zd (buffer %d, bytes %lld..%lld) widened lies outside its target",
                         j, (int)buf[j], (long long)dst[j], (long long)(dst[j] + n[j]));
            goto done;
        }
    }

    for (Py_ssize_t m = 0; m < nmem; m++) {
        if (last[m] < (m ? last[m - 1] + 1 : 0) || last[m] >= nseg || (m == nmem - 1 && last[m] != nseg - 1)) {
            PyErr_Format(PyExc_ValueError, "member %zd: runs up to %lld do not follow the previous member's", m,
                         (long long)last[m]);
            goto done;
        }
    }
    if (nmem == 0 && nseg) {
        PyErr_SetString(PyExc_ValueError, "runs without members");
        goto done;
    }
    memset(status, 0, (size_t)nmem);
    int err = 0;
    Py_ssize_t problems = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t j = 0, mi = 0;
    while (j < nseg) {
        int64_t s = off[j], prev = off[j] + n[j];
        int niov = 0;
        iov[niov].iov_base = (char *)out[buf[j]].view.buf + dst[j];
        iov[niov++].iov_len = (size_t)n[j];
        Py_ssize_t k = j + 1;
        while (k < nseg && fd[k] == fd[j] && off[k] >= prev && off[k] - prev <= read_through &&
               niov < MAX_IOV - 2 && prev - s < read_cap) {
            int64_t gap = off[k] - prev;
            if (gap) {
                iov[niov].iov_base = scratch;
                iov[niov++].iov_len = (size_t)gap;
            }
            iov[niov].iov_base = (char *)out[buf[k]].view.buf + dst[k];
            iov[niov++].iov_len = (size_t)n[k];
            prev = off[k] + n[k];
            k++;
        }
        int64_t total = prev - s, have = read_all(fd[j], iov, niov, s, total);
        if (have < 0) {
            err = errno;
            break;
        }
        if (have < total) { /* the file ended: every member with a run past its end is short */
            Py_ssize_t m = mi;
            for (Py_ssize_t r = j; r < k; r++) {
                while (last[m] < r)
                    m++;
                if (off[r] + n[r] > s + have && status[m] == 0) {
                    status[m] = 2;
                    problems++;
                }
            }
        }
        while (mi < nmem && last[mi] < k) { /* the members this read completed */
            Py_ssize_t first = mi ? last[mi - 1] + 1 : 0;
            if (status[mi] == 0 && check[mi]) {
                uint64_t h;
                if (first == last[mi]) {
                    h = XXH3_64bits((const char *)out[buf[first]].view.buf + dst[first], (size_t)n[first]);
                } else {
                    XXH3_state_t st;
                    XXH3_INITSTATE(&st);
                    XXH3_64bits_reset(&st);
                    for (Py_ssize_t r = first; r <= last[mi]; r++)
                        XXH3_64bits_update(&st, (const char *)out[buf[r]].view.buf + dst[r], (size_t)n[r]);
                    h = XXH3_64bits_digest(&st);
                }
                got[mi] = h;
                if (h != want[mi]) {
                    status[mi] = 1;
                    problems++;
                }
            }
            for (Py_ssize_t r = first; status[mi] == 0 && r <= last[mi]; r++) {
                int c = op[buf[r]];
                if (c)
                    convert(c, scale[buf[r]], (const char *)out[buf[r]].view.buf + dst[r],
                            (char *)wide[buf[r]].view.buf + dst[r] / conv_in[c] * conv_out[c],
                            (size_t)(n[r] / conv_in[c]));
            }
            mi++;
        }
        j = k;
    }
#ifdef HAVE_F16C_PATH
    if (has_avx2)
        _mm_sfence(); /* the streamed stores are visible before the batch is */
#endif
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyLong_FromSsize_t(problems);
done:
    release(a, 11);
    if (out)
        release(out, nbufs);
    if (wide)
        release(wide, nbufs);
    PyMem_Free(out);
    PyMem_Free(wide);
    PyMem_Free(op);
    PyMem_Free(scale);
    PyMem_Free(scratch);
    PyMem_Free(iov);
    return result;
}

PyDoc_STRVAR(use_f16c_doc,
"use_f16c(flag=None) -> bool: whether float16 -> float32 uses the CPU's F16C instructions (x86 CPUs that have\n"
"them) or the portable conversion; flag False selects the portable one (tests compare both).");

static PyObject *
use_f16c(PyObject *self, PyObject *args)
{
    int flag = -1;
    if (!PyArg_ParseTuple(args, "|p", &flag))
        return NULL;
#ifdef HAVE_F16C_PATH
    if (flag >= 0)
        has_f16c = flag && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#endif
    return PyBool_FromLong(has_f16c);
}

static PyMethodDef methods[] = {
    {"read_members", read_members, METH_VARARGS, read_members_doc},
    {"use_f16c", use_f16c, METH_VARARGS, use_f16c_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shards._readv",
    "A batch's members read from the shard files and checked in one call that holds no GIL "
    "(see shards/native/readv.c).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__readv(void)
{
#ifdef HAVE_F16C_PATH
    has_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    has_avx2 = __builtin_cpu_supports("avx2");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "API_VERSION", API_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
