/* densematch's CPU kernels, in plain C for one thread: l1 and linf distances between the rows of
 * Y (F x D) and the columns of X (D x P) and their gradients, the elementwise passes around the
 * matrix product of l2 distances, the engine's tile merge with its candidate listing (float32 /
 * float64 scores, and the certified bfloat16 step), and the values of chosen row pairs. densematch.kernels.native compiles this file once per
 * machine and calls it through ctypes (which lets go of the GIL), one tile per worker thread.
 *
 * The forward keeps a block of FB rows of Y by PB columns of X in registers as accumulators and
 * walks D once: per step one load of X's PB values, FB broadcasts of Y, and FB * PB
 * subtract-absolute-accumulate, vectorised across columns (pixels). torch.cdist's kernel instead
 * reduces over D one pair at a time.
 *
 * Sums run over d = 0 .. D-1 in that order for every pair, however the work is tiled or threaded,
 * so a distance does not depend on the tile it was computed in.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dm_abi.h"

/* the declarations this library was built with (dm_abi.h); the loader compares */
int64_t dm_abi_version(void) { return DM_ABI_VERSION; }

#if defined(__AVX__)
#include <immintrin.h>
#endif

#define FB 4

/* Lanes of 32 bytes (one AVX2 register, two SSE or NEON ones) as GCC / Clang vector extensions,
 * for the loops the compiler's own vectoriser leaves scalar or keeps in memory. */
#define DEFINE_VECTORS(T, I, SUF)                                                                  \
    typedef T vec_##SUF __attribute__((vector_size(32)));                                          \
    typedef I mask_##SUF __attribute__((vector_size(32)));                                         \
    static inline vec_##SUF load_##SUF(const T *p) {                                               \
        vec_##SUF v;                                                                               \
        memcpy(&v, p, sizeof v);                                                                   \
        return v;                                                                                  \
    }                                                                                              \
    static inline void store_##SUF(T *p, vec_##SUF v) { memcpy(p, &v, sizeof v); }                 \
    static inline vec_##SUF pick_##SUF(mask_##SUF m, vec_##SUF a, vec_##SUF b) {                   \
        return (vec_##SUF)(((mask_##SUF)a & m) | ((mask_##SUF)b & ~m));                            \
    }                                                                                              \
    /* the sign bit cleared, as fabs does (one AND) */                                             \
    static inline vec_##SUF vabs_##SUF(vec_##SUF v) {                                              \
        const I body = (I)(~0ULL >> (65 - 8 * sizeof(T)));                                         \
        return (vec_##SUF)((mask_##SUF)v & body);                                                  \
    }

DEFINE_VECTORS(float, int32_t, f32)
DEFINE_VECTORS(double, int64_t, f64)
typedef uint64_t lanes64 __attribute__((vector_size(32))); /* any mask, as four words */
#define STEP(T) (2 * (int64_t)(32 / sizeof(T))) /* values per step: two vectors */

