/* The engine's fp32 projection over block-coded weights (AVX2, FMA, F16C): gemm_blocks_f32.

   A block-coded weight is one whose every run of 32 inputs (one row of W, k = 32 b .. 32 b + 31) is
   d * q + m for small integers q and one fp16 scale d and min m per run: the codes llama.cpp ships
   its models in (Q4_1: q in 0..15 with a min; Q8_0: q in -128..127, no min). A checkpoint converted
   from such a file holds exactly those values in fp32 (disagg.engine.blockcode recovers the codes and
   checks every weight), so reading the codes instead of the fp32 values reads 4.5 or 8.5 bits a
   weight instead of 32: a decode step, bound by reading the weights, reads 5x less.

   y[m, n] = sum_b ( d[n, b] * sum_{k in b} x[m, k] q[n, k] + m[n, b] * sum_{k in b} x[m, k] ) + bias[n]

   in fp32 throughout, the activations unrounded. The layout (``pack`` in disagg.engine.blockcode):
   tiles of COLS = 16 outputs; per tile and input k, the 16 outputs' codes: 4-bit, 8 bytes whose low
   nibbles are outputs 0..7 and high nibbles 8..15; 8-bit, 16 bytes. Per tile and run, the 16 scales
   (and mins) as fp16. Outputs are zero-padded to whole tiles.

   Every output is summed in one order fixed by k alone (even and odd inputs of a run in two sums,
   added at the run's end, then the runs in order), never by the batch size, the row group or the
   thread, so a row gets the same bits whatever it is batched with. One or two rows convert each code
   where they use it; more rows convert each run's codes once for all of them (the same values, so
   the same bits). The work is split over tiles, on
   the kernels' thread team (kernels/team.c). */
#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "team.h"

#define TARGET __attribute__((target("avx2,fma,f16c")))
#define COLS 16
#define RUN 32
#define PREFETCH_RUNS 8 /* runs ahead that one row prefetches its codes: 4 to 32 measured alike */
#define MR 2 /* rows sharing each code vector: 4 partial and 4 total sums per row, 16 registers */
#define EACH(i, n) _Pragma("GCC unroll 8") for (int i = 0; i < (n); i++)

/* the 16 codes of input k of a tile, as two vectors of 8 floats (outputs 0..7, 8..15): converted
   here, or (`run`) read where one run's codes were converted once for every row group */
TARGET static inline __attribute__((always_inline)) void codes(const uint8_t *q, const float *run, int64_t k,
                                                               int bits, __m256 *lo, __m256 *hi) {
    if (run) {
        *lo = _mm256_loadu_ps(run + (k % RUN) * COLS);
        *hi = _mm256_loadu_ps(run + (k % RUN) * COLS + 8);
    } else if (bits == 4) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + k * 8)));
        *lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    } else {
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k * 16))));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k * 16 + 8))));
    }
}

/* Run b of tile t for MT rows from m0: the sums of the run's products in acc (MT x 2 vectors) */
TARGET static inline __attribute__((always_inline)) void run_sums(const float *x, const float *sums, const uint8_t *qt,
                                                                  const float *run, const uint16_t *st,
                                                                  const uint16_t *mt, __m256 acc[MR][2], const int MT,
                                                                  int64_t m0, int64_t K, int64_t b, const int bits) {
    const int64_t runs = K / RUN;
    __m256 even[MR][2], odd[MR][2];
    EACH(m, MT) EACH(c, 2) even[m][c] = odd[m][c] = _mm256_setzero_ps();
    if (!run) { /* the codes a few runs ahead, into the next tile (the tiles lie in one array; an
                   address past its end is only prefetched, never read) */
        const uintptr_t bytes = RUN * (bits == 4 ? 8 : 16), ahead = (uintptr_t)qt + (b + PREFETCH_RUNS) * bytes;
        for (uintptr_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
    }
    for (int64_t k = b * RUN; k < (b + 1) * RUN; k += 2) {
        __m256 lo, hi;
        codes(qt, run, k, bits, &lo, &hi);
        EACH(m, MT) {
            const __m256 xv = _mm256_broadcast_ss(x + (m0 + m) * K + k);
            even[m][0] = _mm256_fmadd_ps(xv, lo, even[m][0]);
            even[m][1] = _mm256_fmadd_ps(xv, hi, even[m][1]);
        }
        codes(qt, run, k + 1, bits, &lo, &hi);
        EACH(m, MT) {
            const __m256 xv = _mm256_broadcast_ss(x + (m0 + m) * K + k + 1);
            odd[m][0] = _mm256_fmadd_ps(xv, lo, odd[m][0]);
            odd[m][1] = _mm256_fmadd_ps(xv, hi, odd[m][1]);
        }
    }
    EACH(c, 2) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + b * COLS + c * 8)));
        EACH(m, MT) acc[m][c] = _mm256_fmadd_ps(d, _mm256_add_ps(even[m][c], odd[m][c]), acc[m][c]);
        if (mt) {
            const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + b * COLS + c * 8)));
            EACH(m, MT) acc[m][c] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(sums + (m0 + m) * runs + b), acc[m][c]);
        }
    }
}

