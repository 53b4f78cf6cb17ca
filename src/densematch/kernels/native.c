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

typedef uint64_t lanes64 __attribute__((vector_size(32))); /* any mask, as four words */
#define STEP(T) (2 * (int64_t)(32 / sizeof(T))) /* values per step: two vectors */

/* whether pixel (qy, qx) of b may be read: inside the grid and not masked out */
static inline int local_inside(int64_t qy, int64_t qx, int64_t H, int64_t W, const uint8_t *mask_b) {
    return qy >= 0 && qy < H && qx >= 0 && qx < W && (!mask_b || mask_b[qy * W + qx]);
}

#define PB STEP(T) /* the columns of X a register block spans: two vectors */

/* the kernels for float, then for double (native_t.h) */
#define T float
#define I int32_t
#define SUF f32
#define ABS fabsf
#define SQRT sqrtf
#define FREXP frexpf
#define LDEXP ldexpf
#define FLOOR floorf
#include "native_t.h"

#define T double
#define I int64_t
#define SUF f64
#define ABS fabs
#define SQRT sqrt
#define FREXP frexp
#define LDEXP ldexp
#define FLOOR floor
#include "native_t.h"
#undef PB

/* The certified bfloat16 search's step for one tile (densematch.engine.half): for the stored
 * bfloat16 scores h (m x n, row stride ldh) of a reference tile, each pair's rounding bound
 * e = qt[r] . rt[c] + rounding |h| (the terms of densematch.precision: the queries' in rows of
 * three, the references' in three planes of n, ldr apart), its lower
 * and upper bounds h - e and h + e (plus bias[c], the l2 column kept out of the product, and the
 * row's group terms, DM_GROUP below), the lower bounds merged into the running top-k (equal values to the lower column) and
 * every pair whose upper bound reaches its row's floor (its running k-th lower bound, or in its
 * first tile a seed: seeded_floor) listed as dm_merge lists (a row whose listed pairs all still
 * reach its floor when cap are listed is marked over; a chunk's lanes are listed together against
 * the floor at its start: take_chunk). NaN
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

/* certified_bounds' e for eight lanes: the scores v (widened) and the references' terms at column
 * c, as every eight-lane loop forms them (the pair loop's and the seed's: the same bits) */
static inline vec_f32 bound8(vec_f32 v, int64_t c, vec_f32 vx, vec_f32 vz, vec_f32 vone, const float *ry,
                             const float *rw, const float *rf, vec_f32 vround) {
    return ((vx * load_f32(ry + c) + vz * load_f32(rw + c)) + vone * load_f32(rf + c)) + vround * vabs_f32(v);
}

/* the row's floor: its k-th lower bound, or the seed (seeded_floor) where higher */
static inline float floor_of(const float *bv, int64_t k, float seed) { return bv[k - 1] > seed ? bv[k - 1] : seed; }

/* a pair whose bounds may reach the row's floor (floor_of with seed): its lower bound merged,
 * its upper one listed (see below) */
static inline void certified_take(float up, float low, int64_t idx, float *bv, int64_t *bi, int64_t k, float seed,
                                  int64_t cap, int64_t *cc, float *cv, int *count, unsigned char *over,
                                  int *listing) {
    const float floor = floor_of(bv, k, seed);
    if (up < floor) return; /* nor can its lower bound (<= up) enter the top k */
    if (low != low) low = -INFINITY;
    if (up != up) up = INFINITY;
    if (*listing) *listing = list_f32(cc, cv, count, cap, over, floor, idx, up);
    insert_f32(bv, bi, k, low, idx);
}

/* The lanes of a chunk whose upper bounds reach the row's floor at the chunk's start (bit t of
 * reach: column col + t, bounds ups[t] and lows[t]). Where the row still lists and its list holds
 * them all, each is listed (its upper bound, NaN as +inf), in lane order, then each lower bound
 * merged: no lane is listed against a floor that a lane before it raised, which lists a few pairs
 * more than lane by lane and keeps the same top k (those pairs are dropped against the final
 * floor). Else lane by lane (certified_take), the list pruned as it fills. Every level takes a
 * chunk this way, so all list the same pairs; the sixteen-lane loop lists with two compress
 * instructions. Most of a search's takes are in chunks that need no pruning (issue 39). */
