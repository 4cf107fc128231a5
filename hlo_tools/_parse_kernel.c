/* The fast mode's hot loop of hlo_tools.parser, as a CPython extension.

   run(lines, k, body, context) builds the instructions of lines[k], lines[k + 1], ...
   exactly as _Parser._body_fast's Python code does, for as long as each line is ASCII
   and canonical (_CANONICAL_INSTR matches it), its shape text is in the shape cache, its
   opcode is known and a parameter's number is a number; it returns the index of the
   first line it leaves to the Python code. It appends to the lists of
   body = (instructions, roots, names, operand_lists, texts), where texts only gets the
   attribute texts the module-wide checks need: those _balanced rejects and those with a
   callee key right before a '='. context = (shapes, opcodes, make, callee_keys), make
   being HloInstruction.

   groups(line) is _CANONICAL_INSTR.match(line).groups("") as the kernel reads it, or
   None where it leaves the line to Python (for the tests). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Character classes of _CANONICAL_INSTR (ASCII only) and of Python's \s and str.strip. */
static int is_lower(Py_UCS1 c) { return c >= 'a' && c <= 'z'; }
static int is_digit(Py_UCS1 c) { return c >= '0' && c <= '9'; }
static int is_first(Py_UCS1 c) { return is_lower(c) || (c >= 'A' && c <= 'Z') || c == '_'; }
static int is_key(Py_UCS1 c) { return is_first(c) || is_digit(c) || c == '-'; }
static int is_name(Py_UCS1 c) { return is_key(c) || c == '.'; }
static int is_space(Py_UCS1 c) {
    return c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f);
}
static int is_inner(Py_UCS1 c) {  /* [^(){}\[\]"*] */
    return c != '(' && c != ')' && c != '{' && c != '}' && c != '[' && c != ']' && c != '"'
        && c != '*';
}

typedef struct {  /* where the groups of _CANONICAL_INSTR are: s[name0:name1], ... */
    int root;
    Py_ssize_t name0, name1, shape0, shape1, op0, op1, in0, in1, attr0;
} Groups;

/* _CANONICAL_INSTR after "(ROOT )?", from s[i] to the end of s[0:n]:
   %?NAME = SHAPE OPCODE(INNER)(, KEY=VALUE)?$ with its possessive repeats. */
static int match_rest(const Py_UCS1 *s, Py_ssize_t n, Py_ssize_t i, Groups *g) {
    Py_ssize_t j;
    if (i < n && s[i] == '%') i++;
    if (i >= n || !is_first(s[i])) return 0;
    g->name0 = i;
    for (i++; i < n && is_name(s[i]); i++) {}
    g->name1 = i;
    if (n - i < 3 || memcmp(s + i, " = ", 3) != 0) return 0;
    g->shape0 = i += 3;
    if (i >= n || !is_lower(s[i])) return 0;
    for (i++; i < n && (is_lower(s[i]) || is_digit(s[i])); i++) {}
    if (i >= n || s[i] != '[') return 0;
    for (i++; i < n && s[i] != ']' && s[i] != '*'; i++) {}
    if (i >= n || s[i] != ']') return 0;
    i++;
    if (i < n && s[i] == '{') {  /* the layout (without it, "{" cannot follow) */
        for (j = i + 1; j < n && s[j] != '}' && s[j] != '*'; j++) {}
        if (j >= n || s[j] != '}') return 0;
        i = j + 1;
    }
    g->shape1 = i;
    if (i >= n || s[i] != ' ') return 0;
    g->op0 = ++i;
    if (i >= n || !is_lower(s[i])) return 0;
    for (i++; i < n && (is_lower(s[i]) || is_digit(s[i]) || s[i] == '-'); i++) {}
    g->op1 = i;
    if (i >= n || s[i] != '(') return 0;
    g->in0 = ++i;
    for (; i < n && is_inner(s[i]); i++) {}
    if (i >= n || s[i] != ')') return 0;
    g->in1 = i++;
    g->attr0 = i;
    if (i == n) return 1;  /* no attributes */
    if (n - i < 2 || s[i] != ',' || s[i + 1] != ' ') return 0;
    g->attr0 = i += 2;
    if (i >= n || !is_first(s[i])) return 0;
    for (i++; i < n && is_key(s[i]); i++) {}
    if (i >= n || s[i] != '=') return 0;
    i++;  /* then [^*]*[^*\s]$: a character at least, no '*', no space at the end */
    return i < n && memchr(s + i, '*', n - i) == NULL && !is_space(s[n - 1]);
}

