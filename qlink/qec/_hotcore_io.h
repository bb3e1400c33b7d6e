/* qlink.qec._hotcore: the I/O under both cores: shm rings (through transports._ringc's C API) or a stream or datagram socket, with tcp's framing.
 * (part of the one translation unit _hotcore.c, which includes it: not compiled on its own) */

/* ------------------------------------------------------------------ I/O: shm rings or a stream socket */

/* A core moves whole frames through one of two kinds of link:
 *  - an shm endpoint's two rings (the ring C API: no system call per frame);
 *  - a connected stream socket carrying qlink's tcp framing (transports/_framing.py: a
 *    32-byte header, kind MSG, then the frame). Input is read in large chunks and parsed
 *    in place; output is gathered and written when the core has nothing else to do (or the
 *    buffer fills), so a side that falls behind writes several whole frames per call, each
 *    frame still stamped at its own time. */
static struct {
    int set;
    uint8_t kind_msg, kind_bye;
    uint64_t max_payload;
} TW; /* tcp framing, from transports._framing.native_layout() */

#define IO_RING 0
#define IO_FD 1
#define IO_DGRAM 2
#define IO_UCX 3
#define IO_IN_NBYTES (4u << 20)
#define IO_OUT_NBYTES (1u << 20)
#define IO_CLOSED (-2)
/* datagrams: one frame per datagram (qlink's udp wire: nothing added), received and sent in
 * batches of up to DG_SLOTS through recvmmsg / sendmmsg */
#define DG_SLOTS 32
#define DG_MAX 65536 /* holds any datagram */
#define DG_PAYLOAD_MAX (DG_MAX - 29) /* (65,507: an IPv4 datagram's most) */
#define DG_SOCKBUF_NBYTES (4 << 20)
#define IO_JOIN_MAX 65536 /* the most join_nbytes can be */

typedef struct {
    int kind;
    PyObject *rx, *tx; /* rings (IO_RING) */
    int fd;            /* IO_FD, IO_DGRAM */
    uint8_t *in, *out;
    size_t in_r, in_w, out_n, out_sent;
    int eof;
    uint64_t oversized, foreign, writes, reads;
    /* IO_DGRAM: received datagrams [dg_r, dg_n) in slots of `in`; gathered ones [dg_sent,
     * dg_out) at out; the peer's address where the socket is not connected (a listener's) */
    struct mmsghdr *dg_in_msg, *dg_out_msg;
    struct iovec *dg_in_iov, *dg_out_iov;
    struct sockaddr_storage *dg_in_addr;
    int dg_nslots, dg_r, dg_n, dg_out, dg_sent;
    /* datagrams and rings: a message sent while join_nbytes > 0 goes behind the message before
     * it, not yet sent, where the two fit in that many bytes -- whole frames back to back, as a
     * stream carries them (a ring's are gathered at `out` and sent as one record at io_flush);
     * joined counts them */
    uint32_t join_nbytes;
    uint64_t joined;
    struct sockaddr_storage peer;
    socklen_t peer_len;
    int has_peer;
    uint64_t refused;
    /* datagrams received before the core took the socket: read first, from `pre` */
    uint8_t *pre;
    size_t *pre_off, *pre_len;
    int pre_n, pre_r;
    struct UcxIo *ux; /* IO_UCX */
    /* IO_FD: the read-ahead buffer's size (in); the longest message taken (longer: refused
     * from its header, nothing read); since when a message has been half received (0: none) */
    size_t in_cap;
    uint64_t max_payload; /* (IO_RING: the largest record of its tx ring) */
    int64_t partial_since;
} Io;

/* ------------------------------------------------------------------ I/O: a UCX endpoint
 * transports.ucx's two-sided messages (tag K_MSG of the connection, the UCX message length
 * the frame's) through the UCP functions UCXX's library exports, called on the worker and
 * endpoint handles the endpoint hands over (transports.ucx UcxEndpoint.native_ucx): tagged
 * sends from a ring of staging slots, each reused once UCX is done with it; a message probed
 * and received whole into `in`. A control frame of the connection (K_CTRL: a close, a
 * wire-up) at the head is left for the endpoint's own code (QLINK_RING_OTHER). */
