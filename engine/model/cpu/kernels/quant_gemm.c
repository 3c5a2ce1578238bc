/* Linear layers on narrow weights: y = x W^T + b with W in blocks of 32 along the input dimension,
 * each block one to three fp32 scales (int8h, int5h: one fp16) and 32 integers
 * (engine/model/cpu/quant_formats.py):
 *
 *   int8 (QUANT_INT8): w = d * q, q in [-128, 127]      quantised at load; GGUF's IQ4_XS
 *   int8h (QUANT_INT8H): int8 with d an fp16            GGUF's Q8_0 and IQ4_NL blocks
 *   int4 (QUANT_INT4): w = d * q + m, q in [0, 15]      GGUF's Q4_1 (and Q4_0: m = -8 d) blocks
 *   int4k (QUANT_INT4K): int4 with d = D * sc, m = M * mc  GGUF's Q4_K (sc, mc 6 bits per
 *                                                       block, D, M fp32 per 8 blocks)
 *   int5 (QUANT_INT5): w = d * q + m, q in [0, 31]      GGUF's Q5_1
 *   int5h (QUANT_INT5H): int5 with d an fp16, m = -16 d  GGUF's Q5_0 blocks
 *   int5k (QUANT_INT5K): int5 with d = D * sc, m = M * mc  GGUF's Q5_K (as int4k)
 *   int6 (QUANT_INT6): w = d_half * (q - 32), q in [0, 63]   GGUF's Q6_K (one d per 16)
 *   int8k (QUANT_INT8K): w = d_half * q + m, q int8     one d per 16 inputs: GGUF's Q3_K; mixed
 *                                                       fused projections
 *   int2k (QUANT_INT2K): w = d_half * q + m_half, q in [0, 3], d_half = D * sc, m_half = M * mc
 *                                                       GGUF's Q2_K (sc, mc 4 bits per 16 inputs,
 *                                                       D, M fp32 per 8 blocks)
 *   int8km (QUANT_INT8KM): w = d_half * q + m_half, q int8   int8k with an offset per 16 inputs:
 *                                                       mixed fused projections with int2k
 *
 * quant_pack turns the column records of quant_formats.py into groups of GROUP = 8 interleaved
 * output columns: per group and block, the 8 columns' scales, then the integers in quads of 4
 * consecutive inputs, one 32-bit lane per column. One vpdpbusd of such a vector against 4
 * activations broadcast then adds 4 products to each of 8 columns, so the integer sums of a block
 * come out per column without any horizontal reduction, and the scales cost one conversion and one
 * multiply-add per 8 columns and block, int8h's and int5h's fp16s one vcvtph2ps more (on
 * column-major records they cost that per column: 3x slower at 16-64 rows,
 * docs/PERFORMANCE.md#narrow-weights). The activations are quantised per row and block to int8 on
 * the way in (d_x = max|x| / 127), so a block's dot product is an integer one: d_w d_x sum(q_w q_x)
 * (+ m_w d_x sum(q_x) for int4 and int8k, whose halves' sums each take their own d_w). Up to ROWS
 * input rows share each weight load. The dots run on vpdpbusd (AVX512-VNNI on 256-bit vectors, or
 * AVX-VNNI), AVX2 (vpmaddubsw + vpmaddwd; these builds need F16C too, which every AVX2 CPU has) or
 * plain C, as the build's target allows (kernels/build.py). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"
#include "quant_gemm.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) /* every AVX2 CPU has F16C */
#include <immintrin.h>
#define QUANT_SIMD 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QUANT_VNNI 1
#define DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define QUANT_VNNI 1
#define DPBUSD _mm256_dpbusd_avx_epi32
#endif
#endif

#define BLOCK QUANT_BLOCK
#define GROUP 8
#define QUADS (BLOCK / 4)
#define ROWS 4
#define GROUPS_PER_TILE 2
#define PREFETCH_AHEAD 4096 /* bytes; into every cache level (docs/PERFORMANCE.md#narrow-weights) */
#define SERIAL_QUANTIZE 32768 /* activations (m x k) up to which one thread quantises them */

enum { QUANT_INT8 = 0, QUANT_INT4 = 1, QUANT_INT8K = 2, QUANT_INT5 = 3, QUANT_INT6 = 4,
       QUANT_INT4K = 5, QUANT_INT8H = 6, QUANT_INT5K = 7, QUANT_INT5H = 8, QUANT_INT2K = 9,
       QUANT_INT8KM = 10 };
#define SUPER 8     /* int2k's, int4k's and int5k's blocks per super-block */
#define SUPER_HEAD 64 /* their D [8] and M [8] f32 before each super-block's blocks */

/* Whether the format's d and m are D * sc and M * mc (int4k, int5k: 6-bit sc, mc per block;
 * int2k: 4-bit sc, mc per half-block; fp32 D, M per super-block). */
static inline int super_scaled(int format) {
    return format == QUANT_INT4K || format == QUANT_INT5K || format == QUANT_INT2K;
}

/* Whether each half-block has its own scale and offset (int2k, int8km): d_lo, d_hi, m_lo, m_hi. */
static inline int half_offsets(int format) {
    return format == QUANT_INT2K || format == QUANT_INT8KM;
}

/* Whether each half-block has its own scale: its integer dots kept apart. */
static inline int halves_apart(int format) {
    return format == QUANT_INT6 || format == QUANT_INT8K || half_offsets(format);
}

/* The sum of a row's quantised activations over half h of block b (QuantRow.c holds -128 times
 * it). */
static inline int half_sum(const QuantRow *x, int64_t b, int h) { return x->c[3 * b + h] / -128; }

/* Whether the format's d is one fp16 per column and block (int8h, int5h: the file's). */
static inline int fp16_scaled(int format) {
    return format == QUANT_INT8H || format == QUANT_INT5H;
}

/* Which integer dot product this build runs. */
const char *quant_gemm_isa(void) {
#if defined(QUANT_VNNI)
    return "vnni";
#elif defined(QUANT_SIMD)
    return "avx2";
#else
    return "generic";
#endif
}

