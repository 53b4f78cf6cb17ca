/* align.c's grid-search kernels for one floating type, included by align.c once per type with T
 * (float, double) and SUF (f32, f64: DM_T(name) is name_SUF) defined; it undefines them at its
 * end. No include guard: each inclusion is one instance. */
#include "dm_template.h"

typedef T DM_T(cvec) __attribute__((vector_size(CROSS_BYTES)));

/* dm_align_cross's inner step: p[kk] += sum_r t[r][kk] a[r .. r + lanes - 1] for kn columns kk of
 * the template (rows of w values from t), the sums in registers */
static inline __attribute__((always_inline)) void DM_T(cross_columns)(const int kn, DM_T(cvec) *p, const T *a,
                                                                       const T *t, int64_t h, int64_t w) {
    DM_T(cvec) acc[CROSS_KB];
    for (int kk = 0; kk < kn; kk++) acc[kk] = p[kk];
    for (int64_t r = 0; r < h; r++) {
        DM_T(cvec) col;
        memcpy(&col, a + r, sizeof col);
        for (int kk = 0; kk < kn; kk++) acc[kk] += t[r * w + kk] * col;
    }
    for (int kk = 0; kk < kn; kk++) p[kk] = acc[kk];
}
/* how many of n shifts along one axis scale i lets the template take: up to most[i] (all n where
 * most is NULL) */
static inline int64_t DM_T(used_shifts)(int64_t n, const int64_t *most, int64_t i) {
    if (!most) return n;
    return most[i] + 1 < n ? (most[i] + 1 > 0 ? most[i] + 1 : 0) : n;
}

/* dm_align_cross on the first ny_used of the ny row shifts only, and, where max_x is given, the
 * column shifts up to max_x[s] of scale_w s (the others are not written) */
static int DM_T(cross_rows)(const T *a, const T *t, const int64_t *i0, const int64_t *i1, const T *w0, const T *w1,
                            int64_t B, int64_t C, int64_t nh, int64_t rows, int64_t W, int64_t h, int64_t w,
                            int64_t nw, int64_t cols, int64_t ny, int64_t ny_used, int64_t nx, const int64_t *max_x,
                            T *out) {
    enum { L = CROSS_BYTES / sizeof(T), KB = CROSS_KB };
    const int64_t span = L + h - 1;
    /* vectors, so aligned to their size (malloc promises only 16 bytes) */
    DM_T(cvec) *P = aligned_alloc(sizeof(DM_T(cvec)), sizeof(DM_T(cvec)) * (size_t)(W * w + nx));
    T *at = malloc(sizeof(T) * (size_t)(W * span));
    if (!P || !at) {
        free(P);
        free(at);
        return 1;
    }
    DM_T(cvec) *acc = P + W * w; /* one row of shifts' sums */
    for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < nh; n++)
            for (int64_t y0 = 0; y0 < ny_used; y0 += L) {
                memset(P, 0, sizeof(DM_T(cvec)) * (size_t)(W * w));
                for (int64_t c = 0; c < C; c++) {
                    const T *ac = a + ((b * C + c) * nh + n) * rows * W;
                    const T *tc = t + (b * C + c) * h * w;
                    for (int64_t v = 0; v < W; v++) /* A's column v, rows y0 .. y0 + span - 1 */
                        for (int64_t j = 0; j < span; j++)
                            at[v * span + j] = y0 + j < rows ? ac[(y0 + j) * W + v] : 0;
                    for (int64_t v = 0; v < W; v++) /* KB columns of T at a time, in registers */
                        for (int64_t k0 = 0; k0 < w; k0 += KB) {
                            DM_T(cvec) *p = P + v * w + k0;
                            const T *a_v = at + v * span, *t0 = tc + k0;
                            switch (w - k0 < KB ? (int)(w - k0) : KB) { /* each width its own copy: the sums in registers */
                            case 1: DM_T(cross_columns)(1, p, a_v, t0, h, w); break;
                            case 2: DM_T(cross_columns)(2, p, a_v, t0, h, w); break;
                            case 3: DM_T(cross_columns)(3, p, a_v, t0, h, w); break;
                            case 4: DM_T(cross_columns)(4, p, a_v, t0, h, w); break;
                            case 5: DM_T(cross_columns)(5, p, a_v, t0, h, w); break;
                            case 6: DM_T(cross_columns)(6, p, a_v, t0, h, w); break;
                            case 7: DM_T(cross_columns)(7, p, a_v, t0, h, w); break;
                            default: DM_T(cross_columns)(KB, p, a_v, t0, h, w);
                            }
                        }
                }
                const int64_t ys = ny_used - y0 < L ? ny_used - y0 : L;
                for (int64_t s = 0; s < nw; s++) {
                    const int64_t *p0 = i0 + s * cols, *p1 = i1 + s * cols;
                    const T *q0 = w0 + s * cols, *q1 = w1 + s * cols;
                    T *o = out + ((b * nh + n) * nw + s) * ny * nx;
                    const int64_t nxs = DM_T(used_shifts)(nx, max_x, s);
                    /* by Rx's column j = x + k, its taps read once: cross[x] takes its k in order */
                    for (int64_t x = 0; x < nxs; x++) acc[x] = (DM_T(cvec)){0};
                    for (int64_t j = 0; j < nxs + w - 1; j++) {
                        const DM_T(cvec) *c0 = P + p0[j] * w, *c1 = P + p1[j] * w;
                        const T f0 = q0[j], f1 = q1[j];
                        const int64_t k_lo = j - nxs + 1 > 0 ? j - nxs + 1 : 0, k_hi = j < w - 1 ? j : w - 1;
                        for (int64_t k = k_lo; k <= k_hi; k++) acc[j - k] += f0 * c0[k] + f1 * c1[k];
                    }
                    for (int64_t x = 0; x < nxs; x++)
                        for (int64_t l = 0; l < ys; l++) o[(y0 + l) * nx + x] = acc[x][l];
                }
            }
    free(P);
    free(at);
    return 0;
}

