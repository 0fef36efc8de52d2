/* The engine's fp32 CPU kernels for the work between projections (AVX2, FMA): rms_norm_f32,
   rope_cache_f32 (a layer's rotary embedding and its KV cache writes in one pass) and
   decode_attention_f32 (every decode row over its own blocks of the paged cache, in one call).

   Built by disagg.engine.kernel like kernels/bf16.c and used beside the block-code projections
   (kernels/blocks.c): one call per layer and operation instead of PyTorch's dozens of small ones.
   Every result is computed in an order fixed by its own row (and position), never by the batch, so
   a sequence's output does not depend on what it is batched with, nor on the thread count.
   rope_cache_f32 rounds exactly as the PyTorch rotary it replaces (x * cos, then the rotated half
   * sin, then their sum, no fused multiply-add): the same bits. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "team.h"
#include <string.h>

#define TARGET __attribute__((target("avx2,fma")))

/* the sum of a vector's 8 lanes, in a fixed order */
TARGET static inline float lanes_sum(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

/* y[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), rows of `width` floats */
TARGET void rms_norm_f32(const float *x, const float *w, float *y, int64_t rows, int64_t width, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *in = x + r * width;
        float *out = y + r * width;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= width; i += 8) {
            const __m256 v = _mm256_loadu_ps(in + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float squares = lanes_sum(acc);
        for (; i < width; i++) squares += in[i] * in[i];
        const float inverse = 1.0f / sqrtf(squares / (float)width + eps);
        const __m256 scale = _mm256_set1_ps(inverse);
        for (i = 0; i + 8 <= width; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(in + i), scale)));
        for (; i < width; i++) out[i] = w[i] * (in[i] * inverse);
    }
}

/* one head of `hd` floats rotated at a position (rotate-half): out = x * cos + rotate(x) * sin */
static inline void rotate(const float *x, const float *cos, const float *sin, float *out, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i] * cos[i], b = -x[i + half] * sin[i];
        out[i] = a + b;
    }
    for (int64_t i = half; i < hd; i++) {
        const float a = x[i] * cos[i], b = x[i - half] * sin[i];
        out[i] = a + b;
    }
}

/* Rows of qkv [T, (heads + 2 kv_heads) * hd]: the queries rotated into q [T, heads, hd]; the keys
   rotated and the values copied into the cache [blocks, layers, 2, bs, kv_heads, hd] at each row's
   (slot_block, slot_offset) of `layer`. cos / sin: [positions, hd]. */
void rope_cache_f32(const float *qkv, float *q, float *cache, const int64_t *positions, const int64_t *slot_block,
                    const int64_t *slot_offset, const float *cos, const float *sin, int64_t rows, int64_t heads,
                    int64_t kv_heads, int64_t hd, int64_t layers, int64_t layer, int64_t bs) {
    const int64_t width = (heads + 2 * kv_heads) * hd, plane = bs * kv_heads * hd;
    for (int64_t r = 0; r < rows; r++) {
        const float *in = qkv + r * width, *c = cos + positions[r] * hd, *s = sin + positions[r] * hd;
        float *keys = cache + ((slot_block[r] * layers + layer) * 2) * plane + slot_offset[r] * kv_heads * hd;
        float *values = keys + plane;
        for (int64_t h = 0; h < heads; h++) rotate(in + h * hd, c, s, q + (r * heads + h) * hd, hd);
        for (int64_t h = 0; h < kv_heads; h++) rotate(in + (heads + h) * hd, c, s, keys + h * hd, hd);
        memcpy(values, in + (heads + kv_heads) * hd, sizeof(float) * (size_t)(kv_heads * hd));
    }
}

/* dot product of two rows of hd floats (hd a multiple of 8), lanes summed in a fixed order */
TARGET static inline float dot(const float *a, const float *b, int64_t hd) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return lanes_sum(acc);
}

/* q's dot products with 8 keys k + j * stride (j = 0..7) as one vector, lane j for key j: eight
   accumulators, then a fixed tree of pairwise sums (hd a multiple of 8) */
TARGET static inline __m256 dot8(const float *q, const float *k, int64_t stride, int64_t hd) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t i = 0; i < hd; i += 8) {
        const __m256 x = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + stride + i), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * stride + i), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * stride + i), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * stride + i), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * stride + i), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * stride + i), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * stride + i), a7);
    }
    const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

