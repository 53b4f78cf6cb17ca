/* align.c's grid-search kernels for one floating type, included by align.c once per type with T
 * (float, double) and SUF (f32, f64: DM_T(name) is name_SUF) defined; it undefines them at its
 * end. No include guard: each inclusion is one instance. */
#include "dm_template.h"

typedef T DM_T(cvec) __attribute__((vector_size(CROSS_BYTES)));
int DM_T(dm_align_cross)(const T *a, const T *t, const int64_t *i0, const int64_t *i1, const T *w0,
                         const T *w1, int64_t B, int64_t C, int64_t nh, int64_t rows, int64_t W, int64_t h,
                         int64_t w, int64_t nw, int64_t cols, int64_t ny, int64_t nx, T *out) {
    enum { L = CROSS_BYTES / sizeof(T), KB = CROSS_KB };
    const int64_t span = L + h - 1;
    /* vectors, so aligned to their size (malloc promises only 16 bytes) */
    DM_T(cvec) *P = aligned_alloc(sizeof(DM_T(cvec)), sizeof(DM_T(cvec)) * (size_t)(W * w));
    T *at = malloc(sizeof(T) * (size_t)(W * span));
    if (!P || !at) {
        free(P);
        free(at);
        return 1;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < nh; n++)
            for (int64_t y0 = 0; y0 < ny; y0 += L) {
                memset(P, 0, sizeof(DM_T(cvec)) * (size_t)(W * w));
                for (int64_t c = 0; c < C; c++) {
                    const T *ac = a + ((b * C + c) * nh + n) * rows * W;
                    const T *tc = t + (b * C + c) * h * w;
                    for (int64_t v = 0; v < W; v++) /* A's column v, rows y0 .. y0 + span - 1 */
                        for (int64_t j = 0; j < span; j++)
                            at[v * span + j] = y0 + j < rows ? ac[(y0 + j) * W + v] : 0;
                    for (int64_t v = 0; v < W; v++) /* KB columns of T at a time, in registers */
                        for (int64_t k0 = 0; k0 < w; k0 += KB) {
                            const int kn = w - k0 < KB ? (int)(w - k0) : KB;
                            DM_T(cvec) acc[KB];
                            for (int kk = 0; kk < KB; kk++) acc[kk] = P[v * w + k0 + (kk < kn ? kk : 0)];
                            for (int64_t r = 0; r < h; r++) {
                                DM_T(cvec) col;
                                memcpy(&col, at + v * span + r, sizeof col);
                                const T *tr = tc + r * w + k0;
                                if (kn == KB)
                                    for (int kk = 0; kk < KB; kk++) acc[kk] += tr[kk] * col;
                                else
                                    for (int kk = 0; kk < kn; kk++) acc[kk] += tr[kk] * col;
                            }
                            for (int kk = 0; kk < kn; kk++) P[v * w + k0 + kk] = acc[kk];
                        }
                }
                const int64_t ys = ny - y0 < L ? ny - y0 : L;
                for (int64_t s = 0; s < nw; s++) {
                    const int64_t *p0 = i0 + s * cols, *p1 = i1 + s * cols;
                    const T *q0 = w0 + s * cols, *q1 = w1 + s * cols;
                    T *o = out + ((b * nh + n) * nw + s) * ny * nx;
                    for (int64_t x = 0; x < nx; x++) {
                        DM_T(cvec) acc = {0};
                        for (int64_t k = 0; k < w; k++) {
                            const int64_t j = x + k;
                            acc += q0[j] * P[p0[j] * w + k] + q1[j] * P[p1[j] * w + k];
                        }
                        for (int64_t l = 0; l < ys; l++) o[(y0 + l) * nx + x] = acc[l];
                    }
                }
            }
    free(P);
    free(at);
    return 0;
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
int DM_T(dm_align_scores)(const T *a, const T *t, const int64_t *i0, const int64_t *i1, const T *w0,
                          const T *w1, int64_t B, int64_t C, int64_t nh, int64_t rows, int64_t W, int64_t h,
                          int64_t w, int64_t nw, int64_t cols, int64_t ny, int64_t nx, int ncc, T *out) {
    if (DM_T(dm_align_cross)(a, t, i0, i1, w0, w1, B, C, nh, rows, W, h, w, nw, cols, ny, nx, out)) return 1;
    const int64_t reach_y = ny + h - 1, reach_x = nx + w - 1, N = (ny + 7) / 8 * 8;
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
                        q1[j] += v;
                    }
                }
            for (int64_t r = 1; r <= reach_y; r++)
                for (int64_t j = 0; j < W; j++) {
                    cum[r * W + j] += cum[(r - 1) * W + j];
                    cum_x[r * W + j] += cum_x[(r - 1) * W + j];
                    cum_1[r * W + j] += cum_1[(r - 1) * W + j];
                }
            for (int64_t j = 0; j < W; j++)
                for (int64_t y = 0; y < N; y++) {
                    const int64_t top = (y < ny ? y : 0) * W + j, end = top + h * W;
                    v2[j * N + y] = cum[end] - cum[top];
                    vx[j * N + y] = cum_x[end] - cum_x[top];
                    v1[j * N + y] = cum_1[end] - cum_1[top];
                }
            for (int64_t s = 0; s < nw; s++) {
                const int64_t *p0 = i0 + s * cols, *p1 = i1 + s * cols;
                const T *q0 = w0 + s * cols, *q1 = w1 + s * cols;
                for (int64_t y = 0; y < N; y++) g2[y] = g1[y] = 0;
                for (int64_t k = 0; k < reach_x; k++) {
                    const double f0 = (double)q0[k], f1 = (double)q1[k];
                    const double *a2 = v2 + p0[k] * N, *b2 = v2 + p1[k] * N, *a1 = v1 + p0[k] * N, *b1 = v1 + p1[k] * N;
                    /* i1 = i0 + 1: the pair's own window sums; i1 = i0 (the last column): A_j^2 */
                    const double *ab = p1[k] == p0[k] ? a2 : vx + p0[k] * N;
                    const double c2 = f0 * f0, cx = 2 * f0 * f1, d2 = f1 * f1;
                    double *e = g2 + (k + 1) * N, *u = g1 + (k + 1) * N;
                    for (int64_t y = 0; y < N; y++) {
                        e[y] = e[y - N] + ((c2 * a2[y] + cx * ab[y]) + d2 * b2[y]);
                        u[y] = u[y - N] + (f0 * a1[y] + f1 * b1[y]);
                    }
                }
                T *o = out + ((b * nh + n) * nw + s) * ny * nx;
                for (int64_t x = 0; x < nx; x++) {
                    const double *e0 = g2 + x * N, *e1 = g2 + (x + w) * N, *u0 = g1 + x * N, *u1 = g1 + (x + w) * N;
                    for (int64_t y = 0; y < ny; y++) {
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
    for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < nh; n++) {
            for (int64_t c = 0; c < C; c++) {
                const T *xc = x + (b * C + c) * H * W;
                for (int64_t r = 0; r < used; r++) {
                    const T *p = xc + r0[n * rows + r] * W, *q = xc + r1[n * rows + r] * W;
                    const T f = v0[n * rows + r], g = v1[n * rows + r];
                    T *o = a + (c * used + r) * W;
                    for (int64_t j = 0; j < W; j++) o[j] = f * p[j] + g * q[j];
                }
            }
            if (DM_T(dm_align_scores)(a, t + b * C * h * w, i0, i1, w0, w1, 1, C, 1, used, W, h, w, nw, cols, ny, nx,
                                      ncc, score)) {
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

/* align's warp (densematch.alignment.warp.warp_batch): out (M, C, h, w) samples image i of x
 * (M, C, H, W) bilinearly at params[i] = (scale_h, scale_w, shift_y, shift_x) (taps' rule, in
 * double): the two rows blended first, then the two columns. Returns 1 where scratch could not
 * be allocated. */
int DM_T(dm_align_warp)(const T *x, const double *params, int64_t M, int64_t C, int64_t H, int64_t W, int64_t h,
                        int64_t w, T *out) {
    int64_t *ti = malloc(sizeof(int64_t) * (size_t)(2 * (h + w)));
    double *tf = malloc(sizeof(double) * (size_t)(h + w + W));
    if (!ti || !tf) {
        free(ti);
        free(tf);
        return 1;
    }
    int64_t *r0 = ti, *r1 = r0 + h, *c0 = r1 + h, *c1 = c0 + w;
    double *fr = tf, *fc = fr + h, *row = fc + w;
    for (int64_t i = 0; i < M; i++) {
        const double *q = params + 4 * i;
        taps(h, H, q[0], q[2], r0, r1, fr);
        taps(w, W, q[1], q[3], c0, c1, fc);
        for (int64_t c = 0; c < C; c++) {
            const T *xc = x + (i * C + c) * H * W;
            T *oc = out + (i * C + c) * h * w;
            for (int64_t r = 0; r < h; r++) {
                const T *a = xc + r0[r] * W, *b = xc + r1[r] * W;
                const double f = fr[r];
                for (int64_t j = 0; j < W; j++) row[j] = (1 - f) * (double)a[j] + f * (double)b[j];
                for (int64_t k = 0; k < w; k++) oc[r * w + k] = (T)((1 - fc[k]) * row[c0[k]] + fc[k] * row[c1[k]]);
            }
        }
    }
    free(ti);
    free(tf);
    return 0;
}
/* the parameters of this instance, so that the next one defines its own */
#undef T
#undef SUF