/* _CANONICAL_INSTR.match on s[0:n], trying "ROOT " first as the regex does. */
static int match_line(const Py_UCS1 *s, Py_ssize_t n, Groups *g) {
    Py_ssize_t i = 0;
    while (i < n && s[i] == ' ') i++;
    g->root = n - i >= 5 && memcmp(s + i, "ROOT ", 5) == 0 && match_rest(s, n, i + 5, g);
    return g->root || match_rest(s, n, i, g);
}

static PyObject *ascii_str(const Py_UCS1 *s, Py_ssize_t n) {
    PyObject *str = PyUnicode_New(n, 127);
    if (str != NULL) memcpy(PyUnicode_1BYTE_DATA(str), s, n);
    return str;
}

/* inner.replace("%", "").split(", ") */
static PyObject *split_operands(const Py_UCS1 *s, Py_ssize_t n) {
    Py_UCS1 stack[512], *buf = n <= 512 ? stack : PyMem_Malloc(n);
    Py_ssize_t m = 0, i, start = 0;
    PyObject *list, *item;
    if (buf == NULL) return PyErr_NoMemory();
    for (i = 0; i < n; i++)
        if (s[i] != '%') buf[m++] = s[i];
    list = PyList_New(0);
    for (i = 0; list != NULL && i <= m; i++) {
        if (i < m && !(buf[i] == ',' && i + 1 < m && buf[i + 1] == ' ')) continue;
        item = ascii_str(buf + start, i - start);
        if (item == NULL || PyList_Append(list, item) < 0) Py_CLEAR(list);
        Py_XDECREF(item);
        start = ++i + 1;  /* past the ", " (or the end) */
    }
    if (buf != stack) PyMem_Free(buf);
    return list;
}

/* inner.strip() of a constant or parameter; NULL without an exception for a parameter
   number that is not a number (the Python code raises then). */
static PyObject *payload(PyObject *line, const Py_UCS1 *s, Py_ssize_t a, Py_ssize_t b,
                         int parameter) {
    Py_ssize_t i;
    while (a < b && is_space(s[a])) a++;
    while (b > a && is_space(s[b - 1])) b--;
    if (parameter) {
        if (a == b) return NULL;
        for (i = a; i < b; i++)
            if (!is_digit(s[i])) return NULL;
    }
    return PyUnicode_Substring(line, a, b);
}

typedef struct {  /* the callee keys of one run() call; ends[c]: some key ends with c */
    Py_ssize_t count, len[16];
    const char *key[16];
    char ends[256];
} Keys;

static int read_keys(PyObject *keys, Keys *out) {
    Py_ssize_t j;
    if (!PyTuple_Check(keys) || PyTuple_GET_SIZE(keys) > 16) {
        PyErr_SetString(PyExc_TypeError, "callee keys: a tuple of at most 16 str");
        return -1;
    }
    out->count = PyTuple_GET_SIZE(keys);
    memset(out->ends, 0, sizeof out->ends);
    for (j = 0; j < out->count; j++) {
        out->key[j] = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(keys, j), &out->len[j]);
        if (out->key[j] == NULL) return -1;
        if (out->len[j] == 0) {
            PyErr_SetString(PyExc_ValueError, "callee keys: empty key");
            return -1;
        }
        out->ends[(unsigned char)out->key[j][out->len[j] - 1]] = 1;
    }
    return 0;
}

/* Whether a callee key ends right before s[i] (a '='). */
static int callee_key_before(const Py_UCS1 *s, Py_ssize_t i, const Keys *keys) {
    Py_ssize_t j;
    if (i == 0 || !keys->ends[s[i - 1]]) return 0;
    for (j = 0; j < keys->count; j++)
        if (keys->len[j] <= i && memcmp(s + i - keys->len[j], keys->key[j], keys->len[j]) == 0)
            return 1;
    return 0;
}

