/*
 * transports/_ringc_put.h: the one-sided half of the shm endpoint's C fast path.
 *
 * Not a stand-alone header: transports/_ringc.c includes it once, after the ring and the
 * FastPath object, whose static helpers it uses (reserve, send_parts, spin_for_record...).
 * It adds FastPath.put / put_many / wait_notification / poll_notification_nowait, the
 * deferred-put (PUT_PULL) records, the streaming copy the target uses for large pulls, and
 * the module functions make_note() and set_stream_copy().
 */
/* ------------------------------------------------------------------ one-sided put and notifications */

/* Enabled by FastPath.enable_one_sided(peer_table, local_table, note_type, notes, slow_put,
 * slow_put_many, slow_wait, slow_poll, finish_put). Layouts are those of transports/_shm_regions.py:
 *
 *   peer_table   the peer's region table in the shared memfd (TABLE_SLOTS slots of 8 u64 words;
 *                word 0 = region_id << 32 | flags), read to see a deregistration;
 *   local_table  a private array of TABLE_SLOTS x (state, nbytes) u64 pairs mirroring the regions
 *                registered on this side (private: the peer cannot change what we validate against).
 *
 * put(data, remote, *, offset, notify_id, tag, timeout_s) and put_many(...) run here when
 * `remote` is a RemoteRegion object the Python put has already validated and mapped
 * (cache_remote() records it, keyed by the object's identity; RemoteRegion is frozen) and the
 * peer's table still shows the same registration: bounds check, memcpy into the mapped
 * region, then one PUT_DONE record published with a release store of head (after an sfence,
 * so even non-temporal stores of a large memcpy are visible before it). Anything else -- a
 * first put into a region, a full ring, an odd argument, an error to raise -- goes to the
 * endpoint's Python method, called with the same arguments.
 *
 * wait_notification / poll_notification_nowait take a PUT_DONE record at the head of the
 * ring when no notification is queued aside in Python (`notes`, a deque) and the record names
 * a region registered here; otherwise the Python method runs. They also carry out PUT_PULL
 * records (a deferred put_many): copy each piece out of the peer's region mapped here
 * (cache_source() records it once Python has mapped it) into ours, then publish the put's
 * sequence number in the ring header (`pulled`) so the initiator may reuse its source. */

#define TABLE_SLOTS 4096
#define SLOT_WORDS 8
#define REGION_ACTIVE 1
#define KIND_PUT_DONE 5
#define DONE_NBYTES 32 /* u32 region_id, u32 tag_len, u64 offset, u64 nbytes, u64 notify_id (then the tag) */
#define MAX_TAG_NBYTES 256
#define REMOTE_CACHE 256 /* regions whose mapping is cached here, by slot (region_id & 255) */
#define KIND_PUT_PULL 6
/* u32 dst region, u32 src region, u32 pieces, u32 tag_len, u64 notify_id, u64 seq, u64 span offset,
 * u64 span nbytes, u32 flags, u32 reserved; then the tag; then pieces x (u64 src_off, u64 dst_off, u64 nbytes) */
#define PULL_NBYTES 56
#define PULL_LAST 1
#define PIECE_NBYTES 24
#define LOCAL_WORDS 4 /* private table slot: state, nbytes, address, reserved */
#define NOGIL_COPY_NBYTES (256u << 10) /* copies at least this large run without the GIL */
#define FENCE_COPY_NBYTES (64u << 10)  /* copies at least this large may use non-temporal stores */

typedef struct {
    PyObject *remote; /* the RemoteRegion object (strong reference: its address identifies it) */
    PyObject *view;   /* memoryview of the peer's region, mapped here */
    Py_buffer vbuf;
    uint64_t state;   /* the peer table's word 0 when the Python put validated it */
    uint64_t nbytes;
    uint32_t rid;
} remote_entry;

typedef struct {
    PyObject *view; /* memoryview of a region the peer registered, mapped here: a source of deferred puts */
    Py_buffer vbuf;
    uint64_t state;
    uint32_t rid;
} source_entry;

struct one_sided {
    Py_buffer peer_tbl;
    Py_buffer local_tbl;
    PyObject *note_type, *notes, *slow_put, *slow_put_many, *slow_wait, *slow_poll, *finish_put;
    int peer_gone; /* set by the endpoint once it knows the peer is gone: puts go to Python */
    int released;  /* disable_one_sided() ran: the tables are no longer held, everything goes to Python */
    unsigned long long puts, put_bytes, zero_copy_puts, gathered_puts, notifications, pulled_bytes, deferred_puts;
    uint64_t pull_seq;            /* deferred puts posted from this side (C and Python alike) */
    uint32_t homes[REMOTE_CACHE]; /* local shared regions deferred puts have come from (0: none) */
    int last_home;
    remote_entry cache[REMOTE_CACHE];
    source_entry sources[REMOTE_CACHE];
};

static PyObject *str_offset, *str_notify_id, *str_tag, *str_region_id, *str_nbytes, *str_defer, *empty_tuple,
    *empty_bytes;

static void entry_clear(remote_entry *e) {
    if (e->remote == NULL)
        return;
    if (e->view != NULL)
        PyBuffer_Release(&e->vbuf);
    Py_CLEAR(e->view);
    Py_CLEAR(e->remote);
}

static void source_clear(source_entry *e) {
    if (e->view == NULL)
        return;
    PyBuffer_Release(&e->vbuf);
    Py_CLEAR(e->view);
}

static void os_free(FastPathObject *f) {
    struct one_sided *o = f->os;
    if (o == NULL)
        return;
    f->os = NULL;
    for (int i = 0; i < REMOTE_CACHE; i++) {
        entry_clear(&o->cache[i]);
        source_clear(&o->sources[i]);
    }
    PyBuffer_Release(&o->peer_tbl);
    PyBuffer_Release(&o->local_tbl);
    Py_CLEAR(o->note_type);
    Py_CLEAR(o->notes);
    Py_CLEAR(o->slow_put);
    Py_CLEAR(o->slow_put_many);
    Py_CLEAR(o->slow_wait);
    Py_CLEAR(o->slow_poll);
    Py_CLEAR(o->finish_put);
    PyMem_Free(o);
}

/* The objects whose buffers are held (the tables, the mapped views) are not visited: to the
 * collector they stay referenced from outside, so it never clears one (a memoryview cleared
 * while exported crashes when the export goes) before os_free() releases it. */
static int os_traverse(FastPathObject *f, visitproc visit, void *arg) {
    struct one_sided *o = f->os;
    if (o == NULL)
        return 0;
    Py_VISIT(o->note_type);
    Py_VISIT(o->notes);
    Py_VISIT(o->slow_put);
    Py_VISIT(o->slow_put_many);
    Py_VISIT(o->slow_wait);
    Py_VISIT(o->slow_poll);
    Py_VISIT(o->finish_put);
    for (int i = 0; i < REMOTE_CACHE; i++)
        Py_VISIT(o->cache[i].remote);
    return 0;
}

