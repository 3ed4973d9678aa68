/* hwpc-sensor's JSON lines, and PowerAPI's CSV rows, parsed straight into columns.
 *
 * parse_csv (at the end of this file) reads whole lines of one CSV events file the same way,
 * for wattflow.formats.csv_frames.
 *
 * parse(lines) reads a batch of hwpc-sensor's JSON reports (a list of bytes, one report each)
 * and writes every cpu's counters into flat int64 columns, without a Python object per report,
 * socket, cpu or counter. It reads only the plain form hwpc-sensor writes: an object with
 * "timestamp", "sensor", "target", "groups" and an optional empty "metadata", in any order;
 * groups of sockets of cpus of integer counters; sockets and cpus written as their number; the
 * same events, in the same order, on every cpu of a group in a line. Anything else (escapes,
 * floats, signs, counters beyond 63 bits, sockets from 65,536 or cpus from 1,048,576 on, unknown
 * or repeated keys, a cpu with other events, bytes that are not JSON) makes it decline: it returns None and the caller reads the batch the
 * way it always did. Every read is bounded by the line's length: the lines come from a network
 * socket.
 *
 * What it returns (see parse's docstring below) is what wattflow.formats.json_frames needs to
 * make the frames; the rules that place a line in a frame (ticks in order, one report per
 * (tick, target), the order of groups) are checked there, on these columns, with numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define OK 0
#define DECLINE (-1)
#define FAIL (-2) /* a Python exception is set (memory) */

#define MAX_GROUPS_PER_LINE 64
#define MAX_EVENTS 128
#define MAX_SIGNATURES 64
#define MAX_SHAPES 64
#define MAX_ID_DIGITS 18  /* an integer timestamp */
/* Socket and cpu numbers are below these (wattflow.formats.reports' SOCKET_LIMIT and
 * CPU_LIMIT): a line with a larger one declines the batch, and the Python way refuses that
 * line alone. */
#define SOCKET_LIMIT 65536
#define CPU_LIMIT 1048576
#define LIMIT_DIGITS 7 /* digits of CPU_LIMIT: no number below it has more */

#define TRY(call)                  \
    do {                           \
        int status_ = (call);      \
        if (status_ != OK) {       \
            return status_;        \
        }                          \
    } while (0)

/* --- growable int64 vectors ------------------------------------------------------------- */

typedef struct {
    int64_t *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Vec;

static int vec_reserve(Vec *vec, Py_ssize_t more) {
    if (more <= vec->cap - vec->len) {
        return OK;
    }
    Py_ssize_t need = vec->len + more;
    Py_ssize_t cap = vec->cap ? vec->cap : 64;
    while (cap < need) {
        if (cap > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)sizeof(int64_t)) {
            PyErr_NoMemory();
            return FAIL;
        }
        cap *= 2;
    }
    int64_t *data = PyMem_Realloc(vec->data, (size_t)cap * sizeof(int64_t));
    if (data == NULL) {
        PyErr_NoMemory();
        return FAIL;
    }
    vec->data = data;
    vec->cap = cap;
    return OK;
}

static inline int vec_push(Vec *vec, int64_t value) {
    if (vec->len == vec->cap) {
        TRY(vec_reserve(vec, 1));
    }
    vec->data[vec->len++] = value;
    return OK;
}

static void vec_free(Vec *vec) {
    PyMem_Free(vec->data);
    vec->data = NULL;
    vec->len = vec->cap = 0;
}

static PyObject *vec_bytes(const Vec *vec) {
    return PyByteArray_FromStringAndSize((const char *)vec->data,
                                         vec->len * (Py_ssize_t)sizeof(int64_t));
}

/* --- interned strings: each distinct text once, as a Python str, by its bytes ---------------- */

typedef struct {
    const char *text; /* in one of the lines, which the batch's tuple keeps alive */
    Py_ssize_t size;
    uint64_t hash;
    Py_ssize_t id;
} Slot;

typedef struct {
    Slot *slots;
    Py_ssize_t cap; /* a power of two */
    Py_ssize_t used;
    PyObject *strings; /* list of str, by id; NULL: made after, by interned_strings */
} Interned;

static uint64_t hash_of(const char *text, Py_ssize_t size) {
    uint64_t hash = 1469598103934665603ULL;
    for (Py_ssize_t at = 0; at < size; at++) {
        hash = (hash ^ (unsigned char)text[at]) * 1099511628211ULL;
    }
    return hash;
}

/* The raw allocator, and no exception set where there are no strings (the CSV rows are
 * read without the interpreter's lock): the caller sets it once it holds the lock. */