static inline void take_chunk(uint32_t reach, const float *ups, const float *lows, int64_t col, float *bv, int64_t *bi,
                              int64_t k, float seed, int64_t cap, int64_t *cc, float *cv, int *count,
                              unsigned char *over, int *listing) {
    if (*listing && *count + __builtin_popcount(reach) <= cap) {
        int at = *count;
        for (uint32_t b = reach; b; b &= b - 1, at++) {
            const int t = __builtin_ctz(b);
            cc[at] = col + t;
            cv[at] = ups[t] != ups[t] ? INFINITY : ups[t];
        }
        *count = at;
        for (uint32_t b = reach; b; b &= b - 1) {
            const int t = __builtin_ctz(b);
            insert_f32(bv, bi, k, lows[t] != lows[t] ? -INFINITY : lows[t], col + t);
        }
        return;
    }
    for (; reach; reach &= reach - 1) {
        const int t = __builtin_ctz(reach);
        certified_take(ups[t], lows[t], col + t, bv, bi, k, seed, cap, cc, cv, count, over, listing);
    }
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

static inline float group_slack(const float *gq, float t0, float t1, float t2, float p) {
    return (((gq[0] * t0 + gq[1] * t1) + gq[2] * t2) + gq[3] * fabsf(p)) + gq[4];
}

static inline void group_add(const float *gp, const float *gq, const float *gt, int64_t g, float *up, float *low) {
    const float p = gp[g], *t = gt + 3 * g, slack = group_slack(gq, t[0], t[1], t[2], p);
    *up = p + slack;
    *low = p - slack;
}

/* the larger of m and v, NaN kept once met (either way round) */
static inline float max_keeping_nan(float m, float v) { return v > m || v != v ? v : m; }

/* The chunk test. A pair's e = ((x ry + z rw) + one rf) + rounding |h| grows with each reference
 * term (no term is negative), and float32's rounded products and sums never decrease as an
 * operand grows; so with each whole chunk's largest terms (NaN where one is NaN) in place of the
 * pair's, every lane's upper bound is at least the pair's own as the pair loop forms it. Where
 * none reaches the row's floor (NaN does), no pair does, and the chunk costs one pass of a few
 * operations a pair, from values made once per row (each chunk's share of the bound and its
 * group's additions), instead of the bounds' three products and their chain per chunk. */
static void chunk_terms(const float *ry, const float *rw, const float *rf, int64_t head, int64_t chunks, float *out) {
    for (int64_t q = 0; q < chunks; q++) {
        float y = -INFINITY, w = -INFINITY, f = -INFINITY;
        for (int64_t c = head + q * DM_GROUP; c < head + (q + 1) * DM_GROUP; c++) {
            y = max_keeping_nan(y, ry[c]);
            w = max_keeping_nan(w, rw[c]);
            f = max_keeping_nan(f, rf[c]);
        }
        out[q] = y, out[chunks + q] = w, out[2 * chunks + q] = f;
    }
}

/* The chunk test costs about a third of the pair loop's operations. The eight-lane loop runs it in
 * passes of its own (chunk_pass), CHUNK_PASS chunks a pass against the floor at the pass's start;
 * the sixteen-lane loop on the chunk's values it has just widened, ahead of the pairs' own bounds
 * (as a pass of its own it saved nothing on an AVX-512 CPU). */
enum { CHUNK_PASS = 4 };

/* Which of the qn (<= CHUNK_PASS) whole chunks from row's column 0 may reach floor (bit q for
 * chunk q): the chunk test on each, share[q] its share of the bound and up[q] its group's addition.
 * Its own loop, apart from the pair loop's: with nothing else live, the compiler keeps it in
 * registers and no branch waits on each chunk (inside the pair loop it spilled that loop's values
 * and branched per chunk: the C step 6-14% slower on the AVX2 EPYC). A floor that rises during the
 * pass only lets more chunks through, and the pair loop tests every pair against the floor of its
 * own time. */
static inline unsigned chunk_pass(const uint16_t *row, const float *bias, const float *share, const float *up,
                                  int64_t qn, float floor, vec_f32 vround) {
    enum { CB = DM_GROUP, L = 8 };
    const vec_f32 vfloor = (vec_f32){} + floor;
    unsigned pass = 0;
    for (int64_t q = 0; q < qn; q++) {
        const vec_f32 vp = (vec_f32){} + share[q], vgu = (vec_f32){} + up[q];
        mask_f32 any = {};
        for (int t = 0; t < CB; t += L) {
            const vec_f32 hv = widen_bf16(row + q * CB + t);
            const vec_f32 u = ((hv + (vp + vround * vabs_f32(hv))) + load_f32(bias + q * CB + t)) + vgu;
            any |= ~(u < vfloor);
        }
        pass |= (unsigned)(lanes_set(any) != 0) << q;
    }
    return pass;
}

/* A floor for a row that has no k lower bounds yet (its first tile): the k-th largest of the
 * whole chunks' largest lower bounds, formed lane by lane as the pair loops form them, -inf where
 * fewer than k chunks or k above SEED_K. Those k pairs are among this tile's, so the row's final
 * k-th lower bound is at least the seed: a pair whose upper bound is below it can neither enter
 * the top k nor be listed, and a listed one below it can go. Without it, a row's first tile
 * raised its floor pair by pair from -inf, k (1 + ln(n / k)) merges and as many listings in a
 * random order, and most of the C step's merges and listings were its first tiles' (issue 39:
 * 96x96x64 same-scene, l2 k=8: 757 of 1052 thousand pairs taken). */
enum { SEED_K = 16 };
static float seeded_floor(const uint16_t *row, const float *ry, const float *rw, const float *rf, const float *bias,
                          const float *adds_low, int64_t chunks, float x, float z, float one, float rounding, int64_t k,
                          float *largest) {
    enum { CB = DM_GROUP, L = 8 };
    if (k > SEED_K || chunks < k) return -INFINITY;
    const vec_f32 vx = (vec_f32){} + x, vz = (vec_f32){} + z, vone = (vec_f32){} + one, vround = (vec_f32){} + rounding;
    for (int64_t q = 0; q < chunks; q++) {
        const int64_t c0 = q * CB;
        const vec_f32 vgl = (vec_f32){} + adds_low[q];
        vec_f32 most = (vec_f32){} - INFINITY;
        for (int t = 0; t < CB; t += L) {
            const int64_t c = c0 + t;
            const vec_f32 v = widen_bf16(row + c), e = bound8(v, c, vx, vz, vone, ry, rw, rf, vround);
            const vec_f32 low = ((v - e) + load_f32(bias + c)) + vgl;
            most = pick_f32(low > most, low, most); /* NaN never is */
        }
        float m = -INFINITY;
        for (int t = 0; t < L; t++) m = most[t] > m ? most[t] : m;
        largest[q] = m;
    }
    /* the k-th largest: the k largest kept in order, most chunks turned away by one compare */
    float top[SEED_K];
    for (int64_t j = 0; j < k; j++) top[j] = -INFINITY;
    for (int64_t q = 0; q < chunks; q++) {
        const float v = largest[q];
        if (!(v > top[k - 1])) continue;
        int64_t j = k - 1;
        for (; j > 0 && v > top[j - 1]; j--) top[j] = top[j - 1];
        top[j] = v;
    }
    return top[k - 1];
}

/* scratch: 10 (n / DM_GROUP + 1) floats (the chunks' largest terms and their groups' terms, one
 * plane each, then one row's shares and additions). Returns how many of the m rows are over. */
int64_t dm_merge_certified_bf16(const uint16_t *h, int64_t ldh, int64_t m, int64_t n, int64_t offset, const float *bias,
                             const float *gp, int64_t ldg, const float *gq, const float *gt, const float *qt,
                             const float *rt, int64_t ldr, float rounding, float *best_v, int64_t *best_i, int64_t k, int64_t cap,
                             int64_t *cand_cols, float *cand_vals, int *counts, unsigned char *over, float *scratch) {
    enum { CB = DM_GROUP, L = 8 };
    const float *ry = rt, *rw = rt + ldr, *rf = rt + 2 * ldr; /* the reference terms, one plane each */
    const int64_t first = offset / DM_GROUP, head = (DM_GROUP - offset % DM_GROUP) % DM_GROUP;
    const int64_t chunks = n > head ? (n - head) / CB : 0;
    /* (disjoint planes of scratch, so restrict: the compiler vectorises the loops over chunks) */
    const float *restrict my = scratch, *restrict mw = scratch + chunks, *restrict mf = scratch + 2 * chunks;
    float *restrict g0 = scratch + 3 * chunks, *restrict g1 = g0 + chunks, *restrict g2 = g1 + chunks;
    /* one row's: each chunk's share of the bound, and its group's additions to the bounds */
    float *restrict share = g2 + chunks, *restrict adds_up = share + chunks, *restrict adds_low = adds_up + chunks;
    float *restrict largest = adds_low + chunks; /* one row's chunks' largest lower bounds (seeded_floor) */
    chunk_terms(ry, rw, rf, head, chunks, scratch);
    const int64_t base = (offset + head) / DM_GROUP - first; /* the first whole chunk's group */
    for (int64_t q = 0; gp && q < chunks; q++)
        g0[q] = gt[3 * (base + q)], g1[q] = gt[3 * (base + q) + 1], g2[q] = gt[3 * (base + q) + 2];
    const vec_f32 vround = (vec_f32){} + rounding;
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
        certified_take(up_, low_, offset + (c), bv, bi, k, seed, cap, cc, cv, &counts[r], &over[r], &listing); \
    } while (0)
#define DM_GROUP_AT(c) \
    if (rp) group_add(rp, rq, gt, (offset + (c)) / DM_GROUP - first, &gu, &gl)
        /* (formed as group_add and the pair loop form them) */
        for (int64_t q = 0; q < chunks; q++) share[q] = (x * my[q] + z * mw[q]) + one * mf[q];
        if (rp) {
            const float *restrict p = rp + base;
            const float terms[5] = {rq[0], rq[1], rq[2], rq[3], rq[4]};
            for (int64_t q = 0; q < chunks; q++) {
                const float slack = group_slack(terms, g0[q], g1[q], g2[q], p[q]);
                adds_up[q] = p[q] + slack;
                adds_low[q] = p[q] - slack;
            }
        } else {
            for (int64_t q = 0; q < chunks; q++) adds_up[q] = adds_low[q] = 0.0f;
        }
#if !defined(__AVX512F__)
        const vec_f32 vx = (vec_f32){} + x, vz = (vec_f32){} + z, vone = (vec_f32){} + one;
#endif
        int listing = 1;
        int64_t c0 = head < n ? head : n;
        const float seed = bv[k - 1] == -INFINITY ? seeded_floor(row + c0, ry + c0, rw + c0, rf + c0, bias + c0, adds_low,
                                                                 chunks, x, z, one, rounding, k, largest)
                                                   : -INFINITY;
        if (c0) DM_GROUP_AT(0);
        for (int64_t c = 0; c < c0; c++) DM_PAIR(c);
        /* whole chunks: the chunk test, CHUNK_PASS chunks at a time; in each chunk that passes it,
         * the upper bounds eight (sixteen) lanes at a time; only where one reaches the floor (NaN
         * does: it proves nothing), the lower bounds too, and the pairs that reach go on to the
         * merge and the listing. After the first tiles few do. */
        float ups[CB], lows[CB];
        const int64_t whole = c0;
#if defined(__AVX512F__)
        /* Sixteen lanes at a time, the floor kept in a register until a take moves it: each chunk
         * its chunk test (as chunk_pass forms it), then where a lane passes, the pairs' own upper
         * bounds. The common chunk, where none passes, costs one mask test (kortest): no stores
         * and no mask moved to a general register, which with the stores of every chunk's bounds
         * took about half the step's time on a Zen 4 (issue 39). The bounds are formed as in the
         * loop below, in the same order: the same bits. */
        const __m512 vx = _mm512_set1_ps(x), vz = _mm512_set1_ps(z), vone = _mm512_set1_ps(one);
        const __m512 vr = _mm512_set1_ps(rounding);
        __m512 vfloor = _mm512_set1_ps(floor_of(bv, k, seed));
        for (int64_t q = 0; q < chunks; q++) {
            const int64_t c = whole + q * CB;
            __m512 hv[2], hr[2], e[2], up[2];
            __mmask16 m[2];
            const __m512 vgu = _mm512_set1_ps(adds_up[q]), vshare = _mm512_set1_ps(share[q]);
            for (int t = 0; t < 2; t++) {
                hv[t] = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + c + 16 * t))), 16));
                hr[t] = _mm512_mul_ps(vr, _mm512_abs_ps(hv[t]));
                const __m512 u = _mm512_add_ps(
                    _mm512_add_ps(_mm512_add_ps(hv[t], _mm512_add_ps(vshare, hr[t])), _mm512_loadu_ps(bias + c + 16 * t)),
                    vgu);
                m[t] = _mm512_cmp_ps_mask(u, vfloor, _CMP_NLT_UQ);
            }
            if (_kortestz_mask16_u8(m[0], m[1])) continue;
            for (int t = 0; t < 2; t++) {
                const int64_t ct = c + 16 * t;
                const __m512 xy = _mm512_mul_ps(vx, _mm512_loadu_ps(ry + ct));
                const __m512 zw = _mm512_mul_ps(vz, _mm512_loadu_ps(rw + ct));
                const __m512 of = _mm512_mul_ps(vone, _mm512_loadu_ps(rf + ct));
                e[t] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(xy, zw), of), hr[t]);
                up[t] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(hv[t], e[t]), _mm512_loadu_ps(bias + ct)), vgu);
                m[t] = _mm512_cmp_ps_mask(up[t], vfloor, _CMP_NLT_UQ);
            }
            if (_kortestz_mask16_u8(m[0], m[1])) continue;
            const __m512 vgl = _mm512_set1_ps(adds_low[q]);
            __m512 low[2];
            for (int t = 0; t < 2; t++) {
                const __m512 hb = _mm512_add_ps(_mm512_sub_ps(hv[t], e[t]), _mm512_loadu_ps(bias + c + 16 * t));
                low[t] = _mm512_add_ps(hb, vgl);
            }
            uint32_t reach = (uint32_t)m[0] | (uint32_t)m[1] << 16;
            if (listing && counts[r] + __builtin_popcount(reach) <= cap) {
                /* take_chunk's first form: the lanes listed by two compresses, then the lower
                 * bounds that may enter the top k (at least its k-th at the chunk's start) merged */
                int at = counts[r];
                const __m512i lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
                const __m512 kth = _mm512_set1_ps(bv[k - 1]);
                uint32_t in = 0;
                for (int t = 0; t < 2; t++) {
                    const __m512 u = _mm512_mask_mov_ps(up[t], _mm512_cmp_ps_mask(up[t], up[t], _CMP_UNORD_Q),
                                                        _mm512_set1_ps(INFINITY));
                    const int got = __builtin_popcount(m[t]);
                    _mm512_mask_storeu_ps(cv + at, (__mmask16)((1u << got) - 1), _mm512_maskz_compress_ps(m[t], u));
                    for (int half = 0; half < 2; half++) {
                        const __mmask8 pick = (__mmask8)(m[t] >> (8 * half));
                        const __m512i cols = _mm512_add_epi64(lanes, _mm512_set1_epi64(offset + c + 16 * t + 8 * half));
                        const int n8 = __builtin_popcount(pick);
                        _mm512_mask_storeu_epi64(cc + at, (__mmask8)((1u << n8) - 1), _mm512_maskz_compress_epi64(pick, cols));
                        at += n8;
                    }
                    in |= (uint32_t)_mm512_mask_cmp_ps_mask(m[t], low[t], kth, _CMP_GE_OQ) << (16 * t);
                }
                counts[r] = at;
                if (in) {
                    for (int t = 0; t < 2; t++) _mm512_storeu_ps(lows + 16 * t, low[t]);
                    for (; in; in &= in - 1) {
                        const int t = __builtin_ctz(in);
                        insert_f32(bv, bi, k, lows[t], offset + c + t);
                    }
                }
            } else {
                for (int t = 0; t < 2; t++) {
                    _mm512_storeu_ps(ups + 16 * t, up[t]);
                    _mm512_storeu_ps(lows + 16 * t, low[t]);
                }
                take_chunk(reach, ups, lows, offset + c, bv, bi, k, seed, cap, cc, cv, &counts[r], &over[r], &listing);
            }
            vfloor = _mm512_set1_ps(floor_of(bv, k, seed));
        }
