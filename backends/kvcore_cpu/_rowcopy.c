/* kvcore_cpu._rowcopy: copy rows of bytes between two buffers by pairs of row indices, in one pass.
 *
 * numpy has no one-pass gather-scatter: random rows on both sides go through a staging buffer, and every
 * numpy call costs about as long as copying a 16 KiB row, so small KV blocks copied at a fraction of
 * memcpy speed. This loop copies each pair straight from source to destination with the GIL released,
 * merging pairs that are consecutive on both sides into one copy.
 *
 * With `stream=True` the destination is written with non-temporal stores (SSE2), which skip reading the
 * destination's cache lines before writing them: for copies much larger than the caches this is what
 * glibc's memcpy does for one large copy, and what a row-by-row memcpy (each row below glibc's
 * threshold) would otherwise miss.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Rows of bytes: a 2-D buffer of one-byte items whose rows are contiguous (any row stride). */
static int
get_rows(PyObject *obj, Py_buffer *view, int writable, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: got %.100s, expected a%s 2-D buffer of bytes (uint8 rows)", name,
                     Py_TYPE(obj)->tp_name, writable ? " writable" : "");
        return -1;
    }
    const char *format = view->format == NULL ? "B" : view->format;
    if (view->ndim != 2 || view->itemsize != 1 || strcmp(format, "B") != 0) {
        PyErr_Format(PyExc_ValueError, "%s: got a %d-D buffer of format '%s', expected 2-D uint8 rows", name,
                     view->ndim, format);
        PyBuffer_Release(view);
        return -1;
    }
    if (view->shape[1] > 1 && view->strides[1] != 1) {
        PyErr_Format(PyExc_ValueError, "%s: got a byte stride of %zd within a row, expected 1", name,
                     view->strides[1]);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Row indices: a 1-D C-contiguous buffer of int64, each in [0, limit). */
static int
get_indices(PyObject *obj, Py_buffer *view, Py_ssize_t limit, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: got %.100s, expected a C-contiguous 1-D buffer of int64", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *format = view->format == NULL ? "B" : view->format;
    size_t length = strlen(format);
    char code = length ? format[length - 1] : '?';
    if (view->ndim != 1 || view->itemsize != 8 || (code != 'l' && code != 'q')) {
        PyErr_Format(PyExc_ValueError, "%s: got a %d-D buffer of format '%s', expected 1-D int64", name,
                     view->ndim, format);
        PyBuffer_Release(view);
        return -1;
    }
    const int64_t *rows = (const int64_t *)view->buf;
    Py_ssize_t count = view->shape[0];
    for (Py_ssize_t i = 0; i < count; i++) {
        if (rows[i] < 0 || rows[i] >= limit) {
            PyErr_Format(PyExc_IndexError, "%s[%zd]: row %lld is outside [0, %zd)", name, i,
                         (long long)rows[i], limit);
            PyBuffer_Release(view);
            return -1;
        }
    }
    return 0;
}

static void
stream_copy(char *dst, const char *src, size_t n)
{
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    for (; i + 16 <= n; i += 16)
        _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

PyDoc_STRVAR(copy_rows_doc,
             "copy_rows(src, dst, src_rows, dst_rows, /, *, stream=False)\n--\n\n"
             "Copy row src_rows[i] of src to row dst_rows[i] of dst for every i, with the GIL released.\n\n"
             "src and dst are 2-D uint8 buffers with rows of the same length (any row stride, contiguous\n"
             "within a row) that do not overlap; the row lists are 1-D int64 of one length. Every index is\n"
             "checked before anything is copied (IndexError names the first bad one). stream=True writes\n"
             "with non-temporal stores: for copies much larger than the caches.");

static PyObject *
copy_rows(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"", "", "", "", "stream", NULL};
    PyObject *src_obj, *dst_obj, *s_obj, *d_obj;
    int stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|$p:copy_rows", keywords, &src_obj, &dst_obj, &s_obj,
                                     &d_obj, &stream))
        return NULL;
    Py_buffer src, dst, s, d;
    PyObject *result = NULL;
    if (get_rows(src_obj, &src, 0, "src") < 0)
        return NULL;
    if (get_rows(dst_obj, &dst, 1, "dst") < 0)
        goto release_src;
    if (src.shape[1] != dst.shape[1]) {
        PyErr_Format(PyExc_ValueError, "dst: got rows of %zd bytes, expected %zd (the rows of src)", dst.shape[1],
                     src.shape[1]);
        goto release_dst;
    }
    if (get_indices(s_obj, &s, src.shape[0], "src_rows") < 0)
        goto release_dst;
    if (get_indices(d_obj, &d, dst.shape[0], "dst_rows") < 0)
        goto release_s;
    if (s.shape[0] != d.shape[0]) {
        PyErr_Format(PyExc_ValueError, "dst_rows: got %zd rows, expected %zd (the length of src_rows)",
                     d.shape[0], s.shape[0]);
        goto release_d;
    }
    {
        const char *src_base = (const char *)src.buf;
        char *dst_base = (char *)dst.buf;
        const int64_t *si = (const int64_t *)s.buf, *di = (const int64_t *)d.buf;
        Py_ssize_t count = s.shape[0], row = src.shape[1];
        Py_ssize_t src_stride = src.strides[0], dst_stride = dst.strides[0];
        int merge = src_stride == row && dst_stride == row;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count;) {
            Py_ssize_t j = i + 1;
            if (merge)
                while (j < count && si[j] == si[j - 1] + 1 && di[j] == di[j - 1] + 1)
                    j++;
            char *to = dst_base + di[i] * dst_stride;
            const char *from = src_base + si[i] * src_stride;
            size_t bytes = (size_t)((j - i) * row);
            if (stream)
                stream_copy(to, from, bytes);
            else
                memcpy(to, from, bytes);
            i = j;
        }
#if defined(__SSE2__)
        if (stream)
            _mm_sfence();
#endif
        Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(Py_None);
release_d:
    PyBuffer_Release(&d);
release_s:
    PyBuffer_Release(&s);
release_dst:
    PyBuffer_Release(&dst);
release_src:
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_rows", (PyCFunction)(void (*)(void))copy_rows, METH_VARARGS | METH_KEYWORDS, copy_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvcore_cpu._rowcopy", "One-pass row copies for kvcore's CPU block mover.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__rowcopy(void)
{
    return PyModule_Create(&module);
}
