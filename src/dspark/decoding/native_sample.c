/* Inverse-CDF sampling over blocks of 256 tokens in one call (decoding/sampling.py's _sample_by_blocks), and the
 * greedy draw (argmax) at the end of the file.
 *
 * torch's fp64 sum of fp32 probabilities widens every element first: at 16 rows of SmolLM2's 49,152 tokens the
 * block masses took 286 µs of a 431 µs draw (session 44, Intel Xeon), ~0.8 % of a plain step at C = 16. Here each
 * block is summed in fp64 by 32 independent accumulators that the compiler vectorises, then combined in one fixed
 * tree, so a row's masses (and its token) depend neither on the other rows of the call nor on the thread count.
 *
 * The search is torch's: the first block whose cumulative mass exceeds u · total (the last block if none does),
 * then the first token of it whose in-block cumulative mass plus the blocks before exceeds the threshold; if
 * rounding leaves none (the block's sum above its own running total), the block's last token with mass. A token
 * or block of zero mass adds nothing to the running totals, so it never holds the threshold. No -ffast-math.
 */
#include <math.h>
#include <stdlib.h>

#include "native_simd.h"

#define BLOCK 256
#define LANES 32
#define PARALLEL_ROWS 8 /* below this the threads cost more than the rows */

/* the fp64 mass of one block, summed in a fixed order */
static double block_mass(const float *q) {
  double acc[LANES] = {0};
  for (long k = 0; k < BLOCK; k += LANES)
    for (int j = 0; j < LANES; j++) acc[j] += (double)q[k + j];
  for (int width = LANES / 2; width > 0; width /= 2) /* pairwise: lanes j and j + width */
    for (int j = 0; j < width; j++) acc[j] += acc[j + width];
  return acc[0];
}

static long sample_row(const float *p, long nb, double u, double *cdf) {
  double run = 0.0;
  for (long b = 0; b < nb; b++) {
    run += block_mass(p + b * BLOCK);
    cdf[b] = run;
  }
  const double threshold = u * run;
  long b = 0;
  while (b < nb - 1 && !(cdf[b] > threshold)) b++;
  const double before = b > 0 ? cdf[b - 1] : 0.0;
  const float *q = p + b * BLOCK;
  double inside = 0.0;
  long last = 0; /* the block's last token with mass (0 if none, as torch's argmax of an all-zero count) */
  for (long k = 0; k < BLOCK; k++) {
    inside += (double)q[k];
    if (inside + before > threshold) return b * BLOCK + k;
    if (q[k] > 0.0f) last = k;
  }
  return b * BLOCK + last;
}

/* probs [R, V] fp32, row r at probs + r * stride (V a multiple of BLOCK; stride >= V: the drafter's slot k of
 * [R, γ, V] is such a view), u [R] fp64 in [0, 1) -> tokens [R] */
void dspark_sample_blocks(const float *probs, long R, long V, long stride, const double *u, long *tokens,
                          int threads) {
  const long nb = V / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (R >= PARALLEL_ROWS)
  for (long r = 0; r < R; r++) {
    double cdf[nb]; /* a few KB of stack: 192 blocks for 49,152 tokens */
    tokens[r] = sample_row(probs + r * stride, nb, u[r], cdf);
  }
}

/* The token after a verified block (decoding/verify.py's draw_next), one row per request: where the request
 * rejected a draft, a draw from max(0, p − q) (q: its draft distribution at that slot, or a point mass on the
 * draft where point[r] >= 0), or from p itself where that leaves no mass; else a draw from p (the bonus). The
 * residual is written out in fp32 exactly as torch's (p - q).clamp(min=0) and drawn by sample_row, so the token is
 * the one sample_from picks from torch's residual row; the rows are found by offsets, so nothing is gathered.
 * With qmap, q's rows hold only a draft vocabulary: entry j is token qmap[j] (Vq of them, distinct), every other
 * token has q = 0, where p − 0 is p bit for bit; so the residual row is the same as from the scattered full row. */
void dspark_sample_next(const float *p, const long *p_off, const float *q, const long *q_off, const long *point,
                        long R, long V, const double *u, long *tokens, int threads, const long *qmap, long Vq) {
  const long nb = V / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (R >= PARALLEL_ROWS)
  for (long r = 0; r < R; r++) {
    double cdf[nb];
    const float *pr = p + p_off[r];
    const float *qr = q != 0 && q_off[r] >= 0 ? q + q_off[r] : 0;
    if (qr == 0 && point[r] < 0) {
      tokens[r] = sample_row(pr, nb, u[r], cdf);
      continue;
    }
    float *w = malloc(V * sizeof(float));
    if (w == 0) { tokens[r] = -2; continue; } /* the caller raises */
    int mass = 0;
    if (qr != 0 && qmap != 0) {
      for (long i = 0; i < V; i++) {
        const float d = pr[i] - 0.0f;
        w[i] = d > 0.0f ? d : 0.0f;
      }
      for (long j = 0; j < Vq; j++) {
        const float d = pr[qmap[j]] - qr[j];
        w[qmap[j]] = d > 0.0f ? d : 0.0f;
      }
      for (long i = 0; i < V; i++) mass |= w[i] > 0.0f;
    } else {
      for (long i = 0; i < V; i++) {
        const float d = pr[i] - (qr != 0 ? qr[i] : (i == point[r] ? 1.0f : 0.0f));
        w[i] = d > 0.0f ? d : 0.0f;
        mass |= d > 0.0f;
      }
    }
    tokens[r] = sample_row(mass ? w : pr, nb, u[r], cdf); /* no residual mass: rejection had probability 0 */
    free(w);
  }
}

