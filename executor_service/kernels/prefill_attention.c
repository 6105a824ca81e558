/*
 * Paged prefill attention on the CPU, for a bfloat16 KV pool: each prompt chunk's queries attend
 * causally to their sequence's keys where they lie in the pool, read through its block table.
 *
 * Why a kernel of our own: the torch path gathers a chunk's cached context into a copy, builds a
 * boolean mask and calls SDPA, whose bfloat16 matrix products on CPUs without AMX go through a
 * generic BLAS path that widens to float32 first. Here the keys are read in place and every query
 * of a tile of sixteen is scored against a key at once: the queries sit transposed in registers,
 * sixteen lanes, one query a lane, and `vdpbf16ps` multiplies them by a key's pairs of values
 * broadcast from the pool. No horizontal sums, no copy of the context, no mask.
 *
 * Each query's arithmetic lives in its own lane and runs in the same order whatever else shares
 * the tile, so a query's output does not depend on how its prompt was chunked or what else ran in
 * the step. Sums are in float32; probabilities stay float32 (SDPA rounds them to bfloat16).
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

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "vector_exp.h"

/* What every chunk of one layer call shares. */
typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    int64_t q_row_stride, q_head_stride, slot_stride, kv_head_stride, out_row_stride, out_head_stride;
    int64_t block_size, heads, group, dim;
    float scale;
} layer_t;

static inline const uint16_t *slot_row(const layer_t *L, const uint16_t *pool, const int64_t *table, int64_t t,
                                       int64_t kv_head) {
    int64_t slot = table[t / L->block_size] * L->block_size + t % L->block_size;
    return pool + slot * L->slot_stride + kv_head * L->kv_head_stride;
}

/* scores[t * TILE + lane] = scale * (query lane . key t) for keys [0, keys). `qt` holds the tile's
 * queries transposed: qt[c * TILE + lane] is the lane's pair of values 2c, 2c + 1. Each score is
 * one chain of vdpbf16ps over the pairs in order; eight keys run side by side for throughput. */
static void score_keys(const layer_t *L, const int64_t *table, int64_t kv_head, const uint32_t *qt, int64_t keys,
                       float *scores) {
    const int64_t pairs = L->dim / 2;
    const __m512 scale = _mm512_set1_ps(L->scale);
    int64_t t = 0;
    for (; t + 8 <= keys; t += 8) {
        const uint32_t *row[8];
        __m512 acc[8];
        for (int u = 0; u < 8; ++u) {
            row[u] = (const uint32_t *)slot_row(L, L->k, table, t + u, kv_head);
            acc[u] = _mm512_setzero_ps();
        }
        for (int64_t c = 0; c < pairs; ++c) {
            __m512bh qc = (__m512bh)_mm512_loadu_si512(qt + c * TILE);
            for (int u = 0; u < 8; ++u)
                acc[u] = _mm512_dpbf16_ps(acc[u], qc, (__m512bh)_mm512_set1_epi32((int)row[u][c]));
        }
        for (int u = 0; u < 8; ++u) _mm512_storeu_ps(scores + (t + u) * TILE, _mm512_mul_ps(acc[u], scale));
    }
    for (; t < keys; ++t) {
        const uint32_t *row = (const uint32_t *)slot_row(L, L->k, table, t, kv_head);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < pairs; ++c)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qt + c * TILE),
                                   (__m512bh)_mm512_set1_epi32((int)row[c]));
        _mm512_storeu_ps(scores + t * TILE, _mm512_mul_ps(acc, scale));
    }
}

/* Softmax numerators in place over keys [0, keys) for each lane, keys past a lane's own position
 * (`first` + lane) zeroed; returns each lane's sum in `totals`. */
static void softmax_lanes(float *scores, int64_t keys, int64_t first, float *totals) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    /* Only the last TILE keys can lie past a lane's position: mask them to -inf first. */
    for (int64_t t = first > 0 ? first : 0; t < keys; ++t) {
        __mmask16 future = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32((int)first)),
                                                   _mm512_set1_epi32((int)t));
        _mm512_storeu_ps(scores + t * TILE, _mm512_mask_mov_ps(_mm512_loadu_ps(scores + t * TILE), future, minus_inf));
    }
    __m512 peak = minus_inf;
    for (int64_t t = 0; t < keys; ++t) peak = _mm512_max_ps(_mm512_loadu_ps(scores + t * TILE), peak);
    __m512 sums = _mm512_setzero_ps();
    for (int64_t t = 0; t < keys; ++t) {
        __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + t * TILE), peak), _mm512_set1_ps(-87.0f));
        __m512 e = exp16_in_range(x);
        /* exp of a masked key: -inf - peak clamps to -87, which exp16 takes to a tiny number, not 0. */
        e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(_mm512_loadu_ps(scores + t * TILE), minus_inf, _CMP_EQ_OQ),
                               _mm512_setzero_ps());
        _mm512_storeu_ps(scores + t * TILE, e);
        sums = _mm512_add_ps(sums, e);
    }
    _mm512_storeu_ps(totals, sums);
}

