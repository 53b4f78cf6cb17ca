/* align's refinement in C: Levenberg-Marquardt on the warp (scale_h, scale_w, shift_y, shift_x),
 * with gain and bias for NCC, each candidate on its own from start to end, in float64. It is the
 * same iteration as densematch.alignment.refine's torch path (the same damping, steps, box and
 * stopping rules), without torch's per-operation cost: a 100 x 100 template costs a few tenths
 * of a millisecond per candidate instead of tens.
 *
 * Template pixel (r, c) looks at image coordinate y = (r + shift_y + 0.5) / scale_h - 0.5 (and x
 * likewise), clamped to the image and sampled bilinearly between rows i0 = min(floor(y), H - 2)
 * and i1 = min(i0 + 1, H - 1), as densematch.alignment.warp.sampling_matrix weighs them. The warp
 * is separable, so the image is first interpolated along x for the rows the template reaches
 * (Y and its x-derivative dY, H' x w), then each template row is a blend of two rows of those:
 * contiguous loops over columns. The normal equations' sums factor the same way: the Jacobian's
 * columns are products of a per-pixel value (gy, gx * b_c, gx, the warped value, 1) and a
 * per-row coefficient, so each row needs a handful of dot products over its columns.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dm_abi.h"

typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4i __attribute__((vector_size(32)));

static inline v4d vabs(v4d v) { return (v4d)((v4i)v & (v4i){INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX}); }

static inline double fold(v4d v) { return (v[0] + v[1]) + (v[2] + v[3]); }

/* One block of four template pixels' contributions, added lane by lane into the sums:
 * acc[i][j] += w q_i q_j and accr[i] += w q_i res for the per-pixel values q = (gy, gx * b_c, gx,
 * u, 1) (the first nb), acc2 += w res^2, acc1 += w |res|. The pixels are the blend (1 - f) a0 + f a1
 * of two rows of the image interpolated along x (e0, e1: their x-derivatives); rows_differ is 0
 * where both are the same clamped row (no y-derivative). Uniform weights multiply by nothing; a
 * weight of exactly 1 gives the same bits. */
static inline __attribute__((always_inline)) void block_sums(const int nb, const int weighted, v4d a0, v4d a1, v4d e0,
                                                             v4d e1, v4d tv, v4d wv, v4d bcv, v4d fv, v4d gv, v4d bv,
                                                             int rows_differ, v4d acc[5][5], v4d accr[5], v4d *acc2,
                                                             v4d *acc1) {
    const v4d one = {1, 1, 1, 1}, zero = {0, 0, 0, 0};
    const v4d u = (one - fv) * a0 + fv * a1, gx = (one - fv) * e0 + fv * e1;
    const v4d gy = rows_differ ? a1 - a0 : zero, res = gv * u + bv - tv;
    const v4d q[5] = {gy, gx * bcv, gx, u, one};
    const v4d wres = weighted ? wv * res : res;
    *acc2 += wres * res;
    *acc1 += weighted ? wv * vabs(res) : vabs(res);
    for (int i = 0; i < nb; i++) {
        const v4d wq = weighted ? wv * q[i] : q[i];
        accr[i] += wq * res;
        for (int j = i; j < nb; j++) acc[i][j] += wq * q[j];
    }
}

/* One template row of one channel into the sums (block_sums), four columns at a time; the
 * columns left over as one block padded with zeros, each padded lane of weight 0. One order on
 * every CPU: lane c % 4 of the sums takes column c. */
