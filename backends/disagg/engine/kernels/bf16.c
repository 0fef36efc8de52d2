/* bf16 CPU kernels of the reference engine. gemv_bf16: small-batch projections, y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]).

   Built by disagg.engine.kernel (gcc -O3, at `make` or first use) and called through ctypes on the
   tensors' memory. One weight row at a time is read once and multiplied against every input row with
   AVX-512-BF16 dot products (vdpbf16ps, fp32 accumulation), so a decode step at batch 1 or 2 reads
   each weight once, at close to the core's read bandwidth. Single-threaded; the caller falls back
   to oneDNN elsewhere. Outputs are rounded to bf16 to nearest even. M is 1..8. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); bf16 in and out, fp32 accumulation. */

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

#define TARGET __attribute__((target("avx512f,avx512bf16,avx512bw")))

/* One weight row at a time, streamed once, against every one of the M input rows (M fixed at
   compile time, so the accumulators stay in registers). */
TARGET static inline __attribute__((always_inline)) void rows(
    const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, const int M, int64_t N,
    int64_t K) {
    const int64_t full = K / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (K - full)) - 1);
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *row = w + n * K;
        __m512 acc[8];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < full; k += 32) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(row + k));
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512((const void *)(x + m * K + k)), wv);
        }
        if (tail) {
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, row + full);
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + full), wv);
        }
        const float b = bias ? from_bf16(bias[n]) : 0.0f;
        for (int m = 0; m < M; m++) y[m * N + n] = to_bf16(_mm512_reduce_add_ps(acc[m]) + b);
    }
}

TARGET void gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                      int64_t N, int64_t K) {
    switch (M) {
        case 1: rows(x, w, bias, y, 1, N, K); break;
        case 2: rows(x, w, bias, y, 2, N, K); break;
        case 3: rows(x, w, bias, y, 3, N, K); break;
        case 4: rows(x, w, bias, y, 4, N, K); break;
        case 5: rows(x, w, bias, y, 5, N, K); break;
        case 6: rows(x, w, bias, y, 6, N, K); break;
        case 7: rows(x, w, bias, y, 7, N, K); break;
        case 8: rows(x, w, bias, y, 8, N, K); break;
        default: break;
    }
}

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
   softmax are fp32 (scratch: group * (max position + 1) floats), the output [B, heads, head_dim]
   bf16. head_dim must be a multiple of 32 and at most 256. */
TARGET void decode_attention_bf16(const uint16_t *q, const uint16_t *cache, const int64_t *tables,
                                  const int64_t *positions, uint16_t *out, float *scratch, int64_t B,
                                  int64_t table_width, int64_t layer, int64_t layers, int64_t block_size,
                                  int64_t kv_heads, int64_t group, int64_t head_dim, float scale) {
    const int64_t row = kv_heads * head_dim;           /* one position's keys (or values) */
    const int64_t block_stride = layers * 2 * block_size * row;
    const int64_t chunks = head_dim / 16;               /* 16 floats per vector */
    for (int64_t b = 0; b < B; b++) {
        const int64_t span = positions[b] + 1;
        const int64_t *table = tables + b * table_width;
        for (int64_t h = 0; h < kv_heads; h++) {
            const uint16_t *queries = q + (b * kv_heads + h) * group * head_dim;
            /* scores[j * span + p] = q_j . k_p * scale */
            for (int64_t p = 0; p < span; p++) {
                const uint16_t *k = cache + table[p / block_size] * block_stride +
                                    (layer * 2 * block_size + p % block_size) * row + h * head_dim;
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
                for (int64_t c = 0; c < chunks; c++) {
                    float values[16];
                    _mm512_storeu_ps(values, acc[j][c]);
                    for (int i = 0; i < 16; i++) o[c * 16 + i] = to_bf16(values[i]);
                }
            }
        }
    }
}
