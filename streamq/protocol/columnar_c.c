/* RECORDS frame bodies decoded straight into Arrow's column buffers.
 *
 * A columnar reader (the Spark source's executors) would otherwise have msgpack make a
 * list, two ints, two bytes and a dict per record, and pyarrow walk them again to build
 * columns: 0.34 us per record of a 100-byte value, most of an executor's Python. Here
 * one pass over the body writes each column's buffers as Arrow lays them out (int64
 * values; int32 offsets and data for binary and string; LSB-first validity bitmaps),
 * which pyarrow wraps without copying (``streamq.protocol.columnar``).
 *
 * It takes only the protocol's exact shapes (docs/protocol.md, "Records"): seq an
 * unsigned int from 1 on, increasing; timestamp an int whose microseconds fit int64;
 * key nil or bin; value bin; headers a map of str keys (valid UTF-8) to bin or nil. For
 * any other body it returns None and the caller decodes it the pure-Python way, which
 * accepts or rejects it with its own precise error: both paths behave the same on every
 * input, by construction, and errors are written once (in Python).
 *
 * This is the one part of the compiled path written in C rather than compiled by mypyc
 * from Python (docs/reference/design.md, "The compiled path"): its pure-Python twin is
 * msgpack's decoder and pyarrow's builders, and a property test drives both with the
 * same bodies (tests/protocol/test_columnar.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RECORDS_TYPE 5

/* A growing buffer of bytes, made into a bytes object at the end. */
typedef struct {
    char *data;
    Py_ssize_t size, capacity;
} Buffer;

static int buffer_reserve(Buffer *b, Py_ssize_t more) {
    if (b->size + more <= b->capacity) return 0;
    Py_ssize_t capacity = b->capacity ? b->capacity : 256;
    while (capacity < b->size + more) capacity *= 2;
    char *data = realloc(b->data, (size_t)capacity);
    if (data == NULL) return -1;
    b->data = data;
    b->capacity = capacity;
    return 0;
}

static int buffer_add(Buffer *b, const void *bytes, Py_ssize_t n) {
    if (buffer_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->size, bytes, (size_t)n);
    b->size += n;
    return 0;
}

static int buffer_add_int32(Buffer *b, int32_t value) {
    return buffer_add(b, &value, sizeof value);
}

static PyObject *buffer_bytes(Buffer *b) {
    return PyBytes_FromStringAndSize(b->data ? b->data : "", b->size);
}

/* A reader of msgpack values in [pos, end). Each read returns 1 on success, 0 for what
 * is not the expected shape (the body goes to the pure-Python decoder). */
typedef struct {
    const unsigned char *pos, *end;
} Reader;

static inline uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

static inline int take(Reader *r, Py_ssize_t n, const unsigned char **at) {
    if (r->end - r->pos < n) return 0;
    *at = r->pos;
    r->pos += n;
    return 1;
}

/* An array's or a map's length: ``fix`` is its fix type's first byte (0x90 or 0x80),
 * ``b16`` its 16-bit type (0xdc or 0xde); a 32-bit type follows it. */
static int read_length(Reader *r, unsigned char fix, unsigned char b16, uint32_t *n) {
    const unsigned char *p;
    if (!take(r, 1, &p)) return 0;
    unsigned char t = *p;
    if ((t & 0xf0) == fix) {
        *n = t & 0x0f;
        return 1;
    }
    int width = t == b16 ? 2 : t == b16 + 1 ? 4 : 0;
    if (!width || !take(r, width, &p)) return 0;
    *n = (uint32_t)be(p, width);
    return 1;
}

static int read_array(Reader *r, uint32_t *n) { return read_length(r, 0x90, 0xdc, n); }

static int read_map(Reader *r, uint32_t *n) { return read_length(r, 0x80, 0xde, n); }

