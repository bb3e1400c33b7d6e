/*
 * transports._ringc: C accelerator of the shared-memory SPSC ring.
 *
 * Same byte layout and the same Python API as transports/_ring.py (read its module
 * docstring for the layout). The point of this module is the hot path: a send is
 * one memcpy plus a release store of `head`; a receive is a bounded spin on an
 * acquire load of `head`, one memcpy and a release store of `tail`. Nothing is
 * allocated on those paths (results are small ints, which CPython caches).
 *
 * A receive that finds its record at once never releases the GIL; one that has to spin
 * releases it for the spin (see spin_for_record).
 */
#define _GNU_SOURCE /* sched_getcpu */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <sched.h>
#include <string.h>
#include <time.h>
#include "_ring_api.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the qlink ring layout is little-endian; this build target is not"
#endif

#define HEADER_NBYTES 512
#define REC_HDR 16
#define MIN_DATA_NBYTES 1024ULL
#define MAX_DATA_NBYTES (1ULL << 30)
#define MAX_RECORD (1ULL << 18)
#define RING_MAGIC 0x3130474E49524C51ULL /* "QLRING01" little-endian */

#define OFF_MAGIC 0
#define OFF_SIZE 8
#define OFF_HEAD 64
#define OFF_TAIL 128
#define OFF_PCLOSED 192
#define OFF_CCLOSED 256
#define OFF_PCPU 320 /* hint: 1 + the CPU the producer last sent from (0: unknown) */
#define OFF_PULLED 384 /* last deferred put the consumer has pulled (stored by the consumer) */

#define KIND_CORRUPT 0
#define KIND_PAD 1
#define KIND_MSG 2

#define SEND_OK 1
#define SEND_FULL 0
#define SEND_TOO_BIG (-1)
#define SEND_PEER_CLOSED (-2)
#define RELEASED (-3)
#define RECV_EMPTY (-1)
#define RECV_SLOW (-2)

typedef struct {
    uint32_t nbytes;
    uint16_t kind;
    uint16_t reserved;
    uint64_t aux;
} rec_hdr;

typedef struct {
    PyObject_HEAD
    Py_buffer buf;
    int has_buf;
    uint8_t *hdr;
    uint8_t *data;
    uint64_t size, mask, max_payload;
    uint64_t head, tail_cache; /* producer side, local */
    uint64_t tail, head_cache; /* consumer side, local */
    unsigned long long messages, message_bytes;
    PyObject *data_view; /* memoryview of the data area, created on first use */
    uint64_t cpu_pub;    /* producer: the CPU hint last published */
    int spinning;        /* threads inside a GIL-free spin on this ring */
    int release_pending; /* release() came while spinning: the last spinner does it */
} RingObject;

static void ring_release(RingObject *r);

static inline uint64_t ld_acq(const uint8_t *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE); }
static inline uint64_t ld_rlx(const uint8_t *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_RELAXED); }
static inline void st_rel(uint8_t *p, uint64_t v) { __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE); }
static inline uint64_t align16(uint64_t n) { return (n + 15) & ~(uint64_t)15; }

/* ------------------------------------------------------------------ producer */

/* Reserve `need` contiguous bytes, writing a pad record first if the end of the data
 * area is too close. Returns the write position, or -1 when the ring lacks room.
 * Nothing is published (the caller's release store of head publishes pad + record). */
static inline int64_t reserve(RingObject *r, uint64_t need) {
    uint64_t pos = r->head & r->mask;
    uint64_t contiguous = r->size - pos;
    uint64_t total = need <= contiguous ? need : contiguous + need;
    if (r->size - (r->head - r->tail_cache) < total) {
        r->tail_cache = ld_acq(r->hdr + OFF_TAIL);
        if (r->size - (r->head - r->tail_cache) < total)
            return -1;
    }
    if (need > contiguous) {
        rec_hdr pad = {(uint32_t)(contiguous - REC_HDR), KIND_PAD, 0, 0};
        memcpy(r->data + pos, &pad, REC_HDR);
        r->head += contiguous;
        pos = 0;
    }
    return (int64_t)pos;
}

static int send_parts(RingObject *r, unsigned kind, uint64_t aux, const void *p1, uint64_t n1, const void *p2,
                      uint64_t n2) {
    if (ld_rlx(r->hdr + OFF_CCLOSED))
        return SEND_PEER_CLOSED;
    uint64_t n = n1 + n2;
    if (n > r->max_payload)
        return SEND_TOO_BIG;
    uint64_t need = REC_HDR + align16(n);
    int64_t pos = reserve(r, need);
    if (pos < 0)
        return SEND_FULL;
    rec_hdr h = {(uint32_t)n, (uint16_t)kind, 0, aux};
    uint8_t *dst = r->data + pos;
    memcpy(dst, &h, REC_HDR);
    if (n1)
        memcpy(dst + REC_HDR, p1, n1);
    if (n2)
        memcpy(dst + REC_HDR + n1, p2, n2);
    r->head += need;
    st_rel(r->hdr + OFF_HEAD, r->head); /* the record's bytes become visible no later than head */
    int cpu = sched_getcpu();
    if (cpu >= 0 && (uint64_t)cpu + 1 != r->cpu_pub) { /* stored only when it changes: no line bouncing */
        r->cpu_pub = (uint64_t)cpu + 1;
        __atomic_store_n((uint64_t *)(r->hdr + OFF_PCPU), r->cpu_pub, __ATOMIC_RELAXED);
    }
    return SEND_OK;
}

static PyObject *Ring_try_send_msg(RingObject *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "try_send_msg(data) takes one argument");
        return NULL;
    }
    if (!r->has_buf)
        return PyLong_FromLong(RELEASED);
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* not a contiguous buffer: the caller's slow path says why */
        return PyLong_FromLong(SEND_TOO_BIG);
    }
    int rc = send_parts(r, KIND_MSG, (uint64_t)b.len, b.buf, (uint64_t)b.len, NULL, 0);
    if (rc == SEND_OK) {
        r->messages++;
        r->message_bytes += (unsigned long long)b.len;
    }
    PyBuffer_Release(&b);
    return PyLong_FromLong(rc);
}