static inline __attribute__((always_inline)) void row_sums(const int nb, const int weighted, const double *y0,
                                                           const double *y1, const double *d0, const double *d1,
                                                           const double *T, const double *wt, const double *bc,
                                                           int64_t w, v4d fv, v4d gv, v4d bv, int rows_differ,
                                                           v4d acc[5][5], v4d accr[5], v4d *acc2, v4d *acc1) {
    const v4d one = {1, 1, 1, 1};
    int64_t c = 0;
    for (; c + 4 <= w; c += 4) {
        v4d a0, a1, e0, e1, tv, wv = one, bcv;
        memcpy(&a0, y0 + c, 32);
        memcpy(&a1, y1 + c, 32);
        memcpy(&e0, d0 + c, 32);
        memcpy(&e1, d1 + c, 32);
        memcpy(&tv, T + c, 32);
        if (weighted) memcpy(&wv, wt + c, 32);
        memcpy(&bcv, bc + c, 32);
        block_sums(nb, weighted, a0, a1, e0, e1, tv, wv, bcv, fv, gv, bv, rows_differ, acc, accr, acc2, acc1);
    }
    if (c < w) {
        const int64_t n = w - c;
        v4d a0 = {0}, a1 = {0}, e0 = {0}, e1 = {0}, tv = {0}, wv = {0}, bcv = {0};
        memcpy(&a0, y0 + c, sizeof(double) * (size_t)n);
        memcpy(&a1, y1 + c, sizeof(double) * (size_t)n);
        memcpy(&e0, d0 + c, sizeof(double) * (size_t)n);
        memcpy(&e1, d1 + c, sizeof(double) * (size_t)n);
        memcpy(&tv, T + c, sizeof(double) * (size_t)n);
        memcpy(&bcv, bc + c, sizeof(double) * (size_t)n);
        for (int64_t l = 0; l < n; l++) wv[l] = weighted ? wt[c + l] : 1.0;
        block_sums(nb, 1, a0, a1, e0, e1, tv, wv, bcv, fv, gv, bv, rows_differ, acc, accr, acc2, acc1);
    }
}

/* bilinear taps of n_out outputs into n_in inputs at scale and shift (sampling_matrix's rule) */
static void taps(int64_t n_out, int64_t n_in, double scale, double shift, int64_t *i0, int64_t *i1, double *frac) {
    for (int64_t i = 0; i < n_out; i++) {
        double y = ((double)i + shift + 0.5) / scale - 0.5;
        y = y < 0 ? 0 : (y > (double)(n_in - 1) ? (double)(n_in - 1) : y);
        double f0 = floor(y);
        const double top = (double)(n_in > 2 ? n_in - 2 : 0);
        if (f0 > top) f0 = top;
        i0[i] = (int64_t)f0;
        i1[i] = i0[i] + 1 < n_in ? i0[i] + 1 : n_in - 1;
        frac[i] = y - f0;
    }
}

/* refine_one's scratch for a level: h + 2 w + 2 C H w values (taps' fractions, b_c, Y and dY),
 * and 2 (h + w) indices */
static inline int64_t refine_scratch(int64_t C, int64_t h, int64_t w, int64_t H) { return h + 2 * w + 2 * C * H * w; }

typedef struct {
    const double *t, *x, *wt; /* one pair: template (C, h, w), image (C, H, W), weights (h, w), or NULL: ones */
    int64_t C, h, w, H, W;
    int P;            /* 4, or 6 with gain and bias */
    double *scratch;  /* refine_scratch values */
    int64_t *itaps;
} pair_t;

/* Cost sum w res^2, the normal equations jtj (P x P) and jtr (P) at q; l1 gets sum w |res|. With
 * jtj NULL, the two sums only (a step that ends the refinement needs no next step): the same bits,
 * without the derivatives. The Jacobian's column k is coef[k] q[basis[k]], coef constant but
 * for scale_h's, G rho_r on row r (rho_r = -(r + sy + 0.5) / sh^2): the sums with gy (q's first)
 * are kept per row, then added into the whole's times 1, rho_r and rho_r^2; all others over the
 * whole template. Every sum in four lanes, folded once. */
