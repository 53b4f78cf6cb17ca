/* certify_alignment's bound in C (densematch.alignment.certify): per cell of warp parameters, a
 * lower bound on the error of every fit inside it, summed row by row over the template and
 * stopped as soon as it passes the line the caller gives (a partial sum is already a bound).
 *
 * Template pixel (r, c) of a fit (scale_h, scale_w, shift_y, shift_x) samples the image
 * bilinearly at y = (r + shift_y + 0.5) / scale_h - 0.5, x likewise, clamped to the image. Cells
 * hold (scale_h, scale_w, centre_y, centre_x): the centres are where the template's pivot pixel
 * (pivot_y, pivot_x) lands, so y = (r - pivot_y) / scale_h + centre_y, and a scale's spread moves
 * a pixel by |r - pivot| / scale^2 per unit, at most half the template's side with the pivot in
 * its middle. Over a cell (centre +- half on each parameter) the coordinate is monotone in each
 * parameter, so the cell's corners give each row's and each column's interval of coordinates,
 * and each pixel samples from the box of their product. The range of the image over that box is taken either over every
 * whole pixel it touches ("pixel": cheap, wide) or as the bilinear interpolant's own range
 * ("exact": its extremes lie among the box's corners, the grid lines' crossings of its edges and
 * the grid points inside, so among the products of {lo, the integers between, hi} on each axis).
 * A pixel's term is its template value's distance to that range (squared for l2).
 *
 * Torch's path (certify.py: sample_spans, pixel_range, bilinear_range) computes the same ranges
 * from the same corners and taps; the two are compared in tests/alignment/test_certify.py. What is added
 * here is the row-by-row stop and no per-operation cost, which is what makes millions of small
 * cells affordable.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dm_abi.h"

/* the interval [lo, hi] of input coordinates output pixel i samples over a cell (centres scale,
 * centre: where the pivot pixel lands; half widths ds, dc), clamped to [0, n_in - 1], from the
 * four corners */
static inline void span(int64_t i, int64_t n_in, double pivot, double scale, double centre, double ds, double dc,
                        double *lo, double *hi) {
    double a = INFINITY, b = -INFINITY;
    const double es[2] = {-ds, ds}, ec[2] = {-dc, dc};
    for (int u = 0; u < 2; u++)
        for (int v = 0; v < 2; v++) {
            const double y = ((double)i - pivot) / (scale + es[u]) + (centre + ec[v]);
            a = y < a ? y : a;
            b = y > b ? y : b;
        }
    const double top = (double)(n_in - 1);
    *lo = a < 0 ? 0 : (a > top ? top : a);
    *hi = b < 0 ? 0 : (b > top ? top : b);
}

/* the points {lo, the integers strictly between, hi} of an interval as bilinear taps, K of them
 * at stride n (the last repeated past the interval's own count: the same extremes), by
 * warp.taps_at's rule: i0 = min(floor(p), n_in - 2), i1 = min(i0 + 1, n_in - 1) */
static inline void points(double lo, double hi, int64_t n_in, int64_t K, int64_t n, int64_t *i0, int64_t *i1,
                          double *g0, double *g1) {
    const double base = floor(lo), top = (double)(n_in > 2 ? n_in - 2 : 0);
    for (int64_t a = 0; a < K; a++) {
        double p = base + (double)a;
        p = p < lo ? lo : (p > hi ? hi : p);
        const double f0 = floor(p) > top ? top : floor(p);
        const int64_t o = a * n;
        i0[o] = (int64_t)f0;
        i1[o] = i0[o] + 1 < n_in ? i0[o] + 1 : n_in - 1;
        g1[o] = p - f0;
        g0[o] = 1 - g1[o];
    }
}

static inline double term(double t, double lo, double hi, int squared) {
    const double gap = (lo - t > 0 ? lo - t : 0) + (t - hi > 0 ? t - hi : 0);
    return squared ? gap * gap : gap;
}

/* Vectors of this level's native width, DM_SUB of them to 8 columns: wider ones, split by the
 * compiler, went through the stack on AVX2 (6x slower there). Min and max in one instruction
 * where the level has it, the same lanes as the portable compare and pick elsewhere (the second
 * operand where the first is not below / above it), so the same bits on every level. */
