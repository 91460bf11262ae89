/* exo-tui's ONNX Runtime custom op: y = x @ w.T for a 4-, 5- or 8-bit affine-quantized w in GGUF's
   blocks, regrouped in tiles of 32 output columns.

   Op "QLinear" in domain "exo.tui". Inputs: X float32 (..., K); W uint8 (ceil(N / 32), K / 32, B):
   tiles of 32 output columns, each one B-byte tile block per 32 weights of its columns: the 32
   scales s, the 32 biases b (float16), then the codes q, a line of 32 bytes (one per column) per k:
     bits 4, B = 640: 16 lines, the low nibble of byte c of line j being the code of (k = j, c) and
                      the high nibble that of (k = j + 16, c) (GGUF's Q4_1 blocks, transposed;
                      Q4_0 is b = -8 s);
     bits 8, B = 1152: 32 lines (GGUF's Q8_0 is q = its signed code + 128, b = -128 s);
     bits 5, B = 768: the codes' low 4 bits in bits 4's 16 lines, then a plane of 128 bytes of
                      their bit 4, as a Q5_K block's (see FMT_Q4K) (GGUF's Q5_1 blocks; Q5_0 is
                      b = -16 s);
   or, with attribute kquant 4, 5 or 6, GGUF's Q4_K, Q5_K or Q6_K: W uint8 (ceil(N / 32), K / 256,
   B), a tile's super-blocks of 256 weights: float16 d (and dmin) and the small integer scales (and
   mins) of its columns, then the codes as above (their bits above the fourth in planes): see FMT_Q4K.
   Columns past N in the last tile are padding. Attributes K, N, bits and xbits (0: X as it is, the
   float32 precision; 16 or 8: X rounded to integer codes, the int16 and int8 precisions, on builds
   with integer products, W's codes in their own layouts, below). Output Y float32 (..., N):

       y[m, n] = sum over k of x[m, k] * (s * q[n, k] + b)      (float32, as the dequantized matrix)

   Each row of X is reduced in the same order whatever the number of rows, so a request's logits
   do not depend on the batch it ran in. Tiles are the tasks of the session's intra-op thread
   pool; a tile's codes are widened to float32 once for up to 8 rows, vectors running along its
   columns, so every product is one multiply-add and there is nothing to reduce across lanes.

   It talks to ONNX Runtime through the part of its C API declared in ort.h. */

#include <string.h>

#include "half.h"
#include "ort.h"
#include "qlinear.h"

#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX512 1
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QL_INT 1 /* integer products for the int16 and int8 precisions: VPDPWSSD and VPDPBUSD */
#define QL_INT_VNNI 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
#define QL_INT 1 /* integer products: VPMADDWD, and VPMADDUBSW for int8 (VPDPBUSD's sums exactly) */
#define QL_INT_AVX2 1
#endif

/* ------------------------------------------------------------------ the kernel */

#define BLOCK 32
#define TILE 32 /* output columns per tile: one task of the thread pool */
#define ROWS 8  /* rows of X per pass over a tile */

/* The tile formats. GGUF's blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) carry their float16 scale
   and bias in each tile block (above). The K-quants' super-blocks of 256 weights keep what the
   file has: per tile (32 columns) and super-block, a header, then its 8 blocks of 32 codes, their
   low 4 bits in the 4-bit lines of the precision (as Q4_0's), then for Q5_K one and for Q6_K two
   planes of 128 bytes of their higher bits (bit 4, then bit 5), one bit a code (Q5_0's and Q5_1's
   codes are a Q5_K block's, so one code path serves both):
     Q4_K, Q5_K (header 640 bytes): the 32 columns' float16 d, their float16 dmin, then per block
               j the 32 columns' 6-bit scales sc (a byte each, 8 x 32), then their mins m (8 x 32):
               the block's weights are (d sc) q - (dmin m), scale and bias computed here in float32,
               exactly (an 11-bit significand times a 6-bit integer), as llama.cpp computes them;
     Q6_K (header 576 bytes): the columns' float16 d, then per group of 16 (two to a block: k < 16
               in the lines' low nibbles, k >= 16 in the high) the columns' int8 scales sc (16 x 32):
               weights (d sc) (q - 32); the integer products take the 32 out in integers.
   A plane is masks laid out for the lanes the precision's lines widen to (the float32 lines': per
   line j two 32-bit words, bit c the code (k = j, c), then (j + 16, c); the others' at their tile
   functions; _bit_plane in __init__.py writes them). A tile of Q4_K is 4736 bytes per 32 x 256
   weights (4.625 bits a weight, the file's 4.5), Q5_K 5760 (5.625, the file's 5.5), Q6_K 6720
   (6.5625, the file's); one of Q5_0 or Q5_1 768 bytes per 32 x 32 (6 bits a weight, the file's
   5.5 and 6). */
#define FMT_Q4 0  /* GGUF's Q4_0 and Q4_1 */
#define FMT_Q8 1  /* Q8_0 */
#define FMT_Q4K 2
#define FMT_Q5K 3
#define FMT_Q6K 4
#define FMT_Q5 5  /* Q5_0 and Q5_1 (after the K-quants: the formats' numbers index the tile functions' tables) */
#define IS_K(f) ((f) == FMT_Q4K || (f) == FMT_Q5K || (f) == FMT_Q6K)
#define CODE_BITS(f) ((f) == FMT_Q8 ? 8 : 4) /* the lines' width (5- and 6-bit codes: their low 4 bits) */
#define PLANES(f) ((f) == FMT_Q5 || (f) == FMT_Q5K ? 1 : (f) == FMT_Q6K ? 2 : 0) /* planes of the codes' bits 4
                                                                                    (and 5) after the lines */
#define CODE_BYTES(f) (CODE_BITS(f) == 4 ? 512 + 128 * PLANES(f) : 1024) /* 32 columns x 32 weights */
#define TILE_BLOCK_BYTES(f) (128 + CODE_BYTES(f)) /* a block of 32 of a format not K-quant's: its scales, biases
                                                     and codes (Q4 640, Q5 768, Q8 1152 bytes) */
#define K_HEADER(f) ((f) == FMT_Q6K ? 576 : 640)
#define SUPER_BYTES(f) (K_HEADER(f) + 8 * CODE_BYTES(f))
#define HALVES(f) ((f) == FMT_Q6K ? 2 : 1) /* scales per block of 32: Q6_K's groups are 16, k < 16 in the
                                               lines' low nibbles, k >= 16 in the high */

/* The format of bits (4, 5 or 8) and kquant (0, or 4, 5, 6 for Q4_K, Q5_K, Q6_K); -1 if none. */
static int format_of(int64_t bits, int64_t kquant)
{
    if (kquant == 0)
        return bits == 4 ? FMT_Q4 : bits == 5 ? FMT_Q5 : bits == 8 ? FMT_Q8 : -1;
    return kquant == 4 ? FMT_Q4K : kquant == 5 ? FMT_Q5K : kquant == 6 ? FMT_Q6K : -1;
}

/* A tile's bytes for nb blocks of 32 along K. */
static inline int64_t tile_bytes(int fmt, int64_t nb)
{
    return IS_K(fmt) ? nb / 8 * SUPER_BYTES(fmt) : nb * TILE_BLOCK_BYTES(fmt);
}

/* Block b's codes in the tile at w. */
static inline __attribute__((always_inline)) const uint8_t *block_codes(const uint8_t *w, int64_t b, const int fmt)
{
    if (!IS_K(fmt))
        return w + b * TILE_BLOCK_BYTES(fmt) + 128;
    return w + (b >> 3) * SUPER_BYTES(fmt) + K_HEADER(fmt) + (b & 7) * CODE_BYTES(fmt);
}

/* Block b's stretch of its tile, the tile's bytes over its blocks (a K-quant super-block's header
   shared out over its 8 blocks). */
static inline int64_t block_stride(const int fmt)
{
    return IS_K(fmt) ? SUPER_BYTES(fmt) / 8 : TILE_BLOCK_BYTES(fmt);
}

#define PREFETCH_BYTES 3072 /* how far ahead of a tile's block its stream is fetched */

/* At each block of a tile (w), the tile's bytes PREFETCH_BYTES ahead of the block into the cache,
   block_stride at a time, so that the blocks' fetches cover the tile's bytes once: a decode step
   reads every matrix from memory once, and at one row a tile's products are too quick for the
   hardware prefetchers, which start over at each 4 KB page and each tile. Measured on a Zen 5 VM
   (2 cores, 75 GB/s to read): the 1B-shape Q4_K_M file's decode from 39 to 61 tok/s at the int16
   precision (llama.cpp's 52); 2048 to 4096 bytes ahead did alike, 1024 less. And at a
   super-block's first block its header, which lies before the codes and is read after the first
   block's, where the prefetchers following the codes forward do not fetch it (without this a Q4_K
   tile at the int16 precision took 2-3 times a Q4_1 tile's). */
static inline __attribute__((always_inline)) void prefetch(const uint8_t *w, int64_t b, const int fmt)
{
#if defined(QL_AVX512) || defined(QL_AVX2)
    const uint8_t *ahead = w + b * block_stride(fmt) + PREFETCH_BYTES;
    for (int64_t l = 0; l < block_stride(fmt); l += 64)
        _mm_prefetch((const char *)(ahead + l), _MM_HINT_T0);
    if (IS_K(fmt) && (b & 7) == 0) {
        const uint8_t *sb = w + (b >> 3) * SUPER_BYTES(fmt);
        for (int l = 0; l < K_HEADER(fmt) / 64; l++)
            _mm_prefetch((const char *)(sb + 64 * l), _MM_HINT_T0);
    }
#else
    (void)w, (void)b, (void)fmt;
#endif
}

