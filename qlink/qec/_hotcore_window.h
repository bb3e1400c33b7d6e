/* qlink.qec._hotcore: the service core's sliding windows (a long memory experiment decoded as its rounds land).
 * (part of the one translation unit _hotcore.c, which includes it: not compiled on its own) */

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
    int64_t F = d->frames_per_shot;
    if (dec_take_counter(s, d, counter)) {
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

