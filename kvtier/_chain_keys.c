/* Page keys in one call: the SHA-256 chain of kvtier.keys.chain_keys (key = SHA-256(parent key || page tokens)),
 * computed in C with OpenSSL's SHA-256 (the library hashlib uses), so a 128k-token prompt costs its compressions and
 * not 128k Python calls. Built by the package's normal install where a compiler and OpenSSL's headers are present;
 * kvtier.keys falls back to hashlib otherwise, with the same keys. */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED
#include <Python.h>
#include <openssl/sha.h>
#include <string.h>

#define KEY_BYTES 32

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer parent, data;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "y*y*n", &parent, &data, &width))
        return NULL;
    PyObject *keys = NULL;
    if (parent.len != KEY_BYTES || width <= 0 || data.len % width) {
        PyErr_Format(PyExc_ValueError, "chain: a %d-byte parent and whole pages of a positive width", KEY_BYTES);
        goto done;
    }
    Py_ssize_t count = data.len / width;
    unsigned char *out = PyMem_RawMalloc(count ? (size_t)count * KEY_BYTES : 1);
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS                       /* the hashing needs no Python object: other threads run */
    const unsigned char *key = (const unsigned char *)parent.buf, *page = (const unsigned char *)data.buf;
    SHA256_CTX ctx;
    for (Py_ssize_t i = 0; i < count; i++, page += width) {
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, key, KEY_BYTES);
        SHA256_Update(&ctx, page, (size_t)width);
        SHA256_Final(out + i * KEY_BYTES, &ctx);
        key = out + i * KEY_BYTES;
    }
    Py_END_ALLOW_THREADS
    keys = PyList_New(count);
    for (Py_ssize_t i = 0; keys != NULL && i < count; i++) {
        PyObject *item = PyBytes_FromStringAndSize((const char *)out + i * KEY_BYTES, KEY_BYTES);
        if (item == NULL)
            Py_CLEAR(keys);
        else
            PyList_SET_ITEM(keys, i, item);
    }
    PyMem_RawFree(out);
done:
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return keys;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(parent, data, width) -> list of 32-byte keys: SHA-256(previous key || page) for each width-byte page."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._chain_keys", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain_keys(void) { return PyModule_Create(&module); }
