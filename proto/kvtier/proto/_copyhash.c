/* kvtier.proto._copyhash: localwire's checked copies, file reads and file writes, in C.
 *
 *   copy_checked(dst, *sources) -> int
 *       copies sources back to back into dst (their total length) and returns xxh3-64 of
 *       what landed in dst: in one pass where the CPU has AVX2 (each 64-byte stripe
 *       loaded once, stored, and hashed from the same registers; "One pass" below), else
 *       each block hashed right after it is copied (cache-warm); the same value as the
 *       pure-Python copy_checked and xxhash.xxh3_64_intdigest. The copy and the hash run
 *       without the GIL. The module's FUSED is 1 where the one pass is used
 *       (KVTIER_COPY_NO_FUSED=1 in the environment turns it off: A/Bs and tests).
 *
 *   copy_streamed(dst, *sources) -> int
 *       the same copy and the same checksum, for a destination this CPU will not read
 *       again soon (a same-node PUT into an extent the tier reserved: another process
 *       reads it, later): each block of the sources is hashed first (it is then in
 *       cache; in the one pass: stored from the registers it was hashed from) and copied
 *       with non-temporal stores, which skip reading the destination's cache lines before
 *       writing them (x86-64: AVX2 or SSE2 streaming stores; elsewhere memcpy; python -m
 *       kvtier.bench.copies compares the two copies). The checksum is of the
 *       bytes read from the sources: the caller owns them, and a source it changes
 *       during the call leaves a value whose checksum every reader finds wrong.
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

#if defined(__x86_64__)
#include <emmintrin.h>
#define STREAM_ALIGN 16
/* copies n bytes with SSE2 non-temporal stores where dst is 16-byte aligned (callers
 * sfence once after the last block) */
static void
copy_stream(char *dst, const char *src, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)dst & (STREAM_ALIGN - 1));
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}
#define STREAM_FENCE() _mm_sfence()
#else
#define copy_stream(dst, src, n) memcpy((dst), (src), (n))
#define STREAM_FENCE() ((void)0)
#endif

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

/* -- One pass: copy and xxh3-64 fused (x86-64 with AVX2) ----------------------------------
 *
 * copy_checked in two passes per block (a copy, then a hash of the copy while it is in
 * cache) runs at ~0.8x a plain memcpy here: the hash's arithmetic waits for the copy and
 * the copy for the hash. This loop loads each 64-byte stripe once, stores it and feeds the
 * same registers to XXH3's accumulator, so the arithmetic runs while the memory system
 * works: 1.3-1.4x the two-pass copy out of a memfd segment here (python -m
 * kvtier.bench.copies, with and without KVTIER_COPY_NO_FUSED=1). It is XXH3's long-input algorithm (xxhash's
 * XXH3_hashLong_64b with the default secret and seed 0: stripes of 64 bytes, the
 * accumulators scrambled after every 16, the last partial block, the input's last 64
 * bytes, the merge), written here against the specification rather than libxxhash's
 * internals, which change between versions; tests/proto/test_copy_checked.py compares it
 * with libxxhash at every length class. Inputs of 240 bytes or less take XXH3's short
 * algorithms: the two-pass path does those. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_FUSED 1

static const uint8_t XXH3_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define STRIPE 64
#define STRIPES_PER_BLOCK 16 /* (sizeof secret - STRIPE) / 8 */
#define SHORT_MAX 240        /* XXH3's short algorithms up to here */

static int have_avx2;

__attribute__((target("avx2"))) static inline void
accumulate(__m256i acc[2], __m256i a, __m256i b, const uint8_t *secret)
{
    __m256i in[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        __m256i key = _mm256_loadu_si256((const __m256i *)(secret + 32 * i));
        __m256i data_key = _mm256_xor_si256(in[i], key);
        __m256i data_key_lo = _mm256_shuffle_epi32(data_key, _MM_SHUFFLE(0, 3, 0, 1));
        __m256i product = _mm256_mul_epu32(data_key, data_key_lo);
        __m256i swapped = _mm256_shuffle_epi32(in[i], _MM_SHUFFLE(1, 0, 3, 2));
        acc[i] = _mm256_add_epi64(product, _mm256_add_epi64(acc[i], swapped));
    }
}