static PyObject *Ring_try_send(RingObject *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "try_send(kind, aux, part1, part2=None)");
        return NULL;
    }
    if (!r->has_buf)
        return PyLong_FromLong(RELEASED);
    long kind = PyLong_AsLong(args[0]);
    if (kind == -1 && PyErr_Occurred())
        return NULL;
    if (kind < 1 || kind > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "record kind must be in 1..65535");
        return NULL;
    }
    unsigned long long aux = PyLong_AsUnsignedLongLong(args[1]);
    if (aux == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer b1, b2;
    int has2 = nargs == 4 && args[3] != Py_None;
    if (PyObject_GetBuffer(args[2], &b1, PyBUF_SIMPLE) < 0)
        return NULL;
    if (has2 && PyObject_GetBuffer(args[3], &b2, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&b1);
        return NULL;
    }
    int rc = send_parts(r, (unsigned)kind, aux, b1.buf, (uint64_t)b1.len, has2 ? b2.buf : NULL,
                        has2 ? (uint64_t)b2.len : 0);
    PyBuffer_Release(&b1);
    if (has2)
        PyBuffer_Release(&b2);
    return PyLong_FromLong(rc);
}

static PyObject *Ring_free_nbytes(RingObject *r, PyObject *Py_UNUSED(ignored)) {
    if (!r->has_buf)
        return PyLong_FromLong(0);
    r->tail_cache = ld_acq(r->hdr + OFF_TAIL);
    return PyLong_FromUnsignedLongLong(r->size - (r->head - r->tail_cache));
}

/* ------------------------------------------------------------------ consumer */

/* 1: a non-pad record at the head (*h, *pos filled); 0: empty; -1: corrupt (*h, *pos filled). */
static inline int head_record(RingObject *r, rec_hdr *h, uint64_t *pos_out) {
    for (;;) {
        if (r->tail == r->head_cache) {
            r->head_cache = ld_acq(r->hdr + OFF_HEAD);
            if (r->tail == r->head_cache)
                return 0;
        }
        uint64_t pos = r->tail & r->mask;
        memcpy(h, r->data + pos, REC_HDR);
        uint64_t stride = REC_HDR + align16(h->nbytes);
        *pos_out = pos;
        if (stride > r->size - pos || stride > r->head_cache - r->tail)
            return -1;
        if (h->kind != KIND_PAD)
            return 1;
        r->tail += stride;
        st_rel(r->hdr + OFF_TAIL, r->tail);
    }
}

/* Poll up to spin_iters times; 1 / 0 / -1 as head_record (0 also when the ring was
 * released meanwhile: callers then find has_buf cleared).
 *
 * The GIL is released for the spin (not for the first poll, which is all a ready record
 * costs), so another thread of this process (a sender, a progress thread) runs meanwhile
 * instead of waiting for the interpreter's 5 ms switch interval. A release() that comes
 * from another thread during the spin is deferred to the spinner, which stops early.
 *
 * Every 16 polls, if the producer's CPU hint is our CPU, sched_yield(): it cannot run
 * while we spin. With yield_every > 0, also sched_yield() every that many polls
 * regardless. Off by default: measured on a busy 2-core machine, yielding blindly inside
 * the short C spin raised the median round trip ~10x when a third process wanted a CPU;
 * the endpoint's Python wait loop yields instead, after 100 us without progress. */
static long yield_every = 0;
static int release_gil = 1;

/* The producer last ran on the CPU we are spinning on: it is queued behind us (or asleep),
 * and spinning can only delay it, so give the CPU away. Two spinning processes that the
 * scheduler put on one core otherwise stall each other for a time slice per message. */
static inline int producer_shares_our_cpu(RingObject *r) {
    uint64_t pc = __atomic_load_n((uint64_t *)(r->hdr + OFF_PCPU), __ATOMIC_RELAXED);
    if (pc == 0)
        return 0;
    int cpu = sched_getcpu();
    return cpu >= 0 && (uint64_t)cpu + 1 == pc;
}
static int spin_for_record(RingObject *r, rec_hdr *h, uint64_t *pos, long spin_iters) {
    int st = head_record(r, h, pos);
    if (st != 0 || spin_iters <= 0)
        return st;
    PyThreadState *ts = NULL;
    r->spinning++;
    if (release_gil)
        ts = PyEval_SaveThread();
    for (long i = 1; st == 0 && i <= spin_iters; i++) {
        if (__atomic_load_n(&r->release_pending, __ATOMIC_ACQUIRE))
            break;
        if ((yield_every > 0 && i % yield_every == 0) || ((i & 15) == 0 && producer_shares_our_cpu(r)))
            sched_yield();
        else
            CPU_RELAX();
        st = head_record(r, h, pos);
    }
    if (ts != NULL)
        PyEval_RestoreThread(ts);
    if (--r->spinning == 0 && r->release_pending) {
        ring_release(r);
        return 0;
    }
    return st;
}

static PyObject *Ring_try_recv(RingObject *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "try_recv(out, spin_iters) takes two arguments");
        return NULL;
    }
    if (!r->has_buf)
        return PyLong_FromLong(RELEASED);
    long spin = PyLong_AsLong(args[1]);
    if (spin == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_WRITABLE) < 0) {
        PyErr_Clear(); /* read-only or not contiguous: the caller's slow path says why */
        return PyLong_FromLong(RECV_SLOW);
    }
    rec_hdr h;
    uint64_t pos;
    long rc;
    int st = spin_for_record(r, &h, &pos, spin);
    if (!r->has_buf) {
        rc = RELEASED;
    } else if (st == 0) {
        rc = RECV_EMPTY;
    } else if (st < 0 || h.kind != KIND_MSG || (uint64_t)h.nbytes != h.aux || (Py_ssize_t)h.nbytes > b.len) {
        rc = RECV_SLOW;
    } else {
        memcpy(b.buf, r->data + pos + REC_HDR, h.nbytes);
        r->tail += REC_HDR + align16(h.nbytes);
        st_rel(r->hdr + OFF_TAIL, r->tail); /* the producer may reuse the bytes once we have read them */
        r->messages++;
        r->message_bytes += h.nbytes;
        rc = (long)h.nbytes;
    }
    PyBuffer_Release(&b);
    return PyLong_FromLong(rc);
}

static PyObject *Ring_poll(RingObject *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "poll(spin_iters) takes one argument");
        return NULL;
    }
    if (!r->has_buf)
        Py_RETURN_FALSE;
    long spin = PyLong_AsLong(args[0]);
    if (spin == -1 && PyErr_Occurred())
        return NULL;
    rec_hdr h;
    uint64_t pos;
    if (spin_for_record(r, &h, &pos, spin) != 0)
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyObject *Ring_peek(RingObject *r, PyObject *Py_UNUSED(ignored)) {
    if (!r->has_buf)
        Py_RETURN_NONE;
    rec_hdr h;
    uint64_t pos;
    int st = head_record(r, &h, &pos);
    if (st == 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(IIKK)", st < 0 ? (unsigned)KIND_CORRUPT : (unsigned)h.kind, (unsigned)h.nbytes,
                         (unsigned long long)h.aux, (unsigned long long)(pos + REC_HDR));
}