typedef struct {
    uint64_t sender_tag;
    size_t length;
} UcxInfo;
#define UX_SLOTS 128
#define UX_SLOT_NBYTES 8192
#define UX_IN_PROGRESS 1
#define UX_ERR_LAST ((uintptr_t)(-100)) /* UCS_PTR_IS_ERR: pointers at or above are status codes */
#define UX_KIND_SHIFT 56
#define UX_K_MSG 0x10
#define UX_MASK_MSG_OR_CTRL ((0xFEull << 56) | (0xFFFFFFull << 32) | 0xFFFFFFFFull)
typedef struct UcxIo {
    void *worker, *ep;
    uint64_t tx_tag, rx_tag;
    unsigned (*progress)(void *);
    void *(*probe)(void *, uint64_t, uint64_t, int, UcxInfo *);
    void *(*send)(void *, const void *, size_t, uint64_t, const void *);
    void *(*msg_recv)(void *, void *, size_t, void *, const void *);
    int (*check)(void *);
    void (*release)(void *);
    uint8_t param[256]; /* ucp_request_param_t, op_attr_mask 0: UCX's defaults */
    uint8_t *slots;
    void *req[UX_SLOTS];
    int next;
    int has; /* a message received into `in`, not yet consumed */
    uint32_t len;
} UcxIo;

static inline int ux_is_err(void *r) { return (uintptr_t)r >= UX_ERR_LAST; }

/* the request of slot i finished? (released then) 1 yes, 0 still in flight */
static int ux_reap(Io *io, int i) {
    UcxIo *u = io->ux;
    void *r = u->req[i];
    if (r == NULL)
        return 1;
    int st = u->check(r);
    if (st == UX_IN_PROGRESS)
        return 0;
    u->release(r);
    u->req[i] = NULL;
    if (st < 0)
        io->eof = 1;
    return 1;
}

/* progress until every staged send is done, for at most `limit_ns`; 1 all done */
static int ux_drain(Io *io, int64_t limit_ns) {
    int64_t t0 = mono_ns();
    for (;;) {
        int left = 0;
        for (int i = 0; i < UX_SLOTS; i++)
            left += !ux_reap(io, i);
        if (!left)
            return 1;
        io->ux->progress(io->ux->worker);
        if (mono_ns() - t0 > limit_ns)
            return 0;
    }
}

static void io_free(Io *io) {
    if (io->ux != NULL) {
        /* a send UCX still reads from its slot keeps the slots alive (left, not freed) */
        if (ux_drain(io, 1000000000LL))
            free(io->ux->slots);
        free(io->ux);
        io->ux = NULL;
    }
    Py_CLEAR(io->rx);
    Py_CLEAR(io->tx);
    PyMem_Free(io->in);
    PyMem_Free(io->out);
    PyMem_Free(io->dg_in_msg);
    PyMem_Free(io->dg_out_msg);
    PyMem_Free(io->dg_in_iov);
    PyMem_Free(io->dg_out_iov);
    PyMem_Free(io->dg_in_addr);
    PyMem_Free(io->pre);
    PyMem_Free(io->pre_off);
    PyMem_Free(io->pre_len);
    io->pre = NULL;
    io->pre_off = io->pre_len = NULL;
    io->in = io->out = NULL;
    io->dg_in_msg = io->dg_out_msg = NULL;
    io->dg_in_iov = io->dg_out_iov = NULL;
    io->dg_in_addr = NULL;
}

static int addr_eq(const struct sockaddr_storage *a, socklen_t alen, const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family)
        return 0;
    if (a->ss_family == AF_INET) {
        const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
        return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
    }
    if (a->ss_family == AF_INET6) {
        const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
        return x->sin6_port == y->sin6_port && memcmp(&x->sin6_addr, &y->sin6_addr, 16) == 0;
    }
    (void)alen;
    return 0;
}

