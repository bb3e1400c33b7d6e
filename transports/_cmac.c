/* transports._cmac: a put's pieces between two processes of one host, many pieces per system call (Linux).
 *
 * cma_pieces(pid, pidfd, write, local_addr, local_offsets, remote_addr, remote_offsets, nbytes) -> bytes moved
 *
 * Piece i moves nbytes[i] bytes between local_addr + local_offsets[i] (this process) and
 * remote_addr + remote_offsets[i] (process `pid`): written there when `write` is true
 * (process_vm_writev), read from there otherwise (process_vm_readv). Up to CMA_BATCH pieces go in
 * each call, an iovec per piece on each side: UCX's CMA transport makes one call per piece, and with
 * 32 KiB pieces the call, not the copy, was most of the time.
 *
 * `pidfd` (from pidfd_open, or -1) is polled before each call: once the peer has exited, the call
 * raises ProcessLookupError instead of touching memory under a pid the kernel may hand to another
 * process. Every other failure (the peer unmapped a region: EFAULT; not allowed: EPERM) raises
 * OSError with the errno of the failing call. Offsets and sizes are int64 arrays of one length. The
 * GIL is released while the bytes move.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>

#define CMA_BATCH 1024 /* UIO_MAXIOV */

static int peer_exited(int pidfd) {
    if (pidfd < 0)
        return 0;
    struct pollfd p = {.fd = pidfd, .events = POLLIN};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR));
}

/* Move pieces [i, k) from byte `done` of piece i on; returns 0 or an errno (ESRCH: the peer exited). */
static int move_pieces(pid_t pid, int pidfd, int write, uint64_t local, const int64_t *lo, uint64_t remote,
                       const int64_t *ro, const int64_t *ln, Py_ssize_t k, uint64_t *moved) {
    struct iovec a[CMA_BATCH], b[CMA_BATCH];
    Py_ssize_t i = 0;
    int64_t skip = 0; /* bytes of piece i already moved */
    while (i < k) {
        if (peer_exited(pidfd))
            return ESRCH;
        int n = 0;
        ssize_t want = 0;
        for (Py_ssize_t j = i; j < k && n < CMA_BATCH; j++) {
            int64_t from = j == i ? skip : 0;
            if (ln[j] - from <= 0)
                continue;
            a[n].iov_base = (void *)(uintptr_t)(local + (uint64_t)lo[j] + (uint64_t)from);
            b[n].iov_base = (void *)(uintptr_t)(remote + (uint64_t)ro[j] + (uint64_t)from);
            a[n].iov_len = b[n].iov_len = (size_t)(ln[j] - from);
            want += (ssize_t)a[n].iov_len;
            n++;
        }
        if (!n)
            break;
        ssize_t got = write ? process_vm_writev(pid, a, (unsigned long)n, b, (unsigned long)n, 0)
                            : process_vm_readv(pid, a, (unsigned long)n, b, (unsigned long)n, 0);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (got == 0)
            return EFAULT; /* nothing moved: a page the kernel could not reach */
        *moved += (uint64_t)got;
        /* advance past `got` bytes: whole pieces, then into the piece where it stopped */
        while (got > 0 && i < k) {
            int64_t left = ln[i] - skip;
            if (left <= 0) {
                i++, skip = 0;
                continue;
            }
            if (got >= left) {
                got -= left;
                i++, skip = 0;
            } else {
                skip += got;
                got = 0;
            }
        }
        while (i < k && ln[i] - skip <= 0)
            i++, skip = 0;
    }
    return 0;
}

static PyObject *mod_cma_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "cma_pieces(pid, pidfd, write, local_addr, local_offsets, remote_addr, "
                                         "remote_offsets, nbytes)");
        return NULL;
    }
    long pid = PyLong_AsLong(args[0]), pidfd = PyLong_AsLong(args[1]);
    int write = PyObject_IsTrue(args[2]);
    uint64_t local = PyLong_AsUnsignedLongLong(args[3]), remote = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred() || write < 0)
        return NULL;
    if (pid <= 0 || !local || !remote) {
        PyErr_SetString(PyExc_ValueError, "cma_pieces: a pid and both base addresses must be given");
        return NULL;
    }
    Py_buffer lo, ro, ln;
    if (PyObject_GetBuffer(args[4], &lo, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[6], &ro, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&lo);
        return NULL;
    }
    if (PyObject_GetBuffer(args[7], &ln, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&lo);
        PyBuffer_Release(&ro);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t k = ln.len / 8;
    if (lo.len != ln.len || ro.len != ln.len || ln.len % 8) {
        PyErr_SetString(PyExc_ValueError, "cma_pieces: offsets and nbytes must be int64 arrays of one length");
        goto done;
    }
    const int64_t *a = lo.buf, *b = ro.buf, *n = ln.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (a[i] < 0 || b[i] < 0 || n[i] < 0) {
            PyErr_Format(PyExc_ValueError, "cma_pieces: piece %zd has a negative offset or size", i);
            goto done;
        }
    }
    uint64_t moved = 0;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = move_pieces((pid_t)pid, (int)pidfd, write, local, a, remote, b, n, k, &moved);
    Py_END_ALLOW_THREADS
    if (err) { /* OSError(errno, text): ProcessLookupError for ESRCH, PermissionError for EPERM... */
        PyObject *text = PyUnicode_FromFormat("cma_pieces: %s of process %ld failed after %llu bytes: %s",
                                              write ? "process_vm_writev" : "process_vm_readv", pid,
                                              (unsigned long long)moved, strerror(err));
        PyObject *exc_args = text ? Py_BuildValue("(iN)", err, text) : NULL;
        if (exc_args) {
            PyErr_SetObject(PyExc_OSError, exc_args);
            Py_DECREF(exc_args);
        }
        goto done;
    }
    res = PyLong_FromUnsignedLongLong(moved);
done:
    PyBuffer_Release(&lo);
    PyBuffer_Release(&ro);
    PyBuffer_Release(&ln);
    return res;
}

static PyMethodDef methods[] = {
    {"cma_pieces", (PyCFunction)(void (*)(void))mod_cma_pieces, METH_FASTCALL,
     "cma_pieces(pid, pidfd, write, local_addr, local_offsets, remote_addr, remote_offsets, nbytes) -> bytes moved: "
     "process_vm_writev (write) or process_vm_readv of every piece, up to 1024 pieces per call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cmac",
                                    "A put's pieces between two processes of one host by process_vm_writev/readv.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__cmac(void) { return PyModule_Create(&module); }
