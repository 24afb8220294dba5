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
 * bf16 (session 39): the same blocks and tiles over bf16 x and W, each step one vdpbf16ps (16 bf16 values, fp32
 * sums of pairs; AVX512-BF16 only, `dspark_linear_bf16_supported`), each output rounded once to bf16 as oneDNN's
 * bf16 product rounds. A bf16 target had no C kernel; with this one its one-token forward went from 17.2 to 15.2
 * ms (SmolLM2, interleaved: `scripts/pad_cost.py --toggle native`, results/native-cost-s39). From 2 rows oneDNN
 * (padded) is as fast or faster, and kernel_choice measures where (results/kernels-s39/routes-bf16.json).
 * Session 53: on CPUs without AVX512-BF16 (AVX2) the same sums come from two fp32 multiply-adds over the
 * widened pairs (dot2), and bf16 blocks and tiles prefetch the W rows that follow them: with 16 short row streams
 * (576 bf16 values) the hardware prefetcher left a one-row bf16 product barely faster than fp32 (SmolLM2's LM
 * head on the AVX2 EPYC: 3.86 ms bf16 against 4.53 fp32; with the prefetch 2.38). On the 576-wide shapes it
 * gains 1.3-1.6x at 1-4 rows, ~1.1-1.2x at 8, nothing on 1,536-wide rows; fp32 with it took 0.89-1.24x its time
 * without (median 1.03x), so fp32 does not prefetch (scripts/linear_prefetch_cost.py, results/bf16-avx2-s53).
 * A bf16 SmolLM2 forward after 300 tokens, 1 / 2 / 4 / 8 rows: 1.41 / 1.57 / 1.36 / 1.18x faster than fp32
 * (scripts/dtype_forward_cost.py, same folder).
 * No -ffast-math: IEEE arithmetic only. Built by models/native.py with the system C compiler (GCC vector
 * extensions, OpenMP).
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "native_simd.h"

#define ROWS 16 /* W rows per block for a single x row */
#define MT 2    /* x rows per tile */
#ifdef __AVX512VL__
#define NT 12   /* W rows per tile: 24 accumulators, two x and one W register of 32 */
#else
#define NT 6    /* W rows per tile: 12 accumulators, two x and one W register of AVX2's 16 */
#endif
#define NB 24   /* W rows per parallel work item when tiling (a multiple of NT) */

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define HAS_BF16 1
/* acc[i] + w[2i]·x[2i] + w[2i+1]·x[2i+1] over the 16 bf16 values held in each of w and x (one vdpbf16ps) */
static inline v8 dot2(v8 acc, v8 w, v8 x) { return (v8)_mm256_dpbf16_ps((__m256)acc, (__m256bh)w, (__m256bh)x); }
#elif defined(__AVX2__)
#define HAS_BF16 1
/* The same sum with no bf16 instructions (AVX2, session 53): each 32-bit lane holds a pair of bf16 values; the
 * even one shifted up and the odd one masked are exact fp32 numbers, in two integer ops (no shuffles). A product
 * of two bf16 values is exact in fp32, so the two multiply-adds round only their sums, in a fixed order. This
 * halves the bytes a decode step reads against fp32 weights, on CPUs without AVX512-BF16. */
typedef unsigned int v8u __attribute__((vector_size(32), aligned(4)));
static inline v8 even(v8 v) { return (v8)((v8u)v << 16); }
static inline v8 odd(v8 v) { return (v8)((v8u)v & 0xffff0000u); }
static inline v8 dot2(v8 acc, v8 w, v8 x) { return madd(madd(acc, even(w), even(x)), odd(w), odd(x)); }
#else
#define HAS_BF16 0
static inline v8 dot2(v8 acc, v8 w, v8 x) { (void)w; (void)x; return acc; } /* never called */
#endif

/* Whether dspark_linear_bf16 may be called: it needs AVX512-BF16's dot products or AVX2's integer vectors. */
int dspark_linear_bf16_supported(void) { return HAS_BF16; }

/* Elements per step of the k loop: 8 fp32 lanes, or 16 bf16 values (8 pairs) for dot2. */
#define STEP(bf) ((bf) ? 16L : 8L)

/* 32 bytes at element k of an fp32 or bf16 array: 8 fp32 lanes, or 16 bf16 values as dot2 reads them. */
static inline __attribute__((always_inline)) v8 load(const void *p, long k, int bf) {
  return bf ? *(const v8 *)((const bf16 *)p + k) : *(const v8 *)((const float *)p + k);
}

