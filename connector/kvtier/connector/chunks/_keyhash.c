/* kvtier.connector._keyhash: the two hot loops of kvtier.connector.keys, in C.
 *
 * Optional: keys.py computes the same bytes in pure Python when this module is not
 * built (no C compiler, no OpenSSL or xxHash headers), and the tests check both
 * against docs/keys.md's scheme. Nothing here decides what is hashed; keys.py does.
 *
 *   pack_u32(token_ids)  -> bytearray   each int as a native-endian u32 (array("I")'s bytes)
 *   chain(algo, prefix, parent, data, chunk_bytes, first, extras) -> list[bytes]
 *       chunk k of data gets the key  H(prefix || u8 len(parent) || parent
 *                                         || extras.get(first + k, b"\0\0") || chunk k)
 *       and becomes the next chunk's parent; algo is "sha256" or "xxh3_128". The
 *       hashing itself runs without the GIL.
 *
 * Build: setuptools, from pyproject.toml (libcrypto, and the xxhash.h header of
 * Debian's libxxhash-dev, used inline).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define OPENSSL_SUPPRESS_DEPRECATED /* SHA256_*: no per-call EVP context set-up */
#include <openssl/sha.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define MAX_KEY 64

/* One token id as u32, with the same checks as array("I"): OverflowError when out of
 * range, TypeError when not an integer. */
static int
as_u32(PyObject *value, uint32_t *out)
{
#if PY_VERSION_HEX < 0x030C0000
    /* CPython 3.11: a non-negative int below 2**30 is one 30-bit digit. */
    if (PyLong_CheckExact(value)) {
        Py_ssize_t size = Py_SIZE(value);
        if (size == 1) {
            *out = (uint32_t)((PyLongObject *)value)->ob_digit[0];
            return 0;
        }
        if (size == 0) {
            *out = 0;
            return 0;
        }
    }
#endif
    unsigned long number;
    if (PyLong_Check(value)) {
        number = PyLong_AsUnsignedLong(value);
    }
    else {
        PyObject *index = PyNumber_Index(value);
        if (index == NULL) {
            return -1;
        }
        number = PyLong_AsUnsignedLong(index);
        Py_DECREF(index);
    }
    if (number == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (number > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, "token id is greater than 2**32 - 1");
        return -1;
    }
    *out = (uint32_t)number;
    return 0;
}

static PyObject *
pack_u32(PyObject *module, PyObject *token_ids)
{
    PyObject *seq = PySequence_Fast(token_ids, "token_ids must be a sequence of ints");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *packed = PyByteArray_FromStringAndSize(NULL, count * 4);
    if (packed != NULL) {
        char *out = PyByteArray_AS_STRING(packed);
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t token;
            if (as_u32(items[i], &token) < 0) {
                Py_CLEAR(packed);
                break;
            }
            memcpy(out + 4 * i, &token, 4);
        }
    }
    Py_DECREF(seq);
    return packed;
}

/* The per-chunk part of a key, after the prefix: parent field, items field, tokens. */
typedef struct {
    uint8_t tag;
    const uint8_t *parent;
    size_t parent_size;
    const char *extras;
    size_t extras_size;
    const char *tokens;
    size_t tokens_size;
} chunk_input;

static size_t
chain_sha256(const SHA256_CTX *base, const chunk_input *in, unsigned char *key)
{
    SHA256_CTX ctx = *base;
    SHA256_Update(&ctx, &in->tag, 1);
    SHA256_Update(&ctx, in->parent, in->parent_size);
    SHA256_Update(&ctx, in->extras, in->extras_size);
    SHA256_Update(&ctx, in->tokens, in->tokens_size);
    SHA256_Final(key, &ctx);
    return SHA256_DIGEST_LENGTH;
}

static size_t
chain_xxh3(const XXH3_state_t *base, XXH3_state_t *state, const chunk_input *in,
           unsigned char *key)
{
    XXH3_copyState(state, base);
    XXH3_128bits_update(state, &in->tag, 1);
    XXH3_128bits_update(state, in->parent, in->parent_size);
    XXH3_128bits_update(state, in->extras, in->extras_size);
    XXH3_128bits_update(state, in->tokens, in->tokens_size);
    XXH128_canonical_t canonical; /* big-endian: what xxhash.xxh3_128().digest() gives */
    XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(state));
    memcpy(key, canonical.digest, sizeof canonical.digest);
    return sizeof canonical.digest;
}

