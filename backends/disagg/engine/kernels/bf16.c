/* The engine's bf16 CPU kernels (AVX-512-BF16): gemm_bf16 (every projection, on its own weight
   layout), gemm_codes_bf16 (decode rows on a Q4_1 block-coded weight), decode_attention_bf16 and
   prompt_attention_bf16 (over the paged KV cache), rms_norm_bf16, silu_mul_bf16 and rope_cache_bf16 (the pointwise work between projections; the last one also
   writes a layer's new keys and values into the cache).

   Built by disagg.engine.kernel (gcc -O3 -fopenmp, at `make` or first use) and called through ctypes
   on the tensors' memory. Dot products are vdpbf16ps (bf16 pairs, fp32 accumulation); bf16 outputs
   are rounded to nearest even. Work is split in parts over the kernels' thread team (team.c); no
   result depends on the thread count, on which thread computes a part, or on the other rows of a
   call. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "team.h"

#define TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))

/* The projection y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for any number of rows M, on a weight
   laid out for it (``pack`` in disagg.engine.kernel).

   The layout: tiles of COLS = 64 outputs; within a tile, for each pair of inputs k = 2 p, 2 p + 1,
   the tile's 64 outputs' two weights: [N / COLS][K / 2][COLS][2], zero-padded to whole tiles. Each
   512-bit vector holds 16 outputs' pair, so vdpbf16ps against an input pair broadcast to every lane
   adds both products to 16 outputs at once; a tile is four such vectors per pair, read front to
   back in one stream. Up to MR input rows share each weight vector loaded: 4 * MR accumulators in
   registers, enough independent sums to cover the dot product's latency, and no horizontal adds.
   All the row groups take a tile while it is in L1, so a call reads the weight from memory once: a
   decode step reads each weight once whatever its batch.

   Every output is one fp32 sum over the pairs p = 0, 1, .. in order (each step adds the pair's two
   products), plus the bias, rounded to bf16 to nearest even, or (`wide`: an output head's logits)
   stored as fp32. That order depends on k alone, never
   on M, on the row group or tile an output falls in, or on which thread computes it, so a row gets
   the same bits at any batch size: a sequence's greedy text does not change with what it is
   batched with. */
#define COLS 64
#ifndef MR
#define MR 6
#endif
#define EACH(i, n) _Pragma("GCC unroll 8") for (int i = 0; i < (n); i++)

/* 16 floats -> 16 bf16, to nearest even; a NaN stays a (quiet) NaN */
TARGET static inline __m256i round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

TARGET static inline __attribute__((always_inline)) void tile(const uint16_t *x, const uint16_t *packed,
                                                              const uint16_t *bias, uint16_t *y, const int MT,
                                                              int64_t r, int64_t m0, int64_t N, int64_t K,
                                                              int wide) {
    const int64_t pairs = K / 2;
    const uint16_t *wt = packed + r * pairs * COLS * 2;
    const uint32_t *in = (const uint32_t *)(x + m0 * K); /* one input pair per 32 bits */
    __m512 acc[MR][4];
    EACH(m, MT) EACH(c, 4) acc[m][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[4];
        EACH(c, 4) wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(wt + (p * COLS + c * 16) * 2));
        EACH(m, MT) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)in[m * pairs + p]);
            EACH(c, 4) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xv, wv[c]);
        }
    }
    EACH(c, 4) {
        const int64_t n = r * COLS + c * 16;
        if (n >= N) break;
        const __mmask16 lanes = N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias + n)), 16));
        if (wide)
            EACH(m, MT) _mm512_mask_storeu_ps((float *)y + (m0 + m) * N + n, lanes, _mm512_add_ps(acc[m][c], b));
        else
            EACH(m, MT) _mm256_mask_storeu_epi16(y + (m0 + m) * N + n, lanes, round_bf16(_mm512_add_ps(acc[m][c], b)));
    }
}

/* Outputs of tile r for rows m_begin .. m_end. */
TARGET static void rows(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t N,
                        int64_t K, int64_t r, int64_t m_begin, int64_t m_end, int wide) {
    int64_t m = m_begin;
    for (; m + MR <= m_end; m += MR) tile(x, packed, bias, y, MR, r, m, N, K, wide);
    switch (m_end - m) { /* the last rows; MR - 1 at most */
        case 7: tile(x, packed, bias, y, 7 % MR, r, m, N, K, wide); break;
        case 6: tile(x, packed, bias, y, 6 % MR, r, m, N, K, wide); break;
        case 5: tile(x, packed, bias, y, 5 % MR, r, m, N, K, wide); break;
        case 4: tile(x, packed, bias, y, 4 % MR, r, m, N, K, wide); break;
        case 3: tile(x, packed, bias, y, 3, r, m, N, K, wide); break;
        case 2: tile(x, packed, bias, y, 2, r, m, N, K, wide); break;
        case 1: tile(x, packed, bias, y, 1, r, m, N, K, wide); break;
        default: break;
    }
}