/* Bytes of one group's block: int8 d [8] f32, u [8 quads][8 columns][4]; int8h the same with d [8]
 * f16 (the file's, as they are: 16 bytes a block less); int4 d [8], m [8] f32, nibbles [4][8
 * columns][4] whose low nibbles are quad j and high nibbles quad j + 4; int5 int4's, then fifth
 * bits [8 columns][4] (bit j: quad j's, so that one 32-byte load serves the block and a shift and a
 * mask take each quad's); int5h d [8] f16, then int5's nibbles and fifth bits (48 bytes a block
 * less than int5: no m, which is -16 d); int6 d_lo [8], d_hi [8] f32, int4's nibbles, then the high
 * bit pairs [2][8 columns][4] (bits 2 j, 2 j + 1 of the first: quad j's, of the second: quad j +
 * 4's); int4k sc [8], mc [8] u8, int4's nibbles, each super-block's blocks after its D [8] and M
 * [8] f32 (SUPER_HEAD); int5k int4k's, then int5's fifth bits; int8k d_lo [8], d_hi [8], m [8] f32,
 * u [8 quads][8 columns][4] (quads 0-3: d_lo's); int8km int8k's with m_lo [8], m_hi [8]; int2k
 * the bytes sc | mc << 4 of the first halves [8], then of the second [8], then the 2-bit integers
 * [2][8 columns][4] (bits 2 j of the first: quad j's, of the second: quad j + 4's), each
 * super-block's blocks after its D [8] and M [8] (int4k's). The int8s are held as u = q + 128 (q ^ 0x80):
 * vpdpbusd's unsigned operand, against the signed activations, so the correction 128 sum(q_x) is
 * the activations' (one per row and half-block, QuantRow.c) and the weights carry no per-column
 * sums (4 bytes a block less: Gemma 3's Q8_0 head is 20 MiB smaller). */
static int64_t group_block_bytes(int format) {
    switch (format) {
    case QUANT_INT4: return 64 + BLOCK * GROUP / 2;
    case QUANT_INT4K: return 16 + BLOCK * GROUP / 2;
    case QUANT_INT5: return 64 + BLOCK * GROUP / 2 + BLOCK * GROUP / 8;
    case QUANT_INT5K:
    case QUANT_INT5H: return 16 + BLOCK * GROUP / 2 + BLOCK * GROUP / 8;
    case QUANT_INT6: return 64 + BLOCK * GROUP / 2 + BLOCK * GROUP / 4;
    case QUANT_INT8K: return 96 + BLOCK * GROUP;
    case QUANT_INT8KM: return 128 + BLOCK * GROUP;
    case QUANT_INT8H: return 16 + BLOCK * GROUP;
    case QUANT_INT2K: return 16 + BLOCK * GROUP / 4;
    default: return 32 + BLOCK * GROUP;
    }
}

/* Where a group block's integers start, after its scales. */
static int64_t quads_offset(int format) {
    switch (format) {
    case QUANT_INT2K:
    case QUANT_INT4K:
    case QUANT_INT5K:
    case QUANT_INT5H:
    case QUANT_INT8H: return 16;
    case QUANT_INT4:
    case QUANT_INT5:
    case QUANT_INT6: return 64;
    case QUANT_INT8K: return 96;
    case QUANT_INT8KM: return 128;
    default: return 32;
    }
}

/* fp32 scales (and offsets) per column and block: d; d, m; d_lo, d_hi, m; d_lo, d_hi, m_lo, m_hi
 * (int2k's, int4k's, int5k's, int8h's and int5h's are not fp32: block_scales). */
static int scale_count(int format) {
    switch (format) {
    case QUANT_INT4:
    case QUANT_INT5:
    case QUANT_INT6: return 2;
    case QUANT_INT8K: return 3;
    case QUANT_INT8KM: return 4;
    default: return 1;
    }
}

static int64_t supers_of(int64_t nb) { return (nb + SUPER - 1) / SUPER; }

/* Bytes of a column record per block (int2k's, int4k's and int5k's past their D and M). */
static int64_t record_block_bytes(int format) {
    switch (format) {
    case QUANT_INT2K: return 2 + BLOCK / 4;
    case QUANT_INT4K: return 2 + BLOCK / 2;
    case QUANT_INT5K: return 2 + BLOCK / 2 + 4;
    case QUANT_INT4: return 8 + BLOCK / 2;
    case QUANT_INT5: return 8 + BLOCK / 2 + 4;
    case QUANT_INT6: return 8 + BLOCK / 2 + 8;
    case QUANT_INT8K: return 12 + BLOCK;
    case QUANT_INT8KM: return 16 + BLOCK;
    case QUANT_INT8H: return 2 + BLOCK;
    case QUANT_INT5H: return 2 + BLOCK / 2 + 4;
    default: return 4 + BLOCK;
    }
}

/* Bits above the nibbles per element: int5, int5k and int5h 1, int6 2 (int4 0). */
static int upper_width(int format) {
    if (format == QUANT_INT5 || format == QUANT_INT5K || format == QUANT_INT5H) return 1;
    return format == QUANT_INT6 ? 2 : 0;
}

/* Bytes of a column record (quant_formats.record_bytes) of nb blocks: int2k's, int4k's and
 * int5k's D and M per super-block, then per block sc, mc (int2k: its halves' bytes) and their
 * integers. */
static int64_t record_bytes(int format, int64_t nb) {
    return (super_scaled(format) ? 8 * supers_of(nb) : 0) + nb * record_block_bytes(format);
}

static int64_t groups_of(int64_t n) { return (n + GROUP - 1) / GROUP; }

/* Bytes of one packed group of 8 columns over nb blocks. */
static int64_t group_bytes(int format, int64_t nb) {
    const int64_t heads = super_scaled(format) ? supers_of(nb) * SUPER_HEAD : 0;
    return heads + nb * group_block_bytes(format);
}

/* Block b of a packed group, and int4k's or int5k's super-block head (D [8], M [8]) of block b. */
static inline const uint8_t *block_at(int format, const uint8_t *group, int64_t b) {
    const int64_t heads = super_scaled(format) ? (b / SUPER + 1) * SUPER_HEAD : 0;
    return group + heads + b * group_block_bytes(format);
}
static inline const float *super_head(int format, const uint8_t *group, int64_t b) {
    const int64_t super_bytes = SUPER_HEAD + SUPER * group_block_bytes(format);
    return (const float *)(group + b / SUPER * super_bytes);
}

