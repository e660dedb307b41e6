/* A bulk publish's records encoded as stored: ``codec.encode_values`` in C.
 *
 * ``publish_many`` encodes each value as the record ``[seq, timestamp, nil, value, {}]``
 * (msgpack, the bytes producers store and send). In Python that is a list, a dict and
 * msgpack's packer per record: about 0.24 us a record of a 100-byte value, the largest
 * part of numbering a transaction's records (``python -m bench.tools.tx_cost``). Here
 * each record's bytes are written in one go: about 0.02 us.
 *
 * A first seq of 0 encodes them all unnumbered, each with seq 0 (numbered when stored or
 * read, ``codec.numbered``): a Spark executor's records, encoded before they have seqs.
 *
 * It takes only the common shape: seqs and the timestamp exact ints from 0 to 2**64 - 1,
 * values a list or tuple of exact bytes of under 2**32 bytes. For any other input it
 * returns None and the caller encodes the pure-Python way, which encodes it or refuses it
 * with its own error: errors are written once, in Python. The encoding is msgpack's
 * smallest form for each field, as msgpack's packer writes it; a property test holds the
 * two to the same bytes (tests/protocol/test_records_c.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The bytes msgpack's smallest form of the unsigned int ``v`` takes. */
static Py_ssize_t uint_size(uint64_t v) {
    if (v < 0x80) return 1;
    if (v <= 0xff) return 2;
    if (v <= 0xffff) return 3;
    if (v <= 0xffffffffULL) return 5;
    return 9;
}

/* ``n`` bytes of ``v``, big-endian, at ``p``; returns the byte after them. */
static char *put_big_endian(char *p, uint64_t v, int n) {
    for (int shift = 8 * (n - 1); shift >= 0; shift -= 8) *p++ = (char)(v >> shift);
    return p;
}

static char *put_uint(char *p, uint64_t v) {
    if (v < 0x80) {
        *p++ = (char)v;
        return p;
    }
    if (v <= 0xff) {
        *p++ = (char)0xcc;
        return put_big_endian(p, v, 1);
    }
    if (v <= 0xffff) {
        *p++ = (char)0xcd;
        return put_big_endian(p, v, 2);
    }
    if (v <= 0xffffffffULL) {
        *p++ = (char)0xce;
        return put_big_endian(p, v, 4);
    }
    *p++ = (char)0xcf;
    return put_big_endian(p, v, 8);
}

/* An exact int from 0 to 2**64 - 1 into ``out``; 0 if ``value`` is anything else. */
static int as_uint64(PyObject *value, uint64_t *out) {
    if (!PyLong_CheckExact(value)) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();  /* negative or too large: the pure-Python way says what it does */
        return 0;
    }
    *out = (uint64_t)v;
    return 1;
}

static PyObject *encode_values(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "encode_values(first_seq, timestamp, values)");
        return NULL;
    }
    uint64_t first, timestamp;
    PyObject *values = args[2];
    if (!as_uint64(args[0], &first) || !as_uint64(args[1], &timestamp)) Py_RETURN_NONE;
    if (!PyList_CheckExact(values) && !PyTuple_CheckExact(values)) Py_RETURN_NONE;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(values);
    PyObject **items = PySequence_Fast_ITEMS(values);
    if (first != 0 && count > 0 && (uint64_t)(count - 1) > UINT64_MAX - first) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyBytes_CheckExact(items[i]) || (uint64_t)PyBytes_GET_SIZE(items[i]) > 0xffffffffULL)
            Py_RETURN_NONE;
    }
    PyObject *records = PyList_New(count);
    if (records == NULL) return NULL;
    Py_ssize_t stamp = uint_size(timestamp);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = items[i];
        Py_ssize_t length = PyBytes_GET_SIZE(value);
        uint64_t seq = first == 0 ? 0 : first + (uint64_t)i;
        Py_ssize_t head = length <= 0xff ? 2 : length <= 0xffff ? 3 : 5;
        /* fixarray 5, seq, timestamp, nil, bin header, value, fixmap 0 */
        Py_ssize_t size = 1 + uint_size(seq) + stamp + 1 + head + length + 1;
        PyObject *record = PyBytes_FromStringAndSize(NULL, size);
        if (record == NULL) {
            Py_DECREF(records);
            return NULL;
        }
        char *p = PyBytes_AS_STRING(record);
        *p++ = (char)0x95;
        p = put_uint(p, seq);
        p = put_uint(p, timestamp);
        *p++ = (char)0xc0;
        if (length <= 0xff) {
            *p++ = (char)0xc4;
            p = put_big_endian(p, (uint64_t)length, 1);
        } else if (length <= 0xffff) {
            *p++ = (char)0xc5;
            p = put_big_endian(p, (uint64_t)length, 2);
        } else {
            *p++ = (char)0xc6;
            p = put_big_endian(p, (uint64_t)length, 4);
        }
        memcpy(p, PyBytes_AS_STRING(value), (size_t)length);
        p[length] = (char)0x80;
        PyList_SET_ITEM(records, i, record);
    }
    return records;
}

static PyMethodDef methods[] = {
    {"encode_values", (PyCFunction)(void (*)(void))encode_values, METH_FASTCALL,
     "encode_values(first_seq, timestamp, values): each value's record as stored, under "
     "consecutive seqs from first_seq (0: all unnumbered, seq 0); None for any input "
     "beyond the common shape."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "records_c", "A bulk publish's records encoded as stored.", -1, methods,
};

PyMODINIT_FUNC PyInit_records_c(void) { return PyModule_Create(&module); }