/* Work items first .. last of `chunks` row chunks per tile, tile-major (a tile's chunks in a row, so
   its weights stay in cache from one chunk to the next). Chunk boundaries fall on multiples of MR. */
TARGET static void items(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t M,
                         int64_t N, int64_t K, int64_t chunks, int64_t first, int64_t last, int wide) {
    const int64_t groups = (M + MR - 1) / MR;
    for (int64_t i = first; i < last; i++) {
        const int64_t r = i / chunks, c = i % chunks;
        const int64_t begin = groups * c / chunks * MR, end = groups * (c + 1) / chunks * MR;
        rows(x, packed, bias, y, N, K, r, begin, end < M ? end : M, wide);
    }
}

struct gemm_job { /* gemm_bf16's operands, for its parts on the team */
    const uint16_t *x, *packed, *bias;
    uint16_t *y;
    int64_t M, N, K, chunks, total, parts;
    int wide;
};

TARGET static void gemm_part(void *ctx, int64_t part, int64_t slot) {
    const struct gemm_job *j = (const struct gemm_job *)ctx;
    (void)slot;
    items(j->x, j->packed, j->bias, j->y, j->M, j->N, j->K, j->chunks, j->total * part / j->parts,
          j->total * (part + 1) / j->parts, j->wide);
}

/* y = x w^T (+ bias), bf16 or (`wide`) fp32, on up to `threads` threads of the team. The work is
   tiles x row chunks (one chunk per thread once there are enough rows: a prompt's outputs split evenly
   whatever the tile count; a decode batch's by tiles only, each weight read once), in up to
   TEAM_PARTS contiguous parts per thread, so the parts of a late helper are taken by the others;
   which thread computes an output changes no bits (see above). K even (the layout holds pairs). */
TARGET void gemm_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t M,
                      int64_t N, int64_t K, int64_t threads, int64_t wide) {
    const int64_t count = (N + COLS - 1) / COLS;
    const int64_t chunks = threads > 1 && M >= 4 * MR * threads ? threads : 1;
    const int64_t total = count * chunks;
    int64_t parts = threads * TEAM_PARTS;
    if (parts > total / 2) parts = total / 2;      /* at least two items a part */
    if (M * N * K < ((int64_t)1 << 19)) parts = 1; /* too small to be worth a hand-off */
    if (parts <= 1) {
        items(x, packed, bias, y, M, N, K, 1, 0, count, (int)wide);
        return;
    }
    const struct gemm_job job = {x, packed, bias, y, M, N, K, chunks, total, parts, (int)wide};
    team_run(gemm_part, (void *)&job, parts, threads);
}

int64_t gemm_tile_cols(void) { return COLS; }

/* The projection's decode rows on a Q4_1 block-coded weight (disagg.engine.blockcode): gemm_codes_bf16.

   A weight converted from llama.cpp's Q4_1 is, per run of 32 inputs of an output, d * q + m with
   codes q in 0..15 and an fp16 scale d and min m. Reading the codes (4.5 bits a weight) instead of
   the bf16 weights (16) is what a decode step, bound by reading the weights, pays for. Each code is
   exact in bf16, so the products with the bf16 inputs are vdpbf16ps as above:

   y[m, n] = sum_b ( d[n, b] * sum_{k in b} x[m, k] q[n, k] + m[n, b] * sum_{k in b} x[m, k] ) + bias[n]

   the code's own value, in fp32 (the bf16 weights are that value rounded), then rounded to bf16 to
   nearest even, or kept as fp32 (`wide`).

   The layout (``quads`` in disagg.engine.blockcode): tiles of QCOLS = 16 outputs; per tile and
   group of four inputs k .. k + 3, 32 bytes, byte 2 j + p holding output j's code of input k + p in
   its low nibble and of input k + 2 + p in its high nibble. Zero-extended to 16-bit words, those 32
   bytes are 16 lanes of (k, k + 1) pairs; the words index a 32-entry table of the codes' bf16
   values (vpermw reads only the index's low 5 bits, so the high nibble needs no mask), and the
   words shifted by 4 give the (k + 2, k + 3) pairs. Per tile and run, the 16 scales and mins, fp16.

   Each output's sum runs in an order fixed by k alone: within a run, the (k, k + 1) pairs in one
   sum and the (k + 2, k + 3) pairs in another, added at the run's end, scaled, and the runs in
   order. So a row's bits do not depend on the rows batched with it, on its row group or on the
   thread, as for gemm_bf16. */
#define QCOLS 16
#define QRUN 32
#define QMR 8 /* rows sharing each converted code vector: 8 is the fastest measured (10 spills) */
#define QPREFETCH_RUNS 8

