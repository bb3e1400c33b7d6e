/*
 * qlink.qec._hotcore: the native per-frame path of the QEC loop over shared memory.
 *
 * Two objects, each a lean state machine over the rings of an shm endpoint (through the C
 * API of transports._ringc, see transports/_ring_api.h):
 *
 *  - ServiceCore: ingests CUDA-Q realtime RPC frames (enqueue_syndromes /
 *    get_corrections / reset_decoder), validates them, accumulates each decoder's shot,
 *    calls the decoder the moment a shot's last bits land (the one Python call per shot:
 *    the decoder itself), and answers. Refusals are answered with their status and
 *    counted by fault; nothing is allocated per frame.
 *  - ControllerCore: the QPU-controller emulator's emit / answer / apply loop: prebuilt
 *    frames sent on the cycle clock (each round its own frame, or whatever the layout
 *    says), get_corrections after a shot's last frame, answers XORed into the Pauli
 *    frame. Runs without the GIL.
 *
 * Both stamp every shot into preallocated int64 rows (the layouts of
 * qlink.qec.timeline's SERVICE_SHOT_FIELDS and CONTROLLER_SHOT_FIELDS) that Python
 * summarizes afterwards. The byte layouts and numbers of the wire are qlink.wire's: they
 * are handed over once by set_wire_layout(), which refuses struct formats this code does
 * not implement. The control plane (configuration, reports) is qlink/qec/hotpath.py.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include "_ring_api.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the CUDA-Q realtime wire is little-endian; this build target is not"
#endif

static qlink_ring_api *RAPI;

static inline int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
static inline int64_t real_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline int64_t rd64(const uint8_t *p) { int64_t v; memcpy(&v, p, 8); return v; }
static inline void wr32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void wr64(uint8_t *p, int64_t v) { memcpy(p, &v, 8); }

/* ------------------------------------------------------------------ wire layout */

static struct {
    int set;
    uint32_t req_magic, resp_magic, fn_enq, fn_get, fn_reset;
    uint32_t hdr, enq_fixed, get_payload, reset_payload;
    int64_t max_bits, max_corr_bits;
    int max_decoders;
    int32_t st_ok, st_invalid, st_bad, st_internal, st_not_ready, st_busy, st_dropped;
} W;

static int layout_int(PyObject *d, const char *key, long long *out) {
    PyObject *v = PyDict_GetItemString(d, key); /* borrowed */
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "wire layout lacks %s", key);
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int layout_fmt(PyObject *d, const char *key, const char *want) {
    PyObject *v = PyDict_GetItemString(d, key);
    const char *s = v ? PyUnicode_AsUTF8(v) : NULL;
    if (s == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_KeyError, "wire layout lacks %s", key);
        return -1;
    }
    if (strcmp(s, want) != 0) {
        PyErr_Format(PyExc_ValueError, "qlink.qec._hotcore implements %s as %s, qlink.wire says %s: rebuild it", key,
                     want, s);
        return -1;
    }
    return 0;
}

static PyObject *mod_set_wire_layout(PyObject *Py_UNUSED(m), PyObject *d) {
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "set_wire_layout(dict)");
        return NULL;
    }
    if (layout_fmt(d, "request_header", "<IIIIQ") || layout_fmt(d, "response_header", "<IiIIQ") ||
        layout_fmt(d, "enqueue_fixed", "<qqqq") || layout_fmt(d, "get_corrections", "<qqB") ||
        layout_fmt(d, "reset_decoder", "<q"))
        return NULL;
    long long v[18];
    const char *keys[18] = {"REQUEST_MAGIC", "RESPONSE_MAGIC", "ENQUEUE_SYNDROMES", "GET_CORRECTIONS",
                            "RESET_DECODER", "HEADER_NBYTES", "ENQUEUE_SYNDROMES_FIXED_NBYTES",
                            "GET_CORRECTIONS_PAYLOAD_NBYTES", "RESET_DECODER_PAYLOAD_NBYTES", "MAX_SYNDROME_BITS",
                            "MAX_CORRECTION_BITS", "MAX_DECODERS", "OK", "INVALID_DECODER", "BAD_REQUEST",
                            "INTERNAL_ERROR", "NOT_READY", "BUSY"};
    for (int i = 0; i < 18; i++)
        if (layout_int(d, keys[i], &v[i]))
            return NULL;
    long long dropped;
    if (layout_int(d, "SYNDROMES_DROPPED", &dropped))
        return NULL;
    if (v[5] != 24 || v[6] != 32 || v[7] != 17 || v[8] != 8) {
        PyErr_SetString(PyExc_ValueError, "wire sizes differ from the ones qlink.qec._hotcore implements");
        return NULL;
    }
    W.req_magic = (uint32_t)v[0];
    W.resp_magic = (uint32_t)v[1];
    W.fn_enq = (uint32_t)v[2];
    W.fn_get = (uint32_t)v[3];
    W.fn_reset = (uint32_t)v[4];
    W.hdr = (uint32_t)v[5];
    W.enq_fixed = (uint32_t)v[6];
    W.get_payload = (uint32_t)v[7];
    W.reset_payload = (uint32_t)v[8];
    W.max_bits = v[9];
    W.max_corr_bits = v[10];
    W.max_decoders = (int)v[11];
    W.st_ok = (int32_t)v[12];
    W.st_invalid = (int32_t)v[13];
    W.st_bad = (int32_t)v[14];
    W.st_internal = (int32_t)v[15];
    W.st_not_ready = (int32_t)v[16];
    W.st_busy = (int32_t)v[17];
    W.st_dropped = (int32_t)dropped;
    W.set = 1;
    Py_RETURN_NONE;
}

static int need_layout(void) {
    if (!W.set) {
        PyErr_SetString(PyExc_RuntimeError, "call qlink.qec._hotcore.set_wire_layout(...) first (qlink.qec.hotpath does)");
        return -1;
    }
    return 0;
}