static int interned_grow(Interned *table) {
    Py_ssize_t cap = table->cap ? table->cap * 2 : 256;
    Slot *slots = NULL;
    if (cap <= PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(Slot) / 2) {
        slots = PyMem_RawCalloc((size_t)cap, sizeof(Slot));
    }
    if (slots == NULL) {
        if (table->strings != NULL) {
            PyErr_NoMemory();
        }
        return FAIL;
    }
    for (Py_ssize_t at = 0; at < table->cap; at++) {
        Slot *old = &table->slots[at];
        if (old->text == NULL) {
            continue;
        }
        Py_ssize_t to = (Py_ssize_t)(old->hash & (uint64_t)(cap - 1));
        while (slots[to].text != NULL) {
            to = (to + 1) & (cap - 1);
        }
        slots[to] = *old;
    }
    PyMem_RawFree(table->slots);
    table->slots = slots;
    table->cap = cap;
    return OK;
}

/* The str of an interned text, appended to the table's strings (valid UTF-8, or DECLINE). */
static int intern_string(Interned *table, const char *text, Py_ssize_t size) {
    PyObject *string = PyUnicode_DecodeUTF8(text, size, NULL);
    if (string == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            return DECLINE;
        }
        return FAIL;
    }
    int appended = PyList_Append(table->strings, string);
    Py_DECREF(string);
    return appended < 0 ? FAIL : OK;
}

/* The id of a string's text, interning it (as a str, which must be valid UTF-8) when new; its
 * str made later where the table has no strings yet. */
static int intern(Interned *table, const char *text, Py_ssize_t size, Py_ssize_t *id) {
    if ((table->used + 1) * 2 > table->cap) {
        TRY(interned_grow(table));
    }
    uint64_t hash = hash_of(text, size);
    Py_ssize_t at = (Py_ssize_t)(hash & (uint64_t)(table->cap - 1));
    while (table->slots[at].text != NULL) {
        Slot *slot = &table->slots[at];
        if (slot->hash == hash && slot->size == size && memcmp(slot->text, text, size) == 0) {
            *id = slot->id;
            return OK;
        }
        at = (at + 1) & (table->cap - 1);
    }
    if (table->strings != NULL) {
        TRY(intern_string(table, text, size));
    }
    Slot *slot = &table->slots[at];
    slot->text = text == NULL ? "" : text;
    slot->size = size;
    slot->hash = hash;
    slot->id = table->used++;
    *id = slot->id;
    return OK;
}

/* The strings of a table interned without them, by id. */
static int interned_strings(Interned *table) {
    table->strings = PyList_New(table->used);
    if (table->strings == NULL) {
        return FAIL;
    }
    for (Py_ssize_t at = 0; at < table->cap; at++) {
        Slot *slot = &table->slots[at];
        if (slot->text == NULL) {
            continue;
        }
        PyObject *string = PyUnicode_DecodeUTF8(slot->text, slot->size, NULL);
        if (string == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                return FAIL;
            }
            PyErr_Clear();
            return DECLINE;
        }
        PyList_SET_ITEM(table->strings, slot->id, string);
    }
    return OK;
}

/* --- the batch's columns ---------------------------------------------------------------------- */

typedef struct {
    Py_ssize_t width;
    Py_ssize_t ids[MAX_EVENTS]; /* the events' string ids, in the cpus' order */
} Signature;

typedef struct {
    Py_ssize_t group;     /* string id of the group's name */
    Py_ssize_t signature; /* index into the signatures */
    Vec lines, sockets, cpus, values; /* per cpu row; values: width per row */
} Shape;

typedef struct {
    Interned names;
    Signature *signatures;
    Py_ssize_t signature_count;
    Shape *shapes;
    Py_ssize_t shape_count;
    PyObject *stamps; /* list: each distinct timestamp of consecutive lines, as int or str */
    const char *stamp_text; /* the last timestamp's bytes, quotes included */
    Py_ssize_t stamp_size;
    Vec line_stamps, line_sensors, line_targets;
    Vec occurrence_lines, occurrence_shapes; /* a line's groups, in the line's order */
    Vec socket_keys; /* the sockets of the group being read */
    Vec scratch; /* socket or cpu numbers to check for repeats */
    int64_t line;
} Batch;

typedef struct {
    const char *at;
    const char *end;
} Cursor;

static inline void skip_space(Cursor *cursor) {
    while (cursor->at < cursor->end) {
        char c = *cursor->at;
        if (c != ' ' && c != '\n' && c != '\r' && c != '\t') {
            return;
        }
        cursor->at++;
    }
}

static inline int expect(Cursor *cursor, char c) {
    skip_space(cursor);
    if (cursor->at >= cursor->end || *cursor->at != c) {
        return DECLINE;
    }
    cursor->at++;
    return OK;
}

/* ',' (1) or the closing character (0) after a member, anything else declines. */
static inline int next_member(Cursor *cursor, char close, int *more) {
    skip_space(cursor);
    if (cursor->at >= cursor->end) {
        return DECLINE;
    }
    if (*cursor->at == ',') {
        cursor->at++;
        *more = 1;
        return OK;
    }
    if (*cursor->at == close) {
        cursor->at++;
        *more = 0;
        return OK;
    }
    return DECLINE;
}