static PyObject *Ring_consume(RingObject *r, PyObject *Py_UNUSED(ignored)) {
    if (!r->has_buf)
        Py_RETURN_NONE;
    rec_hdr h;
    uint64_t pos;
    if (head_record(r, &h, &pos) != 1) {
        PyErr_SetString(PyExc_RuntimeError, "consume() without a valid record at the head of the ring");
        return NULL;
    }
    r->tail += REC_HDR + align16(h.nbytes);
    st_rel(r->hdr + OFF_TAIL, r->tail);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ lifecycle */

static void ring_release(RingObject *r) {
    if (r->spinning > 0) { /* another thread spins on this memory without the GIL: it releases */
        __atomic_store_n(&r->release_pending, 1, __ATOMIC_RELEASE);
        return;
    }
    r->release_pending = 0;
    Py_CLEAR(r->data_view);
    if (r->has_buf) {
        r->has_buf = 0;
        r->hdr = r->data = NULL;
        PyBuffer_Release(&r->buf);
    }
}

static PyObject *Ring_release(RingObject *r, PyObject *Py_UNUSED(ignored)) {
    ring_release(r);
    Py_RETURN_NONE;
}

static int Ring_init(RingObject *r, PyObject *args, PyObject *kwds) {
    PyObject *obj;
    static char *kwlist[] = {"buffer", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Ring", kwlist, &obj))
        return -1;
    if (r->spinning) {
        PyErr_SetString(PyExc_RuntimeError, "cannot re-initialise a ring another thread is waiting on");
        return -1;
    }
    ring_release(r);
    if (PyObject_GetBuffer(obj, &r->buf, PyBUF_WRITABLE) < 0)
        return -1;
    r->has_buf = 1;
    if (r->buf.len < (Py_ssize_t)(HEADER_NBYTES + MIN_DATA_NBYTES)) {
        ring_release(r);
        PyErr_Format(PyExc_ValueError, "buffer of %zd bytes is too small for a ring", r->buf.len);
        return -1;
    }
    uint8_t *base = (uint8_t *)r->buf.buf;
    if (((uintptr_t)base & 7) != 0) {
        ring_release(r);
        PyErr_SetString(PyExc_ValueError, "ring memory must be 8-byte aligned");
        return -1;
    }
    uint64_t magic = ld_acq(base + OFF_MAGIC), size = ld_rlx(base + OFF_SIZE);
    if (magic != RING_MAGIC) {
        ring_release(r);
        PyErr_SetString(PyExc_ValueError, "buffer does not hold a ring (bad magic); call init_ring first");
        return -1;
    }
    if (size < MIN_DATA_NBYTES || size > MAX_DATA_NBYTES || (size & (size - 1)) ||
        (uint64_t)r->buf.len < HEADER_NBYTES + size) {
        ring_release(r);
        PyErr_Format(PyExc_ValueError, "ring header has an invalid data size %llu for a %zd-byte buffer",
                     (unsigned long long)size, r->buf.len);
        return -1;
    }
    r->hdr = base;
    r->data = base + HEADER_NBYTES;
    r->size = size;
    r->mask = size - 1;
    r->max_payload = (size / 4 < MAX_RECORD ? size / 4 : MAX_RECORD) - REC_HDR;
    r->head = r->head_cache = ld_acq(base + OFF_HEAD);
    r->tail = r->tail_cache = ld_acq(base + OFF_TAIL);
    r->messages = r->message_bytes = 0;
    return 0;
}

static void Ring_dealloc(RingObject *r) {
    ring_release(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* ------------------------------------------------------------------ attributes */

static PyObject *Ring_get_data(RingObject *r, void *Py_UNUSED(c)) {
    if (!r->has_buf) {
        PyErr_SetString(PyExc_ValueError, "ring was released");
        return NULL;
    }
    if (r->data_view == NULL) {
        PyObject *whole = PyMemoryView_FromObject(r->buf.obj);
        if (whole == NULL)
            return NULL;
        PyObject *flat = PyObject_CallMethod(whole, "cast", "s", "B");
        Py_DECREF(whole);
        if (flat == NULL)
            return NULL;
        PyObject *start = PyLong_FromLong(HEADER_NBYTES);
        PyObject *stop = PyLong_FromUnsignedLongLong(HEADER_NBYTES + r->size);
        PyObject *sl = (start && stop) ? PySlice_New(start, stop, NULL) : NULL;
        Py_XDECREF(start);
        Py_XDECREF(stop);
        if (sl == NULL) {
            Py_DECREF(flat);
            return NULL;
        }
        r->data_view = PyObject_GetItem(flat, sl);
        Py_DECREF(sl);
        Py_DECREF(flat);
        if (r->data_view == NULL)
            return NULL;
    }
    Py_INCREF(r->data_view);
    return r->data_view;
}

static PyObject *Ring_get_word(RingObject *r, void *closure) {
    if (!r->has_buf)
        return PyLong_FromLong(0);
    return PyLong_FromUnsignedLongLong(ld_acq(r->hdr + (uintptr_t)closure));
}

static PyObject *Ring_get_flag(RingObject *r, void *closure) {
    if (!r->has_buf)
        Py_RETURN_FALSE;
    return PyBool_FromLong(ld_acq(r->hdr + (uintptr_t)closure) != 0);
}

static PyObject *Ring_set_producer_closed(RingObject *r, PyObject *Py_UNUSED(ignored)) {
    if (r->has_buf)
        st_rel(r->hdr + OFF_PCLOSED, 1);
    Py_RETURN_NONE;
}

static PyObject *Ring_set_pulled(RingObject *r, PyObject *arg) {
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (r->has_buf)
        st_rel(r->hdr + OFF_PULLED, v);
    Py_RETURN_NONE;
}

static PyObject *Ring_set_consumer_closed(RingObject *r, PyObject *Py_UNUSED(ignored)) {
    if (r->has_buf)
        st_rel(r->hdr + OFF_CCLOSED, 1);
    Py_RETURN_NONE;
}

static PyObject *Ring_get_producer_head(RingObject *r, void *Py_UNUSED(c)) {
    return PyLong_FromUnsignedLongLong(r->head);
}

static PyObject *Ring_get_nbytes(RingObject *r, void *Py_UNUSED(c)) { return PyLong_FromUnsignedLongLong(r->size); }
static PyObject *Ring_get_max_payload(RingObject *r, void *Py_UNUSED(c)) {
    return PyLong_FromUnsignedLongLong(r->max_payload);
}
static PyObject *Ring_get_messages(RingObject *r, void *Py_UNUSED(c)) { return PyLong_FromUnsignedLongLong(r->messages); }
static PyObject *Ring_get_message_bytes(RingObject *r, void *Py_UNUSED(c)) {
    return PyLong_FromUnsignedLongLong(r->message_bytes);
}

static PyMethodDef Ring_methods[] = {
    {"try_send_msg", (PyCFunction)(void (*)(void))Ring_try_send_msg, METH_FASTCALL,
     "try_send_msg(data) -> 1 sent, 0 full, -1 needs the slow path (streaming, or not a contiguous buffer), -2 peer closed, -3 released"},
    {"try_send", (PyCFunction)(void (*)(void))Ring_try_send, METH_FASTCALL,
     "try_send(kind, aux, part1, part2=None) -> same codes as try_send_msg"},
    {"try_recv", (PyCFunction)(void (*)(void))Ring_try_recv, METH_FASTCALL,
     "try_recv(out, spin_iters) -> n >= 0, -1 empty, -2 use peek() (or out is not a writable contiguous buffer), -3 released"},
    {"poll", (PyCFunction)(void (*)(void))Ring_poll, METH_FASTCALL, "poll(spin_iters) -> True when a record is there"},
    {"peek", (PyCFunction)Ring_peek, METH_NOARGS, "peek() -> (kind, nbytes, aux, payload_offset) or None"},
    {"consume", (PyCFunction)Ring_consume, METH_NOARGS, "consume() -> advance past the head record"},
    {"free_nbytes", (PyCFunction)Ring_free_nbytes, METH_NOARGS, "bytes the producer could write now"},
    {"release", (PyCFunction)Ring_release, METH_NOARGS, "drop the reference to the shared memory"},
    {"set_producer_closed", (PyCFunction)Ring_set_producer_closed, METH_NOARGS, NULL},
    {"set_consumer_closed", (PyCFunction)Ring_set_consumer_closed, METH_NOARGS, NULL},
    {"set_pulled", (PyCFunction)Ring_set_pulled, METH_O, "consumer: publish the last deferred put pulled"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"data", (getter)Ring_get_data, NULL, "memoryview of the data area", NULL},
    {"head", (getter)Ring_get_word, NULL, "shared head", (void *)(uintptr_t)OFF_HEAD},
    {"tail", (getter)Ring_get_word, NULL, "shared tail", (void *)(uintptr_t)OFF_TAIL},
    {"pulled", (getter)Ring_get_word, NULL, "last deferred put the consumer pulled", (void *)(uintptr_t)OFF_PULLED},
    {"producer_closed", (getter)Ring_get_flag, NULL, NULL, (void *)(uintptr_t)OFF_PCLOSED},
    {"consumer_closed", (getter)Ring_get_flag, NULL, NULL, (void *)(uintptr_t)OFF_CCLOSED},
    {"producer_head", (getter)Ring_get_producer_head, NULL, NULL, NULL},
    {"nbytes", (getter)Ring_get_nbytes, NULL, "data area bytes", NULL},
    {"max_payload", (getter)Ring_get_max_payload, NULL, "largest payload of one record", NULL},
    {"messages", (getter)Ring_get_messages, NULL, "messages moved by the fast paths", NULL},
    {"message_bytes", (getter)Ring_get_message_bytes, NULL, "bytes moved by the fast paths", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transports._ringc.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One end of a shared-memory SPSC ring (C implementation; see transports/_ring.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
};

/* ------------------------------------------------------------------ endpoint fast path */

/* FastPath(tx, rx, owner, slow_send, slow_recv, spin_iters): send / send_nowait /
 * recv_into / recv_into_nowait with the endpoint's signatures. Each tries the ring once
 * (a receive spins up to spin_iters polls) and otherwise calls
 * slow_send(owner, data, timeout_s, nowait) or slow_recv(owner, buf, timeout_s, nowait),
 * the endpoint's Python code for everything else: full ring, streaming, queued records,
 * waiting, errors. The owner (the endpoint) is held by a weak reference, so the endpoint
 * keeping this object's bound methods makes no reference cycle and is freed (closing its
 * socket) as soon as it is dropped. `rx_clean` (settable) says whether the receive side
 * may take the fast path at all (no message queued aside). */
typedef struct {
    PyObject_HEAD
    RingObject *tx;
    RingObject *rx;
    PyObject *owner_ref;
    PyObject *slow_send;
    PyObject *slow_recv;
    long spin_iters;
    int rx_clean;
    /* a send or put that finds this deadline passed goes through the Python path, which
     * looks at the peer's socket first: a sender into a dead peer learns of it within
     * peer_check_ns even when its messages still fit the ring */
    uint64_t next_peer_check_ns;
    uint64_t peer_check_ns;
    /* one-sided put / notifications (enable_one_sided); see the section below */
    struct one_sided *os;
} FastPathObject;

static void os_free(FastPathObject *f);
static int os_traverse(FastPathObject *f, visitproc visit, void *arg);

static PyObject *str_timeout_s; /* interned "timeout_s" */

static int fp_traverse(FastPathObject *f, visitproc visit, void *arg) {
    Py_VISIT(f->tx);
    Py_VISIT(f->rx);
    Py_VISIT(f->owner_ref);
    Py_VISIT(f->slow_send);
    Py_VISIT(f->slow_recv);
    return os_traverse(f, visit, arg);
}

static int fp_clear(FastPathObject *f) {
    Py_CLEAR(f->tx);
    Py_CLEAR(f->rx);
    Py_CLEAR(f->owner_ref);
    Py_CLEAR(f->slow_send);
    Py_CLEAR(f->slow_recv);
    os_free(f);
    return 0;
}

static void fp_dealloc(FastPathObject *f) {
    PyObject_GC_UnTrack(f);
    fp_clear(f);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static int fp_init(FastPathObject *f, PyObject *args, PyObject *kwds) {
    PyObject *tx, *rx, *owner, *ss, *sr;
    long spin;
    static char *kwlist[] = {"tx", "rx", "owner", "slow_send", "slow_recv", "spin_iters", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OOOl:FastPath", kwlist, &RingType, &tx, &RingType, &rx, &owner,
                                     &ss, &sr, &spin))
        return -1;
    if (!PyCallable_Check(ss) || !PyCallable_Check(sr)) {
        PyErr_SetString(PyExc_TypeError, "slow_send and slow_recv must be callables");
        return -1;
    }
    PyObject *ref = PyWeakref_NewRef(owner, NULL);
    if (ref == NULL)
        return -1;
    fp_clear(f);
    f->owner_ref = ref;
    Py_INCREF(tx);
    Py_INCREF(rx);
    Py_INCREF(ss);
    Py_INCREF(sr);
    f->tx = (RingObject *)tx;
    f->rx = (RingObject *)rx;
    f->slow_send = ss;
    f->slow_recv = sr;
    f->spin_iters = spin < 0 ? 0 : spin;
    f->rx_clean = 1;
    f->peer_check_ns = 5000000ULL; /* 5 ms */
    f->next_peer_check_ns = 0;
    return 0;
}

/* A setter's value as 0/1; -1 with an exception set (deleting, or truth testing failed). */
static int setter_bool(PyObject *v, const char *name) {
    if (v == NULL) {
        PyErr_Format(PyExc_AttributeError, "%s cannot be deleted", name);
        return -1;
    }
    return PyObject_IsTrue(v);
}

static inline uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* True at most once per peer_check_ns: time to let the Python path look at the peer. */
static inline int peer_check_due(FastPathObject *f) {
    uint64_t now = mono_ns();
    if (now < f->next_peer_check_ns)
        return 0;
    f->next_peer_check_ns = now + f->peer_check_ns;
    return 1;
}

/* Parse (obj, *, timeout_s=None). *fast is cleared when timeout_s is not a plain
 * non-negative number or None: the slow path then validates it (and raises). */
static int fp_args(const char *name, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int with_timeout,
                   PyObject **timeout, int *fast) {
    *timeout = Py_None;
    *fast = 1;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs != 1 || nkw > (with_timeout ? 1 : 0)) {
        PyErr_Format(PyExc_TypeError, "%s() takes one positional argument%s", name,
                     with_timeout ? " and the keyword argument timeout_s" : "");
        return -1;
    }
    if (nkw) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, 0);
        if (k != str_timeout_s && PyUnicode_Compare(k, str_timeout_s) != 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", name, k);
            return -1;
        }
        *timeout = args[1];
        if (*timeout != Py_None) {
            if (PyFloat_CheckExact(*timeout)) {
                double t = PyFloat_AS_DOUBLE(*timeout);
                *fast = t >= 0.0; /* false for NaN too */
            } else if (PyLong_CheckExact(*timeout)) {
                int overflow;
                long long v = PyLong_AsLongLongAndOverflow(*timeout, &overflow);
                *fast = overflow > 0 || (overflow == 0 && v >= 0);
            } else {
                *fast = 0;
            }
        }
    }
    return 0;
}

static PyObject *fp_call_slow(FastPathObject *f, PyObject *slow, PyObject *obj, PyObject *timeout, int nowait) {
    PyObject *owner = NULL;
    if (f->owner_ref != NULL) {
#if PY_VERSION_HEX >= 0x030D0000
        if (PyWeakref_GetRef(f->owner_ref, &owner) < 0)
            return NULL;
#else
        owner = PyWeakref_GetObject(f->owner_ref); /* borrowed */
        if (owner == NULL)
            return NULL;
        owner = owner == Py_None ? NULL : (Py_INCREF(owner), owner);
#endif
    }
    if (owner == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the shm endpoint behind this method no longer exists");
        return NULL;
    }
    PyObject *argv[4] = {owner, obj, timeout, nowait ? Py_True : Py_False};
    PyObject *res = PyObject_Vectorcall(slow, argv, 4, NULL);
    Py_DECREF(owner);
    return res;
}

static PyObject *fp_send_impl(FastPathObject *f, const char *name, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames, int nowait) {
    PyObject *timeout;
    int fast;
    if (fp_args(name, args, nargs, kwnames, !nowait, &timeout, &fast) < 0)
        return NULL;
    RingObject *r = f->tx;
    if (fast && r->has_buf && !peer_check_due(f)) {
        Py_buffer b;
        if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) == 0) {
            int rc = send_parts(r, KIND_MSG, (uint64_t)b.len, b.buf, (uint64_t)b.len, NULL, 0);
            if (rc == SEND_OK) {
                r->messages++;
                r->message_bytes += (unsigned long long)b.len;
            }
            PyBuffer_Release(&b);
            if (rc == SEND_OK)
                Py_RETURN_NONE;
        } else {
            PyErr_Clear();
        }
    }
    return fp_call_slow(f, f->slow_send, args[0], timeout, nowait);
}

static PyObject *fp_recv_impl(FastPathObject *f, const char *name, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames, int nowait) {
    PyObject *timeout;
    int fast;
    if (fp_args(name, args, nargs, kwnames, !nowait, &timeout, &fast) < 0)
        return NULL;
    RingObject *r = f->rx;
    if (fast && f->rx_clean && r->has_buf) {
        Py_buffer b;
        if (PyObject_GetBuffer(args[0], &b, PyBUF_WRITABLE) == 0) {
            rec_hdr h;
            uint64_t pos;
            long n = -1;
            int st = spin_for_record(r, &h, &pos, nowait ? 0 : f->spin_iters);
            if (st > 0 && r->has_buf && h.kind == KIND_MSG && (uint64_t)h.nbytes == h.aux && (Py_ssize_t)h.nbytes <= b.len) {
                memcpy(b.buf, r->data + pos + REC_HDR, h.nbytes);
                r->tail += REC_HDR + align16(h.nbytes);
                st_rel(r->hdr + OFF_TAIL, r->tail);
                r->messages++;
                r->message_bytes += h.nbytes;
                n = (long)h.nbytes;
            }
            PyBuffer_Release(&b);
            if (n >= 0)
                return PyLong_FromLong(n);
        } else {
            PyErr_Clear();
        }
    }
    return fp_call_slow(f, f->slow_recv, args[0], timeout, nowait);
}

static PyObject *fp_send(FastPathObject *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return fp_send_impl(f, "send", args, PyVectorcall_NARGS(nargsf), kwnames, 0);
}
static PyObject *fp_send_nowait(FastPathObject *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return fp_send_impl(f, "send_nowait", args, PyVectorcall_NARGS(nargsf), kwnames, 1);
}
static PyObject *fp_recv_into(FastPathObject *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return fp_recv_impl(f, "recv_into", args, PyVectorcall_NARGS(nargsf), kwnames, 0);
}
static PyObject *fp_recv_into_nowait(FastPathObject *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return fp_recv_impl(f, "recv_into_nowait", args, PyVectorcall_NARGS(nargsf), kwnames, 1);
}

/* One-sided put, vectored and deferred puts, notifications in C: a part of this file kept
 * in its own (included once, here, where it can use everything above). */
#include "_ringc_put.h"

static PyMethodDef fp_methods[] = {
    {"send", (PyCFunction)(void (*)(void))fp_send, METH_FASTCALL | METH_KEYWORDS, "send(data, *, timeout_s=None)"},
    {"send_nowait", (PyCFunction)(void (*)(void))fp_send_nowait, METH_FASTCALL | METH_KEYWORDS, "send_nowait(data)"},
    {"recv_into", (PyCFunction)(void (*)(void))fp_recv_into, METH_FASTCALL | METH_KEYWORDS,
     "recv_into(buf, *, timeout_s=None) -> nbytes"},
    {"recv_into_nowait", (PyCFunction)(void (*)(void))fp_recv_into_nowait, METH_FASTCALL | METH_KEYWORDS,
     "recv_into_nowait(buf) -> nbytes"},
    {"put", (PyCFunction)(void (*)(void))fp_put, METH_FASTCALL | METH_KEYWORDS,
     "put(data, remote, *, offset=0, notify_id=0, tag=b'', timeout_s=None)"},
    {"put_many", (PyCFunction)(void (*)(void))fp_put_many, METH_FASTCALL | METH_KEYWORDS,
     "put_many(data, remote, src_offsets, dst_offsets, nbytes, *, notify_id=0, tag=b'', timeout_s=None, "
     "defer=False) -> 1"},
    {"wait_notification", (PyCFunction)(void (*)(void))fp_wait_notification, METH_FASTCALL | METH_KEYWORDS,
     "wait_notification(*, timeout_s=None) -> Notification"},
    {"poll_notification_nowait", (PyCFunction)(void (*)(void))fp_poll_notification_nowait,
     METH_FASTCALL | METH_KEYWORDS, "poll_notification_nowait() -> Notification"},
    {"enable_one_sided", (PyCFunction)fp_enable_one_sided, METH_VARARGS,
     "enable_one_sided(peer_table, local_table, note_type, notes, slow_put, slow_put_many, slow_wait, slow_poll, "
     "finish_put)"},
    {"disable_one_sided", (PyCFunction)fp_disable_one_sided, METH_NOARGS,
     "drop every cached mapping and send every later put / notification to Python"},
    {"cache_remote", (PyCFunction)fp_cache_remote, METH_VARARGS, "cache_remote(remote, region_id, state, view)"},
    {"forget_remote", (PyCFunction)fp_forget_remote, METH_O, "forget_remote(region_id)"},
    {"cache_source", (PyCFunction)fp_cache_source, METH_VARARGS, "cache_source(region_id, state, view)"},
    {"cache_home", (PyCFunction)fp_cache_home, METH_O, "cache_home(region_id)"},
    {"pull_head", (PyCFunction)fp_pull_head, METH_NOARGS,
     "pull_head() -> Notification / True / None: carry out the PUT_PULL record at the head of the ring"},
    {"counters", (PyCFunction)fp_counters, METH_NOARGS,
     "counters() -> (puts, put_bytes, zero_copy_puts, gathered_puts, notifications, pulled_bytes, deferred_puts) "
     "done in C"},
    {NULL, NULL, 0, NULL},
};

static PyObject *fp_get_clean(FastPathObject *f, void *Py_UNUSED(c)) { return PyBool_FromLong(f->rx_clean); }
static int fp_set_clean(FastPathObject *f, PyObject *v, void *Py_UNUSED(c)) {
    int t = setter_bool(v, "rx_clean");
    if (t < 0)
        return -1;
    f->rx_clean = t;
    return 0;
}

static PyGetSetDef fp_getset[] = {
    {"rx_clean", (getter)fp_get_clean, (setter)fp_set_clean, "may receives take the fast path", NULL},
    {"peer_gone", (getter)fp_get_peer_gone, (setter)fp_set_peer_gone, "send every put to Python (peer gone)", NULL},
    {"pull_seq", (getter)fp_get_pull_seq, (setter)fp_set_pull_seq, "deferred puts posted from this side", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FastPathType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transports._ringc.FastPath",
    .tp_basicsize = sizeof(FastPathObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The hot path of an shm endpoint: send/recv_into on C rings, Python fallbacks for the rest.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)fp_init,
    .tp_dealloc = (destructor)fp_dealloc,
    .tp_traverse = (traverseproc)fp_traverse,
    .tp_clear = (inquiry)fp_clear,
    .tp_methods = fp_methods,
    .tp_getset = fp_getset,
};

static PyObject *mod_set_release_gil(PyObject *Py_UNUSED(m), PyObject *arg) {
    int v = PyObject_IsTrue(arg);
    if (v < 0)
        return NULL;
    int old = release_gil;
    release_gil = v;
    return PyBool_FromLong(old);
}

static PyObject *mod_set_yield_every(PyObject *Py_UNUSED(m), PyObject *arg) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    long old = yield_every;
    yield_every = v < 0 ? 0 : v;
    return PyLong_FromLong(old);
}

/* ------------------------------------------------------------------ C API (capsule) */
/* See _ring_api.h. The same layout code as the methods above, without Python objects. */

static int api_is_ring(PyObject *obj) { return PyObject_TypeCheck(obj, &RingType); }

static int api_send(PyObject *ring, const void *p1, uint64_t n1, const void *p2, uint64_t n2) {
    RingObject *r = (RingObject *)ring;
    if (!r->has_buf)
        return RELEASED;
    int rc = send_parts(r, KIND_MSG, n1 + n2, p1, n1, p2, n2);
    if (rc == SEND_OK) {
        r->messages++;
        r->message_bytes += n1 + n2;
    }
    return rc;
}

static int api_peek(PyObject *ring, const uint8_t **data, uint32_t *nbytes) {
    RingObject *r = (RingObject *)ring;
    if (!r->has_buf)
        return RELEASED;
    rec_hdr h;
    uint64_t pos;
    int st = head_record(r, &h, &pos);
    if (st == 0)
        return QLINK_RING_EMPTY;
    if (st < 0 || h.kind != KIND_MSG || (uint64_t)h.nbytes != h.aux)
        return QLINK_RING_OTHER;
    *data = r->data + pos + REC_HDR;
    *nbytes = h.nbytes;
    return QLINK_RING_MSG;
}

static void api_consume(PyObject *ring) {
    RingObject *r = (RingObject *)ring;
    rec_hdr h;
    uint64_t pos;
    if (!r->has_buf || head_record(r, &h, &pos) != 1)
        return;
    r->tail += REC_HDR + align16(h.nbytes);
    st_rel(r->hdr + OFF_TAIL, r->tail);
    r->messages++;
    r->message_bytes += h.nbytes;
}

static int api_peer_closed(PyObject *ring, int rx) {
    RingObject *r = (RingObject *)ring;
    if (!r->has_buf)
        return 1;
    return ld_acq(r->hdr + (rx ? OFF_PCLOSED : OFF_CCLOSED)) != 0;
}

static int api_producer_on_our_cpu(PyObject *ring) {
    RingObject *r = (RingObject *)ring;
    return r->has_buf && producer_shares_our_cpu(r);
}

/* the bytes queued for the consumer: exact up to QUEUED_EXACT_NBYTES, else at least that much.
 * The producer's head (a cache line it keeps writing) is read only when the head last read
 * is that close: a consumer far behind asks at no cost. */
#define QUEUED_EXACT_NBYTES 4096
static uint64_t api_queued_nbytes(PyObject *ring) {
    RingObject *r = (RingObject *)ring;
    if (!r->has_buf)
        return 0;
    if (r->head_cache - r->tail > QUEUED_EXACT_NBYTES)
        return r->head_cache - r->tail;
    r->head_cache = ld_acq(r->hdr + OFF_HEAD);
    return r->head_cache - r->tail;
}

static qlink_ring_api ring_c_api = {
    QLINK_RING_API_VERSION, api_is_ring,          api_send, api_peek, api_consume, api_peer_closed,
    api_producer_on_our_cpu, api_queued_nbytes,
};

/* Acquire the buffers of objs[0..n) with flags[i] each; -1 (those taken released) on failure. */
static int get_buffers(PyObject *const *objs, Py_buffer *bufs, const int *flags, int n) {
    for (int i = 0; i < n; i++) {
        if (PyObject_GetBuffer(objs[i], &bufs[i], flags[i]) < 0) {
            while (i-- > 0)
                PyBuffer_Release(&bufs[i]);
            return -1;
        }
    }
    return 0;
}

static void release_buffers(Py_buffer *bufs, int n) {
    for (int i = 0; i < n; i++)
        PyBuffer_Release(&bufs[i]);
}

/* first_bad_piece(src_offsets, dst_offsets, nbytes, src_nbytes, region_nbytes) -> -1 when every piece
 * lies inside both (0 <= offset, 0 <= nbytes, offset + nbytes <= the size), else the index of the
 * first that does not: put_many's checks in one pass over int64 arrays of one length, where NumPy
 * makes a dozen passes and temporaries (transports._pieces.check_pieces says what is wrong). */
static PyObject *mod_first_bad_piece(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "first_bad_piece(src_offsets, dst_offsets, nbytes, src_nbytes, region_nbytes)");
        return NULL;
    }
    long long src_n = PyLong_AsLongLong(args[3]), reg_n = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer bufs[3];
    static const int flags[3] = {PyBUF_SIMPLE, PyBUF_SIMPLE, PyBUF_SIMPLE};
    if (get_buffers(args, bufs, flags, 3) < 0)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t k = bufs[2].len / 8, bad = -1;
    if (bufs[0].len != bufs[2].len || bufs[1].len != bufs[2].len || bufs[2].len % 8) {
        PyErr_SetString(PyExc_ValueError, "first_bad_piece: offsets and nbytes must be int64 arrays of one length");
        goto out;
    }
    const int64_t *a = bufs[0].buf, *b = bufs[1].buf, *n = bufs[2].buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (a[i] < 0 || b[i] < 0 || n[i] < 0 || n[i] > src_n || a[i] > src_n - n[i] || n[i] > reg_n ||
            b[i] > reg_n - n[i]) {
            bad = i;
            break;
        }
    }
    res = PyLong_FromSsize_t(bad);