/* Column col's scale and bias in group h (0, or 1 for Q6_K's second 16) of block b. */
static inline __attribute__((always_inline)) void scale1(const uint8_t *w, int64_t b, const int fmt, int col, int h,
                                                          float *s, float *c)
{
    uint16_t hd, hm;
    if (!IS_K(fmt)) {
        const uint8_t *wb = w + b * TILE_BLOCK_BYTES(fmt);
        memcpy(&hd, wb + 2 * col, 2);
        memcpy(&hm, wb + 64 + 2 * col, 2);
        *s = half_to_float(hd);
        *c = half_to_float(hm);
        return;
    }
    const uint8_t *sb = w + (b >> 3) * SUPER_BYTES(fmt);
    const int j = (int)(b & 7);
    memcpy(&hd, sb + 2 * col, 2);
    if (fmt == FMT_Q6K) {
        *s = half_to_float(hd) * (float)(int8_t)sb[64 + 32 * (2 * j + h) + col];
        *c = -32.0f * *s;
    } else {
        memcpy(&hm, sb + 64 + 2 * col, 2);
        *s = half_to_float(hd) * (float)sb[128 + 32 * j + col];
        *c = -half_to_float(hm) * (float)sb[384 + 32 * j + col];
    }
}

#if defined(QL_AVX512)
/* Columns col0 to col0 + 15's scales and biases in group h of block b. */
static inline __attribute__((always_inline)) void scales16(const uint8_t *w, int64_t b, const int fmt, int col0, int h,
                                                            __m512 *s, __m512 *c)
{
    if (!IS_K(fmt)) {
        const uint8_t *wb = w + b * TILE_BLOCK_BYTES(fmt);
        *s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 2 * col0)));
        *c = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 64 + 2 * col0)));
        return;
    }
    const uint8_t *sb = w + (b >> 3) * SUPER_BYTES(fmt);
    const int j = (int)(b & 7);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 2 * col0)));
    if (fmt == FMT_Q6K) {
        const __m128i sc = _mm_loadu_si128((const __m128i *)(sb + 64 + 32 * (2 * j + h) + col0));
        *s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        *c = _mm512_mul_ps(*s, _mm512_set1_ps(-32.0f));
    } else {
        const __m512 dm = _mm512_castsi512_ps(_mm512_xor_si512( /* -dmin: its sign flipped, off the multipliers */
            _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 64 + 2 * col0)))),
            _mm512_set1_epi32((int)0x80000000u)));
        const __m128i sc = _mm_loadu_si128((const __m128i *)(sb + 128 + 32 * j + col0));
        const __m128i m = _mm_loadu_si128((const __m128i *)(sb + 384 + 32 * j + col0));
        *s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
        *c = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)));
    }
}

/* Each row's sums of a tile's 32 columns (a0: columns 0-15, a1: 16-31) to its row of Y, the
   columns below cols only. */
static inline __attribute__((always_inline)) void store_tile(float *y, int64_t ldy, int cols, const int rows,
                                                              const __m512 *a0, const __m512 *a1)
{
    const __mmask16 m0 = (__mmask16)(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
    const __mmask16 m1 = (__mmask16)(cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1);
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, m0, a0[r]);
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, a1[r]);
    }
}
#elif defined(QL_AVX2)
/* Columns col0 to col0 + 7's scales and biases in group h of block b. */
static inline __attribute__((always_inline)) void scales8(const uint8_t *w, int64_t b, const int fmt, int col0, int h,
                                                           __m256 *s, __m256 *c)
{
    if (!IS_K(fmt)) {
        const uint8_t *wb = w + b * TILE_BLOCK_BYTES(fmt);
        *s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 2 * col0)));
        *c = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 64 + 2 * col0)));
        return;
    }
    const uint8_t *sb = w + (b >> 3) * SUPER_BYTES(fmt);
    const int j = (int)(b & 7);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 2 * col0)));
    if (fmt == FMT_Q6K) {
        const __m128i sc = _mm_loadl_epi64((const __m128i *)(sb + 64 + 32 * (2 * j + h) + col0));
        *s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        *c = _mm256_mul_ps(*s, _mm256_set1_ps(-32.0f));
    } else {
        const __m256 dm = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 64 + 2 * col0))),
                                        _mm256_set1_ps(-0.0f)); /* -dmin */
        const __m128i sc = _mm_loadl_epi64((const __m128i *)(sb + 128 + 32 * j + col0));
        const __m128i m = _mm_loadl_epi64((const __m128i *)(sb + 384 + 32 * j + col0));
        *s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
        *c = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)));
    }
}

/* Bits 0-7 of bits as 8 int32 lanes of 1 << shift (set) or 0: a plane's bits of 8 columns. */
static inline __m256i plane8(uint32_t bits, int shift)
{
    const __m256i lanes = _mm256_srlv_epi32(_mm256_set1_epi32((int)bits), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_slli_epi32(_mm256_and_si256(lanes, _mm256_set1_epi32(1)), shift);
}

/* The same for 32 byte lanes (bits 0-31) and for 16 16-bit lanes (bits 0-15). */
static inline __m256i plane32(uint32_t bits, int shift)
{
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                          _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i pick = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b, pick), pick), _mm256_set1_epi8((char)(1 << shift)));
}

static inline __m256i plane16(uint32_t bits, int shift)
{
    const __m256i pick = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, (short)32768);
    const __m256i b = _mm256_and_si256(_mm256_set1_epi16((short)bits), pick);
    return _mm256_and_si256(_mm256_cmpeq_epi16(b, pick), _mm256_set1_epi16((short)(1 << shift)));
}

/* Q6_K's two planes at once: 16 16-bit lanes of 16 (bit i of the 16 bits at m) plus 32 (bit i of
   the 16 bits at m + 128, the next plane): each lane's two bits in its two bytes, then summed. */
static inline __m256i planes16(const uint8_t *m)
{
    uint16_t p4, p5;
    memcpy(&p4, m, 2);
    memcpy(&p5, m + 128, 2);
    const __m256i both = _mm256_set1_epi32((int)(p4 | (uint32_t)p5 << 16)); /* bytes: p4's low, high, p5's low, high */
    const __m256i bytes = _mm256_shuffle_epi8(both, _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,
                                                                     1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3));
    const __m256i pick = _mm256_setr_epi8(1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, (char)128, (char)128,
                                          1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, (char)128, (char)128);
    const __m256i set = _mm256_min_epu8(_mm256_and_si256(bytes, pick), _mm256_set1_epi8(1)); /* 0 or 1 a byte */
    return _mm256_maddubs_epi16(set, _mm256_set1_epi16(32 << 8 | 16));
}
#endif

/* y[r * ldy + c] = x[r] . w[c] for rows r < rows (rows <= ROWS) and the tile's columns c < cols.
   A block's codes are a line per k: for 4 bits 16 lines of 32 bytes, the low nibble of byte c
   being the code of (k, c) and the high nibble that of (k + 16, c); for 8 bits 32 lines of 32
   bytes. Vectors run along the columns, so every product of the block is one multiply-add into a
   column's sum, in the order k = 0, 16, 1, 17, ... for 4 bits and 0, 1, 2, ... for 8: the same
   order whatever the number of rows. */
static inline __attribute__((always_inline)) void tile_rows(const float *x, int64_t k, const uint8_t *w, int64_t nb,
                                                             float *y, int64_t ldy, int cols, const int rows,
                                                             const int fmt)
{
#if defined(QL_AVX512)
    const __m512i low = _mm512_set1_epi32(0x0F);
    __m512 a0[ROWS], a1[ROWS]; /* columns 0-15 and 16-31 */
    for (int r = 0; r < rows; r++)
        a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch(w, b, fmt);
        const uint8_t *q = block_codes(w, b, fmt);
        const float *xb = x + b * BLOCK;
        __m512 s0, s1, c0, c1;
        if (CODE_BITS(fmt) == 4) {
            scales16(w, b, fmt, 0, 0, &s0, &c0);
            scales16(w, b, fmt, 16, 0, &s1, &c1);
            __m512 t0 = s0, t1 = s1, e0 = c0, e1 = c1; /* the high nibbles' (k + 16): Q6_K's second group */
            if (HALVES(fmt) == 2) {
                scales16(w, b, fmt, 0, 1, &t0, &e0);
                scales16(w, b, fmt, 16, 1, &t1, &e1);
            }
            for (int j = 0; j < 16; j++, q += 32) {
                __m512i l0, l1, h0, h1;
#if defined(__AVX512BW__)
                if (PLANES(fmt)) { /* the bits added to the line's 64 codes as bytes, then widened */
                    const __m256i v = _mm256_loadu_si256((const __m256i *)q), nib = _mm256_set1_epi8(0x0F);
                    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, nib)),
                                                      _mm256_and_si256(_mm256_srli_epi16(v, 4), nib), 1);
                    for (int p = 0; p < PLANES(fmt); p++) { /* line j's two words as one mask: k = j, then j + 16 */
                        uint64_t m;
                        memcpy(&m, q - 32 * j + 512 + 128 * p + 8 * j, 8);
                        both = _mm512_mask_add_epi8(both, (__mmask64)m, both, _mm512_set1_epi8((char)(16 << p)));
                    }
                    l0 = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(both));
                    l1 = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(both, 1));
                    h0 = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(both, 2));
                    h1 = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(both, 3));
                } else
