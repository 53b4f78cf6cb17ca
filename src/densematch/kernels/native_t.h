/* native.c's kernels for one floating type, CPython stringlib's way: plain C that a debugger and
 * git blame see line by line, included by native.c once per type with T (float, double), I (the
 * integer of T's width), SUF (f32, f64: DM_T(name) is name_SUF), ABS, SQRT, FREXP, LDEXP and FLOOR
 * (T's functions) defined; it undefines them at its end. No include guard: each inclusion is one
 * instance. */
#include "dm_template.h"

/* Lanes of 32 bytes (one AVX2 register, two SSE or NEON ones) as GCC / Clang vector extensions,
 * for the loops the compiler's own vectoriser leaves scalar or keeps in memory. */
typedef T DM_T(vec) __attribute__((vector_size(32)));
typedef I DM_T(mask) __attribute__((vector_size(32)));
static inline DM_T(vec) DM_T(load)(const T *p) {
    DM_T(vec) v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void DM_T(store)(T *p, DM_T(vec) v) { memcpy(p, &v, sizeof v); }
static inline DM_T(vec) DM_T(pick)(DM_T(mask) m, DM_T(vec) a, DM_T(vec) b) {
    return (DM_T(vec))(((DM_T(mask))a & m) | ((DM_T(mask))b & ~m));
}
/* the sign bit cleared, as fabs does (one AND) */
static inline DM_T(vec) DM_T(vabs)(DM_T(vec) v) {
    const I body = (I)(~0ULL >> (65 - 8 * sizeof(T)));
    return (DM_T(vec))((DM_T(mask))v & body);
}

/* acc[i][j] over d for rows y0..y0+FB-1 and the PB columns at x (row stride ldx): PB is two
 * vectors, so the FB x 2 accumulators stay in registers (GCC kept the scalar form's in
 * memory, a load and a store per step) */
static inline __attribute__((always_inline)) void DM_T(block)(
    const T *y, int64_t ldy, int nf, const T *x, int64_t ldx, int64_t D, int linf, T acc[FB][PB]) {
    enum { HALF = PB / 2 };
    const T *yr[FB];
    for (int i = 0; i < FB; i++) yr[i] = y + (i < nf ? i : nf - 1) * ldy;
    DM_T(vec) v[FB][2];
    for (int i = 0; i < FB; i++) v[i][0] = v[i][1] = (DM_T(vec)){};
    if (linf) {
        for (int64_t d = 0; d < D; d++) {
            const DM_T(vec) x0 = DM_T(load)(x + d * ldx), x1 = DM_T(load)(x + d * ldx + HALF);
            for (int i = 0; i < FB; i++) {
                const DM_T(vec) a0 = DM_T(vabs)(x0 - yr[i][d]), a1 = DM_T(vabs)(x1 - yr[i][d]);
                v[i][0] = DM_T(pick)((a0 > v[i][0]) | (a0 != a0), a0, v[i][0]);
                v[i][1] = DM_T(pick)((a1 > v[i][1]) | (a1 != a1), a1, v[i][1]);
            }
        }
    } else {
        for (int64_t d = 0; d < D; d++) {
            const DM_T(vec) x0 = DM_T(load)(x + d * ldx), x1 = DM_T(load)(x + d * ldx + HALF);
            for (int i = 0; i < FB; i++) {
                v[i][0] += DM_T(vabs)(x0 - yr[i][d]);
                v[i][1] += DM_T(vabs)(x1 - yr[i][d]);
            }
        }
    }
    for (int i = 0; i < FB; i++) {
        DM_T(store)(acc[i], v[i][0]);
        DM_T(store)(acc[i] + HALF, v[i][1]);
    }
}

/* out[f * osf + p * osp] = scale * (sum or max over d of |x[d * ldx + p] - y[f * ldy + d]|).
 * Returns 0, or -1 when scratch memory ran out. */
int DM_T(dm_minkowski)(const T *y, int64_t ldy, const T *x, int64_t ldx, T *out, int64_t osf, int64_t osp,
                       int64_t F, int64_t D, int64_t P, int linf, double scale) {
    T acc[FB][PB];
    T *pad = NULL;
    for (int64_t p0 = 0; p0 < P; p0 += PB) {
        const int pn = P - p0 < PB ? (int)(P - p0) : PB;
        const T *xb = x + p0;
        int64_t ld = ldx;
        if (pn < PB) { /* the last columns, copied into a zero-padded block */
            pad = calloc((size_t)D * PB, sizeof(T));
            if (pad == NULL) return -1;
            for (int64_t d = 0; d < D; d++) memcpy(pad + d * PB, x + d * ldx + p0, pn * sizeof(T));
            xb = pad;
            ld = PB;
        }
        for (int64_t f0 = 0; f0 < F; f0 += FB) {
            const int nf = F - f0 < FB ? (int)(F - f0) : FB;
            DM_T(block)(y + f0 * ldy, ldy, nf, xb, ld, D, linf, acc);
            for (int i = 0; i < nf; i++) {
                T *o = out + (f0 + i) * osf + p0 * osp;
                for (int j = 0; j < pn; j++) o[j * osp] = (T)scale * acc[i][j];
            }
        }
    }
    free(pad);
    return 0;
}

/* g with the sign of diff (0 where diff is 0 or NaN); for linf only where |diff| reaches
 * the distance dv */
static inline __attribute__((always_inline)) T DM_T(weight)(T diff, T gv, T dv, int linf) {
    const T s = diff > 0 ? gv : (diff < 0 ? -gv : 0);
    return linf ? (ABS(diff) == dv ? s : 0) : s;
}
static inline __attribute__((always_inline)) DM_T(vec) DM_T(weights)(
    DM_T(vec) diff, DM_T(vec) gv, DM_T(vec) dv, int linf) {
    const DM_T(mask) sign = (DM_T(mask))diff ^ (DM_T(mask))DM_T(vabs)(diff);
    DM_T(mask) keep = (diff > 0) | (diff < 0);
    if (linf) keep &= DM_T(vabs)(diff) == dv;
    return (DM_T(vec))(((DM_T(mask))gv ^ sign) & keep);
}

/* The gradients of sum_{f,p} g[f, p] * dist(f, p), with dist from the forward:
 *   gx[d * ldgx + p] = sum_f g[f, p] * w(f, d, p)   (written)
 *   gy[f * ldgy + d] -= sum_p g[f, p] * w(f, d, p)  (accumulated)
 * where w = sign(x - y) for l1, and for linf sign(x - y) where |x - y| equals the distance
 * (every such d, as torch.cdist's gradient does), else 0. g and dist: (F, P), row stride ldg.
 * Sums run in one order: gx over f, gy over p in lanes of PB then the lanes in order.
 */
void DM_T(dm_minkowski_grad)(const T *y, int64_t ldy, const T *x, int64_t ldx, const T *g,
                             const T *dist, int64_t ldg, T *gx, int64_t ldgx, T *gy, int64_t ldgy,
                             int64_t F, int64_t D, int64_t P, int linf) {
    enum { HALF = PB / 2 };
    const int64_t full = P - P % PB;
    const DM_T(vec) zero = {};
    for (int64_t d = 0; d < D; d++) {
        const T *xr = x + d * ldx;
        T *gxr = gx + d * ldgx;
        for (int64_t p = 0; p < P; p++) gxr[p] = 0;
        for (int64_t f0 = 0; f0 < F; f0 += FB) {
            const int nf = F - f0 < FB ? (int)(F - f0) : FB;
            DM_T(vec) part[FB][2];
            T yv[FB];
            const T *gr[FB], *dr[FB];
            for (int i = 0; i < FB; i++) {
                const int64_t f = f0 + (i < nf ? i : nf - 1);
                yv[i] = y[f * ldy + d];
                gr[i] = g + f * ldg;
                dr[i] = dist + f * ldg;
                part[i][0] = part[i][1] = zero;
            }
            for (int64_t p0 = 0; p0 < full; p0 += PB) {
                const DM_T(vec) x0 = DM_T(load)(xr + p0), x1 = DM_T(load)(xr + p0 + HALF);
                DM_T(vec) acc0 = DM_T(load)(gxr + p0), acc1 = DM_T(load)(gxr + p0 + HALF);
                _Pragma("GCC unroll 4") for (int i = 0; i < FB; i++) {
                    if (i >= nf) break;
                    const T *gi = gr[i] + p0, *di = dr[i] + p0;
                    const DM_T(vec) s0 = DM_T(weights)(x0 - yv[i], DM_T(load)(gi),
                                                       linf ? DM_T(load)(di) : zero, linf);
                    const DM_T(vec) s1 = DM_T(weights)(x1 - yv[i], DM_T(load)(gi + HALF),
                                                       linf ? DM_T(load)(di + HALF) : zero, linf);
                    part[i][0] += s0;
                    part[i][1] += s1;
                    acc0 += s0;
                    acc1 += s1;
                }
                DM_T(store)(gxr + p0, acc0);
                DM_T(store)(gxr + p0 + HALF, acc1);
            }
            for (int i = 0; i < nf; i++) {
                T sum = 0;
                for (int h = 0; h < 2; h++)
                    for (int j = 0; j < HALF; j++) sum += part[i][h][j];
                for (int64_t p = full; p < P; p++) {
                    const T s = DM_T(weight)(xr[p] - yv[i], gr[i][p], linf ? dr[i][p] : 0, linf);
                    gxr[p] += s;
                    sum += s;
                }
                gy[(f0 + i) * ldgy + d] -= sum;
            }
        }
    }
}

/* l2 after its matrix product: t[f, p] (row stride ldt) holds p_f.x_p, rows[f] ||p_f||^2 and
 * cols[p] ||x_p||^2. Writes v = max(rows - 2 t + cols, 0), or its square root (root), to
 * out[f * osf + p * osp], and each column's smallest v (before clamping) to colmin[p], for the
 * caller to recompute the columns whose expansion lost too many digits. One pass instead of five.
 */
static inline __attribute__((always_inline)) void DM_T(finish_row)(
    const T *tr, T rv, const T *cols, T *o, int64_t osp, int64_t P, int root, T *colmin) {
    for (int64_t p = 0; p < P; p++) {
        const T v = (rv - 2 * tr[p]) + cols[p];
        colmin[p] = colmin[p] < v ? colmin[p] : v;
        const T c = v < 0 ? 0 : v; /* NaN stays */
        o[p * osp] = root ? SQRT(c) : c;
    }
}

/* out[p] = sum over d of x[d * ldx + p]^2, in that order */
void DM_T(dm_sqnorms)(const T *x, int64_t ldx, T *out, int64_t D, int64_t P) {
    for (int64_t p = 0; p < P; p++) out[p] = 0;
    for (int64_t d = 0; d < D; d++) {
        const T *xr = x + d * ldx;
        for (int64_t p = 0; p < P; p++) out[p] += xr[p] * xr[p];
    }
}

void DM_T(dm_l2_finish)(const T *t, int64_t ldt, const T *rows, const T *cols, T *out, int64_t osf,
                        int64_t osp, int64_t F, int64_t P, int root, T *colmin) {
    for (int64_t p = 0; p < P; p++) colmin[p] = INFINITY;
    for (int64_t f = 0; f < F; f++) {
        /* constant arguments let each call be specialised and vectorised */
        if (osp == 1 && root)
            DM_T(finish_row)(t + f * ldt, rows[f], cols, out + f * osf, 1, P, 1, colmin);
        else if (osp == 1)
            DM_T(finish_row)(t + f * ldt, rows[f], cols, out + f * osf, 1, P, 0, colmin);
        else
            DM_T(finish_row)(t + f * ldt, rows[f], cols, out + f * osf, osp, P, root, colmin);
    }
}

/* The backward's pair weights: w = g / dist, 0 where dist is 0 (root), or w = g (squared),
 * into w (F x P, contiguous), with their sums per column (colsum) and per row (rowsum). g and
 * dist may have any strides (an expanded gradient has stride 0). */
static inline __attribute__((always_inline)) T DM_T(weights_row)(
    const T *gr, int64_t gsp, const T *dr, int64_t dsp, T *wr, T *colsum, int64_t P, int root) {
    T part[16] = {0};
    int64_t p = 0;
    for (; p + 16 <= P; p += 16)
        for (int j = 0; j < 16; j++) {
            const T gv = gr[(p + j) * gsp], dv = dr[(p + j) * dsp];
            /* the division always runs (on 1 where dist is 0), so that it vectorises */
            const T v = root ? (dv == 0 ? 0 : gv / (dv == 0 ? 1 : dv)) : gv;
            wr[p + j] = v;
            colsum[p + j] += v;
            part[j] += v;
        }
    T sum = 0;
    for (int j = 0; j < 16; j++) sum += part[j];
    for (; p < P; p++) {
        const T gv = gr[p * gsp], dv = dr[p * dsp];
        const T v = root ? (dv == 0 ? 0 : gv / dv) : gv;
        wr[p] = v;
        colsum[p] += v;
        sum += v;
    }
    return sum;
}

void DM_T(dm_l2_weights)(const T *g, int64_t gsf, int64_t gsp, const T *dist, int64_t dsf, int64_t dsp,
                         T *w, T *colsum, T *rowsum, int64_t F, int64_t P, int root) {
    for (int64_t p = 0; p < P; p++) colsum[p] = 0;
    for (int64_t f = 0; f < F; f++) {
        const T *gr = g + f * gsf, *dr = dist + f * dsf;
        T *wr = w + f * P;
        /* constant arguments specialise the common cases: contiguous gradients, and the
         * expanded one of a sum (stride 0) */
        if (gsp == 1 && dsp == 1 && root)
            rowsum[f] = DM_T(weights_row)(gr, 1, dr, 1, wr, colsum, P, 1);
        else if (gsp == 0 && dsp == 1 && root)
            rowsum[f] = DM_T(weights_row)(gr, 0, dr, 1, wr, colsum, P, 1);
        else if (gsp == 1 && dsp == 1)
            rowsum[f] = DM_T(weights_row)(gr, 1, dr, 1, wr, colsum, P, 0);
        else if (gsp == 0 && dsp == 1)
            rowsum[f] = DM_T(weights_row)(gr, 0, dr, 1, wr, colsum, P, 0);
        else
            rowsum[f] = DM_T(weights_row)(gr, gsp, dr, dsp, wr, colsum, P, root);
    }
}

/* One score tile merged into the running top-k of its rows, for the engine's search on a CPU.
 *
 * s: (m, n) scores, higher is better, row stride lds, columns offset + 0 .. n-1. best_v / best_i:
 * (m, k) contiguous, each row's best first; empty slots hold -inf and -1. Equal scores go to the
 * lower column, whatever order the tiles come in. A chunk of four vectors of scores (32 floats, 16
 * doubles) is tested with vector compares and looked at one by one only when one of them reaches
 * the row's k-th best, which after the first tiles is rare.
 *
 * With a margin (m,), the certified search's candidates are listed too: every column whose score
 * reaches the row's running floor, its k-th best minus the margin, goes to the row's cap slots
 * (cand_cols / cand_vals, (m, cap), counts (m,)) with its score plus the margin: scores that are
 * lower bounds (a tile's scores less its own slack) list upper bounds, and a call's margin holds
 * for its own tile only. A full row is pruned against its k-th best; a row still full is marked
 * over (over[r] = 1) and lists no more (the caller lists it again). The k-th best only rises, so
 * every pair whose listed value reaches the final k-th best is listed, unless its row is over.
 */
enum { DM_T(CHUNK) = (int)(2 * STEP(T)) }; /* values per chunk: four vectors */
static inline int DM_T(better)(T v, int64_t i, T w, int64_t j) { return v > w || (v == w && i < j); }
/* list the pair (idx, v) in a row's candidate slots (cap of them, *count used): a full list
 * keeps only what still reaches floor, and a row whose every slot still does is marked over.
 * Returns whether the row goes on listing. */
static inline int DM_T(list)(int64_t *cc, T *cv, int *count, int64_t cap, unsigned char *over, T floor,
                             int64_t idx, T v) {
    if (*count == cap) {
        int kept = 0;
        for (int t = 0; t < cap; t++)
            if (cv[t] >= floor) {
                cc[kept] = cc[t];
                cv[kept] = cv[t];
                kept++;
            }
        *count = kept;
        if (kept == cap) {
            *over = 1;
            return 0;
        }
    }
    cc[*count] = idx;
    cv[*count] = v;
    (*count)++;
    return 1;
}
/* (v, idx) into a row's running top-k (bv, bi; best first) if it beats the k-th; whether it did */
static inline int DM_T(insert)(T *bv, int64_t *bi, int64_t k, T v, int64_t idx) {
    if (!DM_T(better)(v, idx, bv[k - 1], bi[k - 1])) return 0;
    int64_t t = k - 1;
    while (t > 0 && DM_T(better)(v, idx, bv[t - 1], bi[t - 1])) {
        bv[t] = bv[t - 1];
        bi[t] = bi[t - 1];
        t--;
    }
    bv[t] = v;
    bi[t] = idx;
    return 1;
}
/* whether any of the chunk's values at p is >= floor (NaN never is) */
static inline int DM_T(reaches)(const T *p, T floor) {
    const DM_T(vec) f = (DM_T(vec)){} + floor;
    const int q = DM_T(CHUNK) / 4;
    const DM_T(mask) hit = (DM_T(load)(p) >= f) | (DM_T(load)(p + q) >= f) |
                           (DM_T(load)(p + 2 * q) >= f) | (DM_T(load)(p + 3 * q) >= f);
    const lanes64 w = (lanes64)hit;
    return (w[0] | w[1] | w[2] | w[3]) != 0;
}

void DM_T(dm_merge)(const T *s, int64_t lds, int64_t m, int64_t n, int64_t offset, T *best_v, int64_t *best_i,
                    int64_t k, const T *margin, int64_t cap, int64_t *cand_cols, T *cand_vals,
                    int *counts, unsigned char *over) {
    for (int64_t r = 0; r < m; r++) {
        const T *row = s + r * lds;
        T *bv = best_v + r * k;
        int64_t *bi = best_i + r * k;
        const T slack = margin ? margin[r] : 0;
        T floor = bv[k - 1] - slack;
        int listing = margin != NULL && !over[r];
        int64_t *cc = listing ? cand_cols + r * cap : NULL;
        T *cv = listing ? cand_vals + r * cap : NULL;
        for (int64_t c = 0; c < n; c += DM_T(CHUNK)) {
            const int64_t end = c + DM_T(CHUNK) < n ? c + DM_T(CHUNK) : n;
            if (end - c == DM_T(CHUNK) && !DM_T(reaches)(row + c, floor)) continue;
            for (int64_t q = c; q < end; q++) {
                const T v = row[q];
                if (!(v >= floor)) continue;
                const int64_t idx = offset + q;
                if (listing)
                    listing = DM_T(list)(cc, cv, &counts[r], cap, &over[r], bv[k - 1], idx, v + slack);
                if (DM_T(insert)(bv, bi, k, v, idx)) floor = bv[k - 1] - slack;
            }
        }
    }
}

/* Scored pairs (rows[t], cols[t], score[t]), t < count, in any order, merged into the running
 * top-k of their rows (best_v / best_i (m, k) contiguous, as dm_merge keeps them): equal scores go
 * to the lower column, NaN never enters. The certified searches' candidates, once re-scored. */
void DM_T(dm_merge_pairs)(const int64_t *rows, const int64_t *cols, const T *score, int64_t count,
                          T *best_v, int64_t *best_i, int64_t k) {
    for (int64_t t = 0; t < count; t++)
        (void)DM_T(insert)(best_v + rows[t] * k, best_i + rows[t] * k, k, score[t], cols[t]);
}

/* The listed pairs (dm_merge's slots: cols / vals (m, cap), counts, over) whose value reaches
 * their row's floor, rows over left out, in row then slot order, into rows / cols_out (room for
 * every listed pair); returns how many. */
int64_t DM_T(dm_list_reaching)(const int64_t *cols, const T *vals, const int *counts,
                               const unsigned char *over, int64_t m, int64_t cap, const T *floor,
                               int64_t *rows, int64_t *cols_out) {
    int64_t n = 0;
    for (int64_t r = 0; r < m; r++) {
        if (over[r]) continue;
        for (int64_t t = 0; t < counts[r]; t++)
            if (vals[r * cap + t] >= floor[r]) {
                rows[n] = r;
                cols_out[n++] = cols[r * cap + t];
            }
    }
    return n;
}

/* the sum over c of EXPR (VEXPR on vectors) of x = a[c], y = b[c] */
#define PAIR_SUM(NAME, VEXPR, EXPR)                                                                \
    static inline T NAME(const T *a, const T *b, int64_t C) {                                      \
        const int64_t full = C - C % STEP(T), half = STEP(T) / 2;                                  \
        DM_T(vec) acc[2] = {{0}, {0}};                                                             \
        for (int64_t c = 0; c < full; c += STEP(T))                                                \
            for (int h = 0; h < 2; h++) {                                                          \
                const DM_T(vec) x = DM_T(load)(a + c + h * half), y = DM_T(load)(b + c + h * half); \
                acc[h] += VEXPR;                                                                   \
            }                                                                                      \
        T sum = DM_T(lanes)(acc);                                                                  \
        for (int64_t c = full; c < C; c++) {                                                       \
            const T x = a[c], y = b[c];                                                            \
            sum += EXPR;                                                                           \
        }                                                                                          \
        return sum;                                                                                \
    }

/* the largest of the non-negative EXPR, NaN if any is NaN: the vectors' maximum drops NaNs, so a
 * sum of the same values (NaN exactly when one is) says whether there was one */
#define PAIR_MAX(NAME, VEXPR, EXPR)                                                                \
    static inline T NAME(const T *a, const T *b, int64_t C) {                                      \
        const int64_t full = C - C % STEP(T), half = STEP(T) / 2;                                  \
        DM_T(vec) top[2] = {{0}, {0}}, all[2] = {{0}, {0}};                                        \
        for (int64_t c = 0; c < full; c += STEP(T))                                                \
            for (int h = 0; h < 2; h++) {                                                          \
                const DM_T(vec) x = DM_T(load)(a + c + h * half), y = DM_T(load)(b + c + h * half); \
                const DM_T(vec) v = VEXPR;                                                         \
                (void)x;                                                                           \
                top[h] = DM_T(pick)(top[h] > v, top[h], v);                                        \
                all[h] += v;                                                                       \
            }                                                                                      \
        T most = 0, sum = DM_T(lanes)(all);                                                        \
        for (int h = 0; h < 2; h++)                                                                \
            for (unsigned j = 0; j < 32 / sizeof(T); j++) most = most > top[h][j] ? most : top[h][j]; \
        for (int64_t c = full; c < C; c++) {                                                       \
            const T x = a[c], y = b[c], v = EXPR;                                                  \
            (void)x;                                                                               \
            most = most > v ? most : v;                                                            \
            sum += v;                                                                              \
        }                                                                                          \
        return sum != sum ? sum : most;                                                            \
    }

/* Values of row pairs for the engine's last step and its re-scoring: out[i * k + j] for the
 * query row q[qidx[i]] (q[i] when qidx is NULL) and the reference row r[idx[i * k + j]]
 * (r[i * k + j] when idx is NULL), rows of C values with row strides ldq / ldr:
 *   kind 0: the dot product; 1: the sum of squared differences; 2: the sum of absolute
 *   differences; 3: the largest absolute difference; 4: cosine: each row scaled by 2^-e, e its
 *   largest magnitude's exponent (exact; no square can overflow or underflow), then dot over
 *   the norms (0 for a zero row).
 * For cosine, rterms (3 per row of r, dm_cosine_terms) spare each pair the reference's scale and
 * norm (NULL: computed per pair), for the same values.
 * A NaN anywhere in a pair gives NaN. Every pair is reduced in one order (two vectors of lanes
 * over c, then the two added and their lanes halved by pairs, then the tail), so equal rows give
 * equal values wherever they are, on any CPU.
 *
 * The lanes are the vectors at the top of this file: the compiler's own vectoriser leaves the
 * max-and-sum loops scalar.
 */
static inline T DM_T(lanes)(const DM_T(vec) acc[2]) {
    /* the two vectors, then the lanes halved by pairs: a fixed order, four dependent additions
     * deep rather than sixteen in a row (which had cost a pair at C=64 as much as its loads) */
    DM_T(vec) v = acc[0] + acc[1];
    for (unsigned width = 16 / sizeof(T); width > 0; width /= 2)
        for (unsigned j = 0; j < width; j++) v[j] += v[j + width];
    return v[0];
}

PAIR_SUM(DM_T(dot), x * y, x * y)
PAIR_SUM(DM_T(sqdiff), (x - y) * (x - y), (x - y) * (x - y))
PAIR_SUM(DM_T(absdiff), DM_T(vabs)(x - y), ABS(x - y))
PAIR_MAX(DM_T(maxabs), DM_T(vabs)(x - y), ABS(x - y))
PAIR_MAX(DM_T(peak), DM_T(vabs)(y), ABS(y)) /* of b alone: called with a = b */

/* 2^-e, e the exponent of peak (> 0, finite), as two factors each in range even for a
 * subnormal peak: scaling by it is exact and brings the row's largest magnitude to [0.5, 1) */
static inline void DM_T(unit_scale)(T peak, T s[2]) {
    int e;
    (void)FREXP(peak, &e);
    s[0] = LDEXP((T)1, -e / 2);
    s[1] = LDEXP((T)1, -e - (-e / 2));
}

/* the norm of a * sa */
static inline T DM_T(scaled_norm)(const T *a, const T sa[2], int64_t C) {
    const int64_t full = C - C % STEP(T), half = STEP(T) / 2;
    DM_T(vec) squares[2] = {{0}, {0}};
    for (int64_t c = 0; c < full; c += STEP(T))
        for (int h = 0; h < 2; h++) {
            const DM_T(vec) x = DM_T(load)(a + c + h * half) * sa[0] * sa[1];
            squares[h] += x * x;
        }
    T norm = DM_T(lanes)(squares);
    for (int64_t c = full; c < C; c++) {
        const T x = a[c] * sa[0] * sa[1];
        norm += x * x;
    }
    return SQRT(norm);
}

/* a row's cosine terms (t[0], t[1], t[2]): its scale (unit_scale) and its norm after it;
 * 0, 0, 0 for a zero row, 0, 0, NaN for a row holding a NaN
 * (dm_cosine_terms keeps them for a whole matrix)
 */
static inline void DM_T(row_terms)(const T *a, int64_t C, T t[3]) {
    const T peak = DM_T(peak)(a, a, C);
    t[0] = t[1] = 0;
    t[2] = peak == peak ? 0 : peak;
    if (peak == peak && peak != 0) {
        DM_T(unit_scale)(peak, t);
        t[2] = DM_T(scaled_norm)(a, t, C);
    }
}
/* cos(a, b), a scaled by sa with norm anorm after it (sa 0 and anorm 1 for a zero row), b's
 * terms tb
 */
static inline T DM_T(cosine)(const T *a, const T sa[2], T anorm, const T *b, const T tb[3], int64_t C) {
    if (tb[2] != tb[2]) return tb[2];
    if (tb[2] == 0) return 0;
    const int64_t full = C - C % STEP(T), half = STEP(T) / 2;
    DM_T(vec) dots[2] = {{0}, {0}};
    for (int64_t c = 0; c < full; c += STEP(T))
        for (int h = 0; h < 2; h++) {
            const DM_T(vec) x = DM_T(load)(a + c + h * half) * sa[0] * sa[1];
            const DM_T(vec) y = DM_T(load)(b + c + h * half) * tb[0] * tb[1];
            dots[h] += x * y;
        }
    T dot = DM_T(lanes)(dots);
    for (int64_t c = full; c < C; c++) dot += (a[c] * sa[0] * sa[1]) * (b[c] * tb[0] * tb[1]);
    return dot / (anorm * tb[2]);
}
void DM_T(dm_cosine_terms)(const T *x, int64_t ldx, int64_t m, int64_t C, T *out) {
    for (int64_t i = 0; i < m; i++) DM_T(row_terms)(x + i * ldx, C, out + 3 * i);
}
/* The reference row of the pair DM_AHEAD further on is asked for before this pair is reduced:
 * scattered pairs (the candidates re-scored) each waited a cache miss's whole latency, 65-80 ns
 * a pair at C=64 on a Zen 4 EPYC, 23-30 ns with it (the query rows repeat from pair to pair) */
#ifndef DM_AHEAD
#define DM_AHEAD 8
#endif
/* the first cache lines of a row of C values (at most 16: the hardware streams the rest) */
static inline void DM_T(fetch)(const T *b, int64_t C) {
    const int64_t n = C * (int64_t)sizeof(T), most = n < 1024 ? n : 1024;
    for (int64_t o = 0; o < most; o += 64) __builtin_prefetch((const char *)b + o);
}
void DM_T(dm_pair_values)(const T *q, int64_t ldq, const int64_t *qidx, const T *r, int64_t ldr,
                          const int64_t *idx, int64_t m, int64_t k, int64_t C, int kind,
                          const T *rterms, T *out) {
    T (*const pair)(const T *, const T *, int64_t) = kind == 0   ? DM_T(dot)
                                                  : kind == 1 ? DM_T(sqdiff)
                                                  : kind == 2 ? DM_T(absdiff)
                                                              : DM_T(maxabs);
    const T *last = NULL; /* cosine: the query row whose terms are known */
    T ta[3] = {0, 0, 0}, tb[3], anorm = 1;
    for (int64_t i = 0; i < m; i++) {
        const int64_t row = qidx ? qidx[i] : i;
        const T *a = q + row * ldq;
        if (kind == 4 && a != last) {
            last = a;
            DM_T(row_terms)(a, C, ta);
            anorm = ta[2] == 0 ? 1 : ta[2];
        }
        for (int64_t j = 0; j < k; j++) {
            const int64_t t = i * k + j, at = idx ? idx[t] : t;
            const T *b = r + at * ldr;
            if (t + DM_AHEAD < m * k) DM_T(fetch)(r + (idx ? idx[t + DM_AHEAD] : t + DM_AHEAD) * ldr, C);
            if (kind != 4) {
                out[t] = pair(a, b, C);
            } else if (ta[2] != ta[2]) {
                out[t] = ta[2];
            } else {
                if (rterms)
                    for (int u = 0; u < 3; u++) tb[u] = rterms[3 * at + u];
                else
                    DM_T(row_terms)(b, C, tb);
                out[t] = DM_T(cosine)(a, ta, anorm, b, tb, C);
            }
        }
    }
}

/* Local windows (densematch.local_match, local_cost_volume): the values of rows y0..y1 of a
 * against b at m offsets (oy[j], ox[j]), a and b (H, W, C) with a pixel stride of C, out
 * (m, y1 - y0, W), NaN where an offset leaves the grid. Each value is one pair of the kernels
 * above (kind as in dm_pair_values, cosine aside: its rows come unit already), reduced in their
 * one order, so a window's value equals the engine's value of the same pair. */
#define LOCAL_ROW(FN)                                                                              \
    for (int64_t x = xs; x < xe; x++) o[x] = FN(pa + x * C, pb + x * C, C)

/* o[xs..xe) from row pa of a and row pb of b (pixel stride C), b's row moved dx columns */
static inline void DM_T(local_row)(const T *pa, const T *pb, int64_t C, int64_t xs, int64_t xe,
                                   int kind, T *o) {
    switch (kind) {
    case 0: LOCAL_ROW(DM_T(dot)); break;
    case 1: LOCAL_ROW(DM_T(sqdiff)); break;
    case 2: LOCAL_ROW(DM_T(absdiff)); break;
    default: LOCAL_ROW(DM_T(maxabs)); break;
    }
}

/* row y of a (pa, pixel stride C) at the m offsets, offset j into o + j * stride, NaN where
 * the window leaves b; b's row yy is read at b + (yy % ring) W C (ring = H: b itself; fewer:
 * a ring of its rows) */
static inline void DM_T(local_offsets)(const T *pa, const T *b, int64_t ring, int64_t y,
                                       int64_t H, int64_t W, int64_t C, const int64_t *oy,
                                       const int64_t *ox, int64_t m, int kind, T *o,
                                       int64_t stride) {
    for (int64_t j = 0; j < m; j++, o += stride) {
        const int64_t yy = y + oy[j], dx = ox[j];
        const int64_t xs = yy < 0 || yy >= H ? W : (dx < 0 ? -dx : 0);
        const int64_t xe = yy < 0 || yy >= H ? W : (dx > 0 ? W - dx : W);
        for (int64_t x = 0; x < xs; x++) o[x] = (T)NAN;
        for (int64_t x = xe > xs ? xe : xs; x < W; x++) o[x] = (T)NAN;
        if (xs < xe) DM_T(local_row)(pa, b + ((yy % ring) * W + dx) * C, C, xs, xe, kind, o);
    }
}

void DM_T(dm_local_values)(const T *a, const T *b, int64_t H, int64_t W, int64_t C,
                           const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0,
                           int64_t y1, int kind, T *out) {
    const int64_t stride = (y1 - y0) * W;
    for (int64_t y = y0; y < y1; y++)
        DM_T(local_offsets)(a + y * W * C, b, H, y, H, W, C, oy, ox, m, kind,
                            out + (y - y0) * W, stride);
}

/* row y of channels-first (C, H, W) src, channels last into dst (W, C), in blocks of 8
 * channels so that each write fills a run of a pixel's values */
static void DM_T(local_row_last)(const T *src, int64_t y, int64_t H, int64_t W, int64_t C,
                                 T *dst) {
    for (int64_t c0 = 0; c0 < C; c0 += 8) {
        const int64_t c1 = c0 + 8 < C ? c0 + 8 : C;
        for (int64_t x = 0; x < W; x++)
            for (int64_t c = c0; c < c1; c++) dst[x * C + c] = src[(c * H + y) * W + x];
    }
}

/* dm_local_values for channels-first a and b, (C, H, W), read in place: each row of a and
 * each row of b the offsets reach is turned channels last once, into a ring of the rows one
 * row of a reaches, and valued by the same per-pixel kernels (the same bits). Returns 0, or
 * 1 where the ring could not be allocated. */
int DM_T(dm_local_planar)(const T *a, const T *b, int64_t H, int64_t W, int64_t C,
                          const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0,
                          int64_t y1, int kind, T *out) {
    const int64_t rows = y1 - y0;
    int64_t lo = 0, hi = 0;
    for (int64_t j = 0; j < m; j++) {
        lo = j == 0 || oy[j] < lo ? oy[j] : lo;
        hi = j == 0 || oy[j] > hi ? oy[j] : hi;
    }
    const int64_t ring = hi - lo + 1;
    T *arow = malloc((size_t)((ring + 1) * W * C) * sizeof(T)), *brows = arow + W * C;
    if (!arow) return 1;
    int64_t next = 0; /* the first row of b not yet in the ring */
    for (int64_t y = y0; y < y1; y++) {
        DM_T(local_row_last)(a, y, H, W, C, arow);
        const int64_t first = y + lo > 0 ? y + lo : 0, last = y + hi < H ? y + hi + 1 : H;
        for (int64_t yy = next > first ? next : first; yy < last; yy++)
            DM_T(local_row_last)(b, yy, H, W, C, brows + (yy % ring) * W * C);
        next = last > next ? last : next;
        DM_T(local_offsets)(arow, brows, ring, y, H, W, C, oy, ox, m, kind, out + (y - y0) * W,
                            rows * W);
    }
    free(arow);
    return 0;
}

/* Local windows moved by a flow (H, W, 2) of T: the window of pixel (y, x) sits at
 * (floor(y + fy) + oy, floor(x + fx) + ox) for each offset (oy, ox): rigidly moved, so every
 * offset of a pixel shares the fractions wy = (y - floor(y + fy)) + fy and wx (computed in that
 * order, as densematch.local's torch path does, so both weigh alike to the bit). Nearest
 * (bilinear 0): the flow holds whole numbers, one pixel per offset. Bilinear: the four pixels
 * around the position, weighted (1 - wy)(1 - wx), (1 - wy) wx, wy (1 - wx), wy wx; a corner
 * outside b (or masked out) is harmless where one of its weight's factors is 0. A linear pair
 * (dot) is the blend of the corners' dot products, and where the offsets are a whole grid of unit
 * steps (grid_cols > 0 columns, row-major) the (rows + 1) x (cols + 1) dot products of a pixel are
 * computed once and shared by the offsets (4x fewer); any other pair is the pair of a and the
 * blended feature. valid gets 1 where every corner that counts exists; out is NaN elsewhere.
 * Returns 0, or 1 where its scratch could not be allocated. */
/* where pixel (y, x)'s window sits: its top-left corner and the corners' weights, with each
 * weight's two factors (a corner outside b is harmless where one of them is 0) */
typedef struct {
    int64_t ty, tx;
    T weight[4], factor[4][2];
} DM_T(moved);

static inline DM_T(moved) DM_T(moved_at)(int64_t y, int64_t x, const T *f, int bilinear) {
    const T top = FLOOR((T)y + f[0]), left = FLOOR((T)x + f[1]);
    const T wy = bilinear ? ((T)y - top) + f[0] : 0, wx = bilinear ? ((T)x - left) + f[1] : 0;
    const DM_T(moved) m = {(int64_t)top,
                           (int64_t)left,
                           {(1 - wy) * (1 - wx), (1 - wy) * wx, wy * (1 - wx), wy * wx},
                           {{1 - wy, 1 - wx}, {1 - wy, wx}, {wy, 1 - wx}, {wy, wx}}};
    return m;
}

static inline T DM_T(local_pair)(int kind, const T *x, const T *y, int64_t C) {
    switch (kind) {
    case 0: return DM_T(dot)(x, y, C);
    case 1: return DM_T(sqdiff)(x, y, C);
    case 2: return DM_T(absdiff)(x, y, C);
    default: return DM_T(maxabs)(x, y, C);
    }
}

int DM_T(dm_local_flow)(const T *a, const T *b, int64_t H, int64_t W, int64_t C, const T *flow,
                        int bilinear, const uint8_t *mask_b, const int64_t *oy,
                        const int64_t *ox, int64_t m, int64_t grid_cols, int64_t y0,
                        int64_t y1, int kind, int linear, T *out, uint8_t *valid) {
    const int64_t rows = y1 - y0;
    const int shared = bilinear && linear && grid_cols > 0;
    const int64_t tw = shared ? grid_cols + 1 : 0, th = shared ? m / grid_cols + 1 : 0;
    T *blend = malloc(sizeof(T) * (size_t)(C > 0 ? C : 1));
    T *table = shared ? malloc(sizeof(T) * (size_t)(tw * th)) : NULL;
    uint8_t *held = shared ? malloc((size_t)(tw * th)) : NULL;
    if (!blend || (shared && (!table || !held))) {
        free(blend), free(table), free(held);
        return 1;
    }
    for (int64_t y = y0; y < y1; y++)
        for (int64_t x = 0; x < W; x++) {
            const T *pa = a + (y * W + x) * C;
            const DM_T(moved) at0 = DM_T(moved_at)(y, x, flow + (y * W + x) * 2, bilinear);
            const int64_t ty0 = at0.ty, tx0 = at0.tx;
            const T *weight = at0.weight, (*factor)[2] = at0.factor;
            const int corners = bilinear ? 4 : 1;
            if (shared) /* the dot products of the whole moved window, once */
                for (int64_t r = 0; r < th; r++)
                    for (int64_t s = 0; s < tw; s++) {
                        const int64_t qy = ty0 + oy[0] + r, qx = tx0 + ox[0] + s;
                        const int in = local_inside(qy, qx, H, W, mask_b);
                        held[r * tw + s] = (uint8_t)in;
                        table[r * tw + s] = in ? DM_T(dot)(pa, b + (qy * W + qx) * C, C) : 0;
                    }
            for (int64_t j = 0; j < m; j++) {
                const int64_t at = (j * rows + (y - y0)) * W + x;
                const int64_t ty = ty0 + oy[j], tx = tx0 + ox[j];
                int ok = 1;
                const T *pb[4] = {NULL, NULL, NULL, NULL};
                T v = 0;
                for (int k = 0; k < corners; k++) {
                    const int64_t qy = ty + (k >> 1), qx = tx + (k & 1);
                    int in;
                    if (shared) {
                        const int64_t cell = (j / grid_cols + (k >> 1)) * tw + j % grid_cols + (k & 1);
                        in = held[cell];
                        if (in && weight[k] != 0) v += weight[k] * table[cell];
                    } else {
                        in = local_inside(qy, qx, H, W, mask_b);
                        if (in) pb[k] = b + (qy * W + qx) * C;
                    }
                    if (!in && factor[k][0] != 0 && factor[k][1] != 0) ok = 0;
                }
                valid[at] = (uint8_t)ok;
                if (!ok) {
                    out[at] = (T)NAN;
                } else if (shared) {
                    out[at] = v;
                } else if (corners == 1) {
                    out[at] = DM_T(local_pair)(kind, pa, pb[0], C);
                } else if (linear) {
                    for (int k = 0; k < 4; k++)
                        if (pb[k] && weight[k] != 0) v += weight[k] * DM_T(dot)(pa, pb[k], C);
                    out[at] = v;
                } else {
                    for (int64_t c = 0; c < C; c++) blend[c] = 0;
                    for (int k = 0; k < 4; k++)
                        if (pb[k] && weight[k] != 0)
                            for (int64_t c = 0; c < C; c++) blend[c] += weight[k] * pb[k][c];
                    out[at] = DM_T(local_pair)(kind, pa, blend, C);
                }
            }
        }
    free(blend), free(table), free(held);
    return 0;
}

/* The gradients of dm_local_flow's linear windows (dot): for each pixel and offset with a window
 * (valid) and an output gradient g, a gets g * sum_k w_k b_k, each corner of b g * w_k * a, and
 * a bilinear flow g * sum_k dot(a, b_k) dw_k / d(fy, fx). Corners are read at their positions
 * clamped into b, as the torch path gathers them: a harmless corner outside b has weight 0 but
 * its derivative counts. ga, gb (H, W, C) and gf (H, W, 2) accumulate; any may be NULL. */
void DM_T(dm_local_flow_grad)(const T *a, const T *b, int64_t H, int64_t W, int64_t C,
                              const T *flow, int bilinear, const uint8_t *mask_b,
                              const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0,
                              int64_t y1, const T *grad, T *ga, T *gb, T *gf) {
    const int64_t rows = y1 - y0;
    for (int64_t y = y0; y < y1; y++)
        for (int64_t x = 0; x < W; x++) {
            const T *pa = a + (y * W + x) * C;
            const DM_T(moved) at0 = DM_T(moved_at)(y, x, flow + (y * W + x) * 2, bilinear);
            const int64_t ty0 = at0.ty, tx0 = at0.tx;
            const T *weight = at0.weight, (*factor)[2] = at0.factor;
            const T wy = factor[3][0], wx = factor[3][1];
            const T dwy[4] = {-(1 - wx), -wx, 1 - wx, wx}, dwx[4] = {-(1 - wy), 1 - wy, -wy, wy};
            const int corners = bilinear ? 4 : 1;
            for (int64_t j = 0; j < m; j++) {
                const T g = grad[(j * rows + (y - y0)) * W + x];
                if (g == 0) continue;
                const int64_t ty = ty0 + oy[j], tx = tx0 + ox[j];
                int ok = 1;
                int64_t q[4];
                for (int k = 0; k < corners; k++) {
                    const int64_t qy = ty + (k >> 1), qx = tx + (k & 1);
                    const int in = local_inside(qy, qx, H, W, mask_b);
                    if (!in && factor[k][0] != 0 && factor[k][1] != 0) ok = 0;
                    const int64_t cy = qy < 0 ? 0 : qy >= H ? H - 1 : qy;
                    const int64_t cx = qx < 0 ? 0 : qx >= W ? W - 1 : qx;
                    q[k] = cy * W + cx;
                }
                if (!ok) continue;
                T dfy = 0, dfx = 0;
                for (int k = 0; k < corners; k++) {
                    const T *pb = b + q[k] * C, s = g * weight[k];
                    if (gf && bilinear) {
                        const T d = DM_T(dot)(pa, pb, C);
                        dfy += d * dwy[k];
                        dfx += d * dwx[k];
                    }
                    if (s == 0) continue;
                    if (ga)
                        for (int64_t c = 0; c < C; c++) ga[(y * W + x) * C + c] += s * pb[c];
                    if (gb)
                        for (int64_t c = 0; c < C; c++) gb[q[k] * C + c] += s * pa[c];
                }
                if (gf && bilinear) {
                    gf[(y * W + x) * 2] += g * dfy;
                    gf[(y * W + x) * 2 + 1] += g * dfx;
                }
            }
        }
}

#undef PAIR_SUM
#undef PAIR_MAX
#undef LOCAL_ROW
/* the parameters of this instance, so that the next one defines its own */
#undef T
#undef I
#undef SUF
#undef ABS
#undef SQRT
#undef FREXP
#undef LDEXP
#undef FLOOR