static PyObject *fp_enable_one_sided(FastPathObject *f, PyObject *args) {
    PyObject *peer, *local, *nt, *notes, *sp, *spm, *sw, *spo, *fin;
    if (!PyArg_ParseTuple(args, "OOOOOOOOO:enable_one_sided", &peer, &local, &nt, &notes, &sp, &spm, &sw, &spo, &fin))
        return NULL;
    if (!PyType_Check(nt) || !PyCallable_Check(sp) || !PyCallable_Check(spm) || !PyCallable_Check(sw) ||
        !PyCallable_Check(spo) || !PyCallable_Check(fin)) {
        PyErr_SetString(PyExc_TypeError, "enable_one_sided needs a type and five callables");
        return NULL;
    }
    struct one_sided *o = PyMem_Calloc(1, sizeof(*o));
    if (o == NULL)
        return PyErr_NoMemory();
    if (PyObject_GetBuffer(peer, &o->peer_tbl, PyBUF_SIMPLE) < 0) {
        PyMem_Free(o);
        return NULL;
    }
    if (PyObject_GetBuffer(local, &o->local_tbl, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&o->peer_tbl);
        PyMem_Free(o);
        return NULL;
    }
    size_t need = (size_t)TABLE_SLOTS * SLOT_WORDS * 8;
    if ((size_t)o->peer_tbl.len < need || (size_t)o->local_tbl.len < (size_t)TABLE_SLOTS * LOCAL_WORDS * 8 ||
        ((uintptr_t)o->peer_tbl.buf & 7) || ((uintptr_t)o->local_tbl.buf & 7)) {
        PyBuffer_Release(&o->peer_tbl);
        PyBuffer_Release(&o->local_tbl);
        PyMem_Free(o);
        PyErr_SetString(PyExc_ValueError, "region tables are too small or misaligned");
        return NULL;
    }
    Py_INCREF(nt);
    Py_INCREF(notes);
    Py_INCREF(sp);
    Py_INCREF(spm);
    Py_INCREF(sw);
    Py_INCREF(spo);
    Py_INCREF(fin);
    o->note_type = nt;
    o->notes = notes;
    o->slow_put = sp;
    o->slow_put_many = spm;
    o->slow_wait = sw;
    o->slow_poll = spo;
    o->finish_put = fin;
    os_free(f);
    f->os = o;
    Py_RETURN_NONE;
}

/* disable_one_sided(): release every buffer and mapping held here (the endpoint is closing);
 * later calls go to Python. The counters stay readable. */
static PyObject *fp_disable_one_sided(FastPathObject *f, PyObject *Py_UNUSED(ignored)) {
    struct one_sided *o = f->os;
    if (o != NULL && !o->released) {
        o->released = o->peer_gone = 1;
        for (int i = 0; i < REMOTE_CACHE; i++) {
            entry_clear(&o->cache[i]);
            source_clear(&o->sources[i]);
        }
        PyBuffer_Release(&o->peer_tbl);
        PyBuffer_Release(&o->local_tbl);
    }
    Py_RETURN_NONE;
}

/* The cache entry for a RemoteRegion object: by its region id's slot bits (a peer's region ids
 * differ there for its first REMOTE_CACHE registrations). NULL with an exception on error. */
