/* transports._tcpc: a put's pieces into and out of a TCP socket in one C loop (Linux).
 *
 * splice_pieces(sock_fd, pipe_r, pipe_w, pipe_nbytes, src, src_offsets, nbytes, state) -> bytes written
 *
 * The pieces src[src_offsets[i] : src_offsets[i] + nbytes[i]] are mapped into a pipe with vmsplice
 * (the pipe then refers to the caller's pages; nothing is copied) and moved from the pipe into the
 * socket with splice, which hands the same pages to the TCP stack. The only copy left is the
 * receiver's, out of the socket. The caller must leave the source unchanged until the receiver has
 * read the bytes (a deferred put_many and its flush).
 *
 * Non-blocking: the call does what the socket takes now and returns the number of bytes it wrote
 * to the socket. `state` (int64[3], read and written) says where it stands: the piece in progress,
 * the bytes of that piece already in the pipe, and the bytes waiting in the pipe. The pieces are
 * all written when state[0] == len(nbytes) and state[2] == 0. Errors other than a full socket
 * raise OSError with the errno of the failing call; the state then says what went before.
 *
 * recv_pieces(sock_fd, region, dst_offsets, nbytes, state, spin_ns=0) -> bytes read (-1: end of stream)
 *
 * The receiving side of the same frame: reads the socket straight into the pieces
 * region[dst_offsets[i] : dst_offsets[i] + nbytes[i]], many pieces per recvmsg (an iovec each),
 * without blocking, until every piece is full or the socket has had no more for spin_ns (0:
 * the first time it has none). `state` (int64[2]: the piece in progress, the bytes of it read)
 * says where it stands. A sender as fast as the reader keeps the socket nearly empty, so each
 * recvmsg finds about one segment (64 KiB on loopback): spinning here for the next costs a
 * system call, where going back to the caller's loop and coming back cost ~10 us of Python a
 * segment (a third of the receiver's time at 16 MiB layers, 2-core VM).
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define IOV_BATCH 256

/* A call's pieces: the memory they lie in, their offsets and sizes (int64 arrays of one length),
 * and the caller's record of where the call stands (int64[state_n], written back). */
typedef struct {
    Py_buffer mem, off, len, st;
    Py_ssize_t count;
} pieces_t;

static int pieces_get(pieces_t *p, PyObject *const *args, int mem_flags, Py_ssize_t state_n, const char *name,
                      const char *what) {
    PyObject *const objs[4] = {args[0], args[1], args[2], args[3]};
    Py_buffer *bufs[4] = {&p->mem, &p->off, &p->len, &p->st};
    const int flags[4] = {mem_flags, PyBUF_SIMPLE, PyBUF_SIMPLE, PyBUF_WRITABLE};
    for (int k = 0; k < 4; k++) {
        if (PyObject_GetBuffer(objs[k], bufs[k], flags[k]) < 0) {
            while (k--)
                PyBuffer_Release(bufs[k]);
            return -1;
        }
    }
    p->count = p->len.len / 8;
    const int64_t *off = p->off.buf, *len = p->len.buf, *state = p->st.buf;
    if (p->off.len != p->len.len || p->len.len % 8 || p->st.len < 8 * state_n) {
        PyErr_Format(PyExc_ValueError, "%s: offsets and nbytes must be int64 arrays of one length, state an int64 "
                     "array of %zd", name, state_n);
        goto bad;
    }
    for (Py_ssize_t i = 0; i < p->count; i++) {
        if (off[i] < 0 || len[i] < 0 || off[i] + len[i] > (int64_t)p->mem.len) {
            PyErr_Format(PyExc_ValueError, "%s: piece %zd (%lld bytes at %lld) lies outside the %zd-byte %s", name, i,
                         (long long)len[i], (long long)off[i], p->mem.len, what);
            goto bad;
        }
    }
    if (state[0] < 0 || state[0] > p->count || state[1] < 0 || (state[0] < p->count && state[1] > len[state[0]])) {
        PyErr_Format(PyExc_ValueError, "%s: the state does not fit these pieces", name);
        goto bad;
    }
    return 0;
bad:
    for (int k = 0; k < 4; k++)
        PyBuffer_Release(bufs[k]);
    return -1;
}

static void pieces_release(pieces_t *p) {
    PyBuffer_Release(&p->mem);
    PyBuffer_Release(&p->off);
    PyBuffer_Release(&p->len);
    PyBuffer_Release(&p->st);
}

/* Up to IOV_BATCH iovecs over the pieces from piece i, byte at, at most `room` bytes (< 0: no bound). */
static int pieces_iov(const pieces_t *p, int64_t i, int64_t at, long long room, struct iovec *iov) {
    const int64_t *off = p->off.buf, *len = p->len.buf;
    char *base = p->mem.buf;
    int n = 0;
    for (int64_t j = i, a = at; j < p->count && n < IOV_BATCH && room != 0; j++, a = 0) {
        long long k = len[j] - a;
        if (k <= 0)
            continue;
        if (room > 0 && k > room)
            k = room;
        iov[n].iov_base = base + off[j] + a;
        iov[n].iov_len = (size_t)k;
        n++;
        if (room > 0)
            room -= k;
    }
    return n;
}

