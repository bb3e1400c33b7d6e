/* qlink.qec._hotcore: the service core's state, its datagram shot records, its answers and its decoder calls.
 * (part of the one translation unit _hotcore.c, which includes it: not compiled on its own) */

/* ================================================================== service core */

/* faults and counts, reported by name */
enum {
    C_REQUESTS, C_ENQUEUE, C_GET, C_RESET, C_SHOTS_COMPLETED, C_SHOTS_DECODED, C_DECODE_CALLS, C_ANSWERS,
    C_NOT_READY, C_SHOTS_DROPPED, C_FRAMES_LOST, C_FRAMES_DISCARDED, C_SHOTS_REFUSED_BUSY, C_DECODER_FAILED,
    C_F_SHORT_FRAME, C_F_BAD_MAGIC, C_F_LENGTH, C_F_UNKNOWN_FUNCTION, C_F_DECODER_NOT_CONFIGURED,
    C_F_DECODER_ID, C_F_MAPPING_ID, C_F_SYNDROME_COUNT, C_F_COUNTER_BACKWARDS, C_F_COUNTER_GAP, C_F_RETURN_SIZE,
    C_F_ANSWER_BLOCKED, C_F_LAYOUT_MISMATCH, C_SLOW_PATH, C_REPLAYED, C_WINDOWS, C_SHOTS_REPAIRED,
    C_REPAIR_FRAMES, C_FRAMES_REPEATED, C_ADDRESSED_GETS, C_ANSWERS_WITHHELD, C_FRAMES_PACKED, C_N
};
static const char *count_names[C_N] = {
    "requests", "enqueue", "get_corrections", "reset_decoder", "shots_completed", "shots_decoded", "decode_calls",
    "answers", "not_ready", "shots_dropped", "frames_lost", "frames_discarded", "shots_refused_busy",
    "decoder_failed", "fault.short_frame", "fault.bad_magic", "fault.length", "fault.unknown_function",
    "fault.decoder_not_configured", "fault.decoder_id", "fault.syndrome_mapping_id", "fault.syndrome_count",
    "fault.counter_backwards", "fault.counter_gap", "fault.return_size", "fault.answer_blocked",
    "fault.layout_mismatch", "slow_path_frames", "get_corrections_replayed", "windows_decoded", "shots_repaired",
    "repair_frames", "frames_repeated", "addressed_gets", "answers_withheld", "frames_packed",
};

#define CALL_FIRED 0  /* fn(indices of the fired detectors, uint64) -> observable flips, one byte each */
#define CALL_PACKED 1 /* fn(bit_packed_detection_event_data=(1, nbd) uint8) -> (1, nbo) packed flips */

#define SVC_FIELDS 11 /* qlink.qec.timeline.SERVICE_SHOT_FIELDS */

/* Sliding-window decoding with commit (qlink.qec.decoders.SlidingWindowDecoder, fed as the
 * rounds land): a shot is one long experiment; each window is matched the moment its last
 * round lands (one call of its compiled matcher on the fired detectors), the edges of its
 * commit region are committed (observables into the shot's correction, detectors they flip
 * into the buffer), and the buffer slides by the commit region. */
#define WIN_MAX_COMPILED 32
typedef struct {
    PyObject *fn, *views; /* the matcher's call on fired indices; views of idx of lengths 0..n */
    uint64_t *idx;
    int64_t n, ncommit, k; /* detectors matched, detectors committed, committed edges (fault ids) */
    const uint64_t *obsmask; /* k: observables each committed edge flips */
    const int64_t *fptr, *ftgt; /* k + 1, and: the detectors (relative to the window) each flips */
} WinCompiled;

typedef struct {
    PyObject *keep; /* the plan tuple: holds every array borrowed below */
    const int64_t *rptr; /* R + 1 */
    const uint8_t *wid;  /* the compiled window of each window, in order */
    int64_t R, nwin, W, C, cap;
    WinCompiled cw[WIN_MAX_COMPILED];
    int ncw;
    uint8_t *buf; /* cap detectors, one byte each */
    int64_t t, pushed, filled, widx, t0, t1;
    uint64_t obs;
    int failed;
} WinState;

typedef struct {
    int configured;
    int64_t num_det, num_obs, nbd, nbo;
    int64_t frames_per_shot; /* F: frames of one shot (0: unknown, a gap then drops the shot in progress) */
    int call_kind;
    PyObject *fn;
    PyObject *views;   /* CALL_FIRED: tuple of num_det + 1 uint64 views of lengths 0..num_det */
    uint64_t *idx;     /* their memory */
    PyObject *row;     /* CALL_PACKED: the (1, nbd) uint8 array passed */
    uint8_t *row_data;
    uint8_t *shot;     /* the shot being filled, nbd bytes (+8 slack) */
    int64_t filled, pos;
    int filling;
    int64_t next_counter;
    int has_counter;
    int64_t discard;       /* frames of a shot already dropped still to come */
    int64_t pending_drops; /* dropped shots before the next completed one */
    /* completed shots [head, tail), ring of cap */
    int64_t cap;
    uint8_t *obs;        /* cap * nbo packed flips */
    int8_t *failed;      /* cap: the decoder failed on it */
    int64_t *drops_before;
    int64_t *rec;        /* cap * SVC_FIELDS: the shot's service timestamps until answered */
    uint64_t head, tail;
    uint64_t decoded;    /* shots [head, decoded) decoded, [decoded, tail) waiting for the decoder */
    PyObject *batch_fn;  /* fn(rows (k, nbd) uint8) -> (k, nbo) packed flips (or a tuple, first item) */
    PyObject *pend;      /* (cap, nbd) uint8: the waiting shots' bits, at their ring slots */
    uint8_t *pend_data;
    /* the frame that completed the current shot */
    int64_t last_rid, last_ptp;
    WinState *win; /* sliding windows (a long experiment), or NULL */
    /* datagram links (see ShotRec): each queued shot's key, the record of the shots answered or
     * dropped, and the shot being repaired from frames sent again */
    int64_t *key;      /* cap: the counter of the frame that completed the shot at each queue slot */
    int64_t cur_key;   /* the counter of the frame being handled */
    struct ShotRec *tab; /* TAB_N, or NULL (not a datagram link) */
    uint8_t *rep;      /* nbd + 8 bytes: the shot being repaired */
    int64_t rep_key, rep_next, rep_filled;
    int rep_active;
    /* measurement-level shots (CUDA-Q's D_sparse): the shot's bits are measurements, mapped
     * to the decoder's detectors before the call by XOR of table rows (row 256 j + v: what
     * byte j of the record holding value v contributes) */
    PyObject *map;            /* the (nbd * 256, map_words) uint64 table, or NULL */
    const uint64_t *map_rows; /* (its memory, kept alive by map) */
    int64_t map_words, map_num_det, map_nbd;
    uint64_t *mapped;         /* map_words: one shot's detectors */
} SvcDecoder;

