/* qlink.qec._hotcore: many sessions served at once from one thread, each a ServiceCore over a
 * link of its own, none waited on inside another.
 * (part of the one translation unit _hotcore.c, which includes it: not compiled on its own)
 *
 * serve_sessions(cores, wake, epoll_fd, wake_fd, period_ns, frame_timeout_ns, idle_timeout_ns,
 *                quantum, low_quantum) -> (code, index)
 *
 * Each pass gives every session with input a turn: at most `quantum` frames, then its shots
 * are decoded and its answers written, then the next session's turn. A session whose last
 * turn took all it was given (it sends faster than it is served) is "heavy": it takes its
 * turns after the others, `low_quantum` frames each, so a well-behaved controller's frame
 * waits behind at most a few of a flooder's. Socket links are looked at through `epoll_fd`
 * (the caller registers each session's fd; -1: every link is looked at each pass), rings and
 * UCX endpoints every pass. It returns to the caller (the control plane) when:
 *   SS_PERIOD    period_ns went by (the caller looks at peers, stop flags, session clocks)
 *   SS_SLOW      session `index` has a frame for the endpoint's own code at its head
 *   SS_CLOSED    session `index`'s peer closed or is gone
 *   SS_OVERSIZED session `index` announced a message longer than its cap (refused unread)
 *   SS_WAKE      wake[0] was set, or wake_fd became readable (new sessions to let in)
 *   SS_FRAME_TIMEOUT, SS_IDLE_TIMEOUT  session `index`'s clocks ran out
 *   SS_BLOCKED   session `index`'s answers found its link full: the peer does not read
 * Sessions must be made with answer_block_s=0 (a full link is never waited on). The GIL is
 * let go while no session has input for 50 us, and for a moment every millisecond of work. */

#include <sys/epoll.h>

enum { SS_PERIOD, SS_SLOW, SS_CLOSED, SS_OVERSIZED, SS_WAKE, SS_FRAME_TIMEOUT, SS_IDLE_TIMEOUT, SS_BLOCKED };
#define SS_EVENTS 64

/* one session's turn: up to q frames. Returns the frames handled; *code set when the session
 * needs the control plane. */
static int ss_turn(ServiceCore *s, int q, PyThreadState **ts, int *code) {
    const uint8_t *data;
    uint32_t n;
    int got = 0;
    while (got < q) {
        int rc = io_peek(&s->io, &data, &n);
        if (rc == QLINK_RING_MSG) {
            if (*ts) {
                PyEval_RestoreThread(*ts);
                *ts = NULL;
            }
            int64_t t_in = 0;
            if (s->was_empty) { /* it ended a wait: the frame's time, and ready since */
                t_in = mono_ns();
                s->t_ready = t_in;
                s->was_empty = 0;
            } else {
                s->t_ready = 0;
            }
            s->io.partial_since = 0;
            svc_handle(s, data, n, t_in);
            io_consume(&s->io);
            got++;
            if (got < q && svc_decode_now(s)) /* (a turn's last frame: decoded just below) */
                svc_settle(s);
            continue;
        }
        if (rc == QLINK_RING_EMPTY) {
            s->was_empty = 1;
            if (s->io.kind == IO_FD && s->io.in_w > s->io.in_r) { /* half a message is here: its clock */
                if (s->io.partial_since == 0)
                    s->io.partial_since = mono_ns();
            } else {
                s->io.partial_since = 0;
            }
        } else if (rc == QLINK_RING_OTHER) {
            *code = SS_SLOW;
        } else if (rc == IO_CLOSED && s->io.oversized != s->oversized_seen) {
            s->oversized_seen = s->io.oversized;
            *code = SS_OVERSIZED;
        } else {
            *code = SS_CLOSED; /* IO_CLOSED, or the ring went away */
        }
        break;
    }
    if (got) {
        if (s->pending > 0 || s->n_defer > 0)
            svc_settle(s);
        if (s->io.out_n && io_flush(&s->io) < 0 && *code < 0)
            *code = SS_CLOSED;
        s->last_active_ns = mono_ns();
        if (s->counts[C_F_ANSWER_BLOCKED] != s->blocked_seen) {
            s->blocked_seen = s->counts[C_F_ANSWER_BLOCKED];
            if (*code < 0)
                *code = SS_BLOCKED;
        }
    }
    s->heavy = got >= q;
    s->again = got >= q;
    return got;
}

static inline int ss_polled(ServiceCore *s) { return s->io.kind == IO_RING || s->io.kind == IO_UCX; }

