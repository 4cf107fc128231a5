/* The hot loops of the moves of hlo_tools/plan/ (package hlo_tools.plan), as a CPython
   extension module.

   Built with the system C compiler on first use and loaded by hlo_tools/plan/kernel.py;
   the package falls back to its pure-Python code (which stays the reference) when it
   cannot be built. Each function here makes exactly the decisions and the random draws of
   the Python code it stands for (named in its comment, as module.function of the package),
   in the same order: it draws through the rng's own bound ``getrandbits`` as
   draws._chooser does, it ports the checks of legality.py in their order, and for what it
   does not handle itself (the neighbours of a fused rank node, the compare rule) it calls
   back the Python functions. Given a ``trace`` list, the tries append (code, node, node)
   tuples: the code of their decision (enum Decision below, kernel.py's _DECISIONS) and
   the nodes drawn (-1: none).

   Plans are read through the buffer protocol (order, pos and group must be array('i'));
   group ids are node ids, so every per-node or per-group table has N entries. A function
   answers NotImplemented, before drawing anything, when it cannot take a plan (another
   array type, or the space's scratch in use by another thread in a callback), and the
   caller then runs the Python code. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ static tables */

/* A FusionSpace's static facts (a capsule kept on the space). Lists of nodes are in CSR
   form: the users of node i are users[users_at[i] .. users_at[i + 1]). */
typedef struct {
    int32_t n, root, ncompute, any_bad, multi_output, busy;
    int32_t *users_at, *users;
    int32_t *dops_at, *dops;     /* distinct operands */
    int32_t *fops_at, *fops;     /* distinct fusible operands */
    int32_t *bad_at, *bad;       /* operands a node may not read inside its fusion */
    int32_t *compute;            /* space.compute_nodes */
    PyObject **ints;             /* node -> its int object (dict keys) */
    uint32_t *mark, stamp;       /* scratch: mark[x] == stamp means x is marked */
    int32_t *buf, *buf2;         /* scratch lists of ``cap`` entries */
    Py_ssize_t cap;              /* 3N + 8: two groups' members and copies, and one more */
    PyObject *neighbours_fn;     /* Python callback: kernel._neighbours_of */
    int32_t any_compare;         /* whether the graph has a compare (see compare_fn) */
    uint8_t *reduce;             /* [N] whether a node is a reduce */
    PyObject *compare_fn;        /* Python callback: legality._compare_reads_copy */
} Space;

/* The all-reduce tables of space._ArTables (a capsule kept on the space with them). */
typedef struct {
    int32_t n, nars, skip, in_order;
    int32_t *ars;                /* space.allreduces */
    int32_t *rank, *key, *index; /* [N] per all-reduce: rank node, key id, index; else -1 */
    int32_t *by_rank_at, *by_rank;
    uint8_t *is_ar;
} ArTables;

static PyTypeObject *array_type;

static void free_space(PyObject *capsule) {
    Space *S = PyCapsule_GetPointer(capsule, "plan_kernel.space");
    if (!S) return;
    if (S->ints) {
        for (int32_t i = 0; i < S->n; i++) Py_XDECREF(S->ints[i]);
    }
    Py_XDECREF(S->neighbours_fn);
    Py_XDECREF(S->compare_fn);
    free(S->reduce);
    free(S->users_at); free(S->users); free(S->dops_at); free(S->dops);
    free(S->fops_at); free(S->fops); free(S->bad_at); free(S->bad); free(S->compute);
    free(S->ints); free(S->mark); free(S->buf); free(S->buf2);
    free(S);
}

static void free_ar_tables(PyObject *capsule) {
    ArTables *T = PyCapsule_GetPointer(capsule, "plan_kernel.ar_tables");
    if (!T) return;
    free(T->ars); free(T->rank); free(T->key); free(T->index);
    free(T->by_rank_at); free(T->by_rank); free(T->is_ar);
    free(T);
}

/* Fills a CSR table from a sequence of N iterables of ints (None counts as empty). */
static int build_csr(PyObject *seq, int32_t n, int32_t **at_out, int32_t **items_out) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence");
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "table of the wrong length");
        return -1;
    }
    int32_t *at = malloc(sizeof(int32_t) * (n + 1));
    Py_ssize_t cap = 64, len = 0;
    int32_t *items = malloc(sizeof(int32_t) * cap);
    if (!at || !items) goto nomem;
    at[0] = 0;
    for (int32_t i = 0; i < n; i++) {
        PyObject *entry = PySequence_Fast_GET_ITEM(fast, i);
        if (entry != Py_None) {
            PyObject *it = PyObject_GetIter(entry);
            if (!it) goto fail;
            PyObject *x;
            while ((x = PyIter_Next(it))) {
                long v = PyLong_AsLong(x);
                Py_DECREF(x);
                if (v == -1 && PyErr_Occurred()) { Py_DECREF(it); goto fail; }
                if (len == cap) {
                    cap *= 2;
                    int32_t *grown = realloc(items, sizeof(int32_t) * cap);
                    if (!grown) { Py_DECREF(it); goto nomem; }
                    items = grown;
                }
                items[len++] = (int32_t)v;
            }
            Py_DECREF(it);
            if (PyErr_Occurred()) goto fail;
        }
        at[i + 1] = (int32_t)len;
    }
    Py_DECREF(fast);
    *at_out = at;
    *items_out = items;
    return 0;
nomem:
    PyErr_NoMemory();
fail:
    free(at); free(items);
    Py_DECREF(fast);
    return -1;
}

/* Fills an int32 array of ``len`` entries from a sequence of ints. */
static int32_t *int_array(PyObject *seq, Py_ssize_t len) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence");
    if (!fast) return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != len) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "table of the wrong length");
        return NULL;
    }
    int32_t *out = malloc(sizeof(int32_t) * (len ? len : 1));
    if (!out) { Py_DECREF(fast); PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < len; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) { free(out); Py_DECREF(fast); return NULL; }
        out[i] = (int32_t)v;
    }
    Py_DECREF(fast);
    return out;
}

/* new_space(n, root, multi_output, users, dops, fops, bad, compute, neighbours_fn, reduces,
   compare_fn): ``reduces`` lists the reduce nodes, ``compare_fn`` is
   legality._compare_reads_copy, or None when the graph has no compare */
