/* densematch's C kernels: every function the library exports, as the Python bindings
 * (densematch/kernels/native.py) call them through ctypes. Each source includes this header, so a
 * definition that drifts from its declaration does not compile; tests/kernels/test_native.py checks the
 * bindings' argument and result types against these lines, and the loader refuses a library whose
 * dm_abi_version() is not DM_ABI_VERSION (a stale build in a cache, a library of another version).
 * Raise DM_ABI_VERSION whenever a declaration changes. One declaration a line. */
#ifndef DENSEMATCH_DM_ABI_H
#define DENSEMATCH_DM_ABI_H

#include <stdint.h>

#define DM_ABI_VERSION 9

int64_t dm_abi_version(void);

/* native.c: distances, merges, the certified step, pair values, local windows */
int dm_minkowski_f32(const float *y, int64_t ldy, const float *x, int64_t ldx, float *out, int64_t osf, int64_t osp, int64_t F, int64_t D, int64_t P, int linf, double scale);
void dm_minkowski_grad_f32(const float *y, int64_t ldy, const float *x, int64_t ldx, const float *g, const float *dist, int64_t ldg, float *gx, int64_t ldgx, float *gy, int64_t ldgy, int64_t F, int64_t D, int64_t P, int linf);
int dm_minkowski_f64(const double *y, int64_t ldy, const double *x, int64_t ldx, double *out, int64_t osf, int64_t osp, int64_t F, int64_t D, int64_t P, int linf, double scale);
void dm_minkowski_grad_f64(const double *y, int64_t ldy, const double *x, int64_t ldx, const double *g, const double *dist, int64_t ldg, double *gx, int64_t ldgx, double *gy, int64_t ldgy, int64_t F, int64_t D, int64_t P, int linf);
void dm_sqnorms_f32(const float *x, int64_t ldx, float *out, int64_t D, int64_t P);
void dm_l2_finish_f32(const float *t, int64_t ldt, const float *rows, const float *cols, float *out, int64_t osf, int64_t osp, int64_t F, int64_t P, int root, float *colmin);
void dm_l2_weights_f32(const float *g, int64_t gsf, int64_t gsp, const float *dist, int64_t dsf, int64_t dsp, float *w, float *colsum, float *rowsum, int64_t F, int64_t P, int root);
void dm_sqnorms_f64(const double *x, int64_t ldx, double *out, int64_t D, int64_t P);
void dm_l2_finish_f64(const double *t, int64_t ldt, const double *rows, const double *cols, double *out, int64_t osf, int64_t osp, int64_t F, int64_t P, int root, double *colmin);
void dm_l2_weights_f64(const double *g, int64_t gsf, int64_t gsp, const double *dist, int64_t dsf, int64_t dsp, double *w, double *colsum, double *rowsum, int64_t F, int64_t P, int root);
void dm_merge_f32(const float *s, int64_t lds, int64_t m, int64_t n, int64_t offset, float *best_v, int64_t *best_i, int64_t k, const float *margin, int64_t cap, int64_t *cand_cols, float *cand_vals, int *counts, unsigned char *over);
void dm_merge_f64(const double *s, int64_t lds, int64_t m, int64_t n, int64_t offset, double *best_v, int64_t *best_i, int64_t k, const double *margin, int64_t cap, int64_t *cand_cols, double *cand_vals, int *counts, unsigned char *over);
void dm_merge_pairs_f32(const int64_t *rows, const int64_t *cols, const float *score, int64_t count, float *best_v, int64_t *best_i, int64_t k);
void dm_merge_pairs_f64(const int64_t *rows, const int64_t *cols, const double *score, int64_t count, double *best_v, int64_t *best_i, int64_t k);
int64_t dm_list_reaching_f32(const int64_t *cols, const float *vals, const int *counts, const unsigned char *over, int64_t m, int64_t cap, const float *floor, int64_t *rows, int64_t *cols_out);
int64_t dm_list_reaching_f64(const int64_t *cols, const double *vals, const int *counts, const unsigned char *over, int64_t m, int64_t cap, const double *floor, int64_t *rows, int64_t *cols_out);
int64_t dm_merge_certified_bf16(const uint16_t *h, int64_t ldh, int64_t m, int64_t n, int64_t offset, const float *bias, const float *gp, int64_t ldg, const float *gq, const float *gt, const float *qt, const float *rt, int64_t ldr, float rounding, float *best_v, int64_t *best_i, int64_t k, int64_t cap, int64_t *cand_cols, float *cand_vals, int *counts, unsigned char *over, float *scratch);
void dm_merge_bf16(const uint16_t *s, int64_t lds, int64_t m, int64_t n, int64_t offset, float *best_v, int64_t *best_i, int64_t k, const float *bias);
void dm_row_norms_bf16(const float *x, int64_t ldx, const uint16_t *h, int64_t ldh, const float *u, int64_t ldu, int64_t n, int64_t c, float *out);
int dm_group_bf16(const float *r, int64_t ldr, int64_t n, int64_t c, int64_t extra, int64_t size, float *centres, uint16_t *halves, int64_t ldh, float *norms);
void dm_cosine_terms_f32(const float *x, int64_t ldx, int64_t m, int64_t C, float *out);
void dm_pair_values_f32(const float *q, int64_t ldq, const int64_t *qidx, const float *r, int64_t ldr, const int64_t *idx, int64_t m, int64_t k, int64_t C, int kind, const float *rterms, float *out);
void dm_cosine_terms_f64(const double *x, int64_t ldx, int64_t m, int64_t C, double *out);
void dm_pair_values_f64(const double *q, int64_t ldq, const int64_t *qidx, const double *r, int64_t ldr, const int64_t *idx, int64_t m, int64_t k, int64_t C, int kind, const double *rterms, double *out);
void dm_local_values_f32(const float *a, const float *b, int64_t H, int64_t W, int64_t C, const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0, int64_t y1, int kind, float *out);
int dm_local_planar_f32(const float *a, const float *b, int64_t H, int64_t W, int64_t C, const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0, int64_t y1, int kind, float *out);
void dm_local_values_f64(const double *a, const double *b, int64_t H, int64_t W, int64_t C, const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0, int64_t y1, int kind, double *out);
int dm_local_planar_f64(const double *a, const double *b, int64_t H, int64_t W, int64_t C, const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0, int64_t y1, int kind, double *out);
int dm_local_flow_f32(const float *a, const float *b, int64_t H, int64_t W, int64_t C, const float *flow, int bilinear, const uint8_t *mask_b, const int64_t *oy, const int64_t *ox, int64_t m, int64_t grid_cols, int64_t y0, int64_t y1, int kind, int linear, float *out, uint8_t *valid);
int dm_local_flow_f64(const double *a, const double *b, int64_t H, int64_t W, int64_t C, const double *flow, int bilinear, const uint8_t *mask_b, const int64_t *oy, const int64_t *ox, int64_t m, int64_t grid_cols, int64_t y0, int64_t y1, int kind, int linear, double *out, uint8_t *valid);
void dm_local_flow_grad_f32(const float *a, const float *b, int64_t H, int64_t W, int64_t C, const float *flow, int bilinear, const uint8_t *mask_b, const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0, int64_t y1, const float *grad, float *ga, float *gb, float *gf);
void dm_local_flow_grad_f64(const double *a, const double *b, int64_t H, int64_t W, int64_t C, const double *flow, int bilinear, const uint8_t *mask_b, const int64_t *oy, const int64_t *ox, int64_t m, int64_t y0, int64_t y1, const double *grad, double *ga, double *gb, double *gf);

