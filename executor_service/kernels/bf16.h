/* bfloat16 <-> float32, as torch converts: bf16 is the top half of a float32's bits. */
#ifndef BATON_BF16_H
#define BATON_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Without a branch, so that loops over it vectorise. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16; /* round to nearest even, as torch does */
    uint32_t quiet_nan = (bits >> 16) | 0x40u;                         /* NaN stays NaN */
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* A float rounded to bfloat16 and back: what one torch op on bf16 tensors leaves. */
static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(__AVX512F__)
#include <immintrin.h>

/* The same conversions on sixteen values at once, bit for bit the scalar ones above (integer ops,
 * not AVX512-BF16's vcvtneps2bf16, which flushes denormals to zero). */
static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* f32_to_bf16 on each lane, the bfloat16 bits in the low half of each 32-bit lane. */
static inline __m512i bf16x16_bits(__m512 f) {
    __m512i bits = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_blend_epi32(nan, rounded, quiet_nan);
}

static inline void bf16x16_store(uint16_t *p, __m512 f) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16x16_bits(f)));
}

/* bf16_round on each lane. */
static inline __m512 bf16x16_round(__m512 f) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_bits(f), 16)); }
#endif

#endif