#define DEFER_MIN 256 /* gets held back at least; as many as max_batch above that */
#define DEFER_MAX_CAP 65536
typedef struct {
    int did;
    int consume;
    int64_t rs;
    uint32_t rid;
    int64_t ptp;
} DeferredGet;

/* Over datagrams (a lossy link) the answer of every consuming get (NOT_READY included) is
 * kept a while, at the slot of its request_id: the very same request again (its request_id
 * and ptp_timestamp: the controller asks again when no answer came) gets the same answer
 * once more and consumes nothing, so asking again never consumes a second shot. */
#define KEEP_N 16384 /* (request ids go up one by one: a slot is reused 16,384 asks later) */
#define KEEP_BYTES 64
typedef struct {
    int did, used;
    int32_t status;
    uint32_t rid, nres;
    int64_t ptp;
    uint8_t res[KEEP_BYTES];
} KeptAnswer;

/* Over datagrams a consuming get whose request id has both top bits set (ADDR_BITS) names the
 * shot it asks for: its low 30 bits are the counter of the shot's last frame (mod 2**30). Such a
 * get is answered from the shot it names, whatever came or was lost before it, and may be
 * asked any number of times: a shot once answered keeps its record (TAB_N of them, by shot).
 * A shot lost to a counter gap is recorded as dropped; its frames sent again (their counters
 * behind the stream's) are put together aside and the shot decoded: a repair. */
#define ADDR_BITS 0xC0000000u
#define ADDR_MASK 0x3FFFFFFFu
#define TAB_N 16384 /* (80 B each: 1.3 MB a decoder on a datagram link; 0.46 s of shots at a 4 us cycle, d = 5 --
                    * a get asked again after its 50 ms timeout, and queued behind a backlog, still finds
                    * its shot; with 4,096 a service 60 ms behind answered such gets "dropped") */
#define REC_FINAL 1   /* answered (OK or INTERNAL_ERROR): its answer kept */
#define REC_DROPPED 2 /* lost to a counter gap (or refused BUSY): repairable */
typedef struct ShotRec {
    int64_t key;
    int32_t status;
    int32_t state;
    uint8_t obs[KEEP_BYTES];
} ShotRec;

typedef struct {
    PyObject_HEAD
    Io io;
    KeptAnswer *kept; /* KEEP_N, datagram links only */
    uint64_t n_kept;
    int ack; /* 0 none, 1 errors, 2 all */
    DeferredGet *defer; /* defer_cap: the gets held back while their shots wait for the decoder */
    int n_defer, defer_cap;
    int defer_first; /* [defer_first, n_defer) still held (a pipelined run answers from the front) */
    int ndec;
    SvcDecoder dec[64];
    uint64_t counts[C_N];
    Py_buffer rows;
    int has_rows;
    int64_t nrows, row_n, rows_dropped;
    int64_t t_ready; /* the service back at receiving, its earlier work done */
    PyObject *kw_packed; /* ("bit_packed_detection_event_data",) */
    PyObject *first_error; /* str: the first decoder failure */
    int64_t answer_block_ns;
    int64_t pending;   /* shots waiting for the decoder, all decoders */
    int64_t max_batch; /* decode once this many wait, even with frames still queued */
    /* one of several sessions (serve_sessions): when it last had a frame, whether its last turn
     * took all it was given (it sends faster than it is served: more may wait), whether its
     * link was found empty since its last frame, and the counts its last turn started from */
    int64_t last_active_ns;
    int heavy, again, was_empty;
    uint64_t oversized_seen, blocked_seen;
    /* a datagram sender most of whose frames were malformed (its address may be forged) gets
     * at most ration_per_s answers a second (0: no ration); the rest are counted, not sent */
    int64_t ration_per_s, ration_since_ns, ration_n;
    /* a pipelined run (_hotcore_pipe.h): frames taken in by a thread of their own on CPU
     * ingest_cpu (-1: no such thread) while this thread only decodes */
    int ingest_cpu;
    int piped;                     /* a pipelined run is on */
    int pipe_pause, pipe_paused;   /* the ingest thread asks the decoding thread to stand still */
    int pipe_done, pipe_code;      /* the ingest thread ended (with svc_run's code) */
    uint64_t piped_runs, pipe_waits;
    int64_t pipe_idle_ns;
    long long pipe_max_frames;
} ServiceCore;

/* 1 in the ingest thread of a pipelined run: it never calls into Python, it waits for the
 * decoding thread where a single-threaded service would decode, and it gives its CPU away
 * while it waits (it shares that CPU with others). */