TARGET static inline __attribute__((always_inline)) void codes_tile(const uint16_t *x, const float *sums,
                                                                    const uint8_t *q, const uint16_t *scales,
                                                                    const uint16_t *mins, const uint16_t *bias,
                                                                    uint16_t *y, const int MT, int64_t m0, int64_t t,
                                                                    int64_t N, int64_t K, int wide) {
    const int64_t runs = K / QRUN, pairs = K / 2;
    const uint8_t *qt = q + t * K * (QCOLS / 2);
    const uint16_t *st = scales + t * runs * QCOLS, *mt = mins + t * runs * QCOLS;
    const uint32_t *in = (const uint32_t *)(x + m0 * K);
    /* the bf16 value of code i & 15 */
    const __m512i table = _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0,
                                           0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, 0x4170, 0x4160,
                                           0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0,
                                           0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
    __m512 total[QMR];
    EACH(m, MT) total[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < runs; b++) {
        const uint8_t *qb = qt + b * QRUN * (QCOLS / 2);
        /* the codes a few runs ahead (into the next tile: the tiles lie in one array; an address past
           its end is only prefetched, never read) */
        const uintptr_t ahead = (uintptr_t)qb + QPREFETCH_RUNS * QRUN * (QCOLS / 2);
        EACH(line, QRUN * (QCOLS / 2) / 64) _mm_prefetch((const char *)(ahead + line * 64), _MM_HINT_T0);
        __m512 low[QMR], high[QMR];
        EACH(m, MT) low[m] = high[m] = _mm512_setzero_ps();
        EACH(g, QRUN / 4) {
            const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qb + g * 32)));
            const __m512bh first = (__m512bh)_mm512_permutexvar_epi16(words, table);
            const __m512bh second = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
            const int64_t p = (b * QRUN + g * 4) / 2;
            EACH(m, MT) {
                low[m] = _mm512_dpbf16_ps(low[m], first, (__m512bh)_mm512_set1_epi32((int)in[m * pairs + p]));
                high[m] = _mm512_dpbf16_ps(high[m], second, (__m512bh)_mm512_set1_epi32((int)in[m * pairs + p + 1]));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + b * QCOLS)));
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + b * QCOLS)));
        EACH(m, MT) {
            total[m] = _mm512_fmadd_ps(d, _mm512_add_ps(low[m], high[m]), total[m]);
            total[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sums[(m0 + m) * runs + b]), total[m]);
        }
    }
    const int64_t n = t * QCOLS;
    const __mmask16 lanes = N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
    __m512 bv = _mm512_setzero_ps();
    if (bias)
        bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias + n)), 16));
    if (wide)
        EACH(m, MT) _mm512_mask_storeu_ps((float *)y + (m0 + m) * N + n, lanes, _mm512_add_ps(total[m], bv));
    else
        EACH(m, MT) _mm256_mask_storeu_epi16(y + (m0 + m) * N + n, lanes, round_bf16(_mm512_add_ps(total[m], bv)));
}

/* Tiles first .. last, each for every row group of QMR rows, then the last rows (QMR - 1 at most). */
TARGET static void codes_tiles(const uint16_t *x, const float *sums, const uint8_t *q, const uint16_t *scales,
                               const uint16_t *mins, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                               int64_t K, int64_t first, int64_t last, int wide) {
    for (int64_t t = first; t < last; t++) {
        int64_t m = 0;
        for (; m + QMR <= M; m += QMR) codes_tile(x, sums, q, scales, mins, bias, y, QMR, m, t, N, K, wide);
        switch (M - m) {
            case 7: codes_tile(x, sums, q, scales, mins, bias, y, 7 % QMR, m, t, N, K, wide); break;
            case 6: codes_tile(x, sums, q, scales, mins, bias, y, 6 % QMR, m, t, N, K, wide); break;
            case 5: codes_tile(x, sums, q, scales, mins, bias, y, 5 % QMR, m, t, N, K, wide); break;
            case 4: codes_tile(x, sums, q, scales, mins, bias, y, 4 % QMR, m, t, N, K, wide); break;
            case 3: codes_tile(x, sums, q, scales, mins, bias, y, 3, m, t, N, K, wide); break;
            case 2: codes_tile(x, sums, q, scales, mins, bias, y, 2, m, t, N, K, wide); break;
            case 1: codes_tile(x, sums, q, scales, mins, bias, y, 1, m, t, N, K, wide); break;
            default: break;
        }
    }
}

struct codes_job { /* gemm_codes_bf16's operands, for its parts on the team */
    const uint16_t *x;
    const float *sums;
    const uint8_t *q;
    const uint16_t *scales, *mins, *bias;
    uint16_t *y;
    int64_t M, N, K, count, parts;
    int wide;
};

TARGET static void codes_part(void *ctx, int64_t p, int64_t slot) {
    const struct codes_job *j = (const struct codes_job *)ctx;
    (void)slot;
    codes_tiles(j->x, j->sums, j->q, j->scales, j->mins, j->bias, j->y, j->M, j->N, j->K, j->count * p / j->parts,
                j->count * (p + 1) / j->parts, j->wide);
}

/* y [M, N] = x [M, K] w^T (+ bias) on a Q4_1 weight laid out as above, bf16 or (`wide`) fp32; K a
   multiple of 32. `sums` [M, K / 32]: scratch for each row's sum over each run of inputs (the mins'
   factor), in fp32, in k order. On up to `threads` threads of the team, split by
   tiles. */