/* the tile's outputs for MT rows from m0, plus the bias */
TARGET static inline __attribute__((always_inline)) void store(__m256 acc[MR][2], const float *bias, float *y,
                                                               const int MT, int64_t m0, int64_t N, int64_t t) {
    EACH(c, 2) {
        const int64_t n = t * COLS + c * 8;
        if (n >= N) break;
        EACH(m, MT) {
            float out[8];
            _mm256_storeu_ps(out, acc[m][c]);
            float *row = y + (m0 + m) * N;
            for (int64_t j = 0; j < 8 && n + j < N; j++) row[n + j] = bias ? out[j] + bias[n + j] : out[j];
        }
    }
}

/* One row group of tile t, every run in turn, its sums in registers: for a single group (one or two
   rows), where converting each code where it is used costs nothing extra. */
TARGET static inline __attribute__((always_inline)) void tile(const float *x, const float *sums, const uint8_t *q,
                                                              const uint16_t *scales, const uint16_t *mins,
                                                              const float *bias, float *y, const int MT, int64_t m0,
                                                              int64_t N, int64_t K, int64_t t, const int bits) {
    const int64_t runs = K / RUN;
    const uint8_t *qt = q + t * K * (bits == 4 ? 8 : 16);
    const uint16_t *st = scales + t * runs * COLS, *mt = mins ? mins + t * runs * COLS : NULL;
    __m256 acc[MR][2];
    EACH(m, MT) EACH(c, 2) acc[m][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < runs; b++) run_sums(x, sums, qt, NULL, st, mt, acc, MT, m0, K, b, bits);
    store(acc, bias, y, MT, m0, N, t);
}

/* Every row group of tile t, run by run: each run's codes converted once (RUN x COLS floats, in L1)
   and read by every group, whose sums wait in `totals` (M x COLS floats) between runs. The same
   operations in the same order as `tile`, so the same bits. */
TARGET static inline __attribute__((always_inline)) void tile_groups(const float *x, const float *sums, const uint8_t *q,
                                                                     const uint16_t *scales, const uint16_t *mins,
                                                                     const float *bias, float *y, int64_t M, int64_t N,
                                                                     int64_t K, int64_t t, const int bits, float *run,
                                                                     float *totals) {
    const int64_t runs = K / RUN;
    const uint8_t *qt = q + t * K * (bits == 4 ? 8 : 16);
    const uint16_t *st = scales + t * runs * COLS, *mt = mins ? mins + t * runs * COLS : NULL;
    for (int64_t i = 0; i < M * COLS; i++) totals[i] = 0.0f;
    for (int64_t b = 0; b < runs; b++) {
        for (int64_t k = b * RUN; k < (b + 1) * RUN; k++) {
            __m256 lo, hi;
            codes(qt, NULL, k, bits, &lo, &hi);
            _mm256_storeu_ps(run + (k % RUN) * COLS, lo);
            _mm256_storeu_ps(run + (k % RUN) * COLS + 8, hi);
        }
        int64_t m = 0;
        for (; m < M; m += MR) {
            __m256 acc[MR][2];
            if (m + MR <= M) {
                EACH(r, MR) EACH(c, 2) acc[r][c] = _mm256_loadu_ps(totals + (m + r) * COLS + c * 8);
                run_sums(x, sums, qt, run, st, mt, acc, MR, m, K, b, bits);
                EACH(r, MR) EACH(c, 2) _mm256_storeu_ps(totals + (m + r) * COLS + c * 8, acc[r][c]);
            } else {
                EACH(c, 2) acc[0][c] = _mm256_loadu_ps(totals + m * COLS + c * 8);
                run_sums(x, sums, qt, run, st, mt, acc, 1, m, K, b, bits);
                EACH(c, 2) _mm256_storeu_ps(totals + m * COLS + c * 8, acc[0][c]);
            }
        }
    }
    for (int64_t m = 0; m < M; m++) {
        __m256 acc[MR][2];
        EACH(c, 2) acc[0][c] = _mm256_loadu_ps(totals + m * COLS + c * 8);
        store(acc, bias, y, 1, m, N, t);
    }
}

