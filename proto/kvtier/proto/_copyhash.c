/* kvtier.proto._copyhash: localwire's checked copies, file reads and file writes, in C.
 *
 *   copy_checked(dst, *sources) -> int
 *       copies sources back to back into dst (their total length) and returns xxh3-64 of
 *       what landed in dst, each block hashed right after it is copied (cache-warm); the
 *       same value as the pure-Python copy_checked and xxhash.xxh3_64_intdigest. The copy
 *       and the hash run without the GIL.
 *
 *   read_checked(fd, offset, dst, prefix_len) -> int
 *       reads prefix_len bytes of file fd at offset, then len(dst) bytes right after them
 *       into dst (pread, block by block), and returns xxh3-64 of all of them, each block
 *       hashed right after it is read: a same-node client reading a disk-tier record file
 *       (the prefix is the record's key, which its checksum covers; localwire.read_checked).
 *       OSError on a read error, EOFError when the file ends first. Without the GIL.
 *
 *   write_checked(fd, offset, src, prefix) -> (int, int)
 *       writes prefix then src to file fd at offset (pwrite, block by block), each block of
 *       src first copied into a private buffer, hashed there and written from there, and
 *       returns (xxh3-64 of src, xxh3-64 of prefix + src) as written: the disk tier storing
 *       a value from a same-node client's staging segment, which the client can still
 *       change (what is written is exactly what was hashed; the first checksum is the one
 *       the client sent, the second the record's; localwire.write_checked). One pass over
 *       src instead of a copy into the tier's memory, a hash, and a write. OSError on a
 *       write error. Without the GIL.
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

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <xxhash.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h> /* libxxhash's AVX2/AVX-512 code where the CPU has it */
#define HASH_UPDATE XXH3_64bits_update_dispatch
#else
#define HASH_UPDATE XXH3_64bits_update
#endif

#define BLOCK (64 * 1024) /* hashed right after it is copied: still in L2 */
#define READ_BLOCK (256 * 1024) /* read_checked: fewer preads, each block still in L2 */
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

/* pread exactly n bytes at pos (0), -1 with errno on an error, 1 when the file ends first */
static int
pread_full(int fd, char *out, size_t n, off_t pos)
{
    while (n) {
        ssize_t got = pread(fd, out, n, pos);
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        if (got == 0) {
            return 1;
        }
        out += got;
        pos += got;
        n -= (size_t)got;
    }
    return 0;
}

#define MAX_PREFIX 65535 /* a record's key length is a u16 */