/* An int of msgpack's any width, as int64 (a uint64 above INT64_MAX is not taken). */
static int read_int(Reader *r, int64_t *value) {
    const unsigned char *p;
    if (!take(r, 1, &p)) return 0;
    unsigned char t = *p;
    if (t <= 0x7f) {
        *value = t;
        return 1;
    }
    if (t >= 0xe0) {
        *value = (int8_t)t;
        return 1;
    }
    int width;
    int is_signed;
    switch (t) {
        case 0xcc: width = 1; is_signed = 0; break;
        case 0xcd: width = 2; is_signed = 0; break;
        case 0xce: width = 4; is_signed = 0; break;
        case 0xcf: width = 8; is_signed = 0; break;
        case 0xd0: width = 1; is_signed = 1; break;
        case 0xd1: width = 2; is_signed = 1; break;
        case 0xd2: width = 4; is_signed = 1; break;
        case 0xd3: width = 8; is_signed = 1; break;
        default: return 0;
    }
    if (!take(r, width, &p)) return 0;
    uint64_t raw = be(p, width);
    if (!is_signed) {
        if (raw > INT64_MAX) return 0;
        *value = (int64_t)raw;
    } else if (width == 1) {
        *value = (int8_t)raw;
    } else if (width == 2) {
        *value = (int16_t)raw;
    } else if (width == 4) {
        *value = (int32_t)raw;
    } else {
        *value = (int64_t)raw;
    }
    return 1;
}

/* bin (``want_str`` 0) or str (1): where its bytes start, and how many. */
static int read_bytes(Reader *r, int want_str, const unsigned char **at, uint32_t *n) {
    const unsigned char *p;
    if (!take(r, 1, &p)) return 0;
    unsigned char t = *p;
    int width;
    if (want_str && (t & 0xe0) == 0xa0) {
        *n = t & 0x1f;
        return take(r, *n, at);
    }
    if (want_str) {
        width = t == 0xd9 ? 1 : t == 0xda ? 2 : t == 0xdb ? 4 : 0;
    } else {
        width = t == 0xc4 ? 1 : t == 0xc5 ? 2 : t == 0xc6 ? 4 : 0;
    }
    if (!width || !take(r, width, &p)) return 0;
    *n = (uint32_t)be(p, width);
    return take(r, *n, at);
}

static int is_nil(Reader *r) {
    if (r->pos < r->end && *r->pos == 0xc0) {
        r->pos++;
        return 1;
    }
    return 0;
}

/* Notes entry ``i`` of a column valid or null. A bitmap is kept from the first null on
 * (the entries before it valid): a column without nulls needs none. */
static int note_valid(Buffer *bitmap, Py_ssize_t *nulls, Py_ssize_t i, int valid) {
    if (valid && *nulls == 0) return 0;
    if (*nulls == 0) {
        Py_ssize_t full = i / 8;
        if (buffer_reserve(bitmap, full + 1) < 0) return -1;
        memset(bitmap->data, 0xff, (size_t)full);
        bitmap->data[full] = (char)((1 << (i % 8)) - 1);
        bitmap->size = full + 1;
    } else if (bitmap->size < i / 8 + 1) {
        if (buffer_reserve(bitmap, 1) < 0) return -1;
        bitmap->data[bitmap->size++] = 0;
    }
    if (valid) bitmap->data[i / 8] |= (char)(1 << (i % 8));
    *nulls += !valid;
    return 0;
}

/* A column's validity bitmap, or None when it has no nulls. */
static PyObject *validity(Buffer *bitmap, Py_ssize_t nulls) {
    if (nulls == 0) Py_RETURN_NONE;
    return buffer_bytes(bitmap);
}

enum { SEQS, TIMESTAMPS, KEY_OFFSETS, KEY_DATA, KEY_VALID, VALUE_OFFSETS, VALUE_DATA,
       HEADER_OFFSETS, HKEY_OFFSETS, HKEY_DATA, HVALUE_OFFSETS, HVALUE_DATA, HVALUE_VALID,
       N_BUFFERS };

typedef struct {
    Buffer b[N_BUFFERS];
    Py_ssize_t key_nulls, hvalue_nulls, headers;
} Columns;

static void columns_free(Columns *c) {
    for (int i = 0; i < N_BUFFERS; i++) free(c->b[i].data);
}

/* 1: every record read into ``c``; 0: a shape the pure-Python decoder is left; -1: out
 * of memory (an exception set). */