out:
    release_buffers(bufs, 3);
    return res;
}

/* copy_pieces(dst, src, src_offsets, dst_offsets, nbytes, streaming) -> bytes copied: the pieces of
 * `src` at `src_offsets` into `dst` at `dst_offsets` (int64 arrays of one length), in one C loop
 * without the GIL, with glibc's memcpy or (streaming=True) the non-temporal copy the target uses for
 * large deferred puts. A memcpy floor with no Python overhead per piece, for benchmarks. */
static PyObject *mod_copy_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "copy_pieces(dst, src, src_offsets, dst_offsets, nbytes, streaming)");
        return NULL;
    }
    Py_buffer bufs[5];
    static const int flags[5] = {PyBUF_WRITABLE, PyBUF_SIMPLE, PyBUF_SIMPLE, PyBUF_SIMPLE, PyBUF_SIMPLE};
    if (get_buffers(args, bufs, flags, 5) < 0)
        return NULL;
    Py_buffer d = bufs[0], s = bufs[1], so = bufs[2], dof = bufs[3], ln = bufs[4];
    int streaming = PyObject_IsTrue(args[5]);
    PyObject *res = NULL;
    Py_ssize_t k = ln.len / 8;
    if (streaming < 0 || so.len != ln.len || dof.len != ln.len || ln.len % 8) {
        if (streaming >= 0)
            PyErr_SetString(PyExc_ValueError, "offsets and nbytes must be int64 arrays of one length");
        goto out;
    }
    const int64_t *a = so.buf, *b = dof.buf, *n = ln.buf;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (a[i] < 0 || b[i] < 0 || n[i] < 0 || a[i] + n[i] > s.len || b[i] + n[i] > d.len) {
            PyErr_Format(PyExc_ValueError, "piece %zd (src %lld, dst %lld, %lld bytes) is outside the buffers", i,
                         (long long)a[i], (long long)b[i], (long long)n[i]);
            goto out;
        }
        total += (uint64_t)n[i];
    }
    uint8_t *dp = d.buf;
    const uint8_t *sp = s.buf;
    Py_BEGIN_ALLOW_THREADS
    if (streaming) {
        for (Py_ssize_t i = 0; i < k; i++)
            copy_streaming(dp + b[i], sp + a[i], (size_t)n[i]);
        store_fence();
    } else {
        for (Py_ssize_t i = 0; i < k; i++)
            memcpy(dp + b[i], sp + a[i], (size_t)n[i]);
    }
    Py_END_ALLOW_THREADS
    res = PyLong_FromUnsignedLongLong(total);