int DM_T(dm_align_cross)(const T *a, const T *t, const int64_t *i0, const int64_t *i1, const T *w0,
                         const T *w1, int64_t B, int64_t C, int64_t nh, int64_t rows, int64_t W, int64_t h,
                         int64_t w, int64_t nw, int64_t cols, int64_t ny, int64_t nx, T *out) {
    return DM_T(cross_rows)(a, t, i0, i1, w0, w1, B, C, nh, rows, W, h, w, nw, cols, ny, ny, nx, NULL, out);
}

/* align's grid scores for uniform weights: the cross term (dm_align_cross), then per scale pair
 * the window sums of S^2 (and of S, for NCC) at every shift, and the score there: the mean
 * squared error, or 1 - NCC. S's column k blends A's columns j = i0 and i1 (= j or j + 1), so over
 * a window of rows and the channels sum S_k^2 = w0^2 V2_j + 2 w0 w1 Vx_j + w1^2 V2_i1 and sum S_k
 * = w0 V1_j + w1 V1_i1, where V2, Vx and V1 are the window sums of A_j^2, A_j A_(j+1) and A_j (one
 * set per scale_h, from prefix sums down the rows); a window of columns is then a difference of
 * prefix sums along k. In double, every loop element-wise along vectors of row shifts (padded to
 * whole vectors), so one order on every CPU: the torch path's _window_moments and _shift_scores
 * in one pass where those take some thirty operations. */
/* dm_align_scores on the shifts cross_rows computes only (the others are not written) */
static int DM_T(scores_rows)(const T *a, const T *t, const int64_t *i0, const int64_t *i1, const T *w0, const T *w1,
                             int64_t B, int64_t C, int64_t nh, int64_t rows, int64_t W, int64_t h, int64_t w,
                             int64_t nw, int64_t cols, int64_t ny, int64_t ny_used, int64_t nx, const int64_t *max_x,
                             int ncc, T *out) {
    if (DM_T(cross_rows)(a, t, i0, i1, w0, w1, B, C, nh, rows, W, h, w, nw, cols, ny, ny_used, nx, max_x, out))
        return 1;
    const int64_t reach_y = ny_used + h - 1, reach_x = nx + w - 1, N = (ny_used + 7) / 8 * 8;
    /* prefix sums down the rows of A^2, A_j A_(j+1) and A (reach_y + 1, W) each; their window sums
     * V2, Vx, V1 as (W, N); prefix sums along the columns of S^2 and S, (reach_x + 1, N) each */
    const size_t prefix = (size_t)((reach_y + 1) * W), window = (size_t)(W * N), along = (size_t)((reach_x + 1) * N);
    double *cum = malloc(sizeof(double) * (3 * prefix + 3 * window + 2 * along));
    if (!cum) return 1;
    double *cum_x = cum + prefix, *cum_1 = cum_x + prefix, *v2 = cum_1 + prefix, *vx = v2 + window, *v1 = vx + window;
    double *g2 = v1 + window, *g1 = g2 + along;
    const double total = (double)(C * h * w);
    for (int64_t b = 0; b < B; b++) {
        double tt = 0, ts = 0;
        for (int64_t i = 0; i < C * h * w; i++) {
            const double v = (double)t[b * C * h * w + i];
            tt += v * v;
            ts += v;
        }
        const double mean_t = ts / total, var_t = tt / total - mean_t * mean_t;
        for (int64_t n = 0; n < nh; n++) {
            memset(cum, 0, sizeof(double) * 3 * prefix);
            for (int64_t c = 0; c < C; c++)
                for (int64_t r = 0; r < reach_y; r++) {
                    const T *ar = a + (((b * C + c) * nh + n) * rows + r) * W;
                    double *q2 = cum + (r + 1) * W, *qx = cum_x + (r + 1) * W, *q1 = cum_1 + (r + 1) * W;
                    for (int64_t j = 0; j < W; j++) {
                        const double v = (double)ar[j], next = j + 1 < W ? (double)ar[j + 1] : 0.0;
                        q2[j] += v * v;
                        qx[j] += v * next;
                        if (ncc) q1[j] += v; /* the sums of S only NCC reads */
                    }
                }
            for (int64_t r = 1; r <= reach_y; r++)
                for (int64_t j = 0; j < W; j++) {
                    cum[r * W + j] += cum[(r - 1) * W + j];
                    cum_x[r * W + j] += cum_x[(r - 1) * W + j];
                    if (ncc) cum_1[r * W + j] += cum_1[(r - 1) * W + j];
                }
            for (int64_t j = 0; j < W; j++)
                for (int64_t y = 0; y < N; y++) {
                    const int64_t top = (y < ny_used ? y : 0) * W + j, end = top + h * W;
                    v2[j * N + y] = cum[end] - cum[top];
                    vx[j * N + y] = cum_x[end] - cum_x[top];
                    if (ncc) v1[j * N + y] = cum_1[end] - cum_1[top];
                }
            for (int64_t s = 0; s < nw; s++) {
                const int64_t *p0 = i0 + s * cols, *p1 = i1 + s * cols;
                const T *q0 = w0 + s * cols, *q1 = w1 + s * cols;
                const int64_t nxs = DM_T(used_shifts)(nx, max_x, s);
                for (int64_t y = 0; y < N; y++) g2[y] = g1[y] = 0;
                for (int64_t k = 0; k < nxs + w - 1; k++) {
                    const double f0 = (double)q0[k], f1 = (double)q1[k];
                    const double *a2 = v2 + p0[k] * N, *b2 = v2 + p1[k] * N, *a1 = v1 + p0[k] * N, *b1 = v1 + p1[k] * N;
                    /* i1 = i0 + 1: the pair's own window sums; i1 = i0 (the last column): A_j^2 */
                    const double *ab = p1[k] == p0[k] ? a2 : vx + p0[k] * N;
                    const double c2 = f0 * f0, cx = 2 * f0 * f1, d2 = f1 * f1;
                    double *e = g2 + (k + 1) * N, *u = g1 + (k + 1) * N;
                    for (int64_t y = 0; y < N; y++) e[y] = e[y - N] + ((c2 * a2[y] + cx * ab[y]) + d2 * b2[y]);
                    if (ncc)
                        for (int64_t y = 0; y < N; y++) u[y] = u[y - N] + (f0 * a1[y] + f1 * b1[y]);
                }
                T *o = out + ((b * nh + n) * nw + s) * ny * nx;
                for (int64_t x = 0; x < nxs; x++) {
                    const double *e0 = g2 + x * N, *e1 = g2 + (x + w) * N, *u0 = g1 + x * N, *u1 = g1 + (x + w) * N;
                    for (int64_t y = 0; y < ny_used; y++) {
                        const double cross = (double)o[y * nx + x], energy = e1[y] - e0[y];
                        double score;
                        if (ncc) {
                            const double mean_s = (u1[y] - u0[y]) / total, cov = cross / total - mean_s * mean_t;
                            const double var_s = energy / total - mean_s * mean_s;
                            const double denom = sqrt((var_s > 0 ? var_s : 0) * var_t);
                            score = 1 - cov / (denom > 1e-12 ? denom : 1e-12);
                        } else {
                            const double sq = tt - 2 * cross + energy;
                            score = (sq > 0 ? sq : 0) / total;
                        }
                        o[y * nx + x] = (T)score;
                    }
                }
            }
        }
    }
    free(cum);
    return 0;
}