#else
        for (int64_t q0 = 0; q0 < chunks; q0 += CHUNK_PASS) {
            const int64_t qn = chunks - q0 < CHUNK_PASS ? chunks - q0 : CHUNK_PASS;
            /* (a floor of -inf, a row's first chunks, passes every chunk) */
            unsigned pass = (1u << qn) - 1;
            if (floor_of(bv, k, seed) > -INFINITY)
                pass = chunk_pass(row + whole + q0 * CB, bias + whole + q0 * CB, share + q0, adds_up + q0, qn,
                                  floor_of(bv, k, seed), vround);
            while (pass) {
                const int64_t q = q0 + __builtin_ctz(pass);
                pass &= pass - 1;
                c0 = whole + q * CB;
                gu = adds_up[q], gl = adds_low[q];
                uint32_t reach = 0;
                const vec_f32 floor = (vec_f32){} + floor_of(bv, k, seed), vgu = (vec_f32){} + gu;
                vec_f32 v[CB / L], e[CB / L];
                for (int t = 0; t < CB; t += L) {
                    const int64_t c = c0 + t;
                    v[t / L] = widen_bf16(row + c);
                    e[t / L] = bound8(v[t / L], c, vx, vz, vone, ry, rw, rf, vround);
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
                take_chunk(reach, ups, lows, offset + c0, bv, bi, k, seed, cap, cc, cv, &counts[r], &over[r], &listing);
            }
        }
#endif
        c0 = whole + chunks * CB;
        if (c0 < n) DM_GROUP_AT(c0);
        for (int64_t c = c0; c < n; c++) DM_PAIR(c); /* the tail, within one group */
#undef DM_PAIR
#undef DM_GROUP_AT
    }
    int64_t gone = 0;
    for (int64_t r = 0; r < m; r++) gone += over[r] != 0;
    return gone;
}

