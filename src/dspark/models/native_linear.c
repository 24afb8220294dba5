/* y = x · Wᵀ (+ b) for a few rows of x: the matrix-vector products of a decode step on CPU.
 *
 * Decode-sized products are bound by reading W once from memory, so the kernel streams a block of ROWS rows of W
 * and dots each x row with the whole block while the block is still in L1 (x rows are small and stay cached).
 * Each output is one dot product summed in a fixed order (8-lane partial sums over k, a fixed horizontal sum, then
 * the scalar tail), so a row's result does not depend on how many rows share the call, nor on the thread count.
 * No -ffast-math: IEEE arithmetic only. Built by models/native.py with the system C compiler (GCC vector
 * extensions, OpenMP). ROWS = 16 was the fastest of 4, 8 and 16 on the dev machine (16 accumulators in registers,
 * 16 sequential weight streams for the prefetcher).
 */
#include <stddef.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));  /* aligned(4): rows need not be 32-byte aligned */

#define ROWS 16

static inline float hsum(v8 a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* One x row against nw ≤ ROWS rows of W. Inlined with a constant nw, the loops unroll into registers. */
static inline __attribute__((always_inline)) void block(const float *x, const float *w, int nw, long K,
                                                         const float *bias, float *y) {
  v8 acc[ROWS];
  for (int r = 0; r < ROWS; r++) acc[r] = (v8){0};
  const long k8 = K & ~7L;
  for (long k = 0; k < k8; k += 8) {
    const v8 xv = *(const v8 *)(x + k);
    for (int r = 0; r < nw; r++) acc[r] += *(const v8 *)(w + r * K + k) * xv;
  }
  for (int r = 0; r < nw; r++) {
    float s = hsum(acc[r]);
    for (long k = k8; k < K; k++) s += w[r * K + k] * x[k];
    y[r] = bias ? s + bias[r] : s;
  }
}

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all row-major and contiguous. */
void dspark_linear(const float *x, long M, const float *w, const float *bias, long N, long K, float *y,
                   int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long n = 0; n < N; n += ROWS) {
    const float *b = bias ? bias + n : NULL;
    for (long m = 0; m < M; m++) {
      if (N - n >= ROWS)
        block(x + m * K, w + n * K, ROWS, K, b, y + m * N + n);
      else
        block(x + m * K, w + n * K, (int)(N - n), K, b, y + m * N + n);
    }
  }
}