static double normal_equations(const pair_t *s, const double *q, double *jtj, double *jtr, double *l1) {
    const int64_t h = s->h, w = s->w, H = s->H, W = s->W, P = s->P, nb = !jtj ? 0 : (P == 6 ? 5 : 3);
    const double sh = q[0], sw = q[1], sy = q[2], sx = q[3];
    const double G = P == 6 ? q[4] : 1.0, B = P == 6 ? q[5] : 0.0;
    int64_t *ri0 = s->itaps, *ri1 = ri0 + h, *cj0 = ri1 + h, *cj1 = cj0 + w;
    double *rf = s->scratch, *cg = rf + h, *bc = cg + w;
    taps(h, H, sh, sy, ri0, ri1, rf);
    taps(w, W, sw, sx, cj0, cj1, cg);
    for (int64_t c = 0; c < w; c++) bc[c] = -((double)c + sx + 0.5) / (sw * sw);
    const int64_t lo = ri0[0], n_rows = ri1[h - 1] - lo + 1, C = s->C;
    double *Y = bc + w, *dY = Y + C * n_rows * w;
    for (int64_t ch = 0; ch < C; ch++) /* the image along x, on the rows the template reaches */
        for (int64_t i = 0; i < n_rows; i++) {
            const double *xr = s->x + (ch * H + lo + i) * W;
            double *yo = Y + (ch * n_rows + i) * w, *dyo = dY + (ch * n_rows + i) * w;
            if (nb)
                for (int64_t c = 0; c < w; c++) {
                    const double a = xr[cj0[c]], b = xr[cj1[c]];
                    yo[c] = (1 - cg[c]) * a + cg[c] * b;
                    dyo[c] = b - a; /* 0 where both taps are the last column: one value twice */
                }
            else
                for (int64_t c = 0; c < w; c++) yo[c] = (1 - cg[c]) * xr[cj0[c]] + cg[c] * xr[cj1[c]];
        }
    const v4d zero = {0, 0, 0, 0}, gv = zero + G, bv = zero + B;
    v4d acc[5][5], accr[5], acc2 = zero, acc1 = zero;
    v4d gy_by[3][6] = {{zero}}; /* [1, rho, rho^2]: the sums of gy q_j (j < nb), then of gy res */
    for (int i = 0; i < 5; i++) {
        accr[i] = zero;
        for (int j = 0; j < 5; j++) acc[i][j] = zero;
    }
    for (int64_t r = 0; r < h; r++) {
        const v4d fv = zero + rf[r];
        for (int64_t ch = 0; ch < C; ch++) {
            const double *T = s->t + (ch * h + r) * w, *wt = s->wt ? s->wt + r * w : NULL;
            const double *Yc = Y + ch * n_rows * w, *dYc = dY + ch * n_rows * w;
            const double *y0 = Yc + (ri0[r] - lo) * w, *y1 = Yc + (ri1[r] - lo) * w;
            const double *d0 = dYc + (ri0[r] - lo) * w, *d1 = dYc + (ri1[r] - lo) * w;
            const int differ = ri1[r] != ri0[r];
            /* each case its own inlined copy */
            if (nb == 0 && wt)
                row_sums(0, 1, y0, y1, d0, d1, T, wt, bc, w, fv, gv, bv, differ, acc, accr, &acc2, &acc1);
            else if (nb == 0)
                row_sums(0, 0, y0, y1, d0, d1, T, wt, bc, w, fv, gv, bv, differ, acc, accr, &acc2, &acc1);
            else if (nb == 3 && wt)
                row_sums(3, 1, y0, y1, d0, d1, T, wt, bc, w, fv, gv, bv, differ, acc, accr, &acc2, &acc1);
            else if (nb == 3)
                row_sums(3, 0, y0, y1, d0, d1, T, wt, bc, w, fv, gv, bv, differ, acc, accr, &acc2, &acc1);
            else if (wt)
                row_sums(5, 1, y0, y1, d0, d1, T, wt, bc, w, fv, gv, bv, differ, acc, accr, &acc2, &acc1);
            else
                row_sums(5, 0, y0, y1, d0, d1, T, wt, bc, w, fv, gv, bv, differ, acc, accr, &acc2, &acc1);
        }
        if (!nb) continue;
        const double rho = -((double)r + sy + 0.5) / (sh * sh);
        for (int j = 0; j <= nb; j++) { /* j = nb: the residual's */
            const v4d v = j < nb ? acc[0][j] : accr[0];
            gy_by[0][j] += v;
            gy_by[1][j] += rho * v;
            gy_by[2][j] += (rho * rho) * v;
            if (j < nb)
                acc[0][j] = zero;
            else
                accr[0] = zero;
        }
    }
    *l1 = fold(acc1);
    if (!nb) return fold(acc2);
    /* whole sums: S[a][b] = sum q_a q_b (a <= b), R[a] = sum q_a res, with gy's times 1, rho, rho^2 */
    double S[5][5], R[5], Sg[3][5], Rg[3];
    for (int i = 1; i < nb; i++) {
        R[i] = fold(accr[i]);
        for (int j = i; j < nb; j++) S[i][j] = fold(acc[i][j]);
    }
    for (int m = 0; m < 3; m++) {
        Rg[m] = fold(gy_by[m][nb]);
        for (int j = 0; j < nb; j++) Sg[m][j] = fold(gy_by[m][j]);
    }
    const int basis[6] = {0, 1, 0, 2, 3, 4};
    const double coef[6] = {G, G, G / sh, G / sw, 1.0, 1.0};
    for (int64_t k = 0; k < P; k++) {
        const int a = basis[k];
        jtr[k] = coef[k] * (a ? R[a] : Rg[k == 0]);
        for (int64_t l = k; l < P; l++) {
            const int b = basis[l], rho_power = (k == 0) + (l == 0); /* scale_h's column carries rho_r */
            const double sum = a && b ? S[a < b ? a : b][a < b ? b : a] : Sg[rho_power][a ? a : b];
            jtj[k * P + l] = jtj[l * P + k] = coef[k] * coef[l] * sum;
        }
    }
    return fold(acc2);
}

