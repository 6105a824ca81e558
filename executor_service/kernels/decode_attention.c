/*
 * Paged decode attention on the CPU: one query token per request, attending to the request's whole
 * context where it lies in the KV pool, read through its block table one block at a time (no padded
 * copy of the context is made).
 *
 * Why a kernel of our own: the torch path makes one SDPA call per request per layer, and on a small
 * model that call's dispatch (~30 us) costs more than its arithmetic. Here one call per layer covers
 * every decode of the step. Grouped-query attention reads each key and value once for all query
 * heads of its group. Sums are in float32 whatever the storage type (float32 or bfloat16).
 *
 * Layouts (strides in elements):
 *   query  q + row * q_row_stride + head * q_head_stride, head_dim contiguous
 *   pool   k/v + slot * slot_stride + kv_head * kv_head_stride, head_dim contiguous
 *   out    out + row * out_row_stride + head * out_head_stride
 * Request i: query row rows[i], context length lengths[i], block table
 * tables[table_offsets[i] .. table_offsets[i + 1]); token t lives in slot
 * table[t / block_size] * block_size + t % block_size.
 *
 * Decodes on one cached prompt prefix (their tables begin with the same blocks) are attended
 * together: each shared block is read once for all of them (attend_together), each decode computing
 * exactly what it computes alone.
 *
 * A sliding window (window > 0) reads only the last `window` tokens of each context, as
 * transformers' sliding_window_overlay does: blocks wholly before them are never read (their table
 * entries may be placeholders for released blocks), and the block the window starts in is read from
 * the window's first token.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

#include "bf16.h"

/* Dot product with LANES independent partial sums, so the compiler can vectorise it without
 * reassociating a single sum (no -ffast-math needed). */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES)
        for (int u = 0; u < LANES; ++u) acc[u] += a[t + u] * b[t + u];
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; t < n; ++t) sum += a[t] * b[t];
    return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vector_exp.h"
#define VECTOR 1

/* The eight partial-sum vectors a[0..7] reduced: out[r] = sum of a[r]'s lanes, times scale. One
 * transpose-and-add reduces all eight at once. */
static inline void reduce8(const __m256 a[8], float scale, float *out) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}

/* exp for x <= 0 (scores minus their maximum). */
static inline __m256 exp_nonpositive(__m256 x) { return exp8_in_range(_mm256_max_ps(x, _mm256_set1_ps(-87.0f))); }

/* Eight dot products q . rows[0..7] (rows `stride` floats apart), dim % 8 == 0, written to out[0..7].
 * Each row gets its own vector of partial sums, reduced together at the end. */
static inline void dot8(const float *q, const float *rows, int64_t stride, int64_t dim, float scale, float *out) {
    __m256 a[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < dim; c += 8) {
        __m256 qc = _mm256_loadu_ps(q + c);
        for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows + r * stride + c), a[r]);
    }
    reduce8(a, scale, out);
}