/* A string without escapes or control characters: its bytes between the quotes. */
static inline int read_string(Cursor *cursor, const char **text, Py_ssize_t *size) {
    skip_space(cursor);
    if (cursor->at >= cursor->end || *cursor->at != '"') {
        return DECLINE;
    }
    const char *start = ++cursor->at;
    while (cursor->at < cursor->end) {
        unsigned char c = (unsigned char)*cursor->at;
        if (c == '"') {
            *text = start;
            *size = cursor->at - start;
            cursor->at++;
            return OK;
        }
        if (c == '\\' || c < 0x20) {
            return DECLINE;
        }
        cursor->at++;
    }
    return DECLINE;
}

/* A non-negative integer that fits int64, written as its number ("0" or digits not starting
 * with 0), from *text on: *text is left after its digits. */
static inline int read_integer(const char **text, const char *end, int64_t *value) {
    const char *at = *text;
    if (at >= end || *at < '0' || *at > '9' || (*at == '0' && at + 1 < end && at[1] >= '0' &&
                                                 at[1] <= '9')) {
        return DECLINE;
    }
    uint64_t number = 0;
    /* Eighteen digits are at most 10^18 - 1, under INT64_MAX: no check until then (a counter
     * has a dozen digits, and the check's division was a tenth of reading a row). */
    const char *unchecked = end - at > 18 ? at + 18 : end;
    while (at < unchecked && *at >= '0' && *at <= '9') {
        number = number * 10 + (uint64_t)(*at - '0');
        at++;
    }
    while (at < end && *at >= '0' && *at <= '9') {
        uint64_t digit = (uint64_t)(*at - '0');
        if (number > ((uint64_t)INT64_MAX - digit) / 10) {
            return DECLINE;
        }
        number = number * 10 + digit;
        at++;
    }
    *text = at;
    *value = (int64_t)number;
    return OK;
}

/* A non-negative JSON integer that fits int64 (no sign, fraction or exponent). */
static inline int read_counter(Cursor *cursor, int64_t *value) {
    skip_space(cursor);
    TRY(read_integer(&cursor->at, cursor->end, value));
    const char *at = cursor->at;
    if (at < cursor->end && (*at == '.' || *at == 'e' || *at == 'E')) {
        return DECLINE;
    }
    return OK;
}

/* A socket's or cpu's key: the text of its number, "0" or digits not starting with 0, and
 * the number below limit. */
static inline int read_number_key(Cursor *cursor, int64_t limit, int64_t *value) {
    const char *text;
    Py_ssize_t size;
    TRY(read_string(cursor, &text, &size));
    if (size < 1 || size > LIMIT_DIGITS || (text[0] == '0' && size > 1)) {
        return DECLINE;
    }
    int64_t number = 0;
    for (Py_ssize_t at = 0; at < size; at++) {
        if (text[at] < '0' || text[at] > '9') {
            return DECLINE;
        }
        number = number * 10 + (text[at] - '0');
    }
    if (number >= limit) {
        return DECLINE;
    }
    *value = number;
    return OK;
}

static int compare_int64(const void *left, const void *right) {
    int64_t a = *(const int64_t *)left;
    int64_t b = *(const int64_t *)right;
    return (a > b) - (a < b);
}

/* Whether numbers[0..count) has no repeat: a JSON object with a key twice is not plain. */
static int check_distinct(Batch *batch, const int64_t *numbers, Py_ssize_t count) {
    batch->scratch.len = 0;
    TRY(vec_reserve(&batch->scratch, count));
    memcpy(batch->scratch.data, numbers, (size_t)count * sizeof(int64_t));
    qsort(batch->scratch.data, (size_t)count, sizeof(int64_t), compare_int64);
    for (Py_ssize_t at = 1; at < count; at++) {
        if (batch->scratch.data[at] == batch->scratch.data[at - 1]) {
            return DECLINE;
        }
    }
    return OK;
}

static int find_shape(Batch *batch, Py_ssize_t group, const Signature *signature,
                      Py_ssize_t *found) {
    Py_ssize_t index = -1;
    for (Py_ssize_t at = 0; at < batch->signature_count; at++) {
        Signature *known = &batch->signatures[at];
        if (known->width == signature->width &&
            memcmp(known->ids, signature->ids, (size_t)signature->width * sizeof(Py_ssize_t)) ==
                0) {
            index = at;
            break;
        }
    }
    if (index < 0) {
        if (batch->signature_count >= MAX_SIGNATURES) {
            return DECLINE;
        }
        index = batch->signature_count++;
        batch->signatures[index] = *signature;
    }
    for (Py_ssize_t at = 0; at < batch->shape_count; at++) {
        if (batch->shapes[at].group == group && batch->shapes[at].signature == index) {
            *found = at;
            return OK;
        }
    }
    if (batch->shape_count >= MAX_SHAPES) {
        return DECLINE;
    }
    Shape *shape = &batch->shapes[batch->shape_count];
    memset(shape, 0, sizeof(Shape));
    shape->group = group;
    shape->signature = index;
    *found = batch->shape_count++;
    return OK;
}