#define DEFINE_KERNELS(T, SUF, PB, ABS)                                                            \
    /* acc[i][j] over d for rows y0..y0+FB-1 and the PB columns at x (row stride ldx): PB is two   \
     * vectors, so the FB x 2 accumulators stay in registers (GCC kept the scalar form's in        \
     * memory, a load and a store per step) */                                                     \
    static inline __attribute__((always_inline)) void block_##SUF(                                 \
        const T *y, int64_t ldy, int nf, const T *x, int64_t ldx, int64_t D, int linf, T acc[FB][PB]) {     \
        enum { HALF = PB / 2 };                                                                    \
        const T *yr[FB];                                                                           \
        for (int i = 0; i < FB; i++) yr[i] = y + (i < nf ? i : nf - 1) * ldy;                      \
        vec_##SUF v[FB][2];                                                                        \
        for (int i = 0; i < FB; i++) v[i][0] = v[i][1] = (vec_##SUF){};                            \
        if (linf) {                                                                                \
            for (int64_t d = 0; d < D; d++) {                                                         \
                const vec_##SUF x0 = load_##SUF(x + d * ldx), x1 = load_##SUF(x + d * ldx + HALF); \
                for (int i = 0; i < FB; i++) {                                                     \
                    const vec_##SUF a0 = vabs_##SUF(x0 - yr[i][d]), a1 = vabs_##SUF(x1 - yr[i][d]); \
                    v[i][0] = pick_##SUF((a0 > v[i][0]) | (a0 != a0), a0, v[i][0]);                \
                    v[i][1] = pick_##SUF((a1 > v[i][1]) | (a1 != a1), a1, v[i][1]);                \
                }                                                                                  \
            }                                                                                      \
        } else {                                                                                   \
            for (int64_t d = 0; d < D; d++) {                                                         \
                const vec_##SUF x0 = load_##SUF(x + d * ldx), x1 = load_##SUF(x + d * ldx + HALF); \
                for (int i = 0; i < FB; i++) {                                                     \
                    v[i][0] += vabs_##SUF(x0 - yr[i][d]);                                          \
                    v[i][1] += vabs_##SUF(x1 - yr[i][d]);                                          \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < FB; i++) {                                                             \
            store_##SUF(acc[i], v[i][0]);                                                          \
            store_##SUF(acc[i] + HALF, v[i][1]);                                                   \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* out[f * osf + p * osp] = scale * (sum or max over d of |x[d * ldx + p] - y[f * ldy + d]|).  \
     * Returns 0, or -1 when scratch memory ran out. */                                            \
    int dm_minkowski_##SUF(const T *y, int64_t ldy, const T *x, int64_t ldx, T *out, int64_t osf, int64_t osp, \
                           int64_t F, int64_t D, int64_t P, int linf, double scale) {                       \
        T acc[FB][PB];                                                                             \
        T *pad = NULL;                                                                             \
        for (int64_t p0 = 0; p0 < P; p0 += PB) {                                                      \
            const int pn = P - p0 < PB ? (int)(P - p0) : PB;                                       \
            const T *xb = x + p0;                                                                  \
            int64_t ld = ldx;                                                                         \
            if (pn < PB) { /* the last columns, copied into a zero-padded block */                 \
                pad = calloc((size_t)D * PB, sizeof(T));                                           \
                if (pad == NULL) return -1;                                                        \
                for (int64_t d = 0; d < D; d++) memcpy(pad + d * PB, x + d * ldx + p0, pn * sizeof(T)); \
                xb = pad;                                                                          \
                ld = PB;                                                                           \
            }                                                                                      \
            for (int64_t f0 = 0; f0 < F; f0 += FB) {                                                  \
                const int nf = F - f0 < FB ? (int)(F - f0) : FB;                                   \
                block_##SUF(y + f0 * ldy, ldy, nf, xb, ld, D, linf, acc);                          \
                for (int i = 0; i < nf; i++) {                                                     \
                    T *o = out + (f0 + i) * osf + p0 * osp;                                        \
                    for (int j = 0; j < pn; j++) o[j * osp] = (T)scale * acc[i][j];                \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        free(pad);                                                                                 \
        return 0;                                                                                  \
    }                                                                                              \
                                                                                                   \
    /* g with the sign of diff (0 where diff is 0 or NaN); for linf only where |diff| reaches      \
     * the distance dv */                                                                          \
    static inline __attribute__((always_inline)) T weight_##SUF(T diff, T gv, T dv, int linf) {    \
        const T s = diff > 0 ? gv : (diff < 0 ? -gv : 0);                                          \
        return linf ? (ABS(diff) == dv ? s : 0) : s;                                               \
    }                                                                                              \
    static inline __attribute__((always_inline)) vec_##SUF weights_##SUF(                          \
        vec_##SUF diff, vec_##SUF gv, vec_##SUF dv, int linf) {                                    \
        const mask_##SUF sign = (mask_##SUF)diff ^ (mask_##SUF)vabs_##SUF(diff);                   \
        mask_##SUF keep = (diff > 0) | (diff < 0);                                                 \
        if (linf) keep &= vabs_##SUF(diff) == dv;                                                  \
        return (vec_##SUF)(((mask_##SUF)gv ^ sign) & keep);                                        \
    }                                                                                              \
                                                                                                   \
    /* The gradients of sum_{f,p} g[f, p] * dist(f, p), with dist from the forward:                \
     *   gx[d * ldgx + p] = sum_f g[f, p] * w(f, d, p)   (written)                                 \
     *   gy[f * ldgy + d] -= sum_p g[f, p] * w(f, d, p)  (accumulated)                             \
     * where w = sign(x - y) for l1, and for linf sign(x - y) where |x - y| equals the distance    \
     * (every such d, as torch.cdist's gradient does), else 0. g and dist: (F, P), row stride ldg. \
     * Sums run in one order: gx over f, gy over p in lanes of PB then the lanes in order.         \
     */                                                                                            \
    void dm_minkowski_grad_##SUF(const T *y, int64_t ldy, const T *x, int64_t ldx, const T *g,           \
                                 const T *dist, int64_t ldg, T *gx, int64_t ldgx, T *gy, int64_t ldgy,      \
                                 int64_t F, int64_t D, int64_t P, int linf) {                               \
        enum { HALF = PB / 2 };                                                                    \
        const int64_t full = P - P % PB;                                                              \
        const vec_##SUF zero = {};                                                                 \
        for (int64_t d = 0; d < D; d++) {                                                             \
            const T *xr = x + d * ldx;                                                             \
            T *gxr = gx + d * ldgx;                                                                \
            for (int64_t p = 0; p < P; p++) gxr[p] = 0;                                               \
            for (int64_t f0 = 0; f0 < F; f0 += FB) {                                                  \
                const int nf = F - f0 < FB ? (int)(F - f0) : FB;                                   \
                vec_##SUF part[FB][2];                                                             \
                T yv[FB];                                                                          \
                const T *gr[FB], *dr[FB];                                                          \
                for (int i = 0; i < FB; i++) {                                                     \
                    const int64_t f = f0 + (i < nf ? i : nf - 1);                                     \
                    yv[i] = y[f * ldy + d];                                                        \
                    gr[i] = g + f * ldg;                                                           \
                    dr[i] = dist + f * ldg;                                                        \
                    part[i][0] = part[i][1] = zero;                                                \
                }                                                                                  \
                for (int64_t p0 = 0; p0 < full; p0 += PB) {                                           \
                    const vec_##SUF x0 = load_##SUF(xr + p0), x1 = load_##SUF(xr + p0 + HALF);     \
                    vec_##SUF acc0 = load_##SUF(gxr + p0), acc1 = load_##SUF(gxr + p0 + HALF);     \
                    _Pragma("GCC unroll 4") for (int i = 0; i < FB; i++) {                         \
                        if (i >= nf) break;                                                        \
                        const T *gi = gr[i] + p0, *di = dr[i] + p0;                                \
                        const vec_##SUF s0 = weights_##SUF(x0 - yv[i], load_##SUF(gi),             \
                                                           linf ? load_##SUF(di) : zero, linf);    \
                        const vec_##SUF s1 = weights_##SUF(x1 - yv[i], load_##SUF(gi + HALF),      \
                                                           linf ? load_##SUF(di + HALF) : zero, linf); \
                        part[i][0] += s0;                                                          \
                        part[i][1] += s1;                                                          \
                        acc0 += s0;                                                                \
                        acc1 += s1;                                                                \
                    }                                                                              \
                    store_##SUF(gxr + p0, acc0);                                                   \
                    store_##SUF(gxr + p0 + HALF, acc1);                                            \
                }                                                                                  \
                for (int i = 0; i < nf; i++) {                                                     \
                    T sum = 0;                                                                     \
                    for (int h = 0; h < 2; h++)                                                    \
                        for (int j = 0; j < HALF; j++) sum += part[i][h][j];                       \
                    for (int64_t p = full; p < P; p++) {                                              \
                        const T s = weight_##SUF(xr[p] - yv[i], gr[i][p], linf ? dr[i][p] : 0, linf); \
                        gxr[p] += s;                                                               \
                        sum += s;                                                                  \
                    }                                                                              \
                    gy[(f0 + i) * ldgy + d] -= sum;                                                \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

/* l2 after its matrix product: t[f, p] (row stride ldt) holds p_f.x_p, rows[f] ||p_f||^2 and
 * cols[p] ||x_p||^2. Writes v = max(rows - 2 t + cols, 0), or its square root (root), to
 * out[f * osf + p * osp], and each column's smallest v (before clamping) to colmin[p], for the
 * caller to recompute the columns whose expansion lost too many digits. One pass instead of five.
 */
#define DEFINE_L2(T, SUF, SQRT)                                                                    \
    static inline __attribute__((always_inline)) void finish_row_##SUF(                            \
        const T *tr, T rv, const T *cols, T *o, int64_t osp, int64_t P, int root, T *colmin) {           \
        for (int64_t p = 0; p < P; p++) {                                                             \
            const T v = (rv - 2 * tr[p]) + cols[p];                                                \
            colmin[p] = colmin[p] < v ? colmin[p] : v;                                             \
            const T c = v < 0 ? 0 : v; /* NaN stays */                                             \
            o[p * osp] = root ? SQRT(c) : c;                                                       \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* out[p] = sum over d of x[d * ldx + p]^2, in that order */                                   \
    void dm_sqnorms_##SUF(const T *x, int64_t ldx, T *out, int64_t D, int64_t P) {                          \
        for (int64_t p = 0; p < P; p++) out[p] = 0;                                                   \
        for (int64_t d = 0; d < D; d++) {                                                             \
            const T *xr = x + d * ldx;                                                             \
            for (int64_t p = 0; p < P; p++) out[p] += xr[p] * xr[p];                                  \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void dm_l2_finish_##SUF(const T *t, int64_t ldt, const T *rows, const T *cols, T *out, int64_t osf,  \
                            int64_t osp, int64_t F, int64_t P, int root, T *colmin) {                       \
        for (int64_t p = 0; p < P; p++) colmin[p] = INFINITY;                                         \
        for (int64_t f = 0; f < F; f++) {                                                             \
            /* constant arguments let each call be specialised and vectorised */                   \
            if (osp == 1 && root)                                                                  \
                finish_row_##SUF(t + f * ldt, rows[f], cols, out + f * osf, 1, P, 1, colmin);      \
            else if (osp == 1)                                                                     \
                finish_row_##SUF(t + f * ldt, rows[f], cols, out + f * osf, 1, P, 0, colmin);      \
            else                                                                                   \
                finish_row_##SUF(t + f * ldt, rows[f], cols, out + f * osf, osp, P, root, colmin); \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* The backward's pair weights: w = g / dist, 0 where dist is 0 (root), or w = g (squared),    \
     * into w (F x P, contiguous), with their sums per column (colsum) and per row (rowsum). g and \
     * dist may have any strides (an expanded gradient has stride 0). */                           \
    static inline __attribute__((always_inline)) T weights_row_##SUF(                              \
        const T *gr, int64_t gsp, const T *dr, int64_t dsp, T *wr, T *colsum, int64_t P, int root) {        \
        T part[16] = {0};                                                                          \
        int64_t p = 0;                                                                                \
        for (; p + 16 <= P; p += 16)                                                               \
            for (int j = 0; j < 16; j++) {                                                         \
                const T gv = gr[(p + j) * gsp], dv = dr[(p + j) * dsp];                            \
                /* the division always runs (on 1 where dist is 0), so that it vectorises */       \
                const T v = root ? (dv == 0 ? 0 : gv / (dv == 0 ? 1 : dv)) : gv;                   \
                wr[p + j] = v;                                                                     \
                colsum[p + j] += v;                                                                \
                part[j] += v;                                                                      \
            }                                                                                      \
        T sum = 0;                                                                                 \
        for (int j = 0; j < 16; j++) sum += part[j];                                               \
        for (; p < P; p++) {                                                                       \
            const T gv = gr[p * gsp], dv = dr[p * dsp];                                            \
            const T v = root ? (dv == 0 ? 0 : gv / dv) : gv;                                       \
            wr[p] = v;                                                                             \
            colsum[p] += v;                                                                        \
            sum += v;                                                                              \
        }                                                                                          \
        return sum;                                                                                \
    }                                                                                              \
                                                                                                   \
    void dm_l2_weights_##SUF(const T *g, int64_t gsf, int64_t gsp, const T *dist, int64_t dsf, int64_t dsp,    \
                             T *w, T *colsum, T *rowsum, int64_t F, int64_t P, int root) {               \
        for (int64_t p = 0; p < P; p++) colsum[p] = 0;                                                \
        for (int64_t f = 0; f < F; f++) {                                                             \
            const T *gr = g + f * gsf, *dr = dist + f * dsf;                                       \
            T *wr = w + f * P;                                                                     \
            /* constant arguments specialise the common cases: contiguous gradients, and the       \
             * expanded one of a sum (stride 0) */                                                 \
            if (gsp == 1 && dsp == 1 && root)                                                      \
                rowsum[f] = weights_row_##SUF(gr, 1, dr, 1, wr, colsum, P, 1);                     \
            else if (gsp == 0 && dsp == 1 && root)                                                 \
                rowsum[f] = weights_row_##SUF(gr, 0, dr, 1, wr, colsum, P, 1);                     \
            else if (gsp == 1 && dsp == 1)                                                         \
                rowsum[f] = weights_row_##SUF(gr, 1, dr, 1, wr, colsum, P, 0);                     \
            else if (gsp == 0 && dsp == 1)                                                         \
                rowsum[f] = weights_row_##SUF(gr, 0, dr, 1, wr, colsum, P, 0);                     \
            else                                                                                   \
                rowsum[f] = weights_row_##SUF(gr, gsp, dr, dsp, wr, colsum, P, root);              \
        }                                                                                          \
    }

DEFINE_KERNELS(float, f32, STEP(float), fabsf)
DEFINE_KERNELS(double, f64, STEP(double), fabs)
DEFINE_L2(float, f32, sqrtf)
DEFINE_L2(double, f64, sqrt)

/* One score tile merged into the running top-k of its rows, for the engine's search on a CPU.
 *
 * s: (m, n) scores, higher is better, row stride lds, columns offset + 0 .. n-1. best_v / best_i:
 * (m, k) contiguous, each row's best first; empty slots hold -inf and -1. Equal scores go to the
 * lower column, whatever order the tiles come in. A chunk of four vectors of scores (32 floats, 16
 * doubles) is tested with vector compares and looked at one by one only when one of them reaches
 * the row's k-th best, which after the first tiles is rare.
 *
 * With a margin (m,), the certified search's candidates are listed too: every (column, score)
 * reaching the row's running floor, its k-th best minus the margin, goes to the row's cap slots
 * (cand_cols / cand_vals, (m, cap), counts (m,)). A full row is pruned against its floor; a row
 * still full is marked over (over[r] = 1) and lists no more (the caller lists it again). The
 * floor only rises, so every pair reaching the final floor is listed, unless its row is over.
 */
#define DEFINE_MERGE(T, SUF)                                                                       \
    enum { CHUNK_##SUF = (int)(2 * STEP(T)) }; /* values per chunk: four vectors */                \
    static inline int better_##SUF(T v, int64_t i, T w, int64_t j) { return v > w || (v == w && i < j); } \
    /* list the pair (idx, v) in a row's candidate slots (cap of them, *count used): a full list   \
     * keeps only what still reaches floor, and a row whose every slot still does is marked over.  \
     * Returns whether the row goes on listing. */                                                 \
    static inline int list_##SUF(int64_t *cc, T *cv, int *count, int64_t cap, unsigned char *over, T floor,\
                                 int64_t idx, T v) {                                                  \
        if (*count == cap) {                                                                       \
            int kept = 0;                                                                          \
            for (int t = 0; t < cap; t++)                                                          \
                if (cv[t] >= floor) {                                                              \
                    cc[kept] = cc[t];                                                              \
                    cv[kept] = cv[t];                                                              \
                    kept++;                                                                        \
                }                                                                                  \
            *count = kept;                                                                         \
            if (kept == cap) {                                                                     \
                *over = 1;                                                                         \
                return 0;                                                                          \
            }                                                                                      \
        }                                                                                          \
        cc[*count] = idx;                                                                          \
        cv[*count] = v;                                                                            \
        (*count)++;                                                                                \
        return 1;                                                                                  \
    }                                                                                              \
    /* (v, idx) into a row's running top-k (bv, bi; best first) if it beats the k-th; whether it did */\
    static inline int insert_##SUF(T *bv, int64_t *bi, int64_t k, T v, int64_t idx) {                    \
        if (!better_##SUF(v, idx, bv[k - 1], bi[k - 1])) return 0;                                 \
        int64_t t = k - 1;                                                                            \
        while (t > 0 && better_##SUF(v, idx, bv[t - 1], bi[t - 1])) {                              \
            bv[t] = bv[t - 1];                                                                     \
            bi[t] = bi[t - 1];                                                                     \
            t--;                                                                                   \
        }                                                                                          \
        bv[t] = v;                                                                                 \
        bi[t] = idx;                                                                               \
        return 1;                                                                                  \
    }                                                                                              \
    /* whether any of the chunk's values at p is >= floor (NaN never is) */                        \
    static inline int reaches_##SUF(const T *p, T floor) {                                         \
        const vec_##SUF f = (vec_##SUF){} + floor;                                                 \
        const int q = CHUNK_##SUF / 4;                                                             \
        const mask_##SUF hit = (load_##SUF(p) >= f) | (load_##SUF(p + q) >= f) |                   \
                               (load_##SUF(p + 2 * q) >= f) | (load_##SUF(p + 3 * q) >= f);        \
        const lanes64 w = (lanes64)hit;                                                            \
        return (w[0] | w[1] | w[2] | w[3]) != 0;                                                   \
    }                                                                                              \
                                                                                                   \
    void dm_merge_##SUF(const T *s, int64_t lds, int64_t m, int64_t n, int64_t offset, T *best_v, int64_t *best_i, \
                        int64_t k, const T *margin, int64_t cap, int64_t *cand_cols, T *cand_vals,       \
                        int *counts, unsigned char *over) {                                        \
        for (int64_t r = 0; r < m; r++) {                                                             \
            const T *row = s + r * lds;                                                            \
            T *bv = best_v + r * k;                                                                \
            int64_t *bi = best_i + r * k;                                                          \
            const T slack = margin ? margin[r] : 0;                                                \
            T floor = bv[k - 1] - slack;                                                           \
            int listing = margin != NULL && !over[r];                                              \
            int64_t *cc = listing ? cand_cols + r * cap : NULL;                                    \
            T *cv = listing ? cand_vals + r * cap : NULL;                                          \
            for (int64_t c = 0; c < n; c += CHUNK_##SUF) {                                            \
                const int64_t end = c + CHUNK_##SUF < n ? c + CHUNK_##SUF : n;                        \
                if (end - c == CHUNK_##SUF && !reaches_##SUF(row + c, floor)) continue;            \
                for (int64_t q = c; q < end; q++) {                                                   \
                    const T v = row[q];                                                            \
                    if (!(v >= floor)) continue;                                                   \
                    const int64_t idx = offset + q;                                                   \
                    if (listing)                                                                   \
                        listing = list_##SUF(cc, cv, &counts[r], cap, &over[r], floor, idx, v);    \
                    if (insert_##SUF(bv, bi, k, v, idx)) floor = bv[k - 1] - slack;                \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

DEFINE_MERGE(float, f32)
DEFINE_MERGE(double, f64)

/* Scored pairs (rows[t], cols[t], score[t]), t < count, in any order, merged into the running
 * top-k of their rows (best_v / best_i (m, k) contiguous, as dm_merge keeps them): equal scores go
 * to the lower column, NaN never enters. The certified searches' candidates, once re-scored. */
#define DEFINE_MERGE_PAIRS(T, SUF)                                                                 \
    void dm_merge_pairs_##SUF(const int64_t *rows, const int64_t *cols, const T *score, int64_t count,        \
                              T *best_v, int64_t *best_i, int64_t k) {                                \
        for (int64_t t = 0; t < count; t++)                                                           \
            (void)insert_##SUF(best_v + rows[t] * k, best_i + rows[t] * k, k, score[t], cols[t]);  \
    }

DEFINE_MERGE_PAIRS(float, f32)
DEFINE_MERGE_PAIRS(double, f64)

/* The listed pairs (dm_merge's slots: cols / vals (m, cap), counts, over) whose value reaches
 * their row's floor, rows over left out, in row then slot order, into rows / cols_out (room for
 * every listed pair); returns how many. */
#define DEFINE_REACHING(T, SUF)                                                                    \
    int64_t dm_list_reaching_##SUF(const int64_t *cols, const T *vals, const int *counts,            \
                                   const unsigned char *over, int64_t m, int64_t cap, const T *floor, \
                                   int64_t *rows, int64_t *cols_out) {                             \
        int64_t n = 0;                                                                             \
        for (int64_t r = 0; r < m; r++) {                                                          \
            if (over[r]) continue;                                                                 \
            for (int64_t t = 0; t < counts[r]; t++)                                                \
                if (vals[r * cap + t] >= floor[r]) {                                               \
                    rows[n] = r;                                                                   \
                    cols_out[n++] = cols[r * cap + t];                                             \
                }                                                                                  \
        }                                                                                          \
        return n;                                                                                  \
    }

DEFINE_REACHING(float, f32)
DEFINE_REACHING(double, f64)

/* The certified bfloat16 search's step for one tile (densematch.engine.half): for the stored
 * bfloat16 scores h (m x n, row stride ldh) of a reference tile, each pair's rounding bound
 * e = qt[r] . rt[c] + rounding |h| (the terms of densematch.precision; rows of three), its lower
 * and upper bounds h - e and h + e (plus bias[c], the l2 column kept out of the product, and the
 * row's group terms, DM_GROUP below), the lower bounds merged into the running top-k (equal values to the lower column) and
 * every pair whose upper bound reaches its row's running k-th lower bound listed as dm_merge lists
 * (a row whose listed pairs all still reach its floor when cap are listed is marked over). NaN
 * bounds (products past a half type's range) prove nothing: a lower bound of -inf, an upper of
 * +inf. One pass over the tile instead of torch's passes for the bound, |h|, both bounds and the
 * merge. A row already over is skipped whole: the engine searches it again in float32, so
 * neither its bounds nor its floor are needed any more. */
static inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* eight bfloat16 at p widened to float32 (a shift each) */
static inline vec_f32 widen_bf16(const uint16_t *p) {
    vec_f32 v;
#if defined(__AVX2__)
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    typedef uint16_t half8 __attribute__((vector_size(16)));
    typedef uint32_t word8 __attribute__((vector_size(32)));
    half8 raw;
    memcpy(&raw, p, sizeof raw);
    const word8 bits = __builtin_convertvector(raw, word8) << 16;
#endif
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* bit i set where lane i of m is */
static inline unsigned lanes_set(mask_f32 m) {
#if defined(__AVX__)
    return (unsigned)_mm256_movemask_ps((__m256)m);
#else
    unsigned bits = 0;
    for (int i = 0; i < 8; i++) bits |= (unsigned)(m[i] != 0) << i;
    return bits;
#endif
}

/* a pair's upper and lower bounds (up, low) as the vector loop below forms them, lane by lane:
 * e = ((x ry + z rw) + one rf) + rounding |h|, up = ((h + e) + bias) + gu, low = ((h - e) + bias)
 * + gl, gu / gl its group's additions (0 without groups) */
static inline void certified_bounds(uint16_t raw, int64_t c, float x, float z, float one, const float *ry,
                                    const float *rw, const float *rf, float rounding, const float *bias, float gu,
                                    float gl, float *up, float *low) {
    const float h = bf16_to_f32(raw), b = bias[c];
    const float e = ((x * ry[c] + z * rw[c]) + one * rf[c]) + rounding * fabsf(h);
    *up = ((h + e) + b) + gu;
    *low = ((h - e) + b) + gl;
}

/* a pair whose bounds may reach the row's floor: its lower bound merged, its upper one listed
 * (see below) */
static inline void certified_take(float up, float low, int64_t idx, float *bv, int64_t *bi, int64_t k, int64_t cap,
                                  int64_t *cc, float *cv, int *count, unsigned char *over, int *listing) {
    if (up < bv[k - 1]) return; /* nor can its lower bound (<= up) enter the top k */
    if (low != low) low = -INFINITY;
    if (up != up) up = INFINITY;
    if (*listing) *listing = list_f32(cc, cv, count, cap, over, bv[k - 1], idx, up);
    insert_f32(bv, bi, k, low, idx);
}

/* Groups: where the references' half rows are centred per group of DM_GROUP consecutive
 * references of the whole set (group g: the columns whose index offset + c lies in [32 g,
 * 32 g + 32)), each query row's float32 product with its group's centre, p = gp[r * ldg + g']
 * (g' the group less the tile's first, offset / 32), is added to both bounds, widened by the
 * bound of densematch.precision.group_terms: ((q0 t0 + q1 t1) + q2 t2) + q3 |p| + q4, with the
 * row's terms q = gq[5 r ...] and the group's t = gt[3 g' ...]. The chunks of 32 columns are
 * aligned to the groups, so that one pair of additions serves a chunk; the columns before the
 * first whole group go pair by pair. */
enum { DM_GROUP = 32 };

static inline void group_add(const float *gp, const float *gq, const float *gt, int64_t g, float *up, float *low) {
    const float p = gp[g], *t = gt + 3 * g;
    const float slack = (((gq[0] * t[0] + gq[1] * t[1]) + gq[2] * t[2]) + gq[3] * fabsf(p)) + gq[4];
    *up = p + slack;
    *low = p - slack;
}

void dm_merge_certified_bf16(const uint16_t *h, int64_t ldh, int64_t m, int64_t n, int64_t offset, const float *bias,
                             const float *gp, int64_t ldg, const float *gq, const float *gt, const float *qt,
                             const float *rt, float rounding, float *best_v, int64_t *best_i, int64_t k, int64_t cap,
                             int64_t *cand_cols, float *cand_vals, int *counts, unsigned char *over) {
    enum { CB = DM_GROUP, L = 8 };
    const float *ry = rt, *rw = rt + n, *rf = rt + 2 * n; /* the reference terms, one plane each */
    const int64_t first = offset / DM_GROUP, head = (DM_GROUP - offset % DM_GROUP) % DM_GROUP;
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = h + r * ldh;
        float *bv = best_v + r * k;
        int64_t *bi = best_i + r * k;
        int64_t *cc = cand_cols + r * cap;
        float *cv = cand_vals + r * cap;
        if (over[r]) continue;
        const float x = qt[3 * r], z = qt[3 * r + 1], one = qt[3 * r + 2];
        const float *rp = gp ? gp + r * ldg : NULL, *rq = gp ? gq + 5 * r : NULL;
        float gu = 0.0f, gl = 0.0f; /* the current group's additions (0 without groups) */
#define DM_PAIR(c)                                                                                   \
    do {                                                                                             \
        float up_, low_;                                                                             \
        certified_bounds(row[c], c, x, z, one, ry, rw, rf, rounding, bias, gu, gl, &up_, &low_);      \
        certified_take(up_, low_, offset + (c), bv, bi, k, cap, cc, cv, &counts[r], &over[r], &listing); \
    } while (0)
#define DM_GROUP_AT(c) \
    if (rp) group_add(rp, rq, gt, (offset + (c)) / DM_GROUP - first, &gu, &gl)
#if !defined(__AVX512F__)
        const vec_f32 vx = (vec_f32){} + x, vz = (vec_f32){} + z, vone = (vec_f32){} + one;
        const vec_f32 vround = (vec_f32){} + rounding;
#endif
        int listing = 1;
        int64_t c0 = head < n ? head : n;
        if (c0) DM_GROUP_AT(0);
        for (int64_t c = 0; c < c0; c++) DM_PAIR(c);
        /* whole chunks: the upper bounds eight (sixteen) lanes at a time; only where one reaches
         * the floor (NaN does: it proves nothing), the lower bounds too, and the pairs that reach
         * go on to the merge and the listing. After the first tiles few do. */
        float ups[CB], lows[CB];
        for (; c0 + CB <= n; c0 += CB) {
            DM_GROUP_AT(c0);
            uint32_t reach = 0;
#if defined(__AVX512F__)
            const __m512 floor = _mm512_set1_ps(bv[k - 1]), vgu = _mm512_set1_ps(gu);
            __m512 v[CB / 16], e[CB / 16];
            for (int t = 0; t < CB; t += 16) {
                const int64_t c = c0 + t;
                const __m512 h16 = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + c))), 16));
                const __m512 xy = _mm512_mul_ps(_mm512_set1_ps(x), _mm512_loadu_ps(ry + c));
                const __m512 zw = _mm512_mul_ps(_mm512_set1_ps(z), _mm512_loadu_ps(rw + c));
                const __m512 of = _mm512_mul_ps(_mm512_set1_ps(one), _mm512_loadu_ps(rf + c));
                const __m512 hv = _mm512_mul_ps(_mm512_set1_ps(rounding), _mm512_abs_ps(h16));
                v[t / 16] = h16;
                e[t / 16] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(xy, zw), of), hv);
                const __m512 up = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(h16, e[t / 16]), _mm512_loadu_ps(bias + c)), vgu);
                _mm512_storeu_ps(ups + t, up);
                reach |= (uint32_t)_mm512_cmp_ps_mask(up, floor, _CMP_NLT_UQ) << t;
            }
            if (!reach) continue;
            const __m512 vgl = _mm512_set1_ps(gl);
            for (int t = 0; t < CB; t += 16) {
                const __m512 hb = _mm512_add_ps(_mm512_sub_ps(v[t / 16], e[t / 16]), _mm512_loadu_ps(bias + c0 + t));
                _mm512_storeu_ps(lows + t, _mm512_add_ps(hb, vgl));
            }
#else
            const vec_f32 floor = (vec_f32){} + bv[k - 1], vgu = (vec_f32){} + gu;
            vec_f32 v[CB / L], e[CB / L];
            for (int t = 0; t < CB; t += L) {
                const int64_t c = c0 + t;
                v[t / L] = widen_bf16(row + c);
                e[t / L] = ((vx * load_f32(ry + c) + vz * load_f32(rw + c)) + vone * load_f32(rf + c)) +
                           vround * vabs_f32(v[t / L]);
                const vec_f32 up = ((v[t / L] + e[t / L]) + load_f32(bias + c)) + vgu;
                memcpy(ups + t, &up, sizeof up);
                reach |= lanes_set(~(up < floor)) << t;
            }
            if (!reach) continue;
            const vec_f32 vgl = (vec_f32){} + gl;
            for (int t = 0; t < CB; t += L) {
                const vec_f32 low = ((v[t / L] - e[t / L]) + load_f32(bias + c0 + t)) + vgl;
                memcpy(lows + t, &low, sizeof low);
            }
#endif
            while (reach) { /* the few lanes that reach */
                const int t = __builtin_ctz(reach);
                reach &= reach - 1;
                certified_take(ups[t], lows[t], offset + c0 + t, bv, bi, k, cap, cc, cv, &counts[r], &over[r],
                               &listing);
            }
        }
        if (c0 < n) DM_GROUP_AT(c0);
        for (int64_t c = c0; c < n; c++) DM_PAIR(c); /* the tail, within one group */
#undef DM_PAIR
#undef DM_GROUP_AT
    }
}

/* A bfloat16 score tile (m x n, row stride lds) merged into a float32 running top-k, as dm_merge
 * does (equal scores to the lower column, in any tile order), for precision="fast": chunks of 32
 * scores widened to float32 (a shift each), plus bias[c] where given (the l2 column and the
 * queries' centre, in float32), and skipped unless one reaches the row's k-th best. */
void dm_merge_bf16(const uint16_t *s, int64_t lds, int64_t m, int64_t n, int64_t offset, float *best_v,
                   int64_t *best_i, int64_t k, const float *bias) {
    enum { CB = 32 };
    float v[CB];
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = s + r * lds;
        float *bv = best_v + r * k;
        int64_t *bi = best_i + r * k;
        for (int64_t c0 = 0; c0 < n; c0 += CB) {
            const int64_t cn = n - c0 < CB ? n - c0 : CB;
            const float floor = bv[k - 1];
            int hit = 0;
            for (int64_t t = 0; t < cn; t++) {
                v[t] = bf16_to_f32(row[c0 + t]) + (bias ? bias[c0 + t] : 0.0f);
                hit |= v[t] >= floor;
            }
            if (!hit) continue;
            for (int64_t t = 0; t < cn; t++)
                if (v[t] >= bv[k - 1]) insert_f32(bv, bi, k, v[t], offset + c0 + t);
        }
    }
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
 * over c, then the lanes in order, then the tail), so equal rows give equal values wherever they
 * are, on any CPU.
 *
 * The lanes are the vectors of DEFINE_VECTORS: the compiler's own vectoriser leaves the
 * max-and-sum loops scalar.
 */
#define DEFINE_PAIRS(T, SUF, ABS, SQRT, FREXP, LDEXP)                                              \
    static inline T lanes_##SUF(const vec_##SUF acc[2]) {                                          \
        T sum = 0;                                                                                 \
        for (int h = 0; h < 2; h++)                                                                \
            for (unsigned j = 0; j < 32 / sizeof(T); j++) sum += acc[h][j];                        \
        return sum;                                                                                \
    }                                                                                              \
                                                                                                   \
    PAIR_SUM(T, SUF, dot_##SUF, x * y, x * y)                                                      \
    PAIR_SUM(T, SUF, sqdiff_##SUF, (x - y) * (x - y), (x - y) * (x - y))                           \
    PAIR_SUM(T, SUF, absdiff_##SUF, vabs_##SUF(x - y), ABS(x - y))                                 \
    PAIR_MAX(T, SUF, maxabs_##SUF, vabs_##SUF(x - y), ABS(x - y))                                  \
    PAIR_MAX(T, SUF, peak_##SUF, vabs_##SUF(y), ABS(y)) /* of b alone: called with a = b */        \
                                                                                                   \
    /* 2^-e, e the exponent of peak (> 0, finite), as two factors each in range even for a         \
     * subnormal peak: scaling by it is exact and brings the row's largest magnitude to [0.5, 1) */ \
    static inline void unit_scale_##SUF(T peak, T s[2]) {                                          \
        int e;                                                                                     \
        (void)FREXP(peak, &e);                                                                     \
        s[0] = LDEXP((T)1, -e / 2);                                                                \
        s[1] = LDEXP((T)1, -e - (-e / 2));                                                         \
    }                                                                                              \
                                                                                                   \
    /* the norm of a * sa */                                                                       \
    static inline T scaled_norm_##SUF(const T *a, const T sa[2], int64_t C) {                         \
        const int64_t full = C - C % STEP(T), half = STEP(T) / 2;                                     \
        vec_##SUF squares[2] = {{0}, {0}};                                                         \
        for (int64_t c = 0; c < full; c += STEP(T))                                                   \
            for (int h = 0; h < 2; h++) {                                                          \
                const vec_##SUF x = load_##SUF(a + c + h * half) * sa[0] * sa[1];                  \
                squares[h] += x * x;                                                               \
            }                                                                                      \
        T norm = lanes_##SUF(squares);                                                             \
        for (int64_t c = full; c < C; c++) {                                                          \
            const T x = a[c] * sa[0] * sa[1];                                                      \
            norm += x * x;                                                                         \
        }                                                                                          \
        return SQRT(norm);                                                                         \
    }                                                                                              \
                                                                                                   \
    /* a row's cosine terms (t[0], t[1], t[2]): its scale (unit_scale) and its norm after it;      \
     * 0, 0, 0 for a zero row, 0, 0, NaN for a row holding a NaN                                   \
     * (dm_cosine_terms keeps them for a whole matrix)                                             \
     */                                                                                            \
    static inline void row_terms_##SUF(const T *a, int64_t C, T t[3]) {                            \
        const T peak = peak_##SUF(a, a, C);                                                        \
        t[0] = t[1] = 0;                                                                           \
        t[2] = peak == peak ? 0 : peak;                                                            \
        if (peak == peak && peak != 0) {                                                           \
            unit_scale_##SUF(peak, t);                                                             \
            t[2] = scaled_norm_##SUF(a, t, C);                                                     \
        }                                                                                          \
    }                                                                                              \
    /* cos(a, b), a scaled by sa with norm anorm after it (sa 0 and anorm 1 for a zero row), b's   \
     * terms tb                                                                                    \
     */                                                                                            \
    static inline T cosine_##SUF(const T *a, const T sa[2], T anorm, const T *b, const T tb[3], int64_t C) {\
        if (tb[2] != tb[2]) return tb[2];                                                          \
        if (tb[2] == 0) return 0;                                                                  \
        const int64_t full = C - C % STEP(T), half = STEP(T) / 2;                                  \
        vec_##SUF dots[2] = {{0}, {0}};                                                            \
        for (int64_t c = 0; c < full; c += STEP(T))                                                \
            for (int h = 0; h < 2; h++) {                                                          \
                const vec_##SUF x = load_##SUF(a + c + h * half) * sa[0] * sa[1];                  \
                const vec_##SUF y = load_##SUF(b + c + h * half) * tb[0] * tb[1];                  \
                dots[h] += x * y;                                                                  \
            }                                                                                      \
        T dot = lanes_##SUF(dots);                                                                 \
        for (int64_t c = full; c < C; c++) dot += (a[c] * sa[0] * sa[1]) * (b[c] * tb[0] * tb[1]); \
        return dot / (anorm * tb[2]);                                                              \
    }                                                                                              \
    void dm_cosine_terms_##SUF(const T *x, int64_t ldx, int64_t m, int64_t C, T *out) {            \
        for (int64_t i = 0; i < m; i++) row_terms_##SUF(x + i * ldx, C, out + 3 * i);              \
    }                                                                                              \
    void dm_pair_values_##SUF(const T *q, int64_t ldq, const int64_t *qidx, const T *r, int64_t ldr,\
                              const int64_t *idx, int64_t m, int64_t k, int64_t C, int kind,       \
                              const T *rterms, T *out) {                                           \
        T (*const pair)(const T *, const T *, int64_t) = kind == 0   ? dot_##SUF                   \
                                                      : kind == 1 ? sqdiff_##SUF                   \
                                                      : kind == 2 ? absdiff_##SUF                  \
                                                                  : maxabs_##SUF;                  \
        const T *last = NULL; /* cosine: the query row whose terms are known */                    \
        T ta[3] = {0, 0, 0}, tb[3], anorm = 1;                                                     \
        for (int64_t i = 0; i < m; i++) {                                                          \
            const int64_t row = qidx ? qidx[i] : i;                                                \
            const T *a = q + row * ldq;                                                            \
            if (kind == 4 && a != last) {                                                          \
                last = a;                                                                          \
                row_terms_##SUF(a, C, ta);                                                 \
                anorm = ta[2] == 0 ? 1 : ta[2];                                                    \
            }                                                                                      \
            for (int64_t j = 0; j < k; j++) {                                                      \
                const int64_t t = i * k + j, at = idx ? idx[t] : t;                                \
                const T *b = r + at * ldr;                                                         \
                if (kind != 4) {                                                                   \
                    out[t] = pair(a, b, C);                                                        \
                } else if (ta[2] != ta[2]) {                                                       \
                    out[t] = ta[2];                                                                \
                } else {                                                                           \
                    if (rterms)                                                                    \
                        for (int u = 0; u < 3; u++) tb[u] = rterms[3 * at + u];                    \
                    else                                                                           \
                        row_terms_##SUF(b, C, tb);                                                 \
                    out[t] = cosine_##SUF(a, ta, anorm, b, tb, C);                                 \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

/* the sum over c of EXPR (VEXPR on vectors) of x = a[c], y = b[c] */
#define PAIR_SUM(T, SUF, NAME, VEXPR, EXPR)                                                        \
    static inline T NAME(const T *a, const T *b, int64_t C) {                                         \
        const int64_t full = C - C % STEP(T), half = STEP(T) / 2;                                     \
        vec_##SUF acc[2] = {{0}, {0}};                                                             \
        for (int64_t c = 0; c < full; c += STEP(T))                                                   \
            for (int h = 0; h < 2; h++) {                                                          \
                const vec_##SUF x = load_##SUF(a + c + h * half), y = load_##SUF(b + c + h * half); \
                acc[h] += VEXPR;                                                                   \
            }                                                                                      \
        T sum = lanes_##SUF(acc);                                                                  \
        for (int64_t c = full; c < C; c++) {                                                          \
            const T x = a[c], y = b[c];                                                            \
            sum += EXPR;                                                                           \
        }                                                                                          \
        return sum;                                                                                \
    }

/* the largest of the non-negative EXPR, NaN if any is NaN: the vectors' maximum drops NaNs, so a
 * sum of the same values (NaN exactly when one is) says whether there was one */
#define PAIR_MAX(T, SUF, NAME, VEXPR, EXPR)                                                        \
    static inline T NAME(const T *a, const T *b, int64_t C) {                                         \
        const int64_t full = C - C % STEP(T), half = STEP(T) / 2;                                     \
        vec_##SUF top[2] = {{0}, {0}}, all[2] = {{0}, {0}};                                        \
        for (int64_t c = 0; c < full; c += STEP(T))                                                   \
            for (int h = 0; h < 2; h++) {                                                          \
                const vec_##SUF x = load_##SUF(a + c + h * half), y = load_##SUF(b + c + h * half); \
                const vec_##SUF v = VEXPR;                                                         \
                (void)x;                                                                           \
                top[h] = pick_##SUF(top[h] > v, top[h], v);                                        \
                all[h] += v;                                                                       \
            }                                                                                      \
        T most = 0, sum = lanes_##SUF(all);                                                        \
        for (int h = 0; h < 2; h++)                                                                \
            for (unsigned j = 0; j < 32 / sizeof(T); j++) most = most > top[h][j] ? most : top[h][j]; \
        for (int64_t c = full; c < C; c++) {                                                          \
            const T x = a[c], y = b[c], v = EXPR;                                                  \
            (void)x;                                                                               \
            most = most > v ? most : v;                                                            \
            sum += v;                                                                              \
        }                                                                                          \
        return sum != sum ? sum : most;                                                            \
    }

DEFINE_PAIRS(float, f32, fabsf, sqrtf, frexpf, ldexpf)
DEFINE_PAIRS(double, f64, fabs, sqrt, frexp, ldexp)

/* Local windows (densematch.local_match, local_cost_volume): the values of rows y0..y1 of a
 * against b at m offsets (oy[j], ox[j]), a and b (H, W, C) with a pixel stride of C, out
 * (m, y1 - y0, W), NaN where an offset leaves the grid. Each value is one pair of the kernels
 * above (kind as in dm_pair_values, cosine aside: its rows come unit already), reduced in their
 * one order, so a window's value equals the engine's value of the same pair. */
#define LOCAL_ROW(FN)                                                                              \
    for (int64_t x = xs; x < xe; x++) o[x] = FN(pa + x * C, pb + x * C, C)

#define DEFINE_LOCAL(T, SUF)                                                                       \
    /* o[xs..xe) from row pa of a and row pb of b (pixel stride C), b's row moved dx columns */   \
    static inline void local_row_##SUF(const T *pa, const T *pb, int64_t C, int64_t xs, int64_t xe, \
                                       int kind, T *o) {                                           \
        switch (kind) {                                                                            \
        case 0: LOCAL_ROW(dot_##SUF); break;                                                       \
        case 1: LOCAL_ROW(sqdiff_##SUF); break;                                                    \
        case 2: LOCAL_ROW(absdiff_##SUF); break;                                                   \
        default: LOCAL_ROW(maxabs_##SUF); break;                                                   \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* row y of a (pa, pixel stride C) at the m offsets, offset j into o + j * stride, NaN where  \
     * the window leaves b; b's row yy is read at b + (yy % ring) W C (ring = H: b itself; fewer: \
     * a ring of its rows) */                                                                     \
    static inline void local_offsets_##SUF(const T *pa, const T *b, int64_t ring, int64_t y,       \
                                           int64_t H, int64_t W, int64_t C, const int64_t *oy,     \
                                           const int64_t *ox, int64_t m, int kind, T *o,           \
                                           int64_t stride) {                                       \
        for (int64_t j = 0; j < m; j++, o += stride) {                                             \
            const int64_t yy = y + oy[j], dx = ox[j];                                              \
            const int64_t xs = yy < 0 || yy >= H ? W : (dx < 0 ? -dx : 0);                         \
            const int64_t xe = yy < 0 || yy >= H ? W : (dx > 0 ? W - dx : W);                      \
            for (int64_t x = 0; x < xs; x++) o[x] = (T)NAN;                                        \
            for (int64_t x = xe > xs ? xe : xs; x < W; x++) o[x] = (T)NAN;                         \
            if (xs < xe) local_row_##SUF(pa, b + ((yy % ring) * W + dx) * C, C, xs, xe, kind, o);  \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void dm_local_values_##SUF(const T *a, const T *b, int64_t H, int64_t W, int64_t C,            \
                               const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0,        \
                               int64_t y1, int kind, T *out) {                                     \
        const int64_t stride = (y1 - y0) * W;                                                      \
        for (int64_t y = y0; y < y1; y++)                                                          \
            local_offsets_##SUF(a + y * W * C, b, H, y, H, W, C, oy, ox, m, kind,                  \
                                out + (y - y0) * W, stride);                                       \
    }                                                                                              \
                                                                                                   \
    /* row y of channels-first (C, H, W) src, channels last into dst (W, C), in blocks of 8      \
     * channels so that each write fills a run of a pixel's values */                             \
    static void local_row_last_##SUF(const T *src, int64_t y, int64_t H, int64_t W, int64_t C,     \
                                     T *dst) {                                                     \
        for (int64_t c0 = 0; c0 < C; c0 += 8) {                                                    \
            const int64_t c1 = c0 + 8 < C ? c0 + 8 : C;                                            \
            for (int64_t x = 0; x < W; x++)                                                        \
                for (int64_t c = c0; c < c1; c++) dst[x * C + c] = src[(c * H + y) * W + x];       \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* dm_local_values for channels-first a and b, (C, H, W), read in place: each row of a and    \
     * each row of b the offsets reach is turned channels last once, into a ring of the rows one  \
     * row of a reaches, and valued by the same per-pixel kernels (the same bits). Returns 0, or  \
     * 1 where the ring could not be allocated. */                                                \
    int dm_local_planar_##SUF(const T *a, const T *b, int64_t H, int64_t W, int64_t C,             \
                              const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0,         \
                              int64_t y1, int kind, T *out) {                                      \
        const int64_t rows = y1 - y0;                                                              \
        int64_t lo = 0, hi = 0;                                                                    \
        for (int64_t j = 0; j < m; j++) {                                                          \
            lo = j == 0 || oy[j] < lo ? oy[j] : lo;                                                \
            hi = j == 0 || oy[j] > hi ? oy[j] : hi;                                                \
        }                                                                                          \
        const int64_t ring = hi - lo + 1;                                                          \
        T *arow = malloc((size_t)((ring + 1) * W * C) * sizeof(T)), *brows = arow + W * C;         \
        if (!arow) return 1;                                                                       \
        int64_t next = 0; /* the first row of b not yet in the ring */                             \
        for (int64_t y = y0; y < y1; y++) {                                                        \
            local_row_last_##SUF(a, y, H, W, C, arow);                                             \
            const int64_t first = y + lo > 0 ? y + lo : 0, last = y + hi < H ? y + hi + 1 : H;    \
            for (int64_t yy = next > first ? next : first; yy < last; yy++)                        \
                local_row_last_##SUF(b, yy, H, W, C, brows + (yy % ring) * W * C);                 \
            next = last > next ? last : next;                                                      \
            local_offsets_##SUF(arow, brows, ring, y, H, W, C, oy, ox, m, kind, out + (y - y0) * W, \
                                rows * W);                                                         \
        }                                                                                          \
        free(arow);                                                                                \
        return 0;                                                                                  \
    }

DEFINE_LOCAL(float, f32)
DEFINE_LOCAL(double, f64)

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
/* whether pixel (qy, qx) of b may be read: inside the grid and not masked out */
static inline int local_inside(int64_t qy, int64_t qx, int64_t H, int64_t W, const uint8_t *mask_b) {
    return qy >= 0 && qy < H && qx >= 0 && qx < W && (!mask_b || mask_b[qy * W + qx]);
}

#define DEFINE_LOCAL_FLOW(T, SUF, FLOOR)                                                           \
    /* where pixel (y, x)'s window sits: its top-left corner and the corners' weights, with each \
     * weight's two factors (a corner outside b is harmless where one of them is 0) */            \
    typedef struct {                                                                               \
        int64_t ty, tx;                                                                            \
        T weight[4], factor[4][2];                                                                 \
    } moved_##SUF;                                                                                 \
                                                                                                   \
    static inline moved_##SUF moved_at_##SUF(int64_t y, int64_t x, const T *f, int bilinear) {     \
        const T top = FLOOR((T)y + f[0]), left = FLOOR((T)x + f[1]);                               \
        const T wy = bilinear ? ((T)y - top) + f[0] : 0, wx = bilinear ? ((T)x - left) + f[1] : 0; \
        const moved_##SUF m = {(int64_t)top,                                                       \
                               (int64_t)left,                                                      \
                               {(1 - wy) * (1 - wx), (1 - wy) * wx, wy * (1 - wx), wy * wx},       \
                               {{1 - wy, 1 - wx}, {1 - wy, wx}, {wy, 1 - wx}, {wy, wx}}};          \
        return m;                                                                                  \
    }                                                                                              \
                                                                                                   \
    static inline T local_pair_##SUF(int kind, const T *x, const T *y, int64_t C) {                \
        switch (kind) {                                                                            \
        case 0: return dot_##SUF(x, y, C);                                                         \
        case 1: return sqdiff_##SUF(x, y, C);                                                      \
        case 2: return absdiff_##SUF(x, y, C);                                                     \
        default: return maxabs_##SUF(x, y, C);                                                     \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    int dm_local_flow_##SUF(const T *a, const T *b, int64_t H, int64_t W, int64_t C, const T *flow, \
                            int bilinear, const uint8_t *mask_b, const int64_t *oy,               \
                            const int64_t *ox, int64_t m, int64_t grid_cols, int64_t y0,          \
                            int64_t y1, int kind, int linear, T *out, uint8_t *valid) {           \
        const int64_t rows = y1 - y0;                                                              \
        const int shared = bilinear && linear && grid_cols > 0;                                    \
        const int64_t tw = shared ? grid_cols + 1 : 0, th = shared ? m / grid_cols + 1 : 0;        \
        T *blend = malloc(sizeof(T) * (size_t)(C > 0 ? C : 1));                                    \
        T *table = shared ? malloc(sizeof(T) * (size_t)(tw * th)) : NULL;                          \
        uint8_t *held = shared ? malloc((size_t)(tw * th)) : NULL;                                 \
        if (!blend || (shared && (!table || !held))) {                                             \
            free(blend), free(table), free(held);                                                  \
            return 1;                                                                              \
        }                                                                                          \
        for (int64_t y = y0; y < y1; y++)                                                          \
            for (int64_t x = 0; x < W; x++) {                                                      \
                const T *pa = a + (y * W + x) * C;                                                 \
                const moved_##SUF at0 = moved_at_##SUF(y, x, flow + (y * W + x) * 2, bilinear);    \
                const int64_t ty0 = at0.ty, tx0 = at0.tx;                                          \
                const T *weight = at0.weight, (*factor)[2] = at0.factor;                           \
                const int corners = bilinear ? 4 : 1;                                              \
                if (shared) /* the dot products of the whole moved window, once */                \
                    for (int64_t r = 0; r < th; r++)                                               \
                        for (int64_t s = 0; s < tw; s++) {                                         \
                            const int64_t qy = ty0 + oy[0] + r, qx = tx0 + ox[0] + s;              \
                            const int in = local_inside(qy, qx, H, W, mask_b);                     \
                            held[r * tw + s] = (uint8_t)in;                                        \
                            table[r * tw + s] = in ? dot_##SUF(pa, b + (qy * W + qx) * C, C) : 0;  \
                        }                                                                          \
                for (int64_t j = 0; j < m; j++) {                                                  \
                    const int64_t at = (j * rows + (y - y0)) * W + x;                              \
                    const int64_t ty = ty0 + oy[j], tx = tx0 + ox[j];                              \
                    int ok = 1;                                                                    \
                    const T *pb[4] = {NULL, NULL, NULL, NULL};                                     \
                    T v = 0;                                                                       \
                    for (int k = 0; k < corners; k++) {                                            \
                        const int64_t qy = ty + (k >> 1), qx = tx + (k & 1);                       \
                        int in;                                                                    \
                        if (shared) {                                                              \
                            const int64_t cell = (j / grid_cols + (k >> 1)) * tw + j % grid_cols + (k & 1); \
                            in = held[cell];                                                       \
                            if (in && weight[k] != 0) v += weight[k] * table[cell];                \
                        } else {                                                                   \
                            in = local_inside(qy, qx, H, W, mask_b);                               \
                            if (in) pb[k] = b + (qy * W + qx) * C;                                 \
                        }                                                                          \
                        if (!in && factor[k][0] != 0 && factor[k][1] != 0) ok = 0;                 \
                    }                                                                              \
                    valid[at] = (uint8_t)ok;                                                       \
                    if (!ok) {                                                                     \
                        out[at] = (T)NAN;                                                          \
                    } else if (shared) {                                                           \
                        out[at] = v;                                                               \
                    } else if (corners == 1) {                                                     \
                        out[at] = local_pair_##SUF(kind, pa, pb[0], C);                            \
                    } else if (linear) {                                                           \
                        for (int k = 0; k < 4; k++)                                                \
                            if (pb[k] && weight[k] != 0) v += weight[k] * dot_##SUF(pa, pb[k], C); \
                        out[at] = v;                                                               \
                    } else {                                                                       \
                        for (int64_t c = 0; c < C; c++) blend[c] = 0;                              \
                        for (int k = 0; k < 4; k++)                                                \
                            if (pb[k] && weight[k] != 0)                                           \
                                for (int64_t c = 0; c < C; c++) blend[c] += weight[k] * pb[k][c];  \
                        out[at] = local_pair_##SUF(kind, pa, blend, C);                            \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        free(blend), free(table), free(held);                                                      \
        return 0;                                                                                  \
    }

DEFINE_LOCAL_FLOW(float, f32, floorf)
DEFINE_LOCAL_FLOW(double, f64, floor)

/* The gradients of dm_local_flow's linear windows (dot): for each pixel and offset with a window
 * (valid) and an output gradient g, a gets g * sum_k w_k b_k, each corner of b g * w_k * a, and
 * a bilinear flow g * sum_k dot(a, b_k) dw_k / d(fy, fx). Corners are read at their positions
 * clamped into b, as the torch path gathers them: a harmless corner outside b has weight 0 but
 * its derivative counts. ga, gb (H, W, C) and gf (H, W, 2) accumulate; any may be NULL. */
#define DEFINE_LOCAL_FLOW_GRAD(T, SUF)                                                             \
    void dm_local_flow_grad_##SUF(const T *a, const T *b, int64_t H, int64_t W, int64_t C,         \
                                  const T *flow, int bilinear, const uint8_t *mask_b,             \
                                  const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0,    \
                                  int64_t y1, const T *grad, T *ga, T *gb, T *gf) {               \
        const int64_t rows = y1 - y0;                                                              \
        for (int64_t y = y0; y < y1; y++)                                                          \
            for (int64_t x = 0; x < W; x++) {                                                      \
                const T *pa = a + (y * W + x) * C;                                                 \
                const moved_##SUF at0 = moved_at_##SUF(y, x, flow + (y * W + x) * 2, bilinear);    \
                const int64_t ty0 = at0.ty, tx0 = at0.tx;                                          \
                const T *weight = at0.weight, (*factor)[2] = at0.factor;                           \
                const T wy = factor[3][0], wx = factor[3][1];                                      \
                const T dwy[4] = {-(1 - wx), -wx, 1 - wx, wx}, dwx[4] = {-(1 - wy), 1 - wy, -wy, wy}; \
                const int corners = bilinear ? 4 : 1;                                              \
                for (int64_t j = 0; j < m; j++) {                                                  \
                    const T g = grad[(j * rows + (y - y0)) * W + x];                               \
                    if (g == 0) continue;                                                          \
                    const int64_t ty = ty0 + oy[j], tx = tx0 + ox[j];                              \
                    int ok = 1;                                                                    \
                    int64_t q[4];                                                                  \
                    for (int k = 0; k < corners; k++) {                                            \
                        const int64_t qy = ty + (k >> 1), qx = tx + (k & 1);                       \
                        const int in = local_inside(qy, qx, H, W, mask_b);                         \
                        if (!in && factor[k][0] != 0 && factor[k][1] != 0) ok = 0;                 \
                        const int64_t cy = qy < 0 ? 0 : qy >= H ? H - 1 : qy;                      \
                        const int64_t cx = qx < 0 ? 0 : qx >= W ? W - 1 : qx;                      \
                        q[k] = cy * W + cx;                                                        \
                    }                                                                              \
                    if (!ok) continue;                                                             \
                    T dfy = 0, dfx = 0;                                                            \
                    for (int k = 0; k < corners; k++) {                                            \
                        const T *pb = b + q[k] * C, s = g * weight[k];                             \
                        if (gf && bilinear) {                                                      \
                            const T d = dot_##SUF(pa, pb, C);                                      \
                            dfy += d * dwy[k];                                                     \
                            dfx += d * dwx[k];                                                     \
                        }                                                                          \
                        if (s == 0) continue;                                                      \
                        if (ga)                                                                    \
                            for (int64_t c = 0; c < C; c++) ga[(y * W + x) * C + c] += s * pb[c];  \
                        if (gb)                                                                    \
                            for (int64_t c = 0; c < C; c++) gb[q[k] * C + c] += s * pa[c];         \
                    }                                                                              \
                    if (gf && bilinear) {                                                          \
                        gf[(y * W + x) * 2] += g * dfy;                                            \
                        gf[(y * W + x) * 2 + 1] += g * dfx;                                        \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
    }

DEFINE_LOCAL_FLOW_GRAD(float, f32)
DEFINE_LOCAL_FLOW_GRAD(double, f64)