/* acc[0..64) += sum_j p[j] * rows[j][0..64): eight accumulators stay in registers across tokens. */
static inline void weighted_sum64(float *acc, const float *p, const float *rows, int64_t stride, int64_t count) {
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
    for (int64_t j = 0; j < count; ++j) {
        __m256 w = _mm256_broadcast_ss(p + j);
        const float *row = rows + j * stride;
        for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * c), a[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

#if defined(__AVX512F__)
/* With AVX-512 a bfloat16 pool is read in place, its values widened to float32 in registers as they
 * are loaded, instead of through block_rows' float32 staging copy. On an AMX Xeon the copy (a 48 KB
 * block for a 12-head model, more than L1 holds, written and read back twice) took more time than
 * the arithmetic: in place, the small model's decode shape ran 1.8x faster alone and its decode
 * attention 14 % faster inside the engine (alternated in one process). Float32 keeps the copy,
 * which streams better than reading the pool in place (see block_rows).
 *
 * Where the CPU has AVX512-BF16, the scores are vdpbf16ps dot products of the bfloat16 query and
 * keys: 32 products an instruction, no widening. Each product of two bfloat16 values is exact in
 * float32, so a score differs from the widened one only in the order its sums are rounded. With
 * that, and with rows widened in pairs (bf16_evens, bf16_odds), a layer call on the small model's
 * shared-prefix shape took 3.4 ms instead of 4.3 on one thread of an AMX Xeon. */
#define WIDE 1

/* How the in-place bfloat16 path splits a row: 32 values (64 bytes) are one load, and their
 * even-indexed values are the low halves of its 32-bit lanes, the odd-indexed the high halves. A
 * shift or a mask widens sixteen of them to float32 at once: two integer ops for 32 values where
 * widening each sixteen in order takes a zero-extension and a shift. The float32 copies this path
 * keeps of a query and of its weighted sums are in that order, each 32-value tile's evens, then its
 * odds (SPLIT_INDEX). */
#define SPLIT_INDEX(t) (((t) & ~(int64_t)31) + ((t) & 1) * 16 + (((t) & 31) >> 1))

static inline __m512 bf16_evens(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }

static inline __m512 bf16_odds(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Scores of a query against `n` <= 8 bfloat16 rows (`stride` apart, dim % 32 == 0), read in place,
 * written to out[0..n). Rows past `n` are not read; each row's sum is reduced the same way whatever
 * `n` is, so a token's score does not depend on where its block ends. With AVX512-BF16, each
 * 32-value tile is one vdpbf16ps against the query as the model left it (bfloat16); without it,
 * the split widening above against the query's float32 copy `qs` (in split order). */
static inline __attribute__((always_inline)) void dot8_bf16(const uint16_t *qb, const float *qs,
                                                            const uint16_t *rows, int64_t stride, int64_t dim,
                                                            int n, float scale, float *out) {
    __m512 a[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += 32) {
#if defined(__AVX512BF16__)
        (void)qs;
        __m512bh qc = (__m512bh)_mm512_loadu_si512(qb + c);
        for (int r = 0; r < n; ++r)
            a[r] = _mm512_dpbf16_ps(a[r], qc, (__m512bh)_mm512_loadu_si512(rows + r * stride + c));
#else
        (void)qb;
        __m512 qe = _mm512_loadu_ps(qs + c), qo = _mm512_loadu_ps(qs + c + 16);
        for (int r = 0; r < n; ++r) {
            __m512i kv = _mm512_loadu_si512(rows + r * stride + c);
            a[r] = _mm512_fmadd_ps(qo, bf16_odds(kv), _mm512_fmadd_ps(qe, bf16_evens(kv), a[r]));
        }
#endif
    }
    __m256 halves[8];
    for (int r = 0; r < 8; ++r)
        halves[r] = _mm256_add_ps(_mm512_castps512_ps256(a[r]),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[r]), 1)));
    float sums[8];
    reduce8(halves, scale, sums);
    for (int r = 0; r < n; ++r) out[r] = sums[r];
}

/* acc[0..64) += sum_j p[j] * rows[j][0..64) over bfloat16 rows read in place, acc in split order.
 * Each value gets the same multiply-adds in the same order as widening the rows in order would
 * give it (tokens of even and odd index summed apart, then together). */
