/* Attention for a ragged batch of short query segments (decode and verification blocks), each against its own
 * request's KV cache, in one call per layer — with the cache writes of the new keys and values.
 *
 * Why: torch's path is one scaled_dot_product_attention call (plus two cache writes and a copy out) per request
 * per layer; at 16 one-token requests that Python loop cost more than the attention's arithmetic. Here the new
 * rows are written into the caches first, then the work is split into tasks of (request, KV head, up to CHUNK
 * queries): for every query in the chunk and every query head sharing that KV head, scores over its visible keys,
 * a softmax with the maximum subtracted (exp vectorised: scalar expf made the kernel slower than torch's for
 * multi-token segments), and the weighted sum of values.
 * Register blocking (session 39): scores run 8 keys at a time for QB query rows (each key chunk loaded once into
 * QB x 8 accumulators, the 8 dot products reduced together by hsum8), the weighted sum QB rows at a time with
 * their 64-value accumulators in registers (each value chunk loaded once for the QB rows). One layer's attention on
 * SmolLM2's shapes got 1.4-2.1x faster than the one-dot-at-a-time loop (scripts/attention_kernel_cost.py).
 * Session 47 (perf on an AVX-512 Xeon, one 8-token block after 300 tokens): 16-lane vectors where AVX-512 is there,
 * the bf16 widening by intrinsics (GCC split a 16-lane one in three), a vectorised row maximum (the scalar one was a
 * chain of dependent compares) and no empty pass over the keys for a head size that is a multiple of the lane
 * width: 1.3-2.1x per layer call again (results/attention-kernel-s47).
 * Every score is the same chain of operations in the blocked and the one-key path, and masked keys add exact
 * zeros, so a row's result depends neither on the other requests in the call, nor on the thread count, nor on
 * how many rows its segment has: a verified draft token sees bitwise what plain decoding of it would. The
 * multiply-adds are explicit (madd) and the file is built with -ffp-contract=off: left to the compiler,
 * contraction differed between the blocked and the one-key code.
 * bf16 caches (a bf16 target): the same kernel reads and writes bf16 and computes in fp32 — each query row, key
 * and value is widened as the task reads it (exact: bf16 is fp32's top half) and each output rounded to the nearest
 * bf16, ties to even, as torch rounds. torch's per-request path cost more than the arithmetic in bf16 too (16
 * one-token requests: 60 ms a step against 32 ms for one 16-token request, scripts/segment_cost.py).
 * No -ffast-math: IEEE arithmetic only. Built and loaded by models/native.py; wrapped by
 * models/native_attention.py (which checks it against torch at load).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native_simd.h"

typedef int v8i __attribute__((vector_size(32), aligned(4)));
typedef unsigned short v8h __attribute__((vector_size(16), aligned(2)));

static inline v8 splat(float f) { return (v8){f, f, f, f, f, f, f, f}; }

#define CHUNK 4 /* queries per task: enough tasks to share a long segment between threads, keys still re-read little */

/* dst[0..n) = the fp32 values of bf16 src (the bf16 bits are the top half of the fp32 ones). */
static inline void widen(const bf16 *src, float *dst, long n) {
  long i = 0;
  for (; i + 8 <= n; i += 8) *(v8 *)(dst + i) = (v8)(__builtin_convertvector(*(const v8h *)(src + i), v8i) << 16);
  for (; i < n; i++) {
    const unsigned u = (unsigned)src[i] << 16;
    memcpy(dst + i, &u, sizeof u);
  }
}

/* A row of `hd` values at element `index` of an fp32 or bf16 array, as fp32: the row itself, or widened into buf. */
static inline const float *row_f32(const void *base, long index, int is_bf16, float *buf, long hd) {
  if (!is_bf16) return (const float *)base + index;
  widen((const bf16 *)base + index, buf, hd);
  return buf;
}

/* e^x for x <= 0, 8 lanes: x = n·ln2 + r with |r| <= ln2/2, e^r by Cephes' degree-7 polynomial for expf (within
 * ~2 ulp), 2^n through the exponent bits. Inputs below -87.3 are clamped (e^-87.3 ≈ 1e-38: after subtracting the
 * row maximum such a weight is far below one ulp of the sum). */