int64_t quant_packed_bytes(int format, int64_t n, int64_t k) {
    return groups_of(n) * group_bytes(format, k / BLOCK);
}

/* Whether the format's integers are int8s (held as q + 128), not int4's nibbles and bits above. */
static inline int int8_values(int format) {
    return format == QUANT_INT8 || format == QUANT_INT8H || format == QUANT_INT8K ||
           format == QUANT_INT8KM;
}

/* Element i of a column record's block: int4 nibbles (low: elements 0-15, high: 16-31). */
static inline int record_nibble(const uint8_t *nibbles, int i) {
    return i < 16 ? nibbles[i] & 0x0F : nibbles[i - 16] >> 4;
}

/* Where quad j's upper bits lie in a packed group block: the vector (after the nibbles: from byte
 * 192, int5k's and int5h's 144) and the shift in each of its bytes. */
static inline int upper_at(int format, int j) {
    return quads_offset(format) + BLOCK * GROUP / 2 + 32 * (j / (8 / upper_width(format)));
}
static inline int upper_shift(int width, int j) { return width * (j % (8 / width)); }

/* The int8 of column c's element 4 quad + lane in a packed int8 / int8h / int8k group block
 * (held as q + 128). */
static inline int packed_int8(int format, const uint8_t *blk, int c, int quad, int lane) {
    return (int8_t)(blk[quads_offset(format) + quad * 32 + c * 4 + lane] ^ 0x80);
}

/* The integer of column c's element 4 quad + lane in a packed int2k / int4 / int5 / int6 group
 * block. */
static inline int packed_value(int format, const uint8_t *blk, int c, int quad, int lane) {
    if (format == QUANT_INT2K)
        return (blk[quads_offset(format) + (quad / 4) * 32 + c * 4 + lane] >> 2 * (quad % 4)) & 3;
    const uint8_t byte = blk[quads_offset(format) + (quad % 4) * 32 + c * 4 + lane];
    int q = quad < 4 ? byte & 0x0F : byte >> 4;
    const int width = upper_width(format);
    if (width)
        q |= ((blk[upper_at(format, quad) + c * 4 + lane] >> upper_shift(width, quad)) &
              ((1 << width) - 1))
             << 4;
    return q;
}

/* The integer of column c's element 4 quad + lane in a packed group block of any format. */
static inline int packed_integer(int format, const uint8_t *blk, int c, int quad, int lane) {
    return int8_values(format) ? packed_int8(format, blk, c, quad, lane)
                               : packed_value(format, blk, c, quad, lane);
}

/* The bits above the nibbles of one column's block, from its record (`bits`, element i's at bit
 * width * i, little-endian) into the packed layout (`dst`: the column's 4 bytes of the first
 * upper vector, the second 32 bytes on): byte t of vector v takes quads j = 8 v / width ... of
 * element 4 j + t, at bits width * (j % (8 / width)). Shifts and masks gather each byte's
 * fields (BMI2's pext would, but it is microcoded on AMD before Zen 3). */
static void pack_upper(uint8_t *dst, const uint8_t *bits, int width) {
    if (width == 1) {
        uint32_t all;
        memcpy(&all, bits, 4);
        for (int t = 0; t < 4; t++) {
            uint32_t x = (all >> t) & 0x11111111u; /* element 4 j + t's bit at 4 j */
            x = (x | x >> 3) & 0x03030303u;
            x = (x | x >> 6) & 0x000F000Fu;
            dst[t] = (uint8_t)(x | x >> 12);
        }
        return;
    }
    for (int v = 0; v < 2; v++) {
        uint32_t half; /* elements 16 v ... 16 v + 15's pairs */
        memcpy(&half, bits + 4 * v, 4);
        for (int t = 0; t < 4; t++) {
            uint32_t x = (half >> 2 * t) & 0x03030303u; /* element 4 j + t's pair at 8 j */
            x = (x | x >> 6) & 0x000F000Fu;
            dst[32 * v + t] = (uint8_t)(x | x >> 12);
        }
    }
}

/* Column c's int8s of a block into a group's quads (quads [8][8 columns][4] at dst), as
 * unsigned q + 128. */
static void pack_quads(uint8_t *dst, int c, const int8_t *q) {
    for (int j = 0; j < QUADS; j++) { /* a quad's 4 bytes at once: a Gemma head's 168 M */
        uint32_t quad_bytes;
        memcpy(&quad_bytes, q + 4 * j, 4);
        quad_bytes ^= 0x80808080u;
        memcpy(dst + j * 32 + c * 4, &quad_bytes, 4);
    }
}

/* Block b's scales of a packed group's 8 columns, as the kernel multiplies by them: d [8], then m
 * [8] (int4, int5), d_hi [8] (int6), d_hi and m (int8k) or d_hi, m_lo and m_hi (int8km, int2k);
 * int2k's, int4k's and int5k's products D * sc and M * mc (exact: an fp16's value times an
 * integer below 64); int8h's and int5h's fp16s widened, int5h's m = -16 d (exact). */
static void block_scales(int format, const uint8_t *group, int64_t b, float scales[4 * GROUP]) {
    const uint8_t *blk = block_at(format, group, b);
    if (fp16_scaled(format)) {
        for (int c = 0; c < GROUP; c++) {
            uint16_t half;
            memcpy(&half, blk + 2 * c, 2);
            scales[c] = f16_to_f32(half);
            if (format == QUANT_INT5H) scales[GROUP + c] = -16.0f * scales[c];
        }
        return;
    }
    if (format == QUANT_INT2K) {
        const float *head = super_head(format, group, b);
        for (int c = 0; c < GROUP; c++)
            for (int h = 0; h < 2; h++) {
                scales[h * GROUP + c] = head[c] * (float)(blk[h * GROUP + c] & 0x0F);
                scales[(2 + h) * GROUP + c] = head[GROUP + c] * (float)(blk[h * GROUP + c] >> 4);
            }
        return;
    }
    if (super_scaled(format)) {
        const float *head = super_head(format, group, b);
        for (int c = 0; c < GROUP; c++) {
            scales[c] = head[c] * (float)blk[c];
            scales[GROUP + c] = head[GROUP + c] * (float)blk[GROUP + c];
        }
        return;
    }
    memcpy(scales, blk, sizeof(float) * GROUP * scale_count(format));
}