/* acc += one step's products of a W vector and an x vector (inlined with a constant bf). */
static inline __attribute__((always_inline)) v8 step(v8 acc, v8 w, v8 x, int bf) {
  return bf ? dot2(acc, w, x) : madd(acc, w, x);
}

/* The sum of acc's lanes, the scalar tail k0 <= k < K and the bias, stored to *y (bf16: rounded once). */
static inline __attribute__((always_inline)) void finish(v8 acc, const void *x, const void *w, long k0, long K,
                                                         const void *bias, void *y, int bf) {
  float s = hsum(acc);
  if (bf) {
    for (long k = k0; k < K; k++) s += widen1(((const bf16 *)w)[k]) * widen1(((const bf16 *)x)[k]);
    *(bf16 *)y = narrow(bias ? s + widen1(*(const bf16 *)bias) : s);
  } else {
    for (long k = k0; k < K; k++) s += ((const float *)w)[k] * ((const float *)x)[k];
    *(float *)y = bias ? s + *(const float *)bias : s;
  }
}

/* Pointer to element i of an fp32 or bf16 array; NULL stays NULL (an absent bias). */
static inline __attribute__((always_inline)) const void *at(const void *p, long i, int bf) {
  if (!p) return NULL;
  return bf ? (const void *)((const bf16 *)p + i) : (const void *)((const float *)p + i);
}

/* Which blocks and tiles prefetch the W rows after them (see ahead): bf16 ones. Built with -DDSPARK_PREFETCH=0,
 * 1 or 2: none, bf16 (the default), both (scripts/linear_prefetch_cost.py compares the builds). */
#ifndef DSPARK_PREFETCH
#define DSPARK_PREFETCH 1
#endif
#define PREFETCHES(bf) ((bf) ? DSPARK_PREFETCH >= 1 : DSPARK_PREFETCH >= 2)

/* Bytes of the W rows after a block or tile that it prefetches while it runs (see ahead). */
static inline long ahead_bytes(long rows_left, long rows, long K, int bf) {
  return rows_left <= 0 ? 0 : (rows_left < rows ? rows_left : rows) * K * (bf ? 2L : 4L);
}

/* Prefetch lines [i * per, (i + 1) * per) of the `bytes` after p. A block reads its W rows as that many short
 * streams (a SmolLM2 row is 18 cache lines in bf16), which the hardware prefetcher only catches once each has
 * begun; the rows that follow are contiguous, so the block fetches them ahead as one sequential run. */
static inline __attribute__((always_inline)) void ahead(const char *p, long bytes, long i, long per) {
  for (long b = i * per * 64; b < (i + 1) * per * 64 && b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* One x row against nw ≤ ROWS rows of W, prefetching the `pf` bytes after them. Inlined with constant nw and
 * bf, the loops unroll into registers. */
static inline __attribute__((always_inline)) void block(const void *x, const void *w, int nw, long K,
                                                         const void *bias, void *y, int bf, long pf) {
  v8 acc[ROWS];
  for (int r = 0; r < ROWS; r++) acc[r] = (v8){0};
  const long ks = K & ~(STEP(bf) - 1);
  const char *next = (const char *)at(w, nw * K, bf);
  const long per = ks ? (pf / 64 + ks / STEP(bf)) / (ks / STEP(bf)) : 0; /* lines to prefetch per k step */
  for (long k = 0; k < ks; k += STEP(bf)) {
    if (PREFETCHES(bf)) ahead(next, pf, k / STEP(bf), per);
    const v8 xv = load(x, k, bf);
    for (int r = 0; r < nw; r++) acc[r] = step(acc[r], load(w, r * K + k, bf), xv, bf);
  }
  for (int r = 0; r < nw; r++) finish(acc[r], x, at(w, r * K, bf), ks, K, at(bias, r, bf), (void *)at(y, r, bf), bf);
}

/* Rows x[0..MT) against W rows w[0..NT), prefetching the `pf` bytes after them; y has row stride N. */
static inline __attribute__((always_inline)) void tile(const void *x, const void *w, long K, const void *bias,
                                                        void *y, long N, int bf, long pf) {
  v8 acc[MT][NT];
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < NT; r++) acc[m][r] = (v8){0};
  const long ks = K & ~(STEP(bf) - 1);
  const char *next = (const char *)at(w, NT * K, bf);
  const long per = ks ? (pf / 64 + ks / STEP(bf)) / (ks / STEP(bf)) : 0; /* lines to prefetch per k step */
  for (long k = 0; k < ks; k += STEP(bf)) {
    if (PREFETCHES(bf)) ahead(next, pf, k / STEP(bf), per);
    v8 xv[MT];
    for (int m = 0; m < MT; m++) xv[m] = load(x, m * K + k, bf);
    for (int r = 0; r < NT; r++) {
      const v8 wv = load(w, r * K + k, bf);
      for (int m = 0; m < MT; m++) acc[m][r] = step(acc[m][r], wv, xv[m], bf);
    }
  }
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < NT; r++)
      finish(acc[m][r], at(x, m * K, bf), at(w, r * K, bf), ks, K, at(bias, r, bf), (void *)at(y, m * N + r, bf), bf);
}

