/* kvtier.proto._copyhash: localwire.copy_checked in C.
 *
 *   copy_checked(dst, *sources) -> int
 *       copies sources back to back into dst (their total length) and returns xxh3-64 of
 *       what landed in dst, each block hashed right after it is copied (cache-warm); the
 *       same value as the pure-Python copy_checked and xxhash.xxh3_64_intdigest. The copy
 *       and the hash run without the GIL.
 *
 * Why C (docs/benchmarks.md, "Same-node copies and alignment"): the pure-Python copy is a
 * memoryview slice assignment, one glibc memcpy per 256 KiB block, and on the AMD EPYC of
 * these machines a copy of that size runs at a third to a half of its speed when the
 * destination lies a few bytes (8 or 16) past the source modulo 4 KiB -- exactly the case
 * of a bytearray receive buffer (data at 16 past a page boundary) filled from a page-aligned
 * shared segment. Copying in pieces below glibc's `rep movsb` threshold (its vector loop)
 * loses less there; aligned copies still go whole to memcpy.
 * Releasing the GIL lets an engine's other threads run during the copy.
 *
 * Optional: localwire.py computes the same in pure Python when this module is not built
 * (no C compiler or libxxhash). Build: setuptools, from proto/pyproject.toml (Debian's
 * libxxhash-dev; at run time libxxhash0, whose x86 build picks SSE2, AVX2 or AVX-512 for
 * the CPU it runs on: the inlined header alone would be SSE2, ~20% slower here).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include <xxhash.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h> /* libxxhash's AVX2/AVX-512 code where the CPU has it */
#define HASH_UPDATE XXH3_64bits_update_dispatch
#else
#define HASH_UPDATE XXH3_64bits_update
#endif

#define BLOCK (64 * 1024) /* hashed right after it is copied: still in L2 */
#ifndef PIECE
#define PIECE 2048 /* below glibc's rep movsb threshold on x86-64 */
#endif
#define MAX_SOURCES 64    /* a value's parts: in practice a header and a payload */

static void
copy_pieces(char *dst, const char *src, size_t n)
{
    size_t past = ((uintptr_t)dst - (uintptr_t)src) & 4095;
    if (past == 0 || past >= 64) { /* no 4K aliasing: whole, at memcpy's best */
        memcpy(dst, src, n);
        return;
    }
    while (n > PIECE) {
        memcpy(dst, src, PIECE);
        dst += PIECE;
        src += PIECE;
        n -= PIECE;
    }
    memcpy(dst, src, n);
}

static PyObject *
copy_checked(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "copy_checked(dst, *sources): dst is required");
        return NULL;
    }
    Py_ssize_t nsrc = nargs - 1;
    if (nsrc > MAX_SOURCES) {
        PyErr_Format(PyExc_ValueError, "copy_checked: %zd sources; at most %d", nsrc,
                     MAX_SOURCES);
        return NULL;
    }
    Py_buffer dst;
    Py_buffer src[MAX_SOURCES];
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    Py_ssize_t got = 0, total = 0;
    for (; got < nsrc; got++) {
        if (PyObject_GetBuffer(args[got + 1], &src[got], PyBUF_SIMPLE) < 0) {
            goto fail;
        }
        total += src[got].len;
    }
    if (total != dst.len) {
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes into %zd", total, dst.len);
        goto fail;
    }
    XXH3_state_t *state = XXH3_createState();
    if (state == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    XXH64_hash_t digest;
    Py_BEGIN_ALLOW_THREADS
    XXH3_64bits_reset(state);
    char *out = (char *)dst.buf;
    for (Py_ssize_t i = 0; i < nsrc; i++) {
        const char *in = (const char *)src[i].buf;
        size_t left = (size_t)src[i].len;
        while (left) {
            size_t n = left < BLOCK ? left : BLOCK;
            copy_pieces(out, in, n);
            HASH_UPDATE(state, out, n);
            out += n;
            in += n;
            left -= n;
        }
    }
    digest = XXH3_64bits_digest(state);
    Py_END_ALLOW_THREADS
    XXH3_freeState(state);
    for (Py_ssize_t i = 0; i < nsrc; i++) {
        PyBuffer_Release(&src[i]);
    }
    PyBuffer_Release(&dst);
    return PyLong_FromUnsignedLongLong((unsigned long long)digest);
fail:
    for (Py_ssize_t i = 0; i < got; i++) {
        PyBuffer_Release(&src[i]);
    }
    PyBuffer_Release(&dst);
    return NULL;
}

static PyMethodDef methods[] = {
    {"copy_checked", (PyCFunction)(void (*)(void))copy_checked, METH_FASTCALL,
     "copy_checked(dst, *sources) -> int: copies sources back to back into dst and returns "
     "the xxh3-64 of what landed there (the GIL released)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier.proto._copyhash",
    "localwire.copy_checked in C (see proto/kvtier/proto/_copyhash.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__copyhash(void)
{
    return PyModule_Create(&module);
}
