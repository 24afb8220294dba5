/* What the C kernels share (native_linear.c, native_norm.c, native_attention.c): the 8-lane fp32 vector, the
 * explicit multiply-add, the fixed-order horizontal sum and the scalar bf16 <-> fp32 conversions.
 *
 * Each kernel promises that a row's result depends neither on the other rows of its call nor on the thread
 * count, and that promise rests on these: every sum ends in the same hsum tree, and every multiply-add is
 * madd (the files are built with -ffp-contract=off, so the compiler fuses nothing on its own). Keeping one copy
 * keeps the kernels' arithmetic the same. Included by each source; native.py hashes it with them.
 */
#ifndef DSPARK_NATIVE_SIMD_H
#define DSPARK_NATIVE_SIMD_H

#include <string.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));  /* aligned(4): rows need not be 32-byte aligned */
typedef unsigned short bf16;

#ifdef __FMA__
#include <immintrin.h>
static inline v8 madd(v8 acc, v8 a, v8 b) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc); }
#else
static inline v8 madd(v8 acc, v8 a, v8 b) { return acc + a * b; }
#endif

/* The lanes' sum in one fixed order, whatever path produced them. */
static inline float hsum(v8 a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* bf16 -> fp32: exact, bf16 is fp32's top half. */
static inline float widen1(bf16 h) {
  const unsigned u = (unsigned)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* fp32 -> the nearest bf16, ties to even; NaN becomes the quiet NaN 0x7fc0, as torch rounds. */
static inline bf16 narrow(float f) {
  unsigned u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