/* link (fd, [datagrams already received from the peer], peer (host, port) or None) */
/* the messages (or datagrams) received before the core took the link, read first, from `pre` */
static int io_set_pre(Io *io, PyObject *left) {
    PyObject *seq = PySequence_Fast(left, "the messages already received must be a sequence of bytes");
    if (seq == NULL)
        return -1;
    Py_ssize_t nleft = PySequence_Fast_GET_SIZE(seq);
    size_t total = 0;
    for (Py_ssize_t i = 0; i < nleft; i++) {
        Py_ssize_t len = PyObject_Length(PySequence_Fast_GET_ITEM(seq, i));
        if (len < 0) {
            Py_DECREF(seq);
            return -1;
        }
        total += (size_t)len;
    }
    io->pre = PyMem_Malloc(total + 1);
    io->pre_off = PyMem_Calloc((size_t)nleft + 1, sizeof(size_t));
    io->pre_len = PyMem_Calloc((size_t)nleft + 1, sizeof(size_t));
    if (!io->pre || !io->pre_off || !io->pre_len) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    size_t at = 0;
    for (Py_ssize_t i = 0; i < nleft; i++) {
        Py_buffer b;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &b, PyBUF_SIMPLE) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        size_t n = (size_t)b.len;
        if (at + n > total)
            n = total - at;
        memcpy(io->pre + at, b.buf, n);
        io->pre_off[i] = at;
        io->pre_len[i] = n;
        at += n;
        PyBuffer_Release(&b);
    }
    Py_DECREF(seq);
    io->pre_n = (int)nleft;
    io->pre_r = 0;
    return 0;
}

static int io_init_dgram(Io *io, PyObject *link) {
    PyObject *fdo = PyTuple_GET_ITEM(link, 0), *left = PyTuple_GET_ITEM(link, 1), *peer = PyTuple_GET_ITEM(link, 2);
    io->kind = IO_DGRAM;
    io->fd = (int)PyLong_AsLong(fdo);
    if (io->fd < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "bad socket fd");
        return -1;
    }
    int ns = DG_SLOTS;
    io->dg_nslots = ns;
    io->in = PyMem_Malloc((size_t)ns * DG_MAX);
    io->out = PyMem_Malloc(IO_OUT_NBYTES);
    io->dg_in_msg = PyMem_Calloc((size_t)ns, sizeof(struct mmsghdr));
    io->dg_in_iov = PyMem_Calloc((size_t)ns, sizeof(struct iovec));
    io->dg_in_addr = PyMem_Calloc((size_t)ns, sizeof(struct sockaddr_storage));
    io->dg_out_msg = PyMem_Calloc(DG_SLOTS, sizeof(struct mmsghdr));
    io->dg_out_iov = PyMem_Calloc(DG_SLOTS, sizeof(struct iovec));
    if (!io->in || !io->out || !io->dg_in_msg || !io->dg_in_iov || !io->dg_in_addr || !io->dg_out_msg ||
        !io->dg_out_iov) {
        PyErr_NoMemory();
        return -1;
    }
    if (peer != Py_None) {
        const char *host;
        int port;
        if (!PyArg_ParseTuple(peer, "si", &host, &port)) {
                return -1;
        }
        memset(&io->peer, 0, sizeof(io->peer));
        struct sockaddr_in *a4 = (void *)&io->peer;
        struct sockaddr_in6 *a6 = (void *)&io->peer;
        if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
            a4->sin_family = AF_INET;
            a4->sin_port = htons((uint16_t)port);
            io->peer_len = sizeof(*a4);
        } else if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
            a6->sin6_family = AF_INET6;
            a6->sin6_port = htons((uint16_t)port);
            io->peer_len = sizeof(*a6);
        } else {
                PyErr_Format(PyExc_ValueError, "peer host %s is not a numeric IPv4 or IPv6 address", host);
            return -1;
        }
        io->has_peer = 1;
    }
    for (int i = 0; i < ns; i++) {
        io->dg_in_iov[i].iov_base = io->in + (size_t)i * DG_MAX;
        io->dg_in_iov[i].iov_len = DG_MAX;
        io->dg_in_msg[i].msg_hdr.msg_iov = &io->dg_in_iov[i];
        io->dg_in_msg[i].msg_hdr.msg_iovlen = 1;
    }
    for (int i = 0; i < DG_SLOTS; i++) {
        io->dg_out_msg[i].msg_hdr.msg_iov = &io->dg_out_iov[i];
        io->dg_out_msg[i].msg_hdr.msg_iovlen = 1;
        if (io->has_peer) {
            io->dg_out_msg[i].msg_hdr.msg_name = &io->peer;
            io->dg_out_msg[i].msg_hdr.msg_namelen = io->peer_len;
        }
    }
    if (io_set_pre(io, left) < 0)
        return -1;
    io->dg_n = io->dg_r = 0;
    /* room for a burst: the kernel caps it at net.core.rmem_max / wmem_max */
    int sz = DG_SOCKBUF_NBYTES;
    setsockopt(io->fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
    setsockopt(io->fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof(sz));
    return 0;
}