static PyObject *mod_serve_sessions(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *seq_in;
    Py_buffer wake;
    int epfd, wake_fd, quantum, low_quantum;
    long long period_ns, frame_timeout_ns, idle_timeout_ns;
    if (!PyArg_ParseTuple(args, "Ow*iiLLLii:serve_sessions", &seq_in, &wake, &epfd, &wake_fd, &period_ns,
                          &frame_timeout_ns, &idle_timeout_ns, &quantum, &low_quantum))
        return NULL;
    PyObject *seq = PySequence_Tuple(seq_in); /* (a copy: the caller's list may change meanwhile) */
    if (seq == NULL || wake.len < 1 || quantum < 1 || low_quantum < 1) {
        if (seq != NULL)
            PyErr_SetString(PyExc_ValueError, "serve_sessions: wake needs a byte; quantum and low_quantum >= 1");
        Py_XDECREF(seq);
        PyBuffer_Release(&wake);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    ServiceCore **cores = PyMem_Calloc((size_t)n + 1, sizeof(ServiceCore *));
    int max_fd = wake_fd;
    for (Py_ssize_t i = 0; i < n && cores != NULL; i++) {
        PyObject *o = PyTuple_GET_ITEM(seq, i);
        if (!PyObject_TypeCheck(o, &ServiceCoreType)) {
            PyErr_SetString(PyExc_TypeError, "serve_sessions: every session must be a ServiceCore");
            PyMem_Free(cores);
            Py_DECREF(seq);
            PyBuffer_Release(&wake);
            return NULL;
        }
        cores[i] = (ServiceCore *)o;
        if (!ss_polled(cores[i]) && cores[i]->io.fd > max_fd)
            max_fd = cores[i]->io.fd;
    }
    /* fd -> session, for what epoll reports */
    int *by_fd = cores == NULL ? NULL : PyMem_Malloc(((size_t)max_fd + 2) * sizeof(int));
    if (cores == NULL || by_fd == NULL) {
        PyMem_Free(cores);
        Py_DECREF(seq);
        PyBuffer_Release(&wake);
        return PyErr_NoMemory();
    }
    for (int f = 0; f <= max_fd + 1; f++)
        by_fd[f] = -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!ss_polled(cores[i]) && cores[i]->io.fd >= 0)
            by_fd[cores[i]->io.fd] = (int)i;
    volatile uint8_t *wk = (volatile uint8_t *)wake.buf;
    struct epoll_event ev[SS_EVENTS];
    int64_t t0 = mono_ns(), t_idle0 = t0, t_yield = t0;
    unsigned spins = 1, passes = 0;
    PyThreadState *ts = NULL;
    int code = -1, at = -1;
    for (;;) {
        int busy = 0, woke = 0;
        if (epfd >= 0) {
            int k = epoll_wait(epfd, ev, SS_EVENTS, 0);
            for (int e = 0; e < k; e++) {
                int fd = ev[e].data.fd;
                if (fd == wake_fd) {
                    woke = 1; /* (after this pass: what the sessions already hold goes first) */
                } else if (fd >= 0 && fd <= max_fd && by_fd[fd] >= 0) {
                    cores[by_fd[fd]]->again = 1;
                }
            }
        }
        /* the well-behaved sessions' turns first, then those that flood, a little each */
        for (int pass = 0; pass < 2 && code < 0; pass++) {
            for (Py_ssize_t i = 0; i < n; i++) {
                ServiceCore *s = cores[i];
                if (s->heavy != pass || !(s->again || ss_polled(s) || epfd < 0))
                    continue;
                int q = (pass && n > 1) ? low_quantum : quantum;
                if (ss_turn(s, q, &ts, &code))
                    busy = 1;
                if (code >= 0) {
                    at = (int)i;
                    break;
                }
            }
        }
        if (code >= 0)
            break;
        if (woke) {
            code = SS_WAKE;
            break;
        }
        if (busy) {
            spins = 0;
            if ((++passes & 63) != 0)
                continue;
        } else if (spins++ == 0) {
            t_idle0 = mono_ns();
        }
        if (!busy && (spins & 63) != 0) {
            CPU_RELAX();
            continue;
        }
        /* every 64 passes: the clocks, the wake flag, answers still to write */
        int64_t now = mono_ns();
        /* the sessions' clocks first: a wake flag or a period that ended at every check would
         * otherwise return before them, call after call, and never look at them */
        for (Py_ssize_t i = 0; i < n && code < 0; i++) {
            ServiceCore *s = cores[i];
            if (io_flush(&s->io) < 0 || io_peer_closed(&s->io))
                code = SS_CLOSED;
            else if (frame_timeout_ns > 0 && s->io.partial_since && now - s->io.partial_since >= frame_timeout_ns)
                code = SS_FRAME_TIMEOUT;
            else if (idle_timeout_ns > 0 && now - s->last_active_ns >= idle_timeout_ns)
                code = SS_IDLE_TIMEOUT;
            if (code >= 0)
                at = (int)i;
        }
        if (code >= 0)
            break;
        if (*wk) {
            code = SS_WAKE;
            break;
        }
        if (now - t0 >= period_ns) {
            code = SS_PERIOD;
            break;
        }
        if (busy) {
            if (now - t_yield > 1000000) { /* busy a long while: let a thread waiting for the GIL in */
                t_yield = now;
                PyThreadState *y = PyEval_SaveThread();
                PyEval_RestoreThread(y);
            }
        } else if (ts == NULL && now - t_idle0 > 50000) {
            ts = PyEval_SaveThread();
        }
        CPU_RELAX();
    }
    if (ts)
        PyEval_RestoreThread(ts);
    for (Py_ssize_t i = 0; i < n; i++)
        io_flush(&cores[i]->io);
    PyMem_Free(by_fd);
    PyMem_Free(cores);
    Py_DECREF(seq);
    PyBuffer_Release(&wake);
    return Py_BuildValue("(ii)", code, at);
}