#endif
                {
                    const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
                    const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
                    l0 = _mm512_and_si512(q0, low), l1 = _mm512_and_si512(q1, low);
                    h0 = _mm512_srli_epi32(q0, 4), h1 = _mm512_srli_epi32(q1, 4);
                    for (int p = 0; p < PLANES(fmt); p++) {
                        uint32_t m[2];
                        memcpy(m, q - 32 * j + 512 + 128 * p + 8 * j, 8);
                        const __m512i bit = _mm512_set1_epi32(16 << p);
                        l0 = _mm512_mask_or_epi32(l0, (__mmask16)m[0], l0, bit);
                        l1 = _mm512_mask_or_epi32(l1, (__mmask16)(m[0] >> 16), l1, bit);
                        h0 = _mm512_mask_or_epi32(h0, (__mmask16)m[1], h0, bit);
                        h1 = _mm512_mask_or_epi32(h1, (__mmask16)(m[1] >> 16), h1, bit);
                    }
                }
                const __m512 u0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l0), s0, c0);
                const __m512 u1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l1), s1, c1);
                const __m512 v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h0), t0, e0);
                const __m512 v1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h1), t1, e1);
                for (int r = 0; r < rows; r++) {
                    const __m512 xu = _mm512_set1_ps(xb[r * k + j]), xv = _mm512_set1_ps(xb[r * k + j + 16]);
                    a0[r] = _mm512_fmadd_ps(xv, v0, _mm512_fmadd_ps(xu, u0, a0[r]));
                    a1[r] = _mm512_fmadd_ps(xv, v1, _mm512_fmadd_ps(xu, u1, a1[r]));
                }
            }
        } else {
            scales16(w, b, fmt, 0, 0, &s0, &c0);
            scales16(w, b, fmt, 16, 0, &s1, &c1);
            for (int j = 0; j < 32; j++, q += 32) {
                const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
                const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
                const __m512 u0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), s0, c0);
                const __m512 u1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), s1, c1);
                for (int r = 0; r < rows; r++) {
                    const __m512 xu = _mm512_set1_ps(xb[r * k + j]);
                    a0[r] = _mm512_fmadd_ps(xu, u0, a0[r]);
                    a1[r] = _mm512_fmadd_ps(xu, u1, a1[r]);
                }
            }
        }
    }
    store_tile(y, ldy, cols, rows, a0, a1);
#elif defined(QL_AVX2)
    /* 16 registers: the tile in passes of gp groups of 8 columns, each pass over every block. A
       column's sum is one chain of multiply-adds whatever the pass: few rows take several groups
       at once, or their chains' latency (not the work) would set the pace. */
    const __m256i low = _mm256_set1_epi32(0x0F);
    const int gp = rows == 1 ? 4 : rows <= 3 ? 2 : 1;
    for (int g0 = 0; g0 < TILE / 8 && g0 * 8 < cols; g0 += gp) {
        __m256 a[ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < gp; i++)
                a[r][i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            prefetch(w, b, fmt);
            const uint8_t *q = block_codes(w, b, fmt) + 8 * g0;
            const float *xb = x + b * BLOCK;
            __m256 sc[4][2], tc[4][2]; /* tc: the high nibbles' (Q6_K's second group) */
            {
                for (int i = 0; i < gp; i++) {
                    scales8(w, b, fmt, 8 * (g0 + i), 0, &sc[i][0], &sc[i][1]);
                    tc[i][0] = sc[i][0], tc[i][1] = sc[i][1];
                    if (HALVES(fmt) == 2)
                        scales8(w, b, fmt, 8 * (g0 + i), 1, &tc[i][0], &tc[i][1]);
                }
                for (int j = 0; j < (CODE_BITS(fmt) == 4 ? 16 : 32); j++, q += 32) {
                    for (int i = 0; i < gp; i++) {
                        const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i)));
                        if (CODE_BITS(fmt) == 4) {
                            __m256i l = _mm256_and_si256(q0, low), hv = _mm256_srli_epi32(q0, 4);
                            for (int p = 0; p < PLANES(fmt); p++) { /* the 8 columns' bits of line j's two words */
                                uint32_t m[2];
                                memcpy(m, block_codes(w, b, fmt) + 512 + 128 * p + 8 * j, 8);
                                const int sh = 8 * (g0 + i);
                                l = _mm256_or_si256(l, plane8(m[0] >> sh, 4 + p));
                                hv = _mm256_or_si256(hv, plane8(m[1] >> sh, 4 + p));
                            }
                            const __m256 u = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), sc[i][0], sc[i][1]);
                            const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hv), tc[i][0], tc[i][1]);
                            for (int r = 0; r < rows; r++)
                                a[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(xb[r * k + j + 16]), v,
                                                          _mm256_fmadd_ps(_mm256_set1_ps(xb[r * k + j]), u, a[r][i]));
                        } else {
                            const __m256 u = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), sc[i][0], sc[i][1]);
                            for (int r = 0; r < rows; r++)
                                a[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(xb[r * k + j]), u, a[r][i]);
                        }
                    }
                }
            }
        }
        for (int i = 0; i < gp; i++) {
            const int g = g0 + i, n = cols - g * 8 < 8 ? cols - g * 8 : 8;
            for (int r = 0; r < rows && n > 0; r++) {
                float out[8];
                _mm256_storeu_ps(out, a[r][i]);
                memcpy(y + r * ldy + g * 8, out, (size_t)n * sizeof(float));
            }
        }
    }
#else
    for (int r = 0; r < rows; r++) {
        for (int col = 0; col < cols; col++) {
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *q = block_codes(w, b, fmt) + col;
                const float *xb = x + r * k + b * BLOCK;
                float s, c;
                if (CODE_BITS(fmt) == 4) {
                    float t, e; /* the high nibbles' (Q6_K's second group) */
                    scale1(w, b, fmt, col, 0, &s, &c);
                    scale1(w, b, fmt, col, HALVES(fmt) - 1, &t, &e);
                    for (int j = 0; j < 16; j++) {
                        const int code = q[32 * j];
                        int lo = code & 0x0F, hi = code >> 4;
                        for (int p = 0; p < PLANES(fmt); p++) {
                            uint32_t m[2];
                            memcpy(m, q - col + 512 + 128 * p + 8 * j, 8);
                            lo |= (int)((m[0] >> col) & 1) << (4 + p);
                            hi |= (int)((m[1] >> col) & 1) << (4 + p);
                        }
                        sum += xb[j] * ((float)lo * s + c);
                        sum += xb[j + 16] * ((float)hi * t + e);
                    }
                } else {
                    scale1(w, b, fmt, col, 0, &s, &c);
                    for (int j = 0; j < 32; j++)
                        sum += xb[j] * ((float)q[32 * j] * s + c);
                }
            }
            y[r * ldy + col] = sum;
        }
    }
#endif
}

typedef void (*tile_fn)(const float *, int64_t, const uint8_t *, int64_t, float *, int64_t, int);
#define TILE_ROWS(R, NAME, FMT)                                                                                \
    static void tile_##NAME##_##R(const float *x, int64_t k, const uint8_t *w, int64_t nb, float *y, int64_t ldy, \
                                 int cols)                                                                     \
    {                                                                                                          \
        tile_rows(x, k, w, nb, y, ldy, cols, R, FMT);                                                          \
    }
#define TILES(NAME, FMT)                                                                                       \
    TILE_ROWS(1, NAME, FMT) TILE_ROWS(2, NAME, FMT) TILE_ROWS(3, NAME, FMT) TILE_ROWS(4, NAME, FMT)            \
    TILE_ROWS(5, NAME, FMT) TILE_ROWS(6, NAME, FMT) TILE_ROWS(7, NAME, FMT) TILE_ROWS(8, NAME, FMT)            \
    static const tile_fn tiles_##NAME[ROWS + 1] = {NULL,            tile_##NAME##_1, tile_##NAME##_2,        \
                                                   tile_##NAME##_3, tile_##NAME##_4, tile_##NAME##_5,        \
                                                   tile_##NAME##_6, tile_##NAME##_7, tile_##NAME##_8};
TILES(q4, FMT_Q4)
TILES(q8, FMT_Q8)
TILES(q4k, FMT_Q4K)
TILES(q5k, FMT_Q5K)
TILES(q6k, FMT_Q6K)
TILES(q5, FMT_Q5)
static const tile_fn *const tiles_float[6] = {tiles_q4, tiles_q8, tiles_q4k, tiles_q5k, tiles_q6k, tiles_q5};

#if defined(QL_INT)
/* The int8 precision: each block of 32 values of a row of X is rounded to int8 codes with one
   float scale d (|x| <= 127 d), as llama.cpp's Q8_0, and a block's products are integers:

       y[m, n] = sum over blocks of  d * s * (xq . q)  +  b * d * (sum of the block's xq)

   that is the dequantized matrix times the row as rounded, as llama.cpp's Q8_1 and Q8_K sums
   take it. The bias times the float sum of x would add the codes' rounding error times the
   offset in the matrix's codes (b = -128 s for Q8_0, -dmin m for the K-quants): the product of
   the matrix's codes alone, never centred, carries it (on Q8_0 files twice llama.cpp's distance
   to the float model). (Q6_K: per group of 16, its low nibbles' and its high nibbles' sums apart, d * s * (xq . q -
   32 * (sum of the group's xq)), the codes' offset taken out in integers, as llama.cpp does;
   the 5- and 6-bit codes' bit planes added to the bytes). The codes' lines differ: a line holds, for 16 columns, 4
   bytes each (the codes of 4 consecutive k), as VPDPBUSD multiplies and adds four byte pairs into
   each 32-bit lane. Half h (columns 16 h to 16 h + 15) of a block's codes is:
     bits 4: 4 lines of 64 bytes; byte 4 c + i of line j: code (k = 4 j + i, column c) in the low
             nibble, code (k = 16 + 4 j + i, column c) in the high nibble;
     bits 8: 8 lines of 64 bytes; byte 4 c + i of line j: code (k = 4 j + i, column c). */