/* x = A^-1 b for a P x P system (Gaussian elimination, partial pivoting); 0 where singular */
static int solve(int P, double *A, double *b, double *x) {
    for (int k = 0; k < P; k++) {
        int piv = k;
        for (int i = k + 1; i < P; i++)
            if (fabs(A[i * P + k]) > fabs(A[piv * P + k])) piv = i;
        if (!(fabs(A[piv * P + k]) > 0)) return 0;
        if (piv != k) {
            for (int j = 0; j < P; j++) {
                const double tmp = A[k * P + j];
                A[k * P + j] = A[piv * P + j];
                A[piv * P + j] = tmp;
            }
            const double tmp = b[k];
            b[k] = b[piv];
            b[piv] = tmp;
        }
        for (int i = k + 1; i < P; i++) {
            const double m = A[i * P + k] / A[k * P + k];
            for (int j = k; j < P; j++) A[i * P + j] -= m * A[k * P + j];
            b[i] -= m * b[k];
        }
    }
    for (int i = P - 1; i >= 0; i--) {
        double v = b[i];
        for (int j = i + 1; j < P; j++) v -= A[i * P + j] * x[j];
        x[i] = v / A[i * P + i];
    }
    return 1;
}

/* the box: scales in their ranges, shifts keeping the template inside the stretched image */
static void project(const pair_t *s, const double *range, double *q) {
    q[0] = q[0] < range[0] ? range[0] : (q[0] > range[1] ? range[1] : q[0]);
    q[1] = q[1] < range[2] ? range[2] : (q[1] > range[3] ? range[3] : q[1]);
    const double top_y = (double)s->H * q[0] - (double)s->h, top_x = (double)s->W * q[1] - (double)s->w;
    q[2] = q[2] < 0 ? 0 : q[2];
    q[2] = q[2] < top_y ? q[2] : top_y;
    q[3] = q[3] < 0 ? 0 : q[3];
    q[3] = q[3] < top_x ? q[3] : top_x;
}

static void refine_one(const pair_t *s, const double *range, int iterations, double tolerance, double *p,
                       double *out) {
    const int P = s->P;
    double jtj[36], jtr[6], jtj_t[36], jtr_t[6], A[36], rhs[6], step[6], trial[6], l1;
    const double scale[4] = {(double)s->h, (double)s->w, 1.0, 1.0};
    project(s, range, p);
    double cost = normal_equations(s, p, jtj, jtr, &l1), lam = 1e-3;
    for (int it = 0; it < iterations; it++) {
        for (int k = 0; k < P * P; k++) A[k] = jtj[k];
        for (int k = 0; k < P; k++) {
            A[k * P + k] += jtj[k * P + k] * lam + 1e-12;
            rhs[k] = -jtr[k];
        }
        if (!solve(P, A, rhs, step))
            for (int k = 0; k < P; k++) step[k] = 0;
        for (int k = 0; k < P; k++) trial[k] = p[k] + step[k];
        project(s, range, trial);
        double moved = 0;
        for (int k = 0; k < 4; k++) {
            const double v = fabs(step[k]) * scale[k];
            moved = v > moved ? v : moved;
        }
        /* a step under the tolerance is the last, taken or not: any later one, damped more, is shorter */
        const int last = moved < tolerance;
        double l1_t;
        const double cost_t = normal_equations(s, trial, last ? NULL : jtj_t, jtr_t, &l1_t);
        const int better = cost_t < cost;
        const double gain = better ? (cost - cost_t) / (cost > 1e-30 ? cost : 1e-30) : 0.0;
        if (better) {
            memcpy(p, trial, sizeof(double) * P);
            if (!last) {
                memcpy(jtj, jtj_t, sizeof jtj);
                memcpy(jtr, jtr_t, sizeof jtr);
            }
            cost = cost_t;
            l1 = l1_t;
        }
        if (last || (better && gain < 1e-9) || (!better && lam * 10 >= 1e6)) break;
        lam = better ? lam * 0.3 : lam * 10;
        lam = lam < 1e-9 ? 1e-9 : (lam > 1e9 ? 1e9 : lam);
    }
    out[0] = cost;
    out[1] = l1;
}