static PyObject *new_space(PyObject *self, PyObject *args) {
    int n, root, multi_output;
    PyObject *users, *dops, *fops, *bad, *compute, *neighbours_fn, *reduces, *compare_fn;
    if (!PyArg_ParseTuple(args, "iipOOOOOOOO", &n, &root, &multi_output, &users, &dops, &fops,
                          &bad, &compute, &neighbours_fn, &reduces, &compare_fn))
        return NULL;
    Space *S = calloc(1, sizeof(Space));
    if (!S) return PyErr_NoMemory();
    S->n = n;
    S->root = root;
    S->multi_output = multi_output;
    PyObject *capsule = PyCapsule_New(S, "plan_kernel.space", free_space);
    if (!capsule) { free(S); return NULL; }
    if (build_csr(users, n, &S->users_at, &S->users) || build_csr(dops, n, &S->dops_at, &S->dops)
        || build_csr(fops, n, &S->fops_at, &S->fops) || build_csr(bad, n, &S->bad_at, &S->bad))
        goto fail;
    S->any_bad = S->bad_at[n] > 0;
    S->ncompute = (int32_t)PySequence_Size(compute);
    if (S->ncompute < 0 || !(S->compute = int_array(compute, S->ncompute))) goto fail;
    S->ints = calloc(n ? n : 1, sizeof(PyObject *));
    S->mark = calloc(n ? n : 1, sizeof(uint32_t));
    S->cap = 3 * (Py_ssize_t)n + 8;
    S->buf = malloc(sizeof(int32_t) * S->cap);
    S->buf2 = malloc(sizeof(int32_t) * S->cap);
    if (!S->ints || !S->mark || !S->buf || !S->buf2) { PyErr_NoMemory(); goto fail; }
    for (int32_t i = 0; i < n; i++) {
        if (!(S->ints[i] = PyLong_FromLong(i))) goto fail;
    }
    Py_INCREF(neighbours_fn);
    S->neighbours_fn = neighbours_fn;
    if (!(S->reduce = calloc(n ? n : 1, 1))) { PyErr_NoMemory(); goto fail; }
    Py_ssize_t nreduce = PySequence_Size(reduces);
    if (nreduce < 0) goto fail;
    for (Py_ssize_t i = 0; i < nreduce; i++) {
        PyObject *item = PySequence_GetItem(reduces, i);
        long r = item ? PyLong_AsLong(item) : -1;
        Py_XDECREF(item);
        if (r < 0 || r >= n) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad reduce node");
            goto fail;
        }
        S->reduce[r] = 1;
    }
    S->any_compare = compare_fn != Py_None;
    Py_INCREF(compare_fn);
    S->compare_fn = compare_fn;
    return capsule;
fail:
    Py_DECREF(capsule);
    return NULL;
}

/* new_ar_tables(n, ars, rank, key, index, by_rank, is_allreduce, skip, in_order), the
   per-node lists having N entries (-1 or None where a node is no all-reduce). */
static PyObject *new_ar_tables(PyObject *self, PyObject *args) {
    int n, skip, in_order;
    PyObject *ars, *rank, *key, *index, *by_rank;
    Py_buffer is_ar;
    if (!PyArg_ParseTuple(args, "iOOOOOy*pp", &n, &ars, &rank, &key, &index, &by_rank, &is_ar,
                          &skip, &in_order))
        return NULL;
    ArTables *T = calloc(1, sizeof(ArTables));
    if (!T) { PyBuffer_Release(&is_ar); return PyErr_NoMemory(); }
    T->n = n;
    T->skip = skip;
    T->in_order = in_order;
    PyObject *capsule = PyCapsule_New(T, "plan_kernel.ar_tables", free_ar_tables);
    if (!capsule) { free(T); PyBuffer_Release(&is_ar); return NULL; }
    T->nars = (int32_t)PySequence_Size(ars);
    if (T->nars < 0 || is_ar.len != n || !(T->ars = int_array(ars, T->nars))
        || !(T->rank = int_array(rank, n)) || !(T->key = int_array(key, n))
        || !(T->index = int_array(index, n))
        || build_csr(by_rank, n, &T->by_rank_at, &T->by_rank))
        goto fail;
    if (!(T->is_ar = malloc(n ? n : 1))) { PyErr_NoMemory(); goto fail; }
    memcpy(T->is_ar, is_ar.buf, n);
    PyBuffer_Release(&is_ar);
    return capsule;
fail:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad all-reduce tables");
    PyBuffer_Release(&is_ar);
    Py_DECREF(capsule);
    return NULL;
}

/* ------------------------------------------------------------------ plan access */

/* The arrays of a plan, open for reading. */
typedef struct {
    int32_t *order, *pos, *group;
    Py_buffer views[3];
    int open;
} View;

static void close_view(View *V) {
    for (int k = 0; k < V->open; k++) PyBuffer_Release(&V->views[k]);
    V->open = 0;
}

/* Opens ``plan``'s three arrays: 1 if they are array('i') of N entries, 0 if not (the
   caller then answers NotImplemented), -1 on error. */
static int open_view(Space *S, PyObject *plan, View *V) {
    V->open = 0;
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) < 3) return 0;
    int32_t **out[3] = {&V->order, &V->pos, &V->group};
    for (int k = 0; k < 3; k++) {
        PyObject *arr = PyTuple_GET_ITEM(plan, k);
        if (Py_TYPE(arr) != array_type) { close_view(V); return 0; }
        if (PyObject_GetBuffer(arr, &V->views[k], PyBUF_FORMAT) < 0) { close_view(V); return -1; }
        V->open = k + 1;
        Py_buffer *b = &V->views[k];
        if (b->itemsize != 4 || b->len != 4 * (Py_ssize_t)S->n || !b->format
            || strcmp(b->format, "i") != 0) {
            close_view(V);
            return 0;
        }
        *out[k] = b->buf;
    }
    return 1;
}

/* Whether ``index`` is a plan's copy index (two dicts). */
static int valid_index(PyObject *index) {
    return PyTuple_Check(index) && PyTuple_GET_SIZE(index) == 2
           && PyDict_Check(PyTuple_GET_ITEM(index, 0)) && PyDict_Check(PyTuple_GET_ITEM(index, 1));
}

/* Whether ``state`` is a plan's all-reduce state (neighbours._ArState: tables, ranked list,
   where dict, ranked_in dict, buckets). */
static int valid_state(PyObject *state) {
    return PyTuple_Check(state) && PyTuple_GET_SIZE(state) == 5
           && PyList_Check(PyTuple_GET_ITEM(state, 1)) && PyDict_Check(PyTuple_GET_ITEM(state, 2))
           && PyDict_Check(PyTuple_GET_ITEM(state, 3));
}

/* Starts a call on ``plan`` with its copy index and all-reduce state (either may be NULL):
   1 when it may run (the arrays open in ``V``, the space's scratch taken), 0 when it must
   answer NotImplemented, -1 on error. */
static int enter(Space *S, PyObject *plan, PyObject *index, PyObject *state, View *V) {
    if (S->busy || (index && !valid_index(index)) || (state && !valid_state(state))) return 0;
    int opened = open_view(S, plan, V);
    S->busy = opened > 0;
    return opened;
}

/* Ends a call that ``enter`` started, which answers ``result``. */
static PyObject *leave(Space *S, View *V, PyObject *result) {
    S->busy = 0;
    close_view(V);
    return result;
}

/* What a call answers when ``enter`` did not start it. */
static PyObject *not_entered(int entered) {
    return entered < 0 ? NULL : Py_NewRef(Py_NotImplemented);
}

/* ``enter`` for a move's tries: reads their count from ``arg`` into ``*tries``, then enters
   where there is something to draw (``any``; else 0); 1, 0 or -1. */
static int enter_tries(Space *S, PyObject *arg, long *tries, int any, PyObject *plan,
                       PyObject *index, PyObject *state, View *V) {
    *tries = PyLong_AsLong(arg);
    if (*tries == -1 && PyErr_Occurred()) return -1;
    return any ? enter(S, plan, index, state, V) : 0;
}

/* Checks the argument count of the call ``name`` (a TypeError if not ``want``); 0 or -1. */
static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
    return -1;
}

static Space *get_space(PyObject *capsule) {
    return PyCapsule_GetPointer(capsule, "plan_kernel.space");
}

static uint32_t next_stamp(Space *S) {
    if (++S->stamp == 0) {
        memset(S->mark, 0, sizeof(uint32_t) * S->n);
        S->stamp = 1;
    }
    return S->stamp;
}