static PyObject *
chain(PyObject *module, PyObject *args)
{
    const char *algo;
    Py_buffer prefix, parent, data;
    Py_ssize_t chunk_bytes, first;
    PyObject *extras;
    if (!PyArg_ParseTuple(args, "sy*y*y*nnO!:chain", &algo, &prefix, &parent, &data,
                          &chunk_bytes, &first, &PyDict_Type, &extras)) {
        return NULL;
    }
    int sha = strcmp(algo, "sha256") == 0;
    PyObject *keys = NULL;
    PyObject **fields = NULL;
    unsigned char *out = NULL;
    SHA256_CTX sha_base;
    XXH3_state_t *xxh_base = NULL, *xxh_state = NULL;
    if (!sha && strcmp(algo, "xxh3_128") != 0) {
        PyErr_Format(PyExc_ValueError, "algo must be sha256 or xxh3_128, got %s", algo);
        goto done;
    }
    if (chunk_bytes < 1 || data.len % chunk_bytes || parent.len > MAX_KEY) {
        PyErr_SetString(PyExc_ValueError,
                        "data must be whole chunks, and a parent key at most 64 bytes");
        goto done;
    }
    if (sha) {
        SHA256_Init(&sha_base);
        SHA256_Update(&sha_base, prefix.buf, (size_t)prefix.len);
    }
    else {
        xxh_base = XXH3_createState();
        xxh_state = XXH3_createState();
        if (xxh_base == NULL || xxh_state == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        XXH3_128bits_reset(xxh_base);
        XXH3_128bits_update(xxh_base, prefix.buf, (size_t)prefix.len);
    }
    /* With the GIL: each chunk's items field (a new reference, or NULL for none). */
    Py_ssize_t count = data.len / chunk_bytes;
    fields = PyMem_Calloc((size_t)count + 1, sizeof(PyObject *));
    out = PyMem_Malloc(((size_t)count + 1) * MAX_KEY);
    if (fields == NULL || out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *index = PyLong_FromSsize_t(first + k);
        if (index == NULL) {
            goto done;
        }
        PyObject *field = PyDict_GetItemWithError(extras, index); /* borrowed */
        Py_DECREF(index);
        if (field == NULL && PyErr_Occurred()) {
            goto done;
        }
        if (field != NULL && !PyBytes_Check(field)) {
            PyErr_SetString(PyExc_TypeError, "extras values must be bytes");
            goto done;
        }
        Py_XINCREF(field);
        fields[k] = field;
    }
    /* Without the GIL: the hashing (the bytes are the caller's own, and exported). */
    size_t key_size = (size_t)parent.len;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *prev = parent.buf;
    for (Py_ssize_t k = 0; k < count; k++) {
        unsigned char *key = out + k * MAX_KEY;
        chunk_input in = {(uint8_t)key_size, prev, key_size, "\0\0", 2,
                          (const char *)data.buf + k * chunk_bytes, (size_t)chunk_bytes};
        if (fields[k] != NULL) {
            in.extras = PyBytes_AS_STRING(fields[k]);
            in.extras_size = (size_t)PyBytes_GET_SIZE(fields[k]);
        }
        key_size = sha ? chain_sha256(&sha_base, &in, key)
                       : chain_xxh3(xxh_base, xxh_state, &in, key);
        prev = key;
    }
    Py_END_ALLOW_THREADS
    keys = PyList_New(count);
    for (Py_ssize_t k = 0; keys != NULL && k < count; k++) {
        PyObject *value = PyBytes_FromStringAndSize((const char *)out + k * MAX_KEY,
                                                    (Py_ssize_t)key_size);
        if (value == NULL) {
            Py_CLEAR(keys);
            break;
        }
        PyList_SET_ITEM(keys, k, value);
    }
done:
    if (fields != NULL) {
        for (Py_ssize_t k = 0; k < data.len / chunk_bytes; k++) {
            Py_XDECREF(fields[k]);
        }
    }
    PyMem_Free(fields);
    PyMem_Free(out);
    XXH3_freeState(xxh_base);
    XXH3_freeState(xxh_state);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return keys;
}

static PyMethodDef methods[] = {
    {"pack_u32", pack_u32, METH_O, "token_ids as a bytearray of native-endian u32."},
    {"chain", chain, METH_VARARGS, "The keys of whole chunks, chained from parent."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier.connector._keyhash", NULL, 0, methods,
};

PyMODINIT_FUNC
PyInit__keyhash(void)
{
    return PyModule_Create(&module);
}