int DM_T(dm_align_scores)(const T *a, const T *t, const int64_t *i0, const int64_t *i1, const T *w0,
                          const T *w1, int64_t B, int64_t C, int64_t nh, int64_t rows, int64_t W, int64_t h,
                          int64_t w, int64_t nw, int64_t cols, int64_t ny, int64_t nx, int ncc, T *out) {
    return DM_T(scores_rows)(a, t, i0, i1, w0, w1, B, C, nh, rows, W, h, w, nw, cols, ny, ny, nx, NULL, ncc, out);
}

/* align's grid search: per scale pair, the K lowest local minima over the shifts of score
 * (M x ny x nx; a local minimum is no higher than any of its 8 neighbours), lowest first, ties
 * to the lower flat index; where fewer than K, inf and index 0 fill the rest. One pass, where
 * torch takes a padded copy, four minimum passes and a top-k. */
void DM_T(dm_align_best_shifts)(const T *score, int64_t M, int64_t ny, int64_t nx, int64_t K, T *best,
                                int64_t *where) {
    for (int64_t m = 0; m < M; m++) {
        const T *s = score + m * ny * nx;
        T *bv = best + m * K;
        int64_t *bi = where + m * K;
        for (int64_t k = 0; k < K; k++) {
            bv[k] = (T)INFINITY;
            bi[k] = 0;
        }
        for (int64_t y = 0; y < ny; y++)
            for (int64_t x = 0; x < nx; x++) {
                const T v = s[y * nx + x];
                if (!(v < bv[K - 1])) continue;
                int low = 1;
                for (int64_t dy = y > 0 ? -1 : 0; low && dy <= (y + 1 < ny ? 1 : 0); dy++)
                    for (int64_t dx = x > 0 ? -1 : 0; dx <= (x + 1 < nx ? 1 : 0); dx++)
                        if (s[(y + dy) * nx + x + dx] < v) {
                            low = 0;
                            break;
                        }
                if (!low) continue;
                int64_t k = K - 1;
                for (; k > 0 && v < bv[k - 1]; k--) {
                    bv[k] = bv[k - 1];
                    bi[k] = bi[k - 1];
                }
                bv[k] = v;
                bi[k] = y * nx + x;
            }
    }
}
/* align's whole grid for uniform weights, pair by pair and scale_h by scale_h, nothing kept
 * but the answer: the image stretched along y (A = Ry X, from Ry's two taps per row: r0, r1,
 * v0, v1, each (nh, rows)), the scores (dm_align_scores), inf at shifts past the stretched image
 * (y > max_y[scale_h] or x > max_x[scale_w]), and each scale pair's K best local minima
 * (dm_align_best_shifts) into best and where (B, nh, nw, K). x (B, C, H, W). Returns 1 where
 * scratch could not be allocated. */
int DM_T(dm_align_grid)(const T *x, const T *t, const int64_t *r0, const int64_t *r1, const T *v0, const T *v1,
                        const int64_t *i0, const int64_t *i1, const T *w0, const T *w1, int64_t B, int64_t C,
                        int64_t H, int64_t W, int64_t h, int64_t w, int64_t nh, int64_t rows, int64_t nw,
                        int64_t cols, int64_t ny, int64_t nx, const int64_t *max_y, const int64_t *max_x, int ncc,
                        int64_t K, T *best, int64_t *where) {
    const int64_t used = ny + h - 1; /* the rows of A any window reads */
    T *a = malloc(sizeof(T) * (size_t)(C * used * W + nw * ny * nx));
    if (!a) return 1;
    T *score = a + C * used * W;
    enum { L = CROSS_BYTES / sizeof(T) };
    for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < nh; n++) {
            /* the row shifts this scale_h lets the template take (the others are masked below):
             * the cross term's blocks of L and A's rows stop there */
            const int64_t ny_used = DM_T(used_shifts)(ny, max_y, n);
            const int64_t read = ny_used + L + h - 1 < used ? ny_used + L + h - 1 : used;
            for (int64_t c = 0; c < C && ny_used; c++) {
                const T *xc = x + (b * C + c) * H * W;
                for (int64_t r = 0; r < read; r++) {
                    const T *p = xc + r0[n * rows + r] * W, *q = xc + r1[n * rows + r] * W;
                    const T f = v0[n * rows + r], g = v1[n * rows + r];
                    T *o = a + (c * used + r) * W;
                    for (int64_t j = 0; j < W; j++) o[j] = f * p[j] + g * q[j];
                }
            }
            if (ny_used && DM_T(scores_rows)(a, t + b * C * h * w, i0, i1, w0, w1, 1, C, 1, used, W, h, w, nw, cols,
                                             ny, ny_used, nx, max_x, ncc, score)) {
                free(a);
                return 1;
            }
            for (int64_t s = 0; s < nw; s++)
                for (int64_t y = 0; y < ny; y++)
                    for (int64_t k = 0; k < nx; k++)
                        if (y > max_y[n] || k > max_x[s]) score[(s * ny + y) * nx + k] = (T)INFINITY;
            DM_T(dm_align_best_shifts)(score, nw, ny, nx, K, best + (b * nh + n) * nw * K, where + (b * nh + n) * nw * K);
        }
    free(a);
    return 0;
}