/* link ("ucx", worker handle, endpoint handle, tx tag, rx tag, (progress, probe, send,
 * msg_recv, check, release) function addresses, [messages already received]) */
static int io_init_ucx(Io *io, PyObject *link) {
    io->kind = IO_UCX;
    UcxIo *u = calloc(1, sizeof(UcxIo));
    io->ux = u;
    io->in = PyMem_Malloc(IO_IN_NBYTES);
    if (u == NULL || io->in == NULL || (u->slots = malloc((size_t)UX_SLOTS * UX_SLOT_NBYTES)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *fns = PyTuple_GET_ITEM(link, 5);
    u->worker = PyLong_AsVoidPtr(PyTuple_GET_ITEM(link, 1));
    u->ep = PyLong_AsVoidPtr(PyTuple_GET_ITEM(link, 2));
    u->tx_tag = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(link, 3));
    u->rx_tag = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(link, 4));
    if (PyErr_Occurred())
        return -1;
    if (!PyTuple_Check(fns) || PyTuple_GET_SIZE(fns) != 6 || u->worker == NULL || u->ep == NULL) {
        PyErr_SetString(PyExc_TypeError, "ucx link: (\"ucx\", worker, ep, tx_tag, rx_tag, 6 UCP function addresses, "
                                         "[messages])");
        return -1;
    }
    void *f[6];
    for (int i = 0; i < 6; i++) {
        f[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(fns, i));
        if (f[i] == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "ucx link: a UCP function address is NULL");
            return -1;
        }
    }
    u->progress = (unsigned (*)(void *))f[0];
    u->probe = (void *(*)(void *, uint64_t, uint64_t, int, UcxInfo *))f[1];
    u->send = (void *(*)(void *, const void *, size_t, uint64_t, const void *))f[2];
    u->msg_recv = (void *(*)(void *, void *, size_t, void *, const void *))f[3];
    u->check = (int (*)(void *))f[4];
    u->release = (void (*)(void *))f[5];
    return io_set_pre(io, PyTuple_GET_ITEM(link, 6));
}

/* link: a (tx, rx) pair of rings, (fd, leftover bytes already read from it) for a stream
 * socket, (fd, [datagrams already received], peer or None) for a datagram socket, or a UCX
 * endpoint's (see io_init_ucx) */
static int io_init(Io *io, PyObject *link) {
    memset(io, 0, sizeof(*io));
    io->in_cap = IO_IN_NBYTES;
    io->max_payload = TW.max_payload;
    PyObject *a, *b;
    if (PyTuple_Check(link) && PyTuple_GET_SIZE(link) == 7 && PyUnicode_Check(PyTuple_GET_ITEM(link, 0)))
        return io_init_ucx(io, link);
    if (PyTuple_Check(link) && PyTuple_GET_SIZE(link) == 3)
        return io_init_dgram(io, link);
    if (!PyTuple_Check(link) || PyTuple_GET_SIZE(link) != 2) {
        PyErr_SetString(PyExc_TypeError, "link must be (tx_ring, rx_ring), (socket_fd, leftover_bytes) or "
                                         "(socket_fd, [datagrams], peer)");
        return -1;
    }
    a = PyTuple_GET_ITEM(link, 0);
    b = PyTuple_GET_ITEM(link, 1);
    if (PyLong_Check(a)) {
        if (!TW.set) {
            PyErr_SetString(PyExc_RuntimeError, "call set_stream_layout(transports._framing.native_layout()) first");
            return -1;
        }
        io->kind = IO_FD;
        io->fd = (int)PyLong_AsLong(a);
        if (io->fd < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "bad socket fd");
            return -1;
        }
        io->in = PyMem_Malloc(IO_IN_NBYTES);
        io->out = PyMem_Malloc(IO_OUT_NBYTES);
        if (!io->in || !io->out) {
            PyErr_NoMemory();
            return -1;
        }
        Py_buffer lb;
        if (PyObject_GetBuffer(b, &lb, PyBUF_SIMPLE) < 0)
            return -1;
        if ((size_t)lb.len > IO_IN_NBYTES) {
            PyBuffer_Release(&lb);
            PyErr_SetString(PyExc_ValueError, "too many leftover bytes");
            return -1;
        }
        memcpy(io->in, lb.buf, (size_t)lb.len);
        io->in_w = (size_t)lb.len;
        PyBuffer_Release(&lb);
        return 0;
    }
    if (get_ring(a, "tx") || get_ring(b, "rx"))
        return -1;
    io->kind = IO_RING;
    io->out = PyMem_Malloc(IO_JOIN_MAX); /* (records gathered: see join_nbytes) */
    if (io->out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *mp = PyObject_GetAttrString(a, "max_payload");
    io->max_payload = mp != NULL ? PyLong_AsUnsignedLongLong(mp) : 0;
    Py_XDECREF(mp);
    if (PyErr_Occurred())
        return -1;
    Py_INCREF(a);
    Py_INCREF(b);
    io->tx = a;
    io->rx = b;
    return 0;
}