static const char SPECIAL[256] = {  /* the characters needs_check looks at */
    ['{'] = 1, ['}'] = 1, ['('] = 1, [')'] = 1, ['['] = 1, [']'] = 1, ['"'] = 1, ['\\'] = 1,
    ['='] = 1,
};

/* Whether the module-wide checks need the attribute text s[0:n]: _balanced(text) is
   false, or a callee key stands right before a '='. */
static int needs_check(const Py_UCS1 *s, Py_ssize_t n, const Keys *keys) {
    Py_ssize_t curly = 0, round = 0, square = 0, quotes = 0, backslashes = 0, i;
    for (i = 0; i < n; i++) {
        if (!SPECIAL[s[i]]) continue;
        switch (s[i]) {
        case '{': curly++; break;
        case '}': curly--; break;
        case '(': round++; break;
        case ')': round--; break;
        case '[': square++; break;
        case ']': square--; break;
        case '"': quotes++; break;
        case '\\': backslashes++; break;
        default:
            if (callee_key_before(s, i, keys)) return 1;
        }
    }
    return curly || round || square || (quotes && (quotes % 2 || backslashes));
}

typedef struct {
    PyObject *instructions, *roots, *names, *operand_lists, *texts;  /* borrowed */
    PyObject *shapes, *opcodes, *make;
    Keys keys;
} Context;

static int read_context(PyObject *body, PyObject *context, Context *c) {
    if (!PyTuple_Check(body) || PyTuple_GET_SIZE(body) != 5 || !PyTuple_Check(context)
            || PyTuple_GET_SIZE(context) != 4) {
        PyErr_SetString(PyExc_TypeError, "run(): body and context are tuples of 5 and 4");
        return -1;
    }
    c->instructions = PyTuple_GET_ITEM(body, 0);
    c->roots = PyTuple_GET_ITEM(body, 1);
    c->names = PyTuple_GET_ITEM(body, 2);
    c->operand_lists = PyTuple_GET_ITEM(body, 3);
    c->texts = PyTuple_GET_ITEM(body, 4);
    c->shapes = PyTuple_GET_ITEM(context, 0);
    c->opcodes = PyTuple_GET_ITEM(context, 1);
    c->make = PyTuple_GET_ITEM(context, 2);
    if (!PyList_Check(c->instructions) || !PyList_Check(c->roots) || !PyList_Check(c->names)
            || !PyList_Check(c->operand_lists) || !PyList_Check(c->texts)
            || !PyDict_Check(c->shapes) || !PyAnySet_Check(c->opcodes)
            || !PyCallable_Check(c->make)) {
        PyErr_SetString(PyExc_TypeError, "run(): bad body or context");
        return -1;
    }
    return read_keys(PyTuple_GET_ITEM(context, 3), &c->keys);
}

/* Appends a built instruction and its parts to the body's lists. */
static int append(const Context *c, PyObject *instr, PyObject *name, PyObject *operands,
                  PyObject *text, int root, int check) {
    if (PyList_Append(c->instructions, instr) < 0 || PyList_Append(c->names, name) < 0
            || PyList_Append(c->operand_lists, operands) < 0)
        return -1;
    if (root && PyList_Append(c->roots, name) < 0) return -1;
    return check ? PyList_Append(c->texts, text) : 0;
}

/* Builds the instruction of a matched line: 1 if appended, 0 if left to Python, -1 on
   an error. */