static inline v8 exp8(v8 x) {
  const v8i low = x < -87.3f;
  x = (v8)(((v8i)x & ~low) | ((v8i)((v8){0} - 87.3f) & low));
  const v8 n = madd(splat(12582912.0f), x, splat(1.44269504088896341f)) - 12582912.0f; /* round to nearest */
  v8 r = madd(x, n, splat(-0.693359375f));
  r = madd(r, n, splat(2.12194440e-4f));
  v8 y = madd(splat(1.3981999507e-3f), splat(1.9875691500e-4f), r);
  y = madd(splat(8.3334519073e-3f), y, r);
  y = madd(splat(4.1665795894e-2f), y, r);
  y = madd(splat(1.6666665459e-1f), y, r);
  y = madd(splat(5.0000001201e-1f), y, r);
  y = madd(r, y * r, r) + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  return y * (v8)bits;
}

/* The largest of row[0..n) (-inf for none; NaNs skipped). Lane-wise, then across lanes: max is exact, so the order
 * does not matter (of +0 and -0 either may come out; e^(x - m) is then the same). A scalar loop was a chain of
 * dependent compares: in a perf profile of an 8-token block after 300 keys, most of the time outside the products
 * and the exp. */
static float row_max(const float *row, long n) {
  v8 m8 = splat(-INFINITY);
  long j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 x = *(const v8 *)(row + j);
    const v8i greater = x > m8;
    m8 = (v8)(((v8i)x & greater) | ((v8i)m8 & ~greater));
  }
  float m = -INFINITY;
  for (int l = 0; l < 8; l++) m = m8[l] > m ? m8[l] : m;
  for (; j < n; j++) m = row[j] > m ? row[j] : m;
  return m;
}

/* row[j] = e^(row[j] - m) for j < n; returns their sum (8 lanes, then the tail lane by lane, a fixed order). */
static float exp_sum(float *row, long n, float m) {
  v8 acc = (v8){0};
  const long n8 = n & ~7L;
  for (long j = 0; j < n8; j += 8) {
    const v8 e = exp8(*(v8 *)(row + j) - m);
    *(v8 *)(row + j) = e;
    acc += e;
  }
  float s = hsum(acc);
  if (n8 < n) {
    v8 tail = (v8){0} - 100.0f;
    for (long j = n8; j < n; j++) tail[j - n8] = row[j] - m;
    const v8 e = exp8(tail);
    for (long j = n8; j < n; j++) { row[j] = e[j - n8]; s += e[j - n8]; }
  }
  return s;
}

#ifdef __AVX512F__
/* The dot products and weighted sums run on W = 16 lanes: half the multiply-adds and loads of 8 lanes (one layer
 * of an 8-token verification block after 300 tokens: see scripts/attention_kernel_cost.py, session 47). A score's
 * 16 lane sums are folded to 8 (lane l + lane l+8) before hsum's tree, in the blocked and the one-key path alike. */
#define W 16
typedef float vw __attribute__((vector_size(64), aligned(4)));
static inline vw maddw(vw acc, vw a, vw b) { return (vw)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc); }
static inline v8 fold(vw a) {
  return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13,
                                                                                           14, 15);
}
static inline vw splatw(float f) { return (vw)_mm512_set1_ps(f); }
/* intrinsics: GCC splits a generic 16-lane widening into two 8-lane ones and an insert */
static inline vw widenw(const bf16 *src) {
  return (vw)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16);
}
#else
#define W 8
typedef v8 vw;
typedef v8i vwi;
typedef v8h vwh;
static inline vw maddw(vw acc, vw a, vw b) { return madd(acc, a, b); }
static inline v8 fold(vw a) { return a; }
static inline vw splatw(float f) { return splat(f); }
static inline vw widenw(const bf16 *src) { return (vw)(__builtin_convertvector(*(const vwh *)src, vwi) << 16); }
#endif

#ifdef __AVX512VL__
#define QB 3 /* query rows sharing each key/value load: 24 accumulators in AVX-512VL's 32 vector registers */
#else
#define QB 1 /* AVX2's 16 registers hold one row's 8 accumulators */
#endif

/* W values at element `index` of an fp32 or (widened) bf16 array. Inlined with a constant bf. */
static inline __attribute__((always_inline)) vw loadw(const void *base, long index, int bf) {
  if (bf) return widenw((const bf16 *)base + index);
  return *(const vw *)((const float *)base + index);
}

