
/* disco_estimator simulator kernel; mirrors simulator._schedule_python expression by expression. */
#include <stdint.h>
#include <stdlib.h>

typedef struct { double key; int32_t idx; } item;

static int less(item a, item b) { return a.key < b.key || (a.key == b.key && a.idx < b.idx); }

static void hpush(item *h, int32_t *len, item x) {
    int32_t i = (*len)++;
    while (i > 0) {
        int32_t p = (i - 1) >> 1;
        if (!less(x, h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

static item hpop(item *h, int32_t *len) {
    item top = h[0];
    int32_t m = --(*len);
    if (m == 0) return top;
    item x = h[m];
    int32_t i = 0;
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && less(h[c + 1], h[c])) c++;
        if (!less(h[c], x)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
    return top;
}

static double stretched_finish(double tau, double rho, double t_m, double phi) {
    if (tau >= t_m) return tau + rho;
    double span = phi * (t_m - tau);
    if (rho <= span) return phi > 0.0 ? tau + rho / phi : tau;
    return t_m + (rho - span);
}

static double advance(double tau, double rho, double t_m, double now, double phi) {
    double busy = (t_m < now ? t_m : now) - tau;
    if (busy < 0.0) busy = 0.0;
    double free_ = now - (tau > t_m ? tau : t_m);
    if (free_ < 0.0) free_ = 0.0;
    rho = rho - phi * busy - free_;
    return rho > 0.0 ? rho : 0.0;
}

typedef struct {
    int32_t n;
    const uint8_t *comm;
    const double *d;
    double *start, *finish;
    int32_t *sp, *si, *remaining;
    double *ready;
    item *cq, *mq;
    int32_t ncq, nmq;
    int32_t *ev, *kseq, *corder; /* starts in event order; kernels, comms in finish order */
    int32_t nev, nk, nc;
    int32_t cp;                  /* first comm in corder that may overlap the running kernel */
} state;

static void release(state *S, int32_t k, double f) {
    for (int32_t e = S->sp[k]; e < S->sp[k + 1]; e++) {
        int32_t s = S->si[e];
        if (f > S->ready[s]) S->ready[s] = f;
        if (--S->remaining[s] == 0) {
            item x = {S->ready[s], s};
            if (S->comm[s]) hpush(S->mq, &S->nmq, x); else hpush(S->cq, &S->ncq, x);
        }
    }
}

static double start_comm(state *S, int32_t j, double s_m) {
    double fm = s_m + S->d[j];
    S->start[j] = s_m;
    S->finish[j] = fm;
    S->ev[S->nev++] = j;
    S->corder[S->nc++] = j;
    return fm;
}

static double kernel_overlap(state *S, double s, double f) {
    while (S->cp < S->nc && S->finish[S->corder[S->cp]] <= s) S->cp++;
    double acc = 0.0;
    for (int32_t q = S->cp; q < S->nc && S->start[S->corder[q]] < f; q++) {
        int32_t c = S->corder[q];
        double lo = s > S->start[c] ? s : S->start[c];
        double hi = f < S->finish[c] ? f : S->finish[c];
        if (hi > lo) acc += hi - lo;
    }
    return acc;
}

static void build_successors(state *S, const int32_t *pred_ptr, const int32_t *pred_idx) {
    int32_t n = S->n, *sp = S->sp, *cur = S->remaining;
    for (int32_t v = 0; v <= n; v++) sp[v] = 0;
    for (int32_t e = 0; e < pred_ptr[n]; e++) sp[pred_idx[e] + 1]++;
    for (int32_t v = 0; v < n; v++) sp[v + 1] += sp[v];
    for (int32_t v = 0; v < n; v++) cur[v] = sp[v];
    for (int32_t v = 0; v < n; v++)
        for (int32_t e = pred_ptr[v]; e < pred_ptr[v + 1]; e++) S->si[cur[pred_idx[e]]++] = v;
    for (int32_t v = 0; v < n; v++) {
        S->remaining[v] = pred_ptr[v + 1] - pred_ptr[v];
        S->ready[v] = 0.0;
        if (S->remaining[v] == 0) {
            item x = {0.0, v};
            if (S->comm[v]) S->mq[S->nmq++] = x; else S->cq[S->ncq++] = x; /* sorted: a heap */
        }
    }
}

/* The event loop. Returns the accumulated overlap; S->nev == n iff every node ran. */
static double schedule(state *S, double phi) {
    int slow = phi < 1.0;
    double t_c = 0.0, t_m = 0.0, tau = 0.0, rho = 0.0, overlap = 0.0;
    int32_t run = -1;
    double *start = S->start, *finish = S->finish;
    const double *d = S->d;
    for (;;) {
        if (run >= 0) {
            double f = finish[run];
            if (S->nmq) {
                double r = S->mq[0].key;
                double s_m = t_m > r ? t_m : r;
                if (s_m < f) {
                    int32_t j = hpop(S->mq, &S->nmq).idx;
                    double fm = start_comm(S, j, s_m);
                    if (slow) {
                        rho = advance(tau, rho, t_m, s_m, phi);
                        tau = s_m;
                        finish[run] = stretched_finish(tau, rho, fm, phi);
                    }
                    t_m = fm;
                    release(S, j, fm);
                    continue;
                }
            }
            t_c = f;
            overlap += kernel_overlap(S, start[run], f);
            S->kseq[S->nk++] = run;
            release(S, run, f);
            run = -1;
            continue;
        }
        if (S->ncq) {
            double r = S->cq[0].key;
            double s_c = t_c > r ? t_c : r;
            double s_m = 0.0;
            if (S->nmq) {
                double r2 = S->mq[0].key;
                s_m = t_m > r2 ? t_m : r2;
            }
            if (!S->nmq || s_c <= s_m) {
                int32_t v = hpop(S->cq, &S->ncq).idx;
                start[v] = s_c;
                S->ev[S->nev++] = v;
                if (slow) {
                    tau = s_c;
                    rho = d[v];
                    finish[v] = stretched_finish(tau, rho, t_m, phi);
                } else {
                    finish[v] = s_c + d[v];
                }
                run = v;
                continue;
            }
        } else if (!S->nmq) {
            break;
        }
        item it = hpop(S->mq, &S->nmq);
        double fm = start_comm(S, it.idx, t_m > it.key ? t_m : it.key);
        t_m = fm;
        release(S, it.idx, fm);
    }
    return overlap;
}

/* free_[v] = finish of v's last consumer (lc[v]); no consumer: lc = -1, free_ = makespan. */
static void free_times(state *S, const int32_t *pred_ptr, const int32_t *pred_idx, double *free_,
                       int32_t *lc) {
    int32_t n = S->n;
    double end = 0.0;
    for (int32_t v = 0; v < n; v++) {
        if (S->finish[v] > end) end = S->finish[v];
        free_[v] = -1.0;
        lc[v] = -1;
    }
    for (int32_t v = 0; v < n; v++)
        for (int32_t e = pred_ptr[v]; e < pred_ptr[v + 1]; e++) {
            int32_t p = pred_idx[e];
            if (S->finish[v] > free_[p]) { free_[p] = S->finish[v]; lc[p] = v; }
        }
    for (int32_t v = 0; v < n; v++)
        if (lc[v] < 0) free_[v] = end;
}

/* Peak live bytes by a sweep over allocations in event (= start time) order; consumed
   buffers sorted by free time in O(N) by merging the two finish-ordered sequences. */
static int64_t peak_live(state *S, const double *free_, const int32_t *lc, const int64_t *nbytes,
                         int32_t *rank, int32_t *cnt, int32_t *fl) {
    int32_t n = S->n, i = 0, j = 0, pos = 0, nz = 0;
    while (i < S->nk || j < S->nc) {
        int kernel = j >= S->nc ||
                     (i < S->nk && S->finish[S->kseq[i]] <= S->finish[S->corder[j]]);
        rank[kernel ? S->kseq[i++] : S->corder[j++]] = pos++;
    }
    for (int32_t v = 0; v <= n; v++) cnt[v] = 0;
    for (int32_t v = 0; v < n; v++)
        if (lc[v] >= 0 && free_[v] > S->start[v]) cnt[rank[lc[v]] + 1]++;
    for (int32_t v = 0; v < n; v++) cnt[v + 1] += cnt[v];
    int32_t npos = cnt[n];
    for (int32_t v = 0; v < n; v++)
        if (lc[v] >= 0 && free_[v] > S->start[v]) fl[cnt[rank[lc[v]]]++] = v;
    int32_t *zl = rank; /* rank no longer needed: zero-length lifetimes in start order */
    for (int32_t k = 0; k < S->nev; k++) {
        int32_t a = S->ev[k];
        if (lc[a] >= 0 && !(free_[a] > S->start[a])) zl[nz++] = a;
    }
    int64_t live = 0, peak = 0;
    int32_t pf = 0, pz = 0;
    for (int32_t k = 0; k < S->nev; k++) {
        int32_t a = S->ev[k];
        double t = S->start[a];
        while (pf < npos && free_[fl[pf]] <= t) live -= nbytes[fl[pf++]];
        while (pz < nz && S->start[zl[pz]] < t) live -= nbytes[zl[pz++]];
        live += nbytes[a];
        if (live > peak) peak = live;
    }
    return peak;
}

/* Returns 0 on success, 1 if out of memory, 2 if some node never became ready. */
int disco_sim_run(int32_t n, const uint8_t *comm, const double *d, const int32_t *pred_ptr,
                  const int32_t *pred_idx, const int64_t *nbytes, double phi, double *start,
                  double *finish, double *free_, double *overlap, int64_t *peak) {
    size_t m = (size_t)(n > 0 ? n : 1), ne = (size_t)(pred_ptr[n] > 0 ? pred_ptr[n] : 1);
    state S = {0};
    S.n = n; S.comm = comm; S.d = d; S.start = start; S.finish = finish;
    S.sp = malloc(sizeof(int32_t) * (m + 1));
    S.si = malloc(sizeof(int32_t) * ne);
    S.remaining = malloc(sizeof(int32_t) * m);
    S.ready = malloc(sizeof(double) * m);
    S.cq = malloc(sizeof(item) * m);
    S.mq = malloc(sizeof(item) * m);
    S.ev = malloc(sizeof(int32_t) * m);
    S.kseq = malloc(sizeof(int32_t) * m);
    S.corder = malloc(sizeof(int32_t) * m);
    int rc = 0;
    if (!S.sp || !S.si || !S.remaining || !S.ready || !S.cq || !S.mq || !S.ev || !S.kseq ||
        !S.corder) { rc = 1; goto out; }
    build_successors(&S, pred_ptr, pred_idx);
    *overlap = schedule(&S, phi);
    if (S.nev != n) { rc = 2; goto out; }
    /* reuse the loop's work arrays: lc <- remaining, rank <- si or sp, cnt <- sp, fl <- cq */
    int32_t *lc = S.remaining, *cnt = S.sp, *fl = (int32_t *)S.cq, *rank = (int32_t *)S.mq;
    free_times(&S, pred_ptr, pred_idx, free_, lc);
    *peak = peak_live(&S, free_, lc, nbytes, rank, cnt, fl);
out:
    free(S.sp); free(S.si); free(S.remaining); free(S.ready); free(S.cq); free(S.mq);
    free(S.ev); free(S.kseq); free(S.corder);
    return rc;
}