static inline void weighted_sum64_bf16(float *acc, const float *p, const uint16_t *rows, int64_t stride,
                                       int64_t count) {
    __m512 even[4], odd[4];
    for (int c = 0; c < 4; ++c) even[c] = _mm512_loadu_ps(acc + 16 * c), odd[c] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= count; j += 2) {
        __m512 w0 = _mm512_set1_ps(p[j]), w1 = _mm512_set1_ps(p[j + 1]);
        const uint16_t *r0 = rows + j * stride, *r1 = r0 + stride;
        for (int h = 0; h < 2; ++h) {
            __m512i x0 = _mm512_loadu_si512(r0 + 32 * h), x1 = _mm512_loadu_si512(r1 + 32 * h);
            even[2 * h] = _mm512_fmadd_ps(w0, bf16_evens(x0), even[2 * h]);
            even[2 * h + 1] = _mm512_fmadd_ps(w0, bf16_odds(x0), even[2 * h + 1]);
            odd[2 * h] = _mm512_fmadd_ps(w1, bf16_evens(x1), odd[2 * h]);
            odd[2 * h + 1] = _mm512_fmadd_ps(w1, bf16_odds(x1), odd[2 * h + 1]);
        }
    }
    if (j < count) {
        __m512 w = _mm512_set1_ps(p[j]);
        for (int h = 0; h < 2; ++h) {
            __m512i x = _mm512_loadu_si512(rows + j * stride + 32 * h);
            even[2 * h] = _mm512_fmadd_ps(w, bf16_evens(x), even[2 * h]);
            even[2 * h + 1] = _mm512_fmadd_ps(w, bf16_odds(x), even[2 * h + 1]);
        }
    }
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + 16 * c, _mm512_add_ps(even[c], odd[c]));
}

/* One block's scores for every head, from a bfloat16 pool in place; `rows` is the block's first slot,
 * `qb` the decode's bfloat16 queries (head h at qb + h * q_head_stride), `qs` their float32 copy in
 * split order. */
static void score_block_bf16(const uint16_t *qb, int64_t q_head_stride, const float *qs, const uint16_t *rows,
                             int64_t slot_stride, int64_t kv_head_stride, int64_t count, int64_t heads, int64_t group,
                             int64_t dim, float scale, float *scores, int64_t length) {
    for (int64_t h = 0; h < heads; ++h) {
        const uint16_t *head = rows + (h / group) * kv_head_stride;
        int64_t j = 0;
        for (; j + 8 <= count; j += 8) /* a constant 8 unrolls the rows into registers */
            dot8_bf16(qb + h * q_head_stride, qs + h * dim, head + j * slot_stride, slot_stride, dim, 8, scale,
                      scores + h * length + j);
        if (j < count)
            dot8_bf16(qb + h * q_head_stride, qs + h * dim, head + j * slot_stride, slot_stride, dim,
                      (int)(count - j), scale, scores + h * length + j);
    }
}

/* acc[h] += one block's values weighted by its scores, for every head, from a bfloat16 pool in
 * place (dim % 64 == 0). */
static void accumulate_block_bf16(float *acc, const float *scores, const uint16_t *rows, int64_t slot_stride,
                                  int64_t kv_head_stride, int64_t count, int64_t heads, int64_t group, int64_t dim,
                                  int64_t length) {
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t t = 0; t < dim; t += 64)
            weighted_sum64_bf16(acc + h * dim + t, scores + h * length, rows + (h / group) * kv_head_stride + t,
                                slot_stride, count);
}
#else
#define WIDE 0
#endif /* __AVX512F__ */
#else
#define VECTOR 0
#define WIDE 0
#endif

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t t = 0; t < n; ++t) y[t] += a * x[t];
}

/* Scores of one query against `count` rows `stride` floats apart. */
static void score_rows(const float *q, const float *rows, int64_t stride, int64_t count, int64_t dim, float scale,
                       float *out) {
    int64_t j = 0;
#if VECTOR
    if (dim % 8 == 0)
        for (; j + 8 <= count; j += 8) dot8(q, rows + j * stride, stride, dim, scale, out + j);
#endif
    for (; j < count; ++j) out[j] = dot(q, rows + j * stride, dim) * scale;
}

/* acc[0..dim) += sum_j p[j] * rows[j]. */
static void accumulate_rows(float *acc, const float *p, const float *rows, int64_t stride, int64_t count,
                            int64_t dim) {
    int64_t t = 0;
#if VECTOR
    for (; t + 64 <= dim; t += 64) weighted_sum64(acc + t, p, rows + t, stride, count);
#endif
    if (t < dim)
        for (int64_t j = 0; j < count; ++j) axpy(acc + t, p[j], rows + j * stride + t, dim - t);
}