static inline __attribute__((always_inline)) float load1(const void *base, long index, int bf) {
  if (!bf) return ((const float *)base)[index];
  const unsigned u = (unsigned)((const bf16 *)base)[index] << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* [hsum(a[0]), ..., hsum(a[7])], each lane summed in hsum's order (so a score does not depend on its key block). */
static inline v8 hsum8(const v8 a[8]) {
  const v8i lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
  const v8i even2 = {0, 1, 8, 9, 4, 5, 12, 13}, odd2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const v8i x = {0, 4, 2, 6, 8, 12, 10, 14}, y = {1, 5, 3, 7, 9, 13, 11, 15};
  v8 p[4], q[2];
  for (int i = 0; i < 4; i++)  /* [a_2i: lanes l + l+4 | a_2i+1: the same] */
    p[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi);
  for (int i = 0; i < 2; i++)  /* [a_4i: (0+4)+(2+6), (1+5)+(3+7) | a_4i+2 | a_4i+1 | a_4i+3] */
    q[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], even2) + __builtin_shuffle(p[2 * i], p[2 * i + 1], odd2);
  return __builtin_shuffle(q[0], q[1], x) + __builtin_shuffle(q[0], q[1], y);
}

/* scores[r * span + j] = (q_r · k_j) * scale for nb query rows qs[r] and keys first + j, j < span: blocks of 8 keys
 * (each key chunk loaded once for the nb rows; 8 accumulators a row), folded and reduced by hsum8; the rest one by
 * one. Every score is the same chain of operations (chunk sums, the fold, hsum's tree, the tail dimensions) either
 * way. Inlined with constant nb and bf. */
static inline __attribute__((always_inline)) void score_rows(const float *const *qs, int nb, const void *kc,
                                                             long first, long span, long hd, float scale,
                                                             float *scores, int bf) {
  const long nw = hd & ~(long)(W - 1);
  long j = 0;
  for (; j + 8 <= span; j += 8) {
    vw acc[QB][8];
    for (int r = 0; r < nb; r++)
      for (int t = 0; t < 8; t++) acc[r][t] = (vw){0};
    for (long c = 0; c < nw; c += W) {
      vw qv[QB];
      for (int r = 0; r < nb; r++) qv[r] = *(const vw *)(qs[r] + c);
      for (int t = 0; t < 8; t++) {
        const vw kv = loadw(kc, (first + j + t) * hd + c, bf);
        for (int r = 0; r < nb; r++) acc[r][t] = maddw(acc[r][t], qv[r], kv);
      }
    }
    for (int r = 0; r < nb; r++) {
      v8 folded[8];
      for (int t = 0; t < 8; t++) folded[t] = fold(acc[r][t]);
      v8 s = hsum8(folded);
      for (long i = nw; i < hd; i++)
        for (int t = 0; t < 8; t++) s[t] += qs[r][i] * load1(kc, (first + j + t) * hd + i, bf);
      *(v8 *)(scores + r * span + j) = s * scale;
    }
  }
  for (; j < span; j++)
    for (int r = 0; r < nb; r++) {
      vw acc = (vw){0};
      for (long c = 0; c < nw; c += W) acc = maddw(acc, *(const vw *)(qs[r] + c), loadw(kc, (first + j) * hd + c, bf));
      float s = hsum(fold(acc));
      for (long i = nw; i < hd; i++) s += qs[r][i] * load1(kc, (first + j) * hd + i, bf);
      scores[r * span + j] = s * scale;
    }
}

/* acc[r * hd + d0 + d] = Σ_j p_r[j] v_j[d0 + d] for d < W nc, nb rows of weights p (row stride span; zero where a
 * key is masked), in key order: nb x nc accumulators in registers, each value chunk loaded once for the nb rows.
 * Each dimension is one chain of multiply-adds in key order, whatever the lane width. */
static inline __attribute__((always_inline)) void weigh_rows(const float *p, int nb, int nc, const void *vc,
                                                             long first, long span, long hd, long d0, float *acc,
                                                             int bf) {
  vw a[QB][8];
  for (int r = 0; r < nb; r++)
    for (int c = 0; c < nc; c++) a[r][c] = (vw){0};
  for (long j = 0; j < span; j++) {
    float w[QB];
    for (int r = 0; r < nb; r++) w[r] = p[r * span + j];
    for (int c = 0; c < nc; c++) {
      const vw vv = loadw(vc, (first + j) * hd + d0 + W * c, bf);
      for (int r = 0; r < nb; r++) a[r][c] = maddw(a[r][c], splatw(w[r]), vv);
    }
  }
  for (int r = 0; r < nb; r++)
    for (int c = 0; c < nc; c++) *(vw *)(acc + r * hd + d0 + W * c) = a[r][c];
}