/* Refine m candidates in place: p (m x P), candidate i fitting template owner[i] of t (B, C, h, w)
 * into image owner[i] of x (B, C, H, W) with pixel weights wt (B, h, w), or one (h, w) shared by
 * every pair where wt_shared (no copy of a uniform weight per pair), scales kept in range
 * (lo_h, hi_h, lo_w, hi_w), at most `iterations` steps, done once a step moves no template pixel
 * by `tolerance` pixels or more. out (m x 2) gets each one's weighted sums of squared and of absolute
 * residuals. Returns 0, or 1 where the scratch could not be allocated. */
int dm_align_refine(const double *t, const double *x, const double *wt, int wt_shared, int64_t C, int64_t h,
                    int64_t w, int64_t H, int64_t W, const int64_t *owner, int64_t m, int P, const double *range,
                    int iterations, double tolerance, double *p, double *out) {
    double *scratch = malloc(sizeof(double) * (size_t)refine_scratch(C, h, w, H));
    int64_t *itaps = malloc(sizeof(int64_t) * (size_t)(2 * h + 2 * w));
    if (!scratch || !itaps) {
        free(scratch);
        free(itaps);
        return 1;
    }
    for (int64_t i = 0; i < m; i++) {
        const int64_t o = owner[i];
        const double *wo = wt + (wt_shared ? 0 : o * h * w);
        pair_t s = {t + o * C * h * w, x + o * C * H * W, wo, C, h, w, H, W, P, scratch, itaps};
        refine_one(&s, range, iterations, tolerance, p + i * P, out + 2 * i);
    }
    free(scratch);
    free(itaps);
    return 0;
}

/* One pair's candidates, ranked by their error (NaN last, ties in their order), the first `keep`
 * of them less any within `same` (scales, shifts) of a better one kept: kept gets their indices,
 * best first; returns how many. idx holds the pair's candidate indices (n), sorted in place. */
static int64_t keep_best(int64_t *idx, int64_t n, const double *err, const double *cand, int64_t keep,
                         const double *same, int64_t *kept) {
    for (int64_t i = 1; i < n; i++) { /* insertion sort: a few candidates, and stable */
        const int64_t v = idx[i];
        int64_t j = i;
        for (; j > 0; j--) {
            const double a = err[idx[j - 1]], b = err[v];
            if (!(isnan(a) && !isnan(b)) && !(a > b)) break;
            idx[j] = idx[j - 1];
        }
        idx[j] = v;
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n && i < keep; i++) {
        const double *c = cand + 4 * idx[i];
        int twin = 0;
        for (int64_t j = 0; j < m && !twin; j++) {
            const double *d = cand + 4 * kept[j];
            twin = fabs(c[0] - d[0]) <= same[0] && fabs(c[1] - d[1]) <= same[0] && fabs(c[2] - d[2]) <= same[1] &&
                   fabs(c[3] - d[3]) <= same[1];
        }
        if (!twin) kept[m++] = idx[i];
    }
    return m;
}

/* One pair at one level of align's pyramid: template (C, h, w), image (C, H, W) and weights (h, w)
 * (NULL: ones), float64, and the level's downsampling factor */
typedef struct {
    const double *t, *x, *wt;
    int64_t h, w, H, W;
    double factor;
} level_t;

/* align's refinement down one pair's pyramid, lv[0 .. L - 1] coarsest first. The m candidates in
 * cand (full-resolution (scale_h, scale_w, shift_y, shift_x)) are refined at each level in its own
 * pixels (from gain 1, bias 0 where P = 6) to tolerance[l]; after each level but the last the pair
 * keeps its keep[l] best by the squared error, less twins within `same` (keep_best). The last
 * level's candidates stay in cand (full resolution), with start (where they began there) and sums
 * (squared, absolute); returns their count. scratch holds refine_scratch of the largest level and
 * 5 m more values, itaps its 2 (h + w) indices and 2 m more. */