/* image x (C, H, W) sampled bilinearly at q = (scale_h, scale_w, shift_y, shift_x) (taps' rule, in
 * double) into out (C, h, w): the two rows blended first, then the two columns. ti holds 2 (h + w)
 * indices, tf h + w + W values. */
static void DM_T(warp_into)(const T *x, const double *q, int64_t C, int64_t H, int64_t W, int64_t h, int64_t w,
                            T *out, int64_t *ti, double *tf) {
    int64_t *r0 = ti, *r1 = r0 + h, *c0 = r1 + h, *c1 = c0 + w;
    double *fr = tf, *fc = fr + h, *row = fc + w;
    taps(h, H, q[0], q[2], r0, r1, fr);
    taps(w, W, q[1], q[3], c0, c1, fc);
    for (int64_t c = 0; c < C; c++) {
        const T *xc = x + c * H * W;
        T *oc = out + c * h * w;
        for (int64_t r = 0; r < h; r++) {
            const T *a = xc + r0[r] * W, *b = xc + r1[r] * W;
            const double f = fr[r];
            for (int64_t j = 0; j < W; j++) row[j] = (1 - f) * (double)a[j] + f * (double)b[j];
            for (int64_t k = 0; k < w; k++) oc[r * w + k] = (T)((1 - fc[k]) * row[c0[k]] + fc[k] * row[c1[k]]);
        }
    }
}

/* align's warp (densematch.alignment.warp.warp_batch): out (M, C, h, w) samples image i of x
 * (M, C, H, W) at params[i] (warp_into). Returns 1 where scratch could not be allocated. */
int DM_T(dm_align_warp)(const T *x, const double *params, int64_t M, int64_t C, int64_t H, int64_t W, int64_t h,
                        int64_t w, T *out) {
    int64_t *ti = malloc(sizeof(int64_t) * (size_t)(2 * (h + w)));
    double *tf = malloc(sizeof(double) * (size_t)(h + w + W));
    if (ti && tf)
        for (int64_t i = 0; i < M; i++)
            DM_T(warp_into)(x + i * C * H * W, params + 4 * i, C, H, W, h, w, out + i * C * h * w, ti, tf);
    free(ti);
    free(tf);
    return !ti || !tf;
}

/* The level rule's band share (densematch.alignment.api._low_band), the least over B pairs: each
 * template t (C, h, w) less its weighted mean per channel, times the weights wt (h, w: a Hann
 * window, times the pair's mask, one map per pair where wt_per_pair), has the power
 * sum |rows v cols|^2 of its band (rows (2 ny, h): cosines then sines along y; cols (w, 2 nx):
 * those along x; api._band_dft) against its energy times h w. In double: sums over the pixels
 * in eight lanes (fold8), each product's output summed in one order, over k or r ascending;
 * the products go BAND_J outputs of a row at a time (cols copied into blocks of BAND_J, zero
 * padded), two rows of v at once, so that their sums stay in registers. Returns 1 where scratch
 * could not be allocated. */
int DM_T(dm_align_band)(const T *t, const double *wt, int64_t wt_per_pair, int64_t B, int64_t C, int64_t h, int64_t w,
                        const double *rows, int64_t ny2, const double *cols, int64_t nx2, double *least) {
    const int64_t hw = h * w, ny = ny2 / 2, nx = nx2 / 2, nb = (nx2 + BAND_J - 1) / BAND_J, np = nb * BAND_J;
    double *v = malloc(sizeof(double) * (size_t)(hw + (w + h + 2) * np));
    if (!v) return 1;
    double *cb = v + hw, *p = cb + w * np, *z_cos = p + h * np, *z_sin = z_cos + np;
    for (int64_t k = 0; k < w; k++) /* cols in blocks: block j / BAND_J, row k at cb + (j / BAND_J w + k) BAND_J */
        for (int64_t j = 0; j < np; j++)
            cb[(j / BAND_J * w + k) * BAND_J + j % BAND_J] = j < nx2 ? cols[k * nx2 + j] : 0;
    *least = INFINITY;
    for (int64_t b = 0; b < B; b++) {
        const double *a = wt + (wt_per_pair ? b * hw : 0);
        const double mass = band_sum(a, NULL, hw), weights = mass > 1e-30 ? mass : 1e-30;
        double energy = 0, power = 0;
        for (int64_t c = 0; c < C; c++) {
            const T *tc = t + (b * C + c) * hw;
            for (int64_t i = 0; i < hw; i++) v[i] = (double)tc[i];
            const double mean = band_sum(v, a, hw) / weights;
            for (int64_t i = 0; i < hw; i++) v[i] = (v[i] - mean) * a[i];
            energy += band_sum(v, v, hw);
            for (int64_t j = 0; j < nb; j++) /* p = v cols, block j of its columns, two rows at a time */
                for (int64_t r = 0; r < h; r += 2)
                    band_rows(v + r * w, v + (r + 1 < h ? r + 1 : r) * w, cb + j * w * BAND_J, BAND_J, w,
                              p + r * np + j * BAND_J, p + (r + 1 < h ? r + 1 : r) * np + j * BAND_J);
            for (int64_t i_y = 0; i_y < ny; i_y++) { /* z = rows p: y's cosine row i_y and its sine row */
                for (int64_t j = 0; j < nb; j++)
                    band_rows(rows + i_y * h, rows + (ny + i_y) * h, p + j * BAND_J, np, h, z_cos + j * BAND_J,
                              z_sin + j * BAND_J);
                for (int64_t j = 0; j < nx; j++) {
                    const double re = z_cos[j] - z_sin[nx + j], im = z_sin[j] + z_cos[nx + j];
                    power += re * re + im * im;
                }
            }
        }
        const double total = energy * (double)hw > 1e-300 ? energy * (double)hw : 1e-300, share = power / total;
        if (share < *least) *least = share;
    }
    free(v);
    return 0;
}