out:
    release_buffers(bufs, 5);
    return res;
}

/* rma_post(fn, ep, local_addr, local_offsets, remote_addr, remote_offsets, nbytes, rkey, param, out_reqs)
 * -> (requests in progress, status, index): one UCP RMA call per piece (`fn` is the address of
 * ucp_put_nbx or ucp_get_nbx; `ep`, `rkey` and `param` the UCP handles, as integers), in one C loop:
 * piece i moves nbytes[i] between local_addr + local_offsets[i] and remote_addr + remote_offsets[i].
 * The requests UCX hands back in progress are written to `out_reqs` (uint64, one slot per piece at
 * least); the loop stops at the first error status (status < 0, index of the piece). What Python's
 * ctypes would cost per piece (~1 us) is not paid: a 32 KiB piece moves in a few us. */
typedef void *(*rma_call_t)(void *ep, void *buffer, size_t count, uint64_t remote_addr, void *rkey,
                            const void *param);

static PyObject *mod_rma_post(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "rma_post(fn, ep, local_addr, local_offsets, remote_addr, remote_offsets, "
                                         "nbytes, rkey, param, out_reqs)");
        return NULL;
    }
    uint64_t fn = PyLong_AsUnsignedLongLong(args[0]), ep = PyLong_AsUnsignedLongLong(args[1]);
    uint64_t local = PyLong_AsUnsignedLongLong(args[2]), remote = PyLong_AsUnsignedLongLong(args[4]);
    uint64_t rkey = PyLong_AsUnsignedLongLong(args[7]), param = PyLong_AsUnsignedLongLong(args[8]);
    if (PyErr_Occurred())
        return NULL;
    if (!fn || !ep) {
        PyErr_SetString(PyExc_ValueError, "rma_post: a null function or endpoint");
        return NULL;
    }
    Py_buffer bufs[4];
    PyObject *const objs[4] = {args[3], args[5], args[6], args[9]};
    static const int flags[4] = {PyBUF_SIMPLE, PyBUF_SIMPLE, PyBUF_SIMPLE, PyBUF_WRITABLE};
    if (get_buffers(objs, bufs, flags, 4) < 0)
        return NULL;
    Py_buffer lo = bufs[0], ro = bufs[1], ln = bufs[2], out = bufs[3];
    PyObject *res = NULL;
    Py_ssize_t k = ln.len / 8;
    if (lo.len != ln.len || ro.len != ln.len || ln.len % 8 || out.len < ln.len) {
        PyErr_SetString(PyExc_ValueError, "rma_post: offsets and nbytes must be 8-byte arrays of one length, "
                                          "out_reqs at least as long");
        goto done;
    }
    const int64_t *a = lo.buf, *b = ro.buf, *n = ln.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (a[i] < 0 || b[i] < 0 || n[i] < 0) {
            PyErr_Format(PyExc_ValueError, "rma_post: piece %zd has a negative offset or size", i);
            goto done;
        }
    }
    uint64_t *reqs = out.buf;
    Py_ssize_t nin = 0, bad_at = -1;
    long status = 0;
    rma_call_t call = (rma_call_t)(uintptr_t)fn;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++) {
        if (!n[i])
            continue;
        uintptr_t r = (uintptr_t)call((void *)(uintptr_t)ep, (void *)(uintptr_t)(local + (uint64_t)a[i]), (size_t)n[i],
                                      remote + (uint64_t)b[i], (void *)(uintptr_t)rkey, (const void *)(uintptr_t)param);
        if (!r)
            continue;  /* done already */
        if (r >= (uintptr_t)(intptr_t)-100) { /* UCS_PTR_IS_ERR: a status, not a request */
            status = (long)(intptr_t)r;
            bad_at = i;
            break;
        }
        reqs[nin++] = (uint64_t)r;
    }
    Py_END_ALLOW_THREADS
    res = Py_BuildValue("(nln)", nin, status, bad_at);