#define ROWS_INT8 4

#if defined(QL_INT_VNNI)
/* Group h of block b: each row's integer sums (i0: columns 0-15, i1: 16-31) into its float sums
   f0, f1: times the columns' scales and the row's scale (xd[r * nb]), plus the columns' biases
   times the row's block sum as rounded (xs[r * nb]: d times the sum of its codes); for Q6_K no bias (its codes are offset by 32 in the
   sums: xi, the int8 codes' sum of the group, row r's at xi[2 r nb], or none for the int16
   precision's signed codes). The int8 and int16 precisions' last step of a block. */
static inline __attribute__((always_inline)) void add_block(const uint8_t *w, int64_t b, const int fmt, int h,
                                                             const float *xd, const float *xs, const int32_t *xi,
                                                             int64_t nb, const int rows, __m512i *i0, __m512i *i1,
                                                             __m512 *f0, __m512 *f1)
{
    __m512 s0, s1, c0, c1;
    scales16(w, b, fmt, 0, h, &s0, &c0);
    scales16(w, b, fmt, 16, h, &s1, &c1);
    for (int r = 0; r < rows; r++) {
        const __m512 d = _mm512_set1_ps(xd[r * nb]);
        if (fmt == FMT_Q6K) {
            if (xi != NULL) {
                const __m512i back = _mm512_set1_epi32(-32 * xi[r * 2 * nb]);
                i0[r] = _mm512_add_epi32(i0[r], back);
                i1[r] = _mm512_add_epi32(i1[r], back);
            }
            f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[r]), _mm512_mul_ps(s0, d), f0[r]);
            f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[r]), _mm512_mul_ps(s1, d), f1[r]);
        } else {
            const __m512 sum = _mm512_set1_ps(xs[r * nb]);
            f0[r] = _mm512_fmadd_ps(c0, sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[r]), _mm512_mul_ps(s0, d), f0[r]));
            f1[r] = _mm512_fmadd_ps(c1, sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[r]), _mm512_mul_ps(s1, d), f1[r]));
        }
    }
}

static inline __attribute__((always_inline)) void tile_rows_int8(const int8_t *xq, const float *xd, const float *xs,
                                                                  const int32_t *xi, int64_t k, const uint8_t *w,
                                                                  int64_t nb, float *y, int64_t ldy, int cols,
                                                                  const int rows, const int fmt)
{
    const int bits = CODE_BITS(fmt), half_bytes = (bits == 4 ? 256 : 512), split = HALVES(fmt) == 2;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 f0[ROWS_INT8], f1[ROWS_INT8];
    for (int r = 0; r < rows; r++)
        f0[r] = f1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch(w, b, fmt);
        const uint8_t *q = block_codes(w, b, fmt);
        __m512i i0[ROWS_INT8], i1[ROWS_INT8], k0[ROWS_INT8], k1[ROWS_INT8]; /* k: Q6_K's second group (high nibbles) */
        for (int r = 0; r < rows; r++)
            i0[r] = i1[r] = k0[r] = k1[r] = _mm512_setzero_si512();
        for (int j = 0; j < (bits == 4 ? 4 : 8); j++) {
            const __m512i v0 = _mm512_loadu_si512(q + 64 * j), v1 = _mm512_loadu_si512(q + half_bytes + 64 * j);
            if (bits == 4) {
                __m512i l0 = _mm512_and_si512(v0, low), h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
                __m512i l1 = _mm512_and_si512(v1, low), h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
                for (int p = 0; p < PLANES(fmt); p++) { /* per half and line two masks: bit 4 c + i the code of byte
                                                           4 c + i's low, then high nibble */
                    uint64_t m[4];
                    memcpy(m, q + 512 + 128 * p + 16 * j, 16);
                    memcpy(m + 2, q + 512 + 128 * p + 64 + 16 * j, 16);
                    const __m512i bit = _mm512_set1_epi8((char)(16 << p));
                    l0 = _mm512_mask_add_epi8(l0, (__mmask64)m[0], l0, bit);
                    h0 = _mm512_mask_add_epi8(h0, (__mmask64)m[1], h0, bit);
                    l1 = _mm512_mask_add_epi8(l1, (__mmask64)m[2], l1, bit);
                    h1 = _mm512_mask_add_epi8(h1, (__mmask64)m[3], h1, bit);
                }
                for (int r = 0; r < rows; r++) {
                    const int8_t *xr = xq + r * k + b * BLOCK;
                    int32_t lo4, hi4;
                    memcpy(&lo4, xr + 4 * j, 4);
                    memcpy(&hi4, xr + 16 + 4 * j, 4);
                    const __m512i xl = _mm512_set1_epi32(lo4), xh = _mm512_set1_epi32(hi4);
                    if (split) {
                        i0[r] = _mm512_dpbusd_epi32(i0[r], l0, xl);
                        i1[r] = _mm512_dpbusd_epi32(i1[r], l1, xl);
                        k0[r] = _mm512_dpbusd_epi32(k0[r], h0, xh);
                        k1[r] = _mm512_dpbusd_epi32(k1[r], h1, xh);
                    } else {
                        i0[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i0[r], l0, xl), h0, xh);
                        i1[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i1[r], l1, xl), h1, xh);
                    }
                }
            } else {
                for (int r = 0; r < rows; r++) {
                    int32_t four;
                    memcpy(&four, xq + r * k + b * BLOCK + 4 * j, 4);
                    const __m512i xv = _mm512_set1_epi32(four);
                    i0[r] = _mm512_dpbusd_epi32(i0[r], v0, xv);
                    i1[r] = _mm512_dpbusd_epi32(i1[r], v1, xv);
                }
            }
        }
        add_block(w, b, fmt, 0, xd + b, xs + b, xi + 2 * b, nb, rows, i0, i1, f0, f1);
        if (split)
            add_block(w, b, fmt, 1, xd + b, xs + b, xi + 2 * b + 1, nb, rows, k0, k1, f0, f1);
    }
    store_tile(y, ldy, cols, rows, f0, f1);
}


/* Row r of X to int8 codes, a scale and the block's sum as rounded (d times its codes' sum) per
   block, and the codes' sum per 16 (rounding to nearest, ties to even). */
static void quantize_row(const float *x, int64_t k, int8_t *xq, float *xd, float *xs, int32_t *xi)
{
    for (int64_t b = 0; b < k / BLOCK; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * BLOCK), v1 = _mm512_loadu_ps(x + b * BLOCK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 iv = _mm512_set1_ps(inv);
        const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv)), c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv));
        _mm_storeu_si128((__m128i *)(xq + b * BLOCK), _mm512_cvtsepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)(xq + b * BLOCK + 16), _mm512_cvtsepi32_epi8(c1));
        xi[2 * b] = _mm512_reduce_add_epi32(c0); /* |codes| <= 127: nothing saturated */
        xi[2 * b + 1] = _mm512_reduce_add_epi32(c1);
        xd[b] = d;
        xs[b] = d * (float)(xi[2 * b] + xi[2 * b + 1]);
    }
}
#else /* QL_INT_AVX2 */
/* VPDPBUSD's sum of four byte products per 32-bit lane, from AVX2's 16-bit pair sums: codes of 4
   bits (or of 5 and 6 with their planes' bits, below 64) times int8 values stay within 16 bits
   (2 x 63 x 127); a code of 8 bits (stored + 128) is taken signed, its size times the value's
   sign, then 128 times the block's value sum added back (dot8), all in exact integers, so the
   result is VPDPBUSD's. */
static inline __m256i dot4(__m256i lo, __m256i xl, __m256i hi, __m256i xh)
{
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

static inline __m256i dot_small(__m256i codes, __m256i x)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
}