static remote_entry *cache_slot(struct one_sided *o, PyObject *remote) {
    PyObject *v = PyObject_GetAttr(remote, str_region_id);
    if (v == NULL)
        return NULL;
    unsigned long rid = PyLong_Check(v) ? PyLong_AsUnsignedLongMask(v) : 0;
    Py_DECREF(v);
    if (rid == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    return &o->cache[rid % REMOTE_CACHE];
}

/* cache_remote(remote, region_id, state, nbytes, view): the Python put validated `remote` against
 * the peer's table (word 0 == state) and mapped the region as `view` (None: not mappable here,
 * which only deferred puts can target). */
static PyObject *fp_cache_remote(FastPathObject *f, PyObject *args) {
    PyObject *remote, *view;
    unsigned long rid;
    unsigned long long state, nbytes;
    if (!PyArg_ParseTuple(args, "OkKKO:cache_remote", &remote, &rid, &state, &nbytes, &view))
        return NULL;
    struct one_sided *o = f->os;
    if (o == NULL || o->peer_gone || o->released)
        Py_RETURN_NONE;
    remote_entry *e = cache_slot(o, remote);
    if (e == NULL)
        return NULL;
    entry_clear(e);
    if (view != Py_None) {
        if (PyObject_GetBuffer(view, &e->vbuf, PyBUF_WRITABLE) < 0)
            return NULL;
        if ((uint64_t)e->vbuf.len != nbytes) {
            PyBuffer_Release(&e->vbuf);
            PyErr_SetString(PyExc_ValueError, "cache_remote: the view and nbytes disagree");
            return NULL;
        }
        Py_INCREF(view);
        e->view = view;
    }
    Py_INCREF(remote);
    e->remote = remote;
    e->rid = (uint32_t)rid;
    e->state = state;
    e->nbytes = nbytes;
    Py_RETURN_NONE;
}

/* forget_remote(region_id): drop every cached mapping of that region (before it is unmapped). */
static PyObject *fp_forget_remote(FastPathObject *f, PyObject *arg) {
    unsigned long rid = PyLong_AsUnsignedLong(arg);
    if (rid == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    struct one_sided *o = f->os;
    if (o != NULL)
        for (int i = 0; i < REMOTE_CACHE; i++) {
            if (o->cache[i].remote != NULL && o->cache[i].rid == (uint32_t)rid)
                entry_clear(&o->cache[i]);
            if (o->sources[i].view != NULL && o->sources[i].rid == (uint32_t)rid)
                source_clear(&o->sources[i]);
        }
    Py_RETURN_NONE;
}

/* cache_home(region_id): deferred puts from that local region may be posted in C. */
static PyObject *fp_cache_home(FastPathObject *f, PyObject *arg) {
    unsigned long rid = PyLong_AsUnsignedLong(arg);
    if (rid == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    struct one_sided *o = f->os;
    if (o != NULL && !o->released && rid != 0)
        o->homes[rid % REMOTE_CACHE] = (uint32_t)rid;
    Py_RETURN_NONE;
}

/* cache_source(region_id, state, view): the peer's region `region_id` (table word 0 == state),
 * mapped here as `view`, may be pulled from in C. */
static PyObject *fp_cache_source(FastPathObject *f, PyObject *args) {
    PyObject *view;
    unsigned long rid;
    unsigned long long state;
    if (!PyArg_ParseTuple(args, "kKO:cache_source", &rid, &state, &view))
        return NULL;
    struct one_sided *o = f->os;
    if (o == NULL || o->released)
        Py_RETURN_NONE;
    source_entry *e = &o->sources[rid % REMOTE_CACHE];
    source_clear(e);
    if (PyObject_GetBuffer(view, &e->vbuf, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_INCREF(view);
    e->view = view;
    e->rid = (uint32_t)rid;
    e->state = state;
    Py_RETURN_NONE;
}

/* Keyword arguments by name into out[] (NULL when absent); positional count must be npos. */
static int parse_kw(const char *name, Py_ssize_t nargs, Py_ssize_t npos, PyObject *const *args, PyObject *kwnames,
                    PyObject **names, PyObject **out, int nnames) {
    for (int i = 0; i < nnames; i++)
        out[i] = NULL;
    if (nargs != npos) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments (%zd given)", name, npos, nargs);
        return -1;
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        for (; j < nnames; j++)
            if (key == names[j])
                break;
        if (j == nnames)
            for (j = 0; j < nnames; j++)
                if (PyUnicode_Compare(key, names[j]) == 0)
                    break;
        if (j == nnames) {
            if (PyErr_Occurred())
                return -1;
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", name, key);
            return -1;
        }
        out[j] = args[nargs + k];
    }
    return 0;
}

static int timeout_plain(PyObject *t) { /* None or a non-negative float/int: the C path may run */
    if (t == NULL || t == Py_None)
        return 1;
    if (PyFloat_CheckExact(t))
        return PyFloat_AS_DOUBLE(t) >= 0.0;
    if (PyLong_CheckExact(t)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(t, &overflow);
        return overflow > 0 || (overflow == 0 && v >= 0);
    }
    return 0;
}

/* Call the endpoint's Python method `fn` with the owner first and the caller's arguments. */
static PyObject *forward(FastPathObject *f, PyObject *fn, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *stack[16];
    if (fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "one-sided operations are not enabled on this fast path");
        return NULL;
    }
    if (total + 1 > 16) {
        PyErr_SetString(PyExc_TypeError, "too many arguments");
        return NULL;
    }
    PyObject *owner = NULL;
#if PY_VERSION_HEX >= 0x030D0000
    if (PyWeakref_GetRef(f->owner_ref, &owner) < 0)
        return NULL;
#else
    owner = PyWeakref_GetObject(f->owner_ref);
    if (owner == NULL)
        return NULL;
    owner = owner == Py_None ? NULL : (Py_INCREF(owner), owner);
#endif
    if (owner == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the shm endpoint behind this method no longer exists");
        return NULL;
    }
    stack[0] = owner;
    for (Py_ssize_t i = 0; i < total; i++)
        stack[i + 1] = args[i];
    PyObject *res = PyObject_Vectorcall(fn, stack, (size_t)(nargs + 1), kwnames);
    Py_DECREF(owner);
    return res;
}

/* A put that finds peer_check_due(): the endpoint's own look at the peer (its
 * _check_peer_for_put: the socket polled, a dead peer raises BrokenLinkError) runs here, and
 * the put goes on in C. Forwarding the whole put to Python instead cost a few hundred
 * microseconds (the pieces checked again in NumPy, the records built in Python) on the
 * first put of every burst more than peer_check_ns after the last: the first layer of each
 * KV request. Called after the C checks passed (the same order as the Python put: a bad
 * argument is reported before a dead peer). 0: go on; 1: take the Python path (the state
 * changed meanwhile); -1: an exception is set. */
static int put_peer_check(FastPathObject *f, PyObject *remote, remote_entry *e, const char *what) {
    PyObject *owner = NULL;
#if PY_VERSION_HEX >= 0x030D0000
    if (PyWeakref_GetRef(f->owner_ref, &owner) < 0)
        return -1;
#else
    owner = PyWeakref_GetObject(f->owner_ref);
    if (owner == NULL)
        return -1;
    owner = owner == Py_None ? NULL : (Py_INCREF(owner), owner);
#endif
    if (owner == NULL)
        return 1;
    PyObject *r = PyObject_CallMethod(owner, "_check_peer_for_put", "s", what);
    Py_DECREF(owner);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    struct one_sided *o = f->os;
    if (o == NULL || o->released || o->peer_gone)
        return 1;
    remote_entry *again = cache_slot(o, remote);
    if (again == NULL)
        PyErr_Clear(); /* (it was read a moment ago) the Python path says what is wrong */
    if (again != e || e->remote != remote)
        return 1;
    const uint8_t *slot = (const uint8_t *)o->peer_tbl.buf + (size_t)(e->rid & (TABLE_SLOTS - 1)) * SLOT_WORDS * 8;
    return ld_acq(slot) == e->state ? 0 : 1;
}

/* Common checks of put/put_many: 1 and *e set when the C path may go on. */
typedef struct {
    unsigned long long notify_id;
    const char *tag;
    Py_ssize_t tag_len;
} put_args;

static int put_prelude(FastPathObject *f, PyObject *remote, PyObject *nid, PyObject *tag, PyObject *timeout,
                       remote_entry **ep, put_args *pa) {
    struct one_sided *o = f->os;
    if (o == NULL || o->peer_gone || o->released || !f->tx->has_buf || !timeout_plain(timeout))
        return 0;
    remote_entry *e = cache_slot(o, remote);
    if (e == NULL) {
        PyErr_Clear(); /* not a RemoteRegion: Python says what is wrong */
        return 0;
    }
    if (e->remote != remote)
        return 0;
    const uint8_t *slot = (const uint8_t *)o->peer_tbl.buf + (size_t)(e->rid & (TABLE_SLOTS - 1)) * SLOT_WORDS * 8;
    if (ld_acq(slot) != e->state) /* deregistered (or re-registered) since: Python looks again */
        return 0;
    pa->notify_id = 0;
    pa->tag = NULL;
    pa->tag_len = 0;
    if (nid != NULL) {
        if (!PyLong_CheckExact(nid))
            return 0;
        pa->notify_id = PyLong_AsUnsignedLongLong(nid);
        if (pa->notify_id == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
    }
    if (tag != NULL) {
        if (!PyBytes_CheckExact(tag) || PyBytes_GET_SIZE(tag) > MAX_TAG_NBYTES)
            return 0;
        pa->tag = PyBytes_AS_STRING(tag);
        pa->tag_len = PyBytes_GET_SIZE(tag);
    }
    if (ld_rlx(f->tx->hdr + OFF_CCLOSED))
        return 0;
    *ep = e;
    return 1;
}

/* Is there room for one record of `payload` bytes (and a pad before it)? Checked before a copy,
 * so the PUT_DONE after it never waits. */
static int ring_room(RingObject *tx, uint64_t payload) {
    if (payload > tx->max_payload)
        return 0;
    uint64_t need = REC_HDR + align16(payload);
    uint64_t pos = tx->head & tx->mask, contiguous = tx->size - pos;
    uint64_t total = need <= contiguous ? need : contiguous + need;
    if (tx->size - (tx->head - tx->tail_cache) < total) {
        tx->tail_cache = ld_acq(tx->hdr + OFF_TAIL);
        if (tx->size - (tx->head - tx->tail_cache) < total)
            return 0;
    }
    return 1;
}

/* The local region (registered here, shared) holding [p, p + n): its id and the offset of p in it. */
static int find_home(struct one_sided *o, const uint8_t *p, uint64_t n, uint32_t *rid, uint64_t *off) {
    for (int j = 0; j < REMOTE_CACHE; j++) {
        int i = (o->last_home + j) % REMOTE_CACHE; /* layers go in order: start after the last hit */
        uint32_t r = o->homes[i];
        if (r == 0)
            continue;
        const uint64_t *lt = (const uint64_t *)o->local_tbl.buf + LOCAL_WORDS * (size_t)(r & (TABLE_SLOTS - 1));
        uint64_t state = lt[0], nb = lt[1];
        const uint8_t *base = (const uint8_t *)(uintptr_t)lt[2];
        if ((state >> 32) != r || (state & 3) != 3) { /* deregistered since: forget it */
            o->homes[i] = 0;
            continue;
        }
        if (p >= base && n <= nb && (uint64_t)(p - base) <= nb - n) {
            o->last_home = i + 1;
            *rid = r;
            *off = (uint64_t)(p - base);
            return 1;
        }
    }
    return 0;
}

/* Streaming (non-temporal) copy for large deferred puts: the pieces go to memory without first
 * reading each destination line into the cache (what a plain memcpy does below glibc's own,
 * much larger, threshold). Which is faster depends on the host: on one (AVX-512) host, 32 KiB
 * pieces scattered over 16-128 MiB went ~4.7 GB/s with memcpy and 6.7 (SSE2) to 8 (AVX-512)
 * GB/s streamed; on a 2-core AMD EPYC VM (AVX2) the same copies went ~5 GB/s with memcpy and
 * 1.1-2.5 GB/s streamed. So by default (kind "auto") the target measures both on its own large
 * pulls and uses the faster (see pick_copy); set_stream_copy(kind) fixes one. The streaming body
 * is chosen at import by what the CPU has. */
#define STREAM_COPY_NBYTES (1u << 20) /* a record moving at least this much is streamed (or picked) */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
/* Each copies n bytes (a multiple of 64; d 64-aligned) four pages at a time, interleaved, the
 * way glibc's own large copy goes (measured: a few tenths of a GB/s over one page at a time). */
#define STREAM_PAGE 4096
#define STREAM_LOOP(ATTR, NAME, COPY64)                                                                            \
    ATTR static void NAME(uint8_t *d, const uint8_t *s, size_t n) {                                                \
        size_t i = 0;                                                                                              \
        for (; i + 4 * STREAM_PAGE <= n; i += 4 * STREAM_PAGE)                                                     \
            for (size_t j = 0; j < STREAM_PAGE; j += 64)                                                           \
                for (size_t k = 0; k < 4 * STREAM_PAGE; k += STREAM_PAGE)                                          \
                    COPY64(d + i + k + j, s + i + k + j);                                                          \
        for (; i < n; i += 64)                                                                                     \
            COPY64(d + i, s + i);                                                                                  \
    }
#define COPY64_SSE2(D, S)                                                                                          \
    do {                                                                                                           \
        __m128i a_ = _mm_loadu_si128((const __m128i *)(S)), b_ = _mm_loadu_si128((const __m128i *)((S) + 16));     \
        __m128i c_ = _mm_loadu_si128((const __m128i *)((S) + 32)), e_ = _mm_loadu_si128((const __m128i *)((S) + 48)); \
        _mm_stream_si128((__m128i *)(D), a_);                                                                      \
        _mm_stream_si128((__m128i *)((D) + 16), b_);                                                               \
        _mm_stream_si128((__m128i *)((D) + 32), c_);                                                               \
        _mm_stream_si128((__m128i *)((D) + 48), e_);                                                               \
    } while (0)
#define COPY64_AVX2(D, S)                                                                                          \
    do {                                                                                                           \
        __m256i a_ = _mm256_loadu_si256((const __m256i *)(S)), b_ = _mm256_loadu_si256((const __m256i *)((S) + 32)); \
        _mm256_stream_si256((__m256i *)(D), a_);                                                                   \
        _mm256_stream_si256((__m256i *)((D) + 32), b_);                                                            \
    } while (0)
#define COPY64_AVX512(D, S) _mm512_stream_si512((__m512i *)(D), _mm512_loadu_si512((const void *)(S)))
STREAM_LOOP(, stream_sse2, COPY64_SSE2)
STREAM_LOOP(__attribute__((target("avx2"))), stream_avx2, COPY64_AVX2)
STREAM_LOOP(__attribute__((target("avx512f"))), stream_avx512, COPY64_AVX512)
static void stream_memcpy(uint8_t *d, const uint8_t *s, size_t n) { memcpy(d, s, n); }
static void (*stream_body)(uint8_t *, const uint8_t *, size_t) = stream_sse2;
static const char *stream_kind = "sse2";
/* Select a kind ("avx512", "avx2", "sse2", "memcpy"; NULL: the best this CPU has). 0, or -1 when
 * the CPU lacks it. */
static int select_stream_copy(const char *kind) {
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f"), avx2 = __builtin_cpu_supports("avx2");
    if (kind == NULL)
        kind = avx512 ? "avx512" : avx2 ? "avx2" : "sse2";
    if (strcmp(kind, "avx512") == 0 && avx512)
        stream_body = stream_avx512, stream_kind = "avx512";
    else if (strcmp(kind, "avx2") == 0 && avx2)
        stream_body = stream_avx2, stream_kind = "avx2";
    else if (strcmp(kind, "sse2") == 0)
        stream_body = stream_sse2, stream_kind = "sse2";
    else if (strcmp(kind, "memcpy") == 0)
        stream_body = stream_memcpy, stream_kind = "memcpy";
    else
        return -1;
    return 0;
}
static void copy_streaming(void *dv, const void *sv, size_t n) {
    uint8_t *d = dv;
    const uint8_t *s = sv;
    if (n < 256) {
        memcpy(d, s, n);
        return;
    }
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    memcpy(d, s, head);
    size_t body = (n - head) & ~(size_t)63;
    stream_body(d + head, s + head, body);
    memcpy(d + head + body, s + head + body, n - head - body);
}
#else
static const char *stream_kind = "memcpy";
static int select_stream_copy(const char *kind) { return kind == NULL || strcmp(kind, "memcpy") == 0 ? 0 : -1; }
static void copy_streaming(void *d, const void *s, size_t n) { memcpy(d, s, n); }
#endif

static inline void store_fence(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_sfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/* Copy pieces into the mapped region; without the GIL when large. -1 with an exception set. */
static int copy_pieces(remote_entry *e, const uint8_t *src, const int64_t *so, const int64_t *dof, const int64_t *ln,
                       Py_ssize_t k, uint64_t single_off, uint64_t single_n, uint64_t total) {
    uint8_t *base = (uint8_t *)e->vbuf.buf;
    if (total < NOGIL_COPY_NBYTES) {
        if (so == NULL)
            memcpy(base + single_off, src, single_n);
        else
            for (Py_ssize_t i = 0; i < k; i++)
                memcpy(base + dof[i], src + so[i], (size_t)ln[i]);
    } else {
        /* Another thread may forget this entry while we copy: a second export of the view keeps
         * the mapping alive (the endpoint unmaps only views without exports). */
        Py_buffer hold;
        if (PyObject_GetBuffer(e->view, &hold, PyBUF_WRITABLE) < 0)
            return -1;
        uint8_t *b = (uint8_t *)hold.buf;
        Py_BEGIN_ALLOW_THREADS
        if (so == NULL)
            memcpy(b + single_off, src, single_n);
        else
            for (Py_ssize_t i = 0; i < k; i++)
                memcpy(b + dof[i], src + so[i], (size_t)ln[i]);
        Py_END_ALLOW_THREADS
        PyBuffer_Release(&hold);
    }
    if (total >= FENCE_COPY_NBYTES)
        store_fence();
    return 0;
}

/* Write one PUT_PULL record (room checked by the caller) and publish it. */
static void write_pull(RingObject *tx, uint32_t dst_rid, uint32_t src_rid, uint64_t src_base, const int64_t *so,
                       const int64_t *dof, const int64_t *ln, uint32_t k, const put_args *pa, uint64_t seq,
                       uint64_t span_off, uint64_t span_n) {
    uint64_t n = PULL_NBYTES + (uint64_t)pa->tag_len + (uint64_t)k * PIECE_NBYTES;
    uint64_t need = REC_HDR + align16(n);
    int64_t at = reserve(tx, need);
    uint8_t *p = tx->data + at;
    rec_hdr h = {(uint32_t)n, KIND_PUT_PULL, 0, 0};
    memcpy(p, &h, REC_HDR);
    p += REC_HDR;
    uint32_t tl = (uint32_t)pa->tag_len, flags = PULL_LAST, zero = 0;
    memcpy(p, &dst_rid, 4);
    memcpy(p + 4, &src_rid, 4);
    memcpy(p + 8, &k, 4);
    memcpy(p + 12, &tl, 4);
    memcpy(p + 16, &pa->notify_id, 8);
    memcpy(p + 24, &seq, 8);
    memcpy(p + 32, &span_off, 8);
    memcpy(p + 40, &span_n, 8);
    memcpy(p + 48, &flags, 4);
    memcpy(p + 52, &zero, 4);
    if (tl)
        memcpy(p + PULL_NBYTES, pa->tag, tl);
    uint8_t *q = p + PULL_NBYTES + tl;
    for (uint32_t i = 0; i < k; i++, q += PIECE_NBYTES) {
        uint64_t v[3] = {src_base + (uint64_t)so[i], (uint64_t)dof[i], (uint64_t)ln[i]};
        memcpy(q, v, PIECE_NBYTES);
    }
    tx->head += need;
    st_rel(tx->hdr + OFF_HEAD, tx->head);
}

/* Publish PUT_DONE; on a ring that changed under us (closed by another thread) let Python finish. */
static PyObject *publish_done(FastPathObject *f, uint32_t rid, uint64_t off, uint64_t n, const put_args *pa,
                              PyObject *tag_obj, PyObject *timeout, PyObject *result) {
    uint8_t done[DONE_NBYTES];
    uint32_t tl = (uint32_t)pa->tag_len;
    memcpy(done, &rid, 4);
    memcpy(done + 4, &tl, 4);
    memcpy(done + 8, &off, 8);
    memcpy(done + 16, &n, 8);
    memcpy(done + 24, &pa->notify_id, 8);
    int rc = f->tx->has_buf ? send_parts(f->tx, KIND_PUT_DONE, 0, done, DONE_NBYTES, pa->tag, (uint64_t)pa->tag_len)
                            : RELEASED;
    if (rc == SEND_OK) {
        Py_INCREF(result);
        return result;
    }
    PyObject *rec = PyBytes_FromStringAndSize((const char *)done, DONE_NBYTES);
    if (rec == NULL)
        return NULL;
    PyObject *argv[3] = {rec, tag_obj ? tag_obj : empty_bytes, timeout ? timeout : Py_None};
    PyObject *r = forward(f, f->os->finish_put, argv, 3, NULL);
    Py_DECREF(rec);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_INCREF(result);
    return result;
}

static PyObject *fp_put(FastPathObject *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static PyObject **names_p[4] = {&str_offset, &str_notify_id, &str_tag, &str_timeout_s};
    PyObject *names[4] = {*names_p[0], *names_p[1], *names_p[2], *names_p[3]};
    PyObject *kw[4];
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (f->os == NULL)
        goto slow;
    int check = peer_check_due(f);
    if (parse_kw("put", nargs, 2, args, kwnames, names, kw, 4) < 0)
        return NULL;
    remote_entry *e;
    put_args pa;
    if (!put_prelude(f, args[1], kw[1], kw[2], kw[3], &e, &pa) || e->view == NULL)
        goto slow;
    long long off = 0;
    if (kw[0] != NULL) {
        int overflow;
        if (!PyLong_CheckExact(kw[0]))
            goto slow;
        off = PyLong_AsLongLongAndOverflow(kw[0], &overflow);
        if (overflow)
            goto slow;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        goto slow;
    }
    uint64_t n = (uint64_t)b.len;
    if (off < 0 || n > e->nbytes || (uint64_t)off > e->nbytes - n) {
        PyBuffer_Release(&b);
        goto slow; /* Python raises RegistrationError */
    }
    if (!ring_room(f->tx, DONE_NBYTES + (uint64_t)pa.tag_len)) {
        PyBuffer_Release(&b);
        goto slow;
    }
    if (check) {
        int pc = put_peer_check(f, args[1], e, "put");
        if (pc != 0) {
            PyBuffer_Release(&b);
            if (pc < 0)
                return NULL;
            goto slow;
        }
    }
    uint32_t rid = e->rid;
    int rc = n ? copy_pieces(e, (const uint8_t *)b.buf, NULL, NULL, NULL, 0, (uint64_t)off, n, n) : 0;
    PyBuffer_Release(&b);
    if (rc < 0)
        return NULL;
    struct one_sided *o = f->os;
    o->puts++;
    o->put_bytes += n;
    o->zero_copy_puts++;
    return publish_done(f, rid, (uint64_t)off, n, &pa, kw[2], kw[3], Py_None);
slow:
    return forward(f, f->os ? f->os->slow_put : NULL, args, nargsf, kwnames);
}

/* A 1-D C-contiguous int64 buffer (NumPy int64 arrays, array('q')...). 0 when not one. */
static int i64_buffer(PyObject *obj, Py_buffer *b) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *fmt = b->format ? b->format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@')
        fmt++;
    if (b->itemsize != 8 || b->ndim > 1 || !((fmt[0] == 'q' || fmt[0] == 'l') && fmt[1] == 0)) {
        PyBuffer_Release(b);
        return 0;
    }
    return 1;
}

static PyObject *fp_put_many(FastPathObject *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static PyObject **names_p[4] = {&str_notify_id, &str_tag, &str_timeout_s, &str_defer};
    PyObject *names[4] = {*names_p[0], *names_p[1], *names_p[2], *names_p[3]};
    PyObject *kw[4];
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (f->os == NULL)
        goto slow;
    int check = peer_check_due(f);
    if (parse_kw("put_many", nargs, 5, args, kwnames, names, kw, 4) < 0)
        return NULL;
    int defer = kw[3] != NULL && PyObject_IsTrue(kw[3]);
    if (defer < 0)
        return NULL;
    remote_entry *e;
    put_args pa;
    if (!put_prelude(f, args[1], kw[0], kw[1], kw[2], &e, &pa))
        goto slow;
    Py_buffer b, bs, bd, bl;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        goto slow;
    }
    int got = 0;
    got += i64_buffer(args[2], &bs);
    if (got == 1)
        got += i64_buffer(args[3], &bd);
    if (got == 2)
        got += i64_buffer(args[4], &bl);
    if (got < 3) {
        if (got >= 2)
            PyBuffer_Release(&bd);
        if (got >= 1)
            PyBuffer_Release(&bs);
        PyBuffer_Release(&b);
        goto slow;
    }
    Py_ssize_t k = bs.len / 8;
    const int64_t *so = bs.buf, *dof = bd.buf, *ln = bl.buf;
    uint64_t slen = (uint64_t)b.len, rn = e->nbytes, total = 0, lo = UINT64_MAX, hi = 0;
    int ok = k > 0 && bd.len / 8 == k && bl.len / 8 == k;
    for (Py_ssize_t i = 0; ok && i < k; i++) {
        int64_t s = so[i], d = dof[i], n = ln[i];
        if (s < 0 || d < 0 || n < 0 || (uint64_t)n > slen || (uint64_t)s > slen - (uint64_t)n || (uint64_t)n > rn ||
            (uint64_t)d > rn - (uint64_t)n) {
            ok = 0;
            break;
        }
        total += (uint64_t)n;
        if ((uint64_t)d < lo)
            lo = (uint64_t)d;
        if ((uint64_t)d + (uint64_t)n > hi)
            hi = (uint64_t)d + (uint64_t)n;
    }
    if (ok && check) {
        int pc = put_peer_check(f, args[1], e, "put_many");
        if (pc != 0) {
            PyBuffer_Release(&bl);
            PyBuffer_Release(&bd);
            PyBuffer_Release(&bs);
            PyBuffer_Release(&b);
            if (pc < 0)
                return NULL;
            goto slow;
        }
    }
    uint32_t rid = e->rid, home_rid = 0;
    uint64_t home_off = 0;
    int rc = 0, pulled = 0;
    struct one_sided *o = f->os;
    if (ok && defer) {
        /* deferred: one PUT_PULL record naming the pieces; the target copies them out of home_rid.
         * Python posts what does not fit one record now (and a source it has not seen yet). */
        ok = 0;
        uint64_t payload = PULL_NBYTES + (uint64_t)pa.tag_len + (uint64_t)k * PIECE_NBYTES;
        if (find_home(o, (const uint8_t *)b.buf, slen, &home_rid, &home_off) && ring_room(f->tx, payload)) {
            write_pull(f->tx, rid, home_rid, home_off, so, dof, ln, (uint32_t)k, &pa, ++o->pull_seq, lo, hi - lo);
            o->deferred_puts++;
            ok = pulled = 1;
        }
    } else if (ok) {
        if (e->view != NULL && ring_room(f->tx, DONE_NBYTES + (uint64_t)pa.tag_len))
            rc = copy_pieces(e, (const uint8_t *)b.buf, so, dof, ln, k, 0, 0, total);
        else
            ok = 0;
    }
    PyBuffer_Release(&bl);
    PyBuffer_Release(&bd);
    PyBuffer_Release(&bs);
    PyBuffer_Release(&b);
    if (!ok)
        goto slow; /* Python says what is wrong, or does what C does not */
    if (rc < 0)
        return NULL;
    o->puts += (unsigned long long)k;
    o->put_bytes += total;
    o->gathered_puts++;
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL)
        return NULL;
    if (pulled)
        return one;
    o->zero_copy_puts += (unsigned long long)k;
    PyObject *r = publish_done(f, rid, lo, hi - lo, &pa, kw[1], kw[2], one);
    Py_DECREF(one);
    return r;
slow:
    return forward(f, f->os ? f->os->slow_put_many : NULL, args, nargsf, kwnames);
}

static PyObject *new_note(struct one_sided *o, uint32_t rid, uint64_t off, uint64_t n, uint64_t nid,
                          const uint8_t *tag, uint32_t tag_len) {
    PyTypeObject *tp = (PyTypeObject *)o->note_type;
    PyObject *note = tp->tp_new(tp, empty_tuple, NULL);
    if (note == NULL)
        return NULL;
    PyObject *vals[5];
    vals[0] = PyLong_FromUnsignedLong(rid);
    vals[1] = PyLong_FromUnsignedLongLong(off);
    vals[2] = PyLong_FromUnsignedLongLong(n);
    vals[3] = PyLong_FromUnsignedLongLong(nid);
    vals[4] = tag_len ? PyBytes_FromStringAndSize((const char *)tag, tag_len) : (Py_INCREF(empty_bytes), empty_bytes);
    PyObject *keys[5] = {str_region_id, str_offset, str_nbytes, str_notify_id, str_tag};
    int bad = 0;
    for (int i = 0; i < 5; i++) {
        if (vals[i] == NULL || (!bad && PyObject_GenericSetAttr(note, keys[i], vals[i]) < 0))
            bad = 1;
        Py_XDECREF(vals[i]);
    }
    if (bad) {
        Py_DECREF(note);
        return NULL;
    }
    return note;
}

/* The PUT_DONE record at the head of rx as a Notification, consumed; NULL without an error
 * when it does not name a region registered here (Python counts it). */
static PyObject *take_note(FastPathObject *f, const rec_hdr *h, uint64_t pos) {
    struct one_sided *o = f->os;
    RingObject *rx = f->rx;
    if (h->nbytes < DONE_NBYTES)
        return NULL;
    const uint8_t *p = rx->data + pos + REC_HDR;
    uint32_t rid, tag_len;
    uint64_t off, n, nid;
    memcpy(&rid, p, 4);
    memcpy(&tag_len, p + 4, 4);
    memcpy(&off, p + 8, 8);
    memcpy(&n, p + 16, 8);
    memcpy(&nid, p + 24, 8);
    if ((uint64_t)DONE_NBYTES + tag_len != h->nbytes)
        return NULL;
    const uint64_t *lt = (const uint64_t *)o->local_tbl.buf + LOCAL_WORDS * (size_t)(rid & (TABLE_SLOTS - 1));
    uint64_t state = lt[0], lim = lt[1];
    if ((state >> 32) != rid || !(state & REGION_ACTIVE) || n > lim || off > lim - n)
        return NULL;
    PyObject *note = new_note(o, rid, off, n, nid, p + DONE_NBYTES, tag_len);
    if (note == NULL)
        return NULL;
    rx->tail += REC_HDR + align16(h->nbytes);
    st_rel(rx->hdr + OFF_TAIL, rx->tail);
    return note;
}

static void memcpy_fn(void *d, const void *s, size_t n) { memcpy(d, s, n); }

/* Kind "auto" (the default): each record of a large pull is copied with glibc's memcpy or the
 * streaming copy, whichever has gone faster here, measured on the pulls themselves: each kind's
 * rate is its best ns/byte so far (a best, like the bench's floor: a copy slowed by a preemption
 * or a busy neighbour never counts against a kind; a rate allowed to drift up compared the kind in
 * use, slowed by a loaded moment, with the other's stale best, and flipped to the slower one). The
 * other kind is tried again every PICK_PROBE_EVERY-th large record (under 1 % of the bytes), so a
 * kind unlucky in its first samples gets its chance. The GIL is held across take_pull: one writer. */
#define PICK_PROBE_EVERY 128
#define PICK_FIRST 4
static int pick_auto = 1;
static double pick_ns_per_byte[2]; /* [0] memcpy, [1] streamed; 0: not measured yet */
static unsigned long long pick_records[2], pick_large;

/* 1: stream the next large record, 0: memcpy it. The first PICK_FIRST records of each kind
 * alternate (one unlucky first sample does not decide the next PICK_PROBE_EVERY records). */
static int pick_copy(void) {
    if (pick_records[0] < PICK_FIRST || pick_records[1] < PICK_FIRST)
        return pick_records[1] < pick_records[0];
    int best = pick_ns_per_byte[1] < pick_ns_per_byte[0];
    return (++pick_large % PICK_PROBE_EVERY == 0) ? !best : best;
}

static void pick_note(int streamed, uint64_t ns, uint64_t nbytes) {
    double r = (double)ns / (double)nbytes, *e = &pick_ns_per_byte[streamed];
    if (*e == 0.0 || r < *e)
        *e = r;
    pick_records[streamed]++;
}

/* A PUT_PULL record at the head of rx: copy its pieces out of the peer's mapped region into ours.
 * The GIL stays held for the copy: the destination is this process's own registered memory,
 * which another thread could otherwise deregister and free under it.
 * 2: the last record of its put, consumed, *note set; 1: an earlier record, consumed; 0: Python must
 * handle it (source not mapped here yet, or something to count as bad); -1: error. */
static int take_pull(FastPathObject *f, const rec_hdr *h, uint64_t pos, PyObject **note) {
    struct one_sided *o = f->os;
    RingObject *rx = f->rx;
    if (h->nbytes < PULL_NBYTES)
        return 0;
    const uint8_t *p = rx->data + pos + REC_HDR;
    uint32_t dst_rid, src_rid, k, tag_len, flags;
    uint64_t nid, seq, span_off, span_n;
    memcpy(&dst_rid, p, 4);
    memcpy(&src_rid, p + 4, 4);
    memcpy(&k, p + 8, 4);
    memcpy(&tag_len, p + 12, 4);
    memcpy(&nid, p + 16, 8);
    memcpy(&seq, p + 24, 8);
    memcpy(&span_off, p + 32, 8);
    memcpy(&span_n, p + 40, 8);
    memcpy(&flags, p + 48, 4);
    if (tag_len > MAX_TAG_NBYTES || k > h->nbytes / PIECE_NBYTES ||
        (uint64_t)PULL_NBYTES + tag_len + (uint64_t)k * PIECE_NBYTES != h->nbytes)
        return 0;
    const uint64_t *lt = (const uint64_t *)o->local_tbl.buf + LOCAL_WORDS * (size_t)(dst_rid & (TABLE_SLOTS - 1));
    uint64_t state = lt[0], lim = lt[1];
    uint8_t *dst = (uint8_t *)(uintptr_t)lt[2];
    if ((state >> 32) != dst_rid || !(state & REGION_ACTIVE))
        return 0;
    source_entry *se = &o->sources[src_rid % REMOTE_CACHE];
    const uint8_t *slot = (const uint8_t *)o->peer_tbl.buf + (size_t)(src_rid & (TABLE_SLOTS - 1)) * SLOT_WORDS * 8;
    if (se->view == NULL || se->rid != src_rid || ld_acq(slot) != se->state)
        return 0;
    const uint8_t *src = (const uint8_t *)se->vbuf.buf;
    uint64_t slen = (uint64_t)se->vbuf.len, total = 0;
    const uint8_t *pieces = p + PULL_NBYTES + tag_len;
    for (uint32_t i = 0; i < k; i++) {
        uint64_t q[3];
        memcpy(q, pieces + (size_t)i * PIECE_NBYTES, PIECE_NBYTES);
        if (q[2] > slen || q[0] > slen - q[2] || q[2] > lim || q[1] > lim - q[2])
            return 0;
        total += q[2];
    }
    if ((flags & PULL_LAST) && (span_n > lim || span_off > lim - span_n))
        return 0;
    void (*copy)(void *, const void *, size_t) = memcpy_fn;
    int streamed = -1; /* >= 0: a large record copied by "auto", timed for pick_note */
    if (total >= STREAM_COPY_NBYTES) {
        if (!pick_auto)
            copy = copy_streaming;
        else if ((streamed = pick_copy()) != 0)
            copy = copy_streaming;
    }
    uint64_t t0 = streamed >= 0 ? mono_ns() : 0;
    for (uint32_t i = 0; i < k; i++) {
        uint64_t q[3];
        memcpy(q, pieces + (size_t)i * PIECE_NBYTES, PIECE_NBYTES);
        copy(dst + q[1], src + q[0], (size_t)q[2]);
    }
    if (streamed > 0)
        store_fence(); /* part of the streamed copy's cost (the memcpy side pays none) */
    if (streamed >= 0)
        pick_note(streamed, mono_ns() - t0, total);
    o->pulled_bytes += total;
    if (flags & PULL_LAST) {
        *note = new_note(o, dst_rid, span_off, span_n, nid, p + PULL_NBYTES, tag_len);
        if (*note == NULL)
            return -1;
    }
    rx->tail += REC_HDR + align16(h->nbytes);
    st_rel(rx->hdr + OFF_TAIL, rx->tail);
    if (flags & PULL_LAST) {
        if (total >= FENCE_COPY_NBYTES)
            store_fence();
        st_rel(rx->hdr + OFF_PULLED, seq); /* the initiator may reuse its source from here on */
        return 2;
    }
    return 1;
}

static PyObject *note_impl(FastPathObject *f, PyObject *const *args, size_t nargsf, PyObject *kwnames, int nowait) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    struct one_sided *o = f->os;
    if (o == NULL || o->released)
        goto slow;
    PyObject *names[1] = {str_timeout_s};
    PyObject *kw[1] = {NULL};
    if (parse_kw(nowait ? "poll_notification_nowait" : "wait_notification", nargs, 0, args, kwnames, names, kw,
                 nowait ? 0 : 1) < 0)
        return NULL;
    RingObject *rx = f->rx;
    if (!rx->has_buf || !timeout_plain(kw[0]))
        goto slow;
    Py_ssize_t queued = PyObject_Size(o->notes);
    if (queued != 0) {
        if (queued < 0)
            return NULL;
        goto slow;
    }
    for (;;) {
        rec_hdr h;
        uint64_t pos;
        int st = spin_for_record(rx, &h, &pos, nowait ? 0 : f->spin_iters);
        if (st <= 0 || !rx->has_buf || f->os == NULL || f->os->released)
            break;
        if (h.kind == KIND_PUT_DONE) {
            PyObject *note = take_note(f, &h, pos);
            if (note != NULL)
                o->notifications++; /* delivered here; pull_head's go through Python's queue and count there */
            if (note != NULL || PyErr_Occurred())
                return note;
            break;
        }
        if (h.kind != KIND_PUT_PULL)
            break;
        PyObject *note = NULL;
        int r = take_pull(f, &h, pos, &note);
        if (r < 0)
            return NULL;
        if (r == 2) {
            o->notifications++;
            return note;
        }
        if (r == 0)
            break;
    }
slow:
    return forward(f, f->os == NULL ? NULL : nowait ? f->os->slow_poll : f->os->slow_wait, args, nargsf, kwnames);
}

/* pull_head() -> the Notification when the PUT_PULL record at the head of rx was a put's last
 * and has been carried out here, True for an earlier record carried out, None when Python must
 * handle it (anything C does not: see take_pull). For the endpoint's Python receive path, which
 * meets these records while it looks for a message. */
static PyObject *fp_pull_head(FastPathObject *f, PyObject *Py_UNUSED(ignored)) {
    struct one_sided *o = f->os;
    RingObject *rx = f->rx;
    if (o == NULL || o->released || !rx->has_buf)
        Py_RETURN_NONE;
    rec_hdr h;
    uint64_t pos;
    if (head_record(rx, &h, &pos) != 1 || h.kind != KIND_PUT_PULL)
        Py_RETURN_NONE;
    PyObject *note = NULL;
    int r = take_pull(f, &h, pos, &note);
    if (r < 0)
        return NULL;
    if (r == 2)
        return note;
    if (r == 1)
        Py_RETURN_TRUE;
    Py_RETURN_NONE;
}

static PyObject *fp_wait_notification(FastPathObject *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return note_impl(f, args, nargsf, kwnames, 0);
}
static PyObject *fp_poll_notification_nowait(FastPathObject *f, PyObject *const *args, size_t nargsf,
                                             PyObject *kwnames) {
    return note_impl(f, args, nargsf, kwnames, 1);
}

/* counters() -> (puts, put_bytes, zero_copy_puts, gathered_puts, notifications, pulled_bytes, deferred_puts) */
static PyObject *fp_counters(FastPathObject *f, PyObject *Py_UNUSED(ignored)) {
    struct one_sided *o = f->os;
    if (o == NULL)
        return Py_BuildValue("(KKKKKKK)", 0ULL, 0ULL, 0ULL, 0ULL, 0ULL, 0ULL, 0ULL);
    return Py_BuildValue("(KKKKKKK)", o->puts, o->put_bytes, o->zero_copy_puts, o->gathered_puts, o->notifications,
                         o->pulled_bytes, o->deferred_puts);
}

static PyObject *fp_get_pull_seq(FastPathObject *f, void *Py_UNUSED(c)) {
    return PyLong_FromUnsignedLongLong(f->os == NULL ? 0 : f->os->pull_seq);
}
static int fp_set_pull_seq(FastPathObject *f, PyObject *v, void *Py_UNUSED(c)) {
    unsigned long long x = v == NULL ? (unsigned long long)-1 : PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && (v == NULL || PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "pull_seq cannot be deleted");
        return -1;
    }
    if (f->os != NULL)
        f->os->pull_seq = x;
    return 0;
}