/* the mean of each 2 x 2 block of v (C planes of h x w) into out (C, h / 2, w / 2), a trailing odd
 * row and column dropped (densematch.alignment.search.downsample's halving): the rows' pairs, then
 * the columns', in that order */
static void DM_T(halve)(const T *v, int64_t C, int64_t h, int64_t w, T *out) {
    const int64_t ho = h / 2, wo = w / 2;
    for (int64_t c = 0; c < C; c++)
        for (int64_t i = 0; i < ho; i++) {
            const T *a = v + (c * h + 2 * i) * w, *b = a + w;
            T *o = out + (c * ho + i) * wo;
            for (int64_t j = 0; j < wo; j++) o[j] = ((a[2 * j] + b[2 * j]) + (a[2 * j + 1] + b[2 * j + 1])) * (T)0.25;
        }
}

/* v (C, h, w) filtered by [1, 2, 1] / 4 along its rows, then its columns, edges replicated
 * (densematch.alignment.api._blur), into out as float64; rows holds h w values */
static void DM_T(blur)(const T *v, int64_t C, int64_t h, int64_t w, T *rows, double *out) {
    for (int64_t c = 0; c < C; c++) {
        const T *p = v + c * h * w;
        for (int64_t i = 0; i < h; i++) {
            const T *up = p + (i > 0 ? i - 1 : 0) * w, *at = p + i * w, *dn = p + (i + 1 < h ? i + 1 : i) * w;
            for (int64_t j = 0; j < w; j++) rows[i * w + j] = (up[j] + 2 * at[j] + dn[j]) * (T)0.25;
        }
        for (int64_t i = 0; i < h; i++) {
            const T *r = rows + i * w;
            for (int64_t j = 0; j < w; j++) {
                const T left = r[j > 0 ? j - 1 : 0], right = r[j + 1 < w ? j + 1 : j];
                out[(c * h + i) * w + j] = (double)((left + 2 * r[j] + right) * (T)0.25);
            }
        }
    }
}

/* sum wt[i] v[i] (wt NULL: ones) in double, in four lanes folded in one order: four chains of adds
 * in flight where one would wait on each */
static double DM_T(lane_sum)(const T *v, const T *wt, int64_t n) {
    double lanes[4] = {0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int l = 0; l < 4; l++) lanes[l] += (wt ? (double)wt[i + l] : 1.0) * (double)v[i + l];
    double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; i < n; i++) total += (wt ? (double)wt[i] : 1.0) * (double)v[i];
    return total;
}

/* max |v[i]| (0 where n is 0), four lanes at a time */
static double DM_T(lane_peak)(const T *v, int64_t n) {
    double lanes[4] = {0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int l = 0; l < 4; l++) lanes[l] = fabs((double)v[i + l]) > lanes[l] ? fabs((double)v[i + l]) : lanes[l];
    for (; i < n; i++) lanes[0] = fabs((double)v[i]) > lanes[0] ? fabs((double)v[i]) : lanes[0];
    const double a = lanes[0] > lanes[1] ? lanes[0] : lanes[1], b = lanes[2] > lanes[3] ? lanes[2] : lanes[3];
    return a > b ? a : b;
}

/* 1 - the weighted NCC of the template t (C, h, w) and the warped image u (C, h, w), weights wt
 * (h, w) or 1 where NULL, total their sum times C (densematch.alignment.refine.objective_at), in
 * double */
static double DM_T(ncc_error)(const T *t, const T *u, const T *wt, int64_t C, int64_t hw, double total) {
    double st = 0, su = 0;
    for (int64_t c = 0; c < C; c++)
        for (int64_t i = 0; i < hw; i++) {
            const double a = wt ? (double)wt[i] : 1.0;
            st += a * (double)t[c * hw + i];
            su += a * (double)u[c * hw + i];
        }
    const double mt = st / total, mu = su / total;
    double cov = 0, vt = 0, vu = 0;
    for (int64_t c = 0; c < C; c++)
        for (int64_t i = 0; i < hw; i++) {
            const double a = wt ? (double)wt[i] : 1.0, dt = (double)t[c * hw + i] - mt, du = (double)u[c * hw + i] - mu;
            cov += a * du * dt;
            vt += a * dt * dt;
            vu += a * du * du;
        }
    const double var = sqrt(vu * vt);
    return 1 - cov / (var > 1e-12 ? var : 1e-12);
}

/* One pair at unit amplitude (densematch.alignment.api._centred, per pair): the template t (C, h, w)
 * and the image x (C, H, W) less the image's mean level per channel (level, C), each difference
 * in T, into tu and xu, times the power of two that brings their larger peak into [1, 2), handed
 * back (1 where both are flat). The search's fixed epsilons then mean the same at any amplitude,
 * and its expanded sums keep a texture of 0.01 on a level of 500. */
