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
 *
 * One translation unit in files of one job each, included below in this order:
 *   _hotcore.c          this file: time, little-endian access, the wire layout, the module
 *   _hotcore_io.h       shm rings / stream socket / datagram socket I/O under both cores
 *   _hotcore_svc.h      the service core's state, shot records, answers, decoder calls
 *   _hotcore_window.h   sliding windows with commit (a long memory experiment)
 *   _hotcore_frames.h   the service's frames, its run loop and its Python type
 *   _hotcore_pipe.h     a pipelined run: frames taken in by a thread of their own, decoding here
 *   _hotcore_sessions.h many sessions (a ServiceCore each) served at once from one thread
 *   _hotcore_ctl.h      the controller core
 *   _hotcore_floor.h    the floors measured beside the loop
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
/* Touch every page of p[0, n) (its bytes unchanged) so none is first faulted in on the clock. */
static void prefault(void *p, size_t n) {
    volatile uint8_t *b = (volatile uint8_t *)p;
    for (size_t i = 0; b != NULL && i < n; i += 4096)
        b[i] = b[i];
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


/* the rest of the module, one job a file (one translation unit: the files are included, in this order) */
#include "_hotcore_io.h"
#include "_hotcore_svc.h"
#include "_hotcore_window.h"
#include "_hotcore_frames.h"
#include "_hotcore_pipe.h"
#include "_hotcore_sessions.h"
#include "_hotcore_ctl.h"
#include "_hotcore_floor.h"

static PyMethodDef module_methods[] = {
    {"udp_blast", mod_udp_blast, METH_VARARGS,
     "udp_blast(fd, n, nbytes, period_ns, batch) -> (sent, t_first_ns, t_last_ns, full_waits)"},
    {"udp_sink", mod_udp_sink, METH_VARARGS, "udp_sink(fd, n, idle_ns) -> (received, t_first_ns, t_last_ns, batches)"},
    {"set_wire_layout", mod_set_wire_layout, METH_O, "set_wire_layout(dict): qlink.wire's numbers and struct formats"},
    {"set_stream_layout", mod_set_stream_layout, METH_O,
     "set_stream_layout(dict): the tcp framing of transports._framing (header format, kinds, payload cap)"},
    {"link_round_trip", mod_link_round_trip, METH_VARARGS,
     "link_round_trip(link, n, nbytes, echo, out) -> 0, or -1 when the peer went away"},
    {"serve_sessions", mod_serve_sessions, METH_VARARGS,
     "serve_sessions(cores, wake, epoll_fd, wake_fd, period_ns, frame_timeout_ns, idle_timeout_ns, quantum, "
     "low_quantum) -> (code, index): many sessions at once (see _hotcore_sessions.h)"},
    {"map_records", mod_map_records, METH_VARARGS,
     "map_records(table, num_detectors, records, out) -> ns: the service's measurement -> detector map over rows"},
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