__attribute__((target("avx2"))) static inline void
accumulate_at(__m256i acc[2], const char *p, const uint8_t *secret)
{
    accumulate(acc, _mm256_loadu_si256((const __m256i *)p),
               _mm256_loadu_si256((const __m256i *)(p + 32)), secret);
}

__attribute__((target("avx2"))) static inline void
scramble(__m256i acc[2])
{
    const uint8_t *secret = XXH3_SECRET + sizeof XXH3_SECRET - STRIPE;
    __m256i prime = _mm256_set1_epi32((int)P32_1);
    for (int i = 0; i < 2; i++) {
        __m256i v = _mm256_xor_si256(acc[i], _mm256_srli_epi64(acc[i], 47));
        v = _mm256_xor_si256(v, _mm256_loadu_si256((const __m256i *)(secret + 32 * i)));
        __m256i hi = _mm256_shuffle_epi32(v, _MM_SHUFFLE(0, 3, 0, 1));
        acc[i] = _mm256_add_epi64(_mm256_mul_epu32(v, prime),
                                  _mm256_slli_epi64(_mm256_mul_epu32(hi, prime), 32));
    }
}

static uint64_t
read64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v); /* little-endian: x86-64 */
    return v;
}

static uint64_t
mul_fold(uint64_t a, uint64_t b)
{
    unsigned __int128 product = (unsigned __int128)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static uint64_t
merge(const uint64_t acc[8], size_t len)
{
    const uint8_t *secret = XXH3_SECRET + 11;
    uint64_t h = (uint64_t)len * P64_1;
    for (int i = 0; i < 4; i++) {
        h += mul_fold(acc[2 * i] ^ read64(secret + 16 * i), acc[2 * i + 1] ^ read64(secret + 16 * i + 8));
    }
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    h ^= h >> 32;
    return h;
}

/* Moves (j, at), a source and where in it, past empty sources and one used up; only
 * called while bytes are left, so j stays within the sources. */
static inline void
next_source(const Py_buffer *src, Py_ssize_t *j, size_t *at)
{
    while ((size_t)src[*j].len == *at) {
        (*j)++;
        *at = 0;
    }
}

/* Copies the next n bytes of the sources, from (j, at) on, into to */
static inline void
gather(char *to, size_t n, const Py_buffer *src, Py_ssize_t *j, size_t *at)
{
    while (n) {
        next_source(src, j, at);
        size_t k = (size_t)src[*j].len - *at;
        k = k < n ? k : n;
        memcpy(to, (const char *)src[*j].buf + *at, k);
        to += k;
        *at += k;
        n -= k;
    }
}

/* Copies the sources (total bytes, more than SHORT_MAX) back to back into dst and returns
 * xxh3-64 of what was stored; streamed: non-temporal stores where dst is 32-byte aligned
 * (a stripe that spans two sources, and the tail, go through memcpy). Without the GIL. */
__attribute__((target("avx2"))) static uint64_t
copy_hash_fused(char *dst, const Py_buffer *src, size_t total, int streamed)
{
    _Alignas(32) uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    __m256i acc[2] = {_mm256_load_si256((const __m256i *)init),
                      _mm256_load_si256((const __m256i *)(init + 4))};
    size_t blocks = (total - 1) / (STRIPE * STRIPES_PER_BLOCK);
    size_t stripes = blocks * STRIPES_PER_BLOCK
                     + ((total - 1) - blocks * STRIPE * STRIPES_PER_BLOCK) / STRIPE;
    int nt = streamed && ((uintptr_t)dst & 31) == 0;
    Py_ssize_t j = 0;  /* the source being read, */
    size_t at = 0;     /* and where in it */
    char *out = dst;
    for (size_t i = 0; i < stripes; i++, out += STRIPE) {
        next_source(src, &j, &at);
        const uint8_t *secret = XXH3_SECRET + 8 * (i % STRIPES_PER_BLOCK);
        if ((size_t)src[j].len - at >= STRIPE) {
            const char *in = (const char *)src[j].buf + at;
            __m256i a = _mm256_loadu_si256((const __m256i *)in);
            __m256i b = _mm256_loadu_si256((const __m256i *)(in + 32));
            /* the stored and the hashed bytes are these registers: the compiler may not
             * load the source again for either (another process may be writing it) */
            __asm__("" : "+x"(a), "+x"(b));
            if (nt) {
                _mm256_stream_si256((__m256i *)out, a);
                _mm256_stream_si256((__m256i *)(out + 32), b);
            } else {
                _mm256_storeu_si256((__m256i *)out, a);
                _mm256_storeu_si256((__m256i *)(out + 32), b);
            }
            accumulate(acc, a, b, secret);
            at += STRIPE;
        } else { /* a stripe across sources: gathered in dst, then hashed from there */
            gather(out, STRIPE, src, &j, &at);
            accumulate_at(acc, out, secret);
        }
        if (i % STRIPES_PER_BLOCK == STRIPES_PER_BLOCK - 1) {
            scramble(acc);
        }
    }
    /* the rest (1 to 64 bytes), then the input's last 64 bytes read back from dst */
    char *end = dst + total;
    gather(out, (size_t)(end - out), src, &j, &at);
    if (nt) {
        _mm_sfence(); /* the streamed stores before the read back, and before the reply */
    }
    accumulate_at(acc, end - STRIPE, XXH3_SECRET + sizeof XXH3_SECRET - STRIPE - 7);
    _Alignas(32) uint64_t lanes[8];
    _mm256_store_si256((__m256i *)lanes, acc[0]);
    _mm256_store_si256((__m256i *)(lanes + 4), acc[1]);
    return merge(lanes, total);
}
#else
#define HAVE_FUSED 0
static const int have_avx2 = 0;
#endif

/* copy_checked (streamed 0) and copy_streamed (1) */
static PyObject *
copy_hashed(PyObject *const *args, Py_ssize_t nargs, int streamed)
{
    const char *name = streamed ? "copy_streamed" : "copy_checked";
    if (nargs < 1) {
        PyErr_Format(PyExc_TypeError, "%s(dst, *sources): dst is required", name);
        return NULL;
    }
    Py_ssize_t nsrc = nargs - 1;
    if (nsrc > MAX_SOURCES) {
        PyErr_Format(PyExc_ValueError, "%s: %zd sources; at most %d", name, nsrc,
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
    XXH64_hash_t digest;
#if HAVE_FUSED
    if (have_avx2 && total > SHORT_MAX) {
        Py_BEGIN_ALLOW_THREADS
        digest = copy_hash_fused((char *)dst.buf, src, (size_t)total, streamed);
        Py_END_ALLOW_THREADS
        goto release;
    }
#endif
    XXH3_state_t *state = XXH3_createState();
    if (state == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    XXH3_64bits_reset(state);
    char *out = (char *)dst.buf;
    for (Py_ssize_t i = 0; i < nsrc; i++) {
        const char *in = (const char *)src[i].buf;
        size_t left = (size_t)src[i].len;
        while (left) {
            size_t n = left < BLOCK ? left : BLOCK;
            if (streamed) {
                HASH_UPDATE(state, in, n);
                copy_stream(out, in, n);
            } else {
                copy_pieces(out, in, n);
                HASH_UPDATE(state, out, n);
            }
            out += n;
            in += n;
            left -= n;
        }
    }
    if (streamed) {
        STREAM_FENCE(); /* the streamed stores are visible before the PUT that names them */
    }
    digest = XXH3_64bits_digest(state);
    Py_END_ALLOW_THREADS
    XXH3_freeState(state);
#if HAVE_FUSED
release:
#endif
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

static PyObject *
copy_checked(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    return copy_hashed(args, nargs, 0);
}

static PyObject *
copy_streamed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    return copy_hashed(args, nargs, 1);
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
    {"copy_streamed", (PyCFunction)(void (*)(void))copy_streamed, METH_FASTCALL,
     "copy_streamed(dst, *sources) -> int: copy_checked with each block hashed in the "
     "sources, then copied with non-temporal stores (a destination read later, elsewhere)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier.proto._copyhash",
    "localwire's checked copies, file reads and file writes in C (see proto/kvtier/proto/_copyhash.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__copyhash(void)
{
#if HAVE_FUSED
    __builtin_cpu_init();
    const char *off = getenv("KVTIER_COPY_NO_FUSED"); /* set, not empty, not "0" */
    have_avx2 = __builtin_cpu_supports("avx2") && (off == NULL || *off == '\0' || strcmp(off, "0") == 0);
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "FUSED", have_avx2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