/* values[t * dim ..] = key t's values, widened to float32, for keys [0, keys). */
static void stage_values(const layer_t *L, const int64_t *table, int64_t kv_head, int64_t keys, float *values) {
    for (int64_t t = 0; t < keys; ++t) {
        const uint16_t *row = slot_row(L, L->v, table, t, kv_head);
        for (int64_t d = 0; d < L->dim; d += 16) _mm512_storeu_ps(values + t * L->dim + d, bf16x16_load(row + d));
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
            __m512 x0 = _mm512_loadu_ps(row), x1 = _mm512_loadu_ps(row + 16);
            __m512 x2 = _mm512_loadu_ps(row + 32), x3 = _mm512_loadu_ps(row + 48);
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
            uint16_t *dst = L->out + (out_row + lane0 + r) * L->out_row_stride + head * L->out_head_stride + d;
            for (int c = 0; c < 4; ++c) bf16x16_store(dst + 16 * c, _mm512_mul_ps(acc[r][c], norm));
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
    uint32_t *qt = aligned_buffer(sizeof(uint32_t) * (size_t)(L->dim / 2 * TILE));
    if (scores == NULL || values == NULL || qt == NULL) {
        free(scores), free(values), free(qt);
        return -1;
    }
    stage_values(L, table, kv_head, context, values);
    float *totals = scores + context * TILE;
    for (int64_t tile = 0; tile < count; tile += TILE) {
        int64_t lanes = count - tile < TILE ? count - tile : TILE, first = start + tile;
        memset(qt, 0, sizeof(uint32_t) * (size_t)(L->dim / 2 * TILE));
        for (int64_t r = 0; r < lanes; ++r) {
            const uint32_t *q = (const uint32_t *)(L->q + (row + tile + r) * L->q_row_stride + head * L->q_head_stride);
            for (int64_t c = 0; c < L->dim / 2; ++c) qt[c * TILE + r] = q[c];
        }
        int64_t keys = first + lanes;
        score_keys(L, table, kv_head, qt, keys, scores);
        softmax_lanes(scores, keys, first, totals);
        for (int64_t r = 0; r < lanes; r += 4)
            weigh_values(L, scores, values, totals, r, lanes - r < 4 ? lanes - r : 4, first, head, row + tile);
    }
    free(scores), free(values), free(qt);
    return 0;
}

int baton_prefill_attention_supported(int64_t dim) { return dim > 0 && dim % 64 == 0; }

/* Returns 0 on success, -1 if memory ran out, -2 where the kernel cannot serve this shape. */
int baton_prefill_attention(const void *q, int64_t q_row_stride, int64_t q_head_stride, const void *k, const void *v,
                            int64_t slot_stride, int64_t kv_head_stride, void *out, int64_t out_row_stride,
                            int64_t out_head_stride, const int64_t *rows, const int64_t *counts, const int64_t *starts,
                            const int64_t *table_offsets, const int64_t *tables, int64_t chunks, int64_t block_size,
                            int64_t heads, int64_t kv_heads, int64_t dim, float scale, int threads) {
    if (!baton_prefill_attention_supported(dim) || kv_heads <= 0 || heads % kv_heads != 0) return -2;
    layer_t L = {q, k, v, out, q_row_stride, q_head_stride, slot_stride, kv_head_stride, out_row_stride,
                 out_head_stride, block_size, heads, heads / kv_heads, dim, scale};
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

#else /* without AVX512-BF16 the torch path serves every prefill */

int baton_prefill_attention_supported(int64_t dim) {
    (void)dim;
    return 0;
}

int baton_prefill_attention(const void *q, int64_t q_row_stride, int64_t q_head_stride, const void *k, const void *v,
                            int64_t slot_stride, int64_t kv_head_stride, void *out, int64_t out_row_stride,
                            int64_t out_head_stride, const int64_t *rows, const int64_t *counts, const int64_t *starts,
                            const int64_t *table_offsets, const int64_t *tables, int64_t chunks, int64_t block_size,
                            int64_t heads, int64_t kv_heads, int64_t dim, float scale, int threads) {
    (void)q, (void)q_row_stride, (void)q_head_stride, (void)k, (void)v, (void)slot_stride, (void)kv_head_stride;
    (void)out, (void)out_row_stride, (void)out_head_stride, (void)rows, (void)counts, (void)starts;
    (void)table_offsets, (void)tables, (void)chunks, (void)block_size, (void)heads, (void)kv_heads, (void)dim;
    (void)scale, (void)threads;
    return -2;
}
#endif