TARGET void gemm_codes_bf16(const uint16_t *x, const uint8_t *q, const uint16_t *scales, const uint16_t *mins,
                            const uint16_t *bias, uint16_t *y, float *sums, int64_t M, int64_t N, int64_t K,
                            int64_t threads, int64_t wide) {
    const int64_t runs = K / QRUN, count = (N + QCOLS - 1) / QCOLS;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < runs; b++) {
            float s = 0.0f;
            for (int64_t k = b * QRUN; k < (b + 1) * QRUN; k++) {
                union { uint32_t u; float f; } v = {.u = (uint32_t)x[m * K + k] << 16};
                s += v.f;
            }
            sums[m * runs + b] = s;
        }
    int64_t parts = threads * TEAM_PARTS < count / 2 ? threads * TEAM_PARTS : count / 2;
    if (M * N * K < ((int64_t)1 << 19)) parts = 1; /* too small to be worth a hand-off */
    if (parts <= 1) {
        codes_tiles(x, sums, q, scales, mins, bias, y, M, N, K, 0, count, (int)wide);
        return;
    }
    const struct codes_job job = {x, sums, q, scales, mins, bias, y, M, N, K, count, parts, (int)wide};
    team_run(codes_part, (void *)&job, parts, threads);
}

int64_t codes_tile_cols(void) { return QCOLS; }

/* e^x for x <= 0 (softmax after subtracting the maximum): 2^(x log2 e) split into an integer
   power (scalef) and 2^f, f in [-0.5, 0.5], by its degree-6 Taylor polynomial (relative error
   about 1e-7). */
TARGET static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910071f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718055994531f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 16 bf16 values -> 16 floats */
TARGET static inline __m512 widen(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Decode attention over the paged KV cache, one query row per sequence, every sequence and head in
   one call. The cache is [num_blocks, layers, 2, block_size, kv_heads, head_dim] bf16; sequence b
   attends to positions 0..positions[b] through its row of `tables` [B, table_width]. Each query head
   group (the `group` query heads of one kv head) reads each key and value row once. Scores and the
   softmax are fp32 (scratch: scratch_size = group * (max position + 1) floats per thread), the
   output [B, heads, head_dim] bf16. head_dim must be a multiple of 32 and at most 256. Sequences are
   spread over up to `threads` threads of the team (as gemm_bf16); a sequence's result does
   not depend on which. */
#ifndef AHEAD
#define AHEAD 8 /* positions ahead the cache rows are prefetched: blocks lie anywhere in memory */
#endif
struct decode_attention_job { /* decode_attention_bf16's operands, for its sequences on the team */
    const uint16_t *q, *cache;
    const int64_t *tables, *positions;
    uint16_t *out;
    float *scratches;
    int64_t table_width, layer, layers, block_size, kv_heads, group, head_dim, scratch_size;
    float scale;
};

/* Sequence b of a decode_attention_bf16 call, in scratch `slot`. */
TARGET static void decode_attention_sequence(void *ctx, int64_t b, int64_t slot) {
    const struct decode_attention_job *job = (const struct decode_attention_job *)ctx;
    const uint16_t *q = job->q, *cache = job->cache;
    const int64_t *tables = job->tables, *positions = job->positions;
    uint16_t *out = job->out;
    const int64_t table_width = job->table_width, layer = job->layer, layers = job->layers;
    const int64_t block_size = job->block_size, kv_heads = job->kv_heads, group = job->group;
    const int64_t head_dim = job->head_dim;
    const float scale = job->scale;
    const int64_t row = kv_heads * head_dim;           /* one position's keys (or values) */
    const int64_t block_stride = layers * 2 * block_size * row;
    const int64_t chunks = head_dim / 16;               /* 16 floats per vector */
    {
        float *scratch = job->scratches + slot * job->scratch_size;
        const int64_t span = positions[b] + 1;
        const int64_t *table = tables + b * table_width;
        for (int64_t h = 0; h < kv_heads; h++) {
            const uint16_t *queries = q + (b * kv_heads + h) * group * head_dim;
            /* scores[j * span + p] = q_j . k_p * scale */
            for (int64_t p = 0; p < span; p++) {
                const uint16_t *k = cache + table[p / block_size] * block_stride +
                                    (layer * 2 * block_size + p % block_size) * row + h * head_dim;
                if (p + AHEAD < span) { /* a later position's key and value rows, from memory */
                    const int64_t a = p + AHEAD;
                    const uint16_t *later = cache + table[a / block_size] * block_stride +
                                            (layer * 2 * block_size + a % block_size) * row + h * head_dim;
                    for (int64_t d = 0; d < head_dim; d += 32) {
                        _mm_prefetch((const char *)(later + d), _MM_HINT_T0);
                        _mm_prefetch((const char *)(later + block_size * row + d), _MM_HINT_T1);
                    }
                }
                for (int64_t j = 0; j < group; j++) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t d = 0; d < head_dim; d += 32)
                        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(queries + j * head_dim + d)),
                                               (__m512bh)_mm512_loadu_si512((const void *)(k + d)));
                    scratch[j * span + p] = _mm512_reduce_add_ps(acc) * scale;
                }
            }
            for (int64_t j = 0; j < group; j++) {
                float *s = scratch + j * span;
                __m512 top = _mm512_set1_ps(-INFINITY);
                int64_t p = 0;
                for (; p + 16 <= span; p += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + p));
                float most = _mm512_reduce_max_ps(top);
                for (; p < span; p++) most = s[p] > most ? s[p] : most;
                const __m512 shift = _mm512_set1_ps(most);
                __m512 sum = _mm512_setzero_ps();
                for (p = 0; p + 16 <= span; p += 16) {
                    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + p), shift));
                    _mm512_storeu_ps(s + p, e);
                    sum = _mm512_add_ps(sum, e);
                }
                if (p < span) {
                    const __mmask16 m = (__mmask16)((1u << (span - p)) - 1);
                    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + p), shift));
                    _mm512_mask_storeu_ps(s + p, m, e);
                    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
                }
                const float inverse = 1.0f / _mm512_reduce_add_ps(sum);
                for (p = 0; p < span; p++) s[p] *= inverse;
            }
            /* out_j = sum_p weight[j, p] v_p */
            __m512 acc[8][16];
            for (int64_t j = 0; j < group; j++)
                for (int64_t c = 0; c < chunks; c++) acc[j][c] = _mm512_setzero_ps();
            for (int64_t p = 0; p < span; p++) {
                const uint16_t *v = cache + table[p / block_size] * block_stride +
                                    ((layer * 2 + 1) * block_size + p % block_size) * row + h * head_dim;
                for (int64_t c = 0; c < chunks; c++) {
                    const __m512 vv = widen(v + c * 16);
                    for (int64_t j = 0; j < group; j++)
                        acc[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(scratch[j * span + p]), vv, acc[j][c]);
                }
            }
            for (int64_t j = 0; j < group; j++) {
                uint16_t *o = out + ((b * kv_heads + h) * group + j) * head_dim;
                for (int64_t c = 0; c < chunks; c++)
                    _mm256_storeu_si256((__m256i *)(o + c * 16), round_bf16(acc[j][c]));
            }
        }
    }
}