/* s[0..n) = exp(s - peak), returning their sum. */
static float softmax_numerators(float *s, int64_t n) {
    float peak = -INFINITY, total = 0.0f;
    int64_t j = 0;
#if VECTOR
    /* The maximum over eight lanes: one running maximum was a chain of dependent compares, a quarter
     * of the kernel's own time. A NaN score is passed over as the scalar loop passes it (max_ps
     * returns its second operand when either is NaN), and where the peak is a zero its sign does not
     * change any exp(s - peak). */
    if (n >= 8) {
        __m256 lanes = _mm256_set1_ps(-INFINITY);
        for (; j + 8 <= n; j += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(s + j), lanes);
        float top8[8];
        _mm256_storeu_ps(top8, lanes);
        for (int u = 0; u < 8; ++u) peak = top8[u] > peak ? top8[u] : peak;
    }
#endif
    for (; j < n; ++j) peak = s[j] > peak ? s[j] : peak;
    j = 0;
#if VECTOR
    __m256 sums = _mm256_setzero_ps(), top = _mm256_set1_ps(peak);
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), top));
        _mm256_storeu_ps(s + j, e);
        sums = _mm256_add_ps(sums, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sums);
    total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
#endif
    for (; j < n; ++j) {
        s[j] = expf(s[j] - peak);
        total += s[j];
    }
    return total;
}

/* The first `width` values of `count` pool rows, as float32, in `staging`; `*stride` is set to the
 * distance between the returned rows.
 *
 * Why copy float32 rows that could be read in place: the copy is one plain sequential read, which
 * the hardware prefetchers stream at full speed, and the arithmetic then reads L1. Computing
 * straight from the pool left memory latency exposed: 64 decodes over 700-900-token contexts took
 * 5.5 ms in place and 3.4 ms with the copy (a bare sequential sum over the same blocks: 1.6 ms);
 * prefetching the next block as well made no further difference. */
static const float *block_rows(const void *pool, int64_t offset, int64_t slot_stride, int64_t count, int64_t width,
                               int is_bf16, float *staging, int64_t *stride) {
    if (!is_bf16) {
        memcpy(staging, (const float *)pool + offset, sizeof(float) * (size_t)(count * slot_stride));
        *stride = slot_stride;
        return staging;
    }
    const uint16_t *src = (const uint16_t *)pool + offset;
    for (int64_t j = 0; j < count; ++j)
        for (int64_t t = 0; t < width; ++t) staging[j * width + t] = bf16_to_f32(src[j * slot_stride + t]);
    *stride = width;
    return staging;
}

/* What every decode of one layer call shares: where the queries, the pool and the outputs lie, and
 * the model's shape. */
typedef struct {
    const void *q, *k, *v;
    void *out;
    int64_t q_row_stride, q_head_stride, slot_stride, kv_head_stride, row_width, out_row_stride, out_head_stride;
    int64_t block_size, window, heads, group, dim;
    float scale;
    int is_bf16, in_place;
} layer_t;

/* One decode's working state: it reads tokens [first, first + length) of its context. */
typedef struct {
    int64_t row, first, length;
    const int64_t *table;
    float *scores; /* [heads, length] */
    float *qf;     /* [heads, dim] the queries in float32 (unused where dot8_bf16 takes them as bf16) */
    float *acc;    /* [heads, dim] weighted sums of values */
    float *totals; /* [heads] softmax denominators */
} decode_t;

static size_t decode_floats(const layer_t *L, int64_t length) {
    return (size_t)(L->heads * length + 2 * L->heads * L->dim + L->heads);
}

/* Where value t of a head lies in a decode's float32 query and weighted sums: in split order where
 * the pool is read in place (see SPLIT_INDEX), in order otherwise. */
static inline int64_t at(const layer_t *L, int64_t t) {
#if WIDE
    if (L->in_place) return SPLIT_INDEX(t);
#endif
    (void)L;
    return t;
}

/* Lay out a decode's state in `memory` (decode_floats of it) and read its queries as float32, unless
 * its scores take the bfloat16 queries as they are. */