/* records [n][record bytes] (quant_formats.py's column records) -> packed [groups][nb][block];
 * columns past n pack as zeros. */
void quant_pack(int format, const uint8_t *records, int64_t n, int64_t k, uint8_t *packed) {
    const int64_t nb = k / BLOCK, record = record_bytes(format, nb);
    memset(packed, 0, (size_t)quant_packed_bytes(format, n, k));
    for (int64_t g = 0; g < groups_of(n); g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *group = packed + g * group_bytes(format, nb);
            uint8_t *dst = (uint8_t *)block_at(format, group, b);
            float *scales = (float *)dst;
            for (int c = 0; c < GROUP && g * GROUP + c < n; c++) {
                const uint8_t *rec = records + (g * GROUP + c) * record;
                const uint8_t *ints;
                if (super_scaled(format)) {
                    const int64_t ns = supers_of(nb);
                    /* int4k (int5k) records are 19 (23) bytes a block: their floats unaligned */
                    float *head = (float *)super_head(format, group, b);
                    memcpy(&head[c], rec + 4 * (b / SUPER), 4);
                    memcpy(&head[GROUP + c], rec + 4 * (ns + b / SUPER), 4);
                    dst[c] = rec[8 * ns + b]; /* sc (int2k: the first half's byte) */
                    dst[GROUP + c] = rec[8 * ns + nb + b];
                    ints = rec + 8 * ns + 2 * nb;
                } else if (fp16_scaled(format)) {
                    memcpy(dst + 2 * c, rec + 2 * b, 2); /* the fp16 as it is */
                    ints = rec + 2 * nb;
                } else {
                    const int floats = scale_count(format);
                    for (int f = 0; f < floats; f++)
                        scales[f * GROUP + c] = ((const float *)rec)[f * nb + b];
                    ints = rec + nb * 4 * floats;
                }
                if (format == QUANT_INT2K) { /* int6's high bit pairs' layout */
                    pack_upper(dst + quads_offset(format) + c * 4, ints + b * BLOCK / 4, 2);
                } else if (!int8_values(format)) {
                    const uint8_t *nibbles = ints + b * (BLOCK / 2);
                    for (int j = 0; j < QUADS / 2; j++)
                        for (int t = 0; t < 4; t++)
                            dst[quads_offset(format) + j * 32 + c * 4 + t] =
                                (uint8_t)(record_nibble(nibbles, 4 * j + t) |
                                          record_nibble(nibbles, 16 + 4 * j + t) << 4);
                    if (upper_width(format)) {
                        const int width = upper_width(format), per_byte = 8 / width;
                        pack_upper(dst + upper_at(format, 0) + c * 4,
                                   ints + nb * (BLOCK / 2) + b * BLOCK / per_byte, width);
                    }
                } else {
                    pack_quads(dst + quads_offset(format), c, (const int8_t *)ints + b * BLOCK);
                }
            }
        }
}

/* Rows ids [count] of the weight quant_pack made packed [n, k] from, dequantised into out
 * [count, k] fp32: the values the GEMM multiplies by (quant_formats.dequantize's), so an embedding
 * tied to a narrow lm_head looks its rows up in the head's layout instead of keeping the records
 * a second time. Returns the index of the first id out of [0, n), or -1. Multiply, then add, as
 * dequantize does (a fused multiply-add rounds once: 1-ulp differences), whatever -ffp-contract. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
int64_t quant_unpack_rows(int format, const uint8_t *packed, int64_t n, int64_t k,
                          const int64_t *ids, int64_t count, float *out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    const int64_t nb = k / BLOCK;
    for (int64_t r = 0; r < count; r++) {
        const int64_t id = ids[r];
        if (id < 0 || id >= n) return r;
        const int c = (int)(id % GROUP);
        const uint8_t *group = packed + (id / GROUP) * group_bytes(format, nb);
        float *row = out + r * k;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *src = block_at(format, group, b);
            float scales[4 * GROUP];
            block_scales(format, group, b, scales);
            float *x = row + b * BLOCK;
            for (int i = 0; i < BLOCK; i++) {
                const int quad = i / 4, lane = i % 4, half = i / (BLOCK / 2);
                const int q = packed_integer(format, src, c, quad, lane);
                if (half_offsets(format))
                    x[i] = scales[half * GROUP + c] * (float)q + scales[(2 + half) * GROUP + c];
                else if (format == QUANT_INT8K)
                    x[i] = scales[half * GROUP + c] * (float)q + scales[2 * GROUP + c];
                else if (format == QUANT_INT6)
                    x[i] = scales[half * GROUP + c] * (float)(q - 32);
                else if (int8_values(format))
                    x[i] = scales[c] * (float)q;
                else
                    x[i] = scales[c] * (float)q + scales[GROUP + c];
            }
        }
    }
    return -1;
}

/* One block of 32 activations to int8: q = x / d rounded half to even, d = max|x| / 127; returns
 * d, and the sums of q's halves (elements 0-15, 16-31) in sums. */
static float quantize_block(const float *x, int8_t *q, int sums[2]) {
#ifdef QUANT_SIMD
    /* the same rounding as lrintf below (the current mode: half to even), 8 lanes at a time; a
       decode step's activations were quantised one element at a time while the other thread
       waited at the next barrier */
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 v[4], vmax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(v[i], magnitude));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i n[4];
    for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    for (int h = 0; h < 2; h++) {
        const __m256i half = _mm256_add_epi32(n[2 * h], n[2 * h + 1]);
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
        sums[h] = _mm_cvtsi128_si32(t4);
    }
    /* packs work per 128-bit lane: the bytes come out as dwords [n0 n1 n2 n3 | n0' n1' n2' n3']
       (unprimed: elements 0-3 of each vector, primed: 4-7), put back in order by the permute */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                             _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                                          bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return d;
#else
    float amax = 0.0f;
    for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    sums[0] = sums[1] = 0;
    for (int i = 0; i < BLOCK; i++) {
        q[i] = (int8_t)lrintf(x[i] * inv);
        sums[i / (BLOCK / 2)] += q[i];
    }
    return d;