/* The run [start, end) of the group ``g`` holding the node at position ``p`` (value._span). */
static void span_at(const Space *S, const View *V, int32_t p, int32_t *start, int32_t *end) {
    const int32_t *order = V->order, *group = V->group;
    int32_t g = group[order[p]], s = p, e = p + 1;
    while (s && group[order[s - 1]] == g) s--;
    while (e < S->n && group[order[e]] == g) e++;
    *start = s;
    *end = e;
}

/* dict[key] for a node or group id (borrowed), NULL if absent (or on error). */
static PyObject *lookup(Space *S, PyObject *dict, int32_t key) {
    return PyDict_GET_SIZE(dict) ? PyDict_GetItemWithError(dict, S->ints[key]) : NULL;
}

/* Whether group ``g`` holds copies (is a key of the copy index's ``held``); -1 on error. */
static int holds_copies(Space *S, PyObject *held, int32_t g) {
    return PyDict_GET_SIZE(held) ? PyDict_Contains(held, S->ints[g]) : 0;
}

/* Whether node ``c`` may not read ``o`` inside its fusion (``o`` is one of its bad operands). */
static int reads_bad(const Space *S, int32_t c, int32_t o) {
    for (int32_t j = S->bad_at[c]; j < S->bad_at[c + 1]; j++) {
        if (S->bad[j] == o) return 1;
    }
    return 0;
}

/* The length of ``t``, a tuple of ints (0 if NULL); -1 with a TypeError if not a tuple. */
static Py_ssize_t tuple_len(PyObject *t) {
    if (!t) return 0;
    if (!PyTuple_Check(t)) {
        PyErr_SetString(PyExc_TypeError, "expected a tuple of ints");
        return -1;
    }
    return PyTuple_GET_SIZE(t);
}

/* The int ``t[i]`` of a tuple into ``*v``; 0, or -1 on error. */
static inline int tuple_int(PyObject *t, Py_ssize_t i, long *v) {
    *v = PyLong_AsLong(PyTuple_GET_ITEM(t, i));
    return *v == -1 && PyErr_Occurred() ? -1 : 0;
}

/* Whether the tuple of ints ``t`` (or NULL: empty) holds ``v``; -1 on error. */
static int tuple_has(PyObject *t, long v) {
    Py_ssize_t n = tuple_len(t);
    if (n < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        long x = PyLong_AsLong(PyTuple_GET_ITEM(t, i));
        if (x == v) return 1;
        if (x == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* rng.choice as draws._chooser draws it: getrandbits(k) until below ``n`` (n > 0). */
static int draw(PyObject *bits, int32_t n, int32_t *out) {
    int k = 0;
    for (uint32_t x = (uint32_t)n; x; x >>= 1) k++;
    PyObject *kobj = PyLong_FromLong(k);
    if (!kobj) return -1;
    for (;;) {
        PyObject *r = PyObject_CallOneArg(bits, kobj);
        if (!r) break;
        long v = PyLong_AsLong(r);
        Py_DECREF(r);
        if (v == -1 && PyErr_Occurred()) break;
        if (v < n) {
            Py_DECREF(kobj);
            *out = (int32_t)v;
            return 0;
        }
    }
    Py_DECREF(kobj);
    return -1;
}

/* Copies a sequence of ints (a callback's answer) into ``out``; its length, or -1. */
static Py_ssize_t ints_into(PyObject *seq, int32_t *out, Py_ssize_t cap) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of ints");
    if (!fast) return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    if (len > cap) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "callback answered too many nodes");
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
        out[i] = (int32_t)v;
    }
    Py_DECREF(fast);
    return len;
}

/* ints_into for a callback's answer ``found``, a new reference released here (NULL: the
   call failed, -1). */
static Py_ssize_t answer_into(PyObject *found, int32_t *out, Py_ssize_t cap) {
    if (!found) return -1;
    Py_ssize_t len = ints_into(found, out, cap);
    Py_DECREF(found);
    return len;
}

/* ------------------------------------------------------------------ legality */

/* groups._outside_operands over the fusible operands, for a group ``gid`` (span s:e) that
   holds no copies: distinct operands outside the group, in the order members read them. */
static Py_ssize_t outside_fops(Space *S, const View *V, int32_t gid, int32_t s, int32_t e,
                               int32_t *out) {
    const int32_t *group = V->group;
    if (e - s == 1) {
        int32_t m = V->order[s];
        Py_ssize_t len = S->fops_at[m + 1] - S->fops_at[m];
        memcpy(out, S->fops + S->fops_at[m], sizeof(int32_t) * len);
        return len;
    }
    uint32_t st = next_stamp(S);
    Py_ssize_t len = 0;
    for (int32_t k = s; k < e; k++) {
        int32_t m = V->order[k];
        for (int32_t j = S->fops_at[m]; j < S->fops_at[m + 1]; j++) {
            int32_t o = S->fops[j];
            if (S->mark[o] != st && group[o] != gid) {
                S->mark[o] = st;
                out[len++] = o;
            }
        }
    }
    return len;
}

/* Whether a user of ``node`` would read this copy of ``t`` (``t`` in holders of a user):
   1 if some group in tuple ``t`` (or NULL) is neither ``ga`` nor ``gb`` nor in ``own``;
   -1 on error. */
static int other_than(PyObject *t, int32_t ga, int32_t gb, PyObject *own) {
    Py_ssize_t n = tuple_len(t);
    if (n < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        long h;
        if (tuple_int(t, i, &h) < 0) return -1;
        if (h != ga && h != gb) {
            int has = tuple_has(own, h);
            if (has <= 0) return has < 0 ? -1 : 1;
        }
    }
    return 0;
}

/* Whether ``node``'s value is read in a group other than ``ga`` and ``gb`` (by a user, or by a
   copy of one, in a group that holds no copy of ``node``); 1, 0 or -1. */
static int read_beyond(Space *S, const View *V, PyObject *holders, int32_t node, int32_t ga,
                       int32_t gb) {
    PyObject *own = lookup(S, holders, node);
    if (!own && PyErr_Occurred()) return -1;
    for (int32_t j = S->users_at[node]; j < S->users_at[node + 1]; j++) {
        int32_t u = S->users[j], gu = V->group[u];
        if (gu != ga && gu != gb) {
            int has = tuple_has(own, gu);
            if (has <= 0) return has < 0 ? -1 : 1;
        }
        PyObject *hu = lookup(S, holders, u);
        if (!hu && PyErr_Occurred()) return -1;
        int other = other_than(hu, ga, gb, own);
        if (other) return other;
    }
    return 0;
}

/* groups._feeds_only_node: whether no group but ``gp`` and ``gc`` reads ``node`` (a member
   of ``gp``); 1, 0 or -1 on error. */
static int feeds_only_node(Space *S, const View *V, PyObject *holders, int32_t node, int32_t gp,
                           int32_t gc) {
    const int32_t *group = V->group;
    if (!PyDict_GET_SIZE(holders)) {
        for (int32_t j = S->users_at[node]; j < S->users_at[node + 1]; j++) {
            int32_t gu = group[S->users[j]];
            if (gu != gp && gu != gc) return 0;
        }
        return 1;
    }
    int beyond = read_beyond(S, V, holders, node, gp, gc);
    return beyond < 0 ? -1 : !beyond;
}