static void decode_begin(const layer_t *L, decode_t *d, int64_t row, int64_t length, const int64_t *table,
                         float *memory) {
    d->row = row;
    d->first = L->window > 0 && length > L->window ? length - L->window : 0; /* the first token read */
    d->length = length - d->first;                                          /* from here on: tokens read */
    d->table = table;
    d->scores = memory;
    d->qf = d->scores + L->heads * d->length;
    d->acc = d->qf + L->heads * L->dim;
    d->totals = d->acc + L->heads * L->dim;
#if defined(__AVX512BF16__)
    if (L->in_place) return; /* its scores take the bfloat16 queries as they are (dot8_bf16) */
#endif
    for (int64_t h = 0; h < L->heads; ++h) {
        int64_t offset = row * L->q_row_stride + h * L->q_head_stride;
        for (int64_t t = 0; t < L->dim; ++t)
            d->qf[h * L->dim + at(L, t)] = L->is_bf16 ? bf16_to_f32(((const uint16_t *)L->q)[offset + t])
                                                      : ((const float *)L->q)[offset + t];
    }
}

/* Pass KEYS scores `count` tokens of the decode from `start` (counted from its first token read),
 * pass VALUES adds them to its weighted sums. `offset` is their first slot's in the pool, `rows` the
 * same rows staged in float32 (`stride` apart), or NULL where the pool is read in place. */
enum pass { KEYS, VALUES };

static void attend_run(const layer_t *L, decode_t *d, enum pass pass, int64_t start, int64_t count, int64_t offset,
                       const float *rows, int64_t stride) {
#if WIDE
    if (L->in_place) {
        if (pass == KEYS)
            score_block_bf16((const uint16_t *)L->q + d->row * L->q_row_stride, L->q_head_stride, d->qf,
                             (const uint16_t *)L->k + offset, L->slot_stride, L->kv_head_stride, count, L->heads,
                             L->group, L->dim, L->scale, d->scores + start, d->length);
        else
            accumulate_block_bf16(d->acc, d->scores + start, (const uint16_t *)L->v + offset, L->slot_stride,
                                  L->kv_head_stride, count, L->heads, L->group, L->dim, d->length);
        return;
    }
#endif
    (void)offset;
    for (int64_t h = 0; h < L->heads; ++h) {
        const float *head = rows + (h / L->group) * L->kv_head_stride;
        if (pass == KEYS)
            score_rows(d->qf + h * L->dim, head, stride, count, L->dim, L->scale, d->scores + h * d->length + start);
        else
            accumulate_rows(d->acc + h * L->dim, d->scores + h * d->length + start, head, stride, count, L->dim);
    }
}

/* One pass over the decode's tokens from `from` on, read block by block through its block table. All
 * KV heads are handled together so that each token's row (kv_heads * dim values) is read once, front
 * to back: the context streams through memory in order. */
static void attend_from(const layer_t *L, decode_t *d, enum pass pass, int64_t from, float *staging) {
    const void *pool = pass == KEYS ? L->k : L->v;
    /* start: the first token of each run read from one block, counted from `first`; its slots follow
     * from the token's position in the sequence, start + first. */
    for (int64_t start = from, count; start < d->length; start += count) {
        int64_t token = start + d->first, within = token % L->block_size;
        count = L->block_size - within < d->length - start ? L->block_size - within : d->length - start;
        int64_t offset = (d->table[token / L->block_size] * L->block_size + within) * L->slot_stride, stride = 0;
        const float *rows = L->in_place ? NULL
                                        : block_rows(pool, offset, L->slot_stride, count, L->row_width, L->is_bf16,
                                                     staging, &stride);
        attend_run(L, d, pass, start, count, offset, rows, stride);
    }
}

/* Between the passes: the scores become softmax numerators, the weighted sums start at zero. */
static void decode_softmax(const layer_t *L, decode_t *d) {
    for (int64_t h = 0; h < L->heads; ++h) d->totals[h] = softmax_numerators(d->scores + h * d->length, d->length);
    memset(d->acc, 0, sizeof(float) * (size_t)(L->heads * L->dim));
}