static inline __m256i dot8(__m256i codes, __m256i x)
{
    const __m256i w = _mm256_xor_si256(codes, _mm256_set1_epi8((char)0x80)); /* the signed code */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

/* The AVX-512 tile function's math 8 columns to a vector: per half of 16 columns two vectors a
   line (bytes 0-31 columns 0-7, bytes 32-63 columns 8-15). xi: the int8 codes' sums per 16, two
   a block. */
static inline __attribute__((always_inline)) void tile_rows_int8(const int8_t *xq, const float *xd, const float *xs,
                                                                  const int32_t *xi, int64_t k, const uint8_t *w,
                                                                  int64_t nb, float *y, int64_t ldy, int cols,
                                                                  const int rows, const int fmt)
{
    const int bits = CODE_BITS(fmt), half_bytes = (bits == 4 ? 256 : 512), split = HALVES(fmt) == 2;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 f[ROWS_INT8][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++)
            f[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch(w, b, fmt);
        const uint8_t *q = block_codes(w, b, fmt);
        __m256i acc[2][ROWS_INT8][4]; /* [1]: Q6_K's second group (high nibbles) */
        for (int g = 0; g <= split; g++)
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < 4; c++)
                    acc[g][r][c] = _mm256_setzero_si256();
        for (int j = 0; j < (bits == 4 ? 4 : 8); j++) {
            __m256i v[4], lo[4], hi[4];
            for (int c = 0; c < 4; c++) /* columns 8c to 8c + 7 */
                v[c] = _mm256_loadu_si256((const __m256i *)(q + (c / 2) * half_bytes + 64 * j + 32 * (c % 2)));
            if (bits == 4) {
                for (int c = 0; c < 4; c++) {
                    lo[c] = _mm256_and_si256(v[c], low);
                    hi[c] = _mm256_and_si256(_mm256_srli_epi16(v[c], 4), low);
                    for (int p = 0; p < PLANES(fmt); p++) { /* the AVX-512 code's masks, 32 bits of them a vector */
                        uint64_t m[2];
                        memcpy(m, q + 512 + 128 * p + 64 * (c / 2) + 16 * j, 16);
                        lo[c] = _mm256_or_si256(lo[c], plane32((uint32_t)(m[0] >> (32 * (c % 2))), 4 + p));
                        hi[c] = _mm256_or_si256(hi[c], plane32((uint32_t)(m[1] >> (32 * (c % 2))), 4 + p));
                    }
                }
            }
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + r * k + b * BLOCK;
                int32_t lo4, hi4;
                memcpy(&lo4, xr + 4 * j, 4);
                if (bits == 4) {
                    memcpy(&hi4, xr + 16 + 4 * j, 4);
                    const __m256i xl = _mm256_set1_epi32(lo4), xh = _mm256_set1_epi32(hi4);
                    for (int c = 0; c < 4; c++) {
                        if (split) {
                            acc[0][r][c] = _mm256_add_epi32(acc[0][r][c], dot_small(lo[c], xl));
                            acc[1][r][c] = _mm256_add_epi32(acc[1][r][c], dot_small(hi[c], xh));
                        } else {
                            acc[0][r][c] = _mm256_add_epi32(acc[0][r][c], dot4(lo[c], xl, hi[c], xh));
                        }
                    }
                } else {
                    const __m256i xv = _mm256_set1_epi32(lo4);
                    for (int c = 0; c < 4; c++)
                        acc[0][r][c] = _mm256_add_epi32(acc[0][r][c], dot8(v[c], xv));
                }
            }
        }
        for (int g = 0; g <= split; g++) {
            __m256 sc[4], bc[4];
            for (int c = 0; c < 4; c++)
                scales8(w, b, fmt, 8 * c, g, &sc[c], &bc[c]);
            for (int r = 0; r < rows; r++) {
                const int32_t *xr = xi + 2 * (r * nb + b);
                if (fmt == FMT_Q8 || fmt == FMT_Q6K) { /* Q8_0's codes were taken signed: 128 times the block's sum back;
                                                          Q6_K's offset of 32 out */
                    const __m256i back = _mm256_set1_epi32(fmt == FMT_Q8 ? 128 * (xr[0] + xr[1]) : -32 * xr[g]);
                    for (int c = 0; c < 4; c++)
                        acc[g][r][c] = _mm256_add_epi32(acc[g][r][c], back);
                }
                const __m256 d = _mm256_set1_ps(xd[r * nb + b]), sum = _mm256_set1_ps(xs[r * nb + b]);
                for (int c = 0; c < 4; c++) {
                    const __m256 p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[g][r][c]), _mm256_mul_ps(sc[c], d), f[r][c]);
                    f[r][c] = fmt == FMT_Q6K ? p : _mm256_fmadd_ps(bc[c], sum, p);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float out[TILE];
        for (int c = 0; c < 4; c++)
            _mm256_storeu_ps(out + 8 * c, f[r][c]);
        memcpy(y + r * ldy, out, (size_t)cols * sizeof(float));
    }
}

/* The largest |x| of a block of 32 (in 4 vectors). */
static inline float block_amax(const __m256 v[4])
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

static inline int32_t sum8(__m256i v)
{
    __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* quantize_row's AVX-512 math 8 wide: the same codes, scale and sums. */
static void quantize_row(const float *x, int64_t k, int8_t *xq, float *xd, float *xs, int32_t *xi)
{
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < k / BLOCK; b++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_loadu_ps(x + b * BLOCK + 8 * i);
        const float amax = block_amax(v);
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 iv = _mm256_set1_ps(inv);
        __m256i c[4];
        for (int i = 0; i < 4; i++)
            c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(xq + b * BLOCK), _mm256_permutevar8x32_epi32(bytes, order));
        xi[2 * b] = sum8(_mm256_add_epi32(c[0], c[1]));
        xi[2 * b + 1] = sum8(_mm256_add_epi32(c[2], c[3]));
        xd[b] = d;
        xs[b] = d * (float)(xi[2 * b] + xi[2 * b + 1]);
    }
}
#endif

typedef void (*tile_int8_fn)(const int8_t *, const float *, const float *, const int32_t *, int64_t, const uint8_t *,
                             int64_t, float *, int64_t, int);
#define TILE_ROWS_INT8(R, NAME, FMT)                                                                           \
    static void tile_int8_##NAME##_##R(const int8_t *xq, const float *xd, const float *xs, const int32_t *xi,     \
                                      int64_t k, const uint8_t *w, int64_t nb, float *y, int64_t ldy, int cols) \
    {                                                                                                          \
        tile_rows_int8(xq, xd, xs, xi, k, w, nb, y, ldy, cols, R, FMT);                                        \
    }
#define TILES_INT8(NAME, FMT)                                                                                  \
    TILE_ROWS_INT8(1, NAME, FMT) TILE_ROWS_INT8(2, NAME, FMT) TILE_ROWS_INT8(3, NAME, FMT)                     \
    TILE_ROWS_INT8(4, NAME, FMT)                                                                               \
    static const tile_int8_fn tiles_int8_##NAME[ROWS_INT8 + 1] = {NULL, tile_int8_##NAME##_1, tile_int8_##NAME##_2, \
                                                                  tile_int8_##NAME##_3, tile_int8_##NAME##_4};
TILES_INT8(q4, FMT_Q4)
TILES_INT8(q8, FMT_Q8)
TILES_INT8(q4k, FMT_Q4K)
TILES_INT8(q5k, FMT_Q5K)
TILES_INT8(q6k, FMT_Q6K)
TILES_INT8(q5, FMT_Q5)
static const tile_int8_fn *const tiles_int8[6] = {tiles_int8_q4, tiles_int8_q8, tiles_int8_q4k, tiles_int8_q5k,
                                                  tiles_int8_q6k, tiles_int8_q5};

/* The int16 precision: each block of 32 values of a row of X is rounded to int16 codes with one
   float scale d (|x| <= 32767 d), and a block's products are integers, as for int8:

       y[m, n] = sum over blocks of  d * s * (xq . q)  +  b * d * (sum of the block's xq)

   with 15 bits of each block's largest value where int8 keeps 7 (its logits stay within ~1e-2 of
   float32's on the default model, int8's move by ~1). Its lines pair k and interleave the tile's
   two halves of 16 columns, so that a 16-bit lane's code is one AND or shift away: a block's
   codes are lines of 64 bytes, 4 bytes per column c of the first half (c < 16):
     bits 8: 16 lines; line j, bytes 4 c to 4 c + 3: the codes of (k = 2 j, column c),
             (2 j, c + 16), (2 j + 1, c), (2 j + 1, c + 16);
     bits 4: 8 lines, the same with the code of k in the low nibble and that of k + 16 in the high.
   (the 5- and 6-bit codes' bit planes added in the lanes; Q6_K has no bias, its two groups' sums apart,
   its codes less 32: in the lanes on AVX2, in the sums on VNNI, the same integers.) So the line's 32-bit lane c holds,
   in the low byte (nibble) of each 16-bit half, column c's pair of codes, and column c + 16's one
   byte (nibble) up: VPDPWSSD (VPMADDWD) multiplies a pair by X's and adds. Every sum of a block is
   exact (|xq . q| < 32 x 32767 x 255 < 2^31), whatever the order of its products, so the builds
   agree bit for bit. */

#if defined(QL_INT_VNNI)
#define ROWS_INT16 8

/* Line j of a block (not Q6_K's: group_line_int16) for rows rows of X (xb, the pass's rows a
   block apart): i0 (columns 0-15) and i1 (16-31) of each row plus its products. */
static inline __attribute__((always_inline)) void line_int16(const int16_t *xb, const uint8_t *q, int j, const int rows,
                                                              const int fmt, __m512i *i0, __m512i *i1)
{
    const __m512i v = _mm512_loadu_si512(q + 64 * j);
    if (CODE_BITS(fmt) == 4) {
        const __m512i nibble = _mm512_set1_epi16(0x000F);
        __m512i a = _mm512_and_si512(v, nibble), b = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        __m512i c = _mm512_and_si512(_mm512_srli_epi16(v, 8), nibble), d = _mm512_srli_epi16(v, 12);
        for (int p = 0; p < PLANES(fmt); p++) { /* line j's four masks, for a, b, c, d: bit i their 16-bit lane i's code */
            uint32_t m[4];
            memcpy(m, q + 512 + 128 * p + 16 * j, 16);
            const __m512i bit = _mm512_set1_epi16((short)(16 << p));
            a = _mm512_mask_add_epi16(a, (__mmask32)m[0], a, bit);
            b = _mm512_mask_add_epi16(b, (__mmask32)m[1], b, bit);
            c = _mm512_mask_add_epi16(c, (__mmask32)m[2], c, bit);
            d = _mm512_mask_add_epi16(d, (__mmask32)m[3], d, bit);
        }
        for (int r = 0; r < rows; r++) {
            int32_t lo2, hi2;
            memcpy(&lo2, xb + r * BLOCK + 2 * j, 4);
            memcpy(&hi2, xb + r * BLOCK + 16 + 2 * j, 4);
            const __m512i xl = _mm512_set1_epi32(lo2), xh = _mm512_set1_epi32(hi2);
            i0[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(i0[r], a, xl), b, xh);
            i1[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(i1[r], c, xl), d, xh);
        }
    } else {
        const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi16(0x00FF)), hi = _mm512_srli_epi16(v, 8);
        for (int r = 0; r < rows; r++) {
            int32_t two;
            memcpy(&two, xb + r * BLOCK + 2 * j, 4);
            const __m512i xv = _mm512_set1_epi32(two);
            i0[r] = _mm512_dpwssd_epi32(i0[r], lo, xv);
            i1[r] = _mm512_dpwssd_epi32(i1[r], hi, xv);
        }
    }
}