static double DM_T(centre)(const T *t, const T *x, int64_t C, int64_t hw, int64_t HW, T *level, T *tu, T *xu) {
    for (int64_t c = 0; c < C; c++) {
        level[c] = (T)(DM_T(lane_sum)(x + c * HW, NULL, HW) / (double)HW);
        for (int64_t i = 0; i < hw; i++) tu[c * hw + i] = t[c * hw + i] - level[c];
        for (int64_t i = 0; i < HW; i++) xu[c * HW + i] = x[c * HW + i] - level[c];
    }
    const double peak_t = DM_T(lane_peak)(tu, C * hw), peak_x = DM_T(lane_peak)(xu, C * HW);
    const double peak = peak_t > peak_x ? peak_t : peak_x;
    int e = 0;
    if (!(peak > 0)) return 1.0;
    frexp(peak, &e);
    const double unit = ldexp(1.0, 1 - e);
    for (int64_t i = 0; i < C * hw; i++) tu[i] *= (T)unit;
    for (int64_t i = 0; i < C * HW; i++) xu[i] *= (T)unit;
    return unit;
}

/* The error of the best flat fit to the template t (C, h, w) under the weights wt (h, w, NULL:
 * ones; densematch.alignment.api._spread): the weighted mean absolute ("l1", objective 0) or
 * squared deviation from each channel's weighted mean, in float64; 1 for "ncc". */
static double DM_T(spread)(const T *t, const T *wt, int64_t C, int64_t hw, int64_t objective) {
    if (objective == 2) return 1.0;
    const double weights = wt ? DM_T(lane_sum)(wt, NULL, hw) : (double)hw;
    double total = 0;
    for (int64_t c = 0; c < C; c++) {
        const T *tc = t + c * hw;
        const double mean = DM_T(lane_sum)(tc, wt, hw) / weights;
        double lanes[4] = {0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 4 <= hw; i += 4)
            for (int l = 0; l < 4; l++) {
                const double d = fabs((double)tc[i + l] - mean), a = wt ? (double)wt[i + l] : 1.0;
                lanes[l] += a * (objective == 0 ? d : d * d);
            }
        double part = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        for (; i < hw; i++) {
            const double d = fabs((double)tc[i] - mean), a = wt ? (double)wt[i] : 1.0;
            part += a * (objective == 0 ? d : d * d);
        }
        total += part;
    }
    return total / ((double)C * weights);
}

/* whether the n values of v are all finite: NaN times 0 and Inf times 0 are NaN, in eight lanes */
static int DM_T(all_finite)(const T *v, int64_t n) {
    T lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += v[i + l] * 0;
    for (; i < n; i++) lanes[0] += v[i] * 0;
    T sum = 0;
    for (int l = 0; l < 8; l++) sum += lanes[l];
    return sum == 0;
}

/* align's search for B pairs (densematch.alignment.api._search), each from its pyramid to its
 * warp, with nothing between the steps but this loop. Per pair b of t (B, C, h, w) and x (B, C,
 * H, W), weights wt (B, h, w), or (h, w) shared where sizes[S_WT_SHARED], or uniform where NULL,
 * and total[b] their sum times C (NULL with uniform weights: C h w):
 * 0. the pair at unit amplitude (centre); every output below is back in the pair's own units;
 * 1. the pyramid: sizes[S_LEVELS] levels, each halving the one below (halve), in T, each also in
 *    float64 for the refinement;
 * 2. at the coarsest level the grid (dm_align_grid, from Ry's taps r0, r1, v0, v1 (nh, rows), Rx's
 *    i0, i1, w0, w1 (nw, cols), shifts (ny, nx) up to max_y, max_x), each scale pair's K best
 *    shifts into best and where (B, nh, nw, K); where sizes[S_GRID_GIVEN] they are given there
 *    instead. landscape (B, nh, nw) gets the best of each, shifts (B, nh, nw, 2) its shift in
 *    full-resolution pixels (NaN where it has none);
 * 3. the candidates (dm_align_pick: S_PICK lowest, S_CANDIDATES of them apart by reals[R_NEAR]),
 *    refined down the pyramid (refine_levels: keeping S_KEEP_FIRST after the coarsest level,
 *    S_KEEP_NEXT after the others, twins within R_SAME dropped; R_COARSE_TOLERANCE, then
 *    R_TOLERANCE at full resolution), each rounded to T where torch's path holds them in T;
 * 4. each one that full resolution moved over R_FAR pixels (at the template's far edge) refined
 *    again from where it stopped, on both images blurred (blur) to R_COARSE_TOLERANCE, then sharp:
 *    the two compete;
 * 5. the best by the objective (S_OBJECTIVE: 0 "l1", 1 "l2" from the refinement's sums over total,
 *    2 "ncc" at the warp, with gain and bias fitted), NaN last, ties to the first, into answer
 *    (B, 4) and error (B,) (1 - NCC at least 0), its warp into warped (B, C, h, w), and the error
 *    against the template's own spread (spread) into relative (B,).
 * Returns 1 where scratch could not be allocated, 2 where t holds NaN or Inf, 3 where x does
 * (checked first: nothing else is done then). */