/* Appends the ints of tuple ``t`` (or NULL) to ``out``; the new length, or -1. */
static Py_ssize_t append_tuple(PyObject *t, int32_t *out, Py_ssize_t len) {
    Py_ssize_t n = tuple_len(t);
    if (n < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        long v;
        if (tuple_int(t, i, &v) < 0) return -1;
        out[len++] = (int32_t)v;
    }
    return len;
}

/* legality._layout_safe for groups ``ga`` (span sa:ea) and ``gb`` (span sb:eb) and the node
   ``extra`` (-1: none): whether no node of their fusion (members, copies and ``extra``)
   reads another at a forbidden operand position. */
static int layout_safe(Space *S, const View *V, PyObject *held, int32_t ga, int32_t sa,
                       int32_t ea, int32_t gb, int32_t sb, int32_t eb, int32_t extra) {
    int32_t *nodes = S->buf2;
    Py_ssize_t len = 0;
    for (int32_t k = sa; k < ea; k++) nodes[len++] = V->order[k];
    PyObject *copies = lookup(S, held, ga);
    if (!copies && PyErr_Occurred()) return -1;
    if ((len = append_tuple(copies, nodes, len)) < 0) return -1;
    for (int32_t k = sb; k < eb; k++) nodes[len++] = V->order[k];
    if (gb != ga) {
        copies = lookup(S, held, gb);
        if (!copies && PyErr_Occurred()) return -1;
        if ((len = append_tuple(copies, nodes, len)) < 0) return -1;
    }
    if (extra >= 0) nodes[len++] = extra;
    int any = 0;
    for (Py_ssize_t i = 0; i < len && !any; i++) any = S->bad_at[nodes[i] + 1] > S->bad_at[nodes[i]];
    if (!any) return 1;
    uint32_t st = next_stamp(S);
    for (Py_ssize_t i = 0; i < len; i++) S->mark[nodes[i]] = st;
    for (Py_ssize_t i = 0; i < len; i++) {
        int32_t c = nodes[i];
        for (int32_t j = S->bad_at[c]; j < S->bad_at[c + 1]; j++) {
            if (S->mark[S->bad[j]] == st) return 0;
        }
    }
    return 1;
}

/* ------------------------------------------------------------------ merges */