/* A DSpark block's Markov-head draws in one call (drafters/markov_draws.py): slot k's logits are U_k + W1[x_{k-1}]·W2ᵀ,
 * x_{k-1} the token drawn at slot k-1 (the anchor before slot 1), so the γ slots run in turn. Per slot: the rows'
 * W1 entries gathered (rounded to bf16 where W2 is bf16, as the torch path's .to(bfloat16)), one product through
 * the projection kernel the caller passes (models/native_linear.c, the one the torch path calls for one or two
 * rows, so there its bias is the same bits), the bias added to U_k in fp32, then per row the greedy argmax
 * (argmax_row, below) or, sampled, softmax(logits / T) written to probs — the distribution kept for verification —
 * and a two-level draw from exactly that row (sample_row). The softmax's exp is exp_poly (Cephes' expf: a few ulp
 * from torch's), so a sampled q moves by float rounding from the torch path's: lossless either way, as verification
 * reads the q that was drawn from. Replaces ~9 torch calls a slot (each 20-80 µs right after a target forward,
 * results/post-forward-ops-s48). */
typedef void (*linear_fn)(const void *x, long M, const void *w, const void *bias, long N, long K, void *y, int threads);
static long argmax_row(const float *x, long V);

/* e^x for x <= 0 (a softmax's shifted logits), 16 lanes: Cephes' expf (n = floor(x·log2 e + 1/2), x − n·ln 2 in two
 * parts, a degree-6 polynomial, 2^n from the exponent bits); below -87.3 it is 0. GCC's vector extensions, so it
 * needs no libm call and no -ffast-math to be vectorised. */
typedef float vf __attribute__((vector_size(64), aligned(4)));
typedef int vi __attribute__((vector_size(64)));

