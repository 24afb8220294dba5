/* RMSNorm of a few rows: y = x / sqrt(mean(x²) + eps) · w, for the decode and verify steps on CPU.
 *
 * torch's rms_norm on CPU is a composite of ~8 operators; on a [1, 576] row they cost ~20 µs, about 50 times the
 * arithmetic, and a SmolLM2 step runs 61 of them. One call here is the arithmetic plus one ctypes call.
 *
 * Each row is summed in a fixed order (8 lanes, then a fixed horizontal sum, then the scalar tail), so a row's
 * result does not depend on how many rows share the call or on the thread count. Every row count goes through
 * here, prompts too: switching to torch's norm past some size would make a token's activations depend on the
 * batch it ran in (torch sums in another order), and a bf16 greedy tie could then flip between the engine and
 * one-request decoding. bf16 rows are widened to fp32, computed as fp32 rows are,
 * and rounded to nearest even once at the end, as torch computes bf16 norms in fp32. No -ffast-math.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_simd.h"

#define PARALLEL_ROWS 64 /* below this the threads cost more than the rows */

/* 1 / sqrt(mean(x²) + eps) of one fp32 row */
static float inv_rms(const float *x, long D, float eps) {
  v8 acc = (v8){0};
  const long d8 = D & ~7L;
  for (long k = 0; k < d8; k += 8) {
    const v8 v = *(const v8 *)(x + k);
    acc += v * v;
  }
  float s = hsum(acc);
  for (long k = d8; k < D; k++) s += x[k] * x[k];
  return 1.0f / sqrtf(s / (float)D + eps);
}

/* x [M, D] with row stride sx, w [D], y [M, D] contiguous; rows in parallel when there are many (a prompt) */
void dspark_rms_norm_f32(const float *x, long M, long sx, long D, const float *w, float eps, float *y,
                         int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= PARALLEL_ROWS)
  for (long m = 0; m < M; m++) {
    const float *r = x + m * sx;
    const float inv = inv_rms(r, D, eps);
    for (long k = 0; k < D; k++) y[m * D + k] = (r[k] * inv) * w[k];
  }
}

/* the same over bf16 rows and weight */
void dspark_rms_norm_bf16(const uint16_t *x, long M, long sx, long D, const uint16_t *w, float eps, uint16_t *y,
                          int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= PARALLEL_ROWS)
  for (long m = 0; m < M; m++) {
    float row[D]; /* the row widened: a model's width, a few KB of stack */
    for (long k = 0; k < D; k++) row[k] = widen1(x[m * sx + k]);
    const float inv = inv_rms(row, D, eps);
    for (long k = 0; k < D; k++) y[m * D + k] = narrow((row[k] * inv) * widen1(w[k]));
  }
}