/* CALL(n, b) with constant n = nb (<= QB rows) and b = bf: the instances of score_rows and weigh_rows. */
#if QB == 3
#define BY_ROWS(CALL, nb, bf)                                                                                   \
  do {                                                                                                          \
    if (bf) { if ((nb) == 3) CALL(3, 1); else if ((nb) == 2) CALL(2, 1); else CALL(1, 1); }                     \
    else { if ((nb) == 3) CALL(3, 0); else if ((nb) == 2) CALL(2, 0); else CALL(1, 0); }                        \
  } while (0)
#else
#define BY_ROWS(CALL, nb, bf) do { if (bf) CALL(1, 1); else CALL(1, 0); } while (0)
#endif

static void scores_of(const float *const *qs, int nb, const void *kc, long first, long span, long hd, float scale,
                      float *scores, int bf) {
#define SCORE(n, b) score_rows(qs, n, kc, first, span, hd, scale, scores, b)
  BY_ROWS(SCORE, nb, bf);
#undef SCORE
}

/* The weighted sums in value chunks of 8, 4, 2 and 1 vectors (constant accumulator counts), then the rest. */
static void weigh(const float *p, int nb, const void *vc, long first, long span, long hd, float *acc, int bf) {
  const long nw = hd & ~(long)(W - 1);
  long d0 = 0;
#define WEIGH(n, c, b) weigh_rows(p, n, c, vc, first, span, hd, d0, acc, b)
#define WIDTHS(n, b)                                                                                            \
  do {                                                                                                          \
    for (; d0 + 8 * W <= nw; d0 += 8 * W) WEIGH(n, 8, b);                                                       \
    if (d0 + 4 * W <= nw) { WEIGH(n, 4, b); d0 += 4 * W; }                                                      \
    if (d0 + 2 * W <= nw) { WEIGH(n, 2, b); d0 += 2 * W; }                                                      \
    if (d0 + W <= nw) { WEIGH(n, 1, b); d0 += W; }                                                              \
  } while (0)
  BY_ROWS(WIDTHS, nb, bf);
#undef WIDTHS
#undef WEIGH
  if (nw == hd) return;  /* else a pass over the keys for nothing: a store-forwarding chain per key (perf, s47) */
  for (int r = 0; r < nb; r++)  /* a head size not a multiple of W: the last dimensions one by one */
    for (long j = 0; j < span; j++)
      for (long d = nw; d < hd; d++) acc[r * hd + d] += p[r * span + j] * load1(vc, (first + j) * hd + d, bf);
}

/* One task: queries i0..i1-1 of a segment, the query heads of KV head g. kc, vc: this layer's rows of head g; q,
 * out, kc, vc are bf16 where is_bf16, else fp32 (strides and indices count elements either way). */
static int attend_chunk(const void *q, long q_row, void *out, long out_row, long row0, long start, long i0, long i1,
                        const void *kc, const void *vc, long g, long groups, long hd, long window, float scale,
                        float softcap, int is_bf16) {
  const long first = window > 0 && start + i0 - window + 1 > 0 ? start + i0 - window + 1 : 0;
  const long end = start + i1;  /* query i sees keys lo(i) .. start+i, all inside first .. end-1 */
  const long span = end - first, nq = (i1 - i0) * groups;
  /* bf16: the scores are followed by the task's widened query rows */
  float *scores = malloc(sizeof(float) * (size_t)(nq * span + (is_bf16 ? nq * hd : 0)));
  float *acc = calloc((size_t)(nq * hd), sizeof(float));
  if (!scores || !acc) { free(scores); free(acc); return 1; }
  const float *qs[nq];  /* fp32: the query rows in place */
  for (long qi = 0; qi < nq; qi++) {
    const long index = (row0 + i0 + qi / groups) * q_row + (g * groups + qi % groups) * hd;
    qs[qi] = row_f32(q, index, is_bf16, is_bf16 ? scores + nq * span + qi * hd : NULL, hd);
  }
  for (long r = 0; r < nq; r += QB)  /* keys read once for QB rows (L1/L2 serve the re-reads) */
    scores_of(qs + r, nq - r < QB ? (int)(nq - r) : QB, kc, first, span, hd, scale, scores + r * span, is_bf16);
  float total[nq];
  for (long qi = 0; qi < nq; qi++) {  /* softmax over the visible keys only; masked weights become exact zeros */
    const long pos = start + i0 + qi / groups;
    const long lo = window > 0 && pos - window + 1 > first ? pos - window + 1 - first : 0, hi = pos + 1 - first;
    float *row = scores + qi * span, m;
    if (softcap > 0)
      for (long j = lo; j < hi; j++) row[j] = tanhf(row[j] / softcap) * softcap;
    m = row_max(row + lo, hi - lo);
    total[qi] = exp_sum(row + lo, hi - lo, m);
    for (long j = 0; j < lo; j++) row[j] = 0.0f;  /* p·v adds exactly nothing there: cached values are finite */
    for (long j = hi; j < span; j++) row[j] = 0.0f;
  }
  for (long r = 0; r < nq; r += QB)  /* each value chunk read once for QB rows */
    weigh(scores + r * span, nq - r < QB ? (int)(nq - r) : QB, vc, first, span, hd, acc + r * hd, is_bf16);
  for (long qi = 0; qi < nq; qi++) {
    const long index = (row0 + i0 + qi / groups) * out_row + (g * groups + qi % groups) * hd;
    const float inv = 1.0f / total[qi];
    if (is_bf16)
      for (long d = 0; d < hd; d++) ((bf16 *)out)[index + d] = narrow(acc[qi * hd + d] * inv);
    else
      for (long d = 0; d < hd; d++) ((float *)out)[index + d] = acc[qi * hd + d] * inv;
  }
  free(scores);
  free(acc);
  return 0;
}