/* the gathered datagrams out, in batches (sendmmsg); as io_flush */
static int dg_flush(Io *io) {
    while (io->dg_sent < io->dg_out) {
        int k = sendmmsg(io->fd, io->dg_out_msg + io->dg_sent, (unsigned)(io->dg_out - io->dg_sent),
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k > 0) {
            io->dg_sent += k;
            io->writes++;
            continue;
        }
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS))
            return 1;
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && errno == ECONNREFUSED) { /* the peer's port is closed (ICMP): it is gone */
            io->refused++;
            io->eof = 1;
        }
        return -1;
    }
    io->dg_out = io->dg_sent = 0;
    io->out_n = 0;
    return 0;
}

/* a ring's gathered record out; 0 sent (or none), 1 the ring is full, -1 the peer is gone */
static int ring_flush(Io *io) {
    if (io->out_n == 0)
        return 0;
    int rc = RAPI->send(io->tx, io->out, io->out_n, NULL, 0);
    if (rc == QLINK_RING_SENT) {
        io->out_n = 0;
        return 0;
    }
    return rc == QLINK_RING_FULL ? 1 : -1;
}

/* write what is gathered; 0 all written, 1 some left (the socket is full), -1 the peer is gone */
static int io_flush(Io *io) {
    if (io->kind == IO_RING)
        return ring_flush(io);
    if (io->kind == IO_DGRAM)
        return io->dg_out ? dg_flush(io) : 0;
    if (io->kind == IO_UCX) { /* sends are posted at once: move them along */
        io->ux->progress(io->ux->worker);
        return io->eof ? -1 : 0;
    }
    if (io->kind != IO_FD || io->out_sent == io->out_n)
        return 0;
    while (io->out_sent < io->out_n) {
        ssize_t k = send(io->fd, io->out + io->out_sent, io->out_n - io->out_sent, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k > 0) {
            io->out_sent += (size_t)k;
            io->writes++;
            continue;
        }
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 1;
        if (k < 0 && errno == EINTR)
            continue;
        return -1;
    }
    io->out_n = io->out_sent = 0;
    return 0;
}

/* one whole frame out: a send code of the ring API */
/* progress until request r is done (released then) or a second has gone by (left as it is):
 * its status, UX_IN_PROGRESS when it did not finish */
static int ux_wait(UcxIo *u, void *r) {
    int64_t t0 = mono_ns();
    int st;
    unsigned k = 0;
    while ((st = u->check(r)) == UX_IN_PROGRESS) {
        u->progress(u->worker);
        if ((++k & 1023) == 0 && mono_ns() - t0 > 1000000000LL)
            return UX_IN_PROGRESS;
    }
    u->release(r);
    return st;
}

/* n1 bytes of p1 at `at`, then n2 of p2 (may be NULL when n2 is 0) right behind them */
static inline void put_two(uint8_t *at, const void *p1, uint64_t n1, const void *p2, uint64_t n2) {
    if (n1)
        memcpy(at, p1, n1);
    if (n2)
        memcpy(at + n1, p2, n2);
}