/* The norms the certified search's bound terms are made of (densematch.precision: query_terms,
 * ref_terms, group_terms), in one pass over each row where torch makes four or five: out[4 r ..
 * 4 r + 3] = |x|, |h|, |h - x| (the difference in float32) and |u| of row r of x and u (float32)
 * and h (bfloat16), any row strides (u NULL: 0). Squares summed in float64 (no sum overflows) over eight lanes,
 * column j in lane j % 8, folded in one order: the same bits on every level, and a float32 norm
 * within an ulp of the exact one, inside the bound's slack for its norms. */
typedef float dm_v4f __attribute__((vector_size(16)));
typedef double dm_v4d __attribute__((vector_size(32)));

/* the squares of eight float32 values at p (lanes 0-3, then 4-7) added to acc[0], acc[1] in float64 */
static inline void add_squares8(dm_v4d *acc, const float *p) {
    dm_v4f lo, hi;
    memcpy(&lo, p, sizeof lo);
    memcpy(&hi, p + 4, sizeof hi);
    const dm_v4d a = __builtin_convertvector(lo, dm_v4d), b = __builtin_convertvector(hi, dm_v4d);
    acc[0] += a * a;
    acc[1] += b * b;
}

static inline float norm_of_lanes(const dm_v4d *acc, const double *tail) {
    double s[8];
    for (int l = 0; l < 4; l++) s[l] = acc[0][l] + tail[l], s[4 + l] = acc[1][l] + tail[4 + l];
    return (float)sqrt(((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
}

/* one row's norms: out = |x|, |h|, |h - x| and |u| (u NULL: 0) of c columns */
static inline void row_norms4(const float *x, const uint16_t *h, const float *u, int64_t c, float *out) {
    dm_v4d ax[2] = {{0}}, ah[2] = {{0}}, ad[2] = {{0}}, au[2] = {{0}};
    double tx[8] = {0}, th[8] = {0}, td[8] = {0}, tu[8] = {0}; /* the last columns' lanes */
    int64_t j = 0;
    for (; j + 8 <= c; j += 8) {
        float hv[8], dv[8];
        const vec_f32 w = widen_bf16(h + j), d = w - load_f32(x + j); /* in float32, as torch's form */
        memcpy(hv, &w, sizeof hv);
        memcpy(dv, &d, sizeof dv);
        add_squares8(ax, x + j);
        add_squares8(ah, hv);
        add_squares8(ad, dv);
        if (u) add_squares8(au, u + j); /* (each lane's sums in column order however interleaved) */
    }
    for (int64_t t = j; t < c; t++) {
        const float w = bf16_to_f32(h[t]);
        const double a = x[t], b = w, d = w - x[t]; /* (the difference in float32, as above) */
        tx[t % 8] += a * a, th[t % 8] += b * b, td[t % 8] += d * d;
        if (u) tu[t % 8] += (double)u[t] * u[t];
    }
    out[0] = norm_of_lanes(ax, tx);
    out[1] = norm_of_lanes(ah, th);
    out[2] = norm_of_lanes(ad, td);
    out[3] = norm_of_lanes(au, tu);
}

void dm_row_norms_bf16(const float *x, int64_t ldx, const uint16_t *h, int64_t ldh, const float *u, int64_t ldu,
                       int64_t n, int64_t c, float *out) {
    for (int64_t r = 0; r < n; r++) row_norms4(x + r * ldx, h + r * ldh, u ? u + r * ldu : NULL, c, out + 4 * r);
}

/* float32 to bfloat16, rounded to nearest even as torch rounds (NaN to its one quiet NaN) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The certified search's reference groups in one pass over the references' rows
 * (densematch.engine.half: HalfSearch._group_centres), where torch's operators make seven: rows
 * r (n x c body columns, row stride ldr, then `extra` columns) in groups of `size` consecutive
 * rows from row 0 (the last may be shorter). centres (G x c): each group's mean, its rows added
 * in order in float32 and the sum divided by their count. halves (n x (c + extra), row stride
 * ldh): each body row less its group's centre (fl(b - t)) and the extra columns as they are,
 * rounded to bfloat16 as torch rounds. norms (n x 4): |d|, |h|, |h - d| and |b| of the body
 * columns of d = b - t and h, as dm_row_norms_bf16 makes them of (d, h, b). Each group's rows
 * are read again from the cache it has just filled. The same bits on every level (the sums go in
 * row order, column by column; the norms as dm_row_norms_bf16's). Returns 1 where a
 * centre or a norm is not finite (the caller's torch form then takes the rows), 2 where its
 * scratch cannot be allocated, else 0. */
int dm_group_bf16(const float *r, int64_t ldr, int64_t n, int64_t c, int64_t extra, int64_t size, float *centres,
                  uint16_t *halves, int64_t ldh, float *norms) {
    float *d = malloc(sizeof(float) * (size_t)(c > 0 ? c : 1));
    if (!d) return 2;
    int bad = 0;
    for (int64_t g0 = 0, gi = 0; g0 < n; g0 += size, gi++) {
        const int64_t rows = n - g0 < size ? n - g0 : size;
        float *t = centres + gi * c;
        for (int64_t j = 0; j < c; j++) t[j] = 0.0f;
        for (int64_t i = 0; i < rows; i++) {
            const float *b = r + (g0 + i) * ldr;
            for (int64_t j = 0; j < c; j++) t[j] += b[j];
        }
        const float count = (float)rows;
        for (int64_t j = 0; j < c; j++) {
            t[j] /= count;
            bad |= !isfinite(t[j]);
        }
        for (int64_t i = 0; i < rows; i++) {
            const int64_t row = g0 + i;
            const float *b = r + row * ldr;
            uint16_t *h = halves + row * ldh;
            for (int64_t j = 0; j < c; j++) {
                d[j] = b[j] - t[j];
                h[j] = f32_to_bf16(d[j]);
            }
            for (int64_t j = c; j < c + extra; j++) h[j] = f32_to_bf16(b[j]);
            float *out = norms + 4 * row;
            row_norms4(d, h, b, c, out);
            bad |= !isfinite(out[0]) || !isfinite(out[1]) || !isfinite(out[2]) || !isfinite(out[3]);
        }
    }
    free(d);
    return bad;
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