/* q [N, H, hd], k_new/v_new [N, kvH, hd] with row strides q_row/k_row/v_row (elements; heads contiguous), out [N,
 * H, hd] with row stride out_row; all of them and the caches fp32, or bf16 where is_bf16. seg: [7, n_seg] int64
 * rows: first row in q/out, start position, length, address of the request's k cache [L, kvH, cap, hd], of its v
 * cache, cap, unused. Returns the number of failed tasks (out of memory), 0 on success. */
int dspark_ragged_attention(const void *q, long q_row, const void *k_new, long k_row, const void *v_new, long v_row,
                            void *out, long out_row, const long *seg, long n_seg, long layer, long H, long kvH,
                            long hd, long window, float scale, float softcap, int threads, int is_bf16) {
  const long *row0 = seg, *start = seg + n_seg, *len = seg + 2 * n_seg, *kaddr = seg + 3 * n_seg,
             *vaddr = seg + 4 * n_seg, *cap = seg + 5 * n_seg;
  const long groups = H / kvH;
  const size_t esize = is_bf16 ? sizeof(bf16) : sizeof(float);
  long chunks = 0;
  for (long s = 0; s < n_seg; s++) chunks += (len[s] + CHUNK - 1) / CHUNK;
  long *chunk_seg = malloc(sizeof(long) * (size_t)(2 * chunks + 1)), *chunk_i0 = chunk_seg + chunks;
  if (!chunk_seg) return (int)(chunks * kvH);
  for (long s = 0, c = 0; s < n_seg; s++) {
    char *kc = (char *)kaddr[s] + layer * kvH * cap[s] * hd * esize;
    char *vc = (char *)vaddr[s] + layer * kvH * cap[s] * hd * esize;
    for (long i = 0; i < len[s]; i++)  /* the new rows first: a chunk reads keys of earlier chunks */
      for (long g = 0; g < kvH; g++) {
        const long to = (g * cap[s] + start[s] + i) * hd;
        memcpy(kc + to * esize, (const char *)k_new + ((row0[s] + i) * k_row + g * hd) * esize, hd * esize);
        memcpy(vc + to * esize, (const char *)v_new + ((row0[s] + i) * v_row + g * hd) * esize, hd * esize);
      }
    for (long i0 = 0; i0 < len[s]; i0 += CHUNK, c++) chunk_seg[c] = s, chunk_i0[c] = i0;
  }
  int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(threads) reduction(+ : failed)
  for (long task = 0; task < chunks * kvH; task++) {
    const long c = task / kvH, g = task % kvH, s = chunk_seg[c], i0 = chunk_i0[c];
    const long i1 = i0 + CHUNK < len[s] ? i0 + CHUNK : len[s];
    const size_t head = (size_t)((layer * kvH + g) * cap[s] * hd) * esize;
    failed += attend_chunk(q, q_row, out, out_row, row0[s], start[s], i0, i1, (const char *)kaddr[s] + head,
                           (const char *)vaddr[s] + head, g, groups, hd, window, scale, softcap, is_bf16);
  }
  free(chunk_seg);
  return failed;
}