TARGET void decode_attention_bf16(const uint16_t *q, const uint16_t *cache, const int64_t *tables,
                                  const int64_t *positions, uint16_t *out, float *scratches, int64_t B,
                                  int64_t table_width, int64_t layer, int64_t layers, int64_t block_size,
                                  int64_t kv_heads, int64_t group, int64_t head_dim, float scale,
                                  int64_t threads, int64_t scratch_size) {
    const struct decode_attention_job job = {q,      cache,      tables,   positions, out,  scratches,   table_width,
                                             layer,  layers,     block_size, kv_heads, group, head_dim, scratch_size,
                                             scale};
    /* sequences are independent: one at a time per thread, claimed in order */
    team_run(decode_attention_sequence, (void *)&job, B, threads > B ? B : threads);
}

/* Prompt attention over the paged KV cache: the T rows of one sequence's prompt chunk, at positions
   start .. start + T - 1, each over positions 0 .. its own (causal), the chunk's keys and values
   already written to the cache. q and out are [T, kv_heads * group, head_dim] bf16; `table` is the
   sequence's blocks. Flash-style: keys are taken 16 positions at a time, laid out once per work item
   as dot-product pairs (16 keys' pair of dimensions per vector), so vdpbf16ps scores 16 keys per
   instruction, and values likewise (16 dimensions of two keys per vector); the softmax runs online
   in fp32 (running maximum and sum), its weights are rounded to bf16 for the values' sum, which
   accumulates in fp32. A work item is one kv head and up to ROWS query rows (all `group` query heads), spread
   over up to `threads` threads of the team. head_dim a multiple of 32, at most 256;
   scratch: `threads` * prompt_scratch_floats(head_dim, group) floats. */
#define ROWS 16
#define KEYS 16

int64_t prompt_scratch_floats(int64_t head_dim, int64_t group) {
    /* keys and values as pairs (2 * head_dim / 2 * KEYS uint32), and per query vector its scores
       (KEYS), output (head_dim), maximum and sum */
    return head_dim * KEYS + ROWS * group * (KEYS + head_dim + 2);
}

struct prompt_attention_job { /* prompt_attention_bf16's operands, for its items on the team */
    const uint16_t *q, *cache;
    const int64_t *table;
    uint16_t *out;
    float *scratches;
    int64_t T, start, layer, layers, block_size, kv_heads, group, head_dim;
    float scale;
};

