/* qlink.qec._hotcore: the service core's frames (enqueue_syndromes / get_corrections / reset_decoder), its run loop and its Python type.
 * (part of the one translation unit _hotcore.c, which includes it: not compiled on its own) */

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
    int64_t F = d->frames_per_shot;
    if (dec_take_counter(s, d, counter)) {
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

/* The answered shot's row, while the rows take one; t_out: when its answer left (0: now, the
 * clock read only where a row takes it). */
static void svc_record(ServiceCore *s, SvcDecoder *d, int64_t slot, int32_t status, int64_t t_out) {
    if (!s->has_rows)
        return;
    if (s->row_n >= s->nrows) {
        s->rows_dropped++;
        return;
    }
    int64_t *r = (int64_t *)s->rows.buf + s->row_n * SVC_FIELDS;
    memcpy(r, d->rec + slot * SVC_FIELDS, SVC_FIELDS * sizeof(int64_t));
    r[6] = t_out ? t_out : mono_ns();
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
    if (ld_acq64(&d->decoded) == d->head) /* the oldest shot still waits for the decoder: decode now */
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
            svc_record(s, d, slot, W.st_internal, 0);
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
        svc_record(s, d, slot, W.st_ok, 0);
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
    for (int i = s->defer_first; i < s->n_defer; i++) {
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
    s->n_defer = s->defer_first = 0;
}

/* Pipelined: answer the gets held back whose shots are decoded, in the order they came, up to
 * the first whose shot still waits for the decoding thread. The number answered. (No
 * datagram link is pipelined: no get here is addressed or a request sent again.) */
static int svc_settle_ready(ServiceCore *s) {
    int i = s->defer_first;
    for (; i < s->n_defer; i++) {
        DeferredGet *g = &s->defer[i];
        SvcDecoder *d = &s->dec[g->did];
        if (d->head != d->tail && ld_acq64(&d->decoded) == d->head)
            break;
        svc_get_now(s, d, g->rs, g->consume, g->rid, g->ptp);
    }
    int answered = i - s->defer_first;
    s->defer_first = i;
    if (s->defer_first == s->n_defer)
        s->n_defer = s->defer_first = 0;
    return answered;
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
    if (s->n_defer > s->defer_first || (ld_acq64(&d->decoded) == d->head && d->head != d->tail)) {
        if (s->n_defer >= s->defer_cap && s->defer_first > 0) { /* (pipelined: the answered ones make room) */
            memmove(s->defer, s->defer + s->defer_first, (size_t)(s->n_defer - s->defer_first) * sizeof(DeferredGet));
            s->n_defer -= s->defer_first;
            s->defer_first = 0;
        }
        if (s->n_defer >= s->defer_cap)
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
    if (tl_ingest) { /* (as a single-threaded service: what was queued is decoded, then let go) */
        svc_flush_decoder(s, d);
        pipe_hold(s);
    }
    dec_reset(d);
    if (tl_ingest)
        pipe_go_on(s);
    svc_answer(s, W.st_ok, rid, ptp, NULL, 0);
}

/* One frame. Python exceptions never escape (decoder failures are counted). */
static void svc_handle_one(ServiceCore *s, const uint8_t *f, uint32_t n, int64_t t_in) {
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

/* One message: a frame, or several whole frames back to back (a datagram that carries a shot's
 * last round and its get), each handled as if it came alone. Only a request header right behind
 * a frame splits the message; a frame with anything else behind it is refused (its length). */
static void svc_handle(ServiceCore *s, const uint8_t *f, uint32_t n, int64_t t_in) {
    while (n >= 2 * W.hdr && rd32(f) == W.req_magic) {
        uint64_t k = (uint64_t)W.hdr + rd32(f + 8);
        if (k + W.hdr > n || rd32(f + k) != W.req_magic)
            break;
        svc_handle_one(s, f, (uint32_t)k, t_in);
        f += k;
        n -= (uint32_t)k;
        s->counts[C_FRAMES_PACKED]++; /* (the frame behind it) */
    }
    svc_handle_one(s, f, n, t_in);
}

/* After a frame: whether the shots (and gets) waiting should be decoded (and answered) now.
 * Yes when nothing else waits, or only the get that asks for them (the service is not behind:
 * that get is then answered at once), or enough shots wait; otherwise the service goes on
 * ingesting, and decodes the backlog in one call. */
static inline int svc_decode_now(ServiceCore *s) {
    if (s->pending <= 0 && s->n_defer <= 0)
        return 0;
    const uint8_t *data;
    uint32_t n;
    if (io_peek(&s->io, &data, &n) != QLINK_RING_MSG || s->pending >= s->max_batch)
        return 1;
    return n >= 8 && rd32(data + 4) == W.fn_get && io_queued(&s->io) <= 96;
}

/* What ended a wait for a message (io_peek's rc, no message), as run()'s code: 1 the ring's
 * head needs the Python path, -3 the ring went away, 2 the peer closed; RUN_GO_ON: nothing
 * of those (the link is empty). */
#define RUN_GO_ON 99
static inline int svc_stop_code(int rc) {
    return rc == QLINK_RING_OTHER ? 1 : rc == QLINK_RING_RELEASED ? -3 : rc == IO_CLOSED ? 2 : RUN_GO_ON;
}

/* A frame has come: its time (read only when it ended a wait, `*spins` nonzero: then the service
 * was idle, and ready since t_idle0), 0 when it came while the service was busy. */
static inline int64_t svc_frame_time(ServiceCore *s, unsigned *spins, int64_t t_idle0) {
    int64_t t_in = 0;
    if (*spins) {
        t_in = mono_ns();
        s->t_ready = t_idle0;
    } else {
        s->t_ready = 0;
    }
    *spins = 0;
    return t_in;
}

static const char *svc_pipe_refusal(const ServiceCore *s);
static PyObject *svc_run_piped(ServiceCore *s, long long idle_ns, long long max_frames);

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
    if (s->ingest_cpu >= 0 && svc_pipe_refusal(s) == NULL)
        return svc_run_piped(s, idle_ns, max_frames);
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
            svc_handle(s, data, n, svc_frame_time(s, &spins, t_idle0));
            io_consume(&s->io);
            if ((++busy_frames & 255) == 0) { /* busy a long while: let a thread waiting for the GIL in */
                int64_t now = mono_ns();
                if (now - t_yield > 1000000) {
                    t_yield = now;
                    PyThreadState *y = PyEval_SaveThread();
                    PyEval_RestoreThread(y);
                }
            }
            if (svc_decode_now(s)) {
                svc_settle(s);
                /* the answers of what was just decoded go out now, not when the service next
                 * runs out of input: a service that stays behind (a stream link at the cycle)
                 * would otherwise hold them until its output buffer fills */
                if (s->io.out_n && io_flush(&s->io) < 0) {
                    code = 2;
                    break;
                }
            }
            if (max_frames > 0 && ++frames >= max_frames) {
                code = 3;
                break;
            }
            continue;
        }
        if ((code = svc_stop_code(rc)) != RUN_GO_ON) {
            if (code == 2)
                io_flush(&s->io);
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
    s->n_defer = s->defer_first = 0;
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

static PyObject *svc_get_pipe(ServiceCore *s, void *Py_UNUSED(c)) {
    const char *why = s->ingest_cpu < 0 ? "no ingest_cpu given" : svc_pipe_refusal(s);
    return Py_BuildValue("{s:i,s:K,s:K,s:s}", "ingest_cpu", s->ingest_cpu, "piped_runs",
                         (unsigned long long)s->piped_runs, "ingest_waits", (unsigned long long)s->pipe_waits,
                         "not_piped_because", why ? why : "");
}

static PyGetSetDef svc_getset[] = {
    {"pipe", (getter)svc_get_pipe, NULL,
     "the pipelined runs (an ingest thread on ingest_cpu): how many, the ingest thread's waits for the decoder, "
     "and why a run is not pipelined ('' when it is)", NULL},
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