static int read_records(Reader *r, uint32_t count, Columns *c) {
    Buffer *b = c->b;
    /* Fixed-size columns first: no check of room per record for them. */
    if (buffer_reserve(&b[SEQS], 8 * (Py_ssize_t)count) < 0
        || buffer_reserve(&b[TIMESTAMPS], 8 * (Py_ssize_t)count) < 0
        || buffer_reserve(&b[KEY_OFFSETS], 4 * ((Py_ssize_t)count + 1)) < 0
        || buffer_reserve(&b[VALUE_OFFSETS], 4 * ((Py_ssize_t)count + 1)) < 0
        || buffer_reserve(&b[VALUE_DATA], r->end - r->pos) < 0)
        goto nomemory;
    int64_t *seqs = (int64_t *)b[SEQS].data, *times = (int64_t *)b[TIMESTAMPS].data;
    int32_t *key_offsets = (int32_t *)b[KEY_OFFSETS].data;
    int32_t *value_offsets = (int32_t *)b[VALUE_OFFSETS].data;
    key_offsets[0] = value_offsets[0] = 0;
    int64_t previous = 0;
    for (uint32_t i = 0; i < count; i++) {
        uint32_t fields, n;
        int64_t seq, ms;
        const unsigned char *at;
        if (!read_array(r, &fields) || fields != 5) return 0;
        if (!read_int(r, &seq) || seq <= previous) return 0;
        previous = seqs[i] = seq;
        if (!read_int(r, &ms) || ms > INT64_MAX / 1000 || ms < INT64_MIN / 1000) return 0;
        times[i] = ms * 1000; /* Spark's timestamps are microseconds */
        if (is_nil(r)) {
            if (note_valid(&b[KEY_VALID], &c->key_nulls, i, 0) < 0) goto nomemory;
        } else {
            if (!read_bytes(r, 0, &at, &n)) return 0;
            if (buffer_add(&b[KEY_DATA], at, n) < 0
                || note_valid(&b[KEY_VALID], &c->key_nulls, i, 1) < 0)
                goto nomemory;
        }
        if (b[KEY_DATA].size > INT32_MAX) return 0;
        key_offsets[i + 1] = (int32_t)b[KEY_DATA].size;
        if (!read_bytes(r, 0, &at, &n)) return 0;
        memcpy(b[VALUE_DATA].data + b[VALUE_DATA].size, at, n); /* reserved: within the body */
        b[VALUE_DATA].size += n;
        if (b[VALUE_DATA].size > INT32_MAX) return 0;
        value_offsets[i + 1] = (int32_t)b[VALUE_DATA].size;
        uint32_t pairs;
        if (!read_map(r, &pairs)) return 0;
        if (pairs && c->headers == 0) {
            /* The first record with headers: every one before it had none. */
            for (uint32_t j = 0; j <= i; j++)
                if (buffer_add_int32(&b[HEADER_OFFSETS], 0) < 0) goto nomemory;
            if (buffer_add_int32(&b[HKEY_OFFSETS], 0) < 0
                || buffer_add_int32(&b[HVALUE_OFFSETS], 0) < 0)
                goto nomemory;
        }
        for (uint32_t j = 0; j < pairs; j++) {
            if (!read_bytes(r, 1, &at, &n)) return 0;
            PyObject *key = PyUnicode_DecodeUTF8((const char *)at, n, "strict");
            if (key == NULL) {
                PyErr_Clear();
                return 0;
            }
            Py_DECREF(key);
            /* A key twice in one map: msgpack's dict keeps the last; left to it. */
            const int32_t *seen = (const int32_t *)b[HKEY_OFFSETS].data;
            for (Py_ssize_t k = c->headers - j; k < c->headers; k++) {
                int32_t from = seen[k], length = seen[k + 1] - from;
                if ((uint32_t)length == n && memcmp(b[HKEY_DATA].data + from, at, n) == 0)
                    return 0;
            }
            if (buffer_add(&b[HKEY_DATA], at, n) < 0
                || buffer_add_int32(&b[HKEY_OFFSETS], (int32_t)b[HKEY_DATA].size) < 0)
                goto nomemory;
            int valid = !is_nil(r);
            if (valid && !read_bytes(r, 0, &at, &n)) return 0;
            if ((valid && buffer_add(&b[HVALUE_DATA], at, n) < 0)
                || buffer_add_int32(&b[HVALUE_OFFSETS], (int32_t)b[HVALUE_DATA].size) < 0
                || note_valid(&b[HVALUE_VALID], &c->hvalue_nulls, c->headers, valid) < 0)
                goto nomemory;
            c->headers++;
            if (b[HKEY_DATA].size > INT32_MAX || b[HVALUE_DATA].size > INT32_MAX) return 0;
        }
        if (c->headers && buffer_add_int32(&b[HEADER_OFFSETS], (int32_t)c->headers) < 0)
            goto nomemory;
    }
    b[SEQS].size = b[TIMESTAMPS].size = 8 * (Py_ssize_t)count;
    b[KEY_OFFSETS].size = b[VALUE_OFFSETS].size = 4 * ((Py_ssize_t)count + 1);
    return 1;
nomemory:
    PyErr_NoMemory();
    return -1;
}