static int64_t refine_levels(const level_t *lv, int64_t L, int64_t C, int P, const int64_t *keep,
                             const double *tolerance, const double *range, int iterations, const double *same,
                             int64_t m, double *cand, double *start, double *sums, double *scratch, int64_t big,
                             int64_t *itaps, int64_t big_i) {
    double *err = scratch + big, *tmp = err + m;
    int64_t *idx = itaps + big_i, *kept = idx + m;
    for (int64_t l = 0; l < L; l++) {
        const double f = lv[l].factor;
        const pair_t s = {lv[l].t, lv[l].x, lv[l].wt, C, lv[l].h, lv[l].w, lv[l].H, lv[l].W, P, scratch, itaps};
        for (int64_t i = 0; i < m; i++) {
            double *c = cand + 4 * i, p[6] = {c[0], c[1], c[2] / f, c[3] / f, 1.0, 0.0};
            if (l == L - 1) memcpy(start + 4 * i, c, sizeof(double) * 4);
            refine_one(&s, range, iterations, tolerance[l], p, sums + 2 * i);
            c[0] = p[0];
            c[1] = p[1];
            c[2] = p[2] * f;
            c[3] = p[3] * f;
        }
        if (l == L - 1) break;
        for (int64_t i = 0; i < m; i++) {
            err[i] = sums[2 * i];
            idx[i] = i;
        }
        const int64_t n = keep_best(idx, m, err, cand, keep[l], same, kept);
        for (int64_t j = 0; j < n; j++) memcpy(tmp + 4 * j, cand + 4 * kept[j], sizeof(double) * 4);
        memcpy(cand, tmp, sizeof(double) * (size_t)(4 * n));
        m = n;
    }
    return m;
}

/* align's candidates from the grid (densematch.alignment.search.pick_candidates), per pair b:
 * of the scale pairs' best shifts best[b] (P scale pairs x S shifts, flat shift indices in where,
 * scale pair p = i_h nw + i_w), the n lowest (ties to the lower index), then greedily the first
 * left, dropping every one within near (scale_h, scale_w, shift_y, shift_x) of it, M times (the
 * lowest again where none is left). out (B, M, 4): (scale_h, scale_w, shift_y, shift_x). order
 * holds n indices, params 4 n values of scratch, alive n flags. */
void dm_align_pick(const double *best, const int64_t *where, int64_t B, int64_t P, int64_t S, const double *grid_h,
                   const double *grid_w, int64_t nw, int64_t n_x, const double *near, int64_t n, int64_t M,
                   int64_t *order, double *params, unsigned char *alive, double *out) {
    for (int64_t b = 0; b < B; b++) {
        const double *v = best + b * P * S;
        const int64_t *at = where + b * P * S;
        int64_t kept = 0;
        for (int64_t i = 0; i < P * S; i++) { /* the n lowest, sorted, by insertion */
            if (kept == n && !(v[i] < v[order[n - 1]])) continue;
            int64_t j = kept < n ? kept++ : n - 1;
            for (; j > 0 && v[i] < v[order[j - 1]]; j--) order[j] = order[j - 1];
            order[j] = i;
        }
        for (int64_t j = 0; j < kept; j++) {
            const int64_t pair = order[j] / S, shift = at[order[j]];
            double *q = params + 4 * j;
            q[0] = grid_h[pair / nw];
            q[1] = grid_w[pair % nw];
            q[2] = (double)(shift / n_x);
            q[3] = (double)(shift % n_x);
            alive[j] = isfinite(v[order[j]]) != 0;
        }
        for (int64_t k = 0; k < M; k++) {
            int64_t j = 0;
            while (j < kept && !alive[j]) j++;
            if (j == kept) j = 0;
            const double *q = params + 4 * j;
            memcpy(out + (b * M + k) * 4, q, sizeof(double) * 4);
            for (int64_t i = 0; i < kept; i++) {
                const double *r = params + 4 * i;
                if (fabs(r[0] - q[0]) <= near[0] && fabs(r[1] - q[1]) <= near[1] && fabs(r[2] - q[2]) <= near[2] &&
                    fabs(r[3] - q[3]) <= near[3])
                    alive[i] = 0;
            }
        }
    }
}