static int ux_send(Io *io, const void *p1, uint64_t n1, const void *p2, uint64_t n2) {
    UcxIo *u = io->ux;
    uint64_t n = n1 + n2;
    if (io->eof)
        return QLINK_RING_PEER_CLOSED;
    if (n > IO_IN_NBYTES) /* (more than a native peer takes whole) */
        return QLINK_RING_TOO_BIG;
    int i = u->next;
    uint8_t *buf;
    uint8_t *big = NULL;
    if (n <= UX_SLOT_NBYTES) {
        if (!ux_reap(io, i)) { /* the oldest slot still sending: let UCX move, else full */
            u->progress(u->worker);
            if (!ux_reap(io, i))
                return QLINK_RING_FULL;
        }
        if (io->eof)
            return QLINK_RING_PEER_CLOSED;
        buf = u->slots + (size_t)i * UX_SLOT_NBYTES;
    } else if ((buf = big = malloc(n)) == NULL) {
        return QLINK_RING_FULL;
    }
    put_two(buf, p1, n1, p2, n2);
    void *r = u->send(u->ep, buf, n, u->tx_tag, u->param);
    if (r != NULL && ux_is_err(r)) {
        free(big);
        io->eof = 1;
        return QLINK_RING_PEER_CLOSED;
    }
    if (big != NULL) { /* a large frame: sent before its buffer goes */
        if (r != NULL) {
            int st = ux_wait(u, r);
            if (st == UX_IN_PROGRESS) { /* not done within a second: the link is given up, the buffer kept */
                io->eof = 1;
                return QLINK_RING_PEER_CLOSED;
            }
            if (st < 0)
                io->eof = 1;
        }
        free(big);
    } else {
        u->req[i] = r;
        u->next = (i + 1) % UX_SLOTS;
    }
    io->writes++;
    return io->eof ? QLINK_RING_PEER_CLOSED : QLINK_RING_SENT;
}

static int io_send(Io *io, const void *p1, uint64_t n1, const void *p2, uint64_t n2) {
    if (io->kind == IO_RING) {
        uint64_t n = n1 + n2;
        if (!io->join_nbytes || io->out_n + n > io->join_nbytes) { /* what was gathered goes first */
            int rc = ring_flush(io);
            if (rc != 0)
                return rc > 0 ? QLINK_RING_FULL : QLINK_RING_PEER_CLOSED;
        }
        if (io->join_nbytes && io->out_n + n <= io->join_nbytes) { /* gathered: behind the others, or first */
            io->joined += io->out_n > 0;
            put_two(io->out + io->out_n, p1, n1, p2, n2);
            io->out_n += n;
            return QLINK_RING_SENT;
        }
        return RAPI->send(io->tx, p1, n1, p2, n2);
    }
    if (io->kind == IO_UCX)
        return ux_send(io, p1, n1, p2, n2);
    if (io->kind == IO_DGRAM) {
        uint64_t n = n1 + n2;
        if (n > DG_PAYLOAD_MAX)
            return QLINK_RING_TOO_BIG;
        if (io->eof)
            return QLINK_RING_PEER_CLOSED;
        if (io->join_nbytes && io->dg_out > io->dg_sent && io->out_n + n <= IO_OUT_NBYTES &&
            io->dg_out_iov[io->dg_out - 1].iov_len + n <= io->join_nbytes) {
            put_two(io->out + io->out_n, p1, n1, p2, n2); /* (the last gathered datagram ends there) */
            io->dg_out_iov[io->dg_out - 1].iov_len += n;
            io->out_n += n;
            io->joined++;
            return QLINK_RING_SENT;
        }
        if (io->dg_out == DG_SLOTS || io->out_n + n > IO_OUT_NBYTES) {
            int rc = dg_flush(io);
            if (rc < 0)
                return QLINK_RING_PEER_CLOSED;
            if (rc > 0)
                return QLINK_RING_FULL; /* (the batch stays whole: sent on the next flush) */
        }
        uint8_t *h = io->out + io->out_n;
        put_two(h, p1, n1, p2, n2);
        io->dg_out_iov[io->dg_out].iov_base = h;
        io->dg_out_iov[io->dg_out].iov_len = n;
        io->dg_out++;
        io->out_n += n;
        return QLINK_RING_SENT;
    }
    uint64_t need = 32 + n1 + n2;
    if (need > IO_OUT_NBYTES)
        return QLINK_RING_TOO_BIG;
    if (io->out_n + need > IO_OUT_NBYTES) {
        int rc = io_flush(io);
        if (rc < 0)
            return QLINK_RING_PEER_CLOSED;
        if (io->out_sent) { /* keep the unsent tail at the front */
            memmove(io->out, io->out + io->out_sent, io->out_n - io->out_sent);
            io->out_n -= io->out_sent;
            io->out_sent = 0;
        }
        if (io->out_n + need > IO_OUT_NBYTES)
            return QLINK_RING_FULL;
    }
    uint8_t *h = io->out + io->out_n;
    memset(h, 0, 32);
    h[0] = TW.kind_msg;
    uint64_t n = n1 + n2;
    memcpy(h + 8, &n, 8);
    put_two(h + 32, p1, n1, p2, n2);
    io->out_n += need;
    return QLINK_RING_SENT;
}

