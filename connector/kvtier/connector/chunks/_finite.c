/* kvtier.connector.chunks._finite: the scan of a KV chunk's payload for NaN and infinities.
 *
 *   first_nonfinite(payload, width, mask) -> int
 *       the index of the first element of payload (elements of width 1, 2 or 4 bytes,
 *       native endian) whose bits under mask are all set, or -1 when there is none. With
 *       mask a float type's exponent field (kvtier/connector/chunks/finite.py), that is the
 *       first NaN or infinity. The GIL is released while it scans.
 *
 * Optional: finite.py scans with numpy when this module is not built, and the tests check
 * both against torch.isfinite. Nothing here knows a dtype; finite.py picks width and mask.
 *
 * Each block of SCAN elements is reduced with an OR of per-element comparisons, a loop gcc
 * vectorizes at -O3 (AVX2 where the CPU has it); the OR is kept in lanes of the element's
 * width, which ran 1.5x faster here than an unsigned int (python -m kvtier.bench.finite).
 * Only a block with a hit is scanned again for its index.
 *
 * Build: setuptools, from pyproject.toml (no library).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#define SCAN 4096

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target_clones("avx2", "default"))) /* AVX2 where the CPU has it */
#else
#define WIDE
#endif

/* A payload need not start at a multiple of its element size (a chunk's header has an odd
 * length when its group tag has): elements are read through types of alignment 1, which
 * gcc vectorizes with unaligned loads, as fast here as aligned ones, and that may alias
 * whatever the buffer holds (bytes). */
typedef uint8_t any8;
typedef uint16_t any16 __attribute__((aligned(1), may_alias));
typedef uint32_t any32 __attribute__((aligned(1), may_alias));

#define FIRST(name, type, lane)                                                             \
    WIDE static Py_ssize_t name(const type *p, Py_ssize_t n, lane mask)                     \
    {                                                                                       \
        for (Py_ssize_t start = 0; start < n; start += SCAN) {                              \
            Py_ssize_t end = n - start < SCAN ? n : start + SCAN;                           \
            lane hit = 0; /* lanes of the element's width: no widening in the loop */       \
            for (Py_ssize_t i = start; i < end; i++) {                                      \
                hit |= (lane)(((lane)(p[i] & mask) ^ mask) == 0);                           \
            }                                                                               \
            if (hit) {                                                                      \
                for (Py_ssize_t i = start; i < end; i++) {                                  \
                    if ((lane)(p[i] & mask) == mask) {                                      \
                        return i;                                                           \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        return -1;                                                                          \
    }

FIRST(first8, any8, uint8_t)
FIRST(first16, any16, uint16_t)
FIRST(first32, any32, uint32_t)

static Py_ssize_t
first_any(const void *p, Py_ssize_t n, int width, unsigned long long mask)
{
    if (width == 1) {
        return first8((const any8 *)p, n, (uint8_t)mask);
    }
    if (width == 2) {
        return first16((const any16 *)p, n, (uint16_t)mask);
    }
    return first32((const any32 *)p, n, (uint32_t)mask);
}

static PyObject *
first_nonfinite(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "first_nonfinite(payload, width, mask)");
        return NULL;
    }
    long width = PyLong_AsLong(args[1]);
    if (width == -1 && PyErr_Occurred()) {
        return NULL;
    }
    unsigned long long mask = PyLong_AsUnsignedLongLong(args[2]);
    if (mask == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if ((width != 1 && width != 2 && width != 4) || mask == 0 || mask >> (8 * width)) {
        PyErr_Format(PyExc_ValueError,
                     "first_nonfinite: width %ld and mask %#llx (width 1, 2 or 4 bytes, a "
                     "nonzero mask of that width)",
                     width, mask);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (view.len % width) {
        PyErr_Format(PyExc_ValueError, "first_nonfinite: %zd bytes is not a whole number of "
                     "%ld-byte elements", view.len, width);
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t found;
    Py_BEGIN_ALLOW_THREADS
    found = first_any(view.buf, view.len / width, (int)width, mask);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(found);
}

static PyMethodDef methods[] = {
    {"first_nonfinite", (PyCFunction)(void (*)(void))first_nonfinite, METH_FASTCALL,
     "first_nonfinite(payload, width, mask) -> int: the index of the first element whose "
     "bits under mask are all set, or -1 (the GIL released)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier.connector.chunks._finite",
    "The scan of a KV chunk for NaN and infinities (see connector/kvtier/connector/chunks/_finite.c).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__finite(void)
{
    return PyModule_Create(&module);
}