static inline vf select_vf(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline vf exp_neg(vf x) {
  const vf zero = {0}, lo = zero - 87.33654f;
  const vi under = x < lo;
  const vf xc = select_vf(under, lo, x);
  const vf y = xc * 1.44269504088896341f + 0.5f;
  vi t = __builtin_convertvector(y, vi); /* toward zero; then down to the floor where that rounded up */
  t += (vi)(__builtin_convertvector(t, vf) > y);
  const vf n = __builtin_convertvector(t, vf);
  vf r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vf scale = (vf)((t + 127) << 23); /* n >= -126 here: a normal power of two */
  return (vf)((vi)(p * scale) & ~under);
}

/* softmax(z / t) into p [V], V a multiple of 16 (t == 1: z itself, as sampling._tempered); the max and the sum
 * lane-wise, the sum's lanes then added in one fixed tree */
static void softmax_row(const float *z, float t, float *p, long V) {
  const vf zero = {0};
  vf mx = zero - INFINITY;
  for (long j = 0; j < V; j += 16) {
    const vf x = t == 1.0f ? *(const vf *)(z + j) : *(const vf *)(z + j) / t;
    *(vf *)(p + j) = x;
    mx = select_vf(x > mx, x, mx);
  }
  float m = mx[0];
  for (int l = 1; l < 16; l++) m = mx[l] > m ? mx[l] : m;
  vf acc = zero;
  for (long j = 0; j < V; j += 16) {
    const vf e = exp_neg(*(const vf *)(p + j) - m);
    *(vf *)(p + j) = e;
    acc += e;
  }
  float lanes[16];
  memcpy(lanes, &acc, sizeof lanes);
  for (int w = 8; w > 0; w /= 2)
    for (int l = 0; l < w; l++) lanes[l] += lanes[l + w];
  const float inv = 1.0f / lanes[0];
  for (long j = 0; j < V; j++) p[j] *= inv;
}

/* base [R, g, Vd] (row r, slot k at base + r*bs0 + k*bs1), w1 [V, r] fp32, w2 [Vd, r] (bf: bf16, else fp32),
 * vocab_ids [Vd] draft -> target ids or NULL, anchor [R] target ids, temperature [R] (0: greedy), u [R, g],
 * probs [R, g, Vd] (row r, slot k at probs + r*ps0 + k*ps1) or NULL when every row is greedy, tokens [R, g] out
 * (target ids). Returns 0, or -1 when out of memory (nothing useful written). */
int dspark_markov_draws(const float *base, long bs0, long bs1, const float *w1, long rank, const void *w2, int bf,
                        linear_fn linear, const long *vocab_ids, const long *anchor, const float *temperature,
                        const double *u, float *probs, long ps0, long ps1, long *tokens, long R, long g, long Vd,
                        int threads) {
  const long nb = Vd / BLOCK, esize = bf ? 2 : 4;
  if (R <= 0 || g <= 0) return 0;
  unsigned char *x = malloc(R * rank * esize), *y = malloc(R * Vd * esize);
  float *z = malloc(R * Vd * sizeof(float));
  long *prev = malloc(R * sizeof(long));
  if (!x || !y || !z || !prev) { free(x); free(y); free(z); free(prev); return -1; }
  for (long r = 0; r < R; r++) prev[r] = anchor[r];
  for (long k = 0; k < g; k++) {
    for (long r = 0; r < R; r++)
      for (long i = 0; i < rank; i++) {
        const float e = w1[prev[r] * rank + i];
        if (bf) ((bf16 *)x)[r * rank + i] = narrow(e); else ((float *)x)[r * rank + i] = e;
      }
    linear(x, R, w2, 0, Vd, rank, y, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (R >= 4)
    for (long r = 0; r < R; r++) {
      const float *b = base + r * bs0 + k * bs1;
      float *zr = z + r * Vd;
      for (long j = 0; j < Vd; j++)
        zr[j] = b[j] + (bf ? widen1(((const bf16 *)y)[r * Vd + j]) : ((const float *)y)[r * Vd + j]);
      float *pr = probs ? probs + r * ps0 + k * ps1 : 0;
      long d;
      if (temperature[r] == 0.0f) {
        d = argmax_row(zr, Vd);
        if (pr) { memset(pr, 0, Vd * sizeof(float)); pr[d] = 1.0f; }
      } else {
        double cdf[nb];
        softmax_row(zr, temperature[r], pr, Vd);
        d = sample_row(pr, nb, u[r * g + k], cdf);
      }
      tokens[r * g + k] = prev[r] = vocab_ids ? vocab_ids[d] : d;
    }
  }
  free(x); free(y); free(z); free(prev);
  return 0;
}

/* The greedy draw: each row's first index of its maximum, as torch.argmax (a NaN counts as the maximum, so a row
 * holding one gives its first NaN). torch's CPU argmax carries an (index, value) pair through every comparison:
 * 270 µs for 8 rows of 49,152 logits on session 46's Intel Xeon, where a row's maximum alone (amax) took 16 µs
 * (scripts/greedy_draw_cost.py).
 * Here the maximum comes first, 8 lanes at a time (the lanes' maxima are exact whatever their order), then the
 * first position holding it: two passes over a row the L2 cache already holds. */
typedef float f8 __attribute__((vector_size(32), aligned(4)));
typedef int i8 __attribute__((vector_size(32)));

/* Each lane's maximum so far, and a NaN flag per lane. */
static inline void lane_max(f8 *lane, i8 *bad, f8 v) {
  const i8 up = v > *lane; /* a NaN never wins the compare: `bad` catches it instead */
  *lane = (f8)(((i8)v & up) | ((i8)*lane & ~up));
  *bad |= v != v;
}

static long argmax_row(const float *x, long V) {
  long i = 0;
  float m = -INFINITY;
  int nan = 0;
  if (V >= 32) { /* four independent chains of 8 lanes: one would wait on its own compare */
    f8 lane[4];
    i8 bad[4];
    for (int c = 0; c < 4; c++) { lane[c] = *(const f8 *)(x + 8 * c); bad[c] = lane[c] != lane[c]; }
    for (i = 32; i + 32 <= V; i += 32)
      for (int c = 0; c < 4; c++) lane_max(&lane[c], &bad[c], *(const f8 *)(x + i + 8 * c));
    for (int c = 0; c < 4; c++)
      for (int j = 0; j < 8; j++) { m = lane[c][j] > m ? lane[c][j] : m; nan |= bad[c][j] != 0; }
  }
  for (; i < V; i++) { m = x[i] > m ? x[i] : m; nan |= x[i] != x[i]; }
  if (nan) {
    for (long k = 0; k < V; k++) if (x[k] != x[k]) return k;
  }
  const f8 mm = {m, m, m, m, m, m, m, m};
  long k = 0;
  for (; k + 8 <= V; k += 8) { /* the first block of 8 holding m, then its first lane */
    const i8 hit = *(const f8 *)(x + k) == mm;
    if (hit[0] | hit[1] | hit[2] | hit[3] | hit[4] | hit[5] | hit[6] | hit[7]) break;
  }
  for (; k < V; k++) if (x[k] == m) return k;
  return 0; /* unreachable: m is one of the row's values (a row of -inf holds -inf at 0) */
}

/* x [R, V] fp32 contiguous -> out [R]: argmax_row of each row */
void dspark_argmax_rows(const float *x, long R, long V, long *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (R >= PARALLEL_ROWS)
  for (long r = 0; r < R; r++) out[r] = argmax_row(x + r * V, V);
}