/* A copy of array ``arr`` open for writing (its buffer in ``view``), or NULL. */
static PyObject *copy_array(PyObject *arr, Py_buffer *view) {
    PyObject *copy = PySequence_GetSlice(arr, 0, PY_SSIZE_T_MAX);
    if (!copy) return NULL;
    if (PyObject_GetBuffer(copy, view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(copy);
        return NULL;
    }
    return copy;
}

/* Marks (with a new stamp, returned in ``*st``) the groups holding a descendant of group
   ``first`` (``nodes``, with repeats) scheduled between ``first`` (ending at ``e1``) and
   ``second`` (span s2:e2), as reach._descendant_groups finds them; -1 if a descendant is in
   ``second`` (a cycle), else whether any group was marked. */
static int mark_reached(Space *S, const View *V, const int32_t *nodes, Py_ssize_t nnodes,
                        int32_t e1, int32_t s2, int32_t e2, uint32_t *st) {
    int reached = 0;
    *st = next_stamp(S);
    for (Py_ssize_t i = 0; i < nnodes; i++) {
        int32_t p = V->pos[nodes[i]];
        if (p >= s2 && p < e2) return -1;
        if (p >= e1 && p < s2) {
            S->mark[V->group[nodes[i]]] = *st;
            reached = 1;
        }
    }
    return reached;
}

/* Writes the merged window of merge._merge_runs into ``w`` (a copy of ``order``): the nodes
   between the groups at s1:e1 and s2:e2 whose group is not marked with ``st`` (all when
   ``!reached``), the first group, then if ``reached`` the second group and the marked
   nodes between. Returns the end of the rewritten window. */
static int32_t write_window(const Space *S, const View *V, int32_t *w, int32_t s1, int32_t e1,
                            int32_t s2, int32_t e2, int reached, uint32_t st) {
    const int32_t *order = V->order, *group = V->group;
    int32_t at = s1;
    for (int32_t k = e1; k < s2; k++) {
        if (!reached || S->mark[group[order[k]]] != st) w[at++] = order[k];
    }
    memcpy(w + at, order + s1, sizeof(int32_t) * (e1 - s1));
    if (!reached) return s2;
    at += e1 - s1;
    memcpy(w + at, order + s2, sizeof(int32_t) * (e2 - s2));
    at += e2 - s2;
    for (int32_t k = e1; k < s2; k++) {
        if (S->mark[group[order[k]]] == st) w[at++] = order[k];
    }
    return e2;
}

/* Whether group ``g`` ranks all-reduces (``ranked_in.get(g) or by_rank[g]``); -1 on error. */
static int ranks_some(Space *S, const ArTables *T, PyObject *ranked_in, int32_t g) {
    PyObject *found = lookup(S, ranked_in, g);
    if (!found && PyErr_Occurred()) return -1;
    if (found && PyObject_IsTrue(found)) return 1;
    return T->by_rank_at[g + 1] > T->by_rank_at[g];
}

/* Whether neighbours._merged_ar_state keeps ``state`` as it is after merging ``first`` and
   ``second`` (``inverted``: whether two rank nodes changed places): no rank node moved
   past another, neither group ranks an all-reduce, and they are not two buckets. */
static int ar_state_kept(Space *S, const ArTables *T, PyObject *state, int32_t first,
                         int32_t second, int inverted) {
    if (inverted || (T->rank[first] >= 0 && T->rank[second] >= 0)) return 0;
    PyObject *ranked_in = PyTuple_GET_ITEM(state, 3);
    int some = ranks_some(S, T, ranked_in, first);
    if (!some) some = ranks_some(S, T, ranked_in, second);
    return some < 0 ? -1 : !some;
}

/* merge._merge_runs without its Python objects: merges group ``first`` (span s1:e1) with the
   later group ``second`` (span s2:e2). ``nodes`` (or NULL) are the descendants of
   ``first``'s members: the groups holding one between the two move after the merged group
   (the runs of reach._descendant_groups). With ``T`` and ``state`` (the plan's all-reduce
   state, made with ``T``), also tells whether the merge keeps that state. Returns (first,
   second, order, pos, group, lo, hi, state kept) with the new arrays and the window of
   changed positions, None if a descendant is in ``second`` (a cycle), NULL on error. */
static PyObject *merge(Space *S, const View *V, PyObject *plan, int32_t first, int32_t s1,
                       int32_t e1, int32_t second, int32_t s2, int32_t e2, const int32_t *nodes,
                       Py_ssize_t nnodes, const ArTables *T, PyObject *state) {
    uint32_t st = 0;
    int reached = nodes ? mark_reached(S, V, nodes, nnodes, e1, s2, e2, &st) : 0;
    if (reached < 0) Py_RETURN_NONE;
    PyObject *arrays[3] = {NULL, NULL, NULL};
    Py_buffer view;
    int32_t lo = s1, hi = s1, inverted = 0, last = -1;
    if (e1 == s2) {  /* adjacent groups: the schedule stays as it is */
        arrays[0] = PyTuple_GET_ITEM(plan, 0);
        Py_INCREF(arrays[0]);
        arrays[1] = PyTuple_GET_ITEM(plan, 1);
        Py_INCREF(arrays[1]);
    } else {
        if (!(arrays[0] = copy_array(PyTuple_GET_ITEM(plan, 0), &view))) return NULL;
        int32_t *w = view.buf;
        hi = write_window(S, V, w, s1, e1, s2, e2, reached, st);
        Py_buffer pos_view;
        if (!(arrays[1] = copy_array(PyTuple_GET_ITEM(plan, 1), &pos_view))) {
            PyBuffer_Release(&view);
            goto fail;
        }
        int32_t *new_pos = pos_view.buf;
        for (int32_t k = lo; k < hi; k++) {
            int32_t x = w[k];
            new_pos[x] = k;
            if (T && T->by_rank_at[x + 1] > T->by_rank_at[x]) {  /* a rank node */
                inverted |= V->pos[x] < last;
                last = V->pos[x];
            }
        }
        PyBuffer_Release(&pos_view);
        PyBuffer_Release(&view);
    }
    if (!(arrays[2] = copy_array(PyTuple_GET_ITEM(plan, 2), &view))) goto fail;
    int32_t gid = first < second ? first : second;
    int32_t s = first < second ? s2 : s1, e = first < second ? e2 : e1;
    int32_t *new_group = view.buf;
    for (int32_t k = s; k < e; k++) new_group[V->order[k]] = gid;
    PyBuffer_Release(&view);
    int kept = T && state ? ar_state_kept(S, T, state, first, second, inverted) : 0;
    if (kept < 0) goto fail;
    return Py_BuildValue("iiNNNiiO", first, second, arrays[0], arrays[1], arrays[2], lo, hi,
                         kept ? Py_True : Py_False);
fail:
    Py_XDECREF(arrays[0]);
    Py_XDECREF(arrays[1]);
    Py_XDECREF(arrays[2]);
    return NULL;
}

/* The kernel's all-reduce tables from an argument (None: NULL, without an error). */
static ArTables *ar_tables_arg(PyObject *arg) {
    return arg == Py_None ? NULL : PyCapsule_GetPointer(arg, "plan_kernel.ar_tables");
}

/* ------------------------------------------------------------------ moves */

/* The decisions of a try, as a trace records them: kernel._DECISIONS lists the Python
   Decision of each code, in this order. */
enum Decision {
    LEGAL = 0,          /* legality.LEGAL */
    NO_PRODUCER,        /* the consumer group reads no fusible node outside it */
    NEEDS_MULTI_OUTPUT, /* the producer's group has readers besides the consumer's group */
    LAYOUT_UNSAFE,      /* a forbidden operand position */
    COMPARES_COPY,      /* the compare rule */
    FUSED_PRODUCER,     /* only unfused producers are duplicated */
    NO_OTHER_USERS,     /* a copy would serve every user: plain fusion */
    EXPOSES_MEMBER,     /* a copy would read a value inside another fusion */
    NO_NEIGHBOUR,       /* the all-reduce has no neighbouring bucket */
    KEYS_DIFFER,        /* the two all-reduces may not share a bucket */
};

/* Appends (code, x, y) to ``trace`` when it is a list (None: nothing); 0, or -1 on error. */
static int trace_try(PyObject *trace, int code, int32_t x, int32_t y) {
    if (trace == Py_None) return 0;
    PyObject *entry = Py_BuildValue("(iii)", code, x, y);
    if (!entry) return -1;
    int failed = PyList_Append(trace, entry);
    Py_DECREF(entry);
    return failed;
}

/* Whether legality._compare_reads_copy (the Python function) says no (1), yes (0) or fails (-1)
   for a would-be fusion of groups ``ga`` (span sa:ea) and ``gb`` (span sb:eb) and the new
   copy ``extra`` (-1: none); asked only where it can say yes: a group holds copies, or
   ``extra`` is a reduce or reads a member (a copy of one elementwise op whose operands are
   all outside is the original; a producer reading a member of its consumer's group is
   possible where it reads its own copy of that member). */
static int compare_safe(Space *S, const View *V, PyObject *space, PyObject *plan,
                        PyObject *index, PyObject *held, int32_t ga, int32_t sa, int32_t ea,
                        int32_t gb, int32_t sb, int32_t eb, int32_t extra) {
    if (!S->any_compare) return 1;
    int ask = extra >= 0 && S->reduce[extra];
    for (int32_t j = extra >= 0 ? S->dops_at[extra] : 0; extra >= 0 && !ask
         && j < S->dops_at[extra + 1]; j++) {
        int32_t g = V->group[S->dops[j]];
        ask = g == ga || g == gb;
    }
    if (!ask && (ask = holds_copies(S, held, ga)) < 0) return -1;
    if (!ask && gb != ga && (ask = holds_copies(S, held, gb)) < 0) return -1;
    if (!ask) return 1;
    long v[7] = {ga, sa, ea, gb, sb, eb, extra};
    PyObject *args[11] = {space, plan, index};
    int ok = 1;
    for (int k = 0; k < 7; k++) {
        args[3 + k] = (k == 6 && extra < 0) ? Py_NewRef(Py_None) : PyLong_FromLong(v[k]);
        ok = ok && args[3 + k];
    }
    PyObject *found = ok ? PyObject_Vectorcall(S->compare_fn, args, 10, NULL) : NULL;
    for (int k = 0; k < 7; k++) Py_XDECREF(args[3 + k]);
    if (!found) return -1;
    int truth = PyObject_IsTrue(found);
    Py_DECREF(found);
    return truth < 0 ? -1 : !truth;
}

/* Candidate producers of a consumer group (span sc:ec) into S->buf: groups._outside_operands
   over fusible operands. For a group holding copies: the distinct fusible operands of its
   members (in schedule order), then of its copies (in the copy index's order, ascending),
   outside the group and not copies themselves. */
static Py_ssize_t candidates(Space *S, const View *V, PyObject *held, int32_t gc, int32_t sc,
                             int32_t ec) {
    PyObject *copies = lookup(S, held, gc);
    if (!copies && PyErr_Occurred()) return -1;
    if (!copies) return outside_fops(S, V, gc, sc, ec, S->buf);
    Py_ssize_t ncopies = tuple_len(copies), len = 0;
    if (ncopies < 0) return -1;
    int32_t *out = S->buf, *node = S->buf2;  /* the members, then the copies */
    Py_ssize_t nnodes = 0;
    for (int32_t k = sc; k < ec; k++) node[nnodes++] = V->order[k];
    if ((nnodes = append_tuple(copies, node, nnodes)) < 0) return -1;
    uint32_t st = next_stamp(S);
    for (Py_ssize_t i = ec - sc; i < nnodes; i++) S->mark[node[i]] = st;  /* copies: inside */
    for (Py_ssize_t i = 0; i < nnodes; i++) {
        int32_t m = node[i];
        for (int32_t j = S->fops_at[m]; j < S->fops_at[m + 1]; j++) {
            int32_t o = S->fops[j];
            if (S->mark[o] != st && V->group[o] != gc) {
                S->mark[o] = st;
                out[len++] = o;
            }
        }
    }
    return len;
}

/* legality._single_output_fusion after the draws, less the compare rule (compare_safe):
   whether the producer's group ``gp`` (span sp:ep, not the root's) may join the consumer's
   group ``gc`` (span sc:ec); LEGAL, NEEDS_MULTI_OUTPUT or LAYOUT_UNSAFE, or -1. */
static int fusion_legal(Space *S, const View *V, PyObject *held, PyObject *holders,
                        int32_t producer, int32_t gp, int32_t sp, int32_t ep, int32_t consumer,
                        int32_t gc, int32_t sc, int32_t ec) {
    int ok = feeds_only_node(S, V, holders, producer, gp, gc);  /* the producer first */
    for (int32_t k = sp; k < ep && ok > 0 && ep - sp > 1; k++)  /* then _feeds_only */
        ok = feeds_only_node(S, V, holders, V->order[k], gp, gc);
    if (ok <= 0) return ok < 0 ? -1 : NEEDS_MULTI_OUTPUT;
    if (!S->any_bad) return LEGAL;
    int gp_held, gc_held;
    if ((gp_held = holds_copies(S, held, gp)) < 0 || (gc_held = holds_copies(S, held, gc)) < 0)
        return -1;
    if (ep - sp == 1 && ec - sc == 1 && !gp_held && !gc_held)
        return reads_bad(S, consumer, producer) ? LAYOUT_UNSAFE : LEGAL;
    ok = layout_safe(S, V, held, gp, sp, ep, gc, sc, ec, -1);
    return ok < 0 ? -1 : ok ? LEGAL : LAYOUT_UNSAFE;
}

/* A try's draws (moves.op_fusion_move, moves.duplicate_fusion_move): a compute node
   ``consumer`` (its group ``gc``, span sc:ec), then ``producer`` among its candidates. */
typedef struct {
    int32_t consumer, gc, sc, ec, producer;
} Pick;

/* Draws a try's ``Pick``: 1, 0 when the consumer has no candidate producers, -1 on error. */
static int draw_pick(Space *S, const View *V, PyObject *held, PyObject *bits, Pick *p) {
    int32_t r;
    if (draw(bits, S->ncompute, &r) < 0) return -1;
    p->consumer = S->compute[r];
    p->gc = V->group[p->consumer];
    span_at(S, V, V->pos[p->consumer], &p->sc, &p->ec);
    Py_ssize_t ncand = candidates(S, V, held, p->gc, p->sc, p->ec);
    if (ncand <= 0) return (int)ncand;
    if (draw(bits, (int32_t)ncand, &r) < 0) return -1;
    p->producer = S->buf[r];
    return 1;
}

/* op_fusion(kspace, kar, state, space, plan, index, bits, tries, trace):
   moves.op_fusion_move's tries (single output). None if no try found a legal pair, else
   what merge answers (no group moves after the merged one). ``kar`` and ``state``: see
   merge_py; ``trace``: None, or a list the tries are appended to (trace_try). */
static PyObject *op_fusion(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("op_fusion", nargs, 9) < 0) return NULL;
    Space *S = get_space(args[0]);
    if (!S) return NULL;
    ArTables *T = ar_tables_arg(args[1]);
    if (!T && PyErr_Occurred()) return NULL;
    PyObject *state = T ? args[2] : NULL;
    PyObject *space = args[3], *plan = args[4], *index = args[5], *bits = args[6];
    PyObject *trace = args[8];
    long tries;
    View V;
    int entered = enter_tries(S, args[7], &tries, S->ncompute, plan, index, state, &V);
    if (entered <= 0) return not_entered(entered);
    PyObject *held = PyTuple_GET_ITEM(index, 0), *holders = PyTuple_GET_ITEM(index, 1);
    PyObject *result = NULL;
    int32_t root_group = V.group[S->root];
    for (long t = 0; t < tries; t++) {
        Pick p;
        int drawn = draw_pick(S, &V, held, bits, &p);
        if (drawn < 0) goto done;
        if (!drawn) {
            if (trace_try(trace, NO_PRODUCER, p.consumer, -1) < 0) goto done;
            continue;
        }
        int32_t gp = V.group[p.producer], sp = 0, ep = 0;
        int code = NEEDS_MULTI_OUTPUT;
        if (gp != root_group) {
            span_at(S, &V, V.pos[p.producer], &sp, &ep);
            code = fusion_legal(S, &V, held, holders, p.producer, gp, sp, ep, p.consumer, p.gc,
                                p.sc, p.ec);
            if (code == LEGAL) {
                int ok = compare_safe(S, &V, space, plan, index, held, gp, sp, ep, p.gc, p.sc,
                                      p.ec, -1);
                code = ok < 0 ? -1 : ok ? LEGAL : COMPARES_COPY;
            }
        }
        if (code < 0 || trace_try(trace, code, p.consumer, p.producer) < 0) goto done;
        if (code != LEGAL) continue;
        result = merge(S, &V, plan, gp, sp, ep, p.gc, p.sc, p.ec, NULL, 0, T, state);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    return leave(S, &V, result);
}

/* Whether the node at position ``p`` is alone in its group (value._alone). */
static int alone_at(const Space *S, const View *V, int32_t p) {
    const int32_t *order = V->order, *group = V->group;
    int32_t g = group[order[p]];
    return (!p || group[order[p - 1]] != g) && (p + 1 == S->n || group[order[p + 1]] != g);
}

/* groups._is_read_outside: whether ``node``'s value leaves its group; 1, 0 or -1. */
static int read_outside(Space *S, const View *V, PyObject *holders, int32_t node) {
    if (node == S->root) return 1;
    return read_beyond(S, V, holders, node, V->group[node], V->group[node]);
}

/* legality._exposes_member: whether a copy of ``producer`` in group ``gc`` would read a value
   that does not leave its (multi-node) group; 1, 0 or -1. */
static int exposes_member(Space *S, const View *V, PyObject *holders, int32_t producer,
                          int32_t gc) {
    for (int32_t j = S->dops_at[producer]; j < S->dops_at[producer + 1]; j++) {
        int32_t o = S->dops[j];
        if (V->group[o] == gc) continue;
        PyObject *ho = lookup(S, holders, o);
        if (!ho && PyErr_Occurred()) return -1;
        int has = tuple_has(ho, gc);
        if (has < 0) return -1;
        if (has || alone_at(S, V, V->pos[o])) continue;
        int out = read_outside(S, V, holders, o);
        if (out <= 0) return out < 0 ? -1 : 1;
    }
    return 0;
}

/* legality._duplicate_rest for an unfused ``producer`` read by group ``gc`` (span sc:ec),
   less the compare rule (compare_safe): whether copying it into the group is legal; LEGAL,
   LAYOUT_UNSAFE, NO_OTHER_USERS or EXPOSES_MEMBER, or -1. */
static int duplicate_legal(Space *S, const View *V, PyObject *held, PyObject *holders,
                           int32_t producer, int32_t gc, int32_t sc, int32_t ec) {
    if (S->any_bad) {
        int gc_held = holds_copies(S, held, gc);
        if (gc_held < 0) return -1;
        if (ec - sc == 1 && !gc_held) {
            if (reads_bad(S, V->order[sc], producer)) return LAYOUT_UNSAFE;
        } else {
            int ok = layout_safe(S, V, held, gc, sc, ec, gc, sc, sc, producer);
            if (ok <= 0) return ok < 0 ? -1 : LAYOUT_UNSAFE;
        }
    }
    PyObject *own = lookup(S, holders, producer);
    if (!own && PyErr_Occurred()) return -1;
    int other_users = 0;
    for (int32_t j = S->users_at[producer]; j < S->users_at[producer + 1] && !other_users; j++) {
        int32_t gu = V->group[S->users[j]];
        if (gu != gc) {
            int has = tuple_has(own, gu);
            if (has < 0) return -1;
            other_users = !has;
        }
    }
    if (!other_users) return NO_OTHER_USERS;
    if (S->multi_output) return LEGAL;
    int exposes = exposes_member(S, V, holders, producer, gc);
    return exposes < 0 ? -1 : exposes ? EXPOSES_MEMBER : LEGAL;
}

/* duplicate(kspace, space, plan, index, bits, tries, trace): moves.duplicate_fusion_move's
   tries. None if no try found a legal pair, else (producer, consumer group). ``trace``: see
   op_fusion. */
static PyObject *duplicate(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("duplicate", nargs, 7) < 0) return NULL;
    Space *S = get_space(args[0]);
    if (!S) return NULL;
    PyObject *space = args[1], *plan = args[2], *index = args[3], *bits = args[4];
    PyObject *trace = args[6];
    long tries;
    View V;
    int entered = enter_tries(S, args[5], &tries, S->ncompute, plan, index, NULL, &V);
    if (entered <= 0) return not_entered(entered);
    PyObject *held = PyTuple_GET_ITEM(index, 0), *holders = PyTuple_GET_ITEM(index, 1);
    PyObject *result = NULL;
    for (long t = 0; t < tries; t++) {
        Pick p;
        int drawn = draw_pick(S, &V, held, bits, &p);
        if (drawn < 0) goto done;
        if (!drawn) {
            if (trace_try(trace, NO_PRODUCER, p.consumer, -1) < 0) goto done;
            continue;
        }
        int code = FUSED_PRODUCER;
        if (alone_at(S, &V, V.pos[p.producer])) {
            code = duplicate_legal(S, &V, held, holders, p.producer, p.gc, p.sc, p.ec);
            if (code == LEGAL) {
                int ok = compare_safe(S, &V, space, plan, index, held, p.gc, p.sc, p.ec, p.gc,
                                      p.sc, p.sc, p.producer);
                code = ok < 0 ? -1 : ok ? LEGAL : COMPARES_COPY;
            }
        }
        if (code < 0 || trace_try(trace, code, p.consumer, p.producer) < 0) goto done;
        if (code == LEGAL) {
            result = Py_BuildValue("ii", p.producer, p.gc);
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    return leave(S, &V, result);
}

/* merge(kspace, kar, state, plan, first, s1, e1, second, s2, e2, nodes): see merge above;
   ``nodes`` is an array('i') of descendants or None, ``kar`` the kernel's all-reduce tables
   (new_ar_tables) that ``state``, the plan's all-reduce state, was made with, or None.
   NotImplemented if the plan's arrays are not array('i'). */
static PyObject *merge_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("merge", nargs, 11) < 0) return NULL;
    Space *S = get_space(args[0]);
    if (!S) return NULL;
    ArTables *T = ar_tables_arg(args[1]);
    if (!T && PyErr_Occurred()) return NULL;
    int32_t v[6];
    for (int k = 0; k < 6; k++) {
        long x = PyLong_AsLong(args[4 + k]);
        if (x == -1 && PyErr_Occurred()) return NULL;
        v[k] = (int32_t)x;
    }
    Py_buffer nodes;
    int with_nodes = args[10] != Py_None;
    if (with_nodes && PyObject_GetBuffer(args[10], &nodes, PyBUF_FORMAT) < 0) return NULL;
    if (with_nodes && (nodes.itemsize != 4 || !nodes.format || strcmp(nodes.format, "i"))) {
        PyBuffer_Release(&nodes);
        PyErr_SetString(PyExc_TypeError, "nodes must be an array('i')");
        return NULL;
    }
    View V;
    PyObject *state = T ? args[2] : NULL, *result;
    int entered = enter(S, args[3], NULL, state, &V);
    if (entered > 0) {
        result = leave(S, &V, merge(S, &V, args[3], v[0], v[1], v[2], v[3], v[4], v[5],
                                    with_nodes ? nodes.buf : NULL, with_nodes ? nodes.len / 4 : 0,
                                    T, state));
    } else {
        result = not_entered(entered);
    }
    if (with_nodes) PyBuffer_Release(&nodes);
    return result;
}