/* exp(x) in every lane for x <= 0 (softmax terms), relative error about 2e-7; lanes below -87 (where
   exp underflows) give 0. Range reduction x = n ln2 + r with ln2 split in two, then a degree-6
   polynomial for exp(r) (the Cephes coefficients) scaled by 2^n through the exponent bits. */
TARGET static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.0f);
    const __m256 keep = _mm256_cmp_ps(x, low, _CMP_GE_OQ);
    x = _mm256_max_ps(x, low);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), keep);
}

/* s[0 .. span) = exp(s - max s), returned: their sum, in an order fixed by span alone */
TARGET static float softmax_terms(float *s, int64_t span) {
    float most = -INFINITY;
    for (int64_t p = 0; p < span; p++) most = s[p] > most ? s[p] : most;
    const __m256 top = _mm256_set1_ps(most);
    __m256 total = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 8 <= span; p += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + p), top));
        _mm256_storeu_ps(s + p, e);
        total = _mm256_add_ps(total, e);
    }
    if (p < span) {  /* the last partial vector, padded with -inf (exp 0) */
        float tail[8];
        for (int64_t i = 0; i < 8; i++) tail[i] = p + i < span ? s[p + i] - most : -INFINITY;
        const __m256 e = exp_nonpositive(_mm256_loadu_ps(tail));
        _mm256_storeu_ps(tail, e);
        for (int64_t i = 0; p + i < span; i++) s[p + i] = tail[i];
        total = _mm256_add_ps(total, e);
    }
    return lanes_sum(total);
}

/* Sequence b's kv head h: its `group` query heads over positions 0 .. where[b] of its blocks.
   scores: group * (where[b] + 1) floats of scratch. Positions are walked block by block; a query
   head's output is its weighted sum of values in position order, 64 floats at a time in registers. */
TARGET static void attend(const float *q, const float *cache, const int64_t *table, const int64_t *where, float *out,
                          float *scores, int64_t b, int64_t h, int64_t width, int64_t layer, int64_t layers,
                          int64_t bs, int64_t kv_heads, int64_t group, int64_t hd, float scale) {
    const int64_t span = where[b] + 1, plane = bs * kv_heads * hd, heads = kv_heads * group, stride = kv_heads * hd;
    const int64_t *blocks = table + b * width;
    const __m256 scaled = _mm256_set1_ps(scale);
    for (int64_t blk = 0, p = 0; p < span; blk++) {
        const float *k = cache + ((blocks[blk] * layers + layer) * 2) * plane + h * hd;
        int64_t t = 0;
        for (; t + 8 <= bs && p + 8 <= span; t += 8, p += 8, k += 8 * stride)  /* 8 keys of one block */
            for (int64_t g = 0; g < group; g++)
                _mm256_storeu_ps(scores + g * span + p,
                                 _mm256_mul_ps(dot8(q + (b * heads + h * group + g) * hd, k, stride, hd), scaled));
        for (; t < bs && p < span; t++, p++, k += stride)
            for (int64_t g = 0; g < group; g++)
                scores[g * span + p] = dot(q + (b * heads + h * group + g) * hd, k, hd) * scale;
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * span;
        const __m256 inverse = _mm256_set1_ps(1.0f / softmax_terms(s, span));
        float *o = out + (b * heads + h * group + g) * hd;
        int64_t c = 0;
        for (; c + 64 <= hd; c += 64) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t blk = 0, p = 0; p < span; blk++) {
                const float *v = cache + ((blocks[blk] * layers + layer) * 2 + 1) * plane + h * hd + c;
                for (int64_t t = 0; t < bs && p < span; t++, p++, v += stride) {
                    const __m256 w = _mm256_set1_ps(s[p]);
                    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
                    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
                    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
                    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
                    a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), a4);
                    a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), a5);
                    a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), a6);
                    a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), a7);
                }
            }
            _mm256_storeu_ps(o + c, _mm256_mul_ps(a0, inverse));
            _mm256_storeu_ps(o + c + 8, _mm256_mul_ps(a1, inverse));
            _mm256_storeu_ps(o + c + 16, _mm256_mul_ps(a2, inverse));
            _mm256_storeu_ps(o + c + 24, _mm256_mul_ps(a3, inverse));
            _mm256_storeu_ps(o + c + 32, _mm256_mul_ps(a4, inverse));
            _mm256_storeu_ps(o + c + 40, _mm256_mul_ps(a5, inverse));
            _mm256_storeu_ps(o + c + 48, _mm256_mul_ps(a6, inverse));
            _mm256_storeu_ps(o + c + 56, _mm256_mul_ps(a7, inverse));
        }
        if (c < hd) {  /* the rest of a head_dim that is not a multiple of 64: the same sums, in memory */
            for (int64_t i = c; i < hd; i += 8) _mm256_storeu_ps(o + i, _mm256_setzero_ps());
            for (int64_t blk = 0, p = 0; p < span; blk++) {
                const float *v = cache + ((blocks[blk] * layers + layer) * 2 + 1) * plane + h * hd;
                for (int64_t t = 0; t < bs && p < span; t++, p++, v += stride) {
                    const __m256 w = _mm256_set1_ps(s[p]);
                    for (int64_t i = c; i < hd; i += 8)
                        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
                }
            }
            for (int64_t i = c; i < hd; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), inverse));
        }
    }
}

