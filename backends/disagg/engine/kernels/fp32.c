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
#include <omp.h>
#include <stdint.h>
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

/* Sequence b's kv head h: its `group` query heads over positions 0 .. where[b] of its blocks.
   scores: group * (where[b] + 1) floats of scratch. */
TARGET static void attend(const float *q, const float *cache, const int64_t *table, const int64_t *where, float *out,
                          float *scores, int64_t b, int64_t h, int64_t width, int64_t layer, int64_t layers,
                          int64_t bs, int64_t kv_heads, int64_t group, int64_t hd, float scale) {
    const int64_t span = where[b] + 1, plane = bs * kv_heads * hd, heads = kv_heads * group;
    const int64_t *blocks = table + b * width;
    for (int64_t p = 0; p < span; p++) {
        const float *k = cache + ((blocks[p / bs] * layers + layer) * 2) * plane + ((p % bs) * kv_heads + h) * hd;
        for (int64_t g = 0; g < group; g++) scores[g * span + p] = dot(q + (b * heads + h * group + g) * hd, k, hd) * scale;
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * span;
        float most = -INFINITY, sum = 0.0f;
        for (int64_t p = 0; p < span; p++) most = s[p] > most ? s[p] : most;
        for (int64_t p = 0; p < span; p++) {
            s[p] = expf(s[p] - most);
            sum += s[p];
        }
        float *o = out + (b * heads + h * group + g) * hd;
        for (int64_t i = 0; i < hd; i += 8) _mm256_storeu_ps(o + i, _mm256_setzero_ps());
        for (int64_t p = 0; p < span; p++) {
            const float *v = cache + ((blocks[p / bs] * layers + layer) * 2 + 1) * plane + ((p % bs) * kv_heads + h) * hd;
            const __m256 weight = _mm256_set1_ps(s[p]);
            for (int64_t i = 0; i < hd; i += 8)
                _mm256_storeu_ps(o + i, _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
        }
        const __m256 inverse = _mm256_set1_ps(1.0f / sum);
        for (int64_t i = 0; i < hd; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), inverse));
    }
}

/* Every decode row b: q [B, kv_heads * group, hd] over positions 0 .. where[b] of its blocks
   table [B, width] in the cache [blocks, layers, 2, bs, kv_heads, hd], into out (same shape as q).
   scratch: threads * per_thread floats, per_thread >= group * (max where + 1). hd a multiple of 8. */
TARGET void decode_attention_f32(const float *q, const float *cache, const int64_t *table, const int64_t *where,
                                 float *out, float *scratch, int64_t batch, int64_t width, int64_t layer,
                                 int64_t layers, int64_t bs, int64_t kv_heads, int64_t group, int64_t hd,
                                 float scale, int64_t threads, int64_t per_thread) {
    const int64_t items = batch * kv_heads;
    const int64_t parts = threads < items ? threads : items;
    if (parts <= 1) {
        for (int64_t i = 0; i < items; i++)
            attend(q, cache, table, where, out, scratch, i / kv_heads, i % kv_heads, width, layer, layers, bs,
                   kv_heads, group, hd, scale);
        return;
    }
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int64_t part = 0; part < parts; part++)
        for (int64_t i = items * part / parts; i < items * (part + 1) / parts; i++)
            attend(q, cache, table, where, out, scratch + part * per_thread, i / kv_heads, i % kv_heads, width, layer,
                   layers, bs, kv_heads, group, hd, scale);
}