/* Sorts ``out`` by all-reduce index (by value when the all-reduces are in order). */
static void sort_ars(const ArTables *T, int32_t *out, Py_ssize_t len) {
    for (Py_ssize_t i = 1; i < len; i++) {
        int32_t x = out[i], kx = T->in_order ? x : T->index[x];
        Py_ssize_t j = i;
        while (j > 0 && (T->in_order ? out[j - 1] : T->index[out[j - 1]]) > kx) {
            out[j] = out[j - 1];
            j--;
        }
        out[j] = x;
    }
}

/* An int value of dict[key], or -1 (with an error set). */
static long dict_int(Space *S, PyObject *dict, int32_t key) {
    PyObject *v = PyDict_GetItemWithError(dict, S->ints[key]);
    if (!v) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, S->ints[key]);
        return -1;
    }
    return PyLong_AsLong(v);
}

/* The node ``ranked[i]`` of a list of rank nodes, or -1 (with an error set). */
static long list_int(PyObject *list, Py_ssize_t i) {
    PyObject *v = PyList_GetItem(list, i);
    return v ? PyLong_AsLong(v) : -1;
}

/* The neighbours from the order of gradient production (the end of neighbours._neighbours),
   appended to ``out``; the new length or -1. */
static Py_ssize_t production_neighbours(Space *S, const ArTables *T, PyObject *state, int32_t ar,
                                        int32_t r, int32_t *out, Py_ssize_t len) {
    PyObject *ranked = PyTuple_GET_ITEM(state, 1), *where = PyTuple_GET_ITEM(state, 2);
    const int32_t *tie = T->by_rank + T->by_rank_at[r];
    int32_t ntie = T->by_rank_at[r + 1] - T->by_rank_at[r], k = 0;
    while (tie[k] != ar) k++;
    if (k) {
        out[len++] = tie[k - 1];
    } else {
        long i = dict_int(S, where, r);
        if (i < 0) return -1;
        if (i) {
            long m = list_int(ranked, i - 1);
            if (m < 0) return -1;
            out[len++] = T->by_rank[T->by_rank_at[m + 1] - 1];
        }
    }
    if (k + 1 < ntie) {
        out[len++] = tie[k + 1];
    } else {
        long i = dict_int(S, where, r);
        if (i < 0) return -1;
        if (i + 1 < PyList_GET_SIZE(ranked)) {
            long m = list_int(ranked, i + 1);
            if (m < 0) return -1;
            out[len++] = T->by_rank[T->by_rank_at[m]];
        }
    }
    return len;
}

