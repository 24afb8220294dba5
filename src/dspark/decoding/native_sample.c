/* Inverse-CDF sampling over blocks of 256 tokens in one call (decoding/sampling.py's _sample_by_blocks).
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

/* probs [R, V] fp32 contiguous (V a multiple of BLOCK), u [R] fp64 in [0, 1) -> tokens [R] */
void dspark_sample_blocks(const float *probs, long R, long V, const double *u, long *tokens, int threads) {
  const long nb = V / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (R >= PARALLEL_ROWS)
  for (long r = 0; r < R; r++) {
    double cdf[nb]; /* a few KB of stack: 192 blocks for 49,152 tokens */
    tokens[r] = sample_row(probs + r * V, nb, u[r], cdf);
  }
}
