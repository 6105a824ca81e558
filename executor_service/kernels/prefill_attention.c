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

#if defined(__AVX512F__)
#include <immintrin.h>

#include "vector_exp.h"

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
 * in order; eight keys run side by side for throughput. */
static void score_keys_f32(const layer_t *L, const int64_t *table, int64_t kv_head, const float *qt, int64_t keys,
                           float *scores) {
    const __m512 scale = _mm512_set1_ps(L->scale);
    int64_t t = 0;
    for (; t + 8 <= keys; t += 8) {
        const float *row[8];
        __m512 acc[8];
        for (int u = 0; u < 8; ++u) {
            row[u] = (const float *)L->k + slot_offset(L, table, t + u, kv_head);
            acc[u] = _mm512_setzero_ps();
        }
        for (int64_t d = 0; d < L->dim; ++d) {
            __m512 qd = _mm512_load_ps(qt + d * TILE);
            for (int u = 0; u < 8; ++u) acc[u] = _mm512_fmadd_ps(qd, _mm512_set1_ps(row[u][d]), acc[u]);
        }
        for (int u = 0; u < 8; ++u) _mm512_store_ps(scores + (t + u) * TILE, _mm512_mul_ps(acc[u], scale));
    }
    for (; t < keys; ++t) {
        const float *row = (const float *)L->k + slot_offset(L, table, t, kv_head);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < L->dim; ++d)
            acc = _mm512_fmadd_ps(_mm512_load_ps(qt + d * TILE), _mm512_set1_ps(row[d]), acc);
        _mm512_store_ps(scores + t * TILE, _mm512_mul_ps(acc, scale));
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
 * (`first` + lane) zeroed; returns each lane's sum in `totals`. */
static void softmax_lanes(float *scores, int64_t keys, int64_t first, float *totals) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i positions = _mm512_add_epi32(lane, _mm512_set1_epi32((int)first));
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    /* Only the last TILE keys can lie past a lane's position. */
    __mmask16 past[TILE];
    for (int64_t t = first; t < keys; ++t) {
        past[t - first] = _mm512_cmplt_epi32_mask(positions, _mm512_set1_epi32((int)t));
        _mm512_store_ps(scores + t * TILE, _mm512_mask_mov_ps(_mm512_load_ps(scores + t * TILE), past[t - first],
                                                             minus_inf));
    }
    __m512 peak = minus_inf;
    for (int64_t t = 0; t < keys; ++t) peak = _mm512_max_ps(_mm512_load_ps(scores + t * TILE), peak);
    __m512 sums = _mm512_setzero_ps();
    for (int64_t t = 0; t < keys; ++t) {
        __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_load_ps(scores + t * TILE), peak), _mm512_set1_ps(-87.0f));
        __m512 e = exp16_in_range(x);
        if (t >= first) e = _mm512_mask_mov_ps(e, past[t - first], _mm512_setzero_ps()); /* exp(-87) is not 0 */
        _mm512_store_ps(scores + t * TILE, e);
        sums = _mm512_add_ps(sums, e);
    }
    _mm512_storeu_ps(totals, sums);
}

/* values[t * dim ..] = key t's values as float32, for keys [0, keys). */
static void stage_values(const layer_t *L, const int64_t *table, int64_t kv_head, int64_t keys, float *values) {
    for (int64_t t = 0; t < keys; ++t) {
        int64_t offset = slot_offset(L, table, t, kv_head);
        if (L->is_bf16) {
            const uint16_t *row = (const uint16_t *)L->v + offset;
            for (int64_t d = 0; d < L->dim; d += 16) _mm512_store_ps(values + t * L->dim + d, bf16x16_load(row + d));
        } else {
            memcpy(values + t * L->dim, (const float *)L->v + offset, sizeof(float) * (size_t)L->dim);
        }
    }
}

/* out rows of `count` lanes from `lane0` = sum over keys of p * value, / total; four lanes at a time
 * against 64 values (dim % 64 == 0), each lane's sum in key order. */
static void weigh_values(const layer_t *L, const float *scores, const float *values, const float *totals,
                         int64_t lane0, int64_t count, int64_t first, int64_t head, int64_t out_row) {
    for (int64_t d = 0; d < L->dim; d += 64) {
        __m512 acc[4][4];
        for (int r = 0; r < 4; ++r)
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
        int64_t keys = first + lane0 + count; /* the last lane's position, plus one */
        for (int64_t t = 0; t < keys; ++t) {
            const float *row = values + t * L->dim + d;
            __m512 x0 = _mm512_load_ps(row), x1 = _mm512_load_ps(row + 16);
            __m512 x2 = _mm512_load_ps(row + 32), x3 = _mm512_load_ps(row + 48);
            for (int r = 0; r < count; ++r) {
                __m512 p = _mm512_set1_ps(scores[t * TILE + lane0 + r]);
                acc[r][0] = _mm512_fmadd_ps(p, x0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(p, x1, acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(p, x2, acc[r][2]);
                acc[r][3] = _mm512_fmadd_ps(p, x3, acc[r][3]);
            }
        }
        for (int r = 0; r < count; ++r) {
            __m512 norm = _mm512_set1_ps(1.0f / totals[lane0 + r]);
            int64_t offset = (out_row + lane0 + r) * L->out_row_stride + head * L->out_head_stride + d;
            for (int c = 0; c < 4; ++c) {
                __m512 value = _mm512_mul_ps(acc[r][c], norm);
                if (L->is_bf16)
                    bf16x16_store((uint16_t *)L->out + offset + 16 * c, value);
                else
                    _mm512_storeu_ps((float *)L->out + offset + 16 * c, value);
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
        for (int64_t r = 0; r < lanes; r += 4)
            weigh_values(L, scores, values, totals, r, lanes - r < 4 ? lanes - r : 4, first, head, row + tile);
    }
    free(scores), free(values), free(qt);
    return 0;
}

/* Whether this build serves the pool's dtype (is_bf16: bfloat16, else float32) and head size:
 * float32 with AVX-512, bfloat16 with AVX512-BF16 as well; head_dim a multiple of 64. */
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

#else /* without AVX-512 the torch path serves every prefill */

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