#endif
}

static void quantize_row(const float *x, int64_t k, QuantRow row) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        int sums[2];
        row.d[b] = quantize_block(x + b * BLOCK, row.q + b * BLOCK, sums);
        row.s[b] = row.d[b] * (float)(sums[0] + sums[1]);
        row.c[3 * b] = -128 * sums[0];
        row.c[3 * b + 1] = -128 * sums[1];
        row.c[3 * b + 2] = -128 * (sums[0] + sums[1]);
    }
}

static inline int32_t quad(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#ifdef QUANT_SIMD
/* The `width` bits above the nibbles of quad j, in place above them per byte: bits width * j up
 * of each byte of `upper` (j taken modulo its 8 / width quads) moved to bit 4 and masked (16-bit
 * shifts: no bit crosses a byte on its way there). */
static inline __m256i upper_bits(__m256i upper, const int j, const int width) {
    const int at = upper_shift(width, j);
    const __m256i moved =
        at < 4 ? _mm256_slli_epi16(upper, 4 - at) : _mm256_srli_epi16(upper, at - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8((char)(((1 << width) - 1) << 4)));
}

/* acc + the sums of four u8 x s8 products per 32-bit lane (AVX2: the pairs fit int16 where
 * u <= 128 or |s| <= 127 and u <= 15, which the callers keep to). */
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#ifdef QUANT_VNNI
    return DPBUSD(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* d_lo, d_hi, m_lo, m_hi of block b's 8 columns of int8km or int2k (D * sc and M * mc: exact
 * products, the values int8km's scales would hold). */
static inline void half_scales(int format, const uint8_t *group, int64_t b, const uint8_t *blk,
                               __m256 w[4]) {
    if (format == QUANT_INT8KM) {
        for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps((const float *)blk + i * GROUP);
        return;
    }
    const float *head = super_head(format, group, b);
    for (int h = 0; h < 2; h++) {
        const __m256i bytes =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + h * GROUP)));
        const __m256i sc = _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F));
        w[h] = _mm256_mul_ps(_mm256_loadu_ps(head), _mm256_cvtepi32_ps(sc));
        w[2 + h] = _mm256_mul_ps(_mm256_loadu_ps(head + GROUP),
                                 _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)));
    }
}

/* acc + d_x (d_lo dot_lo + d_hi dot_hi + m_lo sum_lo + m_hi sum_hi): one row's block of int8km
 * or int2k from its halves' integer dots and the activations' halves' sums (all below 2^24:
 * exact as floats). int2k and int8km take the same steps, so int2k's outputs are its widened
 * weight's bit for bit. */
static inline __m256 half_offsets_acc(__m256 acc, const __m256 w[4], __m256i dot_lo,
                                      __m256i dot_hi, const QuantRow *x, int64_t b) {
    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot_lo), w[0]);
    t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_hi), w[1], t);
    t = _mm256_fmadd_ps(w[2], _mm256_set1_ps((float)half_sum(x, b, 0)), t);
    t = _mm256_fmadd_ps(w[3], _mm256_set1_ps((float)half_sum(x, b, 1)), t);
    return _mm256_fmadd_ps(t, _mm256_set1_ps(x->d[b]), acc);
}