/* Adds ``g`` to the near groups (``near``, marked with ``st``). */
static inline void add_near(Space *S, uint32_t st, int32_t *near, Py_ssize_t *len, int32_t g) {
    if (S->mark[g] != st) {
        S->mark[g] = st;
        near[(*len)++] = g;
    }
}

/* The groups near the group of rank node ``r`` when ``r`` is alone and holds no copies:
   its own, those of its users (and of copies reading it) and of its operands, into
   ``near``; their count or -1. */
static Py_ssize_t near_groups(Space *S, const View *V, PyObject *holders, int32_t r,
                              int32_t *near) {
    const int32_t *group = V->group;
    uint32_t st = next_stamp(S);
    Py_ssize_t len = 0;
    add_near(S, st, near, &len, group[r]);
    PyObject *own = PyDict_GET_SIZE(holders) ? lookup(S, holders, r) : NULL;
    if (!own && PyErr_Occurred()) return -1;
    for (int32_t j = S->users_at[r]; j < S->users_at[r + 1]; j++) {
        int32_t u = S->users[j], gu = group[u];
        int has = tuple_has(own, gu);
        if (has < 0) return -1;
        if (!has) add_near(S, st, near, &len, gu);
        PyObject *hu = lookup(S, holders, u);  /* the groups holding copies of ``u`` */
        if (!hu && PyErr_Occurred()) return -1;
        Py_ssize_t nhu = tuple_len(hu);
        if (nhu < 0) return -1;
        for (Py_ssize_t i = 0; i < nhu; i++) {
            long g;
            if (tuple_int(hu, i, &g) < 0 || (has = tuple_has(own, g)) < 0) return -1;
            if (!has) add_near(S, st, near, &len, (int32_t)g);
        }
    }
    for (int32_t j = S->dops_at[r]; j < S->dops_at[r + 1]; j++)
        add_near(S, st, near, &len, group[S->dops[j]]);
    return len;
}

