/* align.c's grid-search kernels for one floating type, included by align.c once per type with T
 * (float, double) and SUF (f32, f64: DM_T(name) is name_SUF) defined; it undefines them at its
 * end. No include guard: each inclusion is one instance. */
#include "dm_template.h"

typedef T DM_T(cvec) __attribute__((vector_size(64)));
int DM_T(dm_align_cross)(const T *a, const T *t, const int64_t *i0, const int64_t *i1, const T *w0,
                         const T *w1, int64_t B, int64_t C, int64_t nh, int64_t rows, int64_t W, int64_t h,
                         int64_t w, int64_t nw, int64_t cols, int64_t ny, int64_t nx, T *out) {
    enum { L = 64 / sizeof(T), KB = CROSS_KB };
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
/* the parameters of this instance, so that the next one defines its own */
#undef T
#undef SUF
