/* qlink.qec._hotcore: a pipelined service run -- frames taken in on one CPU, shots decoded on another.
 * (part of the one translation unit _hotcore.c, which includes it: not compiled on its own)
 *
 * A single-threaded service takes a frame in, and while it does its decoder waits; while it
 * decodes, frames wait. Flat out, that costs the service its ingest time on every shot. A
 * ServiceCore made with ingest_cpu >= 0 runs its frames in a thread of its own, pinned to
 * that CPU, while the thread that called run() (holding the GIL) only calls the decoder:
 *
 *   ingest thread     peek / validate / accumulate a frame; a completed shot's bits go to
 *                     its queue slot and the decoder's tail is published (release); a get
 *                     whose shot is not decoded yet is held back and answered as soon as
 *                     the decoded count (acquire) passes it. It never calls into Python, and
 *                     gives its CPU away whenever it waits (that CPU may be the
 *                     controller's: on a 2-core host, the only other one).
 *   decoding thread   every configured decoder with shots between `decoded` and the tail
 *                     published: one batch call over them (split where the slots wrap),
 *                     their flips and stamps written, `decoded` published (release).
 *
 * Each queue slot is written by one thread at a time: its bits by the ingest thread before
 * the tail passes it, its flips by the decoding thread before `decoded` passes it, and read
 * back by the ingest thread only after. A reset has the decoding thread stand still
 * (pipe_hold) while the queue is emptied under it. When the ingest thread stops (svc_run's
 * codes: idle, the ring's head needs Python, the peer closed, max_frames), the calling
 * thread joins it and settles what is left single-threaded, as svc_run would.
 *
 * Only batch decoders on an shm ring are pipelined (svc_pipe_refusal says why not); any
 * other service runs single-threaded, whatever ingest_cpu says.
 */

#include <pthread.h>

/* Why this service's run cannot be pipelined, or NULL when it can. */
static const char *svc_pipe_refusal(const ServiceCore *s) {
    if (s->io.kind != IO_RING)
        return "only a shared-memory ring link is pipelined";
    if (s->kept != NULL)
        return "a datagram link's kept answers are not pipelined";
    int any = 0;
    for (int i = 0; i < 64; i++) {
        const SvcDecoder *d = &s->dec[i];
        if (!d->configured)
            continue;
        any = 1;
        if (d->batch_fn == NULL)
            return "a decoder without a batch call is not pipelined";
        if (d->win != NULL)
            return "a sliding-window decoder is not pipelined";
        if (d->map != NULL)
            return "a measurement-level decoder is not pipelined";
    }
    return any ? NULL : "no decoder is configured";
}

/* The ingest thread: svc_run's frame loop, without Python. Ends with svc_run's codes. */
static void *svc_ingest_main(void *arg) {
    ServiceCore *s = (ServiceCore *)arg;
    tl_ingest = 1;
    if (s->ingest_cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(s->ingest_cpu, &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set); /* (refused: it runs where it may) */
    }
    long long frames = 0, max_frames = s->pipe_max_frames;
    int64_t idle_ns = s->pipe_idle_ns;
    int64_t t_idle0 = mono_ns();
    unsigned spins = 1;
    int code;
    s->t_ready = t_idle0;
    for (;;) {
        const uint8_t *data;
        uint32_t n;
        int rc = io_peek(&s->io, &data, &n);
        if (rc == QLINK_RING_MSG) {
            svc_handle(s, data, n, svc_frame_time(s, &spins, t_idle0));
            io_consume(&s->io);
            if (s->n_defer > s->defer_first)
                svc_settle_ready(s);
            if (max_frames > 0 && ++frames >= max_frames) {
                code = 3;
                break;
            }
            continue;
        }
        if ((code = svc_stop_code(rc)) != RUN_GO_ON)
            break;
        int waiting = s->n_defer > s->defer_first;
        if (waiting && svc_settle_ready(s))
            spins = 1; /* answers went out: the clock of idleness starts again */
        if (spins++ == 0 || waiting)
            t_idle0 = mono_ns(); /* (gets still held back: not idle) */
        if ((spins & 63) == 0) {
            if (io_peer_closed(&s->io)) {
                code = 2;
                break;
            }
            if (mono_ns() - t_idle0 > idle_ns) {
                code = 0;
                break;
            }
            sched_yield(); /* nothing to take in: the CPU to whoever else wants it */
        }
        CPU_RELAX();
    }
    s->pipe_code = code;
    st_rel_int(&s->pipe_done, 1);
    return NULL;
}

/* run() of a pipelined service: the ingest thread started, this thread decoding until it
 * ends, then what is left settled here. */
static PyObject *svc_run_piped(ServiceCore *s, long long idle_ns, long long max_frames) {
    pthread_t th;
    s->pipe_idle_ns = idle_ns;
    s->pipe_max_frames = max_frames;
    s->pipe_done = s->pipe_pause = s->pipe_paused = 0;
    s->piped = 1;
    int ids[64], nd = 0;
    for (int i = 0; i < 64; i++)
        if (s->dec[i].configured)
            ids[nd++] = i;
    int err = pthread_create(&th, NULL, svc_ingest_main, s);
    if (err != 0) {
        s->piped = 0;
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    s->piped_runs++;
    PyThreadState *ts = NULL;
    int64_t t_idle0 = mono_ns(), t_yield = t_idle0;
    unsigned spins = 0;
    for (;;) {
        if (ld_acq_int(&s->pipe_pause)) { /* the ingest thread changes a queue: stand still */
            st_rel_int(&s->pipe_paused, 1);
            while (ld_acq_int(&s->pipe_pause))
                sched_yield();
            st_rel_int(&s->pipe_paused, 0);
        }
        int did = 0;
        for (int j = 0; j < nd; j++) {
            SvcDecoder *d = &s->dec[ids[j]];
            uint64_t tail = ld_acq64(&d->tail);
            if (d->decoded >= tail)
                continue;
            if (ts) {
                PyEval_RestoreThread(ts);
                ts = NULL;
            }
            svc_decode_upto(s, d, tail);
            did = 1;
        }
        if (did) {
            spins = 0;
            int64_t now = mono_ns();
            if (now - t_yield > 1000000) { /* busy a long while: let a thread waiting for the GIL in */
                t_yield = now;
                PyThreadState *y = PyEval_SaveThread();
                PyEval_RestoreThread(y);
            }
            continue;
        }
        if (ld_acq_int(&s->pipe_done))
            break;
        if (spins++ == 0)
            t_idle0 = mono_ns();
        if ((spins & 63) == 0 && ts == NULL && mono_ns() - t_idle0 > 50000)
            ts = PyEval_SaveThread(); /* idle for 50 us: other threads of this process may run */
        CPU_RELAX();
    }
    if (ts == NULL)
        ts = PyEval_SaveThread();
    pthread_join(th, NULL);
    PyEval_RestoreThread(ts);
    s->piped = 0;
    s->pending = 0; /* what the ingest thread queued after the last pass: settled here, at once */
    for (int j = 0; j < nd; j++)
        s->pending += (int64_t)(s->dec[ids[j]].tail - s->dec[ids[j]].decoded);
    svc_settle(s);
    io_flush(&s->io);
    return PyLong_FromLong(s->pipe_code);
}