static void decode_finish(const layer_t *L, const decode_t *d) {
    for (int64_t h = 0; h < L->heads; ++h) {
        int64_t offset = d->row * L->out_row_stride + h * L->out_head_stride;
        float norm = 1.0f / d->totals[h];
        for (int64_t t = 0; t < L->dim; ++t) {
            float value = d->acc[h * L->dim + at(L, t)] * norm;
            if (L->is_bf16)
                ((uint16_t *)L->out)[offset + t] = f32_to_bf16(value);
            else
                ((float *)L->out)[offset + t] = value;
        }
    }
}

/* Decodes whose contexts begin with the same `shared` blocks of the pool (requests on one cached
 * prompt prefix), attended together: each shared block is read and staged once for all of them,
 * where alone each would read it again. Every decode still computes exactly what it computes
 * alone, in the same order (its shared blocks are its first, read in order, then its own), so the
 * outputs are bit for bit the same. `count` == 1 and `shared` == 0 is one decode alone. Returns 0,
 * or -1 when scratch memory could not be had. */
static int attend_together(const layer_t *L, const int64_t *members, int64_t count, int64_t shared,
                           const int64_t *rows, const int64_t *lengths, const int64_t *table_offsets,
                           const int64_t *tables) {
    size_t floats = (size_t)(L->block_size * L->slot_stride); /* the staging block holds whole pool rows */
    for (int64_t m = 0; m < count; ++m) floats += decode_floats(L, lengths[members[m]]);
    floats = (floats + 3) & ~(size_t)3; /* the decodes' states follow, aligned */
    float *memory = malloc(sizeof(float) * floats + sizeof(decode_t) * (size_t)count);
    if (memory == NULL) return -1;
    float *staging = memory, *next = staging + L->block_size * L->slot_stride;
    decode_t *decodes = (decode_t *)(memory + floats);
    for (int64_t m = 0; m < count; ++m) {
        int64_t i = members[m];
        decode_begin(L, &decodes[m], rows[i], lengths[i], tables + table_offsets[i], next);
        next += decode_floats(L, lengths[i]);
    }
    const int64_t *table = decodes[0].table; /* the shared blocks are the same in every member's table */
    for (enum pass pass = KEYS; pass <= VALUES; ++pass) {
        const void *pool = pass == KEYS ? L->k : L->v;
        for (int64_t b = 0; b < shared; ++b) {
            int64_t offset = table[b] * L->block_size * L->slot_stride, stride = 0;
            const float *staged = L->in_place ? NULL
                                              : block_rows(pool, offset, L->slot_stride, L->block_size,
                                                           L->row_width, L->is_bf16, staging, &stride);
            for (int64_t m = 0; m < count; ++m)
                attend_run(L, &decodes[m], pass, b * L->block_size, L->block_size, offset, staged, stride);
        }
        for (int64_t m = 0; m < count; ++m) {
            attend_from(L, &decodes[m], pass, shared * L->block_size, staging);
            if (pass == KEYS) decode_softmax(L, &decodes[m]);
        }
    }
    for (int64_t m = 0; m < count; ++m) decode_finish(L, &decodes[m]);
    free(memory);
    return 0;
}

/* A decode's first block, the key that groups decodes on one prompt prefix. */
typedef struct {
    int64_t block, index;
} keyed_t;