static _Thread_local int tl_ingest;
static inline uint64_t ld_acq64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void st_rel64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline int ld_acq_int(const int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void st_rel_int(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* The ingest thread has the decoding thread stand still (between two decoder calls) while
 * it changes a decoder's queue under it (a reset), then lets it go on. */
static void pipe_hold(ServiceCore *s) {
    st_rel_int(&s->pipe_pause, 1);
    while (!ld_acq_int(&s->pipe_paused))
        sched_yield();
}
static void pipe_go_on(ServiceCore *s) {
    st_rel_int(&s->pipe_pause, 0);
    while (ld_acq_int(&s->pipe_paused))
        sched_yield();
}
static int svc_settle_ready(ServiceCore *s);

/* Whether a shot's stamps can still reach a row (the rows given and not full). The stamps are
 * read only then: a clock read costs ~30 ns, about a fifth of what a d=5 shot costs the service
 * beyond its decode when the loop runs flat out, and past the kept rows nothing reads them. */
static inline int svc_rows_open(const ServiceCore *s) { return s->has_rows && s->row_n < s->nrows; }

static void win_free(WinState *w) {
    if (w == NULL)
        return;
    Py_CLEAR(w->keep);
    PyMem_Free(w->buf);
    PyMem_Free(w);
}

static void win_reset(WinState *w) {
    memset(w->buf, 0, (size_t)w->cap);
    w->t = w->pushed = w->filled = w->widx = 0;
    w->obs = 0;
    w->failed = 0;
}

static int borrow(PyObject *obj, Py_ssize_t itemsize, Py_ssize_t min_items, const void **out, const char *name) {
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    Py_ssize_t len = b.len;
    *out = b.buf;
    PyBuffer_Release(&b); /* (the plan tuple keeps the array alive) */
    if (len < itemsize * min_items) {
        PyErr_Format(PyExc_ValueError, "window plan: %s holds %zd bytes, needs %zd", name, len, itemsize * min_items);
        return -1;
    }
    return 0;
}

/* plan: (round_ptr int64 (R+1), window ids uint8 (nwin), W, C, buffer detectors,
 *        ((fn, views, idx, n, ncommit, k, obsmask uint64 (k), flip_ptr int64 (k+1), flip_targets int64), ...)) */
static WinState *win_new(PyObject *plan, int64_t num_det, int64_t num_obs) {
    PyObject *rptr, *wid, *cws;
    long long W, C, cap;
    if (!PyArg_ParseTuple(plan, "OOLLLO!", &rptr, &wid, &W, &C, &cap, &PyTuple_Type, &cws))
        return NULL;
    if (num_obs > 64) {
        PyErr_SetString(PyExc_ValueError, "window plan: at most 64 observables");
        return NULL;
    }
    WinState *w = PyMem_Calloc(1, sizeof(WinState));
    if (w == NULL)
        return (WinState *)PyErr_NoMemory();
    Py_INCREF(plan);
    w->keep = plan;
    Py_buffer b;
    if (PyObject_GetBuffer(rptr, &b, PyBUF_C_CONTIGUOUS) < 0)
        goto fail;
    w->rptr = b.buf;
    w->R = b.len / 8 - 1;
    PyBuffer_Release(&b);
    if (PyObject_GetBuffer(wid, &b, PyBUF_C_CONTIGUOUS) < 0)
        goto fail;
    w->wid = b.buf;
    w->nwin = b.len;
    PyBuffer_Release(&b);
    w->W = W;
    w->C = C;
    w->cap = cap;
    if (w->R < 1 || W < 1 || C < 1 || C > W || cap < 1 || w->rptr[w->R] != num_det) {
        PyErr_Format(PyExc_ValueError, "window plan: bad shape (rounds %lld, W %lld, C %lld, buffer %lld; its "
                     "detectors %lld, the decoder's %lld)", (long long)w->R, W, C, cap, (long long)w->rptr[w->R],
                     (long long)num_det);
        goto fail;
    }
    w->ncw = (int)PyTuple_GET_SIZE(cws);
    if (w->ncw > WIN_MAX_COMPILED) {
        PyErr_SetString(PyExc_ValueError, "window plan: too many compiled windows");
        goto fail;
    }
    for (int64_t i = 0; i < w->nwin; i++)
        if (w->wid[i] >= w->ncw) {
            PyErr_SetString(PyExc_ValueError, "window plan: a window names no compiled window");
            goto fail;
        }
    for (int i = 0; i < w->ncw; i++) {
        WinCompiled *c = &w->cw[i];
        PyObject *om, *fp, *ft, *idx;
        long long n, nc, k;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(cws, i), "OOOLLLOOO", &c->fn, &c->views, &idx, &n, &nc, &k, &om, &fp,
                              &ft))
            goto fail;
        c->n = n;
        c->ncommit = nc;
        c->k = k;
        if (n < 0 || n > cap || nc < 0 || nc > n || k < 0 || (k > 0 && (!PyCallable_Check(c->fn) ||
            !PyTuple_Check(c->views) || PyTuple_GET_SIZE(c->views) != n + 1))) {
            PyErr_SetString(PyExc_ValueError, "window plan: a compiled window has a bad shape");
            goto fail;
        }
        if (k > 0 && (borrow(idx, 8, n, (const void **)&c->idx, "idx") ||
                      borrow(om, 8, k, (const void **)&c->obsmask, "obsmask") ||
                      borrow(fp, 8, k + 1, (const void **)&c->fptr, "flip_ptr") ||
                      borrow(ft, 8, c->fptr[k], (const void **)&c->ftgt, "flip_targets")))
            goto fail;
        for (int64_t q = 0; k > 0 && q < c->fptr[k]; q++)
            if (c->ftgt[q] < 0 || c->ftgt[q] >= cap) {
                PyErr_SetString(PyExc_ValueError, "window plan: a committed edge flips a detector past the buffer");
                goto fail;
            }
    }
    w->buf = PyMem_Calloc((size_t)cap + 8, 1);
    if (w->buf == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    win_reset(w);
    return w;
fail:
    win_free(w);
    return NULL;
}

static void dec_free(SvcDecoder *d) {
    win_free(d->win);
    d->win = NULL;
    Py_CLEAR(d->fn);
    Py_CLEAR(d->views);
    Py_CLEAR(d->row);
    Py_CLEAR(d->batch_fn);
    Py_CLEAR(d->pend);
    Py_CLEAR(d->map);
    PyMem_Free(d->mapped);
    PyMem_Free(d->shot); /* (idx and row_data borrow the arrays' memory) */
    PyMem_Free(d->obs);
    PyMem_Free(d->failed);
    PyMem_Free(d->drops_before);
    PyMem_Free(d->rec);
    PyMem_Free(d->key);
    PyMem_Free(d->tab);
    PyMem_Free(d->rep);
    memset(d, 0, sizeof(*d));
}

static void dec_reset(SvcDecoder *d) {
    if (d->win)
        win_reset(d->win);
    d->filled = d->pos = 0;
    d->filling = 0;
    d->has_counter = 0;
    d->next_counter = 0;
    d->discard = 0;
    d->pending_drops = 0;
    d->head = d->tail = d->decoded = 0;
    if (d->tab)
        memset(d->tab, 0, TAB_N * sizeof(ShotRec));
    d->rep_active = 0;
}

/* ----- datagram links: shot records */

static inline ShotRec *tab_slot(SvcDecoder *d, int64_t key) {
    uint64_t F = d->frames_per_shot > 0 ? (uint64_t)d->frames_per_shot : 1;
    return &d->tab[((uint64_t)key / F) % TAB_N];
}

/* the record of the shot whose last frame has counter `key`, or NULL */
static inline ShotRec *tab_get(SvcDecoder *d, int64_t key) {
    if (d->tab == NULL)
        return NULL;
    ShotRec *r = tab_slot(d, key);
    return r->state && r->key == key ? r : NULL;
}

static void tab_put(SvcDecoder *d, int64_t key, int state, int32_t status, const uint8_t *obs) {
    if (d->tab == NULL)
        return;
    ShotRec *r = tab_slot(d, key);
    r->key = key;
    r->state = state;
    r->status = status;
    if (obs)
        memcpy(r->obs, obs, (size_t)d->nbo);
    else
        memset(r->obs, 0, sizeof(r->obs));
}

static int svc_traverse(ServiceCore *s, visitproc visit, void *arg) {
    Py_VISIT(s->io.rx);
    Py_VISIT(s->io.tx);
    for (int i = 0; i < 64; i++) {
        Py_VISIT(s->dec[i].fn);
        Py_VISIT(s->dec[i].views);
        Py_VISIT(s->dec[i].row);
        Py_VISIT(s->dec[i].batch_fn);
        Py_VISIT(s->dec[i].pend);
    }
    return 0;
}

static int svc_clear(ServiceCore *s) {
    io_free(&s->io);
    for (int i = 0; i < 64; i++)
        dec_free(&s->dec[i]);
    if (s->has_rows) {
        PyBuffer_Release(&s->rows);
        s->has_rows = 0;
    }
    Py_CLEAR(s->kw_packed);
    Py_CLEAR(s->first_error);
    PyMem_Free(s->kept);
    s->kept = NULL;
    PyMem_Free(s->defer);
    s->defer = NULL;
    s->n_defer = s->defer_cap = s->defer_first = 0;
    return 0;
}

static void svc_dealloc(ServiceCore *s) {
    PyObject_GC_UnTrack(s);
    svc_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* A measurement-level decoder's map: (table, num_detectors) with table a C-contiguous
 * (nbd * 256, ceil(num_detectors / 64)) uint64 array (nbd: the measurement record's bytes). */
static int dec_set_map(SvcDecoder *d, PyObject *dmap) {
    PyObject *table;
    long long ndet;
    if (!PyArg_ParseTuple(dmap, "OL", &table, &ndet))
        return -1;
    int64_t words = (ndet + 63) / 64;
    Py_buffer b;
    if (ndet < 1 || ndet > W.max_bits || PyObject_GetBuffer(table, &b, PyBUF_C_CONTIGUOUS) < 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "measurement map: %lld detectors is out of range 1..%lld", ndet,
                         (long long)W.max_bits);
        return -1;
    }
    Py_ssize_t want = (Py_ssize_t)(d->nbd * 256 * words * 8);
    if (b.len != want) {
        PyBuffer_Release(&b);
        PyErr_Format(PyExc_ValueError, "measurement map: the table has %zd bytes, %zd expected "
                     "(%lld record bytes x 256 rows x %lld words)", b.len, want, (long long)d->nbd, (long long)words);
        return -1;
    }
    d->map_rows = (const uint64_t *)b.buf; /* borrowed: d->map holds the array */
    PyBuffer_Release(&b);
    d->mapped = PyMem_Calloc((size_t)words, 8);
    if (d->mapped == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(table);
    d->map = table;
    d->map_words = words;
    d->map_num_det = ndet;
    d->map_nbd = (ndet + 7) / 8;
    return 0;
}

/* decoders: a sequence of (decoder_id, num_detectors, num_observables, fn, call_kind,
 * frames_per_shot, capacity_shots, index_array_or_None, row_array_or_None, views_or_None
 * [, batch_fn, pending_rows, window_plan, measurement_map]); with a measurement map,
 * num_detectors is the record's measurements and fn's index array, views and row are
 * sized for the map's detectors. */
static int svc_add_decoder(ServiceCore *s, PyObject *t) {
    long long id, nd, no, kind, fps, cap;
    PyObject *fn, *idx_arr, *row_arr, *views, *batch_fn = Py_None, *pend = Py_None, *plan = Py_None, *dmap = Py_None;
    if (!PyArg_ParseTuple(t, "LLLOLLLOOO|OOOO", &id, &nd, &no, &fn, &kind, &fps, &cap, &idx_arr, &row_arr, &views,
                          &batch_fn, &pend, &plan, &dmap))
        return -1;
    if (id < 0 || id >= W.max_decoders || id >= 64) {
        PyErr_Format(PyExc_ValueError, "decoder_id %lld is out of range 0..%d", id, W.max_decoders - 1);
        return -1;
    }
    SvcDecoder *d = &s->dec[id];
    if (d->configured) {
        PyErr_Format(PyExc_ValueError, "decoder_id %lld is configured twice", id);
        return -1;
    }
    if (nd < 1 || (nd > W.max_bits && plan == Py_None) || no < 0 || no > 8 * 4096 || cap < 1 || fps < 0 || !PyCallable_Check(fn) ||
        (kind != CALL_FIRED && kind != CALL_PACKED)) {
        PyErr_Format(PyExc_ValueError, "decoder %lld: bad shape (detectors %lld, observables %lld, capacity %lld, "
                     "frames per shot %lld, call kind %lld) or decode function", id, nd, no, cap, fps, kind);
        return -1;
    }
    d->num_det = nd;
    d->num_obs = no;
    d->nbd = (nd + 7) / 8;
    d->nbo = no > 0 ? (no + 7) / 8 : 1;
    d->frames_per_shot = fps;
    d->call_kind = (int)kind;
    d->cap = cap;
    Py_INCREF(fn);
    d->fn = fn;
    d->shot = PyMem_Calloc((size_t)d->nbd + 8, 1);
    d->obs = PyMem_Calloc((size_t)(cap * d->nbo), 1);
    d->failed = PyMem_Calloc((size_t)cap, 1);
    d->drops_before = PyMem_Calloc((size_t)cap, sizeof(int64_t));
    d->rec = PyMem_Calloc((size_t)(cap * SVC_FIELDS), sizeof(int64_t));
    if (!d->shot || !d->obs || !d->failed || !d->drops_before || !d->rec) {
        PyErr_NoMemory();
        return -1;
    }
    if (dmap != Py_None && (plan != Py_None || dec_set_map(d, dmap) < 0)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a measurement map does not go with sliding windows");
        return -1;
    }
    int64_t call_nd = d->map ? d->map_num_det : nd, call_nbd = d->map ? d->map_nbd : d->nbd;
    if (kind == CALL_FIRED) {
        Py_buffer b;
        if (!PyTuple_Check(views) || PyTuple_GET_SIZE(views) != call_nd + 1 ||
            PyObject_GetBuffer(idx_arr, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "call kind 'fired' needs num_detectors + 1 views over an index array");
            return -1;
        }
        if (b.len < (Py_ssize_t)(8 * call_nd)) {
            PyBuffer_Release(&b);
            PyErr_SetString(PyExc_ValueError, "index array too small");
            return -1;
        }
        /* borrowed memory: the array (held in d->row) and the views keep it alive */
        d->idx = (uint64_t *)b.buf;
        PyBuffer_Release(&b);
        d->views = views;
        Py_INCREF(views);
        d->row = idx_arr;
        Py_INCREF(idx_arr);
    } else {
        Py_buffer b;
        if (PyObject_GetBuffer(row_arr, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        if (b.len != (Py_ssize_t)call_nbd) {
            PyBuffer_Release(&b);
            PyErr_SetString(PyExc_ValueError, "call kind 'packed' needs a (1, ceil(num_detectors/8)) uint8 row");
            return -1;
        }
        d->row_data = (uint8_t *)b.buf;
        PyBuffer_Release(&b);
        d->row = row_arr;
        Py_INCREF(row_arr);
    }
    if (batch_fn != Py_None && pend != Py_None) {
        Py_buffer b;
        if (!PyCallable_Check(batch_fn) || PyObject_GetBuffer(pend, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "batch_fn must be callable");
            return -1;
        }
        if (b.len != (Py_ssize_t)(cap * d->nbd)) {
            PyBuffer_Release(&b);
            PyErr_SetString(PyExc_ValueError, "the pending rows must be a (capacity_shots, ceil(D/8)) uint8 array");
            return -1;
        }
        d->pend_data = (uint8_t *)b.buf;
        PyBuffer_Release(&b);
        Py_INCREF(batch_fn);
        Py_INCREF(pend);
        d->batch_fn = batch_fn;
        d->pend = pend;
    }
    if (plan != Py_None) {
        d->win = win_new(plan, nd, no);
        if (d->win == NULL)
            return -1;
    }
    d->configured = 1;
    dec_reset(d);
    return 0;
}

static int svc_init(ServiceCore *s, PyObject *args, PyObject *kwds) {
    PyObject *link, *decoders, *rows = Py_None;
    int ack = 1;
    double block_s = 1.0;
    long long max_batch = 256, read_ahead = 0, max_frame = 0, ration = 0;
    int ingest_cpu = -1;
    static char *kwlist[] = {"link", "decoders", "ack", "rows", "answer_block_s", "max_batch", "read_ahead_nbytes",
                             "max_frame_nbytes", "ration_answers_per_s", "ingest_cpu", NULL};
    if (need_layout())
        return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|$iOdLLLLi:ServiceCore", kwlist, &link, &decoders, &ack, &rows,
                                     &block_s, &max_batch, &read_ahead, &max_frame, &ration, &ingest_cpu))
        return -1;
    if (ingest_cpu < -1 || ingest_cpu >= CPU_SETSIZE) {
        PyErr_Format(PyExc_ValueError, "ingest_cpu must be -1 (no ingest thread) or a CPU number, got %d", ingest_cpu);
        return -1;
    }
    if (read_ahead < 0 || max_frame < 0 || ration < 0) {
        PyErr_SetString(PyExc_ValueError, "read_ahead_nbytes, max_frame_nbytes and ration_answers_per_s must be >= 0 "
                                          "(0: the default)");
        return -1;
    }
    if (ack < 0 || ack > 2) {
        PyErr_SetString(PyExc_ValueError, "ack must be 0 (none), 1 (errors) or 2 (all)");
        return -1;
    }
    svc_clear(s);
    memset(s->counts, 0, sizeof(s->counts));
    s->ingest_cpu = ingest_cpu;
    s->piped = 0;
    s->piped_runs = s->pipe_waits = 0;
    if (io_init(&s->io, link) < 0)
        return -1;
    if (max_frame > 0 && (uint64_t)max_frame < s->io.max_payload)
        s->io.max_payload = (uint64_t)max_frame;
    if (read_ahead > 0 && s->io.kind == IO_FD) { /* a smaller read-ahead: bounded memory per connection */
        size_t cap = (size_t)read_ahead;
        if (cap < 32 + s->io.max_payload && s->io.max_payload < IO_IN_NBYTES)
            cap = 32 + s->io.max_payload; /* (a whole message of the longest taken must fit) */
        if (cap < s->io.in_w)
            cap = s->io.in_w;
        if (cap < 4096)
            cap = 4096;
        if (cap < s->io.in_cap) {
            uint8_t *in = PyMem_Realloc(s->io.in, cap);
            if (in == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            s->io.in = in;
            s->io.in_cap = cap;
        }
    }
    s->ration_per_s = s->io.kind == IO_DGRAM ? ration : 0;
    s->ration_since_ns = 0;
    s->ration_n = 0;
    s->last_active_ns = mono_ns();
    s->again = 1; /* (it may have frames already: looked at on the first pass) */
    s->was_empty = 1;
    s->heavy = 0;
    s->ack = ack;
    s->answer_block_ns = (int64_t)(block_s * 1e9);
    s->kw_packed = Py_BuildValue("(s)", "bit_packed_detection_event_data");
    if (s->kw_packed == NULL)
        return -1;
    PyObject *seq = PySequence_Fast(decoders, "decoders must be a sequence of tuples");
    if (seq == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        if (svc_add_decoder(s, PySequence_Fast_GET_ITEM(seq, i)) < 0) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    if (rows != Py_None) {
        if (get_rows(rows, &s->rows, SVC_FIELDS, "rows", &s->nrows) < 0)
            return -1;
        s->has_rows = 1;
    }
    s->row_n = s->rows_dropped = 0;
    s->t_ready = mono_ns();
    s->pending = 0;
    s->n_defer = s->defer_first = 0;
    s->n_kept = 0;
    if (s->io.kind == IO_DGRAM) {
        s->kept = PyMem_Calloc(KEEP_N, sizeof(KeptAnswer));
        if (s->kept == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (int i = 0; i < 64; i++) {
            SvcDecoder *d = &s->dec[i];
            if (!d->configured || d->nbo > KEEP_BYTES) /* (answers too long to keep: first come, first served) */
                continue;
            d->key = PyMem_Calloc((size_t)d->cap, sizeof(int64_t));
            d->tab = PyMem_Calloc(TAB_N, sizeof(ShotRec));
            d->rep = PyMem_Calloc((size_t)d->nbd + 8, 1);
            if (!d->key || !d->tab || !d->rep) {
                PyErr_NoMemory();
                return -1;
            }
        }
    }
    s->max_batch = max_batch < 1 ? 1 : max_batch;
    /* a backlog of max_batch shots is decoded in one call: their gets wait beside them */
    s->defer_cap = (int)(s->max_batch < DEFER_MIN ? DEFER_MIN : s->max_batch > DEFER_MAX_CAP ? DEFER_MAX_CAP : s->max_batch);
    s->defer = PyMem_Calloc((size_t)s->defer_cap, sizeof(DeferredGet));
    if (s->defer == NULL) {
        s->defer_cap = 0;
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* ----- answers */

#define RATION_GRACE 64 /* malformed frames a datagram sender may send before its answers are rationed */
static uint64_t malformed(const ServiceCore *s) { /* (a counter behind or a gap is loss, not malformed) */
    static const int bad[] = {C_F_SHORT_FRAME, C_F_BAD_MAGIC, C_F_LENGTH, C_F_UNKNOWN_FUNCTION,
                              C_F_DECODER_NOT_CONFIGURED, C_F_DECODER_ID, C_F_MAPPING_ID, C_F_SYNDROME_COUNT,
                              C_F_RETURN_SIZE, C_F_LAYOUT_MISMATCH};
    uint64_t n = 0;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        n += s->counts[bad[i]];
    return n;
}

/* 1 when this answer must be withheld (see ration_per_s) */
static int rationed(ServiceCore *s) {
    uint64_t bad = malformed(s);
    if (bad <= RATION_GRACE || 2 * bad <= s->counts[C_REQUESTS])
        return 0;
    int64_t now = mono_ns();
    if (now - s->ration_since_ns >= 1000000000LL) {
        s->ration_since_ns = now;
        s->ration_n = 0;
    }
    if (s->ration_n >= s->ration_per_s) {
        s->counts[C_ANSWERS_WITHHELD]++;
        return 1;
    }
    s->ration_n++;
    return 0;
}

static void svc_answer(ServiceCore *s, int32_t status, uint32_t rid, int64_t ptp, const uint8_t *res, uint32_t nres) {
    if (s->ration_per_s > 0 && rationed(s))
        return;
    uint8_t h[24];
    wr32(h, W.resp_magic);
    memcpy(h + 4, &status, 4);
    wr32(h + 8, nres);
    wr32(h + 12, rid);
    wr64(h + 16, ptp);
    int rc = io_send(&s->io, h, 24, res, nres);
    if (rc == QLINK_RING_FULL) { /* the controller is not reading: wait a bounded time */
        int64_t t0 = mono_ns();
        PyThreadState *ts = tl_ingest ? NULL : PyEval_SaveThread();
        while (rc == QLINK_RING_FULL && mono_ns() - t0 < s->answer_block_ns && !io_peer_closed(&s->io)) {
            if (tl_ingest)
                sched_yield(); /* (the reader may be waiting for this CPU) */
            else
                CPU_RELAX();
            rc = io_send(&s->io, h, 24, res, nres);
        }
        if (ts)
            PyEval_RestoreThread(ts);
    }
    if (rc == QLINK_RING_SENT)
        s->counts[C_ANSWERS]++;
    else
        s->counts[C_F_ANSWER_BLOCKED]++;
}

static inline void svc_refuse(ServiceCore *s, int fault, int32_t status, uint32_t rid, int64_t ptp) {
    s->counts[fault]++;
    if (s->ack >= 1)
        svc_answer(s, status, rid, ptp, NULL, 0);
}

/* ----- decoding */

static void note_failure(ServiceCore *s) {
    if (s->first_error == NULL) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        s->first_error = v ? PyObject_Repr(v) : NULL;
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
    }
    PyErr_Clear();
}

/* A measurement record (nbd bytes) mapped to its detectors in acc (words 64-bit words): the XOR
 * of one table row per nonzero byte (row 256 j + v: what byte j holding v flips). */
static inline void map_record(const uint64_t *rows, int64_t words, const uint8_t *bits, int64_t nbd, uint64_t *acc) {
    memset(acc, 0, (size_t)words * 8);
    for (int64_t j = 0; j < nbd; j++) {
        if (bits[j] == 0)
            continue;
        const uint64_t *r = rows + ((size_t)(256 * j + bits[j])) * (size_t)words;
        for (int64_t w = 0; w < words; w++)
            acc[w] ^= r[w];
    }
}

/* Decode `bits` (nbd bytes, pad bits clear) into `out` (nbo packed bytes). 0 ok, -1 failed (counted). */
static int svc_decode(ServiceCore *s, SvcDecoder *d, const uint8_t *bits, uint8_t *out) {
    PyObject *res;
    int64_t nbd = d->nbd;
    if (d->map_rows != NULL) { /* measurements -> detectors */
        map_record(d->map_rows, d->map_words, bits, nbd, d->mapped);
        bits = (const uint8_t *)d->mapped;
        nbd = d->map_nbd;
    }
    if (d->call_kind == CALL_FIRED) {
        int64_t k = 0;
        uint64_t *idx = d->idx;
        int64_t j = 0;
        for (; j + 8 <= nbd; j += 8) {
            uint64_t w;
            memcpy(&w, bits + j, 8);
            while (w) {
                idx[k++] = (uint64_t)(8 * j + __builtin_ctzll(w));
                w &= w - 1;
            }
        }
        for (; j < nbd; j++) {
            unsigned b = bits[j];
            while (b) {
                idx[k++] = (uint64_t)(8 * j + __builtin_ctz(b));
                b &= b - 1;
            }
        }
        PyObject *view = PyTuple_GET_ITEM(d->views, k);
        res = PyObject_Vectorcall(d->fn, &view, 1, NULL);
    } else {
        memcpy(d->row_data, bits, (size_t)nbd);
        res = PyObject_Vectorcall(d->fn, &d->row, 0, s->kw_packed);
    }
    s->counts[C_DECODE_CALLS]++;
    if (res == NULL) {
        note_failure(s);
        return -1;
    }
    PyObject *arr = res;
    if (PyTuple_Check(res) && PyTuple_GET_SIZE(res) >= 1) /* (flips, weight) */
        arr = PyTuple_GET_ITEM(res, 0);
    Py_buffer b;
    if (PyObject_GetBuffer(arr, &b, PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(res);
        note_failure(s);
        return -1;
    }
    int rc = 0;
    memset(out, 0, (size_t)d->nbo);
    if (d->call_kind == CALL_FIRED) {
        if (b.len < d->num_obs || (b.itemsize != 1 && b.len / (b.itemsize ? b.itemsize : 1) < d->num_obs)) {
            rc = -1;
        } else {
            const uint8_t *p = (const uint8_t *)b.buf;
            Py_ssize_t step = b.itemsize > 0 ? b.itemsize : 1;
            for (int64_t o = 0; o < d->num_obs; o++) /* little-endian: the low byte says 0 or not for bools/ints */
                if (p[o * step])
                    out[o >> 3] |= (uint8_t)(1u << (o & 7));
        }
    } else {
        if (b.len < d->nbo && d->num_obs > 0)
            rc = -1;
        else if (d->num_obs > 0)
            memcpy(out, b.buf, (size_t)d->nbo);
    }
    PyBuffer_Release(&b);
    Py_DECREF(res);
    if (rc < 0 && s->first_error == NULL)
        s->first_error = PyUnicode_FromString("the decoder returned fewer observable flips than the DEM has");
    return rc;
}

/* A completed shot takes the next queue slot (the drops before it recorded there); -1 and
 * BUSY in *status_out when the queue is full (the shot counted as dropped). */
static int64_t svc_admit(ServiceCore *s, SvcDecoder *d, int64_t *status_out) {
    s->counts[C_SHOTS_COMPLETED]++;
    if ((int64_t)(d->tail - d->head) >= d->cap) {
        s->counts[C_SHOTS_REFUSED_BUSY]++;
        s->counts[C_SHOTS_DROPPED]++;
        d->pending_drops++;
        *status_out = W.st_busy;
        tab_put(d, d->cur_key, REC_DROPPED, W.st_dropped, NULL); /* (its frames sent again repair it) */
        return -1;
    }
    int64_t slot = (int64_t)(d->tail % (uint64_t)d->cap);
    if (d->key)
        d->key[slot] = d->cur_key;
    d->drops_before[slot] = d->pending_drops;
    d->pending_drops = 0;
    return slot;
}

/* A completed shot: queue it (BUSY when the queue is full) and decode it at once. */
static void svc_complete(ServiceCore *s, SvcDecoder *d, const uint8_t *bits, uint32_t rid, int64_t ptp, int64_t t_in,
                         int64_t *status_out) {
    /* pipelined: a full queue whose gets wait for the decoding thread makes room as it answers
     * them (a single-threaded service decodes before its queue fills) */
    while (tl_ingest && (int64_t)(d->tail - d->head) >= d->cap && s->n_defer > s->defer_first)
        if (!svc_settle_ready(s)) {
            s->pipe_waits++;
            sched_yield();
        }
    int64_t slot = svc_admit(s, d, status_out);
    if (slot < 0)
        return;
    if (t_in == 0 && svc_rows_open(s)) /* the frame came while the service was busy: stamped now (parsed,
                                         * about to decode) */
        t_in = mono_ns();
    int64_t *r = d->rec + slot * SVC_FIELDS;
    r[0] = rid;
    r[1] = ptp;
    r[2] = t_in;
    r[3] = t_in; /* complete: the frame that completed it was received */
    r[6] = 0;
    r[8] = 0;
    r[9] = 1;
    r[10] = s->t_ready ? s->t_ready : t_in; /* busy back to back: ready when it took this frame */
    if (d->batch_fn != NULL) { /* decoded by svc_flush: at once when nothing else waits, else in one call */
        memcpy(d->pend_data + slot * d->nbd, bits, (size_t)d->nbd);
        if (s->piped) { /* the decoding thread takes it from here */
            st_rel64(&d->tail, d->tail + 1);
        } else {
            d->tail++;
            s->pending++;
        }
        return;
    }
    int64_t t0 = mono_ns();
    int rc = svc_decode(s, d, bits, d->obs + slot * d->nbo);
    int64_t t1 = mono_ns();
    d->failed[slot] = rc < 0;
    if (rc < 0)
        s->counts[C_DECODER_FAILED]++;
    else
        s->counts[C_SHOTS_DECODED]++;
    r[4] = t0;
    r[5] = t1;
    r[7] = 1;
    d->tail++;
    d->decoded = d->tail;
}

/* Decode d's waiting shots up to `upto`: one shot through the single-shot call, several
 * through the batch call (split where the ring of slots wraps). */
static void svc_decode_upto(ServiceCore *s, SvcDecoder *d, uint64_t upto) {
    while (d->decoded < upto) {
        int64_t first = (int64_t)(d->decoded % (uint64_t)d->cap);
        int64_t k = (int64_t)(upto - d->decoded);
        if (first + k > d->cap)
            k = d->cap - first;
        int64_t t0 = mono_ns();
        int rc = 0;
        if (k == 1 || d->batch_fn == NULL) {
            k = 1;
            rc = svc_decode(s, d, d->pend_data + first * d->nbd, d->obs + first * d->nbo);
        } else {
            s->counts[C_DECODE_CALLS]++;
            PyObject *rows = PySequence_GetSlice(d->pend, first, first + k);
            PyObject *res = rows ? PyObject_CallOneArg(d->batch_fn, rows) : NULL;
            Py_XDECREF(rows);
            Py_buffer b;
            if (res == NULL) {
                note_failure(s);
                rc = -1;
            } else {
                PyObject *arr = (PyTuple_Check(res) && PyTuple_GET_SIZE(res) >= 1) ? PyTuple_GET_ITEM(res, 0) : res;
                if (PyObject_GetBuffer(arr, &b, PyBUF_C_CONTIGUOUS) < 0) {
                    note_failure(s);
                    rc = -1;
                } else {
                    if (d->num_obs > 0 && b.len < k * d->nbo) {
                        rc = -1;
                        if (s->first_error == NULL)
                            s->first_error = PyUnicode_FromString("the batch decoder returned too few rows");
                    } else if (d->num_obs > 0) {
                        memcpy(d->obs + first * d->nbo, b.buf, (size_t)(k * d->nbo));
                    } else {
                        memset(d->obs + first * d->nbo, 0, (size_t)(k * d->nbo));
                    }
                    PyBuffer_Release(&b);
                }
                Py_DECREF(res);
            }
        }
        int64_t t1 = mono_ns();
        for (int64_t i = 0; i < k; i++) {
            int64_t *r = d->rec + (first + i) * SVC_FIELDS;
            r[4] = t0;
            r[5] = t1;
            r[7] = k;
            d->failed[first + i] = rc < 0;
        }
        s->counts[rc < 0 ? C_DECODER_FAILED : C_SHOTS_DECODED] += (uint64_t)k;
        st_rel64(&d->decoded, d->decoded + (uint64_t)k); /* (what the ingest thread of a pipelined run waits for) */
        if (!s->piped)
            s->pending -= k;
    }
}

/* Decode every waiting shot of d; in the ingest thread of a pipelined run, wait until the
 * decoding thread has. */
static void svc_flush_decoder(ServiceCore *s, SvcDecoder *d) {
    if (tl_ingest) {
        uint64_t want = d->tail;
        while (ld_acq64(&d->decoded) < want) {
            s->pipe_waits++;
            sched_yield();
        }
        return;
    }
    svc_decode_upto(s, d, d->tail);
}

static void svc_flush(ServiceCore *s) {
    for (int i = 0; i < 64 && s->pending > 0; i++)
        if (s->dec[i].configured)
            svc_flush_decoder(s, &s->dec[i]);
}

/* `g` frames were lost before this one: drop every shot they touched. */
/* A frame's counter taken (the next one expected after it); 1 when the frame belongs to a shot
 * already dropped and is discarded here (counted, its place in the shot kept), else 0. */
static inline int dec_take_counter(ServiceCore *s, SvcDecoder *d, int64_t counter) {
    d->next_counter = counter + 1;
    d->has_counter = 1;
    if (d->discard <= 0)
        return 0;
    d->discard--;
    s->counts[C_FRAMES_DISCARDED]++;
    if (d->frames_per_shot > 0)
        d->pos = (d->pos + 1) % d->frames_per_shot;
    return 1;
}

static void svc_lose(ServiceCore *s, SvcDecoder *d, int64_t g) {
    s->counts[C_F_COUNTER_GAP]++;
    s->counts[C_FRAMES_LOST] += (uint64_t)g;
    int64_t F = d->frames_per_shot;
    int64_t drops;
    if (F <= 0) { /* layout unknown: the shot in progress (if any) is dropped, this frame starts afresh */
        drops = 1;
        d->pos = 0;
        d->discard = 0;
    } else {
        int64_t total = d->pos + g;
        drops = (total - 1) / F + 1;
        /* the shots touched, by the counter of each one's last frame: recorded as dropped */
        int64_t first = d->next_counter - d->pos;
        for (int64_t k = 0; d->tab && k < drops; k++) {
            ShotRec *r = tab_get(d, first + k * F + F - 1);
            if (r == NULL || r->state != REC_FINAL)
                tab_put(d, first + k * F + F - 1, REC_DROPPED, W.st_dropped, NULL);
        }
        if (d->discard > 0) /* the shot in progress was dropped already (an earlier gap): counted then */
            drops--;
        int64_t np = total % F;
        d->pos = np;
        d->discard = np ? F - np : 0;
    }
    d->filling = 0;
    d->filled = 0;
    d->pending_drops += drops;
    s->counts[C_SHOTS_DROPPED] += (uint64_t)drops;
}

/* OR n bits of src (from bit 0) into d->shot at bit d->filled. */
static inline void append_bits(SvcDecoder *d, const uint8_t *src, int64_t n) {
    int64_t f = d->filled;
    int64_t nb = (n + 7) >> 3;
    int o = (int)(f & 7);
    uint8_t *dst = d->shot + (f >> 3);
    uint8_t lastmask = (n & 7) ? (uint8_t)((1u << (n & 7)) - 1) : 0xFF;
    if (o == 0) {
        memcpy(dst, src, (size_t)nb);
        dst[nb - 1] &= lastmask;
    } else {
        for (int64_t i = 0; i < nb; i++) {
            unsigned v = src[i];
            if (i == nb - 1)
                v &= lastmask;
            dst[i] |= (uint8_t)(v << o);
            dst[i + 1] = (uint8_t)(v >> (8 - o)); /* the next byte starts clean */
        }
    }
    d->filled = f + n;
}

