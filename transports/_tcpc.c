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
 * recv_pieces(sock_fd, region, dst_offsets, nbytes, state) -> bytes read (-1: end of stream)
 *
 * The receiving side of the same frame: reads the socket straight into the pieces
 * region[dst_offsets[i] : dst_offsets[i] + nbytes[i]], many pieces per recvmsg (an iovec each),
 * without blocking, until the socket has no more or every piece is full. `state` (int64[2]: the
 * piece in progress, the bytes of it read) says where it stands.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define IOV_BATCH 256

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
    Py_buffer src, so, ln, st;
    if (PyObject_GetBuffer(args[4], &src, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[5], &so, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (PyObject_GetBuffer(args[6], &ln, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&so);
        return NULL;
    }
    if (PyObject_GetBuffer(args[7], &st, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&so);
        PyBuffer_Release(&ln);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t count = ln.len / 8;
    const int64_t *off = so.buf, *len = ln.buf;
    int64_t *state = st.buf;
    if (so.len != ln.len || ln.len % 8 || st.len < 24) {
        PyErr_SetString(PyExc_ValueError, "splice_pieces: src_offsets and nbytes must be int64 arrays of one length, "
                                          "state an int64 array of 3");
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (off[i] < 0 || len[i] < 0 || off[i] + len[i] > (int64_t)src.len) {
            PyErr_Format(PyExc_ValueError, "splice_pieces: piece %zd (%lld bytes at %lld) lies outside the %zd-byte "
                         "source", i, (long long)len[i], (long long)off[i], src.len);
            goto done;
        }
    }
    int64_t i = state[0], at = state[1], inpipe = state[2];
    if (i < 0 || i > count || at < 0 || inpipe < 0 || (i < count && at > len[i])) {
        PyErr_SetString(PyExc_ValueError, "splice_pieces: the state does not fit these pieces");
        goto done;
    }
    long long written = 0;
    int err = 0;
    const char *failed = NULL;
    char *base = src.buf;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        if (inpipe > 0) {
            unsigned int fl = SPLICE_F_NONBLOCK | SPLICE_F_MOVE | (i < count ? SPLICE_F_MORE : 0);
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
        while (i < count && at >= len[i]) {
            i++;
            at = 0;
        }
        if (i >= count)
            break;
        struct iovec iov[IOV_BATCH];
        int n = 0;
        long long room = pipe_nbytes;
        for (int64_t j = i, a = at; j < count && n < IOV_BATCH && room > 0; j++, a = 0) {
            long long k = len[j] - a;
            if (k <= 0)
                continue;
            if (k > room)
                k = room;
            iov[n].iov_base = base + off[j] + a;
            iov[n].iov_len = (size_t)k;
            n++;
            room -= k;
        }
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
        while (k > 0) { /* step over what went into the pipe */
            long long left = len[i] - at;
            if (k >= left) {
                k -= left;
                i++;
                at = 0;
            } else {
                at += k;
                k = 0;
            }
        }
    }
    Py_END_ALLOW_THREADS
    state[0] = i;
    state[1] = at;
    state[2] = inpipe;
    if (failed) {
        errno = err;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, failed);
        goto done;
    }
    res = PyLong_FromLongLong(written);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&so);
    PyBuffer_Release(&ln);
    PyBuffer_Release(&st);
    return res;
}

static PyObject *recv_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "recv_pieces(sock_fd, region, dst_offsets, nbytes, state)");
        return NULL;
    }
    int sock = PyLong_AsLong(args[0]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer dst, dof, ln, st;
    if (PyObject_GetBuffer(args[1], &dst, PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[2], &dof, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (PyObject_GetBuffer(args[3], &ln, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&dof);
        return NULL;
    }
    if (PyObject_GetBuffer(args[4], &st, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&dof);
        PyBuffer_Release(&ln);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t count = ln.len / 8;
    const int64_t *off = dof.buf, *len = ln.buf;
    int64_t *state = st.buf;
    if (dof.len != ln.len || ln.len % 8 || st.len < 16) {
        PyErr_SetString(PyExc_ValueError, "recv_pieces: dst_offsets and nbytes must be int64 arrays of one length, "
                                          "state an int64 array of 2");
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (off[i] < 0 || len[i] < 0 || off[i] + len[i] > (int64_t)dst.len) {
            PyErr_Format(PyExc_ValueError, "recv_pieces: piece %zd (%lld bytes at %lld) lies outside the %zd-byte "
                         "region", i, (long long)len[i], (long long)off[i], dst.len);
            goto done;
        }
    }
    int64_t i = state[0], at = state[1];
    if (i < 0 || i > count || at < 0 || (i < count && at > len[i])) {
        PyErr_SetString(PyExc_ValueError, "recv_pieces: the state does not fit these pieces");
        goto done;
    }
    long long got = 0;
    int err = 0, eof = 0;
    char *base = dst.buf;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        while (i < count && at >= len[i]) {
            i++;
            at = 0;
        }
        if (i >= count)
            break;
        struct iovec iov[IOV_BATCH];
        int n = 0;
        for (int64_t j = i, a = at; j < count && n < IOV_BATCH; j++, a = 0) {
            if (len[j] - a <= 0)
                continue;
            iov[n].iov_base = base + off[j] + a;
            iov[n].iov_len = (size_t)(len[j] - a);
            n++;
        }
        struct msghdr mh = {0};
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)n;
        ssize_t k = recvmsg(sock, &mh, MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                err = errno;
            break;
        }
        if (k == 0) {
            eof = 1;
            break;
        }
        got += k;
        while (k > 0) {
            long long left = len[i] - at;
            if (k >= left) {
                k -= left;
                i++;
                at = 0;
            } else {
                at += k;
                k = 0;
            }
        }
    }
    Py_END_ALLOW_THREADS
    state[0] = i;
    state[1] = at;
    if (err) {
        errno = err;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, "recvmsg");
        goto done;
    }
    res = PyLong_FromLongLong(eof && !got ? -1 : got);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&dof);
    PyBuffer_Release(&ln);
    PyBuffer_Release(&st);
    return res;
}

static PyMethodDef methods[] = {
    {"splice_pieces", (PyCFunction)(void (*)(void))splice_pieces, METH_FASTCALL,
     "splice_pieces(sock_fd, pipe_r, pipe_w, pipe_nbytes, src, src_offsets, nbytes, state) -> bytes written"},
    {"recv_pieces", (PyCFunction)(void (*)(void))recv_pieces, METH_FASTCALL,
     "recv_pieces(sock_fd, region, dst_offsets, nbytes, state) -> bytes read (-1: end of stream)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tcpc",
                                    "A put's pieces into a TCP socket by splice, and out of it by recvmsg.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__tcpc(void) { return PyModule_Create(&module); }
