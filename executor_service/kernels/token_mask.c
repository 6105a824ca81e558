/*
 * A structured output's token bitmask applied to float32 logits rows: every token whose bit is clear
 * becomes -inf, the others keep their logits.
 *
 * Why: xgrammar's CPU kernel tests and writes token by token, about 25 us a row of an 8,192-token
 * vocabulary, whether the row allows a few tokens or nearly all; at 64 constrained rows that is a
 * tenth of a tiny model's decode step. Here a word of the bitmask covers 32 tokens at once: a word
 * with every bit set (inside a string, most of a row) is skipped, and any other is one select over
 * its 32 logits, which the compiler vectorises.
 *
 * Layout as xgrammar's: token t is bit t % 32 of word t / 32 of its row's int32 words.
 */
#include <math.h>
#include <stdint.h>

/* For each i < count: logits row rows[i] (row_stride floats apart) masked by bitmask row rows[i]
 * (words int32 apart), over its first `covered` tokens. */
void baton_apply_token_bitmask(float *logits, int64_t row_stride, const int32_t *bitmask, int64_t words,
                               const int64_t *rows, int64_t count, int64_t covered) {
    const float blocked = -INFINITY;
    for (int64_t i = 0; i < count; ++i) {
        float *row = logits + rows[i] * row_stride;
        const uint32_t *bits = (const uint32_t *)(bitmask + rows[i] * words);
        for (int64_t base = 0, w = 0; base < covered; base += 32, ++w) {
            uint32_t word = bits[w];
            int64_t n = covered - base < 32 ? covered - base : 32;
            if (word == UINT32_MAX) continue;
            /* A select rather than a branch per bit: the compiler turns it into masked vector stores. */
            for (int64_t j = 0; j < n; ++j) row[base + j] = ((word >> j) & 1u) ? row[base + j] : blocked;
        }
    }
}