done:
    release_buffers(bufs, 4);
    return res;
}

static PyMethodDef module_methods[] = {
    {"set_stream_copy", (PyCFunction)(void (*)(void))mod_set_stream_copy, METH_FASTCALL,
     "set_stream_copy(kind=None) -> previous kind: how the target copies large deferred puts ('avx512', 'avx2', "
     "'sse2', 'memcpy'; None or 'auto': the faster of memcpy and this CPU's best streaming copy, measured on the "
     "pulls, the measurement started over)"},
    {"pull_copy", (PyCFunction)mod_pull_copy, METH_NOARGS,
     "pull_copy() -> (kind, memcpy GB/s, streamed GB/s, memcpy records, streamed records) of large deferred puts"},
    {"set_release_gil", mod_set_release_gil, METH_O,
     "set_release_gil(flag) -> previous value: release the GIL while spinning (default True)"},
    {"make_note", mod_make_note, METH_VARARGS,
     "make_note(type, region_id, offset, nbytes, notify_id, tag): a Notification as the fast path builds it"},
    {"first_bad_piece", (PyCFunction)(void (*)(void))mod_first_bad_piece, METH_FASTCALL,
     "first_bad_piece(src_offsets, dst_offsets, nbytes, src_nbytes, region_nbytes) -> -1, or the index of the "
     "first piece outside the source or the region"},
    {"copy_pieces", (PyCFunction)(void (*)(void))mod_copy_pieces, METH_FASTCALL,
     "copy_pieces(dst, src, src_offsets, dst_offsets, nbytes, streaming) -> bytes copied (memcpy or streamed)"},
    {"rma_post", (PyCFunction)(void (*)(void))mod_rma_post, METH_FASTCALL,
     "rma_post(fn, ep, local_addr, local_offsets, remote_addr, remote_offsets, nbytes, rkey, param, out_reqs) -> "
     "(requests in progress, status, index of a failed piece or -1): one ucp_put_nbx/ucp_get_nbx per piece"},
    {"set_yield_every", mod_set_yield_every, METH_O,
     "set_yield_every(polls) -> previous value: sched_yield() every that many polls of a spin (0: never)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ringc_module = {
    PyModuleDef_HEAD_INIT, "_ringc", "C accelerator of the qlink shared-memory ring.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__ringc(void) {
    if (PyType_Ready(&RingType) < 0 || PyType_Ready(&FastPathType) < 0)
        return NULL;
    str_timeout_s = PyUnicode_InternFromString("timeout_s");
    str_offset = PyUnicode_InternFromString("offset");
    str_notify_id = PyUnicode_InternFromString("notify_id");
    str_tag = PyUnicode_InternFromString("tag");
    str_region_id = PyUnicode_InternFromString("region_id");
    str_nbytes = PyUnicode_InternFromString("nbytes");
    str_defer = PyUnicode_InternFromString("defer");
    empty_tuple = PyTuple_New(0);
    empty_bytes = PyBytes_FromStringAndSize(NULL, 0);
    if (!str_timeout_s || !str_offset || !str_notify_id || !str_tag || !str_region_id || !str_nbytes || !str_defer ||
        !empty_tuple || !empty_bytes)
        return NULL;
    PyObject *m = PyModule_Create(&ringc_module);
    if (m == NULL)
        return NULL;
    PyObject *impl = PyUnicode_FromString("c");
    if (impl == NULL || PyDict_SetItemString(RingType.tp_dict, "impl", impl) < 0) {
        Py_XDECREF(impl);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(impl);
    PyType_Modified(&RingType);
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&FastPathType);
    if (PyModule_AddObject(m, "FastPath", (PyObject *)&FastPathType) < 0) {
        Py_DECREF(&FastPathType);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(&ring_c_api, QLINK_RING_API_CAPSULE, NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    select_stream_copy(NULL);
    return m;
}