/* Line j of a Q6_K block, its group h only (h = 0: k < 16, the lines' low nibbles of each byte,
   a and c of line_int16; h = 1: k >= 16, b and d), for rows rows: i0 (columns 0-15) and i1
   (16-31) of each row plus its products, the codes taken unsigned (0-63; the offset of 32 comes
   out of the sums at the group's end). Half the sums of line_int16's at a time: a row's two
   groups' four in registers, for 8 rows, are all of AVX-512's 32. */
static inline __attribute__((always_inline)) void group_line_int16(const int16_t *xb, const uint8_t *q, int j, int h,
                                                                    const int rows, __m512i *i0, __m512i *i1)
{
    const __m512i v = _mm512_loadu_si512(q + 64 * j), nibble = _mm512_set1_epi16(0x000F);
    __m512i lo = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, nibble), hi = _mm512_srli_epi16(v, h ? 12 : 8);
    if (!h)
        hi = _mm512_and_si512(hi, nibble);
    for (int p = 0; p < 2; p++) { /* line j's masks of columns 0-15 (word h) and 16-31 (word 2 + h) */
        const uint8_t *m = q + 512 + 128 * p + 16 * j;
        const __m512i bit = _mm512_set1_epi16((short)(16 << p));
        lo = _mm512_mask_add_epi16(lo, _load_mask32((__mmask32 *)(m + 4 * h)), lo, bit);
        hi = _mm512_mask_add_epi16(hi, _load_mask32((__mmask32 *)(m + 8 + 4 * h)), hi, bit);
    }
    for (int r = 0; r < rows; r++) {
        int32_t two;
        memcpy(&two, xb + r * BLOCK + 16 * h + 2 * j, 4);
        const __m512i xv = _mm512_set1_epi32(two);
        i0[r] = _mm512_dpwssd_epi32(i0[r], lo, xv);
        i1[r] = _mm512_dpwssd_epi32(i1[r], hi, xv);
    }
}

/* A tile for up to 8 rows. Few rows take the lines of a block in several sets of sums (line j
   into set j mod sets), added at the block's end: enough chains of VPDPWSSD in flight that their
   latency does not set the pace. Q6_K's blocks go a group at a time (group_line_int16), and its
   integer sums less 32 times the group's codes of X (xi: a row's two a block, xi[2 r nb]) make
   line_int16's sums of the codes less 32. */
static inline __attribute__((always_inline)) void tile_rows_int16(const int16_t *xq, const float *xd, const float *xs,
                                                                   const int32_t *xi, const uint8_t *w, int64_t nb,
                                                                   float *y, int64_t ldy, int cols, const int rows,
                                                                   const int fmt)
{
    const int lines = CODE_BITS(fmt) == 4 ? 8 : 16, split = HALVES(fmt) == 2;
    const int sets = rows == 1 ? 4 : rows == 2 ? 2 : 1;
    __m512 f0[ROWS_INT16], f1[ROWS_INT16]; /* columns 0-15 and 16-31 */
    for (int r = 0; r < rows; r++)
        f0[r] = f1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch(w, b, fmt);
        const uint8_t *q = block_codes(w, b, fmt);
        const int16_t *xb = xq + b * ROWS_INT16 * BLOCK;
        if (split) {
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m512i g0[4][ROWS_INT16], g1[4][ROWS_INT16];
                for (int s = 0; s < sets; s++)
                    for (int r = 0; r < rows; r++)
                        g0[s][r] = g1[s][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int j = 0; j < 8; j += sets)
                    for (int s = 0; s < sets; s++)
                        group_line_int16(xb, q, j + s, h, rows, g0[s], g1[s]);
                for (int s = 1; s < sets; s++)
                    for (int r = 0; r < rows; r++) {
                        g0[0][r] = _mm512_add_epi32(g0[0][r], g0[s][r]);
                        g1[0][r] = _mm512_add_epi32(g1[0][r], g1[s][r]);
                    }
                add_block(w, b, fmt, h, xd + b, xs + b, xi + 2 * b + h, nb, rows, g0[0], g1[0], f0, f1);
                __asm__ volatile("" ::: "memory"); /* each group loads its lines: kept from the other's, they
                                                     would be spilled (no registers are left) */
            }
            continue;
        }
        __m512i i0[4][ROWS_INT16], i1[4][ROWS_INT16];
        for (int s = 0; s < sets; s++)
            for (int r = 0; r < rows; r++)
                i0[s][r] = i1[s][r] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int j = 0; j < lines; j += sets)
            for (int s = 0; s < sets; s++)
                line_int16(xb, q, j + s, rows, fmt, i0[s], i1[s]);
        for (int s = 1; s < sets; s++)
            for (int r = 0; r < rows; r++) {
                i0[0][r] = _mm512_add_epi32(i0[0][r], i0[s][r]);
                i1[0][r] = _mm512_add_epi32(i1[0][r], i1[s][r]);
            }
        add_block(w, b, fmt, 0, xd + b, xs + b, NULL, nb, rows, i0[0], i1[0], f0, f1);
    }
    store_tile(y, ldy, cols, rows, f0, f1);
}

/* Row r of X to int16 codes, a scale and the block's sum as rounded per block (rounding to nearest, ties to even),
   and the codes' sum per 16 (xi, two a block: Q6_K's offset); block b's codes at xq + b * stride
   (the rows of a tile's pass are interleaved by block: see quantize_task). */
static void quantize_row16(const float *x, int64_t k, int16_t *xq, int64_t stride, float *xd, float *xs, int32_t *xi)
{
    for (int64_t b = 0; b < k / BLOCK; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * BLOCK), v1 = _mm512_loadu_ps(x + b * BLOCK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        const __m512 iv = _mm512_set1_ps(inv);
        const __m256i c0 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v0, iv)));
        const __m256i c1 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v1, iv)));
        _mm256_storeu_si256((__m256i *)(xq + b * stride), c0);
        _mm256_storeu_si256((__m256i *)(xq + b * stride + 16), c1);
        xi[2 * b] = _mm512_reduce_add_epi32(_mm512_cvtepi16_epi32(c0));
        xi[2 * b + 1] = _mm512_reduce_add_epi32(_mm512_cvtepi16_epi32(c1));
        xd[b] = d;
        xs[b] = d * (float)(xi[2 * b] + xi[2 * b + 1]);
    }
}
#else /* QL_INT_AVX2 */
#define ROWS_INT16 4

/* The same sums 8 columns at a time: a pass over every block per group of 8 columns, c0 to
   c0 + 7 = 16 h + 8 s: half s of each line (bytes 32 s to 32 s + 31) holds them in the low
   (h = 0) or the high (h = 1) byte of each 16-bit lane's, as the VNNI build reads it; Q6_K's
   offset of 32 out of the sums, as there (xi). */
static inline __attribute__((always_inline)) void tile_rows_int16(const int16_t *xq, const float *xd, const float *xs,
                                                                   const int32_t *xi, const uint8_t *w, int64_t nb,
                                                                   float *y, int64_t ldy, int cols, const int rows,
                                                                   const int fmt)
{
    const int bits = CODE_BITS(fmt), lines = bits == 4 ? 8 : 16, split = HALVES(fmt) == 2;
    const __m256i nibble = _mm256_set1_epi16(0x000F), byte = _mm256_set1_epi16(0x00FF);
    for (int g = 0; g < TILE / 8; g++) {
        const int s = g & 1, h = g >> 1, c0 = 16 * h + 8 * s;
        if (c0 >= cols)
            continue;
        __m256 f[ROWS_INT16];
        for (int r = 0; r < rows; r++)
            f[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            prefetch(w, b, fmt);
            const uint8_t *q = block_codes(w, b, fmt) + 32 * s;
            __m256i acc[2][ROWS_INT16]; /* [1]: Q6_K's second group (the high nibbles) */
            for (int r = 0; r < rows; r++)
                acc[0][r] = acc[1][r] = _mm256_setzero_si256();
            for (int j = 0; j < lines; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * j));
                if (bits == 4) {
                    const __m256i half = h ? _mm256_srli_epi16(v, 8) : v;
                    __m256i l = _mm256_and_si256(half, nibble), u = _mm256_and_si256(_mm256_srli_epi16(half, 4), nibble);
                    const uint8_t *planes = block_codes(w, b, fmt) + 512 + 16 * j + 4 * (2 * h) + 2 * s;
                    if (fmt == FMT_Q6K) { /* the VNNI code's masks of a, b (low byte) or c, d (high), both planes at once */
                        l = _mm256_or_si256(l, planes16(planes));
                        u = _mm256_or_si256(u, planes16(planes + 4));
                    } else if (PLANES(fmt) == 1) { /* Q5_K's, Q5_0's and Q5_1's */
                        uint16_t m[2];
                        memcpy(&m[0], planes, 2);
                        memcpy(&m[1], planes + 4, 2);
                        l = _mm256_or_si256(l, plane16(m[0], 4));
                        u = _mm256_or_si256(u, plane16(m[1], 4));
                    }
                    for (int r = 0; r < rows; r++) {
                        const int16_t *xr = xq + (b * ROWS_INT16 + r) * BLOCK;
                        int32_t lo2, hi2;
                        memcpy(&lo2, xr + 2 * j, 4);
                        memcpy(&hi2, xr + 16 + 2 * j, 4);
                        const __m256i pl = _mm256_madd_epi16(l, _mm256_set1_epi32(lo2));
                        const __m256i pu = _mm256_madd_epi16(u, _mm256_set1_epi32(hi2));
                        if (split) {
                            acc[0][r] = _mm256_add_epi32(acc[0][r], pl);
                            acc[1][r] = _mm256_add_epi32(acc[1][r], pu);
                        } else {
                            acc[0][r] = _mm256_add_epi32(acc[0][r], _mm256_add_epi32(pl, pu));
                        }
                    }
                } else {
                    const __m256i c = _mm256_and_si256(h ? _mm256_srli_epi16(v, 8) : v, byte);
                    for (int r = 0; r < rows; r++) {
                        int32_t two;
                        memcpy(&two, xq + (b * ROWS_INT16 + r) * BLOCK + 2 * j, 4);
                        acc[0][r] = _mm256_add_epi32(acc[0][r], _mm256_madd_epi16(c, _mm256_set1_epi32(two)));
                    }
                }
            }
            for (int hh = 0; hh <= split; hh++) {
                __m256 sc, bc;
                scales8(w, b, fmt, c0, hh, &sc, &bc);
                for (int r = 0; r < rows; r++) {
                    if (fmt == FMT_Q6K) /* its codes' offset of 32 out (xi: the group's codes of X) */
                        acc[hh][r] = _mm256_add_epi32(acc[hh][r], _mm256_set1_epi32(-32 * xi[2 * (r * nb + b) + hh]));
                    const __m256 d = _mm256_set1_ps(xd[r * nb + b]), sum = _mm256_set1_ps(xs[r * nb + b]);
                    const __m256 p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[hh][r]), _mm256_mul_ps(sc, d), f[r]);
                    f[r] = fmt == FMT_Q6K ? p : _mm256_fmadd_ps(bc, sum, p);
                }
            }
        }
        const int n = cols - c0 < 8 ? cols - c0 : 8;
        for (int r = 0; r < rows; r++) {
            float out[8];
            _mm256_storeu_ps(out, f[r]);
            memcpy(y + r * ldy + c0, out, (size_t)n * sizeof(float));
        }
    }
}

