/* qlink.qec._hotcore: the controller core: the QPU-controller emulator's emit / answer / apply loop.
 * (part of the one translation unit _hotcore.c, which includes it: not compiled on its own) */

/* ================================================================== controller core */

#define CTL_FIELDS 11 /* qlink.qec.timeline.CONTROLLER_SHOT_FIELDS */
enum { K_SHOT, K_RID, K_EMIT, K_DUE, K_SENT, K_GET, K_RESP, K_APPLIED, K_POLLS, K_STATUS, K_CORRECT };

#define GET_BIT 0x80000000u

typedef struct {
    PyObject_HEAD
    Io io;
    /* frames: S shots x F frames, each prebuilt (counter, request id and ptp patched at send) */
    Py_buffer frames, offs, lens, last_round, get_frame, rows, corr, lag;
    int has[8];
    int64_t S, F, R, nbo, cycle_ns, gap_cycles, lockstep, stall_ns, deadline_ns;
    int64_t lag_n;
    /* state (resumable: run() returns on a stall and is called again) */
    int64_t s_emit, f_emit, s_ans, t0, shot_t0, counter, rid, get_rid;
    int64_t frames_sent, late, max_lag, reasks, misses, bad_answers, full_waits, late_threshold_ns;
    int64_t backlog_every, backlog_n, backlog_cap;
    Py_buffer backlog;
    int has_backlog;
    uint8_t pauli[4096];
    int started, done;
    int64_t t_end, statuses[8], real_off;
    /* each shot's latest get: its request id, ptp stamp and send time (an answer is matched
     * to it; over datagrams it is sent again, the very same, when no answer came in time) */
    int64_t *get_rid_of, *get_ptp_of, *get_t_of;
    int64_t get_timeout_ns, resends, stale;
    /* datagrams: when an answer last came, and the latest shot answered (an answer past the
     * oldest one waiting says that one's get or answer was lost; none at all for a get timeout
     * says the service went quiet: only then is a get asked again -- a service merely behind
     * answers in order, and asking it again only adds to what it is behind on) */
    int64_t t_answer, latest_answered;
    int64_t get_owed; /* shot + 1 whose get could not be sent yet (the ring stayed full), or 0 */
    /* datagrams: each shot's get names it (the counter of its last frame, ADDR_BITS); answers
     * are taken in any order; a shot the service lacks has its frames sent again (a repair) */
    int64_t *ctr_of, *repairs_of;
    int64_t repairs, resent_frames, max_repairs;
    int ready;     /* the service answered the first look (datagrams: nothing is played before) */
    int pack_get;  /* datagrams: a shot's get rides in the datagram of its last frame (two whole frames) */
    uint32_t join_nbytes; /* datagrams and rings: a frame emitted behind its clock joins the message before
                           * it, up to this many bytes (0: one frame a message, besides a packed get) */
    int64_t ping_t, pings;
} ControllerCore;

#define EMIT_BURST 32 /* frames emitted back to back, at most, between two looks for answers */
#define JOIN_NBYTES 1472 /* join_nbytes by default: an Ethernet MTU's UDP payload */
#define PING_RID 0x7FFFFFFFu /* the look before a datagram run: a peek, answered whatever the state */

static int ctl_traverse(ControllerCore *c, visitproc visit, void *arg) {
    Py_VISIT(c->io.tx);
    Py_VISIT(c->io.rx);
    return 0;
}

static int ctl_clear(ControllerCore *c) {
    io_free(&c->io);
    Py_buffer *bs[8] = {&c->frames, &c->offs, &c->lens, &c->last_round, &c->get_frame, &c->rows, &c->corr, &c->lag};
    for (int i = 0; i < 8; i++)
        if (c->has[i]) {
            PyBuffer_Release(bs[i]);
            c->has[i] = 0;
        }
    if (c->has_backlog) {
        PyBuffer_Release(&c->backlog);
        c->has_backlog = 0;
    }
    PyMem_Free(c->get_rid_of);
    PyMem_Free(c->get_ptp_of);
    PyMem_Free(c->get_t_of);
    PyMem_Free(c->ctr_of);
    PyMem_Free(c->repairs_of);
    c->get_rid_of = c->get_ptp_of = c->get_t_of = c->ctr_of = c->repairs_of = NULL;
    return 0;
}

