/*
 * The elementwise work of a Llama layer on the CPU, float32 or bfloat16: residual add + RMSNorm,
 * RoPE + KV write, SiLU-and-multiply; and the greedy argmax over a step's float32 logits.
 *
 * Why: each of these is 5-10 torch ops in transformers' formulation (RMSNorm alone is cast, pow, mean,
 * add, rsqrt, mul, cast, mul), and on a small model each op's dispatch (~5 us) costs more than its
 * arithmetic. One call here replaces each group, and reads and writes each row once.
 *
 * Compiled with -ffp-contract=off: every product and sum is rounded on its own, as torch's separate
 * ops round them, so RoPE, the residual add and the norm's scaling give transformers' values bit for
 * bit. Two things differ by at most an ulp or so: the order of the norm's sum of squares, and the exp
 * inside SiLU (a Cephes polynomial here, in vector_exp.h; Sleef in torch). Greedy outputs are tested
 * against model.generate.
 *
 * The bfloat16 versions (``_bf16``, uint16_t storage) compute in float32 and round to bfloat16
 * wherever one of transformers' torch ops on bf16 tensors would round: RoPE and the residual add
 * give its values bit for bit, the norm and SiLU within a bf16 ulp (the same two differences).
 *
 * Rows are contiguous unless a stride is passed; every length is in elements.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define LANES 16

/* Rows are split between `threads` OpenMP threads (the engine's torch threads for the step) where a
 * call has at least PARALLEL_VALUES values: a prefill step's rows, or a decode batch of a model a few
 * hundred wide. Each row is computed by one thread exactly as alone, so the results do not depend on
 * the split. Serial, these calls held the engine thread for about a tenth of its time on the small
 * model while the other threads waited; smaller calls stay serial, where waking a thread would cost
 * more than it saves. */
#define PARALLEL_VALUES 32768
#define PARALLEL(threads, rows, width) ((threads) > 1 && (rows) * (width) >= PARALLEL_VALUES)

/* hidden[r] += delta[r] (when delta is given); out[r] = weight * (hidden[r] / sqrt(mean(hidden[r]^2) + eps)). */
void baton_add_rms_norm(float *hidden, const float *delta, const float *weight, float *out, int64_t rows,
                        int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (PARALLEL(threads, rows, dim))
    for (int64_t r = 0; r < rows; ++r) {
        float *h = hidden + r * dim;
        float *o = out + r * dim;
        if (delta) {
            const float *d = delta + r * dim;
            for (int64_t i = 0; i < dim; ++i) h[i] = h[i] + d[i];
        }
        float acc[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= dim; i += LANES)
            for (int u = 0; u < LANES; ++u) acc[u] += h[i + u] * h[i + u];
        float sum = 0.0f;
        for (int u = 0; u < LANES; ++u) sum += acc[u];
        for (; i < dim; ++i) sum += h[i] * h[i];
        float inverse = 1.0f / sqrtf(sum / (float)dim + eps);
        for (i = 0; i < dim; ++i) o[i] = weight[i] * (h[i] * inverse);
    }
}

/* x = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]), in place. */
static inline void rotate(float *x, const float *cos, const float *sin, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/*
 * Row r of qkv (row_stride apart) holds q_heads query heads, then kv_heads key heads, then kv_heads
 * value heads, each dim long. RoPE with cos/sin row r ([rows, dim]) is applied in place to the query
 * and key heads; then, when keys is given, the row's keys and values are copied to slot slots[r] of
 * the pool ([slots, kv_heads, dim] each).
 */
void baton_rope_store(float *qkv, int64_t rows, int64_t row_stride, const float *cos, const float *sin,
                      int64_t q_heads, int64_t kv_heads, int64_t dim, float *keys, float *values,
                      const int64_t *slots, int threads) {
    int64_t kv_width = kv_heads * dim;
#pragma omp parallel for num_threads(threads) if (PARALLEL(threads, rows, row_stride))
    for (int64_t r = 0; r < rows; ++r) {
        float *row = qkv + r * row_stride;
        for (int64_t h = 0; h < q_heads + kv_heads; ++h) rotate(row + h * dim, cos + r * dim, sin + r * dim, dim);
        if (keys) {
            memcpy(keys + slots[r] * kv_width, row + q_heads * dim, sizeof(float) * kv_width);
            memcpy(values + slots[r] * kv_width, row + q_heads * dim + kv_width, sizeof(float) * kv_width);
        }
    }
}

#if defined(__AVX512F__)
/* SiLU and the bfloat16 RoPE take sixteen lanes at a time, each lane computing exactly what the
 * scalar (or eight-lane) loop computes for its element, the same operations in the same order, so
 * results are bit for bit theirs. The norm gained nothing measurable this way (its bfloat16
 * rounding, done exactly in integer ops, is most of its work) and keeps its scalar loops. */
#define WIDE 1
#else
#define WIDE 0
#endif

/* The bfloat16 add + RMSNorm: hidden = bf16(hidden + delta); out = bf16(weight * bf16(hidden * inverse)),
 * the sum of squares in float32 (transformers upcasts to float32 for it and casts back). */
void baton_add_rms_norm_bf16(uint16_t *hidden, const uint16_t *delta, const uint16_t *weight, uint16_t *out,
                             int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (PARALLEL(threads, rows, dim))
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t *h = hidden + r * dim;
        uint16_t *o = out + r * dim;
        if (delta) {
            const uint16_t *d = delta + r * dim;
            for (int64_t i = 0; i < dim; ++i) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(d[i]));
        }
        float acc[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= dim; i += LANES)
            for (int u = 0; u < LANES; ++u) {
                float x = bf16_to_f32(h[i + u]);
                acc[u] += x * x;
            }
        float sum = 0.0f;
        for (int u = 0; u < LANES; ++u) sum += acc[u];
        for (; i < dim; ++i) sum += bf16_to_f32(h[i]) * bf16_to_f32(h[i]);
        float inverse = 1.0f / sqrtf(sum / (float)dim + eps);
        for (i = 0; i < dim; ++i)
            o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * bf16_round(bf16_to_f32(h[i]) * inverse));
    }
}