typedef struct {
    Py_ssize_t width;
    const char *texts[MAX_EVENTS];
    Py_ssize_t sizes[MAX_EVENTS];
} EventNames;

/* The first cpu of a group in a line: its events name the group's shape. */
static int read_first_cpu(Batch *batch, Cursor *cursor, Py_ssize_t group, EventNames *names,
                          Shape **shape) {
    int64_t values[MAX_EVENTS];
    Signature signature;
    TRY(expect(cursor, '{'));
    int more = 1;
    Py_ssize_t width = 0;
    while (more) {
        if (width >= MAX_EVENTS) {
            return DECLINE;
        }
        TRY(read_string(cursor, &names->texts[width], &names->sizes[width]));
        TRY(expect(cursor, ':'));
        TRY(read_counter(cursor, &values[width]));
        width++;
        TRY(next_member(cursor, '}', &more));
    }
    names->width = width;
    signature.width = width;
    for (Py_ssize_t at = 0; at < width; at++) {
        TRY(intern(&batch->names, names->texts[at], names->sizes[at], &signature.ids[at]));
        for (Py_ssize_t before = 0; before < at; before++) {
            if (signature.ids[before] == signature.ids[at]) {
                return DECLINE; /* an event twice */
            }
        }
    }
    Py_ssize_t index;
    TRY(find_shape(batch, group, &signature, &index));
    *shape = &batch->shapes[index];
    TRY(vec_reserve(&(*shape)->values, width));
    memcpy((*shape)->values.data + (*shape)->values.len, values, (size_t)width * sizeof(int64_t));
    (*shape)->values.len += width;
    return OK;
}

/* Any other cpu of the group in the line: the first cpu's events, in its order. */
static int read_cpu(Cursor *cursor, const EventNames *names, Shape *shape) {
    TRY(expect(cursor, '{'));
    TRY(vec_reserve(&shape->values, names->width));
    int64_t *values = shape->values.data + shape->values.len;
    for (Py_ssize_t at = 0; at < names->width; at++) {
        if (at) {
            TRY(expect(cursor, ','));
        }
        /* The first cpu's name, quoted: the names hold no quote, backslash or control
         * character (read_string took them), so these bytes are that string and no other. */
        skip_space(cursor);
        Py_ssize_t size = names->sizes[at];
        const char *text = cursor->at;
        if (cursor->end - text < size + 2 || text[0] != '"' || text[size + 1] != '"' ||
            memcmp(text + 1, names->texts[at], (size_t)size) != 0) {
            return DECLINE;
        }
        cursor->at = text + size + 2;
        TRY(expect(cursor, ':'));
        TRY(read_counter(cursor, &values[at]));
    }
    TRY(expect(cursor, '}'));
    shape->values.len += names->width;
    return OK;
}

/* One group of a line: its sockets, their cpus and their counters, as rows of its shape. */
static int read_group(Batch *batch, Cursor *cursor, Py_ssize_t group) {
    Shape *shape = NULL;
    EventNames names;
    int64_t last_socket = -1;
    int sockets_sorted = 1;
    batch->socket_keys.len = 0;
    TRY(expect(cursor, '{'));
    int more_sockets = 1;
    while (more_sockets) {
        int64_t socket;
        TRY(read_number_key(cursor, SOCKET_LIMIT, &socket));
        TRY(vec_push(&batch->socket_keys, socket));
        sockets_sorted &= socket > last_socket;
        last_socket = socket;
        TRY(expect(cursor, ':'));
        TRY(expect(cursor, '{'));
        Py_ssize_t cpus_start = shape ? shape->cpus.len : 0;
        int64_t last_cpu = -1;
        int cpus_sorted = 1;
        int more_cpus = 1;
        while (more_cpus) {
            int64_t cpu;
            TRY(read_number_key(cursor, CPU_LIMIT, &cpu));
            TRY(expect(cursor, ':'));
            if (shape == NULL) {
                TRY(read_first_cpu(batch, cursor, group, &names, &shape));
                cpus_start = shape->cpus.len;
            } else {
                TRY(read_cpu(cursor, &names, shape));
            }
            TRY(vec_push(&shape->lines, batch->line));
            TRY(vec_push(&shape->sockets, socket));
            TRY(vec_push(&shape->cpus, cpu));
            cpus_sorted &= cpu > last_cpu;
            last_cpu = cpu;
            TRY(next_member(cursor, '}', &more_cpus));
        }
        if (!cpus_sorted) {
            TRY(check_distinct(batch, shape->cpus.data + cpus_start,
                               shape->cpus.len - cpus_start));
        }
        TRY(next_member(cursor, '}', &more_sockets));
    }
    if (!sockets_sorted) {
        TRY(check_distinct(batch, batch->socket_keys.data, batch->socket_keys.len));
    }
    TRY(vec_push(&batch->occurrence_lines, batch->line));
    TRY(vec_push(&batch->occurrence_shapes, shape - batch->shapes));
    return OK;
}