int DM_T(dm_align_search)(const T *t, const T *x, const T *wt, const T *total, const int64_t *sizes,
                          const double *reals, const int64_t *r0, const int64_t *r1, const T *v0, const T *v1,
                          const int64_t *i0, const int64_t *i1, const T *w0, const T *w1, const int64_t *max_y,
                          const int64_t *max_x, const double *grid_h, const double *grid_w, T *best, int64_t *where,
                          T *landscape, T *shifts, T *answer, T *error, T *warped, T *relative) {
    const int64_t B = sizes[S_B], C = sizes[S_C], h = sizes[S_H], w = sizes[S_W], H = sizes[S_BIG_H];
    const int64_t W = sizes[S_BIG_W], L = sizes[S_LEVELS], nh = sizes[S_NH], nw = sizes[S_NW], K = sizes[S_K];
    const int64_t nx = sizes[S_NX], n_pick = sizes[S_PICK], M = sizes[S_CANDIDATES], objective = sizes[S_OBJECTIVE];
    const int shared = sizes[S_WT_SHARED] != 0, ncc = objective == 2, P = ncc ? 6 : 4;
    const int iterations = (int)sizes[S_ITERATIONS];
    const double *range = reals + R_RANGE;
    const double coarse = (double)((int64_t)1 << (L - 1));
    const double tol[2] = {reals[R_COARSE_TOLERANCE], reals[R_TOLERANCE]};
    if (L < 1 || L > 62) return 1;
    if (!DM_T(all_finite)(t, B * C * h * w)) return 2;
    if (!DM_T(all_finite)(x, B * C * H * W)) return 3;
    /* the levels' sizes, finest first, and the room their copies take */
    int64_t lh[62], lw[62], lH[62], lW[62], n_t = 0, n_d = 0, n_w = 0;
    for (int64_t j = 0; j < L; j++) {
        lh[j] = h >> j, lw[j] = w >> j, lH[j] = H >> j, lW[j] = W >> j;
        const int64_t plane = C * (lh[j] * lw[j] + lH[j] * lW[j]);
        n_d += plane + (wt ? lh[j] * lw[j] : 0);
        if (j > 0) n_t += plane, n_w += lh[j] * lw[j];
    }
    const int64_t big = refine_scratch(C, h, w, H), big_i = 2 * (h + w), hw = h * w, grid = nh * nw * K;
    const int64_t m_all = 2 * M; /* the levels' candidates, and as many refined again */
    const size_t n_doubles = (size_t)(n_d + big + 5 * M + 4 * m_all + 4 * M + 2 * m_all + grid + 4 * n_pick + h + w + W);
    double *dbuf = malloc(sizeof(double) * n_doubles), *blurred = NULL;
    T *tbuf = malloc(sizeof(T) * (size_t)(n_t + n_w + 4 * m_all + 2 * m_all + m_all + C * hw + C * (hw + H * W) + C));
    int64_t *ibuf = malloc(sizeof(int64_t) * (size_t)(big_i + 2 * M + n_pick + 2 * (h + w)));
    unsigned char *alive = malloc((size_t)n_pick + 1);
    int failed = !dbuf || !tbuf || !ibuf || !alive;
    if (failed) goto done;
    double *pyr = dbuf, *scratch = pyr + n_d, *cand = scratch + big + 5 * M, *start = cand + 4 * m_all;
    double *sums = start + 4 * M, *best_d = sums + 2 * m_all, *params = best_d + grid, *tf = params + 4 * n_pick;
    T *halves = tbuf, *wt_halves = halves + n_t, *cand_t = wt_halves + n_w, *sums_t = cand_t + 4 * m_all;
    T *err = sums_t + 2 * m_all, *u = err + m_all, *tu = u + C * hw, *xu = tu + C * hw, *level = xu + C * H * W;
    int64_t *itaps = ibuf, *order = itaps + big_i + 2 * M, *ti = order + n_pick;
    /* shared weights: their halvings once, for every pair */
    const T *wl[62];
    if (wt && shared) {
        wl[0] = wt;
        for (int64_t j = 1, at = 0; j < L; at += lh[j] * lw[j], j++) {
            DM_T(halve)(wl[j - 1], 1, lh[j - 1], lw[j - 1], wt_halves + at);
            wl[j] = wt_halves + at;
        }
    }
    for (int64_t b = 0; b < B; b++) {
        const T *tl[62], *xl[62];
        const double unit = DM_T(centre)(t + b * C * hw, x + b * C * H * W, C, hw, H * W, level, tu, xu);
        const T per_unit = (T)unit, per_area = (T)(unit * unit); /* powers of two: exact */
        tl[0] = tu;
        xl[0] = xu;
        if (wt && !shared) wl[0] = wt + b * hw;
        for (int64_t j = 1, at = 0, at_w = 0; j < L; j++) {
            T *th = halves + at, *xh = th + C * lh[j] * lw[j];
            DM_T(halve)(tl[j - 1], C, lh[j - 1], lw[j - 1], th);
            DM_T(halve)(xl[j - 1], C, lH[j - 1], lW[j - 1], xh);
            tl[j] = th, xl[j] = xh;
            at += C * (lh[j] * lw[j] + lH[j] * lW[j]);
            if (wt && !shared) {
                DM_T(halve)(wl[j - 1], 1, lh[j - 1], lw[j - 1], wt_halves + at_w);
                wl[j] = wt_halves + at_w;
                at_w += lh[j] * lw[j];
            }
        }
        /* every level in float64 for the refinement, coarsest first (uniform weights: none) */
        level_t lv[62];
        for (int64_t j = 0, at = 0; j < L; j++) {
            const int64_t nt = C * lh[j] * lw[j], nxs = C * lH[j] * lW[j], np = wt ? lh[j] * lw[j] : 0;
            double *dt = pyr + at, *dx = dt + nt, *dw = dx + nxs;
            for (int64_t i = 0; i < nt; i++) dt[i] = (double)tl[j][i];
            for (int64_t i = 0; i < nxs; i++) dx[i] = (double)xl[j][i];
            for (int64_t i = 0; i < np; i++) dw[i] = (double)wl[j][i];
            lv[L - 1 - j] = (level_t){dt, dx, wt ? dw : NULL, lh[j], lw[j], lH[j], lW[j], (double)((int64_t)1 << j)};
            at += nt + nxs + np;
        }
        /* the grid and its landscape */
        T *bb = best + b * grid;
        int64_t *wb = where + b * grid;
        const int64_t c_ = L - 1;
        if (!sizes[S_GRID_GIVEN] &&
            DM_T(dm_align_grid)(xl[c_], tl[c_], r0, r1, v0, v1, i0, i1, w0, w1, 1, C, lH[c_], lW[c_], lh[c_], lw[c_],
                                nh, sizes[S_ROWS], nw, sizes[S_COLS], sizes[S_NY], nx, max_y, max_x, ncc, K, bb, wb)) {
            failed = 1;
            goto done;
        }
        for (int64_t p = 0; p < nh * nw; p++) {
            const T v = bb[p * K];
            T *sh = shifts + 2 * (b * nh * nw + p);
            landscape[b * nh * nw + p] = ncc ? v : v / per_area;
            sh[0] = isfinite(v) ? (T)(wb[p * K] / nx) * (T)coarse : (T)NAN;
            sh[1] = isfinite(v) ? (T)(wb[p * K] % nx) * (T)coarse : (T)NAN;
        }
        /* the candidates, in T as torch holds them, then down the pyramid */
        for (int64_t i = 0; i < grid; i++) best_d[i] = (double)bb[i];
        dm_align_pick(best_d, wb, 1, nh * nw, K, grid_h, grid_w, nw, nx, reals + R_NEAR, n_pick, M, order, params,
                      alive, cand);
        for (int64_t i = 0; i < 4 * M; i++) cand[i] = (double)((T)cand[i] * (T)(i % 4 < 2 ? 1 : coarse));
        int64_t keep[62];
        double tolerance[62];
        for (int64_t l = 0; l < L; l++) {
            keep[l] = l == 0 ? sizes[S_KEEP_FIRST] : sizes[S_KEEP_NEXT];
            tolerance[l] = tol[l == L - 1];
        }
        int64_t n = refine_levels(lv, L, C, P, keep, tolerance, range, iterations, reals + R_SAME, M, cand, start,
                                  sums, scratch, big, itaps, big_i);
        for (int64_t i = 0; i < 4 * n; i++) cand_t[i] = (T)cand[i];
        for (int64_t i = 0; i < 2 * n; i++) sums_t[i] = (T)sums[i];
        /* those full resolution moved far, again from where they stopped: blurred, then sharp */
        const level_t *full = lv + L - 1;
        const double edge[4] = {(double)h, (double)w, 1.0, 1.0};
        int blur_done = 0;
        for (int64_t i = 0, m = n; i < m; i++) {
            double moved = 0;
            for (int k = 0; k < 4; k++) {
                const double v = (double)fabs(cand_t[4 * i + k] - (T)start[4 * i + k]) * edge[k];
                moved = v > moved ? v : moved;
            }
            if (!(moved > reals[R_FAR])) continue;
            if (!blurred) /* both images blurred in float64, and room for one plane's rows in T */
                blurred = malloc(sizeof(double) * (size_t)(C * (hw + H * W) + H * W));
            if (!blurred) {
                failed = 1;
                goto done;
            }
            if (!blur_done) {
                T *rows = (T *)(blurred + C * (hw + H * W));
                DM_T(blur)(tl[0], C, h, w, rows, blurred);
                DM_T(blur)(xl[0], C, H, W, rows, blurred + C * hw);
                blur_done = 1;
            }
            const pair_t soft = {blurred, blurred + C * hw, full->wt, C, h, w, H, W, P, scratch, itaps};
            const pair_t sharp = {full->t, full->x, full->wt, C, h, w, H, W, P, scratch, itaps};
            double p[6] = {cand_t[4 * i], cand_t[4 * i + 1], cand_t[4 * i + 2], cand_t[4 * i + 3], 1.0, 0.0}, s2[2];
            refine_one(&soft, range, iterations, tol[0], p, s2);
            for (int k = 0; k < 4; k++) p[k] = (double)(T)p[k];
            p[4] = 1.0, p[5] = 0.0;
            refine_one(&sharp, range, iterations, tol[1], p, s2);
            for (int k = 0; k < 4; k++) cand_t[4 * n + k] = (T)p[k];
            sums_t[2 * n] = (T)s2[0], sums_t[2 * n + 1] = (T)s2[1];
            n++;
        }
        /* the best by the objective, and its warp */
        const T weights_b = total ? total[b] : (T)(C * hw);
        int64_t pick = 0;
        for (int64_t i = 0; i < n; i++) {
            if (ncc) {
                double q[4];
                for (int k = 0; k < 4; k++) q[k] = (double)cand_t[4 * i + k];
                DM_T(warp_into)(xl[0], q, C, H, W, h, w, u, ti, tf);
                err[i] = (T)DM_T(ncc_error)(tl[0], u, wt ? wl[0] : NULL, C, hw, (double)weights_b);
            } else {
                err[i] = sums_t[2 * i + (objective == 0)] / weights_b;
            }
            if (i > 0 && !isnan(err[i]) && (isnan(err[pick]) || err[i] < err[pick])) pick = i;
        }
        double q[4];
        for (int k = 0; k < 4; k++) {
            answer[4 * b + k] = cand_t[4 * pick + k];
            q[k] = (double)cand_t[4 * pick + k];
        }
        /* back in the pair's own units: the warp of its image, errors of its amplitude */
        const T e = err[pick];
        error[b] = objective == 2 ? (e < 0 ? 0 : e) : objective == 0 ? e / per_unit : e / per_area;
        T *wb_out = warped + b * C * hw;
        DM_T(warp_into)(xl[0], q, C, H, W, h, w, wb_out, ti, tf);
        for (int64_t c = 0; c < C; c++)
            for (int64_t i = 0; i < hw; i++) wb_out[c * hw + i] = wb_out[c * hw + i] / per_unit + level[c];
        const double flat = DM_T(spread)(t + b * C * hw, wt ? wl[0] : NULL, C, hw, objective);
        const T least = sizeof(T) == 4 ? (T)FLT_MIN : (T)DBL_MIN;
        relative[b] = error[b] / ((T)flat > least ? (T)flat : least);
    }
done:
    free(dbuf);
    free(tbuf);
    free(ibuf);
    free(alive);
    free(blurred);
    return failed;
}

/* the parameters of this instance, so that the next one defines its own */
#undef T
#undef SUF