/* rotate() on bfloat16: each product and the sum rounded to bf16, as (x * cos) + (rotate_half(x) * sin) is. */
static inline void rotate_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
        float lo = bf16_round(a * bf16_to_f32(cos[i])) + bf16_round(-b * bf16_to_f32(sin[i]));
        float hi = bf16_round(b * bf16_to_f32(cos[i + half])) + bf16_round(a * bf16_to_f32(sin[i + half]));
        x[i] = f32_to_bf16(lo);
        x[i + half] = f32_to_bf16(hi);
    }
}

#if WIDE
/* rotate_bf16 sixteen pairs at a time, half % 16 == 0. */
static inline void rotate_bf16_wide(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000);
    for (int64_t i = 0; i < half; i += 16) {
        __m512 a = bf16x16_load(x + i), b = bf16x16_load(x + i + half);
        __m512 minus_b = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(b), sign));
        __m512 lo = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(a, bf16x16_load(cos + i))),
                                  bf16x16_round(_mm512_mul_ps(minus_b, bf16x16_load(sin + i))));
        __m512 hi = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(b, bf16x16_load(cos + i + half))),
                                  bf16x16_round(_mm512_mul_ps(a, bf16x16_load(sin + i + half))));
        bf16x16_store(x + i, lo);
        bf16x16_store(x + i + half, hi);
    }
}
#endif

/* baton_rope_store on bfloat16 rows, cos/sin and pool. */
void baton_rope_store_bf16(uint16_t *qkv, int64_t rows, int64_t row_stride, const uint16_t *cos, const uint16_t *sin,
                           int64_t q_heads, int64_t kv_heads, int64_t dim, uint16_t *keys, uint16_t *values,
                           const int64_t *slots, int threads) {
    int64_t kv_width = kv_heads * dim;
#pragma omp parallel for num_threads(threads) if (PARALLEL(threads, rows, row_stride))
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t *row = qkv + r * row_stride;
        for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
#if WIDE
            if (dim % 32 == 0) {
                rotate_bf16_wide(row + h * dim, cos + r * dim, sin + r * dim, dim / 2);
                continue;
            }
#endif
            rotate_bf16(row + h * dim, cos + r * dim, sin + r * dim, dim);
        }
        if (keys) {
            memcpy(keys + slots[r] * kv_width, row + q_heads * dim, sizeof(uint16_t) * kv_width);
            memcpy(values + slots[r] * kv_width, row + q_heads * dim + kv_width, sizeof(uint16_t) * kv_width);
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vector_exp.h"

/* exp(x) with x clamped to [-87.3, 88.38], beyond which the result is 2^-126 or +inf: what SiLU's
 * 1 + exp(-x) needs. */
static inline __m256 exp8(__m256 x) {
    __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_CLAMP_LOW)), _mm256_set1_ps(EXP_CLAMP_HIGH));
    return exp8_in_range(clamped);
}
#endif

#if WIDE
/* silu(g) = g / (1 + exp(-g)) on sixteen lanes, as silu_times computes it on eight. */
static inline __m512 silu16(__m512 g) {
    __m512 minus_g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000)));
    __m512 low = _mm512_max_ps(minus_g, _mm512_set1_ps(EXP_CLAMP_LOW));
    __m512 clamped = _mm512_min_ps(low, _mm512_set1_ps(EXP_CLAMP_HIGH));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_in_range(clamped)));
}
#endif