/* args[0] and args[1] as a file descriptor and an offset in it (0), or -1 with an error set */
static int
fd_and_offset(PyObject *const *args, const char *name, int *fd, off_t *offset)
{
    long f = PyLong_AsLong(args[0]);
    if (f == -1 && PyErr_Occurred()) {
        return -1;
    }
    long long o = PyLong_AsLongLong(args[1]);
    if (o == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (f < 0 || f > 0x7fffffffL || o < 0) {
        PyErr_Format(PyExc_ValueError, "%s: fd %ld, offset %lld (each >= 0)", name, f, o);
        return -1;
    }
    *fd = (int)f;
    *offset = (off_t)o;
    return 0;
}

static PyObject *
read_checked(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "read_checked(fd, offset, dst, prefix_len)");
        return NULL;
    }
    int fd;
    off_t offset;
    if (fd_and_offset(args, "read_checked", &fd, &offset) < 0) {
        return NULL;
    }
    Py_ssize_t prefix = PyLong_AsSsize_t(args[3]);
    if (prefix == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (prefix < 0 || prefix > MAX_PREFIX) {
        PyErr_Format(PyExc_ValueError, "read_checked: prefix_len %zd (0 to %d)", prefix,
                     MAX_PREFIX);
        return NULL;
    }
    Py_buffer dst;
    if (PyObject_GetBuffer(args[2], &dst, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    XXH3_state_t *state = XXH3_createState();
    char *head = malloc(prefix ? (size_t)prefix : 1);
    if (state == NULL || head == NULL) {
        XXH3_freeState(state);
        free(head);
        PyBuffer_Release(&dst);
        return PyErr_NoMemory();
    }
    int failed = 0, err = 0;
    XXH64_hash_t digest = 0;
    Py_BEGIN_ALLOW_THREADS
    XXH3_64bits_reset(state);
    off_t pos = (off_t)offset;
    failed = pread_full((int)fd, head, (size_t)prefix, pos);
    if (!failed) {
        HASH_UPDATE(state, head, (size_t)prefix);
        pos += prefix;
    }
    char *out = (char *)dst.buf;
    size_t left = (size_t)dst.len;
    while (!failed && left) {
        size_t n = left < READ_BLOCK ? left : READ_BLOCK;
        failed = pread_full((int)fd, out, n, pos);
        if (!failed) {
            HASH_UPDATE(state, out, n);
            out += n;
            pos += (off_t)n;
            left -= n;
        }
    }
    err = errno;
    if (!failed) {
        digest = XXH3_64bits_digest(state);
    }
    Py_END_ALLOW_THREADS
    XXH3_freeState(state);
    free(head);
    PyBuffer_Release(&dst);
    if (failed < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (failed > 0) {
        PyErr_Format(PyExc_EOFError, "read_checked: the file ended before %zd + %zd bytes "
                     "at offset %lld", prefix, dst.len, (long long)offset);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)digest);
}

/* pwrite exactly n bytes at pos (0), -1 with errno on an error */
static int
pwrite_full(int fd, const char *in, size_t n, off_t pos)
{
    while (n) {
        ssize_t put = pwrite(fd, in, n, pos);
        if (put < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        if (put == 0) { /* no progress: never loop on it */
            errno = EIO;
            return -1;
        }
        in += put;
        pos += put;
        n -= (size_t)put;
    }
    return 0;
}

static PyObject *
write_checked(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "write_checked(fd, offset, src, prefix)");
        return NULL;
    }
    int fd;
    off_t offset;
    if (fd_and_offset(args, "write_checked", &fd, &offset) < 0) {
        return NULL;
    }
    Py_buffer src, prefix;
    if (PyObject_GetBuffer(args[2], &src, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[3], &prefix, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (prefix.len > MAX_PREFIX) {
        PyErr_Format(PyExc_ValueError, "write_checked: a prefix of %zd bytes; at most %d",
                     prefix.len, MAX_PREFIX);
        PyBuffer_Release(&prefix);
        PyBuffer_Release(&src);
        return NULL;
    }
    XXH3_state_t *value = XXH3_createState();
    XXH3_state_t *whole = XXH3_createState();
    void *bounce = NULL;
    if (value == NULL || whole == NULL || posix_memalign(&bounce, 4096, READ_BLOCK) != 0) {
        XXH3_freeState(value);
        XXH3_freeState(whole);
        PyBuffer_Release(&prefix);
        PyBuffer_Release(&src);
        return PyErr_NoMemory();
    }
    int failed = 0, err = 0;
    XXH64_hash_t value_digest = 0, whole_digest = 0;
    Py_BEGIN_ALLOW_THREADS
    XXH3_64bits_reset(value);
    XXH3_64bits_reset(whole);
    off_t pos = (off_t)offset;
    HASH_UPDATE(whole, prefix.buf, (size_t)prefix.len);
    failed = pwrite_full((int)fd, (const char *)prefix.buf, (size_t)prefix.len, pos);
    pos += prefix.len;
    const char *in = (const char *)src.buf;
    size_t left = (size_t)src.len;
    while (!failed && left) {
        /* Blocks end at multiples of READ_BLOCK in the file (the first one shorter): the
         * page cache then holds the value in large folios, which later reads copy out
         * faster (an unaligned 256 KiB write leaves a partial page at each end; reads of
         * such a file ran ~10% slower here). */
        size_t room = READ_BLOCK - (size_t)(pos % READ_BLOCK);
        size_t n = left < room ? left : room;
        copy_pieces((char *)bounce, in, n); /* the bytes hashed and written: no one else's */
        HASH_UPDATE(value, bounce, n);
        HASH_UPDATE(whole, bounce, n);
        failed = pwrite_full((int)fd, (const char *)bounce, n, pos);
        in += n;
        pos += (off_t)n;
        left -= n;
    }
    err = errno;
    if (!failed) {
        value_digest = XXH3_64bits_digest(value);
        whole_digest = XXH3_64bits_digest(whole);
    }
    Py_END_ALLOW_THREADS
    XXH3_freeState(value);
    XXH3_freeState(whole);
    free(bounce);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&src);
    if (failed) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(KK)", (unsigned long long)value_digest,
                         (unsigned long long)whole_digest);
}

static PyMethodDef methods[] = {
    {"read_checked", (PyCFunction)(void (*)(void))read_checked, METH_FASTCALL,
     "read_checked(fd, offset, dst, prefix_len) -> int: reads prefix_len bytes at offset "
     "(hashed only), then len(dst) more into dst; returns the xxh3-64 of all of them (the "
     "GIL released)."},
    {"write_checked", (PyCFunction)(void (*)(void))write_checked, METH_FASTCALL,
     "write_checked(fd, offset, src, prefix) -> (int, int): writes prefix then src at "
     "offset, each block of src copied aside, hashed and written from there; returns the "
     "xxh3-64 of src and of prefix + src as written (the GIL released)."},
    {"copy_checked", (PyCFunction)(void (*)(void))copy_checked, METH_FASTCALL,
     "copy_checked(dst, *sources) -> int: copies sources back to back into dst and returns "
     "the xxh3-64 of what landed there (the GIL released)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier.proto._copyhash",
    "localwire's checked copies, file reads and file writes in C (see proto/kvtier/proto/_copyhash.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__copyhash(void)
{
    return PyModule_Create(&module);
}
