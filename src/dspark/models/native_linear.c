/* y = x · Wᵀ (+ b) for a few rows of x: the matrix-vector products of a decode step on CPU.
 *
 * Decode-sized products are bound by reading W once from memory, so the kernel streams ROWS rows of W at a time
 * and multiplies each against every row of x while it is in registers. Each output is one dot product summed in a
 * fixed order (8-lane partial sums over k, a fixed horizontal sum, then the scalar tail), so a row's result does
 * not depend on how many rows share the call, nor on the thread count. No -ffast-math: IEEE arithmetic only.
 * Built by models/native.py with the system C compiler (GCC vector extensions, OpenMP).
 */
#include <stddef.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));  /* aligned(4): rows need not be 32-byte aligned */

#define ROWS 4  /* rows of W per block: 4 independent FMA chains per x row hide the FMA latency */
#define XMAX 4  /* rows of x per pass over a block */

static inline float hsum(v8 a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* Inlined with constant nx / nw, the loops below unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block(const float *x, int nx, const float *w, int nw, long K,
                                                         const float *bias, float *y, long ldy) {
  v8 acc[ROWS][XMAX];
  for (int r = 0; r < ROWS; r++)
    for (int j = 0; j < XMAX; j++) acc[r][j] = (v8){0};
  const long k8 = K & ~7L;
  for (long k = 0; k < k8; k += 8) {
    v8 xv[XMAX];
    for (int j = 0; j < nx; j++) xv[j] = *(const v8 *)(x + j * K + k);
    for (int r = 0; r < nw; r++) {
      const v8 wv = *(const v8 *)(w + r * K + k);
      for (int j = 0; j < nx; j++) acc[r][j] += wv * xv[j];
    }
  }
  for (int r = 0; r < nw; r++)
    for (int j = 0; j < nx; j++) {
      float s = hsum(acc[r][j]);
      for (long k = k8; k < K; k++) s += w[r * K + k] * x[j * K + k];
      y[j * ldy + r] = bias ? s + bias[r] : s;
    }
}

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all row-major and contiguous. */
void dspark_linear(const float *x, long M, const float *w, const float *bias, long N, long K, float *y,
                   int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long n = 0; n < N; n += ROWS) {
    const int nw = N - n < ROWS ? (int)(N - n) : ROWS;
    const float *b = bias ? bias + n : NULL;
    for (long m = 0; m < M; m += XMAX) {
      const int nx = M - m < XMAX ? (int)(M - m) : XMAX;
      const float *xm = x + m * K, *wn = w + n * K;
      float *ym = y + m * N + n;
      if (nw < ROWS) { block(xm, nx, wn, nw, K, b, ym, N); continue; }
      switch (nx) {
        case 1: block(xm, 1, wn, ROWS, K, b, ym, N); break;
        case 2: block(xm, 2, wn, ROWS, K, b, ym, N); break;
        case 3: block(xm, 3, wn, ROWS, K, b, ym, N); break;
        default: block(xm, XMAX, wn, ROWS, K, b, ym, N); break;
      }
    }
  }
}