/* out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)). */
static void silu_times(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
#if WIDE
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(gate + i)), _mm512_loadu_ps(up + i)));
#endif
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp8(_mm256_xor_ps(g, sign));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; ++i) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]. */
void baton_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (PARALLEL(threads, rows, inter))
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = gate_up + r * 2 * inter;
        silu_times(gate, gate + inter, out + r * inter, inter);
    }
}

#define CHUNK 256

/* baton_silu_mul_bf16's values [start, inter) of one row, converted a chunk at a time so that each
 * loop is a plain one the compiler vectorises. */
static void silu_mul_tail_bf16(const uint16_t *g, const uint16_t *u16, uint16_t *o, int64_t start, int64_t inter) {
    float gate[CHUNK], up[CHUNK], silu[CHUNK], ones[CHUNK];
    for (int u = 0; u < CHUNK; ++u) ones[u] = 1.0f; /* silu(g) * 1 is silu(g) exactly */
    for (int64_t i = start; i < inter; i += CHUNK) {
        int64_t n = inter - i < CHUNK ? inter - i : CHUNK;
        for (int64_t u = 0; u < n; ++u) gate[u] = bf16_to_f32(g[i + u]);
        for (int64_t u = 0; u < n; ++u) up[u] = bf16_to_f32(u16[i + u]);
        silu_times(gate, ones, silu, n);
        for (int64_t u = 0; u < n; ++u) silu[u] = bf16_round(silu[u]) * up[u];
        for (int64_t u = 0; u < n; ++u) o[i + u] = f32_to_bf16(silu[u]);
    }
}

/* baton_silu_mul on bfloat16: out = bf16(bf16(silu(gate)) * up), silu in float32 as torch computes it. */
void baton_silu_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t inter, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) if (PARALLEL(threads, rows, inter))
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *g = gate_up + r * 2 * inter;
        const uint16_t *u16 = g + inter;
        uint16_t *o = out + r * inter;
        int64_t start = 0;
#if WIDE
        for (; start + 16 <= inter; start += 16) {
            __m512 silu16_g = bf16x16_round(silu16(bf16x16_load(g + start)));
            bf16x16_store(o + start, _mm512_mul_ps(silu16_g, bf16x16_load(u16 + start)));
        }
#endif
        if (start < inter) silu_mul_tail_bf16(g, u16, o, start, inter);
    }
}

/* torch.argmax over one row: the first index of the maximum, a NaN counting as the maximum. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t best = 0, i = 0;
#if defined(__AVX2__)
    if (n >= 16) {
        /* Each lane keeps its own first maximum (strict >), so the lowest index wins among equals. */
        __m256 top = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
        __m256i where = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = where;
        const __m256i step = _mm256_set1_epi32(8);
        for (i = 8; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            at = _mm256_add_epi32(at, step);
            __m256 greater = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
            top = _mm256_blendv_ps(top, v, greater);
            where = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(at), greater));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        if (_mm256_movemask_ps(nan)) {
            for (int64_t j = 0; j < n; ++j)
                if (isnan(x[j])) return j;
        }
        float tops[8];
        int32_t wheres[8];
        _mm256_storeu_ps(tops, top);
        _mm256_storeu_si256((__m256i *)wheres, where);
        best = wheres[0];
        for (int u = 1; u < 8; ++u)
            if (tops[u] > x[best] || (tops[u] == x[best] && wheres[u] < best)) best = wheres[u];
    }
#endif
    if (i == 0) {
        if (isnan(x[0])) return 0;
        i = 1;
    }
    for (; i < n; ++i) {
        if (isnan(x[i])) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

void baton_argmax_rows(const float *logits, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out) {
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(logits + r * row_stride, cols);
}

/* baton_argmax_rows over bfloat16 logits: each row widened (exactly) a chunk at a time into a scratch
 * that stays in L1, so the whole [rows, cols] block is never copied to float32 first. The first NaN,
 * else the first maximum, wins across chunks as within one. */
#define ARGMAX_CHUNK 2048
void baton_argmax_rows_bf16(const uint16_t *logits, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out) {
    float chunk[ARGMAX_CHUNK];
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *row = logits + r * row_stride;
        int64_t best = 0;
        float top = 0.0f;
        for (int64_t start = 0; start < cols; start += ARGMAX_CHUNK) {
            int64_t n = cols - start < ARGMAX_CHUNK ? cols - start : ARGMAX_CHUNK;
            for (int64_t i = 0; i < n; ++i) chunk[i] = bf16_to_f32(row[start + i]);
            int64_t at = argmax_row(chunk, n);
            if (isnan(chunk[at])) {
                best = start + at;
                break;
            }
            if (start == 0 || chunk[at] > top) best = start + at, top = chunk[at];
        }
        out[r] = best;
    }
}
