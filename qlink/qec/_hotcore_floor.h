/* qlink.qec._hotcore: the floors measured beside the loop (a bare round trip, a udp pair).
 * (part of the one translation unit _hotcore.c, which includes it: not compiled on its own) */

/* ================================================================== floor */

/* link_round_trip(link, n, nbytes, echo, out, hold_ns=0, pause_ns=0): the bare round trip of
 * whole messages over the same link (rings or a stream socket) through the same I/O the cores
 * use: the floor of a frame and its answer. echo=1 on the answering side (it returns after n
 * messages). out: int64 per round trip (initiator). Each message goes out at once (no
 * gathering). hold_ns (answering side): a busy spin of that long before each answer, the
 * stand-in for a decoder call of that length (holds: an int64 array of such spins, taken in
 * turn: a decoder's own call times); pause_ns (initiator): a busy spin of that long
 * between round trips, the stand-in for a shot's rounds, each round trip then timed from
 * when it was due (a reaction counts from its last round's tick, however late the controller
 * sent it) -- together the lock-step loop's shape with no qlink software in it, whose tail is
 * the host's. */
static PyObject *mod_link_round_trip(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *link, *out;
    PyObject *holds_obj = Py_None;
    long long n, nbytes, hold_ns = 0, pause_ns = 0;
    int echo;
    if (!PyArg_ParseTuple(args, "OLLpO|LLO", &link, &n, &nbytes, &echo, &out, &hold_ns, &pause_ns, &holds_obj))
        return NULL;
    if (hold_ns < 0 || pause_ns < 0) {
        PyErr_SetString(PyExc_ValueError, "hold_ns and pause_ns must be >= 0");
        return NULL;
    }
    Py_buffer hb;
    const int64_t *holds = NULL;
    Py_ssize_t nholds = 0;
    if (holds_obj != Py_None) {
        if (PyObject_GetBuffer(holds_obj, &hb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            return NULL;
        if (hb.itemsize != 8 || hb.len < 8) {
            PyBuffer_Release(&hb);
            PyErr_SetString(PyExc_ValueError, "holds: a non-empty int64 array of ns");
            return NULL;
        }
        holds = hb.buf;
        nholds = hb.len / 8;
    }
    if (nbytes < 1 || nbytes > 4096) {
        PyErr_SetString(PyExc_ValueError, "nbytes in 1..4096");
        return NULL;
    }
    Io io;
    if (io_init(&io, link) < 0) {
        io_free(&io);
        if (holds)
            PyBuffer_Release(&hb);
        return NULL;
    }
    Py_buffer ob;
    int has_out = 0;
    if (!echo) {
        if (PyObject_GetBuffer(out, &ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            io_free(&io);
            return NULL;
        }
        has_out = 1;
        if (ob.len < 8 * n) {
            PyBuffer_Release(&ob);
            io_free(&io);
            if (holds)
                PyBuffer_Release(&hb);
            PyErr_SetString(PyExc_ValueError, "out too small");
            return NULL;
        }
    }
    uint8_t msg[4096];
    memset(msg, 0x5A, sizeof(msg));
    int code = 0;
    Py_BEGIN_ALLOW_THREADS;
    int64_t t_end = mono_ns();
    for (long long i = 0; i < n && code == 0; i++) {
        int64_t t0;
        if (pause_ns && !echo) { /* timed from when it was due, as a reaction is from its tick */
            t0 = t_end + pause_ns;
            while (mono_ns() < t0)
                CPU_RELAX();
        } else {
            t0 = mono_ns();
        }
        if (!echo && (io_send(&io, msg, (uint64_t)nbytes, NULL, 0) != QLINK_RING_SENT || io_flush(&io) < 0)) {
            code = -1;
            break;
        }
        const uint8_t *d;
        uint32_t len;
        int64_t waited = 0;
        for (;;) {
            int rc = io_peek(&io, &d, &len);
            if (rc == QLINK_RING_MSG)
                break;
            if (rc != QLINK_RING_EMPTY || ((++waited & 1023) == 0 && io_peer_closed(&io))) {
                code = -1;
                break;
            }
            CPU_RELAX();
        }
        if (code)
            break;
        io_consume(&io);
        if (echo) {
            int64_t h = holds ? holds[i % nholds] : hold_ns;
            if (h > 0) {
                int64_t th = mono_ns();
                while (mono_ns() - th < h)
                    CPU_RELAX();
            }
            if (io_send(&io, msg, (uint64_t)nbytes, NULL, 0) != QLINK_RING_SENT || io_flush(&io) < 0)
                code = -1;
        } else {
            t_end = mono_ns();
            ((int64_t *)ob.buf)[i] = t_end - t0;
        }
    }
    while (io_flush(&io) == 1) /* (a stream: what is left of the last answer) */
        CPU_RELAX();
    Py_END_ALLOW_THREADS;
    if (has_out)
        PyBuffer_Release(&ob);
    if (holds)
        PyBuffer_Release(&hb);
    io_free(&io);
    return PyLong_FromLong(code);
}

/* udp_blast(fd, n, nbytes, period_ns, batch) -> (sent, t_first_ns, t_last_ns, full_waits): the
 * kernel floor's sender. n datagrams of nbytes on a connected datagram socket, the i-th due
 * at t0 + i * period_ns (0: at once), every datagram due sent in one sendmmsg of at most
 * `batch`. Each datagram carries its sequence number in its first 8 bytes. */
static PyObject *mod_udp_blast(PyObject *Py_UNUSED(m), PyObject *args) {
    int fd, batch;
    long long n, nbytes, period_ns;
    if (!PyArg_ParseTuple(args, "iLLLi", &fd, &n, &nbytes, &period_ns, &batch))
        return NULL;
    if (nbytes < 8 || nbytes > 1400 || batch < 1 || batch > DG_SLOTS || n < 1 || period_ns < 0) {
        PyErr_SetString(PyExc_ValueError, "udp_blast: nbytes in 8..1400, batch in 1..32, n >= 1, period_ns >= 0");
        return NULL;
    }
    static uint8_t buf[DG_SLOTS][1400];
    struct mmsghdr msg[DG_SLOTS];
    struct iovec iov[DG_SLOTS];
    memset(msg, 0, sizeof(msg));
    for (int i = 0; i < DG_SLOTS; i++) {
        memset(buf[i], 0x5A, sizeof(buf[i]));
        iov[i].iov_base = buf[i];
        iov[i].iov_len = (size_t)nbytes;
        msg[i].msg_hdr.msg_iov = &iov[i];
        msg[i].msg_hdr.msg_iovlen = 1;
    }
    long long sent = 0, waits = 0;
    int64_t t0 = 0, t1 = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS;
    t0 = mono_ns();
    while (sent < n) {
        int64_t now = mono_ns();
        long long due = period_ns ? (now - t0) / period_ns + 1 : n;
        if (due > n)
            due = n;
        long long k = due - sent;
        if (k <= 0) {
            CPU_RELAX();
            continue;
        }
        if (k > batch)
            k = batch;
        for (long long i = 0; i < k; i++) {
            long long seq = sent + i;
            memcpy(buf[i], &seq, 8);
        }
        int r = sendmmsg(fd, msg, (unsigned)k, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r > 0) {
            sent += r;
            continue;
        }
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS || errno == EINTR ||
                      errno == ECONNREFUSED)) {
            waits++;
            continue;
        }
        err = errno;
        break;
    }
    t1 = mono_ns();
    Py_END_ALLOW_THREADS;
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("LLLL", sent, (long long)t0, (long long)t1, waits);
}

/* udp_sink(fd, n, idle_ns) -> (received, t_first_ns, t_last_ns, batches): the kernel floor's
 * receiver, recvmmsg in batches of up to 32 (spinning, non-blocking) until n datagrams came or
 * none came for idle_ns after the first. */
static PyObject *mod_udp_sink(PyObject *Py_UNUSED(m), PyObject *args) {
    int fd;
    long long n, idle_ns;
    if (!PyArg_ParseTuple(args, "iLL", &fd, &n, &idle_ns))
        return NULL;
    static uint8_t buf[DG_SLOTS][2048];
    struct mmsghdr msg[DG_SLOTS];
    struct iovec iov[DG_SLOTS];
    long long got = 0, batches = 0;
    int64_t t_first = 0, t_last = 0, t_wait0 = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS;
    t_wait0 = mono_ns();
    while (got < n) {
        memset(msg, 0, sizeof(msg));
        for (int i = 0; i < DG_SLOTS; i++) {
            iov[i].iov_base = buf[i];
            iov[i].iov_len = sizeof(buf[i]);
            msg[i].msg_hdr.msg_iov = &iov[i];
            msg[i].msg_hdr.msg_iovlen = 1;
        }
        int r = recvmmsg(fd, msg, DG_SLOTS, MSG_DONTWAIT, NULL);
        if (r > 0) {
            int64_t now = mono_ns();
            if (got == 0)
                t_first = now;
            t_last = now;
            got += r;
            batches++;
            continue;
        }
        if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            err = errno;
            break;
        }
        int64_t now = mono_ns();
        if (now - (got ? t_last : t_wait0) > (got ? idle_ns : 10 * idle_ns + 5000000000LL))
            break;
        CPU_RELAX();
    }
    Py_END_ALLOW_THREADS;
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("LLLL", got, (long long)t_first, (long long)t_last, batches);
}