/* Tiles first .. last, each for every row: one row group with its sums in registers, or (`run`,
   `totals`: more than one group) run by run with each run's codes converted once. */
TARGET static void tiles(const float *x, const float *sums, const uint8_t *q, const uint16_t *scales,
                         const uint16_t *mins, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                         int64_t first, int64_t last, int bits, float *run, float *totals) {
    for (int64_t t = first; t < last; t++) {
        if (run && bits == 4) {
            tile_groups(x, sums, q, scales, mins, bias, y, M, N, K, t, 4, run, totals);
        } else if (run) {
            tile_groups(x, sums, q, scales, mins, bias, y, M, N, K, t, 8, run, totals);
        } else if (bits == 4) {
            if (M == MR) tile(x, sums, q, scales, mins, bias, y, MR, 0, N, K, t, 4);
            else tile(x, sums, q, scales, mins, bias, y, 1, 0, N, K, t, 4);
        } else {
            if (M == MR) tile(x, sums, q, scales, mins, bias, y, MR, 0, N, K, t, 8);
            else tile(x, sums, q, scales, mins, bias, y, 1, 0, N, K, t, 8);
        }
    }
}

/* `tiles` with scratch of its own when there is more than one row group; -1 when it cannot be
   allocated */
TARGET static int64_t part(const float *x, const float *sums, const uint8_t *q, const uint16_t *scales,
                           const uint16_t *mins, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                           int64_t first, int64_t last, int bits) {
    if (M <= MR) {
        tiles(x, sums, q, scales, mins, bias, y, M, N, K, first, last, bits, NULL, NULL);
        return 0;
    }
    float *scratch = (float *)malloc(sizeof(float) * (size_t)((RUN + M) * COLS));
    if (!scratch) return -1;
    tiles(x, sums, q, scales, mins, bias, y, M, N, K, first, last, bits, scratch, scratch + RUN * COLS);
    free(scratch);
    return 0;
}

struct blocks_job { /* gemm_blocks_f32's operands, for its parts on the team */
    const float *x, *sums;
    const uint8_t *q;
    const uint16_t *scales, *mins;
    const float *bias;
    float *y;
    int64_t M, N, K, count, parts;
    int bits;
    _Atomic int64_t failed; /* a part's scratch could not be allocated */
};

TARGET static void blocks_part(void *ctx, int64_t p, int64_t slot) {
    struct blocks_job *j = (struct blocks_job *)ctx;
    (void)slot;
    if (part(j->x, j->sums, j->q, j->scales, j->mins, j->bias, j->y, j->M, j->N, j->K, j->count * p / j->parts,
             j->count * (p + 1) / j->parts, j->bits))
        atomic_store(&j->failed, 1);
}

/* y [M, N] = x [M, K] w^T (+ bias), fp32, on a weight of `bits`-bit codes (4: with mins; 8: without)
   laid out as above; K a multiple of 32. On up to `threads` threads of the kernels' team (kernels/team.c).
   Returns 0, or -1 when a scratch (the runs' input sums, converted codes) cannot be allocated. */
TARGET int64_t gemm_blocks_f32(const float *x, const uint8_t *q, const uint16_t *scales, const uint16_t *mins,
                               const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t bits,
                               int64_t threads) {
    const int64_t runs = K / RUN, count = (N + COLS - 1) / COLS;
    float *sums = NULL;
    if (mins) { /* each row's sum over each run of inputs, in k order: the mins' factor */
        sums = (float *)malloc(sizeof(float) * (size_t)(M * runs > 0 ? M * runs : 1));
        if (!sums) return -1;
        for (int64_t m = 0; m < M; m++)
            for (int64_t b = 0; b < runs; b++) {
                float s = 0.0f;
                for (int64_t k = b * RUN; k < (b + 1) * RUN; k++) s += x[m * K + k];
                sums[m * runs + b] = s;
            }
    }
    int64_t parts = threads * TEAM_PARTS < count / 2 ? threads * TEAM_PARTS : count / 2;
    if (M * N * K < ((int64_t)1 << 19)) parts = 1; /* too small to be worth a hand-off */
    int64_t failed = 0;
    if (parts <= 1) {
        failed = part(x, sums, q, scales, mins, bias, y, M, N, K, 0, count, (int)bits);
    } else {
        struct blocks_job job = {x, sums, q, scales, mins, bias, y, M, N, K, count, parts, (int)bits, 0};
        team_run(blocks_part, &job, parts, threads);
        failed = atomic_load(&job.failed);
    }
    free(sums);
    return failed ? -1 : 0;
}

int64_t blocks_tile_cols(void) { return COLS; }
int64_t blocks_run(void) { return RUN; }