/* Work item `item` of a prompt_attention_bf16 call (a kv head and up to ROWS rows), in scratch `slot`. */
TARGET static void prompt_attention_item(void *ctx, int64_t item, int64_t slot) {
    const struct prompt_attention_job *job = (const struct prompt_attention_job *)ctx;
    const uint16_t *q = job->q, *cache = job->cache;
    const int64_t *table = job->table;
    uint16_t *out = job->out;
    const int64_t T = job->T, start = job->start, layer = job->layer, layers = job->layers;
    const int64_t block_size = job->block_size, kv_heads = job->kv_heads, group = job->group;
    const int64_t head_dim = job->head_dim;
    const float scale = job->scale;
    const int64_t row = kv_heads * head_dim;
    const int64_t block_stride = layers * 2 * block_size * row;
    const int64_t heads = kv_heads * group, pairs = head_dim / 2, chunks = head_dim / 16;
    const int64_t per_thread = prompt_scratch_floats(head_dim, group);
    {
        const int64_t h = item % kv_heads, r0 = item / kv_heads * ROWS;
        const int64_t r1 = r0 + ROWS < T ? r0 + ROWS : T, vectors = (r1 - r0) * group;
        float *base = job->scratches + slot * per_thread;
        uint32_t *keys = (uint32_t *)base;               /* [pairs][KEYS]: two dimensions of a key */
        uint16_t *values = (uint16_t *)(keys + pairs * KEYS); /* [KEYS / 2][head_dim][2]: two keys' */
        float *scores = base + head_dim * KEYS;           /* [vectors][KEYS] */
        float *acc = scores + ROWS * group * KEYS;   /* [vectors][head_dim] */
        float *most = acc + ROWS * group * head_dim; /* [vectors] */
        float *sum = most + ROWS * group;            /* [vectors] */
        for (int64_t v = 0; v < vectors; v++) {
            most[v] = -INFINITY;
            sum[v] = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) acc[v * head_dim + d] = 0.0f;
        }
        const int64_t last = start + r1 - 1; /* the furthest position any of these rows sees */
        for (int64_t c0 = 0; c0 <= last; c0 += KEYS) {
            const int64_t n = last + 1 - c0 < KEYS ? last + 1 - c0 : KEYS;
            for (int64_t t = 0; t < KEYS; t++) {
                uint16_t *vpair = values + (t / 2) * head_dim * 2 + t % 2;
                if (t >= n) { /* past the last key: zero, and masked below */
                    for (int64_t d = 0; d < pairs; d++) keys[d * KEYS + t] = 0;
                    for (int64_t d = 0; d < head_dim; d++) vpair[d * 2] = 0;
                    continue;
                }
                const int64_t p = c0 + t;
                const uint16_t *k = cache + table[p / block_size] * block_stride +
                                    (layer * 2 * block_size + p % block_size) * row + h * head_dim;
                const uint32_t *kp = (const uint32_t *)k;
                for (int64_t d = 0; d < pairs; d++) keys[d * KEYS + t] = kp[d];
                const uint16_t *vrow = k + block_size * row;
                for (int64_t d = 0; d < head_dim; d++) vpair[d * 2] = vrow[d];
            }
            /* scores of every query vector against these keys, four vectors at a time */
            for (int64_t v0 = 0; v0 < vectors; v0 += 4) {
                const int64_t vn = vectors - v0 < 4 ? vectors - v0 : 4;
                __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                const uint32_t *qv[4];
                for (int64_t u = 0; u < 4; u++) {
                    const int64_t v = v0 + (u < vn ? u : 0), i = r0 + v / group, j = v % group;
                    qv[u] = (const uint32_t *)(q + (i * heads + h * group + j) * head_dim);
                }
                for (int64_t d = 0; d < pairs; d++) {
                    const __m512bh kv = (__m512bh)_mm512_loadu_si512((const void *)(keys + d * KEYS));
                    for (int u = 0; u < 4; u++) s[u] = _mm512_dpbf16_ps(s[u], (__m512bh)_mm512_set1_epi32((int)qv[u][d]), kv);
                }
                for (int64_t u = 0; u < vn; u++) _mm512_storeu_ps(scores + (v0 + u) * KEYS, s[u]);
            }
            /* online softmax and the values' weighted sum, per query vector */
            for (int64_t v = 0; v < vectors; v++) {
                const int64_t position = start + r0 + v / group;
                if (c0 > position) continue; /* every key here is after this row */
                const int64_t seen = position - c0 + 1 < n ? position - c0 + 1 : n;
                const __mmask16 lanes = (__mmask16)((1u << seen) - 1);
                const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(scores + v * KEYS), _mm512_set1_ps(scale));
                const float top = _mm512_mask_reduce_max_ps(lanes, sv);
                const float updated = top > most[v] ? top : most[v];
                const float correction = most[v] == -INFINITY ? 0.0f : expf(most[v] - updated);
                const __m512 e = _mm512_maskz_mov_ps(lanes, exp_nonpositive(_mm512_sub_ps(sv, _mm512_set1_ps(updated))));
                uint32_t weights[KEYS / 2]; /* the weights in bf16, two keys' per 32 bits */
                _mm256_storeu_si256((__m256i *)weights, round_bf16(e));
                sum[v] = sum[v] * correction + _mm512_reduce_add_ps(e);
                most[v] = updated;
                float *o = acc + v * head_dim;
                const int64_t used = (seen + 1) / 2;
                for (int64_t c = 0; c < chunks; c++) {
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(o + c * 16), _mm512_set1_ps(correction));
                    for (int64_t tp = 0; tp < used; tp++)
                        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi32((int)weights[tp]),
                                             (__m512bh)_mm512_loadu_si512((const void *)(values + (tp * head_dim + c * 16) * 2)));
                    _mm512_storeu_ps(o + c * 16, a);
                }
            }
        }
        for (int64_t v = 0; v < vectors; v++) {
            const int64_t i = r0 + v / group, j = v % group;
            uint16_t *o = out + (i * heads + h * group + j) * head_dim;
            const __m512 inverse = _mm512_set1_ps(1.0f / sum[v]);
            for (int64_t c = 0; c < chunks; c++)
                _mm256_storeu_si256((__m256i *)(o + c * 16), round_bf16(_mm512_mul_ps(_mm512_loadu_ps(acc + v * head_dim + c * 16), inverse)));
        }
    }
}