#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
typedef double dm_vd __attribute__((vector_size(64)));
#define DM_MIN(a, b) ((dm_vd)_mm512_min_pd((__m512d)(a), (__m512d)(b)))
#define DM_MAX(a, b) ((dm_vd)_mm512_max_pd((__m512d)(a), (__m512d)(b)))
#elif defined(__AVX__)
typedef double dm_vd __attribute__((vector_size(32)));
#define DM_MIN(a, b) ((dm_vd)_mm256_min_pd((__m256d)(a), (__m256d)(b)))
#define DM_MAX(a, b) ((dm_vd)_mm256_max_pd((__m256d)(a), (__m256d)(b)))
#elif defined(__SSE2__)
typedef double dm_vd __attribute__((vector_size(16)));
#define DM_MIN(a, b) ((dm_vd)_mm_min_pd((__m128d)(a), (__m128d)(b)))
#define DM_MAX(a, b) ((dm_vd)_mm_max_pd((__m128d)(a), (__m128d)(b)))
#else
typedef double dm_vd __attribute__((vector_size(16)));
typedef int64_t dm_vi __attribute__((vector_size(16)));
#define DM_PICK(m, a, b) ((dm_vd)(((m) & (dm_vi)(a)) | (~(m) & (dm_vi)(b))))
#define DM_MIN(a, b) DM_PICK((a) < (b), a, b)
#define DM_MAX(a, b) DM_PICK((a) > (b), a, b)
#endif
enum { DM_LANES = sizeof(dm_vd) / sizeof(double), DM_SUB = 8 / DM_LANES };

/* One template row's terms in the exact range: each pixel's extremes among its ky x K points
 * (the image along x at point a of column j, at a w + j of each row of along; rows yi0[b],
 * yi1[b] blended by yg0[b], yg1[b] at point b along y), kept in registers 8 columns at a time;
 * a point b on a whole image row (pure[b], the row; -1 where blended) takes that row's extremes
 * over the K points, made once in ext (row r's minima at r 2 w, maxima after): the same
 * extremes, one load instead of K. The terms summed in 8 lanes, then folded in one fixed order,
 * then the columns left over. */