static void ctl_dealloc(ControllerCore *c) {
    PyObject_GC_UnTrack(c);
    ctl_clear(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int ctl_buf(ControllerCore *c, int i, Py_buffer *b, PyObject *obj, int writable, Py_ssize_t min_len,
                   const char *name) {
    if (PyObject_GetBuffer(obj, b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    c->has[i] = 1;
    if (b->len < min_len) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", name, b->len, min_len);
        return -1;
    }
    return 0;
}

static int ctl_init(ControllerCore *c, PyObject *args, PyObject *kwds) {
    PyObject *link, *frames, *offs, *lens, *last_round, *get_frame, *rows, *corr, *lag = Py_None,
        *backlog = Py_None;
    long long S = -1, F = -1, R = -1, nbo = -1, cycle_ns = -1, gap_cycles = 0, lockstep = 0, stall_ns = 1000000, deadline_ns = 0;
    long long counter = 0, rid = 0, get_rid = 0, late_ns = -1, backlog_every = 0, get_timeout_ns = 50000000;
    long long max_repairs = 16, get_in_last_datagram = 0, join_nbytes = JOIN_NBYTES;
    static char *kwlist[] = {"link", "frames", "offsets", "lengths", "last_round", "get_frame", "rows",
                             "corrections", "num_shots", "frames_per_shot", "rounds_per_shot", "obs_nbytes",
                             "cycle_ns", "gap_cycles", "lockstep", "stall_ns", "deadline_ns", "counter_start",
                             "request_id_start", "get_request_id_start", "late_ns", "lag", "backlog",
                             "backlog_every", "get_timeout_ns", "max_repairs", "get_in_last_datagram", "join_nbytes",
                             NULL};
    if (need_layout())
        return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOO|$LLLLLLLLLLLLLOOLLLLL:ControllerCore", kwlist, &link,
                                     &frames, &offs, &lens, &last_round, &get_frame, &rows, &corr, &S, &F, &R, &nbo,
                                     &cycle_ns, &gap_cycles, &lockstep, &stall_ns, &deadline_ns, &counter, &rid,
                                     &get_rid, &late_ns, &lag, &backlog, &backlog_every, &get_timeout_ns,
                                     &max_repairs, &get_in_last_datagram, &join_nbytes))
        return -1;
    if (S < 1 || F < 1 || R < 1 || nbo < 1 || nbo > 4096 || cycle_ns < 1 || gap_cycles < 0) {
        PyErr_SetString(PyExc_ValueError, "num_shots, frames_per_shot, rounds_per_shot, cycle_ns must be >= 1, "
                                          "obs_nbytes in 1..4096, gap_cycles >= 0");
        return -1;
    }
    ctl_clear(c);
    if (io_init(&c->io, link) < 0)
        return -1;
    if (ctl_buf(c, 0, &c->frames, frames, 1, 1, "frames") || ctl_buf(c, 1, &c->offs, offs, 0, 8 * S * F, "offsets") ||
        ctl_buf(c, 2, &c->lens, lens, 0, 8 * S * F, "lengths") ||
        ctl_buf(c, 3, &c->last_round, last_round, 0, 8 * F, "last_round") ||
        ctl_buf(c, 4, &c->get_frame, get_frame, 1, W.hdr + W.get_payload, "get_frame") ||
        ctl_buf(c, 5, &c->rows, rows, 1, 8 * CTL_FIELDS * S, "rows") ||
        ctl_buf(c, 6, &c->corr, corr, 1, nbo * S, "corrections"))
        return -1;
    const int64_t *o = c->offs.buf, *l = c->lens.buf;
    for (int64_t i = 0; i < S * F; i++)
        if (o[i] < 0 || l[i] < W.hdr + W.enq_fixed || o[i] + l[i] > c->frames.len) {
            PyErr_Format(PyExc_ValueError, "frame %lld lies outside the frames buffer", (long long)i);
            return -1;
        }
    if (lag != Py_None && ctl_buf(c, 7, &c->lag, lag, 1, 0, "lag"))
        return -1;
    c->lag_n = c->has[7] ? c->lag.len / 8 : 0;
    if (backlog != Py_None) {
        if (get_rows(backlog, &c->backlog, 2, "backlog", &c->backlog_cap) < 0)
            return -1;
        c->has_backlog = 1;
    }
    c->backlog_every = backlog_every > 0 ? backlog_every : 1;
    c->backlog_n = 0;
    c->S = S;
    c->F = F;
    c->R = R;
    c->nbo = nbo;
    c->cycle_ns = cycle_ns;
    c->gap_cycles = gap_cycles;
    c->lockstep = lockstep;
    c->stall_ns = stall_ns;
    c->deadline_ns = deadline_ns;
    c->counter = counter;
    c->rid = rid;
    c->get_rid = get_rid;
    c->late_threshold_ns = late_ns >= 0 ? late_ns : cycle_ns;
    c->s_emit = c->f_emit = c->s_ans = 0;
    c->frames_sent = c->late = c->max_lag = c->reasks = c->misses = c->bad_answers = c->full_waits = 0;
    memset(c->pauli, 0, sizeof(c->pauli));
    memset(c->statuses, 0, sizeof(c->statuses));
    c->started = c->done = 0;
    memset(c->rows.buf, 0, (size_t)(8 * CTL_FIELDS * S));
    c->get_rid_of = PyMem_Calloc((size_t)S, 8);
    c->get_ptp_of = PyMem_Calloc((size_t)S, 8);
    c->get_t_of = PyMem_Calloc((size_t)S, 8);
    if (!c->get_rid_of || !c->get_ptp_of || !c->get_t_of) {
        PyErr_NoMemory();
        return -1;
    }
    c->get_timeout_ns = get_timeout_ns > 0 ? get_timeout_ns : 50000000;
    c->resends = c->stale = 0;
    c->t_answer = 0;
    c->latest_answered = -1;
    c->get_owed = 0;
    c->ctr_of = PyMem_Calloc((size_t)S, 8);
    c->repairs_of = PyMem_Calloc((size_t)S, 8);
    if (!c->ctr_of || !c->repairs_of) {
        PyErr_NoMemory();
        return -1;
    }
    c->repairs = c->resent_frames = 0;
    c->max_repairs = max_repairs >= 0 ? max_repairs : 0;
    c->ready = c->io.kind != IO_DGRAM;
    c->pack_get = c->io.kind == IO_DGRAM && get_in_last_datagram != 0;
    /* (joined frames need a service that takes a message frame by frame, as a packed get does:
     * over udp they go with it; a stream gathers its frames anyway) */
    if (join_nbytes > IO_JOIN_MAX)
        join_nbytes = IO_JOIN_MAX;
    if (c->io.kind == IO_RING && (uint64_t)join_nbytes > c->io.max_payload) /* (a small ring's records) */
        join_nbytes = (long long)c->io.max_payload;
    c->join_nbytes = (c->io.kind == IO_RING || c->pack_get) && join_nbytes > 0 ? (uint32_t)join_nbytes : 0;
    /* touched now, not on the clock: a page first written mid-run costs a fault (~1 us) */
    prefault(c->corr.buf, (size_t)c->corr.len);
    prefault(c->get_rid_of, (size_t)S * 8);
    prefault(c->get_ptp_of, (size_t)S * 8);
    prefault(c->get_t_of, (size_t)S * 8);
    prefault(c->ctr_of, (size_t)S * 8);
    prefault(c->repairs_of, (size_t)S * 8);
    if (c->has[7])
        prefault(c->lag.buf, (size_t)c->lag.len);
    if (c->has_backlog)
        prefault(c->backlog.buf, (size_t)c->backlog.len);
    c->ping_t = c->pings = 0;
    return 0;
}

static inline int64_t *ctl_row(ControllerCore *c, int64_t s) { return (int64_t *)c->rows.buf + s * CTL_FIELDS; }

static int ctl_poll(ControllerCore *c, int *progress);

/* send a message, waiting while the ring is full; 0 sent, -1 peer gone / released, -2 still
 * full after stall_ns (nothing sent: the caller returns to Python, which looks at the peer --
 * a killed peer cannot mark its ring closed -- and calls run() again). While it waits it
 * takes the answers that come: a service whose answers find the way back full stops reading
 * frames, and a controller that only waited for room would wait on it in turn. */
static int ctl_send2(ControllerCore *c, const uint8_t *p, uint32_t n, const uint8_t *p2, uint32_t n2) {
    int rc = io_send(&c->io, p, n, p2, n2);
    if (rc == QLINK_RING_FULL) {
        c->full_waits++;
        int64_t t0 = mono_ns();
        unsigned k = 0;
        while (rc == QLINK_RING_FULL) {
            if (io_peer_closed(&c->io) || io_flush(&c->io) < 0)
                return -1;
            if (c->s_ans < c->s_emit) {
                int progress = 0;
                if (ctl_poll(c, &progress) < 0)
                    return -1;
            }
            if ((++k & 255) == 0 && mono_ns() - t0 > c->stall_ns)
                return -2;
            if ((k & 31) == 0 && io_yield_hint(&c->io))
                sched_yield(); /* the service's side that would make room runs on this CPU */
            else
                CPU_RELAX();
            rc = io_send(&c->io, p, n, p2, n2);
        }
    }
    return rc == QLINK_RING_SENT ? 0 : -1;
}

static inline int ctl_send(ControllerCore *c, const uint8_t *p, uint32_t n) { return ctl_send2(c, p, n, NULL, 0); }

/* shot s's get made ready to go (stamped t): its request id, the row's and the shot's records;
 * returns its length. ctl_unprep_get takes it back when it could not be sent. */
static uint32_t ctl_prep_get(ControllerCore *c, int64_t s, int64_t t) {
    uint8_t *g = c->get_frame.buf;
    uint32_t rid = (uint32_t)(GET_BIT | (uint32_t)(c->get_rid++ & 0x7FFFFFFF));
    if (c->io.kind == IO_DGRAM) /* the get names its shot */
        rid = ADDR_BITS | (uint32_t)(c->ctr_of[s] & ADDR_MASK);
    wr32(g + 12, rid);
    wr64(g + 16, t + c->real_off);
    int64_t *r = ctl_row(c, s);
    if (r[K_POLLS] == 0)
        r[K_GET] = t;
    r[K_POLLS]++;
    c->get_rid_of[s] = rid;
    c->get_ptp_of[s] = t + c->real_off;
    c->get_t_of[s] = t;
    return (uint32_t)(W.hdr + W.get_payload);
}

static void ctl_unprep_get(ControllerCore *c, int64_t s) {
    int64_t *r = ctl_row(c, s);
    c->get_rid--;
    if (--r[K_POLLS] == 0)
        r[K_GET] = 0;
}

static int ctl_send_get(ControllerCore *c, int64_t s) {
    uint32_t n = ctl_prep_get(c, s, mono_ns());
    int rc = ctl_send(c, c->get_frame.buf, n);
    if (rc == -2) { /* not sent: owed, sent first when run() is called again */
        ctl_unprep_get(c, s);
        c->get_owed = s + 1;
    }
    return rc;
}

/* datagrams: shot s's frames once more, their own counters, and its get (the service lacks
 * the shot: a frame of it was lost); 0 sent, else ctl_send's code */
static int ctl_repair(ControllerCore *c, int64_t s) {
    const int64_t *offs = c->offs.buf, *lens = c->lens.buf;
    uint8_t *frames = c->frames.buf;
    int64_t F = c->F, first = c->ctr_of[s] - (F - 1);
    int64_t now = mono_ns();
    c->repairs++;
    c->repairs_of[s]++;
    for (int64_t f = 0; f < F; f++) {
        int64_t i = s * F + f;
        uint8_t *fr = frames + offs[i];
        wr32(fr + 12, (uint32_t)(c->rid++ & 0x7FFFFFFF));
        wr64(fr + 16, now + c->real_off);
        wr64(fr + W.hdr + 8, first + f);
        int rc = ctl_send(c, fr, (uint32_t)lens[i]);
        if (rc != 0)
            return rc; /* (asked again on the timer: the answer says what is still missing) */
        c->resent_frames++;
    }
    return ctl_send_get(c, s);
}

/* datagrams: an answer to a get that named its shot; 1 the oldest shot resolved */
static int ctl_take_named(ControllerCore *c, int32_t status, uint32_t rid, int64_t ptp, const uint8_t *res,
                          uint32_t rlen, int64_t t_resp) {
    if ((rid & ADDR_BITS) != ADDR_BITS) /* an enqueue's answer, or the look's */
        return 0;
    if (c->s_ans >= c->s_emit) {
        c->stale++;
        return 0;
    }
    uint32_t delta = (rid - (uint32_t)c->ctr_of[c->s_ans]) & ADDR_MASK;
    int64_t s = c->s_ans + (int64_t)(delta / (uint32_t)c->F);
    if (delta % (uint32_t)c->F || s >= c->s_emit) { /* names no shot waiting: an earlier one's again */
        c->stale++;
        return 0;
    }
    int64_t *r = ctl_row(c, s);
    if (r[K_STATUS] != -1) { /* answered already (asked twice) */
        c->stale++;
        return 0;
    }
    if (status == W.st_not_ready || status == W.st_dropped) {
        if (ptp != c->get_ptp_of[s]) { /* an earlier ask's: the latest one's answer decides */
            c->stale++;
            return 0;
        }
        if (c->repairs_of[s] < c->max_repairs) {
            c->reasks++;
            ctl_repair(c, s);
            return 0;
        }
        status = W.st_dropped; /* given up on: lost, and said so in its row */
    }
    r[K_RESP] = t_resp;
    r[K_STATUS] = status;
    if (s > c->latest_answered)
        c->latest_answered = s;
    if (status == W.st_ok) {
        uint8_t *corr = (uint8_t *)c->corr.buf + s * c->nbo;
        uint32_t m = rlen < c->nbo ? rlen : (uint32_t)c->nbo;
        memcpy(corr, res, m);
        for (uint32_t i = 0; i < m; i++)
            c->pauli[i] ^= corr[i];
        r[K_APPLIED] = mono_ns();
    }
    int64_t before = c->s_ans;
    while (c->s_ans < c->s_emit && ctl_row(c, c->s_ans)[K_STATUS] != -1)
        c->s_ans++;
    return c->s_ans > before;
}

/* one answer at the head of rx: 1 a shot resolved, 0 nothing to do, -1 bad */
static int ctl_take_answer(ControllerCore *c, const uint8_t *a, uint32_t n, int64_t t_resp) {
    if (n < W.hdr || rd32(a) != W.resp_magic) {
        c->bad_answers++;
        return 0;
    }
    int32_t status;
    memcpy(&status, a + 4, 4);
    uint32_t rlen = rd32(a + 8), rid = rd32(a + 12);
    if ((uint64_t)rlen + W.hdr != n) {
        c->bad_answers++;
        return 0;
    }
    if (rid == PING_RID && !(rid & GET_BIT) && c->io.kind == IO_DGRAM) { /* the look's answer */
        c->ready = 1;
        return 0;
    }
    if (status >= 0 && status < 8)
        c->statuses[status]++;
    if (c->io.kind == IO_DGRAM) {
        c->t_answer = t_resp;
        return ctl_take_named(c, status, rid, rd64(a + 16), a + W.hdr, rlen, t_resp);
    }
    if (!(rid & GET_BIT)) /* an enqueue's answer (a refusal with ack='errors') */
        return 0;
    if (c->s_ans >= c->s_emit) {
        c->bad_answers++;
        return 0;
    }
    int64_t s = c->s_ans;
    if ((uint32_t)c->get_rid_of[s] != rid) { /* an answer to an earlier ask (asked again since): not this one */
        c->stale++;
        return 0;
    }
    int64_t *r = ctl_row(c, s);
    if (status == W.st_not_ready) { /* ask again */
        c->reasks++;
        ctl_send_get(c, s);
        return 0;
    }
    r[K_RESP] = t_resp;
    r[K_STATUS] = status;
    if (s > c->latest_answered)
        c->latest_answered = s;
    if (status == W.st_ok) {
        uint8_t *corr = (uint8_t *)c->corr.buf + s * c->nbo;
        uint32_t m = rlen < c->nbo ? rlen : (uint32_t)c->nbo;
        memcpy(corr, a + W.hdr, m);
        for (uint32_t i = 0; i < m; i++)
            c->pauli[i] ^= corr[i];
        r[K_APPLIED] = mono_ns();
    }
    c->s_ans++;
    return 1;
}

static int ctl_poll(ControllerCore *c, int *progress) {
    const uint8_t *a;
    uint32_t n;
    int rc = io_peek(&c->io, &a, &n);
    if (rc == QLINK_RING_MSG) {
        int64_t t = mono_ns();
        int resolved = ctl_take_answer(c, a, n, t);
        io_consume(&c->io);
        *progress = 1 + resolved; /* 2: a shot resolved */
        return 1;
    }
    if (rc == IO_CLOSED)
        return -3;
    if (rc == QLINK_RING_OTHER || rc == QLINK_RING_RELEASED)
        return -1;
    return 0;
}

static void ctl_backlog_sample(ControllerCore *c, int64_t t) {
    if (!c->has_backlog || c->backlog_n >= c->backlog_cap)
        return;
    int64_t *b = (int64_t *)c->backlog.buf + 2 * c->backlog_n++;
    b[0] = t - c->t0;
    b[1] = c->s_emit * c->R - c->s_ans * c->R;
}

/* run(timeout_ns) -> 0 done, 1 stalled stall_ns without progress (look at the peer, call again),
 * -1 the peer closed / the ring went away, -2 something other than a whole message arrived */
static PyObject *ctl_run(ControllerCore *c, PyObject *arg) {
    long long budget_ns = PyLong_AsLongLong(arg);
    if (budget_ns == -1 && PyErr_Occurred())
        return NULL;
    if (c->done)
        return PyLong_FromLong(0);
    int code = 0;
    const int64_t *offs = c->offs.buf, *lens = c->lens.buf, *lr = c->last_round.buf;
    uint8_t *frames = c->frames.buf;
    int64_t S = c->S, F = c->F, R = c->R, cyc = c->cycle_ns;
    Py_BEGIN_ALLOW_THREADS;
    int64_t t_call = mono_ns(), t_progress = t_call;
    if (!c->ready) {
        /* datagrams: nothing is played before the service answers a look (a peek): a burst sent
         * while it is not yet reading its socket would overflow the socket's buffer */
        uint8_t ping[64];
        uint32_t np = W.hdr + W.get_payload;
        memcpy(ping, c->get_frame.buf, np);
        wr32(ping + 12, PING_RID);
        ping[W.hdr + 16] = 0;
        int64_t now = t_call;
        unsigned k = 0;
        while (!c->ready) {
            if (c->pings == 0 || now - c->ping_t > c->get_timeout_ns) {
                c->pings++;
                c->ping_t = now;
                wr64(ping + 16, now + real_ns() - mono_ns());
                if (ctl_send(c, ping, np) == -1 || io_flush(&c->io) < 0) {
                    code = -1;
                    break;
                }
            }
            const uint8_t *a;
            uint32_t n;
            int rc = io_peek(&c->io, &a, &n);
            if (rc == QLINK_RING_MSG) {
                if (n >= W.hdr && rd32(a) == W.resp_magic && rd32(a + 12) == PING_RID)
                    c->ready = 1;
                io_consume(&c->io);
                continue;
            }
            if (rc == IO_CLOSED || io_peer_closed(&c->io)) {
                code = -1;
                break;
            }
            if ((++k & 255) == 0) {
                now = mono_ns();
                if (now - t_call > budget_ns || now - t_call > c->stall_ns) {
                    code = 1;
                    break;
                }
            }
            CPU_RELAX();
        }
        if (!c->ready)
            goto out;
        t_call = t_progress = mono_ns();
    }
    if (!c->started) {
        c->started = 1;
        c->real_off = real_ns() - mono_ns(); /* ptp_timestamp: the send time on the wall clock */
        c->t0 = t_call + 20 * cyc; /* the first tick, a little ahead */
        c->shot_t0 = c->t0;
    }
    unsigned idle = 0, burst = 0;
    int64_t now = t_call;
    for (;;) {
        int progress = 0;
        if (c->get_owed) {
            int64_t s = c->get_owed - 1;
            c->get_owed = 0;
            int rc = ctl_send_get(c, s);
            if (rc == -2) {
                code = 1;
                break;
            }
            if (rc < 0) {
                code = -1;
                break;
            }
        }
        int can_emit = c->s_emit < S && (!c->lockstep || c->s_ans == c->s_emit);
        /* the clock is read where a tick may be due, and every 32 idle polls otherwise */
        if (can_emit || (idle & 31) == 0)
            now = mono_ns();
        /* emit the next frame at its tick */
        if (can_emit) {
            int64_t s = c->s_emit, f = c->f_emit;
            int64_t tick;
            if (c->lockstep)
                tick = c->shot_t0 + lr[f] * cyc;
            else
                tick = c->t0 + (s * (R + c->gap_cycles) + lr[f]) * cyc;
            if (now >= tick) {
                int64_t i = s * F + f;
                uint8_t *fr = frames + offs[i];
                uint32_t rid = (uint32_t)(c->rid++ & 0x7FFFFFFF);
                wr32(fr + 12, rid);
                wr64(fr + 16, now + c->real_off);
                wr64(fr + W.hdr + 8, c->counter++);
                /* datagrams: the shot's get goes in the datagram of its last frame, stamped alike
                 * (where both fit in one datagram) */
                int packed = c->pack_get && f == F - 1 &&
                             (uint64_t)lens[i] + W.hdr + W.get_payload <= (uint64_t)DG_PAYLOAD_MAX;
                if (f == F - 1) /* (a datagram get names its shot by this counter) */
                    c->ctr_of[s] = c->counter - 1;
                int src;
                c->io.join_nbytes = burst > 0 ? c->join_nbytes : 0; /* (the shot's get too, below) */
                if (packed) {
                    uint32_t gn = ctl_prep_get(c, s, now);
                    src = ctl_send2(c, fr, (uint32_t)lens[i], c->get_frame.buf, gn);
                    if (src == -2)
                        ctl_unprep_get(c, s);
                } else {
                    src = ctl_send(c, fr, (uint32_t)lens[i]);
                }
                if (src == -2) { /* not sent: emitted again when run() is called again */
                    c->rid--;
                    c->counter--;
                    code = 1;
                    break;
                }
                if (src < 0) {
                    code = -1;
                    break;
                }
                int64_t t_sent = f == F - 1 ? mono_ns() : now; /* (read again only where a stage needs it) */
                int64_t lag = now - tick;
                if (lag > c->max_lag)
                    c->max_lag = lag;
                if (lag > c->late_threshold_ns)
                    c->late++;
                if (c->frames_sent < c->lag_n)
                    ((int64_t *)c->lag.buf)[c->frames_sent] = lag;
                c->frames_sent++;
                progress = 1;
                if (f == F - 1) {
                    int64_t *r = ctl_row(c, s);
                    r[K_SHOT] = s;
                    r[K_RID] = rid;
                    r[K_EMIT] = tick;
                    r[K_DUE] = tick;
                    r[K_SENT] = t_sent;
                    r[K_STATUS] = -1;
                    if (packed) /* its get left with it */
                        r[K_GET] = c->get_t_of[s] = t_sent;
                    c->s_emit++;
                    c->f_emit = 0;
                    int grc = packed ? 0 : ctl_send_get(c, s);
                    if (grc == -2) { /* (owed: sent first on the next call) */
                        code = 1;
                        break;
                    }
                    if (grc < 0) {
                        code = -1;
                        break;
                    }
                    if (c->s_emit % c->backlog_every == 0)
                        ctl_backlog_sample(c, t_sent);
                } else {
                    c->f_emit++;
                }
                c->io.join_nbytes = 0;
                t_progress = t_sent;
                idle = 0;
                /* the next frame may be due already; a controller behind its clock still reads
                 * its answers every EMIT_BURST frames (a datagram socket's buffer, left unread
                 * through a long catch-up, drops answers: each then waits out get_timeout_ns) */
                if (++burst < EMIT_BURST)
                    continue;
            }
        }
        burst = 0;
        /* nothing more due now: what was gathered goes out (stream links; rings sent already) */
        if (c->io.out_n && io_flush(&c->io) < 0) {
            code = -1;
            break;
        }
        /* answers: every one waiting (up to 32), not one per pass -- a controller behind its
         * clock passes here once per write of its frames, and answers read one a pass would
         * then pile up in the link (a stream's socket buffer fills and holds the service's) */
        if (c->s_ans < c->s_emit) {
            int got = 0, stop = 0;
            for (int k = 0; k < 32 && c->s_ans < c->s_emit; k++) {
                progress = 0;
                int prc = ctl_poll(c, &progress);
                if (prc == -3 || prc < 0) {
                    code = prc == -3 ? -1 : -2;
                    stop = 1;
                    break;
                }
                if (!progress)
                    break;
                got = 1;
                int64_t t;
                if (progress == 2) {
                    int64_t *rr = ctl_row(c, c->s_ans - 1);
                    t = rr[K_APPLIED] ? rr[K_APPLIED] : rr[K_RESP];
                } else {
                    t = mono_ns();
                }
                t_progress = t;
                idle = 0;
                if (progress == 2 && c->lockstep && c->s_ans == c->s_emit) {
                    /* the next shot starts on the next tick after the correction was applied */
                    int64_t *r = ctl_row(c, c->s_ans - 1);
                    if (c->deadline_ns > 0 && (r[K_APPLIED] == 0 || r[K_APPLIED] - r[K_EMIT] > c->deadline_ns))
                        c->misses++;
                    int64_t kk = (t - c->t0 + cyc - 1) / cyc + c->gap_cycles;
                    c->shot_t0 = c->t0 + kk * cyc;
                    break;
                }
            }
            if (stop)
                break;
            if (got)
                continue;
        }
        if (c->s_ans >= S) {
            c->t_end = mono_ns();
            c->done = 1;
            ctl_backlog_sample(c, c->t_end);
            code = 0;
            break;
        }
        if ((idle++ & 31) == 0) {
            if (now - t_progress > c->stall_ns || now - t_call > budget_ns) {
                code = 1;
                break;
            }
            if (c->s_ans < c->s_emit && io_yield_hint(&c->io))
                sched_yield(); /* what would answer runs on this CPU (a pipelined service's ingest thread) */
            if (io_peer_closed(&c->io) || io_flush(&c->io) < 0) {
                code = -1;
                break;
            }
            if (c->io.kind == IO_DGRAM && c->s_ans < c->s_emit && now - c->get_t_of[c->s_ans] > c->get_timeout_ns &&
                (c->latest_answered > c->s_ans || now - c->t_answer > c->get_timeout_ns)) {
                /* no answer in time: the gets of the oldest shots still unanswered, asked again
                 * (their answers, or the service's word that it lacks them, come back) */
                int64_t end = c->s_ans + 64 < c->s_emit ? c->s_ans + 64 : c->s_emit;
                int grc = 0;
                for (int64_t s = c->s_ans; s < end && grc == 0; s++)
                    if (ctl_row(c, s)[K_STATUS] == -1 && now - c->get_t_of[s] > c->get_timeout_ns) {
                        c->resends++;
                        grc = ctl_send_get(c, s);
                    }
                if (grc == -1) {
                    code = -1;
                    break;
                }
            }
        }
        CPU_RELAX();
    }
out:
    c->io.join_nbytes = 0;
    io_flush(&c->io);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(code);
}

static PyObject *ctl_stats(ControllerCore *c, PyObject *Py_UNUSED(ig)) {
    return Py_BuildValue(
        "{sLsLsLsLsLsLsLsLsLsLsLsLsLsLsy#s(LLLLLLLL)sLsLsLsLsLsL}", "shots_emitted", (long long)c->s_emit, "shots_answered",
        (long long)c->s_ans, "frames_sent", (long long)c->frames_sent, "late_frames", (long long)c->late,
        "max_lag_ns", (long long)c->max_lag, "reasks", (long long)c->reasks, "deadline_misses", (long long)c->misses,
        "bad_answers", (long long)c->bad_answers, "full_waits", (long long)c->full_waits, "t0_ns", (long long)c->t0,
        "t_end_ns", (long long)c->t_end, "counter", (long long)c->counter, "request_id", (long long)c->rid,
        "get_request_id", (long long)c->get_rid, "pauli_frame", (const char *)c->pauli, (Py_ssize_t)c->nbo, "statuses",
        (long long)c->statuses[0], (long long)c->statuses[1], (long long)c->statuses[2], (long long)c->statuses[3],
        (long long)c->statuses[4], (long long)c->statuses[5], (long long)c->statuses[6], (long long)c->statuses[7],
        "resent_gets", (long long)c->resends, "stale_answers", (long long)c->stale, "repairs", (long long)c->repairs,
        "resent_frames", (long long)c->resent_frames, "looks", (long long)c->pings, "frames_joined",
        (long long)c->io.joined);
}

/* start_ids(counter, request_id, get_request_id): where this run's ids start (before it runs) */
static PyObject *ctl_start_ids(ControllerCore *c, PyObject *args) {
    long long counter, rid, get_rid;
    if (!PyArg_ParseTuple(args, "LLL", &counter, &rid, &get_rid))
        return NULL;
    if (c->started) {
        PyErr_SetString(PyExc_RuntimeError, "start_ids() after the run started");
        return NULL;
    }
    c->counter = counter;
    c->rid = rid;
    c->get_rid = get_rid;
    Py_RETURN_NONE;
}

static PyObject *ctl_get_backlog_n(ControllerCore *c, void *Py_UNUSED(x)) { return PyLong_FromLongLong(c->backlog_n); }

static PyMethodDef ctl_methods[] = {
    {"run", (PyCFunction)ctl_run, METH_O,
     "run(budget_ns) -> 0 done, 1 no progress for stall_ns or budget spent (look at the peer, call again), "
     "-1 peer closed, -2 an answer that is not a whole message"},
    {"stats", (PyCFunction)ctl_stats, METH_NOARGS, "counters of the run"},
    {"start_ids", (PyCFunction)ctl_start_ids, METH_VARARGS,
     "start_ids(counter, request_id, get_request_id): where the run's ids start (before it runs)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ctl_getset[] = {
    {"backlog_samples", (getter)ctl_get_backlog_n, NULL, "backlog rows recorded", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ControllerCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "qlink.qec._hotcore.ControllerCore",
    .tp_basicsize = sizeof(ControllerCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "ControllerCore(...): the controller emulator's emit / answer / apply loop",
    .tp_traverse = (traverseproc)ctl_traverse,
    .tp_clear = (inquiry)ctl_clear,
    .tp_dealloc = (destructor)ctl_dealloc,
    .tp_init = (initproc)ctl_init,
    .tp_new = PyType_GenericNew,
    .tp_methods = ctl_methods,
    .tp_getset = ctl_getset,
};