/* Rows [0, rows) of x times one packed group (its nb blocks from `group`): out [rows][8]. */
static inline __attribute__((always_inline)) void group_rows(int format, const uint8_t *group,
                                                             int64_t nb, const QuantRow *x,
                                                             float out[ROWS][GROUP],
                                                             const int rows) {
    const int64_t gb = group_block_bytes(format); /* what each block's prefetch asks for */
    __m256 acc[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = block_at(format, group, b);
        /* the weights PREFETCH_AHEAD bytes on, asked for now: they arrive while this block
           computes (the hardware prefetcher alone left the loads waiting on memory). Into every
           cache level (T0): the non-temporal hint streamed 2-3x slower on an Intel Xeon */
        for (int64_t line = 0; line < gb; line += 64)
            __builtin_prefetch(blk + PREFETCH_AHEAD + line, 0, 3);
        __m256 wd = _mm256_setzero_ps(), w2 = wd; /* d; m, or d_hi of int6 and int8k */
        __m256 halves[4];                         /* int2k's and int8km's: half_scales */
        if (half_offsets(format)) {
            half_scales(format, group, b, blk, halves);
        } else if (super_scaled(format)) {
            /* D sc and M mc: exact products, the values int4's (int5's) scales would hold */
            const float *head = super_head(format, group, b);
            const __m256 sc = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)blk)));
            const __m256 mc = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + GROUP))));
            wd = _mm256_mul_ps(_mm256_loadu_ps(head), sc);
            w2 = _mm256_mul_ps(_mm256_loadu_ps(head + GROUP), mc);
        } else if (fp16_scaled(format)) {
            wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)); /* exact */
            /* int5h's m = -16 d (exact; int8h has none): int5's arithmetic from here, its
               outputs bit for bit (the offset taken in the integer sums instead, one multiply-add
               a row less, was 1 % slower at 16 rows on AVX2 and no faster on VNNI) */
            w2 = _mm256_mul_ps(wd, _mm256_set1_ps(-16.0f));
        } else {
            wd = _mm256_loadu_ps((const float *)blk);
            w2 = _mm256_loadu_ps((const float *)(blk + 32));
        }
        __m256i dots[ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) dots[r] = _mm256_setzero_si256();
        if (!int8_values(format)) {
            const __m256i low = _mm256_set1_epi8(0x0F);
            /* the bits above the nibbles, byte c * 4 + t for column c's element 4 j + t of quad
               j: int5's bit j; int6's bits 2 j, 2 j + 1 in the first vector for quads 0-3, in the
               second for quads 4-7; int2k's 2-bit integers the same way, without nibbles */
            __m256i upper[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            const int pairs_at = format == QUANT_INT2K ? quads_offset(format) : upper_at(format, 0);
            if (upper_width(format) || format == QUANT_INT2K)
                upper[0] = _mm256_loadu_si256((const __m256i *)(blk + pairs_at));
            if (format == QUANT_INT6 || format == QUANT_INT2K)
                upper[1] = _mm256_loadu_si256((const __m256i *)(blk + pairs_at + 32));
            /* int6 and int2k keep their halves apart (dots: d_lo's quads 0-3, high: d_hi's 4-7),
               int6's each starting at -32 sum(q_x) of its half: the integers' offset of 32 */
            __m256i high[ROWS];
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) high[r] = _mm256_setzero_si256();
            if (format == QUANT_INT6) {
#pragma GCC unroll 4
                for (int r = 0; r < rows; r++) {
                    dots[r] = _mm256_set1_epi32(x[r].c[3 * b] / 4);
                    high[r] = _mm256_set1_epi32(x[r].c[3 * b + 1] / 4);
                }
            }
#ifndef QUANT_VNNI
            __m256i pairs[ROWS], pairs_high[ROWS];
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) pairs[r] = pairs_high[r] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 4
            for (int j = 0; j < QUADS / 2; j++) {
                __m256i lo, hi;
                if (format == QUANT_INT2K) {
                    const __m256i three = _mm256_set1_epi8(3);
                    lo = _mm256_and_si256(_mm256_srli_epi16(upper[0], 2 * j), three);
                    hi = _mm256_and_si256(_mm256_srli_epi16(upper[1], 2 * j), three);
                } else {
                    const __m256i v =
                        _mm256_loadu_si256((const __m256i *)(blk + quads_offset(format) + 32 * j));
                    lo = _mm256_and_si256(v, low);
                    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                if (upper_width(format) == 1) {
                    lo = _mm256_or_si256(lo, upper_bits(upper[0], j, 1));
                    hi = _mm256_or_si256(hi, upper_bits(upper[0], j + QUADS / 2, 1));
                } else if (format == QUANT_INT6) {
                    lo = _mm256_or_si256(lo, upper_bits(upper[0], j, 2));
                    hi = _mm256_or_si256(hi, upper_bits(upper[1], j, 2));
                }
#pragma GCC unroll 4
                for (int r = 0; r < rows; r++) {
                    const int8_t *xq = x[r].q + b * BLOCK;
                    const __m256i x_lo = _mm256_set1_epi32(quad(xq + 4 * j));
                    const __m256i x_hi = _mm256_set1_epi32(quad(xq + 16 + 4 * j));
#ifdef QUANT_VNNI
                    dots[r] = dot4(dots[r], lo, x_lo);
                    if (halves_apart(format))
                        high[r] = dot4(high[r], hi, x_hi);
                    else
                        dots[r] = dot4(dots[r], hi, x_hi);
#else
                    /* pair sums in 16 bits, each at most 2 * 3 * 128 (int2k), 2 * 15 * 128
                       (int4), 2 * 31 * 128 (int5) or 2 * 63 * 128 (int6) in magnitude: int4's 8
                       of a block add up to 30720 < 2^15 (int2k's 4 per half to 3072), so one
                       vpmaddwd per block widens them instead of one per pair (half the
                       multiplies); int5's and int6's one per 4 and per 2 */
                    pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, x_lo));
                    __m256i *hi_pairs = halves_apart(format) ? &pairs_high[r] : &pairs[r];
                    *hi_pairs = _mm256_add_epi16(*hi_pairs, _mm256_maddubs_epi16(hi, x_hi));
                    const int once = format == QUANT_INT4 || format == QUANT_INT2K;
                    if (once ? j == QUADS / 2 - 1 : j % 2 == 1) {
                        const __m256i ones = _mm256_set1_epi16(1);
                        dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(pairs[r], ones));
                        pairs[r] = _mm256_setzero_si256();
                        if (halves_apart(format)) {
                            high[r] = _mm256_add_epi32(high[r],
                                                       _mm256_madd_epi16(pairs_high[r], ones));
                            pairs_high[r] = _mm256_setzero_si256();
                        }
                    }
#endif
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                if (format == QUANT_INT2K) {
                    acc[r] = half_offsets_acc(acc[r], halves, dots[r], high[r], &x[r], b);
                } else if (format == QUANT_INT6) {
                    /* each half's dot within 16 * 63 * 127 < 2^24: exact as a float */
                    const __m256 low_dot = _mm256_mul_ps(_mm256_cvtepi32_ps(dots[r]), wd);
                    const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high[r]), w2, low_dot);
                    acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(x[r].d[b]), acc[r]);
                } else {
                    const __m256 scale = _mm256_mul_ps(wd, _mm256_set1_ps(x[r].d[b]));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), scale, acc[r]);
                    acc[r] = _mm256_fmadd_ps(w2, _mm256_set1_ps(x[r].s[b]), acc[r]);
                }
            }
            continue;
        }
        /* int8, int8h, int8k and int8km: their int8 quads in one loop (with the format and j
           constants, the half's choice folds away); int8k's and int8km's halves apart (dots:
           d_lo's, high: d_hi's) */
        const uint8_t *quads = blk + quads_offset(format);
        __m256i high[ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) high[r] = _mm256_setzero_si256();
#ifdef QUANT_VNNI
        /* the sums start at minus the activations' correction, a broadcast instead of a
           subtraction per row (QuantRow.c) */
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const int32_t *c = x[r].c + 3 * b;
            if (halves_apart(format)) {
                dots[r] = _mm256_set1_epi32(c[0]);
                high[r] = _mm256_set1_epi32(c[1]);
            } else {
                dots[r] = _mm256_set1_epi32(c[2]);
            }
        }
#endif
#pragma GCC unroll 8
        for (int j = 0; j < QUADS; j++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(quads + 32 * j));
            /* w stays in a register: with the format a constant gcc folded this load into each
               row's vpdpbusd, and 4 loads of it per quad made the loads the bottleneck (int8 20%
               slower at 16 rows) */
            __asm__("" : "+x"(w));
            const int in_high = halves_apart(format) && j >= QUADS / 2;
#ifdef QUANT_VNNI
            /* (q_w + 128) q_x, on sums that started at -128 sum(q_x): exact in 32 bits */
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                const __m256i xq = _mm256_set1_epi32(quad(x[r].q + b * BLOCK + 4 * j));
                if (in_high)
                    high[r] = dot4(high[r], w, xq);
                else
                    dots[r] = dot4(dots[r], w, xq);
            }
