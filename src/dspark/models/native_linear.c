/* y = x · Wᵀ (+ b) for a few rows of x: the matrix-vector products of a decode or verify step on CPU.
 *
 * Decode-sized products are bound by reading W once from memory. One row of x streams a block of ROWS rows of W
 * (16 accumulators in registers, 16 sequential weight streams for the prefetcher: the fastest of 4, 8 and 16 on
 * the dev machine). Two or more rows go through register tiles of MT x rows by NT W rows instead, so each W vector
 * loaded feeds MT multiply-adds and each x vector NT of them: with one row per call a 4-row product cost 4 times
 * the loads of a 1-row one, and this kernel lost to oneDNN's packed product from 3-4 rows up. 2 x 6 (12
 * accumulators, two x and one W register: 15 of AVX2's 16) was the fastest of 2x4, 2x5, 2x6, 3x4 and 4x3.
 * AVX-512VL gives 256-bit code 32 registers, and there 2 x 12 (24 accumulators; 12 weight streams, closer to the
 * one-row path's 16) cut SmolLM2's projections at 2 rows from 21.4 to 20.1 ms, at 8 from 32.7 to 30.3 (session 38,
 * results/kernels-s38); 2 x 8 and 2 x 14 gained less in single runs.
 *
 * Every output is one chain of 8-lane fused multiply-adds over k in order, a fixed horizontal sum, then the
 * scalar tail, whichever path computed it, so a row's result does not depend on how many rows share the call nor
 * on the thread count. The multiply-add is explicit (madd) and the file is built with -ffp-contract=off: left to
 * the compiler, contraction into FMA differed between the tile and the one-row code and broke that invariance.
 * No -ffast-math: IEEE arithmetic only. Built by models/native.py with the system C compiler (GCC vector
 * extensions, OpenMP).
 */
#include <stddef.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));  /* aligned(4): rows need not be 32-byte aligned */

#define ROWS 16 /* W rows per block for a single x row */
#define MT 2    /* x rows per tile */
#ifdef __AVX512VL__
#define NT 12   /* W rows per tile: 24 accumulators, two x and one W register of 32 */
#else
#define NT 6    /* W rows per tile: 12 accumulators, two x and one W register of AVX2's 16 */
#endif
#define NB 24   /* W rows per parallel work item when tiling (a multiple of NT) */

#ifdef __FMA__
#include <immintrin.h>
static inline v8 madd(v8 acc, v8 a, v8 b) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc); }
#else
static inline v8 madd(v8 acc, v8 a, v8 b) { return acc + a * b; }
#endif

static inline float hsum(v8 a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static inline float finish(v8 acc, const float *x, const float *w, long k8, long K, const float *bias) {
  float s = hsum(acc);
  for (long k = k8; k < K; k++) s += w[k] * x[k];
  return bias ? s + *bias : s;
}

/* One x row against nw ≤ ROWS rows of W. Inlined with a constant nw, the loops unroll into registers. */
static inline __attribute__((always_inline)) void block(const float *x, const float *w, int nw, long K,
                                                         const float *bias, float *y) {
  v8 acc[ROWS];
  for (int r = 0; r < ROWS; r++) acc[r] = (v8){0};
  const long k8 = K & ~7L;
  for (long k = 0; k < k8; k += 8) {
    const v8 xv = *(const v8 *)(x + k);
    for (int r = 0; r < nw; r++) acc[r] = madd(acc[r], *(const v8 *)(w + r * K + k), xv);
  }
  for (int r = 0; r < nw; r++) y[r] = finish(acc[r], x, w + r * K, k8, K, bias ? bias + r : NULL);
}

/* Rows x[0..MT) against W rows w[0..NT); y has row stride N. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, long K, const float *bias,
                                                        float *y, long N) {
  v8 acc[MT][NT];
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < NT; r++) acc[m][r] = (v8){0};
  const long k8 = K & ~7L;
  for (long k = 0; k < k8; k += 8) {
    v8 xv[MT];
    for (int m = 0; m < MT; m++) xv[m] = *(const v8 *)(x + m * K + k);
    for (int r = 0; r < NT; r++) {
      const v8 wv = *(const v8 *)(w + r * K + k);
      for (int m = 0; m < MT; m++) acc[m][r] = madd(acc[m][r], wv, xv[m]);
    }
  }
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < NT; r++) y[m * N + r] = finish(acc[m][r], x + m * K, w + r * K, k8, K, bias ? bias + r : NULL);
}

/* x rows [m0, m1) against W rows [n, n1), one row at a time in blocks of at most ROWS. */
static void rows_one_by_one(const float *x, long m0, long m1, const float *w, const float *bias, long n, long n1,
                            long N, long K, float *y) {
  for (long m = m0; m < m1; m++)
    for (long j = n; j < n1; j += ROWS) {
      const float *b = bias ? bias + j : NULL;
      if (n1 - j >= ROWS) block(x + m * K, w + j * K, ROWS, K, b, y + m * N + j);
      else block(x + m * K, w + j * K, (int)(n1 - j), K, b, y + m * N + j);
    }
}

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all row-major and contiguous. */
void dspark_linear(const float *x, long M, const float *w, const float *bias, long N, long K, float *y,
                   int threads) {
  if (M == 1) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n += ROWS) rows_one_by_one(x, 0, 1, w, bias, n, n + ROWS < N ? n + ROWS : N, N, K, y);
    return;
  }
  const long mt = M - M % MT; /* x rows covered by tiles; an odd last row goes alone */
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long n = 0; n < N; n += NB) {
    const long n1 = n + NB < N ? n + NB : N;
    const long j1 = n + (n1 - n) / NT * NT; /* W rows covered by tiles */
    for (long j = n; j < j1; j += NT)  /* each NT-row slice of W is reused by every x tile while cached */
      for (long m = 0; m < mt; m += MT) tile(x + m * K, w + j * K, K, bias ? bias + j : NULL, y + m * N + j, N);
    rows_one_by_one(x, 0, mt, w, bias, j1, n1, N, K, y);
    rows_one_by_one(x, mt, M, w, bias, n, n1, N, K, y);
  }
}