/* quantize_row16's AVX-512 math 8 wide: the same codes, scale and sums. */
static void quantize_row16(const float *x, int64_t k, int16_t *xq, int64_t stride, float *xd, float *xs, int32_t *xi)
{
    for (int64_t b = 0; b < k / BLOCK; b++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_loadu_ps(x + b * BLOCK + 8 * i);
        const float amax = block_amax(v);
        const float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        const __m256 iv = _mm256_set1_ps(inv);
        for (int i = 0; i < 4; i += 2) {
            const __m256i c = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv)),
                                                 _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], iv)));
            _mm256_storeu_si256((__m256i *)(xq + b * stride + 8 * i), _mm256_permute4x64_epi64(c, _MM_SHUFFLE(3, 1, 2, 0)));
            xi[2 * b + i / 2] = sum8(_mm256_madd_epi16(c, _mm256_set1_epi16(1)));
        }
        xd[b] = d;
        xs[b] = d * (float)(xi[2 * b] + xi[2 * b + 1]);
    }
}
#endif

typedef void (*tile_int16_fn)(const int16_t *, const float *, const float *, const int32_t *, const uint8_t *, int64_t,
                              float *, int64_t, int);
#define TILE_ROWS_INT16(R, NAME, FMT)                                                                               \
    static void tile_int16_##NAME##_##R(const int16_t *xq, const float *xd, const float *xs, const int32_t *xi,     \
                                       const uint8_t *w, int64_t nb, float *y, int64_t ldy, int cols)                \
    {                                                                                                               \
        tile_rows_int16(xq, xd, xs, xi, w, nb, y, ldy, cols, R, FMT);                                               \
    }
#if ROWS_INT16 == 8
#define TILES_INT16(NAME, FMT)                                                                                      \
    TILE_ROWS_INT16(1, NAME, FMT) TILE_ROWS_INT16(2, NAME, FMT) TILE_ROWS_INT16(3, NAME, FMT)                       \
    TILE_ROWS_INT16(4, NAME, FMT) TILE_ROWS_INT16(5, NAME, FMT) TILE_ROWS_INT16(6, NAME, FMT)                       \
    TILE_ROWS_INT16(7, NAME, FMT) TILE_ROWS_INT16(8, NAME, FMT)                                                     \
    static const tile_int16_fn tiles_int16_##NAME[ROWS_INT16 + 1] = {                                               \
        NULL, tile_int16_##NAME##_1, tile_int16_##NAME##_2, tile_int16_##NAME##_3, tile_int16_##NAME##_4,           \
        tile_int16_##NAME##_5, tile_int16_##NAME##_6, tile_int16_##NAME##_7, tile_int16_##NAME##_8};
#else
#define TILES_INT16(NAME, FMT)                                                                                      \
    TILE_ROWS_INT16(1, NAME, FMT) TILE_ROWS_INT16(2, NAME, FMT) TILE_ROWS_INT16(3, NAME, FMT)                       \
    TILE_ROWS_INT16(4, NAME, FMT)                                                                                   \
    static const tile_int16_fn tiles_int16_##NAME[ROWS_INT16 + 1] = {                                               \
        NULL, tile_int16_##NAME##_1, tile_int16_##NAME##_2, tile_int16_##NAME##_3, tile_int16_##NAME##_4};
#endif
TILES_INT16(q4, FMT_Q4)
TILES_INT16(q8, FMT_Q8)
TILES_INT16(q4k, FMT_Q4K)
TILES_INT16(q5k, FMT_Q5K)
TILES_INT16(q6k, FMT_Q6K)
TILES_INT16(q5, FMT_Q5)
static const tile_int16_fn *const tiles_int16[6] = {tiles_int16_q4, tiles_int16_q8, tiles_int16_q4k, tiles_int16_q5k,
                                                    tiles_int16_q6k, tiles_int16_q5};
#endif
typedef QLJob Job; /* qlinear.h */

/* Tile `task` of W (columns [task * TILE, ...) of Y), every row: the tile stays in the caches
   while the rows pass over it, a few rows at a time. */
static void run_task(void *arg, size_t task)
{
    const Job *job = (const Job *)arg;
    const int64_t nb = job->k / BLOCK, n0 = (int64_t)task * TILE;
    const int cols = job->n - n0 < TILE ? (int)(job->n - n0) : TILE;
    const uint8_t *w = job->w + (int64_t)task * tile_bytes(job->fmt, nb);
#if defined(QL_INT)
    if (job->xbits == 16) {
        const tile_int16_fn *tiles = tiles_int16[job->fmt];
        for (int64_t m0 = 0; m0 < job->m; m0 += ROWS_INT16) {
            const int64_t rows = job->m - m0 < ROWS_INT16 ? job->m - m0 : ROWS_INT16;
            tiles[rows]((const int16_t *)job->xq + m0 * job->k, job->xd + m0 * nb, job->xs + m0 * nb, job->xi + 2 * m0 * nb,
                        w, nb, job->y + m0 * job->n + n0, job->n, cols);
        }
        return;
    }
    if (job->xbits == 8) {
        const tile_int8_fn *tiles = tiles_int8[job->fmt];
        for (int64_t m0 = 0; m0 < job->m; m0 += ROWS_INT8) {
            const int64_t rows = job->m - m0 < ROWS_INT8 ? job->m - m0 : ROWS_INT8;
            tiles[rows]((const int8_t *)job->xq + m0 * job->k, job->xd + m0 * nb, job->xs + m0 * nb, job->xi + 2 * m0 * nb,
                        job->k, w, nb, job->y + m0 * job->n + n0, job->n, cols);
        }
        return;
    }
#endif
    const tile_fn *tiles = tiles_float[job->fmt];
    for (int64_t m0 = 0; m0 < job->m; m0 += ROWS) {
        const int64_t rows = job->m - m0 < ROWS ? job->m - m0 : ROWS;
        tiles[rows](job->x + m0 * job->k, job->k, w, nb, job->y + m0 * job->n + n0, job->n, cols);
    }
}

#if defined(QL_INT)
/* The integer precisions' scratch for X (one allocation, freed with free()); NULL if out of memory.
   The int16 codes take whole passes of ROWS_INT16 rows (see quantize_task). */
static void *integer_scratch(Job *job)
{
    const int64_t nb = job->k / BLOCK;
    const int64_t rows = job->xbits == 16 ? (job->m + ROWS_INT16 - 1) / ROWS_INT16 * ROWS_INT16 : job->m;
    float *scratch = (float *)malloc((size_t)(4 * job->m * nb) * sizeof(float) + (size_t)(rows * job->k * (job->xbits / 8)));
    if (scratch != NULL) {
        job->xd = scratch;
        job->xs = scratch + job->m * nb;
        job->xi = (const int32_t *)(scratch + 2 * job->m * nb);
        job->xq = scratch + 4 * job->m * nb;
    }
    return scratch;
}

/* Row `row` of X to integer codes. The int16 codes of a tile's pass of ROWS_INT16 rows are
   interleaved by block: block b of the pass's row r at (b * ROWS_INT16 + r) * BLOCK from the
   pass's start, so the tile finds every row's codes of a block at fixed offsets. */
