/* out[rows, n] = bf16(x[rows, k] @ W^T) for bfloat16 linear layers at decode sizes, through the
 * oneDNN BRGeMM micro-kernel that torch exports (at::native::cpublas::brgemm, resolved by the
 * Python side and passed in as a function pointer, so this file links against nothing).
 *
 * Why: torch's oneDNN linear (mkldnn._linear_pointwise) spends 20-30 us per call outside the
 * arithmetic (creating the primitive descriptor, wrapping tensors), whatever the size: 16x16 takes
 * as long as 256x256. A tiny model's step makes 17 such calls. The micro-kernel is the same AMX
 * code oneDNN's inner product runs (the same float32 accumulation, then one rounding to bf16),
 * and a cached one costs about a microsecond to call.
 *
 * W is packed once (by the Python side) into the VNNI layout the kernel reads: [k/2][n][2], pairs
 * of consecutive k interleaved. After each call the AMX tile state is released, so that torch's
 * record of the configured kernel stays true when oneDNN's own primitives reconfigure the tiles in
 * between.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

typedef void (*brgemm_bf16_fn)(int64_t m, int64_t n, int64_t k, int64_t ld_a, int64_t ld_b, int64_t ld_c,
                               bool add_c, const uint16_t *a, const uint16_t *b, float *c, bool is_vnni);
typedef void (*brgemm_release_fn)(bool is_vnni);

/* The float32 accumulator, grown as needed, one per thread (each executor step runs on one). */
static __thread float *accumulator;
static __thread int64_t accumulator_len;

static float *accumulator_for(int64_t len) {
    if (len > accumulator_len) {
        float *grown = realloc(accumulator, (size_t)len * sizeof *grown);
        if (grown == NULL) return NULL;
        accumulator = grown;
        accumulator_len = len;
    }
    return accumulator;
}

/* Returns 0, or -1 when the accumulator could not be allocated (nothing was written). */
int baton_small_gemm_bf16(void *brgemm, void *release, const uint16_t *x, int64_t rows, int64_t k,
                          int64_t x_stride, const uint16_t *packed, int64_t n, uint16_t *out, int64_t out_stride) {
    float *acc = accumulator_for(rows * n);
    if (acc == NULL) return -1;
    /* Whole tiles of 16 rows, then the rest: each row comes out the same either way (its own dot
     * products, in the same order), and the kernels torch compiles and caches per row count are
     * 19 per shape (16, 32, 48, 64 and 1-15) instead of one for every batch size. */
    int64_t whole = rows / 16 * 16;
    if (whole > 0) ((brgemm_bf16_fn)brgemm)(whole, n, k, x_stride, n, n, false, x, packed, acc, true);
    if (rows > whole)
        ((brgemm_bf16_fn)brgemm)(rows - whole, n, k, x_stride, n, n, false, x + whole * x_stride, packed,
                                 acc + whole * n, true);
    ((brgemm_release_fn)release)(true);
    for (int64_t r = 0; r < rows; r++) {
        const float *src = acc + r * n;
        uint16_t *dst = out + r * out_stride;
        int64_t j = 0;
#if defined(__AVX512F__)
        for (; j + 16 <= n; j += 16) bf16x16_store(dst + j, _mm512_loadu_ps(src + j));
#endif
        for (; j < n; j++) dst[j] = f32_to_bf16(src[j]);
    }
    return 0;
}