static PyObject *fp_get_peer_gone(FastPathObject *f, void *Py_UNUSED(c)) {
    return PyBool_FromLong(f->os != NULL && f->os->peer_gone);
}
static int fp_set_peer_gone(FastPathObject *f, PyObject *v, void *Py_UNUSED(c)) {
    int t = setter_bool(v, "peer_gone");
    if (t < 0)
        return -1;
    if (f->os != NULL)
        f->os->peer_gone = t;
    return 0;
}

/* make_note(type, region_id, offset, nbytes, notify_id, tag): a Notification built the way the
 * fast path builds them (the endpoint checks once that it equals one made by the constructor). */
static PyObject *mod_make_note(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *tp, *vals[5];
    if (!PyArg_ParseTuple(args, "OOOOOO:make_note", &tp, &vals[0], &vals[1], &vals[2], &vals[3], &vals[4]))
        return NULL;
    if (!PyType_Check(tp)) {
        PyErr_SetString(PyExc_TypeError, "make_note needs a type");
        return NULL;
    }
    PyObject *note = ((PyTypeObject *)tp)->tp_new((PyTypeObject *)tp, empty_tuple, NULL);
    if (note == NULL)
        return NULL;
    PyObject *keys[5] = {str_region_id, str_offset, str_nbytes, str_notify_id, str_tag};
    for (int i = 0; i < 5; i++)
        if (PyObject_GenericSetAttr(note, keys[i], vals[i]) < 0) {
            Py_DECREF(note);
            return NULL;
        }
    return note;
}

