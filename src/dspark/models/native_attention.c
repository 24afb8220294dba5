/* Attention for a ragged batch of short query segments (decode and verification blocks), each against its own
 * request's KV cache, in one call per layer — with the cache writes of the new keys and values.
 *
 * Why: torch's path is one scaled_dot_product_attention call (plus two cache writes and a copy out) per request
 * per layer; at 16 one-token requests that Python loop cost more than the attention's arithmetic. Here the new
 * rows are written into the caches first, then the work is split into tasks of (request, KV head, up to CHUNK
 * queries): for every query in the chunk and every query head sharing that KV head, scores over its visible keys
 * (each key read once for all of them), a softmax with the maximum subtracted (exp vectorised: scalar expf made
 * the kernel slower than torch's for multi-token segments), and the weighted sum of values. Each task's sums run
 * in a fixed order, so a request's result depends neither on the other requests in the call nor on the thread
 * count.
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

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int v8i __attribute__((vector_size(32), aligned(4)));
typedef unsigned short v8h __attribute__((vector_size(16), aligned(2)));
typedef unsigned short bf16;

#define CHUNK 4 /* queries per task: enough tasks to share a long segment between threads, keys still re-read little */

static inline float hsum(v8 a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static inline float dot(const float *a, const float *b, long n) {
  v8 acc = (v8){0};
  const long n8 = n & ~7L;
  for (long i = 0; i < n8; i += 8) acc += *(const v8 *)(a + i) * *(const v8 *)(b + i);
  float s = hsum(acc);
  for (long i = n8; i < n; i++) s += a[i] * b[i];
  return s;
}

/* dst[0..n) = the fp32 values of bf16 src (the bf16 bits are the top half of the fp32 ones). */
static inline void widen(const bf16 *src, float *dst, long n) {
  long i = 0;
  for (; i + 8 <= n; i += 8) *(v8 *)(dst + i) = (v8)(__builtin_convertvector(*(const v8h *)(src + i), v8i) << 16);
  for (; i < n; i++) {
    const unsigned u = (unsigned)src[i] << 16;
    memcpy(dst + i, &u, sizeof u);
  }
}

/* fp32 -> the nearest bf16, ties to even; NaN stays a (quiet) NaN. */
static inline bf16 narrow(float f) {
  unsigned u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
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
  const v8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
  v8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v8 y = 1.9875691500e-4f * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  return y * (v8)bits;
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

/* One task: queries i0..i1-1 of a segment, the query heads of KV head g. kc, vc: this layer's rows of head g; q,
 * out, kc, vc are bf16 where is_bf16, else fp32 (strides and indices count elements either way). */
static int attend_chunk(const void *q, long q_row, void *out, long out_row, long row0, long start, long i0, long i1,
                        const void *kc, const void *vc, long g, long groups, long hd, long window, float scale,
                        float softcap, int is_bf16) {
  const long first = window > 0 && start + i0 - window + 1 > 0 ? start + i0 - window + 1 : 0;
  const long end = start + i1;  /* query i sees keys lo(i) .. start+i, all inside first .. end-1 */
  const long span = end - first, nq = (i1 - i0) * groups;
  /* bf16: the scores are followed by the task's widened query rows and one widened key/value row */
  const long widened = is_bf16 ? nq * hd + hd : 0;
  float *scores = malloc(sizeof(float) * (size_t)(nq * span + widened));
  float *acc = calloc((size_t)(nq * hd), sizeof(float));
  if (!scores || !acc) { free(scores); free(acc); return 1; }
  float *kv_buf = is_bf16 ? scores + nq * span + nq * hd : NULL;
  const float *qs[nq];  /* fp32: the query rows in place */
  for (long qi = 0; qi < nq; qi++) {
    const long index = (row0 + i0 + qi / groups) * q_row + (g * groups + qi % groups) * hd;
    qs[qi] = row_f32(q, index, is_bf16, is_bf16 ? scores + nq * span + qi * hd : NULL, hd);
  }
  for (long j = first; j < end; j++) {  /* each key read once for every query of the task */
    const float *kj = row_f32(kc, j * hd, is_bf16, kv_buf, hd);
    for (long qi = 0; qi < nq; qi++) {
      float s = dot(qs[qi], kj, hd) * scale;
      if (softcap > 0) s = tanhf(s / softcap) * softcap;
      scores[qi * span + (j - first)] = s;
    }
  }
  float total[nq];
  long lo[nq], hi[nq];
  for (long qi = 0; qi < nq; qi++) {  /* softmax over the visible keys only: masked ones are never read */
    const long pos = start + i0 + qi / groups;
    lo[qi] = window > 0 && pos - window + 1 > first ? pos - window + 1 - first : 0;
    hi[qi] = pos + 1 - first;
    float *row = scores + qi * span, m = -INFINITY;
    for (long j = lo[qi]; j < hi[qi]; j++) m = row[j] > m ? row[j] : m;
    total[qi] = exp_sum(row + lo[qi], hi[qi] - lo[qi], m);
  }
  for (long j = 0; j < span; j++) {  /* each value read once */
    const float *vj = row_f32(vc, (first + j) * hd, is_bf16, kv_buf, hd);
    for (long qi = 0; qi < nq; qi++) {
      if (j < lo[qi] || j >= hi[qi]) continue;
      const float p = scores[qi * span + j];
      float *a = acc + qi * hd;
      for (long d = 0; d < hd; d++) a[d] += p * vj[d];
    }
  }
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