static int get_ring(PyObject *obj, const char *name) {
    if (RAPI == NULL || !RAPI->is_ring(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a transports._ringc.Ring (an shm endpoint with the C ring)", name);
        return -1;
    }
    return 0;
}

/* A writable C-contiguous int64 2-D buffer of `ncols` columns (rows recorded into it). */
static int get_rows(PyObject *obj, Py_buffer *b, int64_t ncols, const char *name, int64_t *nrows) {
    if (PyObject_GetBuffer(obj, b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (b->len % (Py_ssize_t)(8 * ncols) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must hold rows of %lld int64 values", name, (long long)ncols);
        PyBuffer_Release(b);
        return -1;
    }
    *nrows = b->len / (8 * ncols);
    return 0;
}


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
#define IO_IN_NBYTES (4u << 20)
#define IO_OUT_NBYTES (1u << 20)
#define IO_CLOSED (-2)
/* datagrams: one frame per datagram (qlink's udp wire: nothing added), received and sent in
 * batches of up to DG_SLOTS through recvmmsg / sendmmsg */
#define DG_SLOTS 32
#define DG_MAX 65536 /* holds any datagram */
#define DG_SOCKBUF_NBYTES (4 << 20)

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
    struct sockaddr_storage peer;
    socklen_t peer_len;
    int has_peer;
    uint64_t refused;
    /* datagrams received before the core took the socket: read first, from `pre` */
    uint8_t *pre;
    size_t *pre_off, *pre_len;
    int pre_n, pre_r;
} Io;

static void io_free(Io *io) {
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
static int io_init_dgram(Io *io, PyObject *link) {
    PyObject *fdo = PyTuple_GET_ITEM(link, 0), *left = PyTuple_GET_ITEM(link, 1), *peer = PyTuple_GET_ITEM(link, 2);
    io->kind = IO_DGRAM;
    io->fd = (int)PyLong_AsLong(fdo);
    if (io->fd < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "bad socket fd");
        return -1;
    }
    PyObject *seq = PySequence_Fast(left, "the datagrams already received must be a sequence of bytes");
    if (seq == NULL)
        return -1;
    Py_ssize_t nleft = PySequence_Fast_GET_SIZE(seq);
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
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    if (peer != Py_None) {
        const char *host;
        int port;
        if (!PyArg_ParseTuple(peer, "si", &host, &port)) {
            Py_DECREF(seq);
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
            Py_DECREF(seq);
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
    io->dg_n = io->dg_r = 0;
    /* room for a burst: the kernel caps it at net.core.rmem_max / wmem_max */
    int sz = DG_SOCKBUF_NBYTES;
    setsockopt(io->fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
    setsockopt(io->fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof(sz));
    return 0;
}

/* link: a (tx, rx) pair of rings, (fd, leftover bytes already read from it) for a stream
 * socket, or (fd, [datagrams already received], peer or None) for a datagram socket */
static int io_init(Io *io, PyObject *link) {
    memset(io, 0, sizeof(*io));
    PyObject *a, *b;
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

/* write what is gathered; 0 all written, 1 some left (the socket is full), -1 the peer is gone */
static int io_flush(Io *io) {
    if (io->kind == IO_DGRAM)
        return io->dg_out ? dg_flush(io) : 0;
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
static int io_send(Io *io, const void *p1, uint64_t n1, const void *p2, uint64_t n2) {
    if (io->kind == IO_RING)
        return RAPI->send(io->tx, p1, n1, p2, n2);
    if (io->kind == IO_DGRAM) {
        uint64_t n = n1 + n2;
        if (n > DG_MAX - 29) /* (65,507: an IPv4 datagram's most) */
            return QLINK_RING_TOO_BIG;
        if (io->eof)
            return QLINK_RING_PEER_CLOSED;
        if (io->dg_out == DG_SLOTS || io->out_n + n > IO_OUT_NBYTES) {
            int rc = dg_flush(io);
            if (rc < 0)
                return QLINK_RING_PEER_CLOSED;
            if (rc > 0)
                return QLINK_RING_FULL; /* (the batch stays whole: sent on the next flush) */
        }
        uint8_t *h = io->out + io->out_n;
        if (n1)
            memcpy(h, p1, n1);
        if (n2)
            memcpy(h + n1, p2, n2);
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
    if (n1)
        memcpy(h + 32, p1, n1);
    if (n2)
        memcpy(h + 32 + n1, p2, n2);
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

static int io_peek(Io *io, const uint8_t **data, uint32_t *n) {
    if (io->kind == IO_RING)
        return RAPI->peek(io->rx, data, n);
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
            if (nb > TW.max_payload || 32 + tag + nb > IO_IN_NBYTES) { /* never buffered: the stream is given up */
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
        if (io->in_r && (io->in_r == io->in_w || IO_IN_NBYTES - io->in_w < (1u << 16))) {
            memmove(io->in, io->in + io->in_r, io->in_w - io->in_r);
            io->in_w -= io->in_r;
            io->in_r = 0;
        }
        ssize_t k = recv(io->fd, io->in + io->in_w, IO_IN_NBYTES - io->in_w, MSG_DONTWAIT);
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

/* ================================================================== service core */

/* faults and counts, reported by name */
enum {
    C_REQUESTS, C_ENQUEUE, C_GET, C_RESET, C_SHOTS_COMPLETED, C_SHOTS_DECODED, C_DECODE_CALLS, C_ANSWERS,
    C_NOT_READY, C_SHOTS_DROPPED, C_FRAMES_LOST, C_FRAMES_DISCARDED, C_SHOTS_REFUSED_BUSY, C_DECODER_FAILED,
    C_F_SHORT_FRAME, C_F_BAD_MAGIC, C_F_LENGTH, C_F_UNKNOWN_FUNCTION, C_F_DECODER_NOT_CONFIGURED,
    C_F_DECODER_ID, C_F_MAPPING_ID, C_F_SYNDROME_COUNT, C_F_COUNTER_BACKWARDS, C_F_COUNTER_GAP, C_F_RETURN_SIZE,
    C_F_ANSWER_BLOCKED, C_F_LAYOUT_MISMATCH, C_SLOW_PATH, C_REPLAYED, C_WINDOWS, C_SHOTS_REPAIRED,
    C_REPAIR_FRAMES, C_FRAMES_REPEATED, C_ADDRESSED_GETS, C_N
};
static const char *count_names[C_N] = {
    "requests", "enqueue", "get_corrections", "reset_decoder", "shots_completed", "shots_decoded", "decode_calls",
    "answers", "not_ready", "shots_dropped", "frames_lost", "frames_discarded", "shots_refused_busy",
    "decoder_failed", "fault.short_frame", "fault.bad_magic", "fault.length", "fault.unknown_function",
    "fault.decoder_not_configured", "fault.decoder_id", "fault.syndrome_mapping_id", "fault.syndrome_count",
    "fault.counter_backwards", "fault.counter_gap", "fault.return_size", "fault.answer_blocked",
    "fault.layout_mismatch", "slow_path_frames", "get_corrections_replayed", "windows_decoded", "shots_repaired",
    "repair_frames", "frames_repeated", "addressed_gets",
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

#define DEFER_MAX 256
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
#define TAB_N 4096
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
    DeferredGet defer[DEFER_MAX];
    int n_defer;
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
} ServiceCore;

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
    long long max_batch = 256;
    static char *kwlist[] = {"link", "decoders", "ack", "rows", "answer_block_s", "max_batch", NULL};
    if (need_layout())
        return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|$iOdL:ServiceCore", kwlist, &link, &decoders, &ack, &rows,
                                     &block_s, &max_batch))
        return -1;
    if (ack < 0 || ack > 2) {
        PyErr_SetString(PyExc_ValueError, "ack must be 0 (none), 1 (errors) or 2 (all)");
        return -1;
    }
    svc_clear(s);
    memset(s->counts, 0, sizeof(s->counts));
    if (io_init(&s->io, link) < 0)
        return -1;
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
    s->n_defer = 0;
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
    return 0;
}

/* ----- answers */

static void svc_answer(ServiceCore *s, int32_t status, uint32_t rid, int64_t ptp, const uint8_t *res, uint32_t nres) {
    uint8_t h[24];
    wr32(h, W.resp_magic);
    memcpy(h + 4, &status, 4);
    wr32(h + 8, nres);
    wr32(h + 12, rid);
    wr64(h + 16, ptp);
    int rc = io_send(&s->io, h, 24, res, nres);
    if (rc == QLINK_RING_FULL) { /* the controller is not reading: wait a bounded time */
        int64_t t0 = mono_ns();
        PyThreadState *ts = PyEval_SaveThread();
        while (rc == QLINK_RING_FULL && mono_ns() - t0 < s->answer_block_ns && !io_peer_closed(&s->io)) {
            CPU_RELAX();
            rc = io_send(&s->io, h, 24, res, nres);
        }
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

/* Decode `bits` (nbd bytes, pad bits clear) into `out` (nbo packed bytes). 0 ok, -1 failed (counted). */
static int svc_decode(ServiceCore *s, SvcDecoder *d, const uint8_t *bits, uint8_t *out) {
    PyObject *res;
    int64_t nbd = d->nbd;
    if (d->map_rows != NULL) { /* measurements -> detectors: XOR the rows of the bytes that are set */
        const int64_t words = d->map_words;
        uint64_t *acc = d->mapped;
        memset(acc, 0, (size_t)words * 8);
        for (int64_t j = 0; j < nbd; j++) {
            if (bits[j] == 0)
                continue;
            const uint64_t *r = d->map_rows + ((size_t)(256 * j + bits[j])) * (size_t)words;
            for (int64_t w = 0; w < words; w++)
                acc[w] ^= r[w];
        }
        bits = (const uint8_t *)acc;
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
    int64_t slot = svc_admit(s, d, status_out);
    if (slot < 0)
        return;
    if (t_in == 0) /* the frame came while the service was busy: stamped now (parsed, about to decode) */
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
        d->tail++;
        s->pending++;
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

/* Decode every waiting shot of d: one shot through the single-shot call, several through
 * the batch call (split where the ring of slots wraps). */
static void svc_flush_decoder(ServiceCore *s, SvcDecoder *d) {
    while (d->decoded < d->tail) {
        int64_t first = (int64_t)(d->decoded % (uint64_t)d->cap);
        int64_t k = (int64_t)(d->tail - d->decoded);
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
        d->decoded += (uint64_t)k;
        s->pending -= k;
    }
}

static void svc_flush(ServiceCore *s) {
    for (int i = 0; i < 64 && s->pending > 0; i++)
        if (s->dec[i].configured)
            svc_flush_decoder(s, &s->dec[i]);
}

/* `g` frames were lost before this one: drop every shot they touched. */
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

/* ----- sliding windows */

/* match one window and commit its commit region; 0 ok, -1 the matcher failed (counted) */
static int win_decode(ServiceCore *s, WinState *w, WinCompiled *c) {
    int rc = 0;
    uint8_t *buf = w->buf;
    if (c->k > 0) {
        int64_t k = 0;
        for (int64_t i = 0; i < c->n; i++)
            if (buf[i])
                c->idx[k++] = (uint64_t)i;
        PyObject *view = PyTuple_GET_ITEM(c->views, k);
        PyObject *res = PyObject_Vectorcall(c->fn, &view, 1, NULL);
        s->counts[C_DECODE_CALLS]++;
        if (res == NULL) {
            note_failure(s);
            rc = -1;
        } else {
            PyObject *arr = (PyTuple_Check(res) && PyTuple_GET_SIZE(res) >= 1) ? PyTuple_GET_ITEM(res, 0) : res;
            Py_buffer b;
            if (PyObject_GetBuffer(arr, &b, PyBUF_C_CONTIGUOUS) < 0) {
                note_failure(s);
                rc = -1;
            } else {
                Py_ssize_t step = b.itemsize > 0 ? b.itemsize : 1;
                if (b.len / step < c->k) {
                    rc = -1;
                    if (s->first_error == NULL)
                        s->first_error = PyUnicode_FromString("a window's matcher returned fewer fault ids than it has");
                } else {
                    const uint8_t *m = (const uint8_t *)b.buf;
                    for (int64_t j = 0; j < c->k; j++)
                        if (m[j * step]) {
                            w->obs ^= c->obsmask[j];
                            for (int64_t q = c->fptr[j]; q < c->fptr[j + 1]; q++)
                                buf[c->ftgt[q]] ^= 1;
                        }
                }
                PyBuffer_Release(&b);
            }
            Py_DECREF(res);
        }
    }
    int64_t sh = c->ncommit;
    if (sh > 0) {
        memmove(buf, buf + sh, (size_t)(w->cap - sh));
        memset(buf + w->cap - sh, 0, (size_t)sh);
    }
    s->counts[C_WINDOWS]++;
    return rc;
}

/* the windows whose last round has landed (as SlidingWindowDecoder.push_round) */
static void win_advance(ServiceCore *s, WinState *w) {
    while (w->t < w->R) {
        int64_t end = w->t + w->W;
        if (end >= w->R && w->pushed < w->R)
            break;
        if (end < w->R && w->pushed < end)
            break;
        if (w->widx >= w->nwin) { /* (the plan is shorter than the experiment: refused at build) */
            w->failed = 1;
            w->t = w->R;
            break;
        }
        w->t0 = mono_ns();
        if (win_decode(s, w, &w->cw[w->wid[w->widx++]]) < 0)
            w->failed = 1;
        w->t1 = mono_ns();
        w->t = end >= w->R ? w->R : w->t + w->C;
    }
}

/* a long experiment's last window committed: its correction is the shot's answer */
static void svc_complete_win(ServiceCore *s, SvcDecoder *d, uint32_t rid, int64_t ptp, int64_t t_in,
                             int64_t *status_out) {
    WinState *w = d->win;
    int64_t slot = svc_admit(s, d, status_out);
    if (slot < 0)
        return;
    if (t_in == 0)
        t_in = w->t0;
    int64_t *r = d->rec + slot * SVC_FIELDS;
    r[0] = rid;
    r[1] = ptp;
    r[2] = t_in;
    r[3] = t_in;
    r[4] = w->t0; /* the last window's match */
    r[5] = w->t1;
    r[6] = 0;
    r[7] = 1;
    r[8] = 0;
    r[9] = 1;
    r[10] = s->t_ready ? s->t_ready : t_in;
    uint8_t *o = d->obs + slot * d->nbo;
    memset(o, 0, (size_t)d->nbo);
    for (int64_t i = 0; i < d->num_obs; i++)
        if ((w->obs >> i) & 1)
            o[i >> 3] |= (uint8_t)(1u << (i & 7));
    d->failed[slot] = (int8_t)w->failed;
    s->counts[w->failed ? C_DECODER_FAILED : C_SHOTS_DECODED]++;
    d->tail++;
    d->decoded = d->tail;
}

/* a frame of a long experiment: its bits go into the window buffer round by round, each
 * window matched as its last round lands */
static void win_enqueue(ServiceCore *s, SvcDecoder *d, const uint8_t *bits, int64_t n, int64_t gap, int64_t counter,
                        uint32_t rid, int64_t ptp, int64_t t_in) {
    WinState *w = d->win;
    int64_t filled = (gap || !d->filling) ? 0 : w->filled;
    if (filled + n > d->num_det)
        return svc_refuse(s, C_F_SYNDROME_COUNT, W.st_bad, rid, ptp);
    if (gap) {
        svc_lose(s, d, gap);
        win_reset(w);
    }
    d->next_counter = counter + 1;
    d->has_counter = 1;
    int64_t F = d->frames_per_shot;
    if (d->discard > 0) {
        d->discard--;
        s->counts[C_FRAMES_DISCARDED]++;
        if (F > 0)
            d->pos = (d->pos + 1) % F;
        if (s->ack == 2)
            svc_answer(s, W.st_dropped, rid, ptp, NULL, 0);
        return;
    }
    if (!d->filling) {
        win_reset(w);
        d->filling = 1;
        d->pos = 0;
    }
    d->pos++;
    int64_t i = 0;
    for (;;) {
        while (w->pushed < w->R && w->rptr[w->pushed + 1] == w->filled) { /* a round complete */
            w->pushed++;
            win_advance(s, w);
        }
        if (i >= n || w->pushed >= w->R)
            break;
        int64_t m = w->rptr[w->pushed + 1] - w->filled; /* the rest of this round */
        if (m > n - i)
            m = n - i;
        int64_t off = w->filled - w->rptr[w->t];
        if (off < 0 || off + m > w->cap) { /* (cannot happen with a plan from SlidingWindowDecoder) */
            w->failed = 1;
        } else {
            uint8_t *b = w->buf + off;
            for (int64_t j = 0; j < m; j++) {
                int64_t bit = i + j;
                b[j] ^= (uint8_t)((bits[bit >> 3] >> (bit & 7)) & 1);
            }
        }
        i += m;
        w->filled += m;
    }
    int64_t status = W.st_ok;
    if (w->t >= w->R && w->pushed >= w->R) {
        d->filling = 0;
        if (F > 0 && d->pos != F)
            s->counts[C_F_LAYOUT_MISMATCH]++;
        d->pos = 0;
        svc_complete_win(s, d, rid, ptp, t_in, &status);
    }
    if (status != W.st_ok) {
        if (s->ack >= 1)
            svc_answer(s, (int32_t)status, rid, ptp, NULL, 0);
    } else if (s->ack == 2) {
        svc_answer(s, W.st_ok, rid, ptp, NULL, 0);
    }
}

/* OR n bits of src into buf at bit *filled (buf's bytes past it clean) */
static void append_bits_to(uint8_t *buf, int64_t *filled, const uint8_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int64_t b = *filled + i;
        if ((src[i >> 3] >> (i & 7)) & 1)
            buf[b >> 3] |= (uint8_t)(1u << (b & 7));
    }
    *filled += n;
}

/* A frame of a shot recorded as dropped, sent again: put together aside (the shot's frames in
 * order, from its first), the shot decoded once its last lands. 1 taken, 0 not such a frame. */
static int svc_repair_frame(ServiceCore *s, SvcDecoder *d, const uint8_t *bits, int64_t n, int64_t x, uint32_t rid,
                            int64_t ptp) {
    int64_t F = d->frames_per_shot;
    if (d->tab == NULL || F <= 0 || d->win != NULL)
        return 0;
    /* the one shot whose last frame lies in [x, x + F) holds x */
    ShotRec *r = NULL;
    int64_t L = 0;
    for (int64_t j = 0; j < F && r == NULL; j++)
        if ((r = tab_get(d, x + j)) != NULL)
            L = x + j;
    if (r == NULL || r->state != REC_DROPPED)
        return 0;
    s->counts[C_REPAIR_FRAMES]++;
    if (x == L - F + 1) { /* its first frame: (re)start */
        d->rep_active = 1;
        d->rep_key = L;
        d->rep_filled = 0;
        memset(d->rep, 0, (size_t)d->nbd + 8);
    } else if (!d->rep_active || d->rep_key != L || x != d->rep_next) {
        return 1; /* a frame out of turn: the shot is asked for (and sent) again */
    }
    if (d->rep_filled + n > d->num_det) {
        d->rep_active = 0;
        s->counts[C_F_LAYOUT_MISMATCH]++;
        return 1;
    }
    append_bits_to(d->rep, &d->rep_filled, bits, n);
    d->rep_next = x + 1;
    if (x == L) {
        d->rep_active = 0;
        if (d->rep_filled != d->num_det) {
            s->counts[C_F_LAYOUT_MISMATCH]++;
            return 1;
        }
        uint8_t out[KEEP_BYTES];
        int rc = svc_decode(s, d, d->rep, out);
        s->counts[C_SHOTS_COMPLETED]++;
        s->counts[rc < 0 ? C_DECODER_FAILED : C_SHOTS_DECODED]++;
        s->counts[C_SHOTS_REPAIRED]++;
        tab_put(d, L, REC_FINAL, rc < 0 ? W.st_internal : W.st_ok, rc < 0 ? NULL : out);
    }
    if (s->ack == 2)
        svc_answer(s, W.st_ok, rid, ptp, NULL, 0);
    return 1;
}

/* A frame behind the stream (counter < the next expected) over datagrams: a frame of a
 * dropped shot sent again (a repair), or one of a shot that is here already (counted, let
 * be). 1 taken, 0 not (refused as counter_backwards). */
static int svc_behind(ServiceCore *s, SvcDecoder *d, const uint8_t *bits, int64_t n, int64_t x, uint32_t rid,
                      int64_t ptp) {
    int64_t F = d->frames_per_shot;
    if (d->tab == NULL || F <= 0)
        return 0;
    if (svc_repair_frame(s, d, bits, n, x, rid, ptp))
        return 1;
    int here = d->filling && x >= d->next_counter - d->pos; /* the shot being filled */
    for (int64_t j = 0; j < F && !here; j++) {
        ShotRec *r = tab_get(d, x + j);
        here = r != NULL && r->state == REC_FINAL;
    }
    for (uint64_t q = d->tail, k = 0; q > d->head && k < 256 && !here; q--, k++) { /* queued, not yet asked */
        int64_t key = d->key[(q - 1) % (uint64_t)d->cap];
        if (key < x)
            break;
        here = key < x + F;
    }
    if (!here)
        return 0;
    s->counts[C_FRAMES_REPEATED]++;
    if (s->ack == 2)
        svc_answer(s, W.st_ok, rid, ptp, NULL, 0);
    return 1;
}

static void svc_enqueue(ServiceCore *s, const uint8_t *p, uint32_t arg_len, uint32_t rid, int64_t ptp, int64_t t_in) {
    s->counts[C_ENQUEUE]++;
    if (arg_len < W.enq_fixed)
        return svc_refuse(s, C_F_LENGTH, W.st_bad, rid, ptp);
    int64_t did = rd64(p), counter = rd64(p + 8), mapping = rd64(p + 16), n = rd64(p + 24);
    if (n < 0 || n > W.max_bits || (int64_t)arg_len != W.enq_fixed + ((n + 7) >> 3))
        return svc_refuse(s, C_F_LENGTH, W.st_bad, rid, ptp);
    if (did < 0 || did >= W.max_decoders)
        return svc_refuse(s, C_F_DECODER_ID, W.st_invalid, rid, ptp);
    SvcDecoder *d = &s->dec[did];
    if (!d->configured)
        return svc_refuse(s, C_F_DECODER_NOT_CONFIGURED, W.st_invalid, rid, ptp);
    if (mapping != 0)
        return svc_refuse(s, C_F_MAPPING_ID, W.st_bad, rid, ptp);
    if (n == 0)
        return svc_refuse(s, C_F_SYNDROME_COUNT, W.st_bad, rid, ptp);
    int64_t gap = 0;
    const uint8_t *bits = p + W.enq_fixed;
    if (d->has_counter && counter != d->next_counter) {
        if (counter < d->next_counter) {
            if (svc_behind(s, d, bits, n, counter, rid, ptp))
                return;
            return svc_refuse(s, C_F_COUNTER_BACKWARDS, W.st_bad, rid, ptp);
        }
        gap = counter - d->next_counter;
    }
    d->cur_key = counter;
    if (d->win)
        return win_enqueue(s, d, bits, n, gap, counter, rid, ptp, t_in);
    int64_t nd = d->num_det;
    int64_t filled = (gap || !d->filling) ? 0 : d->filled;
    int whole = 0;
    if (filled + n > nd) {
        if (filled || n % nd) /* changes nothing: the sender may send it again with the same counter */
            return svc_refuse(s, C_F_SYNDROME_COUNT, W.st_bad, rid, ptp);
        whole = 1;
    }
    if (gap)
        svc_lose(s, d, gap);
    d->next_counter = counter + 1;
    d->has_counter = 1;
    int64_t F = d->frames_per_shot;
    if (d->discard > 0) {
        d->discard--;
        s->counts[C_FRAMES_DISCARDED]++;
        if (F > 0)
            d->pos = (d->pos + 1) % F;
        if (d->rep_active && counter == d->rep_next && svc_repair_frame(s, d, bits, n, counter, rid, ptp))
            return; /* (the rest of a dropped shot arriving while it is repaired: taken into the repair) */
        if (s->ack == 2)
            svc_answer(s, W.st_dropped, rid, ptp, NULL, 0);
        return;
    }
    int64_t status = W.st_ok;
    if (whole || (n == nd && !d->filling)) { /* whole shots: decode straight from the frame */
        int64_t k = n / nd;
        if ((nd & 7) == 0) {
            for (int64_t i = 0; i < k; i++)
                svc_complete(s, d, bits + i * d->nbd, rid, ptp, t_in, &status);
        } else {
            for (int64_t i = 0; i < k; i++) {
                memset(d->shot, 0, (size_t)d->nbd + 1);
                d->filled = 0;
                /* shot i starts at bit i*nd of the frame */
                int64_t b0 = i * nd, nbytes = (n + 7) >> 3;
                int sh = (int)(b0 & 7);
                for (int64_t j = 0; j < d->nbd; j++) {
                    int64_t at = (b0 >> 3) + j;
                    unsigned v = bits[at] >> sh;
                    if (sh && at + 1 < nbytes)
                        v |= (unsigned)bits[at + 1] << (8 - sh);
                    d->shot[j] = (uint8_t)v;
                }
                if (nd & 7)
                    d->shot[d->nbd - 1] &= (uint8_t)((1u << (nd & 7)) - 1);
                svc_complete(s, d, d->shot, rid, ptp, t_in, &status);
            }
            d->filled = 0;
        }
        d->pos = 0;
    } else {
        if (!d->filling) {
            d->filling = 1;
            d->filled = 0;
            d->shot[0] = 0;
        }
        append_bits(d, bits, n);
        d->pos++;
        if (d->filled == nd) {
            if (F > 0 && d->pos != F)
                s->counts[C_F_LAYOUT_MISMATCH]++;
            d->filling = 0;
            d->pos = 0;
            svc_complete(s, d, d->shot, rid, ptp, t_in, &status);
            d->filled = 0;
        } else if (F > 0 && d->pos >= F) {
            s->counts[C_F_LAYOUT_MISMATCH]++;
        }
    }
    if (status != W.st_ok) {
        if (s->ack >= 1)
            svc_answer(s, (int32_t)status, rid, ptp, NULL, 0);
    } else if (s->ack == 2) {
        svc_answer(s, W.st_ok, rid, ptp, NULL, 0);
    }
}

static void svc_record(ServiceCore *s, SvcDecoder *d, int64_t slot, int32_t status, int64_t t_out) {
    if (!s->has_rows)
        return;
    if (s->row_n >= s->nrows) {
        s->rows_dropped++;
        return;
    }
    int64_t *r = (int64_t *)s->rows.buf + s->row_n * SVC_FIELDS;
    memcpy(r, d->rec + slot * SVC_FIELDS, SVC_FIELDS * sizeof(int64_t));
    r[6] = t_out;
    r[8] = status;
    s->row_n++;
}

static void svc_keep(ServiceCore *s, int did, int32_t status, uint32_t rid, int64_t ptp, const uint8_t *res,
                     uint32_t nres) {
    if (s->kept == NULL || nres > KEEP_BYTES)
        return;
    KeptAnswer *k = &s->kept[rid % KEEP_N];
    s->n_kept++;
    k->used = 1;
    k->did = did;
    k->status = status;
    k->rid = rid;
    k->ptp = ptp;
    k->nres = nres;
    if (nres)
        memcpy(k->res, res, nres);
}

/* the very same consuming get again (or a peek with its request_id): its kept answer, 1; else 0 */
static int svc_replay(ServiceCore *s, int did, int consume, uint32_t rid, int64_t ptp) {
    KeptAnswer *k = &s->kept[rid % KEEP_N];
    if (k->used && k->rid == rid && k->did == did && (!consume || k->ptp == ptp)) {
        s->counts[C_REPLAYED]++;
        svc_answer(s, k->status, rid, ptp, k->res, k->nres);
        return 1;
    }
    return 0;
}

static void svc_get_now(ServiceCore *s, SvcDecoder *d, int64_t rs, int consume, uint32_t rid, int64_t ptp) {
    if (d->head == d->tail) {
        if (d->pending_drops > 0) { /* dropped shots with nothing after them yet */
            if (consume) {
                d->pending_drops--;
                svc_keep(s, (int)(d - s->dec), W.st_dropped, rid, ptp, NULL, 0);
            }
            svc_answer(s, W.st_dropped, rid, ptp, NULL, 0);
            return;
        }
        s->counts[C_NOT_READY]++;
        if (consume)
            svc_keep(s, (int)(d - s->dec), W.st_not_ready, rid, ptp, NULL, 0);
        svc_answer(s, W.st_not_ready, rid, ptp, NULL, 0);
        return;
    }
    if (d->decoded == d->head) /* the oldest shot still waits for the decoder: decode now */
        svc_flush_decoder(s, d);
    int64_t slot = (int64_t)(d->head % (uint64_t)d->cap);
    if (d->drops_before[slot] > 0) {
        if (consume) {
            d->drops_before[slot]--;
            svc_keep(s, (int)(d - s->dec), W.st_dropped, rid, ptp, NULL, 0);
        }
        svc_answer(s, W.st_dropped, rid, ptp, NULL, 0);
        return;
    }
    if (d->failed[slot]) {
        if (consume) {
            d->head++;
            svc_keep(s, (int)(d - s->dec), W.st_internal, rid, ptp, NULL, 0);
        }
        svc_answer(s, W.st_internal, rid, ptp, NULL, 0);
        if (consume)
            svc_record(s, d, slot, W.st_internal, mono_ns());
        return;
    }
    uint8_t out[4096 + 8];
    uint32_t nres = (uint32_t)((rs + 7) >> 3);
    memcpy(out, d->obs + slot * d->nbo, nres);
    if (rs & 7)
        out[nres - 1] &= (uint8_t)((1u << (rs & 7)) - 1);
    if (consume) {
        d->head++;
        svc_keep(s, (int)(d - s->dec), W.st_ok, rid, ptp, out, nres);
    }
    svc_answer(s, W.st_ok, rid, ptp, out, nres);
    if (consume)
        svc_record(s, d, slot, W.st_ok, mono_ns());
}

static inline int is_addressed(ServiceCore *s, SvcDecoder *d, int consume, uint32_t rid) {
    return consume && d->tab != NULL && (rid & ADDR_BITS) == ADDR_BITS;
}

/* A consuming get that names its shot (ADDR_BITS): the queued shots up to the named one are
 * answered into their records (a get that named an earlier one was lost: asked again, it is
 * answered from the record), then the named shot's record answers. NOT_READY while its last
 * frame has not come; SYNDROMES_DROPPED for a shot lost (until its frames, sent again, repair it). */
static void svc_get_addressed(ServiceCore *s, SvcDecoder *d, int64_t rs, uint32_t rid, int64_t ptp) {
    s->counts[C_ADDRESSED_GETS]++;
    if (!d->has_counter) {
        s->counts[C_NOT_READY]++;
        return svc_answer(s, W.st_not_ready, rid, ptp, NULL, 0);
    }
    /* the counter nearest the stream's that is the named one mod 2**30 */
    uint32_t delta = ((rid & ADDR_MASK) - (uint32_t)(d->next_counter & ADDR_MASK)) & ADDR_MASK;
    int64_t K = d->next_counter + (delta >= (ADDR_MASK + 1u) / 2 ? (int64_t)delta - (int64_t)(ADDR_MASK + 1u) : (int64_t)delta);
    ShotRec *r = tab_get(d, K);
    if (r == NULL && d->head != d->tail && d->key[d->head % (uint64_t)d->cap] <= K) {
        if (d->decoded < d->tail)
            svc_flush_decoder(s, d);
        int64_t now = mono_ns();
        while (d->head != d->tail) {
            int64_t slot = (int64_t)(d->head % (uint64_t)d->cap);
            if (d->key[slot] > K)
                break;
            int32_t st = d->failed[slot] ? W.st_internal : W.st_ok;
            tab_put(d, d->key[slot], REC_FINAL, st, d->failed[slot] ? NULL : d->obs + slot * d->nbo);
            d->head++;
            svc_record(s, d, slot, st, now);
        }
        r = tab_get(d, K);
    }
    if (r != NULL && r->state == REC_FINAL) {
        uint8_t out[KEEP_BYTES];
        uint32_t nres = r->status == W.st_ok ? (uint32_t)((rs + 7) >> 3) : 0;
        memcpy(out, r->obs, nres);
        if (nres && (rs & 7))
            out[nres - 1] &= (uint8_t)((1u << (rs & 7)) - 1);
        return svc_answer(s, r->status, rid, ptp, out, nres);
    }
    if (r == NULL && K >= d->next_counter) { /* its last frame has not come (yet) */
        s->counts[C_NOT_READY]++;
        return svc_answer(s, W.st_not_ready, rid, ptp, NULL, 0);
    }
    svc_answer(s, W.st_dropped, rid, ptp, NULL, 0); /* lost (or answered too long ago to be kept) */
}

/* Answer the gets held back while shots waited for the decoder, in the order they came. */
static void svc_settle(ServiceCore *s) {
    svc_flush(s);
    for (int i = 0; i < s->n_defer; i++) {
        DeferredGet *g = &s->defer[i];
        if (is_addressed(s, &s->dec[g->did], g->consume, g->rid)) {
            svc_get_addressed(s, &s->dec[g->did], g->rs, g->rid, g->ptp);
            continue;
        }
        /* (over datagrams a get held back may be a request sent again: answered as the first) */
        if (s->kept != NULL && s->n_kept && svc_replay(s, g->did, g->consume, g->rid, g->ptp))
            continue;
        svc_get_now(s, &s->dec[g->did], g->rs, g->consume, g->rid, g->ptp);
    }
    s->n_defer = 0;
}

static void svc_get(ServiceCore *s, const uint8_t *p, uint32_t arg_len, uint32_t rid, int64_t ptp) {
    s->counts[C_GET]++;
    if (arg_len != W.get_payload)
        return svc_refuse(s, C_F_LENGTH, W.st_bad, rid, ptp);
    int64_t did = rd64(p), rs = rd64(p + 8);
    int consume = p[16] != 0;
    if (did < 0 || did >= W.max_decoders)
        return svc_refuse(s, C_F_DECODER_ID, W.st_invalid, rid, ptp);
    SvcDecoder *d = &s->dec[did];
    if (!d->configured)
        return svc_refuse(s, C_F_DECODER_NOT_CONFIGURED, W.st_invalid, rid, ptp);
    if (rs < 1 || rs > d->num_obs || rs > W.max_corr_bits)
        return svc_refuse(s, C_F_RETURN_SIZE, W.st_bad, rid, ptp);
    int addressed = is_addressed(s, d, consume, rid);
    if (!addressed && s->kept != NULL && s->n_kept && svc_replay(s, (int)did, consume, rid, ptp))
        return;
    /* The oldest shot still waits for the decoder (or earlier gets wait): hold this get back
     * while frames are still queued, so the waiting shots go to the decoder in one call. The
     * run loop decodes and answers as soon as nothing else waits (at once in lock-step). */
    if (s->n_defer > 0 || (d->decoded == d->head && d->head != d->tail)) {
        if (s->n_defer == DEFER_MAX)
            svc_settle(s);
        else {
            DeferredGet *g = &s->defer[s->n_defer++];
            g->did = (int)did;
            g->rs = rs;
            g->consume = consume;
            g->rid = rid;
            g->ptp = ptp;
            return;
        }
    }
    if (addressed)
        return svc_get_addressed(s, d, rs, rid, ptp);
    svc_get_now(s, d, rs, consume, rid, ptp);
}

static void svc_reset(ServiceCore *s, const uint8_t *p, uint32_t arg_len, uint32_t rid, int64_t ptp) {
    s->counts[C_RESET]++;
    if (arg_len != W.reset_payload)
        return svc_refuse(s, C_F_LENGTH, W.st_bad, rid, ptp);
    int64_t did = rd64(p);
    if (did < 0 || did >= W.max_decoders)
        return svc_refuse(s, C_F_DECODER_ID, W.st_invalid, rid, ptp);
    SvcDecoder *d = &s->dec[did];
    if (!d->configured)
        return svc_refuse(s, C_F_DECODER_NOT_CONFIGURED, W.st_invalid, rid, ptp);
    svc_settle(s); /* the gets held back answer what they asked before the reset */
    dec_reset(d);
    svc_answer(s, W.st_ok, rid, ptp, NULL, 0);
}

/* One frame. Python exceptions never escape (decoder failures are counted). */
static void svc_handle(ServiceCore *s, const uint8_t *f, uint32_t n, int64_t t_in) {
    s->counts[C_REQUESTS]++;
    if (n < W.hdr) { /* not even a header: no request id to answer */
        s->counts[C_F_SHORT_FRAME]++;
        return;
    }
    uint32_t magic = rd32(f), fn = rd32(f + 4), arg_len = rd32(f + 8), rid = rd32(f + 12);
    int64_t ptp = rd64(f + 16);
    if (magic != W.req_magic)
        return svc_refuse(s, C_F_BAD_MAGIC, W.st_bad, rid, ptp);
    if ((uint64_t)arg_len + W.hdr != n)
        return svc_refuse(s, C_F_LENGTH, W.st_bad, rid, ptp);
    const uint8_t *p = f + W.hdr;
    if (fn == W.fn_enq)
        svc_enqueue(s, p, arg_len, rid, ptp, t_in);
    else if (fn == W.fn_get)
        svc_get(s, p, arg_len, rid, ptp);
    else if (fn == W.fn_reset)
        svc_reset(s, p, arg_len, rid, ptp);
    else
        svc_refuse(s, C_F_UNKNOWN_FUNCTION, W.st_bad, rid, ptp);
}

/* run(idle_ns, max_frames=0) -> 0 idle for idle_ns (look at the peer), 1 the head of the
 * ring needs the Python path, 2 the peer closed its side, 3 max_frames handled, -3 released */
static PyObject *svc_run(ServiceCore *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "run(idle_ns, max_frames=0)");
        return NULL;
    }
    long long idle_ns = PyLong_AsLongLong(args[0]);
    long long max_frames = nargs > 1 ? PyLong_AsLongLong(args[1]) : 0;
    if (PyErr_Occurred())
        return NULL;
    /* Clock reads cost ~35 ns each: none per frame. The time a frame came is read when it
     * ends a wait (the service was idle: that read is also when it became ready again) and
     * otherwise only where a shot completes (svc_complete). */
    int64_t t_idle0 = mono_ns();
    long long frames = 0;
    PyThreadState *ts = NULL;
    unsigned spins = 1;
    int code;
    uint64_t busy_frames = 0;
    int64_t t_yield = t_idle0;
    s->t_ready = t_idle0;
    for (;;) {
        const uint8_t *data;
        uint32_t n;
        int rc = io_peek(&s->io, &data, &n);
        if (rc == QLINK_RING_MSG) {
            if (ts) {
                PyEval_RestoreThread(ts);
                ts = NULL;
            }
            int64_t t_in = 0;
            if (spins) { /* it ended a wait */
                t_in = mono_ns();
                s->t_ready = t_idle0;
            } else {
                s->t_ready = 0;
            }
            spins = 0;
            svc_handle(s, data, n, t_in);
            io_consume(&s->io);
            if ((++busy_frames & 255) == 0) { /* busy a long while: let a thread waiting for the GIL in */
                int64_t now = mono_ns();
                if (now - t_yield > 1000000) {
                    t_yield = now;
                    PyThreadState *y = PyEval_SaveThread();
                    PyEval_RestoreThread(y);
                }
            }
            if (s->pending > 0 || s->n_defer > 0) {
                /* Decode now when nothing else waits, or only the get that asks for it (the
                 * service is not behind: that get is then answered at once), or enough shots
                 * wait; otherwise go on ingesting, and decode the backlog in one call. */
                int next = io_peek(&s->io, &data, &n);
                if (next != QLINK_RING_MSG || s->pending >= s->max_batch ||
                    (io_queued(&s->io) <= 96 && n >= 8 && rd32(data + 4) == W.fn_get))
                    svc_settle(s);
            }
            if (max_frames > 0 && ++frames >= max_frames) {
                code = 3;
                break;
            }
            continue;
        }
        if (rc == QLINK_RING_OTHER) {
            code = 1;
            break;
        }
        if (rc == QLINK_RING_RELEASED) {
            code = -3;
            break;
        }
        if (rc == IO_CLOSED) {
            io_flush(&s->io);
            code = 2;
            break;
        }
        if (spins++ == 0) {
            t_idle0 = mono_ns();
            if (io_flush(&s->io) < 0) { /* answers gathered while frames came: out now */
                code = 2;
                break;
            }
        }
        if ((spins & 63) == 0) {
            if (io_peer_closed(&s->io) || io_flush(&s->io) < 0) {
                code = 2;
                break;
            }
            int64_t now = mono_ns();
            if (now - t_idle0 > idle_ns) {
                code = 0;
                break;
            }
            /* idle for 50 us: let other threads of this process run while we spin */
            if (ts == NULL && now - t_idle0 > 50000)
                ts = PyEval_SaveThread();
            if (io_yield_hint(&s->io))
                sched_yield();
        }
        CPU_RELAX();
    }
    if (ts)
        PyEval_RestoreThread(ts);
    io_flush(&s->io);
    return PyLong_FromLong(code);
}

/* handle(frame) -> None: one frame that came by another path (the endpoint's Python code) */
static PyObject *svc_handle_py(ServiceCore *s, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    s->counts[C_SLOW_PATH]++;
    svc_handle(s, (const uint8_t *)b.buf, (uint32_t)(b.len > 0xFFFFFFFFLL ? 0xFFFFFFFFLL : b.len), mono_ns());
    PyBuffer_Release(&b);
    svc_settle(s);
    io_flush(&s->io);
    Py_RETURN_NONE;
}

static PyObject *svc_counts(ServiceCore *s, PyObject *Py_UNUSED(ig)) {
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (int i = 0; i < C_N; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(s->counts[i]);
        if (v == NULL || PyDict_SetItemString(d, count_names[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyObject *svc_reset_all(ServiceCore *s, PyObject *Py_UNUSED(ig)) {
    for (int i = 0; i < 64; i++)
        if (s->dec[i].configured)
            dec_reset(&s->dec[i]);
    s->pending = 0;
    s->n_defer = 0;
    s->row_n = s->rows_dropped = 0;
    Py_RETURN_NONE;
}

static PyObject *svc_backlog(ServiceCore *s, PyObject *arg) {
    long id = PyLong_AsLong(arg);
    if (id == -1 && PyErr_Occurred())
        return NULL;
    if (id < 0 || id >= 64 || !s->dec[id].configured) {
        PyErr_Format(PyExc_ValueError, "decoder %ld is not configured", id);
        return NULL;
    }
    return PyLong_FromLongLong((long long)(s->dec[id].tail - s->dec[id].head));
}

static PyObject *svc_get_rows_used(ServiceCore *s, void *Py_UNUSED(c)) { return PyLong_FromLongLong(s->row_n); }
static PyObject *svc_get_rows_dropped(ServiceCore *s, void *Py_UNUSED(c)) { return PyLong_FromLongLong(s->rows_dropped); }
static PyObject *svc_get_first_error(ServiceCore *s, void *Py_UNUSED(c)) {
    if (s->first_error == NULL)
        Py_RETURN_NONE;
    Py_INCREF(s->first_error);
    return s->first_error;
}

static PyMethodDef svc_methods[] = {
    {"run", (PyCFunction)(void (*)(void))svc_run, METH_FASTCALL,
     "run(idle_ns, max_frames=0) -> 0 idle, 1 the ring's head needs the Python path, 2 peer closed, 3 max_frames, "
     "-3 released"},
    {"handle", (PyCFunction)svc_handle_py, METH_O, "handle(frame): one frame received by the Python path"},
    {"counts", (PyCFunction)svc_counts, METH_NOARGS, "counts and faults by name"},
    {"reset_all", (PyCFunction)svc_reset_all, METH_NOARGS, "reset every decoder (a new peer) and the shot rows"},
    {"backlog", (PyCFunction)svc_backlog, METH_O, "backlog(decoder_id) -> shots decoded and not yet answered"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef svc_getset[] = {
    {"rows_used", (getter)svc_get_rows_used, NULL, "shot rows recorded", NULL},
    {"rows_dropped", (getter)svc_get_rows_dropped, NULL, "shots answered past the rows' capacity", NULL},
    {"first_error", (getter)svc_get_first_error, NULL, "the first decoder failure (repr), or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ServiceCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "qlink.qec._hotcore.ServiceCore",
    .tp_basicsize = sizeof(ServiceCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "ServiceCore(rx, tx, decoders, *, ack=1, rows=None, answer_block_s=1.0): the decoder service's per-frame path",
    .tp_traverse = (traverseproc)svc_traverse,
    .tp_clear = (inquiry)svc_clear,
    .tp_dealloc = (destructor)svc_dealloc,
    .tp_init = (initproc)svc_init,
    .tp_new = PyType_GenericNew,
    .tp_methods = svc_methods,
    .tp_getset = svc_getset,
};

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
    int64_t get_owed; /* shot + 1 whose get could not be sent yet (the ring stayed full), or 0 */
    /* datagrams: each shot's get names it (the counter of its last frame, ADDR_BITS); answers
     * are taken in any order; a shot the service lacks has its frames sent again (a repair) */
    int64_t *ctr_of, *repairs_of;
    int64_t repairs, resent_frames, max_repairs;
    int ready;     /* the service answered the first look (datagrams: nothing is played before) */
    int64_t ping_t, pings;
} ControllerCore;

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
    long long max_repairs = 16;
    static char *kwlist[] = {"link", "frames", "offsets", "lengths", "last_round", "get_frame", "rows",
                             "corrections", "num_shots", "frames_per_shot", "rounds_per_shot", "obs_nbytes",
                             "cycle_ns", "gap_cycles", "lockstep", "stall_ns", "deadline_ns", "counter_start",
                             "request_id_start", "get_request_id_start", "late_ns", "lag", "backlog",
                             "backlog_every", "get_timeout_ns", "max_repairs", NULL};
    if (need_layout())
        return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOO|$LLLLLLLLLLLLLOOLLL:ControllerCore", kwlist, &link,
                                     &frames, &offs, &lens, &last_round, &get_frame, &rows, &corr, &S, &F, &R, &nbo,
                                     &cycle_ns, &gap_cycles, &lockstep, &stall_ns, &deadline_ns, &counter, &rid,
                                     &get_rid, &late_ns, &lag, &backlog, &backlog_every, &get_timeout_ns,
                                     &max_repairs))
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
    c->ping_t = c->pings = 0;
    return 0;
}

static inline int64_t *ctl_row(ControllerCore *c, int64_t s) { return (int64_t *)c->rows.buf + s * CTL_FIELDS; }

/* send a message, waiting while the ring is full; 0 sent, -1 peer gone / released, -2 still
 * full after stall_ns (nothing sent: the caller returns to Python, which looks at the peer --
 * a killed peer cannot mark its ring closed -- and calls run() again) */
static int ctl_send(ControllerCore *c, const uint8_t *p, uint32_t n) {
    int rc = io_send(&c->io, p, n, NULL, 0);
    if (rc == QLINK_RING_FULL) {
        c->full_waits++;
        int64_t t0 = mono_ns();
        unsigned k = 0;
        while (rc == QLINK_RING_FULL) {
            if (io_peer_closed(&c->io) || io_flush(&c->io) < 0)
                return -1;
            if ((++k & 255) == 0 && mono_ns() - t0 > c->stall_ns)
                return -2;
            CPU_RELAX();
            rc = io_send(&c->io, p, n, NULL, 0);
        }
    }
    return rc == QLINK_RING_SENT ? 0 : -1;
}

static int ctl_send_get(ControllerCore *c, int64_t s) {
    uint8_t *g = c->get_frame.buf;
    uint32_t rid = (uint32_t)(GET_BIT | (uint32_t)(c->get_rid++ & 0x7FFFFFFF));
    if (c->io.kind == IO_DGRAM) /* the get names its shot */
        rid = ADDR_BITS | (uint32_t)(c->ctr_of[s] & ADDR_MASK);
    int64_t t = mono_ns();
    wr32(g + 12, rid);
    wr64(g + 16, t + c->real_off);
    int64_t *r = ctl_row(c, s);
    if (r[K_POLLS] == 0)
        r[K_GET] = t;
    r[K_POLLS]++;
    c->get_rid_of[s] = rid;
    c->get_ptp_of[s] = t + c->real_off;
    c->get_t_of[s] = t;
    int rc = ctl_send(c, g, W.hdr + W.get_payload);
    if (rc == -2) { /* not sent: owed, sent first when run() is called again */
        c->get_rid--;
        r[K_POLLS]--;
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
    if (c->io.kind == IO_DGRAM)
        return ctl_take_named(c, status, rid, rd64(a + 16), a + W.hdr, rlen, t_resp);
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
    unsigned idle = 0;
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
                int src = ctl_send(c, fr, (uint32_t)lens[i]);
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
                    c->ctr_of[s] = c->counter - 1;
                    int64_t *r = ctl_row(c, s);
                    r[K_SHOT] = s;
                    r[K_RID] = rid;
                    r[K_EMIT] = tick;
                    r[K_DUE] = tick;
                    r[K_SENT] = t_sent;
                    r[K_STATUS] = -1;
                    c->s_emit++;
                    c->f_emit = 0;
                    int grc = ctl_send_get(c, s);
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
                t_progress = t_sent;
                idle = 0;
                continue; /* the next frame may be due already */
            }
        }
        /* nothing more due now: what was gathered goes out (stream links; rings sent already) */
        if (c->io.out_n && io_flush(&c->io) < 0) {
            code = -1;
            break;
        }
        /* answers */
        if (c->s_ans < c->s_emit) {
            int prc = ctl_poll(c, &progress);
            if (prc == -3) {
                code = -1;
                break;
            }
            if (prc < 0) {
                code = -2;
                break;
            }
            if (progress) {
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
                    int64_t k = (t - c->t0 + cyc - 1) / cyc + c->gap_cycles;
                    c->shot_t0 = c->t0 + k * cyc;
                }
                continue;
            }
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
            if (io_peer_closed(&c->io) || io_flush(&c->io) < 0) {
                code = -1;
                break;
            }
            if (c->io.kind == IO_DGRAM && c->s_ans < c->s_emit && now - c->get_t_of[c->s_ans] > c->get_timeout_ns) {
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
    io_flush(&c->io);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(code);
}

static PyObject *ctl_stats(ControllerCore *c, PyObject *Py_UNUSED(ig)) {
    return Py_BuildValue(
        "{sLsLsLsLsLsLsLsLsLsLsLsLsLsLsy#s(LLLLLLLL)sLsLsLsLsL}", "shots_emitted", (long long)c->s_emit, "shots_answered",
        (long long)c->s_ans, "frames_sent", (long long)c->frames_sent, "late_frames", (long long)c->late,
        "max_lag_ns", (long long)c->max_lag, "reasks", (long long)c->reasks, "deadline_misses", (long long)c->misses,
        "bad_answers", (long long)c->bad_answers, "full_waits", (long long)c->full_waits, "t0_ns", (long long)c->t0,
        "t_end_ns", (long long)c->t_end, "counter", (long long)c->counter, "request_id", (long long)c->rid,
        "get_request_id", (long long)c->get_rid, "pauli_frame", (const char *)c->pauli, (Py_ssize_t)c->nbo, "statuses",
        (long long)c->statuses[0], (long long)c->statuses[1], (long long)c->statuses[2], (long long)c->statuses[3],
        (long long)c->statuses[4], (long long)c->statuses[5], (long long)c->statuses[6], (long long)c->statuses[7],
        "resent_gets", (long long)c->resends, "stale_answers", (long long)c->stale, "repairs", (long long)c->repairs,
        "resent_frames", (long long)c->resent_frames, "looks", (long long)c->pings);
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

/* ================================================================== floor */

/* link_round_trip(link, n, nbytes, echo, out): the bare round trip of whole messages over
 * the same link (rings or a stream socket) through the same I/O the cores use: the floor of
 * a frame and its answer. echo=1 on the answering side (it returns after n messages). out:
 * int64 per round trip (initiator). Each message goes out at once (no gathering). */
static PyObject *mod_link_round_trip(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *link, *out;
    long long n, nbytes;
    int echo;
    if (!PyArg_ParseTuple(args, "OLLpO", &link, &n, &nbytes, &echo, &out))
        return NULL;
    if (nbytes < 1 || nbytes > 4096) {
        PyErr_SetString(PyExc_ValueError, "nbytes in 1..4096");
        return NULL;
    }
    Io io;
    if (io_init(&io, link) < 0) {
        io_free(&io);
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
            PyErr_SetString(PyExc_ValueError, "out too small");
            return NULL;
        }
    }
    uint8_t msg[4096];
    memset(msg, 0x5A, sizeof(msg));
    int code = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (long long i = 0; i < n && code == 0; i++) {
        int64_t t0 = mono_ns();
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
            if (io_send(&io, msg, (uint64_t)nbytes, NULL, 0) != QLINK_RING_SENT || io_flush(&io) < 0)
                code = -1;
        } else {
            ((int64_t *)ob.buf)[i] = mono_ns() - t0;
        }
    }
    while (io_flush(&io) == 1) /* (a stream: what is left of the last answer) */
        CPU_RELAX();
    Py_END_ALLOW_THREADS;
    if (has_out)
        PyBuffer_Release(&ob);
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

static PyMethodDef module_methods[] = {
    {"udp_blast", mod_udp_blast, METH_VARARGS,
     "udp_blast(fd, n, nbytes, period_ns, batch) -> (sent, t_first_ns, t_last_ns, full_waits)"},
    {"udp_sink", mod_udp_sink, METH_VARARGS, "udp_sink(fd, n, idle_ns) -> (received, t_first_ns, t_last_ns, batches)"},
    {"set_wire_layout", mod_set_wire_layout, METH_O, "set_wire_layout(dict): qlink.wire's numbers and struct formats"},
    {"set_stream_layout", mod_set_stream_layout, METH_O,
     "set_stream_layout(dict): the tcp framing of transports._framing (header format, kinds, payload cap)"},
    {"link_round_trip", mod_link_round_trip, METH_VARARGS,
     "link_round_trip(link, n, nbytes, echo, out) -> 0, or -1 when the peer went away"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hotcore_module = {
    PyModuleDef_HEAD_INIT, "_hotcore", "Native per-frame path of the qlink QEC loop over shared memory.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__hotcore(void) {
    PyObject *ringc = PyImport_ImportModule("transports._ringc"); /* (PyCapsule_Import imports only the package) */
    if (ringc == NULL)
        return NULL;
    Py_DECREF(ringc);
    RAPI = (qlink_ring_api *)PyCapsule_Import(QLINK_RING_API_CAPSULE, 0);
    if (RAPI == NULL)
        return NULL;
    if (RAPI->version != QLINK_RING_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "transports._ringc offers ring API version %d, qlink.qec._hotcore needs %d",
                     RAPI->version, QLINK_RING_API_VERSION);
        return NULL;
    }
    if (PyType_Ready(&ServiceCoreType) < 0 || PyType_Ready(&ControllerCoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&hotcore_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ServiceCoreType);
    Py_INCREF(&ControllerCoreType);
    if (PyModule_AddObject(m, "ServiceCore", (PyObject *)&ServiceCoreType) < 0 ||
        PyModule_AddObject(m, "ControllerCore", (PyObject *)&ControllerCoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