static int build(PyObject *line, const Py_UCS1 *s, const Groups *g, const Context *c) {
    PyObject *opcode, *key = NULL, *shape = NULL, *name = NULL, *operands = NULL;
    PyObject *pay = NULL, *text = NULL, *instr = NULL;
    Py_ssize_t oplen = g->op1 - g->op0, n = PyUnicode_GET_LENGTH(line);
    int rc = -1, parameter;
    opcode = PyUnicode_Substring(line, g->op0, g->op1);
    if (opcode == NULL) return -1;
    rc = PySet_Contains(c->opcodes, opcode);  /* 0: unknown, Python raises */
    if (rc <= 0) goto done;
    rc = -1;
    key = PyUnicode_Substring(line, g->shape0, g->shape1);
    if (key == NULL) goto done;
    shape = PyDict_GetItemWithError(c->shapes, key);
    if (shape == NULL) {  /* not cached: Python parses it */
        rc = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    Py_INCREF(shape);  /* (`make` runs Python code, which may clear the cache) */
    parameter = oplen == 9 && memcmp(s + g->op0, "parameter", 9) == 0;
    if (parameter || (oplen == 8 && memcmp(s + g->op0, "constant", 8) == 0)) {
        pay = payload(line, s, g->in0, g->in1, parameter);
        if (pay == NULL) {
            rc = PyErr_Occurred() ? -1 : 0;
            goto done;
        }
        operands = PyList_New(0);
    } else {
        pay = PyUnicode_New(0, 127);
        operands = g->in0 == g->in1 ? PyList_New(0) : split_operands(s + g->in0, g->in1 - g->in0);
    }
    name = PyUnicode_Substring(line, g->name0, g->name1);
    text = PyUnicode_Substring(line, g->attr0, n);
    if (pay == NULL || operands == NULL || name == NULL || text == NULL) goto done;
    {
        PyObject *args[7] = {name, opcode, shape, operands, Py_None, pay, text};
        instr = PyObject_Vectorcall(c->make, args, 7, NULL);
    }
    if (instr != NULL && append(c, instr, name, operands, text, g->root,
                                needs_check(s + g->attr0, n - g->attr0, &c->keys)) == 0)
        rc = 1;
done:
    Py_DECREF(opcode);
    Py_XDECREF(key);
    Py_XDECREF(shape);
    Py_XDECREF(name);
    Py_XDECREF(operands);
    Py_XDECREF(pay);
    Py_XDECREF(text);
    Py_XDECREF(instr);
    return rc;
}

static PyObject *run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Context c;
    Py_ssize_t k;
    (void)self;
    if (nargs != 4 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "run(lines: list, k, body, context)");
        return NULL;
    }
    k = PyLong_AsSsize_t(args[1]);
    if ((k == -1 && PyErr_Occurred()) || read_context(args[2], args[3], &c) < 0) return NULL;
    for (; k >= 0 && k < PyList_GET_SIZE(args[0]); k++) {
        PyObject *line = PyList_GET_ITEM(args[0], k);
        Groups g;
        int rc;
        if (!PyUnicode_Check(line) || !PyUnicode_IS_ASCII(line)
                || !match_line(PyUnicode_1BYTE_DATA(line), PyUnicode_GET_LENGTH(line), &g))
            break;
        Py_INCREF(line);
        rc = build(line, PyUnicode_1BYTE_DATA(line), &g, &c);
        Py_DECREF(line);
        if (rc < 0) return NULL;
        if (rc == 0) break;
    }
    return PyLong_FromSsize_t(k);
}

static PyObject *groups(PyObject *self, PyObject *line) {
    Groups g;
    Py_ssize_t n;
    (void)self;
    if (!PyUnicode_Check(line)) {
        PyErr_SetString(PyExc_TypeError, "groups(line: str)");
        return NULL;
    }
    n = PyUnicode_GET_LENGTH(line);
    if (!PyUnicode_IS_ASCII(line) || !match_line(PyUnicode_1BYTE_DATA(line), n, &g))
        Py_RETURN_NONE;
    return Py_BuildValue("(sNNNNN)", g.root ? "ROOT " : "",
                         PyUnicode_Substring(line, g.name0, g.name1),
                         PyUnicode_Substring(line, g.shape0, g.shape1),
                         PyUnicode_Substring(line, g.op0, g.op1),
                         PyUnicode_Substring(line, g.in0, g.in1),
                         PyUnicode_Substring(line, g.attr0, n));
}

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL, "Builds canonical lines."},
    {"groups", groups, METH_O, "The groups of a canonical line, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hlo_parse_kernel", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hlo_parse_kernel(void) { return PyModule_Create(&module); }