/* the frame at the head of the input: a peek code, or IO_CLOSED (peer gone, EOF or BYE) */
static int dg_peek(Io *io, const uint8_t **data, uint32_t *n) {
    if (io->pre_r < io->pre_n) {
        *data = io->pre + io->pre_off[io->pre_r];
        *n = (uint32_t)io->pre_len[io->pre_r];
        return QLINK_RING_MSG;
    }
    for (;;) {
        if (io->dg_r < io->dg_n) {
            int i = io->dg_r;
            if (io->has_peer && !addr_eq(&io->dg_in_addr[i], io->dg_in_msg[i].msg_hdr.msg_namelen, &io->peer)) {
                io->foreign++; /* another sender's datagram on a listener's socket: not ours, counted */
                io->dg_r++;
                continue;
            }
            *data = io->in + (size_t)i * DG_MAX;
            *n = io->dg_in_msg[i].msg_len;
            return QLINK_RING_MSG;
        }
        if (io->eof)
            return IO_CLOSED;
        int ns = io->dg_nslots < DG_SLOTS ? io->dg_nslots : DG_SLOTS;
        for (int i = 0; i < ns; i++) {
            struct msghdr *h = &io->dg_in_msg[i].msg_hdr;
            h->msg_name = io->has_peer ? &io->dg_in_addr[i] : NULL;
            h->msg_namelen = io->has_peer ? sizeof(struct sockaddr_storage) : 0;
            h->msg_flags = 0;
        }
        int k = recvmmsg(io->fd, io->dg_in_msg, (unsigned)ns, MSG_DONTWAIT, NULL);
        if (k > 0) {
            io->dg_n = k;
            io->dg_r = 0;
            io->reads++;
            continue;
        }
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return QLINK_RING_EMPTY;
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && errno == ECONNREFUSED) /* the peer's port is closed (ICMP): it is gone */
            io->refused++;
        io->eof = 1;
    }
}

static int ux_peek(Io *io, const uint8_t **data, uint32_t *n) {
    UcxIo *u = io->ux;
    if (io->pre_r < io->pre_n) {
        *data = io->pre + io->pre_off[io->pre_r];
        *n = (uint32_t)io->pre_len[io->pre_r];
        return QLINK_RING_MSG;
    }
    if (u->has) {
        *data = io->in;
        *n = u->len;
        return QLINK_RING_MSG;
    }
    if (io->eof)
        return IO_CLOSED;
    for (int k = 0; k < 2; k++) {
        UcxInfo info;
        if (u->probe(u->worker, u->rx_tag, UX_MASK_MSG_OR_CTRL, 0, &info) != NULL) {
            if ((info.sender_tag >> UX_KIND_SHIFT) != UX_K_MSG)
                return QLINK_RING_OTHER; /* a control frame first: the endpoint's own code takes it */
            void *m = u->probe(u->worker, u->rx_tag, ~0ull, 1, &info);
            if (m == NULL)
                return QLINK_RING_OTHER;
            size_t len = info.length, cap = IO_IN_NBYTES;
            void *r = u->msg_recv(u->worker, io->in, len < cap ? len : cap, m, u->param);
            int st = 0;
            if (r != NULL && ux_is_err(r)) {
                st = -1;
            } else if (r != NULL) {
                st = ux_wait(u, r);
                if (st == UX_IN_PROGRESS) { /* a receive that does not finish: the link is given up */
                    io->eof = 1;
                    return IO_CLOSED;
                }
            }
            if (len > cap) { /* never taken whole: dropped, counted */
                io->oversized++;
                continue;
            }
            if (st < 0) {
                io->eof = 1;
                return IO_CLOSED;
            }
            io->reads++;
            u->has = 1;
            u->len = (uint32_t)len;
            *data = io->in;
            *n = u->len;
            return QLINK_RING_MSG;
        }
        if (k == 0)
            u->progress(u->worker);
    }
    return QLINK_RING_EMPTY;
}