static void quantize_task(void *arg, size_t row)
{
    const Job *job = (const Job *)arg;
    const int64_t nb = job->k / BLOCK, r = (int64_t)row % ROWS_INT16;
    if (job->xbits == 16)
        quantize_row16(job->x + row * job->k, job->k, (int16_t *)job->xq + ((int64_t)row - r) * job->k + r * BLOCK,
                       ROWS_INT16 * BLOCK, (float *)job->xd + row * nb, (float *)job->xs + row * nb,
                       (int32_t *)job->xi + 2 * row * nb);
    else
        quantize_row(job->x + row * job->k, job->k, (int8_t *)job->xq + row * job->k, (float *)job->xd + row * nb,
                     (float *)job->xs + row * nb, (int32_t *)job->xi + 2 * row * nb);
}
#endif

/* For the tests: the same computation without ONNX Runtime, on one thread; xbits 16 or 8: the
   int16 or int8 precision (only where exo_qlinear_integer() says the build has them); kquant 0
   (bits 4, 5 or 8: GGUF's blocks of 32) or 4, 5, 6 (Q4_K, Q5_K, Q6_K super-blocks). Returns 0, or
   -1 if it cannot. */
int exo_qlinear(const float *x, const uint8_t *w, float *y, int64_t m, int64_t k, int64_t n, int64_t bits, int64_t xbits,
                int64_t kquant)
{
    const int fmt = format_of(bits, kquant);
    if (fmt < 0 || k % (IS_K(fmt) ? 256 : BLOCK) != 0)
        return -1;
    Job job = {x, w, y, m, k, n, fmt, xbits, NULL, NULL, NULL, NULL};
    void *scratch = NULL;
    if (xbits) {
#if defined(QL_INT)
        if ((xbits != 8 && xbits != 16) || (scratch = integer_scratch(&job)) == NULL)
            return -1;
        for (size_t r = 0; r < (size_t)m; r++)
            quantize_task(&job, r);
#else
        return -1;
#endif
    }
    for (size_t t = 0; t < (size_t)((n + TILE - 1) / TILE); t++)
        run_task(&job, t);
    free(scratch);
    return 0;
}

/* qlinear.h: the kernel for other ops of the library */
int ql_format(int64_t bits, int64_t kquant) { return format_of(bits, kquant); }
int ql_is_kquant(int fmt) { return IS_K(fmt); }
int64_t ql_tile_bytes(int fmt, int64_t k) { return tile_bytes(fmt, k / BLOCK); }
void ql_tile(const QLJob *job, int64_t tile) { run_task((void *)job, (size_t)tile); }

void *ql_integer_scratch(QLJob *job)
{
#if defined(QL_INT)
    return (job->xbits == 8 || job->xbits == 16) ? integer_scratch(job) : NULL;
#else
    (void)job;
    return NULL;
#endif
}

void ql_quantize_row(const QLJob *job, int64_t row)
{
#if defined(QL_INT)
    quantize_task((void *)job, (size_t)row);
#else
    (void)job;
    (void)row;
#endif
}

int exo_qlinear_integer(void)
{
#if defined(QL_INT)
    return 1;
#else
    return 0;
#endif
}

const char *exo_qlinear_isa(void)
{
#if defined(QL_AVX512)
    return "avx512";
#elif defined(QL_AVX2)
    return "avx2";
#else
    return "c";
#endif
}

/* ------------------------------------------------------------------ the op */

typedef struct {
    int64_t k, n, bits, xbits, kquant;
    int fmt;
} Kernel;

static OrtStatus *create_kernel(const void *op, OrtApiTable *given, const OrtKernelInfo *info, void **out)
{
    (void)op;
    (void)given;
    Kernel *kernel = (Kernel *)calloc(1, sizeof(Kernel));
    if (kernel == NULL)
        return API(API_CreateStatus, CreateStatus_t)(ORT_FAIL, "QLinear: out of memory");
    OrtStatus *status = int_attribute(info, "K", &kernel->k);
    if (status == NULL)
        status = int_attribute(info, "N", &kernel->n);
    if (status == NULL)
        status = int_attribute(info, "bits", &kernel->bits);
    if (status == NULL && (kernel->k <= 0 || kernel->k % BLOCK != 0 || kernel->n <= 0))
        status = fail("QLinear: K must be a positive multiple of 32 and N positive");
    if (status == NULL)
        status = int_attribute(info, "xbits", &kernel->xbits);
    if (status == NULL)
        optional_int_attribute(info, "kquant", &kernel->kquant);
    if (status == NULL && (kernel->fmt = format_of(kernel->bits, kernel->kquant)) < 0)
        status = fail("QLinear: bits must be 4, 5 or 8, or kquant 4, 5 or 6 (Q4_K, Q5_K, Q6_K)");
    if (status == NULL && IS_K(kernel->fmt) && kernel->k % 256 != 0)
        status = fail("QLinear: K must be a multiple of 256 for K-quant super-blocks");
    if (status == NULL && kernel->xbits != 0 && kernel->xbits != 8 && kernel->xbits != 16)
        status = fail("QLinear: xbits must be 0 (float32), 8 or 16");
#if !defined(QL_INT)
    if (status == NULL && kernel->xbits)
        status = fail("QLinear: this build has no integer products (they need AVX2 or AVX-512 VNNI)");
#endif
    if (status != NULL) {
        free(kernel);
        return status;
    }
    *out = kernel;
    return NULL;
}

static OrtStatus *compute(void *arg, OrtKernelContext *context)
{
    const Kernel *kernel = (const Kernel *)arg;
    const OrtValue *x_value, *w_value;
    CHECK(API(API_KernelContext_GetInput, KernelContext_GetInput_t)(context, 0, &x_value));
    CHECK(API(API_KernelContext_GetInput, KernelContext_GetInput_t)(context, 1, &w_value));
    int64_t dims[8], w_dims[8];
    size_t rank, w_rank;
    CHECK(shape_of(x_value, dims, &rank));
    CHECK(shape_of(w_value, w_dims, &w_rank));
    if (dims[rank - 1] != kernel->k)
        return fail("QLinear: the last dimension of X is not K");
    const int fmt = kernel->fmt;
    if (w_rank != 3 || w_dims[0] != (kernel->n + TILE - 1) / TILE ||
        w_dims[1] != kernel->k / (IS_K(fmt) ? 256 : BLOCK) ||
        w_dims[2] != (IS_K(fmt) ? SUPER_BYTES(fmt) : TILE_BLOCK_BYTES(fmt)))
        return fail(fmt == FMT_Q4    ? "QLinear: W must be (ceil(N / 32), K / 32, 640) for bits 4"
                    : fmt == FMT_Q5  ? "QLinear: W must be (ceil(N / 32), K / 32, 768) for bits 5"
                    : fmt == FMT_Q8  ? "QLinear: W must be (ceil(N / 32), K / 32, 1152) for bits 8"
                    : fmt == FMT_Q6K ? "QLinear: W must be (ceil(N / 32), K / 256, 6720) for Q6_K"
                    : fmt == FMT_Q5K ? "QLinear: W must be (ceil(N / 32), K / 256, 5760) for Q5_K"
                                     : "QLinear: W must be (ceil(N / 32), K / 256, 4736) for Q4_K");
    int64_t m = 1;
    for (size_t i = 0; i + 1 < rank; i++)
        m *= dims[i];
    dims[rank - 1] = kernel->n;
    OrtValue *y_value;
    CHECK(API(API_KernelContext_GetOutput, KernelContext_GetOutput_t)(context, 0, dims, rank, &y_value));
    void *x, *w, *y;
    CHECK(API(API_GetTensorMutableData, GetTensorMutableData_t)((OrtValue *)x_value, &x));
    CHECK(API(API_GetTensorMutableData, GetTensorMutableData_t)((OrtValue *)w_value, &w));
    CHECK(API(API_GetTensorMutableData, GetTensorMutableData_t)(y_value, &y));
    if (m == 0)
        return NULL;
    Job job = {(const float *)x, (const uint8_t *)w, (float *)y, m, kernel->k, kernel->n, fmt, kernel->xbits,
               NULL, NULL, NULL, NULL};
    const size_t tasks = (size_t)((kernel->n + TILE - 1) / TILE);
    if (!kernel->xbits)
        return API(API_KernelContext_ParallelFor, KernelContext_ParallelFor_t)(context, run_task, tasks, 0, &job);
#if defined(QL_INT)
    void *scratch = integer_scratch(&job);
    if (scratch == NULL)
        return API(API_CreateStatus, CreateStatus_t)(ORT_FAIL, "QLinear: out of memory");
    OrtStatus *status = NULL;
    if (m < 16) {
        for (size_t r = 0; r < (size_t)m; r++)
            quantize_task(&job, r);
    } else {
        status = API(API_KernelContext_ParallelFor, KernelContext_ParallelFor_t)(context, quantize_task, (size_t)m, 0, &job);
    }
    if (status == NULL)
        status = API(API_KernelContext_ParallelFor, KernelContext_ParallelFor_t)(context, run_task, tasks, 0, &job);
    free(scratch);
    return status;
#else
    return fail("QLinear: this build has no integer products");
#endif
}

static const char *op_name(const void *op) { (void)op; return "QLinear"; }
static int input_type(const void *op, size_t index) { (void)op; return index == 0 ? ELEM_FLOAT : ELEM_UINT8; }
static size_t input_count(const void *op) { (void)op; return 2; }
static int output_type(const void *op, size_t index) { (void)op; (void)index; return ELEM_FLOAT; }
static size_t output_count(const void *op) { (void)op; return 1; }

const CustomOp exo_qlinear_op =
    EXO_CUSTOM_OP(op_name, input_type, input_count, output_type, output_count, create_kernel, compute);