#else
            /* |q_w| (q_x sign(q_w)), q_w signed again: -128 reads as 128 unsigned, still right */
            const __m256i signed_w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
            const __m256i magnitude = _mm256_abs_epi8(signed_w);
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                const __m256i xq = _mm256_set1_epi32(quad(x[r].q + b * BLOCK + 4 * j));
                if (in_high)
                    high[r] = dot4(high[r], magnitude, _mm256_sign_epi8(xq, signed_w));
                else
                    dots[r] = dot4(dots[r], magnitude, _mm256_sign_epi8(xq, signed_w));
            }
#endif
        }
        if (format == QUANT_INT8KM) {
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++)
                acc[r] = half_offsets_acc(acc[r], halves, dots[r], high[r], &x[r], b);
            continue;
        }
        if (format == QUANT_INT8K) {
            /* each half's dot now within 16 * 128 * 127 < 2^24: exact as a float */
            const __m256 wm = _mm256_loadu_ps((const float *)(blk + 64));
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high[r]), w2,
                                                   _mm256_mul_ps(_mm256_cvtepi32_ps(dots[r]), wd));
                acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(x[r].d[b]), acc[r]);
                acc[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(x[r].s[b]), acc[r]);
            }
            continue;
        }
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const __m256 scale = _mm256_mul_ps(wd, _mm256_set1_ps(x[r].d[b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), scale, acc[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(out[r], acc[r]);
}
#else
/* The integer dots of column c's halves of a packed block (int6's integers less 32) with a row's
 * int8s xq: halves [2]. */
static void half_dots(int format, const uint8_t *blk, int c, const int8_t *xq, int halves[2]) {
    const int offset = format == QUANT_INT6 ? 32 : 0;
    halves[0] = halves[1] = 0;
    for (int i = 0; i < BLOCK; i++)
        halves[i / (BLOCK / 2)] += (packed_integer(format, blk, c, i / 4, i % 4) - offset) * xq[i];
}

static void group_rows(int format, const uint8_t *group, int64_t nb, const QuantRow *x,
                       float out[ROWS][GROUP], const int rows) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < GROUP; c++) out[r][c] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = block_at(format, group, b);
        float wd[4 * GROUP];
        block_scales(format, group, b, wd);
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = x[r].q + b * BLOCK;
            for (int c = 0; c < GROUP; c++) {
                int dot = 0;
                if (half_offsets(format)) { /* int2k, int8km: half_offsets_acc's steps */
                    int halves[2];
                    half_dots(format, blk, c, xq, halves);
                    const float t = (float)halves[0] * wd[c] + (float)halves[1] * wd[GROUP + c] +
                                    wd[2 * GROUP + c] * (float)half_sum(&x[r], b, 0) +
                                    wd[3 * GROUP + c] * (float)half_sum(&x[r], b, 1);
                    out[r][c] += t * x[r].d[b];
                    continue;
                }
                if (!int8_values(format) && format != QUANT_INT6) { /* int4, int5 (k, h): d q + m */
                    for (int i = 0; i < BLOCK; i++)
                        dot += packed_value(format, blk, c, i / 4, i % 4) * xq[i];
                    out[r][c] += wd[GROUP + c] * x[r].s[b];
                } else if (format == QUANT_INT6 || format == QUANT_INT8K) {
                    int halves[2];
                    half_dots(format, blk, c, xq, halves);
                    dot = halves[0];
                    const float offset = format == QUANT_INT8K ? wd[2 * GROUP + c] * x[r].s[b] : 0.0f;
                    out[r][c] += offset + wd[GROUP + c] * x[r].d[b] * (float)halves[1];
                } else {
                    for (int i = 0; i < BLOCK; i++)
                        dot += packed_int8(format, blk, c, i / 4, i % 4) * xq[i];
                }
                out[r][c] += wd[c] * x[r].d[b] * (float)dot;
            }
        }
    }
}
#endif


/* Rows [r0, r0 + rows) of x times group g of w: out [rows][8], without the bias. */
static inline __attribute__((always_inline)) void format_rows(const int format,
                                                              const uint8_t *group, int64_t nb,
                                                              const QuantRow *x, int rows,
                                                              float out[ROWS][GROUP]) {
    switch (rows) { /* the row count a constant in each copy */
    case 4: group_rows(format, group, nb, x, out, 4); break;
    case 3: group_rows(format, group, nb, x, out, 3); break;
    case 2: group_rows(format, group, nb, x, out, 2); break;
    default: group_rows(format, group, nb, x, out, 1); break;
    }
}

static void group_out(const NarrowLinear *w, int64_t g, const QuantRow *x, int64_t r0, int rows,
                      float out[ROWS][GROUP]) {
    const int64_t nb = w->k / BLOCK;
    const uint8_t *group = w->packed + g * group_bytes(w->format, nb);
    /* the format a constant in each copy too: each format's block loop compiled for it alone
       (at 16 rows int4 ran 8% faster on Zen 4, int8 14% with the register hint in group_rows) */
    switch (w->format) {
    case QUANT_INT4: format_rows(QUANT_INT4, group, nb, x + r0, rows, out); break;
    case QUANT_INT5: format_rows(QUANT_INT5, group, nb, x + r0, rows, out); break;
    case QUANT_INT6: format_rows(QUANT_INT6, group, nb, x + r0, rows, out); break;
    case QUANT_INT4K: format_rows(QUANT_INT4K, group, nb, x + r0, rows, out); break;
    case QUANT_INT5K: format_rows(QUANT_INT5K, group, nb, x + r0, rows, out); break;
    case QUANT_INT5H: format_rows(QUANT_INT5H, group, nb, x + r0, rows, out); break;
    case QUANT_INT8K: format_rows(QUANT_INT8K, group, nb, x + r0, rows, out); break;
    case QUANT_INT8KM: format_rows(QUANT_INT8KM, group, nb, x + r0, rows, out); break;
    case QUANT_INT2K: format_rows(QUANT_INT2K, group, nb, x + r0, rows, out); break;
    case QUANT_INT8H: format_rows(QUANT_INT8H, group, nb, x + r0, rows, out); break;
    default: format_rows(QUANT_INT8, group, nb, x + r0, rows, out); break;
    }
}

