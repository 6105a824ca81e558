/*
 * Paged prefill attention on the CPU, for a float32 or bfloat16 KV pool: each prompt chunk's
 * queries attend causally to their sequence's keys where they lie in the pool, read through its
 * block table.
 *
 * Why a kernel of our own: the torch path gathers a chunk's cached context into a copy, builds a
 * boolean mask and calls SDPA, whose matrix products on AMD CPUs go through MKL's generic AVX2 path
 * (bfloat16 widened to float32 first). Here the keys are read in place and every query of a tile of
 * sixteen is scored against a key at once: the queries sit transposed, sixteen lanes, one query a
 * lane, and each of a key's values (float32, a multiply-add each) or pairs of values (bfloat16, one
 * `vdpbf16ps` each) is broadcast from the pool against them. No horizontal sums, no copy of the
 * context, no mask.
 *
 * Float32 pools are served with AVX-512 or with AVX2 and FMA (the sixteen lanes then two registers
 * of eight), bfloat16 pools with AVX512-BF16 only: without `vdpbf16ps` a bfloat16 key would be
 * widened per query tile, and on such CPUs bfloat16 is no faster than float32 anyway.
 *
 * Each query's arithmetic lives in its own lane and runs in the same order whatever else shares
 * the tile, so a query's output does not depend on how its prompt was chunked or what else ran in
 * the step. Sums are in float32; probabilities stay float32 (SDPA rounds bfloat16's to bfloat16).
 *
 * Layouts (strides in elements), as the decode kernel's:
 *   query  q + row * q_row_stride + head * q_head_stride, head_dim contiguous
 *   pool   k/v + slot * slot_stride + kv_head * kv_head_stride, head_dim contiguous
 *   out    out + row * out_row_stride + head * out_head_stride
 * Chunk i: query rows rows[i] .. rows[i] + counts[i], at positions starts[i] onwards of its
 * sequence; position p attends to keys 0..p, every one of them already in the pool (the chunk's own
 * were written before the call). Key t lives in slot table[t / block_size] * block_size + t %
 * block_size, the table being tables[table_offsets[i] ..).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define TILE 16 /* queries scored together, one a lane */

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#include "vector_exp.h"

/* Sixteen float32 lanes, one query each: one AVX-512 register, or two AVX2 registers, low lanes
 * first. Every lane runs the same operations in the same order on either, so the kernel below is
 * written once. How much work one loop keeps in registers differs (AVX-512 has 32 registers of
 * sixteen lanes, AVX2 16 of eight): keys scored side by side, sixteen-value columns and lanes
 * weighed side by side. None of them changes the order of any lane's sums. On AVX2, six keys
 * (twelve independent multiply-add chains) and eight lanes, a few accumulators spilled, instead of
 * four and four took a layer call of the small model's heads on a Zen 3 EPYC (a 40-token chunk
 * after 390 cached tokens, one thread) from 1.36 ms to 0.96 ms. */