/* map_records(table, num_detectors, records, out) -> ns: the service core's measurement ->
 * detector map (map_record, the very code a measurement-level shot goes through) over every
 * row of records ((n, record bytes) uint8), the detectors of each row written to out ((n,
 * words) uint64); the wall time of the whole loop in ns. What the map adds to a shot, apart
 * from everything else the service does. */
static PyObject *mod_map_records(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *table, *records, *out;
    long long ndet;
    if (!PyArg_ParseTuple(args, "OLOO", &table, &ndet, &records, &out))
        return NULL;
    Py_buffer t, r, o;
    if (PyObject_GetBuffer(table, &t, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(records, &r, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) {
        PyBuffer_Release(&t);
        return NULL;
    }
    if (PyObject_GetBuffer(out, &o, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&t);
        PyBuffer_Release(&r);
        return NULL;
    }
    int64_t words = (ndet + 63) / 64;
    int64_t n = r.ndim == 2 ? (int64_t)r.shape[0] : 0, nbd = r.ndim == 2 ? (int64_t)r.shape[1] : 0;
    PyObject *res = NULL;
    if (ndet < 1 || n < 1 || t.len != (Py_ssize_t)(nbd * 256 * words * 8) || o.len < (Py_ssize_t)(n * words * 8)) {
        PyErr_SetString(PyExc_ValueError, "map_records: the table must be (record bytes * 256, words) uint64, the "
                                          "records (n, record bytes) uint8 and out (n, words) uint64");
    } else {
        const uint64_t *rows = (const uint64_t *)t.buf;
        const uint8_t *rec = (const uint8_t *)r.buf;
        uint64_t *dst = (uint64_t *)o.buf;
        int64_t t0 = mono_ns();
        for (int64_t i = 0; i < n; i++)
            map_record(rows, words, rec + i * nbd, nbd, dst + i * words);
        res = PyLong_FromLongLong(mono_ns() - t0);
    }
    PyBuffer_Release(&t);
    PyBuffer_Release(&r);
    PyBuffer_Release(&o);
    return res;
}