PyDoc_STRVAR(decode_doc,
"decode(body: bytes) -> tuple | None\n\n"
"A RECORDS frame body's records as Arrow column buffers: (fields, tail, count, seqs,\n"
"timestamps in microseconds, key offsets, key data, key validity or None, value\n"
"offsets, value data, then for headers None or (entry offsets, key offsets, key data,\n"
"value offsets, value data, value validity or None)). ``fields``: the message's array\n"
"length; ``tail``: where its fields after the records start. None for a body of any\n"
"other shape: decode it the pure-Python way.");

static PyObject *decode(PyObject *Py_UNUSED(module), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Reader r = {(const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len};
    Columns c;
    memset(&c, 0, sizeof c);
    PyObject *result = NULL;
    uint32_t fields, count;
    int64_t type;
    if (!read_array(&r, &fields) || fields < 2 || fields > 4 || !read_int(&r, &type)
        || type != RECORDS_TYPE || !read_array(&r, &count)
        || (Py_ssize_t)count > r.end - r.pos) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    int read = read_records(&r, count, &c);
    if (read < 0) goto done;
    if (read == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    Buffer *b = c.b;
    PyObject *headers;
    if (c.headers) {
        headers = Py_BuildValue(
            "(NNNNNN)", buffer_bytes(&b[HEADER_OFFSETS]), buffer_bytes(&b[HKEY_OFFSETS]),
            buffer_bytes(&b[HKEY_DATA]), buffer_bytes(&b[HVALUE_OFFSETS]),
            buffer_bytes(&b[HVALUE_DATA]), validity(&b[HVALUE_VALID], c.hvalue_nulls));
    } else {
        headers = Py_NewRef(Py_None);
    }
    if (headers == NULL) goto done;
    result = Py_BuildValue(
        "(InINNNNNNNN)", fields, (Py_ssize_t)(r.pos - (const unsigned char *)view.buf), count,
        buffer_bytes(&b[SEQS]), buffer_bytes(&b[TIMESTAMPS]), buffer_bytes(&b[KEY_OFFSETS]),
        buffer_bytes(&b[KEY_DATA]), validity(&b[KEY_VALID], c.key_nulls),
        buffer_bytes(&b[VALUE_OFFSETS]), buffer_bytes(&b[VALUE_DATA]), headers);
done:
    columns_free(&c);
    PyBuffer_Release(&view);
    return result;
}

/* A record's fields as a ``Record`` (``type``, a tuple subclass of 5), or NULL: 0 in
 * ``*shape`` for a shape left to the pure-Python decoder, -1 with an exception set. Its
 * fields are ints, bytes, None and a dict of str to bytes, none of which can hold a
 * reference back: the record is untracked by the cyclic garbage collector, whose passes
 * over the records a consumer holds otherwise took more of its CPU than the decoding. */
static PyObject *read_record(Reader *r, PyTypeObject *type, int64_t previous, int64_t *seq,
                             int *shape) {
    uint32_t fields, n, pairs;
    int64_t ms;
    const unsigned char *at;
    PyObject *key = NULL, *value = NULL, *headers = NULL, *record;
    *shape = 0;
    if (!read_array(r, &fields) || fields != 5) return NULL;
    if (!read_int(r, seq) || *seq <= previous || !read_int(r, &ms)) return NULL;
    if (is_nil(r)) {
        key = Py_NewRef(Py_None);
    } else {
        if (!read_bytes(r, 0, &at, &n)) return NULL;
        if ((key = PyBytes_FromStringAndSize((const char *)at, n)) == NULL) goto failed;
    }
    if (!read_bytes(r, 0, &at, &n)) goto shaped;
    if ((value = PyBytes_FromStringAndSize((const char *)at, n)) == NULL) goto failed;
    if (!read_map(r, &pairs)) goto shaped;
    if ((headers = PyDict_New()) == NULL) goto failed;
    for (uint32_t j = 0; j < pairs; j++) {
        if (!read_bytes(r, 1, &at, &n)) goto shaped;
        PyObject *name = PyUnicode_DecodeUTF8((const char *)at, n, "strict");
        if (name == NULL) {
            PyErr_Clear();
            goto shaped;
        }
        if (!read_bytes(r, 0, &at, &n)) {
            Py_DECREF(name);
            goto shaped;
        }
        PyObject *bytes = PyBytes_FromStringAndSize((const char *)at, n);
        /* A key twice in one map: the last kept, as msgpack's dict keeps it. */
        int set = bytes == NULL ? -1 : PyDict_SetItem(headers, name, bytes);
        Py_DECREF(name);
        Py_XDECREF(bytes);
        if (set < 0) goto failed;
    }
    if ((record = type->tp_alloc(type, 5)) == NULL) goto failed;
    PyObject *seq_object = PyLong_FromLongLong(*seq), *ms_object = PyLong_FromLongLong(ms);
    if (seq_object == NULL || ms_object == NULL) {
        Py_XDECREF(seq_object);
        Py_XDECREF(ms_object);
        Py_DECREF(record);
        goto failed;
    }
    PyTuple_SET_ITEM(record, 0, seq_object);
    PyTuple_SET_ITEM(record, 1, ms_object);
    PyTuple_SET_ITEM(record, 2, key);
    PyTuple_SET_ITEM(record, 3, value);
    PyTuple_SET_ITEM(record, 4, headers);
    PyObject_GC_UnTrack(record);
    return record;
failed:
    *shape = -1;
shaped:
    Py_XDECREF(key);
    Py_XDECREF(value);
    Py_XDECREF(headers);
    return NULL;
}

PyDoc_STRVAR(decode_records_doc,
"decode_records(body: bytes, record: type, max_seq: int) -> list | None\n\n"
"A RECORDS frame body's fields: [records, epoch?, through?], its records a tuple of\n"
"``record`` tuples, its epoch and through ints or None (unchecked). None for a body of any\n"
"other shape, or a seq beyond ``max_seq``: decode it the pure-Python way.");

static PyObject *decode_records(PyObject *Py_UNUSED(module), PyObject *const *args,
                                Py_ssize_t nargs) {
    if (nargs != 3 || !PyType_Check(args[1]) || !PyType_IsSubtype((PyTypeObject *)args[1],
                                                                    &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "decode_records(body, record type, max_seq)");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)args[1];
    int64_t max_seq = PyLong_AsLongLong(args[2]);
    if (max_seq == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    Reader r = {(const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len};
    PyObject *records = NULL, *result = NULL;
    uint32_t fields, count;
    int64_t kind, seq, previous = 0;
    if (!read_array(&r, &fields) || fields < 2 || fields > 4 || !read_int(&r, &kind)
        || kind != RECORDS_TYPE || !read_array(&r, &count)
        || (Py_ssize_t)count > r.end - r.pos)
        goto other;
    if ((records = PyTuple_New(count)) == NULL) goto done;
    for (uint32_t i = 0; i < count; i++) {
        int shape;
        PyObject *record = read_record(&r, type, previous, &seq, &shape);
        if (record == NULL) {
            if (shape < 0) goto done;
            goto other;
        }
        PyTuple_SET_ITEM(records, i, record);
        previous = seq;
    }
    if (previous > max_seq || (result = PyList_New(fields - 1)) == NULL) goto checked;
    PyList_SET_ITEM(result, 0, Py_NewRef(records));
    for (uint32_t i = 1; i < fields - 1; i++) {
        int64_t number;
        PyObject *field;
        if (is_nil(&r)) {
            field = Py_NewRef(Py_None);
        } else if (!read_int(&r, &number)) {
            Py_CLEAR(result);
            goto checked;
        } else if ((field = PyLong_FromLongLong(number)) == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, field);
    }
    if (r.pos != r.end) Py_CLEAR(result);
checked:
    if (result != NULL || PyErr_Occurred()) goto done;
other:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(records);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_O, decode_doc},
    {"decode_records", (PyCFunction)(void (*)(void))decode_records, METH_FASTCALL,
     decode_records_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "columnar_c",
    "RECORDS frame bodies decoded into Arrow column buffers (see streamq.protocol.columnar).",
    -1, methods,
};

PyMODINIT_FUNC PyInit_columnar_c(void) { return PyModule_Create(&module); }
