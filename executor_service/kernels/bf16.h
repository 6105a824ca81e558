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

#endif