static int by_block(const void *a, const void *b) {
    const keyed_t *x = a, *y = b;
    if (x->block != y->block) return x->block < y->block ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* One unit of parallel work: decodes order[start .. start + count) sharing their first `shared` blocks. */
typedef struct {
    int64_t start, count, shared;
} work_t;

/* Split the decodes into work: runs of decodes whose tables begin with the same blocks, at most
 * `most` a unit (so that threads share one hot prefix), each with the full blocks all of them share;
 * every other decode alone. `order` receives the decodes' indices, grouped. Returns the units. */
static int64_t plan_work(const int64_t *lengths, const int64_t *table_offsets, const int64_t *tables, int64_t count,
                         int64_t block_size, int share, int64_t most, keyed_t *keyed, int64_t *order, work_t *work) {
    for (int64_t i = 0; i < count; ++i) {
        /* A decode without a full block (or any, with sharing off) keys alone: -1 - i is no block id. */
        int whole = share && lengths[i] >= block_size;
        keyed[i] = (keyed_t){whole ? tables[table_offsets[i]] : -1 - i, i};
    }
    qsort(keyed, (size_t)count, sizeof(keyed_t), by_block);
    int64_t units = 0;
    for (int64_t i = 0; i < count; ++i) order[i] = keyed[i].index;
    for (int64_t start = 0, end; start < count; start = end) {
        for (end = start + 1; end < count && end - start < most && keyed[end].block == keyed[start].block;) ++end;
        int64_t shared = keyed[start].block < 0 || end - start == 1 ? 0 : INT64_MAX;
        const int64_t *lead = tables + table_offsets[order[start]];
        for (int64_t m = start; m < end && shared > 0; ++m) {
            const int64_t *table = tables + table_offsets[order[m]];
            int64_t full = lengths[order[m]] / block_size, same = 0;
            while (same < full && same < shared && table[same] == lead[same]) ++same;
            shared = same;
        }
        if (shared == 0) { /* nothing to read once for several: each alone */
            for (int64_t m = start; m < end; ++m) work[units++] = (work_t){m, 1, 0};
        } else {
            work[units++] = (work_t){start, end - start, shared};
        }
    }
    return units;
}

/* Returns 0 on success, -1 if memory ran out (the caller falls back to the torch path). `share`:
 * decodes whose contexts begin with the same pool blocks read them once together (attend_together);
 * 0 attends each alone (the outputs are the same either way). */
int baton_decode_attention(const void *q, int64_t q_row_stride, int64_t q_head_stride, const void *k, const void *v,
                           int64_t slot_stride, int64_t kv_head_stride, void *out, int64_t out_row_stride,
                           int64_t out_head_stride, const int64_t *rows, const int64_t *lengths,
                           const int64_t *table_offsets, const int64_t *tables, int64_t count, int64_t block_size,
                           int64_t window, int64_t heads, int64_t kv_heads, int64_t dim, float scale, int is_bf16,
                           int threads, int share) {
    layer_t L = {q, k, v, out, q_row_stride, q_head_stride, slot_stride, kv_head_stride, kv_heads * kv_head_stride,
                 out_row_stride, out_head_stride, block_size, window, heads, heads / kv_heads, dim, scale, is_bf16, 0};
    /* With AVX-512 a bfloat16 pool is read in place where its float32 staging block would not sit in
     * L1 beside the rest (16 KB): smaller blocks (the tiny model's 8 KB) stage as fast. */
    L.in_place = WIDE && is_bf16 && dim % 64 == 0 && block_size * L.row_width * (int64_t)sizeof(float) > 16384;
    if (count <= 0) return 0;
    keyed_t *keyed = malloc(sizeof(keyed_t) * (size_t)count);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)count);
    work_t *work = malloc(sizeof(work_t) * (size_t)count);
    int failed = keyed == NULL || order == NULL || work == NULL;
    if (!failed) {
        /* A sliding window reads no fixed first blocks, so windowed decodes attend alone. Several
         * threads split a hot prefix's decodes into a few units each, so that none idles. */
        int64_t most = threads > 1 ? (count + 4 * threads - 1) / (4 * threads) : count;
        int64_t units = plan_work(lengths, table_offsets, tables, count, block_size, share && window == 0,
                                  most > 1 ? most : 1, keyed, order, work);
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1) reduction(| : failed)
        for (int64_t u = 0; u < units; ++u)
            failed |= attend_together(&L, order + work[u].start, work[u].count, work[u].shared, rows, lengths,
                                      table_offsets, tables) != 0;
    }
    free(keyed);
    free(order);
    free(work);
    return failed ? -1 : 0;
}