struct attention_job { /* decode_attention_f32's operands, for its items on the team */
    const float *q, *cache;
    const int64_t *table, *where;
    float *out, *scratch;
    int64_t width, layer, layers, bs, kv_heads, group, hd, per_thread;
    float scale;
};

/* Item i of decode_attention_f32: sequence i / kv_heads, kv head i % kv_heads, in scratch `slot`. */
TARGET static void attention_item(void *ctx, int64_t i, int64_t slot) {
    const struct attention_job *j = (const struct attention_job *)ctx;
    attend(j->q, j->cache, j->table, j->where, j->out, j->scratch + slot * j->per_thread, i / j->kv_heads,
           i % j->kv_heads, j->width, j->layer, j->layers, j->bs, j->kv_heads, j->group, j->hd, j->scale);
}

/* Every decode row b: q [B, kv_heads * group, hd] over positions 0 .. where[b] of its blocks
   table [B, width] in the cache [blocks, layers, 2, bs, kv_heads, hd], into out (same shape as q).
   scratch: threads * per_thread floats, per_thread >= group * (max where + 1). hd a multiple of 8. */
TARGET void decode_attention_f32(const float *q, const float *cache, const int64_t *table, const int64_t *where,
                                 float *out, float *scratch, int64_t batch, int64_t width, int64_t layer,
                                 int64_t layers, int64_t bs, int64_t kv_heads, int64_t group, int64_t hd,
                                 float scale, int64_t threads, int64_t per_thread) {
    const int64_t items = batch * kv_heads;
    const struct attention_job job = {q,      cache, table, where, out,  scratch, width, layer,
                                      layers, bs,    kv_heads, group, hd, per_thread, scale};
    team_run(attention_item, (void *)&job, items, threads < items ? threads : items);
}

/* y [M, N] = x [M, K] w^T (+ bias), fp32, for weights without block codes (gemm_f32).

   The weight is laid out once, at load (``pack`` in disagg.engine.fp32kernel): tiles of GEMM_COLS =
   16 outputs, per tile and input k the 16 outputs' weights side by side, outputs zero-padded to whole
   tiles. A decode row reads each weight once, as two vectors, so a step streams the weights; a group
   of up to GEMM_MR rows shares each vector (12 sums in registers), and prompt rows go through it in
   chunks of GEMM_CHUNK rows whose inputs stay in cache while the tiles pass.

   Every output is one sum over k in order, whatever the row group, chunk or thread, so a row gets the
   same bits whatever it is batched with. The work is split over tiles, on the
   kernels' thread team (team.c). */
#define GEMM_COLS 16
#define GEMM_MR 6
#define GEMM_CHUNK 48
#define GEMM_EACH(i, n) _Pragma("GCC unroll 8") for (int i = 0; i < (n); i++)