/* align.c: align's refinement, cross term, grid scores, whole grid, best shifts, candidates, warp, the level rule's band share, and the whole search */
int dm_align_refine(const double *t, const double *x, const double *wt, int wt_shared, int64_t C, int64_t h, int64_t w, int64_t H, int64_t W, const int64_t *owner, int64_t m, int P, const double *range, int iterations, double tolerance, double *p, double *out);
void dm_align_pick(const double *best, const int64_t *where, int64_t B, int64_t P, int64_t S, const double *grid_h, const double *grid_w, int64_t nw, int64_t n_x, const double *near, int64_t n, int64_t M, int64_t *order, double *params, unsigned char *alive, double *out);
int dm_align_cross_f32(const float *a, const float *t, const int64_t *i0, const int64_t *i1, const float *w0, const float *w1, int64_t B, int64_t C, int64_t nh, int64_t rows, int64_t W, int64_t h, int64_t w, int64_t nw, int64_t cols, int64_t ny, int64_t nx, float *out);
int dm_align_cross_f64(const double *a, const double *t, const int64_t *i0, const int64_t *i1, const double *w0, const double *w1, int64_t B, int64_t C, int64_t nh, int64_t rows, int64_t W, int64_t h, int64_t w, int64_t nw, int64_t cols, int64_t ny, int64_t nx, double *out);
int dm_align_scores_f32(const float *a, const float *t, const int64_t *i0, const int64_t *i1, const float *w0, const float *w1, int64_t B, int64_t C, int64_t nh, int64_t rows, int64_t W, int64_t h, int64_t w, int64_t nw, int64_t cols, int64_t ny, int64_t nx, int ncc, float *out);
int dm_align_scores_f64(const double *a, const double *t, const int64_t *i0, const int64_t *i1, const double *w0, const double *w1, int64_t B, int64_t C, int64_t nh, int64_t rows, int64_t W, int64_t h, int64_t w, int64_t nw, int64_t cols, int64_t ny, int64_t nx, int ncc, double *out);
int dm_align_warp_f32(const float *x, const double *params, int64_t M, int64_t C, int64_t H, int64_t W, int64_t h, int64_t w, float *out);
int dm_align_warp_f64(const double *x, const double *params, int64_t M, int64_t C, int64_t H, int64_t W, int64_t h, int64_t w, double *out);
int dm_align_band_f32(const float *t, const double *wt, int64_t wt_per_pair, int64_t B, int64_t C, int64_t h, int64_t w, const double *rows, int64_t ny2, const double *cols, int64_t nx2, double *least);
int dm_align_band_f64(const double *t, const double *wt, int64_t wt_per_pair, int64_t B, int64_t C, int64_t h, int64_t w, const double *rows, int64_t ny2, const double *cols, int64_t nx2, double *least);
int dm_align_grid_f32(const float *x, const float *t, const int64_t *r0, const int64_t *r1, const float *v0, const float *v1, const int64_t *i0, const int64_t *i1, const float *w0, const float *w1, int64_t B, int64_t C, int64_t H, int64_t W, int64_t h, int64_t w, int64_t nh, int64_t rows, int64_t nw, int64_t cols, int64_t ny, int64_t nx, const int64_t *max_y, const int64_t *max_x, int ncc, int64_t K, float *best, int64_t *where);
int dm_align_grid_f64(const double *x, const double *t, const int64_t *r0, const int64_t *r1, const double *v0, const double *v1, const int64_t *i0, const int64_t *i1, const double *w0, const double *w1, int64_t B, int64_t C, int64_t H, int64_t W, int64_t h, int64_t w, int64_t nh, int64_t rows, int64_t nw, int64_t cols, int64_t ny, int64_t nx, const int64_t *max_y, const int64_t *max_x, int ncc, int64_t K, double *best, int64_t *where);
void dm_align_best_shifts_f32(const float *score, int64_t M, int64_t ny, int64_t nx, int64_t K, float *best, int64_t *where);
void dm_align_best_shifts_f64(const double *score, int64_t M, int64_t ny, int64_t nx, int64_t K, double *best, int64_t *where);
int dm_align_search_f32(const float *t, const float *x, const float *wt, const float *total, const int64_t *sizes, const double *reals, const int64_t *r0, const int64_t *r1, const float *v0, const float *v1, const int64_t *i0, const int64_t *i1, const float *w0, const float *w1, const int64_t *max_y, const int64_t *max_x, const double *grid_h, const double *grid_w, float *best, int64_t *where, float *landscape, float *shifts, float *answer, float *error, float *warped, float *relative);
int dm_align_search_f64(const double *t, const double *x, const double *wt, const double *total, const int64_t *sizes, const double *reals, const int64_t *r0, const int64_t *r1, const double *v0, const double *v1, const int64_t *i0, const int64_t *i1, const double *w0, const double *w1, const int64_t *max_y, const int64_t *max_x, const double *grid_h, const double *grid_w, double *best, int64_t *where, double *landscape, double *shifts, double *answer, double *error, double *warped, double *relative);

/* certify.c: certify_alignment's bound */
int dm_certify_bound(const double *image, const double *tpl, int64_t C, int64_t h, int64_t w, int64_t H, int64_t W, const double *cells, int64_t M, const double *half, const double *pivot, const int64_t *rows, int64_t n_rows, int exact, int squared, double stop, const double *floors, double *out, double *row_sums);

#endif