#if defined(__AVX512F__)
typedef __m512 vec16;
#define KEYS_TOGETHER 8 /* keys scored side by side */
#define VALUE_COLUMNS 4 /* sixteen-value columns weighed side by side */
#define WEIGH_LANES 4   /* lanes weighed side by side */
static inline vec16 v_zero(void) { return _mm512_setzero_ps(); }
static inline vec16 v_set1(float x) { return _mm512_set1_ps(x); }
static inline vec16 v_load(const float *p) { return _mm512_load_ps(p); }
static inline vec16 v_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vec16 x) { _mm512_store_ps(p, x); }
static inline void v_storeu(float *p, vec16 x) { _mm512_storeu_ps(p, x); }
static inline vec16 v_fmadd(vec16 a, vec16 b, vec16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec16 v_mul(vec16 a, vec16 b) { return _mm512_mul_ps(a, b); }
static inline vec16 v_add(vec16 a, vec16 b) { return _mm512_add_ps(a, b); }
static inline vec16 v_sub(vec16 a, vec16 b) { return _mm512_sub_ps(a, b); }
static inline vec16 v_max(vec16 a, vec16 b) { return _mm512_max_ps(a, b); }
static inline vec16 v_exp(vec16 x) { return exp16_in_range(x); }
/* x with its lanes below `lanes` set to `fill`. */
static inline vec16 v_fill_below(vec16 x, int64_t lanes, float fill) {
    return _mm512_mask_mov_ps(x, (__mmask16)((1u << lanes) - 1u), _mm512_set1_ps(fill));
}
#else
typedef struct {
    __m256 lo, hi;
} vec16;
#define KEYS_TOGETHER 6
#define VALUE_COLUMNS 1
#define WEIGH_LANES 8
static inline vec16 v_zero(void) { return (vec16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vec16 v_set1(float x) { return (vec16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline vec16 v_load(const float *p) { return (vec16){_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
static inline vec16 v_loadu(const float *p) { return (vec16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v_store(float *p, vec16 x) { _mm256_store_ps(p, x.lo), _mm256_store_ps(p + 8, x.hi); }
static inline void v_storeu(float *p, vec16 x) { _mm256_storeu_ps(p, x.lo), _mm256_storeu_ps(p + 8, x.hi); }
static inline vec16 v_fmadd(vec16 a, vec16 b, vec16 c) {
    return (vec16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vec16 v_mul(vec16 a, vec16 b) { return (vec16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline vec16 v_add(vec16 a, vec16 b) { return (vec16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline vec16 v_sub(vec16 a, vec16 b) { return (vec16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline vec16 v_max(vec16 a, vec16 b) { return (vec16){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline vec16 v_exp(vec16 x) { return (vec16){exp8_in_range(x.lo), exp8_in_range(x.hi)}; }
static inline vec16 v_fill_below(vec16 x, int64_t lanes, float fill) {
    const __m256i low = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i high = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i bound = _mm256_set1_epi32((int)lanes);
    const __m256 with = _mm256_set1_ps(fill);
    return (vec16){_mm256_blendv_ps(x.lo, with, _mm256_castsi256_ps(_mm256_cmpgt_epi32(bound, low))),
                   _mm256_blendv_ps(x.hi, with, _mm256_castsi256_ps(_mm256_cmpgt_epi32(bound, high)))};
}
#endif

/* What every chunk of one layer call shares. */
typedef struct {
    const void *q, *k, *v;
    void *out;
    int64_t q_row_stride, q_head_stride, slot_stride, kv_head_stride, out_row_stride, out_head_stride;
    int64_t block_size, heads, group, dim;
    float scale;
    int is_bf16;
} layer_t;

/* Where key t's row of a kv head lies in the pool, in elements. */
static inline int64_t slot_offset(const layer_t *L, const int64_t *table, int64_t t, int64_t kv_head) {
    int64_t slot = table[t / L->block_size] * L->block_size + t % L->block_size;
    return slot * L->slot_stride + kv_head * L->kv_head_stride;
}

/* scores[t * TILE + lane] = scale * (query lane . key t) for keys [0, keys), from a float32 pool:
 * qt[d * TILE + lane] is the lane's value d, and each score is one chain of multiply-adds over d
 * in order; KEYS_TOGETHER keys run side by side for throughput. */
static void score_keys_f32(const layer_t *L, const int64_t *table, int64_t kv_head, const float *qt, int64_t keys,
                           float *scores) {
    const vec16 scale = v_set1(L->scale);
    int64_t t = 0;
    for (; t + KEYS_TOGETHER <= keys; t += KEYS_TOGETHER) {
        const float *row[KEYS_TOGETHER];
        vec16 acc[KEYS_TOGETHER];
        for (int u = 0; u < KEYS_TOGETHER; ++u) {
            row[u] = (const float *)L->k + slot_offset(L, table, t + u, kv_head);
            acc[u] = v_zero();
        }
        for (int64_t d = 0; d < L->dim; ++d) {
            vec16 qd = v_load(qt + d * TILE);
            for (int u = 0; u < KEYS_TOGETHER; ++u) acc[u] = v_fmadd(qd, v_set1(row[u][d]), acc[u]);
        }
        for (int u = 0; u < KEYS_TOGETHER; ++u) v_store(scores + (t + u) * TILE, v_mul(acc[u], scale));
    }
    for (; t < keys; ++t) {
        const float *row = (const float *)L->k + slot_offset(L, table, t, kv_head);
        vec16 acc = v_zero();
        for (int64_t d = 0; d < L->dim; ++d) acc = v_fmadd(v_load(qt + d * TILE), v_set1(row[d]), acc);
        v_store(scores + t * TILE, v_mul(acc, scale));
    }
}

#if defined(__AVX512BF16__)
/* The same from a bfloat16 pool: qt[c * TILE + lane] is the lane's pair of values 2c, 2c + 1, and
 * each score is one chain of vdpbf16ps over the pairs in order. */
static void score_keys_bf16(const layer_t *L, const int64_t *table, int64_t kv_head, const uint32_t *qt,
                            int64_t keys, float *scores) {
    const int64_t pairs = L->dim / 2;
    const __m512 scale = _mm512_set1_ps(L->scale);
    int64_t t = 0;
    for (; t + 8 <= keys; t += 8) {
        const uint32_t *row[8];
        __m512 acc[8];
        for (int u = 0; u < 8; ++u) {
            row[u] = (const uint32_t *)((const uint16_t *)L->k + slot_offset(L, table, t + u, kv_head));
            acc[u] = _mm512_setzero_ps();
        }
        for (int64_t c = 0; c < pairs; ++c) {
            __m512bh qc = (__m512bh)_mm512_load_si512(qt + c * TILE);
            for (int u = 0; u < 8; ++u)
                acc[u] = _mm512_dpbf16_ps(acc[u], qc, (__m512bh)_mm512_set1_epi32((int)row[u][c]));
        }
        for (int u = 0; u < 8; ++u) _mm512_store_ps(scores + (t + u) * TILE, _mm512_mul_ps(acc[u], scale));
    }
    for (; t < keys; ++t) {
        const uint32_t *row = (const uint32_t *)((const uint16_t *)L->k + slot_offset(L, table, t, kv_head));
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < pairs; ++c)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_load_si512(qt + c * TILE),
                                   (__m512bh)_mm512_set1_epi32((int)row[c]));
        _mm512_store_ps(scores + t * TILE, _mm512_mul_ps(acc, scale));
    }
}
#define BF16_SCORES 1
#else
#define BF16_SCORES 0
#endif

/* The tile's queries transposed into `qt`, lanes past `lanes` zero: float32 values, one row per
 * value, or bfloat16 pairs, one row per pair. */
static void transpose_queries(const layer_t *L, int64_t row, int64_t lanes, int64_t head, void *qt) {
    int64_t rows = L->is_bf16 ? L->dim / 2 : L->dim;
    memset(qt, 0, sizeof(float) * (size_t)(rows * TILE));
    for (int64_t r = 0; r < lanes; ++r) {
        int64_t offset = (row + r) * L->q_row_stride + head * L->q_head_stride;
        const uint32_t *q = L->is_bf16 ? (const uint32_t *)((const uint16_t *)L->q + offset)
                                       : (const uint32_t *)((const float *)L->q + offset);
        for (int64_t c = 0; c < rows; ++c) ((uint32_t *)qt)[c * TILE + r] = q[c];
    }
}

/* Softmax numerators in place over keys [0, keys) for each lane, keys past a lane's own position
 * (`first` + lane) zeroed; returns each lane's sum in `totals`. Only the last TILE keys can lie past
 * a lane's position: key t lies past lanes below t - first. */
static void softmax_lanes(float *scores, int64_t keys, int64_t first, float *totals) {
    for (int64_t t = first; t < keys; ++t)
        v_store(scores + t * TILE, v_fill_below(v_load(scores + t * TILE), t - first, -INFINITY));
    vec16 peak = v_set1(-INFINITY);
    for (int64_t t = 0; t < keys; ++t) peak = v_max(v_load(scores + t * TILE), peak);
    vec16 sums = v_zero();
    for (int64_t t = 0; t < keys; ++t) {
        vec16 e = v_exp(v_max(v_sub(v_load(scores + t * TILE), peak), v_set1(-87.0f)));
        if (t > first) e = v_fill_below(e, t - first, 0.0f); /* exp(-87) is not 0 */
        v_store(scores + t * TILE, e);
        sums = v_add(sums, e);
    }
    v_storeu(totals, sums);
}

/* values[t * dim ..] = key t's values as float32, for keys [0, keys). */
static void stage_values(const layer_t *L, const int64_t *table, int64_t kv_head, int64_t keys, float *values) {
    for (int64_t t = 0; t < keys; ++t) {
        int64_t offset = slot_offset(L, table, t, kv_head);
#if BF16_SCORES
        if (L->is_bf16) {
            const uint16_t *row = (const uint16_t *)L->v + offset;
            for (int64_t d = 0; d < L->dim; d += 16) _mm512_store_ps(values + t * L->dim + d, bf16x16_load(row + d));
        } else
#endif
        {
            memcpy(values + t * L->dim, (const float *)L->v + offset, sizeof(float) * (size_t)L->dim);
        }
    }
}

/* out rows of `count` <= WEIGH_LANES lanes from `lane0` = sum over keys of p * value, / total,
 * against VALUE_COLUMNS sixteen-value columns at a time, each lane's sum in key order. */
static void weigh_values(const layer_t *L, const float *scores, const float *values, const float *totals,
                         int64_t lane0, int64_t count, int64_t first, int64_t head, int64_t out_row) {
    for (int64_t d = 0; d < L->dim; d += 16 * VALUE_COLUMNS) {
        vec16 acc[WEIGH_LANES][VALUE_COLUMNS];
        for (int r = 0; r < WEIGH_LANES; ++r)
            for (int c = 0; c < VALUE_COLUMNS; ++c) acc[r][c] = v_zero();
        int64_t keys = first + lane0 + count; /* the last lane's position, plus one */
        for (int64_t t = 0; t < keys; ++t) {
            const float *row = values + t * L->dim + d;
            vec16 x[VALUE_COLUMNS];
            for (int c = 0; c < VALUE_COLUMNS; ++c) x[c] = v_load(row + 16 * c);
            for (int r = 0; r < count; ++r) {
                vec16 p = v_set1(scores[t * TILE + lane0 + r]);
                for (int c = 0; c < VALUE_COLUMNS; ++c) acc[r][c] = v_fmadd(p, x[c], acc[r][c]);
            }
        }
        for (int r = 0; r < count; ++r) {
            vec16 norm = v_set1(1.0f / totals[lane0 + r]);
            int64_t offset = (out_row + lane0 + r) * L->out_row_stride + head * L->out_head_stride + d;
            for (int c = 0; c < VALUE_COLUMNS; ++c) {
                vec16 value = v_mul(acc[r][c], norm);
#if BF16_SCORES
                if (L->is_bf16) {
                    bf16x16_store((uint16_t *)L->out + offset + 16 * c, value);
                    continue;
                }
#endif
                v_storeu((float *)L->out + offset + 16 * c, value);
            }
        }
    }
}

/* 64-byte aligned memory; aligned_alloc wants a size that is a multiple of the alignment. */
static void *aligned_buffer(size_t bytes) { return aligned_alloc(64, (bytes + 63) & ~(size_t)63); }

/* One chunk's queries of one head: tile by tile, scores, softmax, weighted values. */
static int attend_head(const layer_t *L, int64_t row, int64_t count, int64_t start, const int64_t *table,
                       int64_t head) {
    int64_t kv_head = head / L->group, context = start + count;
    float *scores = aligned_buffer(sizeof(float) * (size_t)(context * TILE + TILE));
    float *values = aligned_buffer(sizeof(float) * (size_t)(context * L->dim));
    float *qt = aligned_buffer(sizeof(float) * (size_t)(L->dim * TILE));
    if (scores == NULL || values == NULL || qt == NULL) {
        free(scores), free(values), free(qt);
        return -1;
    }
    stage_values(L, table, kv_head, context, values);
    float *totals = scores + context * TILE;
    for (int64_t tile = 0; tile < count; tile += TILE) {
        int64_t lanes = count - tile < TILE ? count - tile : TILE, first = start + tile, keys = first + lanes;
        transpose_queries(L, row + tile, lanes, head, qt);
#if BF16_SCORES
        if (L->is_bf16)
            score_keys_bf16(L, table, kv_head, (const uint32_t *)qt, keys, scores);
        else
#endif
            score_keys_f32(L, table, kv_head, qt, keys, scores);
        softmax_lanes(scores, keys, first, totals);
        for (int64_t r = 0; r < lanes; r += WEIGH_LANES)
            weigh_values(L, scores, values, totals, r, lanes - r < WEIGH_LANES ? lanes - r : WEIGH_LANES, first, head,
                         row + tile);
    }
    free(scores), free(values), free(qt);
    return 0;
}

/* Whether this build serves the pool's dtype (is_bf16: bfloat16, else float32) and head size:
 * float32 with AVX-512 or with AVX2 and FMA, bfloat16 with AVX512-BF16; head_dim a multiple of 64. */
int baton_prefill_attention_supported(int64_t dim, int is_bf16) {
    return dim > 0 && dim % 64 == 0 && (!is_bf16 || BF16_SCORES);
}

/* Returns 0 on success, -1 if memory ran out, -2 where the kernel cannot serve this shape. */
int baton_prefill_attention(const void *q, int64_t q_row_stride, int64_t q_head_stride, const void *k, const void *v,
                            int64_t slot_stride, int64_t kv_head_stride, void *out, int64_t out_row_stride,
                            int64_t out_head_stride, const int64_t *rows, const int64_t *counts, const int64_t *starts,
                            const int64_t *table_offsets, const int64_t *tables, int64_t chunks, int64_t block_size,
                            int64_t heads, int64_t kv_heads, int64_t dim, float scale, int is_bf16, int threads) {
    if (!baton_prefill_attention_supported(dim, is_bf16) || kv_heads <= 0 || heads % kv_heads != 0) return -2;
    layer_t L = {q, k, v, out, q_row_stride, q_head_stride, slot_stride, kv_head_stride, out_row_stride,
                 out_head_stride, block_size, heads, heads / kv_heads, dim, scale, is_bf16};
    int failed = 0;
    /* One unit of work per chunk and head; a long chunk's heads spread over the threads. */
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1) reduction(| : failed)
    for (int64_t unit = 0; unit < chunks * heads; ++unit) {
        int64_t i = unit / heads, head = unit % heads;
        if (counts[i] > 0)
            failed |= attend_head(&L, rows[i], counts[i], starts[i], tables + table_offsets[i], head) != 0;
    }
    return failed ? -1 : 0;
}

#else /* without AVX2 and FMA the torch path serves every prefill */

int baton_prefill_attention_supported(int64_t dim, int is_bf16) {
    (void)dim, (void)is_bf16;
    return 0;
}

int baton_prefill_attention(const void *q, int64_t q_row_stride, int64_t q_head_stride, const void *k, const void *v,
                            int64_t slot_stride, int64_t kv_head_stride, void *out, int64_t out_row_stride,
                            int64_t out_head_stride, const int64_t *rows, const int64_t *counts, const int64_t *starts,
                            const int64_t *table_offsets, const int64_t *tables, int64_t chunks, int64_t block_size,
                            int64_t heads, int64_t kv_heads, int64_t dim, float scale, int is_bf16, int threads) {
    (void)q, (void)q_row_stride, (void)q_head_stride, (void)k, (void)v, (void)slot_stride, (void)kv_head_stride;
    (void)out, (void)out_row_stride, (void)out_head_stride, (void)rows, (void)counts, (void)starts;
    (void)table_offsets, (void)tables, (void)chunks, (void)block_size, (void)heads, (void)kv_heads, (void)dim;
    (void)scale, (void)is_bf16, (void)threads;
    return -2;
}
#endif
