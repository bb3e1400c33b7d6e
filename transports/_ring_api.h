/*
 * transports/_ring_api.h: the C API of transports._ringc, for other native modules.
 *
 * A native module that moves whole messages through an shm endpoint's rings without the
 * interpreter (qlink's QEC hot path) gets this table from the capsule
 * "transports._ringc._C_API" and calls it on the endpoint's transports._ringc.Ring
 * objects. Only whole messages take this path; anything else at the head of a ring
 * (a streamed message, a one-sided put, a corrupt record) is left there for the
 * endpoint's Python code. Every call needs the ring to stay alive (hold a reference);
 * none touches a Python object, so they may run without the GIL as long as no other
 * thread uses the same ring meanwhile.
 */
#ifndef QLINK_RING_API_H
#define QLINK_RING_API_H
#include <stdint.h>

/* a polite busy-wait step, for the spin loops of the ring and of the code that uses it */
#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define CPU_RELAX() ((void)0)
#endif

#define QLINK_RING_API_CAPSULE "transports._ringc._C_API"
#define QLINK_RING_API_VERSION 1

/* send codes (as try_send_msg) */
#define QLINK_RING_SENT 1
#define QLINK_RING_FULL 0
#define QLINK_RING_TOO_BIG (-1)
#define QLINK_RING_PEER_CLOSED (-2)
#define QLINK_RING_RELEASED (-3)
/* peek codes */
#define QLINK_RING_MSG 1
#define QLINK_RING_EMPTY 0
#define QLINK_RING_OTHER (-1)

typedef struct {
    int version;
    /* 1 when obj is a transports._ringc.Ring */
    int (*is_ring)(PyObject *obj);
    /* one whole message of n1 + n2 bytes (p2 may be NULL): a send code */
    int (*send)(PyObject *ring, const void *p1, uint64_t n1, const void *p2, uint64_t n2);
    /* the message at the head: QLINK_RING_MSG (*data, *nbytes valid until consume),
     * QLINK_RING_EMPTY, QLINK_RING_OTHER (not a whole message) or QLINK_RING_RELEASED */
    int (*peek)(PyObject *ring, const uint8_t **data, uint32_t *nbytes);
    /* drop the head message (after a peek that returned QLINK_RING_MSG), counted */
    void (*consume)(PyObject *ring);
    /* the other side closed: the producer of an rx ring, the consumer of a tx ring */
    int (*peer_closed)(PyObject *ring, int rx);
    /* the producer of this ring last ran on the CPU the caller runs on (spinning then only
     * delays it: yield instead) */
    int (*producer_on_our_cpu)(PyObject *ring);
    /* consumer side: bytes of records waiting in the ring (headers and padding included) */
    uint64_t (*queued_nbytes)(PyObject *ring); /* exact up to 4 KiB, else a lower bound */
} qlink_ring_api;

#endif