TARGET void prompt_attention_bf16(const uint16_t *q, const uint16_t *cache, const int64_t *table, uint16_t *out,
                                  float *scratches, int64_t T, int64_t start, int64_t layer, int64_t layers,
                                  int64_t block_size, int64_t kv_heads, int64_t group, int64_t head_dim,
                                  float scale, int64_t threads) {
    const int64_t items = kv_heads * ((T + ROWS - 1) / ROWS);
    const struct prompt_attention_job job = {q,     cache,  table,      out,      scratches, T,       start,
                                             layer, layers, block_size, kv_heads, group,     head_dim, scale};
    team_run(prompt_attention_item, (void *)&job, items, threads > items ? items : threads);
}

/* Pointwise work between the projections, one pass each instead of several PyTorch operations; per
   row, so a row's result does not depend on the others. Rows are spread over up to `threads`
   threads when there are enough of them. Widths must be multiples of 16. */
#define POINTWISE_MIN ((int64_t)1 << 16) /* elements below which a call runs on its caller alone */

/* Rows first .. last of a pointwise call; `ctx` its operands. */
typedef void (*row_range)(const void *ctx, int64_t first, int64_t last);

struct rows_job {
    row_range fn;
    const void *ctx;
    int64_t T, parts;
};

static void rows_part(void *ctx, int64_t part, int64_t slot) {
    const struct rows_job *job = (const struct rows_job *)ctx;
    (void)slot;
    job->fn(job->ctx, job->T * part / job->parts, job->T * (part + 1) / job->parts);
}

/* fn over rows 0 .. T - 1, in parts on the team when the call has `elements` enough to be worth it. */
static void over_rows(row_range fn, const void *ctx, int64_t T, int64_t elements, int64_t threads) {
    int64_t parts = threads > 1 && elements >= POINTWISE_MIN ? threads * TEAM_PARTS : 1;
    if (parts > T) parts = T;
    if (parts <= 1) {
        fn(ctx, 0, T);
        return;
    }
    const struct rows_job job = {fn, ctx, T, parts};
    team_run(rows_part, (void *)&job, parts, threads);
}

TARGET static inline __m512 round_trip(__m512 v) { /* v rounded to bf16, back as floats */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round_bf16(v)), 16));
}

/* y = weight * bf16(x * rsqrt(mean(x^2) + eps)) per row of H, x and weight bf16, statistics in fp32:
   what the reference RMSNorm computes. */
struct rms_norm_job {
    const uint16_t *x, *weight;
    uint16_t *y;
    int64_t H;
    float eps;
};

TARGET static void rms_norm_rows(const void *ctx, int64_t first, int64_t last) {
    const struct rms_norm_job *job = (const struct rms_norm_job *)ctx;
    const uint16_t *x = job->x, *weight = job->weight;
    uint16_t *y = job->y;
    const int64_t H = job->H;
    const float eps = job->eps;

    for (int64_t t = first; t < last; t++) {
        const uint16_t *in = x + t * H;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t c = 0; c < H; c += 16) {
            const __m512 v = widen(in + c);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)H + eps));
        for (int64_t c = 0; c < H; c += 16) {
            const __m512 normed = round_trip(_mm512_mul_ps(widen(in + c), scale));
            _mm256_storeu_si256((__m256i *)(y + t * H + c), round_bf16(_mm512_mul_ps(normed, widen(weight + c))));
        }
    }
}

TARGET void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t T, int64_t H, float eps,
                          int64_t threads) {
    const struct rms_norm_job job = {x, weight, y, H, eps};
    over_rows(rms_norm_rows, &job, T, T * H, threads);
}

/* out = silu(gate) * up per row, gate_up [T, 2 I] (gate first), out [T, I], in fp32, rounded once. */
struct silu_mul_job {
    const uint16_t *gate_up;
    uint16_t *out;
    int64_t I;
};