/* neighbours._neighbours of all-reduce ``ar`` into S->buf (by the Python function unless its
   rank node is alone and holds no copies); their count or -1. */
static Py_ssize_t neighbours(Space *S, const ArTables *T, const View *V, PyObject *space,
                             PyObject *plan, PyObject *index, PyObject *state, int32_t ar) {
    PyObject *held = PyTuple_GET_ITEM(index, 0), *holders = PyTuple_GET_ITEM(index, 1);
    int32_t r = T->rank[ar], mine = V->group[r], q = V->pos[r], *out = S->buf;
    int in_held = holds_copies(S, held, mine);
    if (in_held < 0) return -1;
    if (in_held || (q && V->group[V->order[q - 1]] == mine)
        || (q + 1 < S->n && V->group[V->order[q + 1]] == mine)) {
        PyObject *args[4] = {space, plan, index, S->ints[ar]};
        return answer_into(PyObject_Vectorcall(S->neighbours_fn, args, 4, NULL), out, S->cap);
    }
    int32_t *near = S->buf2;
    Py_ssize_t nnear = near_groups(S, V, holders, r, near), len = 0;
    if (nnear < 0) return -1;
    PyObject *ranked_in = PyTuple_GET_ITEM(state, 3);
    for (Py_ssize_t i = 0; i < nnear; i++) {
        int32_t h = near[i];
        if (T->skip && T->is_ar[h]) continue;  /* buckets hold no rank nodes */
        PyObject *found = lookup(S, ranked_in, h);
        if (!found && PyErr_Occurred()) return -1;
        if (found && PyTuple_Check(found) && PyTuple_GET_SIZE(found)) {
            if ((len = append_tuple(found, out, len)) < 0) return -1;
        } else {
            for (int32_t j = T->by_rank_at[h]; j < T->by_rank_at[h + 1]; j++)
                out[len++] = T->by_rank[j];
        }
    }
    sort_ars(T, out, len);
    for (Py_ssize_t i = 0; i < len; i++) {  /* out.remove(ar) */
        if (out[i] == ar) {
            memmove(out + i, out + i + 1, sizeof(int32_t) * (len - i - 1));
            len--;
            break;
        }
    }
    return production_neighbours(S, T, state, ar, r, out, len);
}

/* allreduce_pick(kspace, kar, space, plan, index, state, bits, tries, trace): the tries of
   moves.allreduce_move up to a pair of buckets with equal keys. None if none, else
   (tries left, first, s1, e1, second, s2, e2, a, b): the buckets in schedule order and
   spans, and the all-reduces drawn. ``trace``: see op_fusion (the pair answered is left to
   the caller, which checks it for cycles). */
static PyObject *allreduce_pick(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("allreduce_pick", nargs, 9) < 0) return NULL;
    Space *S = get_space(args[0]);
    ArTables *T = PyCapsule_GetPointer(args[1], "plan_kernel.ar_tables");
    if (!S || !T) return NULL;
    PyObject *space = args[2], *plan = args[3], *index = args[4], *state = args[5];
    PyObject *bits = args[6], *trace = args[8];
    long tries;
    View V;
    int entered = enter_tries(S, args[7], &tries, T->nars, plan, index, state, &V);
    if (entered <= 0) return not_entered(entered);
    PyObject *result = NULL;
    const int32_t *group = V.group, *pos = V.pos;
    for (long t = tries; t > 0; t--) {
        int32_t i;
        if (draw(bits, T->nars, &i) < 0) goto done;
        int32_t a = T->ars[i], ga = group[a];
        Py_ssize_t len = neighbours(S, T, &V, space, plan, index, state, a), kept = 0;
        if (len < 0) goto done;
        for (Py_ssize_t k = 0; k < len; k++) {
            if (group[S->buf[k]] != ga) S->buf[kept++] = S->buf[k];
        }
        if (!kept) {
            if (trace_try(trace, NO_NEIGHBOUR, a, -1) < 0) goto done;
            continue;
        }
        if (draw(bits, (int32_t)kept, &i) < 0) goto done;
        int32_t b = S->buf[i], gb = group[b];
        if (T->key[a] != T->key[b]) {
            if (trace_try(trace, KEYS_DIFFER, a, b) < 0) goto done;
            continue;
        }
        int32_t first = pos[ga] < pos[gb] ? ga : gb, second = first == ga ? gb : ga;
        int32_t s1, e1, s2, e2;
        span_at(S, &V, pos[first], &s1, &e1);
        span_at(S, &V, pos[second], &s2, &e2);
        result = Py_BuildValue("liiiiiiii", t - 1, first, s1, e1, second, s2, e2, a, b);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    return leave(S, &V, result);
}

/* draws(bits, n, count): ``count`` draws of rng.choice over ``n`` items (results unused). */
static PyObject *draws(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("draws", nargs, 3) < 0) return NULL;
    long n = PyLong_AsLong(args[1]), count = PyLong_AsLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    for (long k = 0; k < count; k++) {
        int32_t r;
        if (draw(args[0], (int32_t)n, &r) < 0) return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"new_space", new_space, METH_VARARGS, "static tables of a FusionSpace"},
    {"new_ar_tables", new_ar_tables, METH_VARARGS, "static all-reduce tables"},
    {"op_fusion", (PyCFunction)(void (*)(void))op_fusion, METH_FASTCALL, "op fusion tries"},
    {"duplicate", (PyCFunction)(void (*)(void))duplicate, METH_FASTCALL, "duplicate tries"},
    {"merge", (PyCFunction)(void (*)(void))merge_py, METH_FASTCALL, "the arrays of a merge"},
    {"allreduce_pick", (PyCFunction)(void (*)(void))allreduce_pick, METH_FASTCALL,
     "all-reduce tries"},
    {"draws", (PyCFunction)(void (*)(void))draws, METH_FASTCALL, "unused draws"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_plan_kernel_ext", NULL, -1, methods};

PyMODINIT_FUNC PyInit__plan_kernel_ext(void) {
    PyObject *array_module = PyImport_ImportModule("array");
    if (!array_module) return NULL;
    array_type = (PyTypeObject *)PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    if (!array_type) return NULL;
    return PyModule_Create(&module);
}