/* align's grid search: the cross term sum_{r,k} T(r, k) S(y + r, x + k) at every integer shift
 * (y, x) and every scale pair, for S = Ry X Rx^T, without S. A = Ry X (one per scale_h: rows x W)
 * is given; Rx has two taps per row (i0, i1 with weights w0, w1). Per scale_h and block of LANES
 * row shifts:
 *   P[W'][k][y] = sum_c sum_r A(y + r, W') T(r, k)        (vectors across y: A's columns, read
 *                                                         transposed once, slide under T)
 *   cross[sw][y][x] = sum_k w0 P[i0(sw, x + k)][k][y] + w1 P[i1(sw, x + k)][k][y]
 * Rx's taps take 2 w multiply-adds per output where a dense product with Rx takes W w. Sums run
 * in one fixed order (c, r; then k), the same on every CPU: the row shifts are vectors of the
 * level's own width (64 bytes on AVX-512, 32 on AVX, 16 below; 64-byte ones split by the
 * compiler went through the stack on AVX2, 6x slower), each lane one row shift's own
 * arithmetic, and the template's columns go CROSS_KB at a time through registers, which changes
 * no sum. Returns 1 where scratch could not be allocated. */
#if defined(__AVX512F__)
#define CROSS_BYTES 64
#elif defined(__AVX__)
#define CROSS_BYTES 32
#else
#define CROSS_BYTES 16
#endif
#define CROSS_KB 8

/* dm_align_search's operands: its sizes (int64), then its reals (double), in this order. The
 * binding (densematch/kernels/c_align.py: align_search) writes them in the same order. */
enum {
    S_B, S_C, S_H, S_W, S_BIG_H, S_BIG_W, /* pairs, channels, template and image sides */
    S_LEVELS, S_GRID_GIVEN, S_WT_SHARED,   /* pyramid levels; best and where given; one weight map */
    S_NH, S_ROWS, S_NW, S_COLS, S_NY, S_NX, S_K, /* the grid: Ry's and Rx's taps, shifts, minima kept */
    S_PICK, S_CANDIDATES, S_KEEP_FIRST, S_KEEP_NEXT, /* candidates: ranked, taken, kept after levels */
    S_OBJECTIVE, S_ITERATIONS,                      /* 0 l1, 1 l2, 2 ncc; refinement steps at most */
    S_COUNT
};
enum { R_RANGE = 0, R_NEAR = 4, R_SAME = 8, R_TOLERANCE = 10, R_COARSE_TOLERANCE = 11, R_FAR = 12, R_COUNT = 13 };

/* the level rule's band products: outputs of a row summed at a time (dm_align_band) */
#define BAND_J 16

/* out0[l] = sum_k a0[k] b[k stride + l] and out1 likewise from a1, for l < BAND_J, k < n ascending:
 * the BAND_J sums of two rows in vectors of four, each b row read once for both (b's rows start
 * anywhere: loaded through memcpy) */
typedef double band_v __attribute__((vector_size(32)));
static void band_rows(const double *a0, const double *a1, const double *b, int64_t stride, int64_t n, double *out0,
                      double *out1) {
    band_v s0[BAND_J / 4] = {{0}}, s1[BAND_J / 4] = {{0}};
    for (int64_t k = 0; k < n; k++) {
        const band_v x0 = {a0[k], a0[k], a0[k], a0[k]}, x1 = {a1[k], a1[k], a1[k], a1[k]};
        for (int l = 0; l < BAND_J / 4; l++) {
            band_v bl;
            memcpy(&bl, b + k * stride + 4 * l, sizeof bl);
            s0[l] += x0 * bl;
            s1[l] += x1 * bl;
        }
    }
    memcpy(out0, s0, sizeof s0);
    memcpy(out1, s1, sizeof s1);
}

/* lanes[0..7] added in one order: pairs, then pairs of pairs */
static inline double fold8(const double *lanes) {
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

/* sum a[i] b[i] (b NULL: ones) over n doubles, in eight lanes folded by fold8, the tail after */
static double band_sum(const double *a, const double *b, int64_t n) {
    double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += a[i + l] * (b ? b[i + l] : 1.0);
    double total = fold8(lanes);
    for (; i < n; i++) total += a[i] * (b ? b[i] : 1.0);
    return total;
}

/* the kernels for float, then for double (align_t.h) */
#define T float
#define SUF f32
#include "align_t.h"

#define T double
#define SUF f64
#include "align_t.h"