static int read_groups(Batch *batch, Cursor *cursor) {
    Py_ssize_t seen[MAX_GROUPS_PER_LINE];
    Py_ssize_t count = 0;
    TRY(expect(cursor, '{'));
    int more = 1;
    while (more) {
        const char *text;
        Py_ssize_t size;
        Py_ssize_t group;
        TRY(read_string(cursor, &text, &size));
        TRY(intern(&batch->names, text, size, &group));
        for (Py_ssize_t at = 0; at < count; at++) {
            if (seen[at] == group) {
                return DECLINE;
            }
        }
        if (count >= MAX_GROUPS_PER_LINE) {
            return DECLINE;
        }
        seen[count++] = group;
        TRY(expect(cursor, ':'));
        TRY(read_group(batch, cursor, group));
        TRY(next_member(cursor, '}', &more));
    }
    return OK;
}

/* The timestamp: a string, or an integer; its index among the batch's distinct timestamps
 * (compared with the line before's only: a batch's lines come tick by tick). */
static int read_stamp(Batch *batch, Cursor *cursor, int64_t *index) {
    skip_space(cursor);
    const char *start = cursor->at;
    PyObject *stamp;
    if (cursor->at < cursor->end && *cursor->at == '"') {
        const char *text;
        Py_ssize_t size;
        TRY(read_string(cursor, &text, &size));
        if (batch->stamp_text != NULL && batch->stamp_size == cursor->at - start &&
            memcmp(batch->stamp_text, start, (size_t)batch->stamp_size) == 0) {
            *index = PyList_GET_SIZE(batch->stamps) - 1;
            return OK;
        }
        stamp = PyUnicode_DecodeUTF8(text, size, NULL);
        if (stamp == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                return FAIL;
            }
            PyErr_Clear();
            return DECLINE;
        }
    } else {
        const char *at = cursor->at;
        int negative = 0;
        if (at < cursor->end && *at == '-') {
            negative = 1;
            at++;
        }
        const char *digits = at;
        int64_t number = 0;
        while (at < cursor->end && *at >= '0' && *at <= '9' && at - digits < MAX_ID_DIGITS) {
            number = number * 10 + (*at - '0');
            at++;
        }
        Py_ssize_t count = at - digits;
        if (count == 0 || (digits[0] == '0' && count > 1)) {
            return DECLINE;
        }
        if (at < cursor->end && (*at == '.' || *at == 'e' || *at == 'E' ||
                                 (*at >= '0' && *at <= '9'))) {
            return DECLINE; /* a float, or more digits than this reads */
        }
        cursor->at = at;
        if (batch->stamp_text != NULL && batch->stamp_size == cursor->at - start &&
            memcmp(batch->stamp_text, start, (size_t)batch->stamp_size) == 0) {
            *index = PyList_GET_SIZE(batch->stamps) - 1;
            return OK;
        }
        stamp = PyLong_FromLongLong(negative ? -number : number);
        if (stamp == NULL) {
            return FAIL;
        }
    }
    int appended = PyList_Append(batch->stamps, stamp);
    Py_DECREF(stamp);
    if (appended < 0) {
        return FAIL;
    }
    batch->stamp_text = start;
    batch->stamp_size = cursor->at - start;
    *index = PyList_GET_SIZE(batch->stamps) - 1;
    return OK;
}

enum { TIMESTAMP = 1, SENSOR = 2, TARGET = 4, GROUPS = 8, METADATA = 16 };

static int key_of(const char *text, Py_ssize_t size) {
#define IS(word) (size == (Py_ssize_t)sizeof(word) - 1 && memcmp(text, word, size) == 0)
    if (IS("timestamp")) return TIMESTAMP;
    if (IS("sensor")) return SENSOR;
    if (IS("target")) return TARGET;
    if (IS("groups")) return GROUPS;
    if (IS("metadata")) return METADATA;
    return 0;
#undef IS
}