static inline int row_chunk(int64_t m, int64_t r0) { return m - r0 < ROWS ? (int)(m - r0) : ROWS; }

static inline float bias_of(const NarrowLinear *w, int64_t c) {
    return w->bias ? w->bias[c] : 0.0f;
}

/* Groups [g0, g1) of w for every row into y [m, n]. */
static void group_tile(const NarrowLinear *w, int64_t g0, int64_t g1, const QuantRow *x,
                       int64_t m, float *y) {
    for (int64_t g = g0; g < g1; g++)
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            float out[ROWS][GROUP];
            const int rows = row_chunk(m, r0);
            group_out(w, g, x, r0, rows, out);
            const int64_t c0 = g * GROUP, width = w->n - c0 < GROUP ? w->n - c0 : GROUP;
            for (int r = 0; r < rows; r++)
                for (int64_t c = 0; c < width; c++)
                    y[(r0 + r) * w->n + c0 + c] = out[r][c] + bias_of(w, c0 + c);
        }
}

/* Gate groups [g0, g1) of a [gate; up] weight (n = 2 width, width % 8 == 0) for every row:
 * act [m, width] = activation(gate) * up, the up half's group g + width / 8 beside gate group g.
 * Inlined per activation (gelu_tanh constant), so each epilogue's loop vectorises. */
static inline __attribute__((always_inline)) void gated_tile(const NarrowLinear *w, int64_t g0,
                                                             int64_t g1, const QuantRow *x,
                                                             int64_t m, float *act,
                                                             const int gelu) {
    const int64_t width = w->n / 2, up_groups = width / GROUP;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            float gate[ROWS][GROUP], up[ROWS][GROUP];
            const int rows = row_chunk(m, r0);
            group_out(w, g, x, r0, rows, gate);
            group_out(w, g + up_groups, x, r0, rows, up);
            const int64_t c0 = g * GROUP;
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < GROUP; c++) {
                    const float z = gate[r][c] + bias_of(w, c0 + c);
                    act[(r0 + r) * width + c0 + c] =
                        (gelu ? gelu_tanh(z) : silu(z)) * (up[r][c] + bias_of(w, width + c0 + c));
                }
        }
}

/* The tiles of groups [0, groups) of GROUPS_PER_TILE each, shared over the calling team; gated:
 * gated_tile's with `activation` (an ACT_ code), over the gate half's groups. Guided: each thread
 * takes long runs of consecutive tiles, one sequential stream of weights, and the shrinking last
 * runs even out a late thread. Tiles handed out one by one (dynamic) interleaved the threads
 * every ~7 KB, which broke both streams: 2 threads then read slower than 1
 * (docs/PERFORMANCE.md#narrow-weights). */
static void shared_tiles(const NarrowLinear *w, const QuantRow *x, int64_t m, float *y,
                         int gated, int activation) {
    const int64_t groups = gated ? w->n / 2 / GROUP : groups_of(w->n);
    const int64_t tiles = (groups + GROUPS_PER_TILE - 1) / GROUPS_PER_TILE;
#pragma omp for schedule(guided) nowait
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t g0 = t * GROUPS_PER_TILE;
        const int64_t g1 = g0 + GROUPS_PER_TILE < groups ? g0 + GROUPS_PER_TILE : groups;
        if (gated && activation == ACT_GELU_TANH)
            gated_tile(w, g0, g1, x, m, y, 1);
        else if (gated)
            gated_tile(w, g0, g1, x, m, y, 0);
        else
            group_tile(w, g0, g1, x, m, y);
    }
}

void quant_gemm_shared(const NarrowLinear *w, const QuantRow *rows, int64_t m, float *y) {
    shared_tiles(w, rows, m, y, 0, ACT_SILU);
}

void quant_gated_shared(const NarrowLinear *gate_up, const QuantRow *rows, int64_t m, float *act,
                        int activation) {
    shared_tiles(gate_up, rows, m, act, 1, activation);
}

QuantRow *quant_rows_alloc(int64_t m, int64_t k) {
    const int64_t nb = k / BLOCK;
    /* the rows, then d and s [m, nb] floats each, c [m, 3 nb] int32, then q [m, k] bytes */
    const size_t head = (size_t)m * sizeof(QuantRow);
    const size_t words = (size_t)(5 * m * nb) * 4;
    QuantRow *rows = malloc(head + words + (size_t)(m * k));
    if (rows == NULL) return NULL;
    float *scales = (float *)((char *)rows + head);
    int32_t *sums = (int32_t *)(scales + 2 * m * nb);
    int8_t *bytes = (int8_t *)(sums + 3 * m * nb);
    for (int64_t r = 0; r < m; r++)
        rows[r] = (QuantRow){bytes + r * k, scales + r * nb, scales + (m + r) * nb,
                             sums + 3 * r * nb};
    return rows;
}

void quant_rows_fill(const float *x, int64_t m, int64_t k, QuantRow *rows, int64_t first,
                     int64_t step) {
    for (int64_t r = first; r < m; r += step) quantize_row(x + r * k, k, rows[r]);
}

/* y [m, n] = x [m, k] . W^T (+ bias [n] when given), W packed by quant_pack for k inputs
 * (k % 32 == 0), on nthreads threads. Returns 0, or -1 when out of memory or k is not a multiple
 * of the block. */
int quant_gemm(int format, const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n,
               const float *bias, float *y, int nthreads) {
    if (k % BLOCK || m <= 0) return m == 0 ? 0 : -1;
    QuantRow *rows = quant_rows_alloc(m, k);
    if (rows == NULL) return -1;
    const NarrowLinear w = {format, packed, n, k, bias};
    const int64_t tiles = (groups_of(n) + GROUPS_PER_TILE - 1) / GROUPS_PER_TILE;
    /* decode-sized inputs are quantised by the caller's thread before the team starts: a barrier
       between the two loops cost more than the work (the team's threads sleep in between) */
    const int serial_quantize = m * k <= SERIAL_QUANTIZE;
    if (serial_quantize) quant_rows_fill(x, m, k, rows, 0, 1);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && tiles > 1)
    {
        if (!serial_quantize) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) quantize_row(x + r * k, k, rows[r]);
        }
        quant_gemm_shared(&w, rows, m, y);
    }
    free(rows);
    return 0;
}