/* MT rows from m0 of tile t (weights wt: K x 16), their outputs written with the bias */
TARGET static inline __attribute__((always_inline)) void gemm_rows(const float *x, const float *wt, const float *bias,
                                                                   float *y, const int MT, int64_t m0, int64_t N,
                                                                   int64_t K, int64_t t) {
    __m256 acc[GEMM_MR][2];
    GEMM_EACH(m, MT) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 lo = _mm256_loadu_ps(wt + k * GEMM_COLS), hi = _mm256_loadu_ps(wt + k * GEMM_COLS + 8);
        GEMM_EACH(m, MT) {
            const __m256 xv = _mm256_broadcast_ss(x + (m0 + m) * K + k);
            acc[m][0] = _mm256_fmadd_ps(xv, lo, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xv, hi, acc[m][1]);
        }
    }
    const int64_t n0 = t * GEMM_COLS;
    GEMM_EACH(m, MT) {
        float *row = y + (m0 + m) * N;
        if (n0 + GEMM_COLS <= N && !bias) {
            _mm256_storeu_ps(row + n0, acc[m][0]);
            _mm256_storeu_ps(row + n0 + 8, acc[m][1]);
            continue;
        }
        float out[GEMM_COLS];
        _mm256_storeu_ps(out, acc[m][0]);
        _mm256_storeu_ps(out + 8, acc[m][1]);
        for (int64_t j = 0; j < GEMM_COLS && n0 + j < N; j++) row[n0 + j] = bias ? out[j] + bias[n0 + j] : out[j];
    }
}

/* rows [first_row, last_row) of tile t, in groups of GEMM_MR and one group of the rest */
TARGET static void gemm_tile(const float *x, const float *w, const float *bias, float *y, int64_t first_row,
                             int64_t last_row, int64_t N, int64_t K, int64_t t) {
    const float *wt = w + t * K * GEMM_COLS;
    int64_t m = first_row;
    for (; m + GEMM_MR <= last_row; m += GEMM_MR) gemm_rows(x, wt, bias, y, GEMM_MR, m, N, K, t);
    switch (last_row - m) {
    case 5: gemm_rows(x, wt, bias, y, 5, m, N, K, t); break;
    case 4: gemm_rows(x, wt, bias, y, 4, m, N, K, t); break;
    case 3: gemm_rows(x, wt, bias, y, 3, m, N, K, t); break;
    case 2: gemm_rows(x, wt, bias, y, 2, m, N, K, t); break;
    case 1: gemm_rows(x, wt, bias, y, 1, m, N, K, t); break;
    default: break;
    }
}

/* tiles first .. last for every row, a chunk of rows at a time */
TARGET static void gemm_part(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                             int64_t K, int64_t first, int64_t last) {
    for (int64_t r = 0; r < M; r += GEMM_CHUNK) {
        const int64_t end = r + GEMM_CHUNK < M ? r + GEMM_CHUNK : M;
        for (int64_t t = first; t < last; t++) gemm_tile(x, w, bias, y, r, end, N, K, t);
    }
}

struct gemm_job { /* gemm_f32's operands, for its parts on the team */
    const float *x, *w, *bias;
    float *y;
    int64_t M, N, K, count, parts;
};

TARGET static void gemm_team_part(void *ctx, int64_t p, int64_t slot) {
    const struct gemm_job *j = (const struct gemm_job *)ctx;
    (void)slot;
    gemm_part(j->x, j->w, j->bias, j->y, j->M, j->N, j->K, j->count * p / j->parts, j->count * (p + 1) / j->parts);
}

/* y [M, N] = x [M, K] w^T (+ bias) on the tiled weight above; on up to `threads` threads of the team */
TARGET void gemm_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                     int64_t threads) {
    const int64_t count = (N + GEMM_COLS - 1) / GEMM_COLS;
    int64_t parts = threads * TEAM_PARTS < count / 2 ? threads * TEAM_PARTS : count / 2;
    if (M * N * K < ((int64_t)1 << 19)) parts = 1; /* too small to be worth a hand-off */
    if (parts <= 1) {
        gemm_part(x, w, bias, y, M, N, K, 0, count);
        return;
    }
    const struct gemm_job job = {x, w, bias, y, M, N, K, count, parts};
    team_run(gemm_team_part, (void *)&job, parts, threads);
}

int64_t gemm_f32_tile_cols(void) { return GEMM_COLS; }