/* set_stream_copy(kind=None) -> the kind in use before: how large deferred puts are copied.
 * None or "auto": the faster of memcpy and the CPU's best streaming copy, measured as pulls go
 * (the streaming body stays the best this CPU has; setting it starts the measurement over); a
 * named kind: always that one. */
static PyObject *mod_set_stream_copy(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    const char *kind = NULL;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "set_stream_copy(kind=None) takes at most one argument");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        kind = PyUnicode_AsUTF8(args[0]);
        if (kind == NULL)
            return NULL;
    }
    const char *old = pick_auto ? "auto" : stream_kind;
    int is_auto = kind == NULL || strcmp(kind, "auto") == 0;
    if (select_stream_copy(is_auto ? NULL : kind) < 0) {
        PyErr_Format(PyExc_ValueError, "stream copy %R is not available on this CPU (kinds: auto, avx512, avx2, "
                     "sse2, memcpy)", args[0]);
        return NULL;
    }
    pick_auto = is_auto;
    if (is_auto) { /* "auto" starts its measurement over: both kinds are tried again from the next pull */
        pick_ns_per_byte[0] = pick_ns_per_byte[1] = 0.0;
        pick_records[0] = pick_records[1] = 0;
        pick_large = 0;
    }
    return PyUnicode_FromString(old);
}

/* pull_copy() -> (kind, memcpy GB/s, streamed GB/s, memcpy records, streamed records): how large
 * deferred puts are copied here ("auto" or the fixed kind) and, under "auto", the best rate each
 * copy has shown on them (None before its first large record). */
static PyObject *mod_pull_copy(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    PyObject *rate[2];
    for (int i = 0; i < 2; i++) {
        if (pick_ns_per_byte[i] > 0.0)
            rate[i] = PyFloat_FromDouble(1.0 / pick_ns_per_byte[i]);
        else {
            Py_INCREF(Py_None);
            rate[i] = Py_None;
        }
    }
    return Py_BuildValue("(sNNKK)", pick_auto ? "auto" : stream_kind, rate[0], rate[1], pick_records[0],
                         pick_records[1]);
}