/* Step (i, at) over k bytes of the pieces. */
static void pieces_step(const pieces_t *p, int64_t *i, int64_t *at, long long k) {
    const int64_t *len = p->len.buf;
    while (k > 0) {
        long long left = len[*i] - *at;
        if (k >= left) {
            k -= left;
            (*i)++;
            *at = 0;
        } else {
            *at += k;
            k = 0;
        }
    }
}

/* Step (i, at) past whole and empty pieces; true while a piece is left. */
static int pieces_left(const pieces_t *p, int64_t *i, int64_t *at) {
    const int64_t *len = p->len.buf;
    while (*i < p->count && *at >= len[*i]) {
        (*i)++;
        *at = 0;
    }
    return *i < p->count;
}

static PyObject *splice_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "splice_pieces(sock_fd, pipe_r, pipe_w, pipe_nbytes, src, src_offsets, "
                                         "nbytes, state)");
        return NULL;
    }
    int sock = PyLong_AsLong(args[0]), pr = PyLong_AsLong(args[1]), pw = PyLong_AsLong(args[2]);
    long long pipe_nbytes = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (pipe_nbytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "splice_pieces: pipe_nbytes must be positive");
        return NULL;
    }
    pieces_t p;
    if (pieces_get(&p, args + 4, PyBUF_SIMPLE, 3, "splice_pieces", "source") < 0)
        return NULL;
    int64_t *state = p.st.buf;
    int64_t i = state[0], at = state[1], inpipe = state[2];
    if (inpipe < 0) {
        pieces_release(&p);
        PyErr_SetString(PyExc_ValueError, "splice_pieces: the state does not fit these pieces");
        return NULL;
    }
    long long written = 0;
    int err = 0;
    const char *failed = NULL;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        if (inpipe > 0) {
            unsigned int fl = SPLICE_F_NONBLOCK | SPLICE_F_MOVE | (i < p.count ? SPLICE_F_MORE : 0);
            ssize_t k = splice(pr, NULL, sock, NULL, (size_t)inpipe, fl);
            if (k < 0) {
                if (errno == EINTR)
                    continue;
                if (errno != EAGAIN) {
                    err = errno;
                    failed = "splice";
                }
                break;
            }
            if (k == 0)
                break;
            inpipe -= k;
            written += k;
            continue;
        }
        if (!pieces_left(&p, &i, &at))
            break;
        struct iovec iov[IOV_BATCH];
        int n = pieces_iov(&p, i, at, pipe_nbytes, iov);
        ssize_t k = vmsplice(pw, iov, (unsigned long)n, SPLICE_F_NONBLOCK);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            failed = "vmsplice";
            break;
        }
        if (k == 0)
            break;
        inpipe += k;
        pieces_step(&p, &i, &at, k);
    }
    Py_END_ALLOW_THREADS
    state[0] = i;
    state[1] = at;
    state[2] = inpipe;
    pieces_release(&p);
    if (failed) {
        errno = err;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, failed);
    }
    return PyLong_FromLongLong(written);
}

static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static PyObject *recv_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "recv_pieces(sock_fd, region, dst_offsets, nbytes, state, spin_ns=0)");
        return NULL;
    }
    int sock = PyLong_AsLong(args[0]);
    long long spin_ns = nargs == 6 ? PyLong_AsLongLong(args[5]) : 0;
    if (PyErr_Occurred())
        return NULL;
    pieces_t p;
    if (pieces_get(&p, args + 1, PyBUF_WRITABLE, 2, "recv_pieces", "region") < 0)
        return NULL;
    int64_t *state = p.st.buf;
    int64_t i = state[0], at = state[1];
    long long got = 0;
    int err = 0, eof = 0;
    long long dry_since = 0; /* when the socket was first found empty since the last bytes */
    Py_BEGIN_ALLOW_THREADS
    while (pieces_left(&p, &i, &at)) {
        struct iovec iov[IOV_BATCH];
        struct msghdr mh = {0};
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)pieces_iov(&p, i, at, -1, iov);
        ssize_t k = recvmsg(sock, &mh, MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                err = errno;
                break;
            }
            if (spin_ns <= 0)
                break;
            long long t = now_ns();
            if (dry_since == 0)
                dry_since = t;
            else if (t - dry_since > spin_ns)
                break;
            continue;
        }
        dry_since = 0;
        if (k == 0) {
            eof = 1;
            break;
        }
        got += k;
        pieces_step(&p, &i, &at, k);
    }
    Py_END_ALLOW_THREADS
    state[0] = i;
    state[1] = at;
    pieces_release(&p);
    if (err) {
        errno = err;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, "recvmsg");
    }
    return PyLong_FromLongLong(eof && !got ? -1 : got);
}

static PyMethodDef methods[] = {
    {"splice_pieces", (PyCFunction)(void (*)(void))splice_pieces, METH_FASTCALL,
     "splice_pieces(sock_fd, pipe_r, pipe_w, pipe_nbytes, src, src_offsets, nbytes, state) -> bytes written"},
    {"recv_pieces", (PyCFunction)(void (*)(void))recv_pieces, METH_FASTCALL,
     "recv_pieces(sock_fd, region, dst_offsets, nbytes, state, spin_ns=0) -> bytes read (-1: end of stream)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tcpc",
                                    "A put's pieces into a TCP socket by splice, and out of it by recvmsg.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__tcpc(void) { return PyModule_Create(&module); }