static int io_peek(Io *io, const uint8_t **data, uint32_t *n) {
    if (io->kind == IO_RING)
        return RAPI->peek(io->rx, data, n);
    if (io->kind == IO_UCX)
        return ux_peek(io, data, n);
    if (io->kind == IO_DGRAM)
        return dg_peek(io, data, n);
    for (;;) {
        size_t avail = io->in_w - io->in_r;
        if (avail >= 32) {
            const uint8_t *h = io->in + io->in_r;
            uint64_t nb;
            uint16_t tag;
            memcpy(&nb, h + 8, 8);
            memcpy(&tag, h + 2, 2);
            if (h[0] == TW.kind_bye)
                return IO_CLOSED;
            if (nb > io->max_payload || 32 + tag + nb > io->in_cap) { /* never buffered: the stream is given up */
                io->oversized++;
                return IO_CLOSED;
            }
            if (avail >= 32 + tag + nb) {
                if (h[0] != TW.kind_msg || tag) { /* a put or anything but a plain message: skipped, counted */
                    io->foreign++;
                    io->in_r += 32 + tag + nb;
                    continue;
                }
                *data = h + 32;
                *n = (uint32_t)nb;
                return QLINK_RING_MSG;
            }
        }
        if (io->eof)
            return IO_CLOSED;
        /* room to read: compact, then one non-blocking read */
        if (io->in_r && (io->in_r == io->in_w || io->in_cap - io->in_w < (io->in_cap >> 2))) {
            memmove(io->in, io->in + io->in_r, io->in_w - io->in_r);
            io->in_w -= io->in_r;
            io->in_r = 0;
        }
        if (io->in_w == io->in_cap)
            return QLINK_RING_EMPTY; /* (full of a message being received: cannot happen, see the cap check) */
        ssize_t k = recv(io->fd, io->in + io->in_w, io->in_cap - io->in_w, MSG_DONTWAIT);
        if (k > 0) {
            io->in_w += (size_t)k;
            io->reads++;
            continue;
        }
        if (k == 0) {
            io->eof = 1;
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return QLINK_RING_EMPTY;
        if (errno == EINTR)
            continue;
        io->eof = 1;
    }
}

static void io_consume(Io *io) {
    if (io->kind == IO_RING) {
        RAPI->consume(io->rx);
        return;
    }
    if (io->kind == IO_UCX) {
        if (io->pre_r < io->pre_n)
            io->pre_r++;
        else
            io->ux->has = 0;
        return;
    }
    if (io->kind == IO_DGRAM) {
        if (io->pre_r < io->pre_n)
            io->pre_r++;
        else
            io->dg_r++;
        return;
    }
    uint64_t nb;
    memcpy(&nb, io->in + io->in_r + 8, 8);
    io->in_r += 32 + nb;
}

static int io_peer_closed(Io *io) {
    if (io->kind == IO_RING)
        return RAPI->peer_closed(io->rx, 1) || RAPI->peer_closed(io->tx, 0);
    return io->eof;
}

/* bytes of input waiting behind nothing else (ring: records queued; stream: unparsed bytes) */
static uint64_t io_queued(Io *io) {
    if (io->kind == IO_RING)
        return RAPI->queued_nbytes(io->rx);
    if (io->kind == IO_DGRAM) {
        uint64_t q = 0;
        for (int i = io->pre_r; i < io->pre_n; i++)
            q += io->pre_len[i];
        for (int i = io->dg_r; i < io->dg_n; i++)
            q += io->dg_in_msg[i].msg_len;
        return q;
    }
    if (io->kind == IO_UCX)
        return io->ux->has ? io->ux->len : 0;
    return io->in_w - io->in_r;
}

static int io_yield_hint(Io *io) { return io->kind == IO_RING && RAPI->producer_on_our_cpu(io->rx); }

static PyObject *mod_set_stream_layout(PyObject *Py_UNUSED(m), PyObject *d) {
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "set_stream_layout(dict)");
        return NULL;
    }
    if (layout_fmt(d, "header", "<BBHIQQQ"))
        return NULL;
    long long msg, bye, maxp;
    if (layout_int(d, "KIND_MSG", &msg) || layout_int(d, "KIND_BYE", &bye) || layout_int(d, "MAX_FRAME_PAYLOAD", &maxp))
        return NULL;
    TW.kind_msg = (uint8_t)msg;
    TW.kind_bye = (uint8_t)bye;
    TW.max_payload = (uint64_t)maxp;
    TW.set = 1;
    Py_RETURN_NONE;
}