TARGET static void silu_mul_rows(const void *ctx, int64_t first, int64_t last) {
    const struct silu_mul_job *job = (const struct silu_mul_job *)ctx;
    const uint16_t *gate_up = job->gate_up;
    uint16_t *out = job->out;
    const int64_t I = job->I;

    for (int64_t t = first; t < last; t++) {
        const uint16_t *gate = gate_up + t * 2 * I, *up = gate + I;
        for (int64_t c = 0; c < I; c += 16) {
            const __m512 g = widen(gate + c);
            /* e = exp(-|g|) <= 1; silu(g) = g / (1 + e^-g) = g / (1 + e) for g >= 0, g e / (1 + e) else */
            const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
            const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 top = _mm512_mask_mul_ps(g, negative, g, e);
            const __m512 silu = _mm512_div_ps(top, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm256_storeu_si256((__m256i *)(out + t * I + c), round_bf16(_mm512_mul_ps(silu, widen(up + c))));
        }
    }
}

TARGET void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t I, int64_t threads) {
    const struct silu_mul_job job = {gate_up, out, I};
    over_rows(silu_mul_rows, &job, T, T * I, threads);
}

TARGET static inline __m512 negated(__m512 v) { /* -v, the sign bit flipped (-0 for 0, as PyTorch) */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}

/* x * cos + rotate_half(x) * sin over one head of head_dim = 2 * half (half a multiple of 16), with
   each product and the sum rounded to bf16, as RotaryTable.apply's PyTorch operations round them:
   the same bits. */
TARGET static inline void rotate(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, uint16_t *out,
                                 int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const __m512 x1 = widen(x + i), x2 = widen(x + half + i);
        const __m512 low = _mm512_add_ps(round_trip(_mm512_mul_ps(x1, widen(cos + i))),
                                         round_trip(_mm512_mul_ps(negated(x2), widen(sin + i))));
        const __m512 high = _mm512_add_ps(round_trip(_mm512_mul_ps(x2, widen(cos + half + i))),
                                          round_trip(_mm512_mul_ps(x1, widen(sin + half + i))));
        _mm256_storeu_si256((__m256i *)(out + i), round_bf16(low));
        _mm256_storeu_si256((__m256i *)(out + half + i), round_bf16(high));
    }
}

/* A layer's attention inputs from its qkv projection, in one pass instead of a dozen PyTorch
   operations: rows qkv [T, (heads + 2 kv_heads) * head_dim] (q, k, v), at positions[t]. The queries,
   rotated, go to q_out [T, heads, head_dim]; the keys, rotated, and the values go straight into the
   KV cache [blocks, layers, 2, block_size, kv_heads, head_dim] of `layer`, at block slot_block[t],
   offset slot_offset[t]. cos and sin: bf16 [positions, head_dim]. head_dim a multiple of 32. */
struct rope_cache_job {
    const uint16_t *qkv;
    uint16_t *q_out, *cache;
    const int64_t *positions, *slot_block, *slot_offset;
    const uint16_t *cos, *sin;
    int64_t heads, kv_heads, head_dim, layers, layer, block_size;
};

TARGET static void rope_cache_rows(const void *ctx, int64_t first, int64_t last) {
    const struct rope_cache_job *job = (const struct rope_cache_job *)ctx;
    const uint16_t *qkv = job->qkv, *cos = job->cos, *sin = job->sin;
    uint16_t *q_out = job->q_out, *cache = job->cache;
    const int64_t *positions = job->positions, *slot_block = job->slot_block, *slot_offset = job->slot_offset;
    const int64_t heads = job->heads, kv_heads = job->kv_heads, head_dim = job->head_dim;
    const int64_t layers = job->layers, layer = job->layer, block_size = job->block_size;
    const int64_t width = (heads + 2 * kv_heads) * head_dim, half = head_dim / 2, kv = kv_heads * head_dim;
    for (int64_t t = first; t < last; t++) {
        const uint16_t *row = qkv + t * width;
        const uint16_t *c = cos + positions[t] * head_dim, *s = sin + positions[t] * head_dim;
        uint16_t *keys = cache + (((slot_block[t] * layers + layer) * 2) * block_size + slot_offset[t]) * kv;
        uint16_t *values = keys + block_size * kv; /* the same slot of the block's value half */
        for (int64_t h = 0; h < heads; h++) rotate(row + h * head_dim, c, s, q_out + (t * heads + h) * head_dim, half);
        for (int64_t h = 0; h < kv_heads; h++) rotate(row + (heads + h) * head_dim, c, s, keys + h * head_dim, half);
        const uint16_t *v = row + (heads + kv_heads) * head_dim;
        for (int64_t i = 0; i < kv; i += 32) _mm512_storeu_si512((void *)(values + i), _mm512_loadu_si512((const void *)(v + i)));
    }
}

TARGET void rope_cache_bf16(const uint16_t *qkv, uint16_t *q_out, uint16_t *cache, const int64_t *positions,
                            const int64_t *slot_block, const int64_t *slot_offset, const uint16_t *cos,
                            const uint16_t *sin, int64_t T, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t layers, int64_t layer, int64_t block_size, int64_t threads) {
    const struct rope_cache_job job = {qkv, q_out, cache, positions, slot_block, slot_offset, cos, sin,
                                       heads, kv_heads, head_dim, layers, layer, block_size};
    over_rows(rope_cache_rows, &job, T, T * (heads + 2 * kv_heads) * head_dim, threads);
}