static inline double exact_row(const double *along, const double *ext, int64_t w, int64_t K, int64_t ky,
                               const int64_t *yi0, const int64_t *yi1, const double *yg0, const double *yg1,
                               const int64_t *pure, const double *t, int squared) {
    const int64_t stride = w * K;
    double sums[8] = {0}; /* the lanes' sums, in memory: the block's extremes keep the registers */
    const dm_vd zero = {0};
    int64_t j = 0;
    for (; j + 8 <= w; j += 8) {
        dm_vd lo[DM_SUB], hi[DM_SUB];
        for (int s = 0; s < DM_SUB; s++) {
            lo[s] = zero + INFINITY;
            hi[s] = zero - INFINITY;
        }
        for (int64_t b = 0; b < ky; b++) {
            if (pure[b] >= 0) { /* a whole image row: its extremes over the points, made once */
                const double *e = ext + pure[b] * 2 * w + j;
                for (int s = 0; s < DM_SUB; s++) {
                    dm_vd u, v;
                    memcpy(&u, e + s * DM_LANES, sizeof u);
                    memcpy(&v, e + w + s * DM_LANES, sizeof v);
                    lo[s] = DM_MIN(u, lo[s]);
                    hi[s] = DM_MAX(v, hi[s]);
                }
                continue;
            }
            const double *r0 = along + yi0[b] * stride + j, *r1 = along + yi1[b] * stride + j;
            const double g0 = yg0[b], g1 = yg1[b];
            for (int64_t a = 0; a < K; a++)
                for (int s = 0; s < DM_SUB; s++) {
                    dm_vd p0, p1;
                    memcpy(&p0, r0 + a * w + s * DM_LANES, sizeof p0);
                    memcpy(&p1, r1 + a * w + s * DM_LANES, sizeof p1);
                    const dm_vd v = p0 * g0 + p1 * g1;
                    lo[s] = DM_MIN(v, lo[s]);
                    hi[s] = DM_MAX(v, hi[s]);
                }
        }
        for (int s = 0; s < DM_SUB; s++) {
            dm_vd tv, acc;
            memcpy(&tv, t + j + s * DM_LANES, sizeof tv);
            memcpy(&acc, sums + s * DM_LANES, sizeof acc);
            const dm_vd gap = DM_MAX(lo[s] - tv, zero) + DM_MAX(tv - hi[s], zero);
            acc += squared ? gap * gap : gap;
            memcpy(sums + s * DM_LANES, &acc, sizeof acc);
        }
    }
    double total = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
    if (j + 4 <= w) { /* four columns left (100 = 12 x 8 + 4): one vector of four, its lanes folded */
        typedef double v4 __attribute__((vector_size(32)));
        typedef int64_t v4i __attribute__((vector_size(32)));
        const v4 none = {0, 0, 0, 0};
        v4 lo = none + INFINITY, hi = none - INFINITY, tv;
        for (int64_t b = 0; b < ky; b++) {
            const double *r0 = along + yi0[b] * stride + j, *r1 = along + yi1[b] * stride + j;
            const double g0 = yg0[b], g1 = yg1[b];
            for (int64_t a = 0; a < (pure[b] >= 0 ? 1 : K); a++) {
                v4 v, u;
                if (pure[b] >= 0) { /* the row's extremes over the points */
                    memcpy(&v, ext + pure[b] * 2 * w + j, sizeof v);
                    memcpy(&u, ext + pure[b] * 2 * w + w + j, sizeof u);
                } else {
                    v4 p0, p1;
                    memcpy(&p0, r0 + a * w, sizeof p0);
                    memcpy(&p1, r1 + a * w, sizeof p1);
                    v = u = p0 * g0 + p1 * g1;
                }
                const v4i below = v < lo, above = u > hi; /* the lanes' min and max as DM_MIN and DM_MAX pick */
                lo = (v4)((below & (v4i)v) | (~below & (v4i)lo));
                hi = (v4)((above & (v4i)u) | (~above & (v4i)hi));
            }
        }
        memcpy(&tv, t + j, sizeof tv);
        const v4 under = lo - tv, over = tv - hi;
        const v4 gap = (v4)((v4i)(under > none) & (v4i)under) + (v4)((v4i)(over > none) & (v4i)over);
        const v4 terms = squared ? gap * gap : gap;
        total += (terms[0] + terms[1]) + (terms[2] + terms[3]);
        j += 4;
    }
    for (; j < w; j++) {
        double lo = INFINITY, hi = -INFINITY;
        for (int64_t b = 0; b < ky; b++) {
            if (pure[b] >= 0) {
                const double u = ext[pure[b] * 2 * w + j], v = ext[pure[b] * 2 * w + w + j];
                lo = u < lo ? u : lo;
                hi = v > hi ? v : hi;
                continue;
            }
            for (int64_t a = 0; a < K; a++) {
                const double v = along[yi0[b] * stride + a * w + j] * yg0[b] + along[yi1[b] * stride + a * w + j] * yg1[b];
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
        }
        total += term(t[j], lo, hi, squared);
    }
    return total;
}

/* Sums over the template's rows (in the order given) and channels of each cell's terms, into
 * out[m]; a cell stops at the first row after which its sum exceeds stop. image (C, H, W),
 * template (C, h, w), cells (M, 4) centres (scale_h, scale_w, centre_y, centre_x), half (4),
 * pivot (2: the template pixel the centres place).
 *
 * With floors (M, n_rows), in the rows' order: a lower bound per cell and row (its parent's
 * row sums: a cell inside another samples each pixel from a box inside the other's, so each of
 * its terms is at least the other's). A cell's sum then starts at its floors' and each row
 * computed replaces its floor, so that the rows not reached still count: a cell whose parent's
 * sum came within a hair of stop passes it after the few rows where it differs, not after all.
 * With row_sums (M, n_rows): each row's sum, its floor (or 0) where the cell stopped before it,
 * the floors of the cell's own children. Returns 1 where its scratch cannot be allocated. */
int dm_certify_bound(const double *image, const double *tpl, int64_t C, int64_t h, int64_t w, int64_t H,
                     int64_t W, const double *cells, int64_t M, const double *half, const double *pivot,
                     const int64_t *rows, int64_t n_rows, int exact, int squared, double stop, const double *floors,
                     double *out, double *row_sums) {
    const int64_t KX = W + 2, KY = H + 2; /* the most points an interval can hold */
    double *xlo = malloc(sizeof(double) * (size_t)(2 * w + 2 * w * KX + 2 * KY));
    int64_t *xi = malloc(sizeof(int64_t) * (size_t)(2 * w * KX + 3 * KY));
    /* exact: C H w K values, the image along x at each column's points (grown to the most points
     * a cell needs), then ext: C H 2 w, each image row's extremes over each column's points, or
     * with whole pixels over each column's box */
    double *along = NULL, *ext = NULL;
    int64_t along_k = 0;
    char *ready = malloc((size_t)(C * H) + 1);
    if (!xlo || !xi || !ready) {
        free(xlo);
        free(xi);
        free(ready);
        return 1;
    }
    double *xhi = xlo + w, *xg0 = xhi + w, *xg1 = xg0 + w * KX;
    double *yg0 = xg1 + w * KX, *yg1 = yg0 + KY;
    int64_t *xi0 = xi, *xi1 = xi0 + w * KX, *yi0 = xi1 + w * KX, *yi1 = yi0 + KY, *pure = yi1 + KY;
    int64_t K = 1; /* points per column */
    for (int64_t m = 0; m < M; m++) {
        const double *cell = cells + 4 * m;
        /* cells in a row with the same scale_w and shift_x (siblings, as certify.py orders
         * them) share their columns' boxes, and the image along x at their points */
        const double *before = m > 0 ? cell - 4 : NULL;
        if (!before || cell[1] != before[1] || cell[3] != before[3]) {
            K = 1;
            for (int64_t j = 0; j < w; j++) {
                span(j, W, pivot[1], cell[1], cell[3], half[1], half[3], xlo + j, xhi + j);
                const int64_t f = (int64_t)floor(xlo[j]), l = (int64_t)ceil(xhi[j]);
                K = l - f + 1 > K ? l - f + 1 : K;
                if (!exact) /* whole pixels: the columns xi0[j] .. xi1[j] */
                    xi0[j] = f, xi1[j] = l < W - 1 ? l : W - 1;
            }
            const int64_t room = exact ? K + 2 : 2;
            if (room > along_k) {
                free(along);
                along = malloc(sizeof(double) * (size_t)(C * H * w * room));
                along_k = room;
                if (!along) {
                    free(xlo);
                    free(xi);
                    free(ready);
                    return 1;
                }
            }
            if (exact) /* point a of column j at a * w + j: the loops below run along the columns */
                for (int64_t j = 0; j < w; j++) points(xlo[j], xhi[j], W, K, w, xi0 + j, xi1 + j, xg0 + j, xg1 + j);
            ext = along + (exact ? C * H * w * K : 0);
            for (int64_t r = 0; r < C * H; r++) ready[r] = 0;
        }
        const double *floor_m = floors ? floors + m * n_rows : NULL;
        double *sums_m = row_sums ? row_sums + m * n_rows : NULL;
        double total = 0;
        if (floor_m)
            for (int64_t q = 0; q < n_rows; q++) total += floor_m[q];
        if (sums_m)
            for (int64_t q = 0; q < n_rows; q++) sums_m[q] = floor_m ? floor_m[q] : 0;
        for (int64_t q = 0; q < n_rows && !(total > stop); q++) {
            const int64_t i = rows[q];
            double row = 0, ylo, yhi;
            span(i, H, pivot[0], cell[0], cell[2], half[0], half[2], &ylo, &yhi);
            for (int64_t ch = 0; ch < C; ch++) {
                const double *img = image + ch * H * W, *t = tpl + (ch * h + i) * w;
                if (exact) {
                    const int64_t ky = (int64_t)(ceil(yhi) - floor(ylo)) + 1;
                    points(ylo, yhi, H, ky, 1, yi0, yi1, yg0, yg1);
                    for (int64_t b = 0; b < ky; b++) {
                        /* a point on a whole row (a weight 0 on the other) samples that row alone */
                        pure[b] = yg1[b] == 0 ? yi0[b] : (yg0[b] == 0 ? yi1[b] : -1);
                        const int64_t rr[2] = {yi0[b], yi1[b]};
                        for (int e = 0; e < 2; e++) /* the image along x at the points, once per row and cell */
                            if (!ready[ch * H + rr[e]]) {
                                const double *src = img + rr[e] * W;
                                double *dst = along + (ch * H + rr[e]) * w * K, *lo = ext + (ch * H + rr[e]) * 2 * w;
                                for (int64_t o = 0; o < w * K; o++) dst[o] = src[xi0[o]] * xg0[o] + src[xi1[o]] * xg1[o];
                                memcpy(lo, dst, sizeof(double) * (size_t)w); /* the row's extremes over the points */
                                memcpy(lo + w, dst, sizeof(double) * (size_t)w);
                                for (int64_t a = 1; a < K; a++)
                                    for (int64_t j = 0; j < w; j++) {
                                        const double v = dst[a * w + j];
                                        lo[j] = v < lo[j] ? v : lo[j];
                                        lo[w + j] = v > lo[w + j] ? v : lo[w + j];
                                    }
                                ready[ch * H + rr[e]] = 1;
                            }
                    }
                    row += exact_row(along + (ch * H) * w * K, ext + ch * H * 2 * w, w, K, ky, yi0, yi1, yg0, yg1,
                                     pure, t, squared);
                } else {
                    /* every whole pixel the box touches: each image row's extremes over the
                     * columns' boxes (once per row and siblings), then over the box's rows */
                    const int64_t r0 = (int64_t)floor(ylo), r_end = (int64_t)ceil(yhi);
                    const int64_t r1 = r_end < H - 1 ? r_end : H - 1;
                    double *lo = xg0, *hi = xg1; /* scratch: w values each */
                    for (int64_t r = r0; r <= r1; r++) {
                        double *rmin = ext + (ch * H + r) * 2 * w, *rmax = rmin + w;
                        if (!ready[ch * H + r]) {
                            const double *src = img + r * W;
                            for (int64_t j = 0; j < w; j++) {
                                double a = src[xi0[j]], b = a;
                                for (int64_t c = xi0[j] + 1; c <= xi1[j]; c++) {
                                    a = src[c] < a ? src[c] : a;
                                    b = src[c] > b ? src[c] : b;
                                }
                                rmin[j] = a;
                                rmax[j] = b;
                            }
                            ready[ch * H + r] = 1;
                        }
                        if (r == r0) {
                            memcpy(lo, rmin, sizeof(double) * (size_t)w);
                            memcpy(hi, rmax, sizeof(double) * (size_t)w);
                            continue;
                        }
                        int64_t j = 0;
                        for (; j + DM_LANES <= w; j += DM_LANES) {
                            dm_vd a, b, u, v;
                            memcpy(&a, rmin + j, sizeof a);
                            memcpy(&b, rmax + j, sizeof b);
                            memcpy(&u, lo + j, sizeof u);
                            memcpy(&v, hi + j, sizeof v);
                            u = DM_MIN(a, u);
                            v = DM_MAX(b, v);
                            memcpy(lo + j, &u, sizeof u);
                            memcpy(hi + j, &v, sizeof v);
                        }
                        for (; j < w; j++) {
                            lo[j] = rmin[j] < lo[j] ? rmin[j] : lo[j];
                            hi[j] = rmax[j] > hi[j] ? rmax[j] : hi[j];
                        }
                    }
                    double s = 0;
                    for (int64_t j = 0; j < w; j++) s += term(t[j], lo[j], hi[j], squared);
                    row += s;
                }
            }
            total += floor_m ? row - floor_m[q] : row;
            if (sums_m) sums_m[q] = row;
        }
        out[m] = total;
    }
    free(xlo);
    free(xi);
    free(along);
    free(ready);
    return 0;
}