static int read_line(Batch *batch, const char *text, Py_ssize_t size) {
    Cursor cursor = {text, text + size};
    int64_t stamp = 0;
    Py_ssize_t sensor = 0, target = 0;
    int seen = 0;
    TRY(expect(&cursor, '{'));
    int more = 1;
    while (more) {
        const char *key_text;
        Py_ssize_t key_size;
        TRY(read_string(&cursor, &key_text, &key_size));
        int key = key_of(key_text, key_size);
        if (key == 0 || (seen & key)) {
            return DECLINE;
        }
        seen |= key;
        TRY(expect(&cursor, ':'));
        const char *name;
        Py_ssize_t name_size;
        switch (key) {
        case TIMESTAMP:
            TRY(read_stamp(batch, &cursor, &stamp));
            break;
        case SENSOR:
        case TARGET:
            TRY(read_string(&cursor, &name, &name_size));
            if (name_size == 0) {
                return DECLINE;
            }
            TRY(intern(&batch->names, name, name_size, key == SENSOR ? &sensor : &target));
            break;
        case GROUPS:
            TRY(read_groups(batch, &cursor));
            break;
        default: /* METADATA: only an empty one */
            TRY(expect(&cursor, '{'));
            TRY(expect(&cursor, '}'));
        }
        TRY(next_member(&cursor, '}', &more));
    }
    skip_space(&cursor);
    if (cursor.at != cursor.end || (seen | METADATA) != (TIMESTAMP | SENSOR | TARGET | GROUPS |
                                                          METADATA)) {
        return DECLINE;
    }
    TRY(vec_push(&batch->line_stamps, stamp));
    TRY(vec_push(&batch->line_sensors, sensor));
    TRY(vec_push(&batch->line_targets, target));
    batch->line++;
    return OK;
}

static int is_blank(const char *text, Py_ssize_t size) {
    for (Py_ssize_t at = 0; at < size; at++) {
        char c = text[at];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r' && c != '\v' && c != '\f') {
            return 0;
        }
    }
    return 1;
}

static void batch_free(Batch *batch) {
    PyMem_RawFree(batch->names.slots);
    Py_XDECREF(batch->names.strings);
    Py_XDECREF(batch->stamps);
    if (batch->shapes != NULL) {
        for (Py_ssize_t at = 0; at < batch->shape_count; at++) {
            Shape *shape = &batch->shapes[at];
            vec_free(&shape->lines);
            vec_free(&shape->sockets);
            vec_free(&shape->cpus);
            vec_free(&shape->values);
        }
    }
    PyMem_Free(batch->shapes);
    PyMem_Free(batch->signatures);
    vec_free(&batch->line_stamps);
    vec_free(&batch->line_sensors);
    vec_free(&batch->line_targets);
    vec_free(&batch->occurrence_lines);
    vec_free(&batch->occurrence_shapes);
    vec_free(&batch->socket_keys);
    vec_free(&batch->scratch);
}

static PyObject *batch_result(Batch *batch) {
    PyObject *shapes = PyList_New(batch->shape_count);
    if (shapes == NULL) {
        return NULL;
    }
    for (Py_ssize_t at = 0; at < batch->shape_count; at++) {
        Shape *shape = &batch->shapes[at];
        Signature *signature = &batch->signatures[shape->signature];
        PyObject *events = PyTuple_New(signature->width);
        if (events == NULL) {
            Py_DECREF(shapes);
            return NULL;
        }
        for (Py_ssize_t event = 0; event < signature->width; event++) {
            PyObject *name = PyList_GET_ITEM(batch->names.strings, signature->ids[event]);
            Py_INCREF(name);
            PyTuple_SET_ITEM(events, event, name);
        }
        PyObject *item = Py_BuildValue(
            "(ONNNNN)", PyList_GET_ITEM(batch->names.strings, shape->group), events,
            vec_bytes(&shape->lines), vec_bytes(&shape->sockets), vec_bytes(&shape->cpus),
            vec_bytes(&shape->values));
        if (item == NULL) {
            Py_DECREF(shapes);
            return NULL;
        }
        PyList_SET_ITEM(shapes, at, item);
    }
    return Py_BuildValue("(OONNNNNN)", batch->names.strings, batch->stamps,
                         vec_bytes(&batch->line_stamps), vec_bytes(&batch->line_sensors),
                         vec_bytes(&batch->line_targets), vec_bytes(&batch->occurrence_lines),
                         vec_bytes(&batch->occurrence_shapes), shapes);
}

PyDoc_STRVAR(parse_doc,
"parse(lines, /)\n--\n\n"
"hwpc-sensor's JSON lines (a sequence of bytes; blank lines skipped) as columns, or None\n"
"when a line is not in the plain form this reads (the caller then reads the batch another\n"
"way). Returns (names, stamps, line_stamps, line_sensors, line_targets, occurrence_lines,\n"
"occurrence_shapes, shapes): names, the distinct strings (sensors, targets, groups, events)\n"
"by id; stamps, the timestamps (int or str) of runs of lines with the same one; per line\n"
"(int64 columns, as bytearrays) its stamp's index and its sensor's and target's name ids;\n"
"per group of a line, in the line's order, the line and the group's shape; per shape (a\n"
"group's name and its events, in order) a tuple (group, events, lines, sockets, cpus,\n"
"values), one row per cpu, values row by row.");