/* x rows [m0, m1) against W rows [n, n1), one row at a time in blocks of at most ROWS. */
static inline __attribute__((always_inline)) void rows_one_by_one(const void *x, long m0, long m1, const void *w,
                                                                   const void *bias, long n, long n1, long N, long K,
                                                                   void *y, int bf) {
  for (long m = m0; m < m1; m++)
    for (long j = n; j < n1; j += ROWS) {
      const void *xm = at(x, m * K, bf), *wj = at(w, j * K, bf), *bj = at(bias, j, bf);
      void *ym = (void *)at(y, m * N + j, bf);
      const long pf = m == m0 ? ahead_bytes(N - j - ROWS, ROWS, K, bf) : 0; /* later x rows find W cached */
      if (n1 - j >= ROWS) block(xm, wj, ROWS, K, bj, ym, bf, pf);
      else block(xm, wj, (int)(n1 - j), K, bj, ym, bf, 0);
    }
}

/* Work item n of a product of M >= 2 rows: W rows [n, n + NB) against every x row. */
static inline __attribute__((always_inline)) void tiled_item(const void *x, long M, const void *w, const void *bias,
                                                              long n, long N, long K, void *y, int bf) {
  const long mt = M - M % MT; /* x rows covered by tiles; an odd last row goes alone */
  const long n1 = n + NB < N ? n + NB : N;
  const long j1 = n + (n1 - n) / NT * NT; /* W rows covered by tiles */
  for (long j = n; j < j1; j += NT)  /* each NT-row slice of W is reused by every x tile while cached */
    for (long m = 0; m < mt; m += MT)
      tile(at(x, m * K, bf), at(w, j * K, bf), K, at(bias, j, bf), (void *)at(y, m * N + j, bf), N, bf,
           m ? 0 : ahead_bytes(N - j - NT, NT, K, bf)); /* later x tiles find the slice cached */
  rows_one_by_one(x, 0, mt, w, bias, j1, n1, N, K, y, bf);
  rows_one_by_one(x, mt, M, w, bias, n, n1, N, K, y, bf);
}

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]: row-major and contiguous, all fp32 or (BF) all bf16. A macro,
 * not an inline function: GCC outlines an OpenMP region before inlining, so a region inside a shared function
 * received bf as a run-time value and tested it in the inner loops (fp32 ran slower at 3-8 rows). */
#define LINEAR(x, M, w, bias, N, K, y, threads, BF)                                                              \
  do {                                                                                                          \
    if ((M) == 1) {                                                                                             \
      _Pragma("omp parallel for schedule(static) num_threads(threads)")                                        \
      for (long n = 0; n < (N); n += ROWS)                                                                      \
        rows_one_by_one(x, 0, 1, w, bias, n, n + ROWS < (N) ? n + ROWS : (N), N, K, y, BF);                     \
    } else {                                                                                                    \
      _Pragma("omp parallel for schedule(static) num_threads(threads)")                                        \
      for (long n = 0; n < (N); n += NB) tiled_item(x, M, w, bias, n, N, K, y, BF);                             \
    }                                                                                                           \
  } while (0)

void dspark_linear(const float *x, long M, const float *w, const float *bias, long N, long K, float *y, int threads) {
  LINEAR(x, M, w, bias, N, K, y, threads, 0);
}

/* The same for bf16 x, w, bias and y, with fp32 sums (dot2 steps) and each output rounded once to bf16. Call it
 * only where dspark_linear_bf16_supported() says so. */
void dspark_linear_bf16(const bf16 *x, long M, const bf16 *w, const bf16 *bias, long N, long K, bf16 *y,
                        int threads) {
  if (HAS_BF16) LINEAR(x, M, w, bias, N, K, y, threads, 1);
}