static PyObject *parse(PyObject *module, PyObject *argument) {
    (void)module;
    /* A tuple of the lines: holds them (and the bytes the columns point into) whatever the
     * caller's list does meanwhile. */
    PyObject *lines = PySequence_Tuple(argument);
    if (lines == NULL) {
        return NULL;
    }
    Batch batch;
    memset(&batch, 0, sizeof(batch));
    PyObject *result = NULL;
    int status = OK;
    batch.names.strings = PyList_New(0);
    batch.stamps = PyList_New(0);
    batch.signatures = PyMem_Calloc(MAX_SIGNATURES, sizeof(Signature));
    batch.shapes = PyMem_Calloc(MAX_SHAPES, sizeof(Shape));
    if (batch.names.strings == NULL || batch.stamps == NULL || batch.signatures == NULL ||
        batch.shapes == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        status = FAIL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(lines);
    for (Py_ssize_t at = 0; at < count && status == OK; at++) {
        PyObject *line = PyTuple_GET_ITEM(lines, at);
        if (!PyBytes_Check(line)) {
            status = DECLINE;
            break;
        }
        const char *text = PyBytes_AS_STRING(line);
        Py_ssize_t size = PyBytes_GET_SIZE(line);
        if (is_blank(text, size)) {
            continue;
        }
        status = read_line(&batch, text, size);
    }
    if (status == OK && batch.line == 0) {
        status = DECLINE;
    }
    if (status == OK) {
        result = batch_result(&batch);
    } else if (status == DECLINE) {
        result = Py_NewRef(Py_None);
    }
    batch_free(&batch);
    Py_DECREF(lines);
    return result;
}

/* --- PowerAPI's CSV rows ---------------------------------------------------------------------- */

#define CSV_FIXED_CELLS 5   /* timestamp, sensor, target, socket, cpu */
#define CSV_LONGEST_NAME 1023 /* longer sensor or target names go the row-by-row way */

/* A cell of text: not empty, no quote, NUL or carriage return, shorter than CSV_LONGEST_NAME,
 * valid UTF-8; its id among the interned names. */
static inline int csv_name(Interned *names, const char **cell, const char *end, int64_t *id) {
    const char *start = *cell;
    const char *at = start;
    while (at < end && *at != ',') {
        if (*at == '"' || *at == '\0' || *at == '\r') {
            return DECLINE;
        }
        at++;
    }
    Py_ssize_t size = at - start;
    if (size == 0 || size > CSV_LONGEST_NAME) {
        return DECLINE;
    }
    Py_ssize_t found;
    TRY(intern(names, start, size, &found));
    *cell = at;
    *id = (int64_t)found;
    return OK;
}

/* The comma after a cell that is not the row's last, or the row's end after its last. */
static inline int csv_next(const char **cell, const char *end, int last) {
    if (last) {
        return *cell == end ? OK : DECLINE;
    }
    if (*cell >= end || **cell != ',') {
        return DECLINE;
    }
    (*cell)++;
    return OK;
}

typedef struct {
    int64_t *millis, *sensors, *targets, *sockets, *cpus, *counters;
} CsvColumns;

static int csv_row(Interned *names, const char *at, const char *end, Py_ssize_t events,
                   CsvColumns *columns, Py_ssize_t row) {
    int64_t number;
    TRY(read_integer(&at, end, &columns->millis[row]));
    TRY(csv_next(&at, end, 0));
    TRY(csv_name(names, &at, end, &columns->sensors[row]));
    TRY(csv_next(&at, end, 0));
    TRY(csv_name(names, &at, end, &columns->targets[row]));
    TRY(csv_next(&at, end, 0));
    TRY(read_integer(&at, end, &number));
    if (number >= SOCKET_LIMIT) {
        return DECLINE;
    }
    columns->sockets[row] = number;
    TRY(csv_next(&at, end, 0));
    TRY(read_integer(&at, end, &number));
    if (number >= CPU_LIMIT) {
        return DECLINE;
    }
    columns->cpus[row] = number;
    int64_t *counters = columns->counters + row * events;
    for (Py_ssize_t event = 0; event < events; event++) {
        TRY(csv_next(&at, end, 0));
        /* A counter may be negative: SmartWatts dead-letters it with its reason. */
        int negative = at < end && *at == '-';
        at += negative;
        TRY(read_integer(&at, end, &counters[event]));
        if (negative) {
            counters[event] = -counters[event];
        }
    }
    return csv_next(&at, end, 1);
}

static int csv_rows(Interned *names, const char *text, Py_ssize_t size, Py_ssize_t events,
                    CsvColumns *columns) {
    const char *at = text;
    const char *stop = text + size;
    Py_ssize_t row = 0;
    while (at < stop) {
        const char *end = memchr(at, '\n', (size_t)(stop - at));
        const char *next = end + 1;
        if (end > at && end[-1] == '\r') {
            end--; /* a file written by Python's csv module ends its lines with \r\n */
        }
        TRY(csv_row(names, at, end, events, columns, row));
        row++;
        at = next;
    }
    return OK;
}

PyDoc_STRVAR(parse_csv_doc,
"parse_csv(data, cells, /)\n--\n\n"
"Whole lines of a PowerAPI CSV events file (any contiguous bytes-like object) in its own layout (timestamp, sensor, target,\n"
"socket, cpu, then cells - 5 counters; every line ending with a line break) as columns, or\n"
"None when a line is not plain: quoted, empty or blank cells, another number of cells, a\n"
"carriage return not before a line break, numbers that are not written as an integer of\n"
"at most 63 bits without leading zeros (non-negative but for counters; socket below 65,536,\n"
"cpu below 1,048,576), names of 1,024 bytes\n"
"or more or not UTF-8. Returns (names, millis, sensors, targets, sockets, cpus, counters):\n"
"the distinct sensor and target names by id, then int64 columns as bytearrays (sensors and\n"
"targets as name ids; counters row by row). The rows are read without the interpreter's\n"
"lock.");

static PyObject *parse_csv_text(const char *text, Py_ssize_t size, Py_ssize_t cells);

static PyObject *parse_csv(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyObject_CheckBuffer(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "parse_csv(data: Buffer, cells: int)");
        return NULL;
    }
    Py_ssize_t cells = PyLong_AsSsize_t(args[1]);
    if (cells == -1 && PyErr_Occurred()) {
        return NULL;
    }
    /* Any contiguous buffer: the CSV input reads its chunks into one buffer it reuses,
       whose pages are already mapped, rather than into a new bytes object per chunk. */
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) != 0) {
        return NULL;
    }
    PyObject *result = parse_csv_text(view.buf, view.len, cells);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *parse_csv_text(const char *text, Py_ssize_t size, Py_ssize_t cells) {
    if (cells <= CSV_FIXED_CELLS || size == 0 || text[size - 1] != '\n') {
        Py_RETURN_NONE;
    }
    Py_ssize_t events = cells - CSV_FIXED_CELLS;
    Py_ssize_t rows = 0;
    Py_BEGIN_ALLOW_THREADS
    for (const char *at = text; (at = memchr(at, '\n', (size_t)(text + size - at))) != NULL;
         at++) {
        rows++;
    }
    Py_END_ALLOW_THREADS
    if (events > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(int64_t) / rows) {
        return PyErr_NoMemory();
    }
    Py_ssize_t sizes[7] = {0, 8 * rows, 8 * rows, 8 * rows, 8 * rows, 8 * rows,
                           8 * rows * events};
    PyObject *result = PyTuple_New(7);
    if (result == NULL) {
        return NULL;
    }
    int64_t *starts[7] = {NULL};
    for (int at = 1; at < 7; at++) {
        PyObject *column = PyByteArray_FromStringAndSize(NULL, sizes[at]);
        if (column == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyTuple_SET_ITEM(result, at, column);
        starts[at] = (int64_t *)PyByteArray_AS_STRING(column);
    }
    /* The rows are read without the interpreter's lock (the CSV input parses in a thread of
       its own, and the event loop goes on meanwhile), the names' str made after. */
    CsvColumns columns = {starts[1], starts[2], starts[3], starts[4], starts[5], starts[6]};
    Interned names = {NULL, 0, 0, NULL};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = csv_rows(&names, text, size, events, &columns);
    Py_END_ALLOW_THREADS
    if (status == OK) {
        status = interned_strings(&names);
    } else if (status == FAIL) {
        PyErr_NoMemory(); /* the only failure without the lock */
    }
    PyMem_RawFree(names.slots);
    if (names.strings != NULL) {
        PyTuple_SET_ITEM(result, 0, names.strings); /* the tuple owns it now */
    }
    if (status != OK) {
        Py_DECREF(result);
        if (status == DECLINE) {
            Py_RETURN_NONE;
        }
        return NULL;
    }
    return result;
}

static PyMethodDef methods[] = {
    {"parse", parse, METH_O, parse_doc},
    {"parse_csv", (PyCFunction)(void (*)(void))parse_csv, METH_FASTCALL, parse_csv_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "_hwpc_lines",
    "hwpc-sensor's JSON lines and PowerAPI's CSV rows parsed in C straight into int64 "
    "columns (see wattflow.formats.json_frames and wattflow.formats.csv_frames).",
    0,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__hwpc_lines(void) { return PyModule_Create(&module); }
