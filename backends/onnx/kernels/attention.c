/* exo-tui's ONNX Runtime custom op "Attention" (domain "exo.tui"): rotary embedding, the in-place
   KV cache and causal attention, as com.microsoft's GroupQueryAttention with do_rotary=1 and
   rotary_interleaved=1 computes them for exo-tui's graphs, with the cost of a row of a batch that
   of the row itself.

   Inputs: qkv float32 (B, T, (H + 2 G) D), the rows' queries, keys and values side by side (H query
   heads, G key/value heads, D per head); past_key, past_value (B, G, cap, D), float32, or float16
   for the op "AttentionF16" (the same kernel: keys and values rounded to float16 as they are
   stored and widened as they are read, half the bytes, which at long contexts are most of what a
   decode step reads; the math stays float32); seqlens_k int32 (B,): each row's cached positions +
   T - 1; total_seq_len int32 (a scalar, the largest cached + T: checked); cos, sin float32
   (max_pos, D / 2); slots int32 (B,): the cache slot of each row. The caches hold S >= B slots,
   (S, G, cap, D): row b reads and appends to slot slots[b], so a batch is any set of requests of a
   pool of caches, with no padding rows for the slots between them. Rows of one token (T = 1) may
   share a slot at distinct positions: a request's several tokens (a verify step's, beside other
   requests' decode steps), each attending to the cache and to the rows before it, as one row of
   those tokens would (every row's keys are written before any row attends: the phases below).
   Attributes num_heads (H) and kv_num_heads (G); optional scale (the queries' factor, default
   1 / sqrt(D)) and window (> 0: a query at p sees only the keys at p - window + 1 .. p, and the
   caches are rings: position p lives at p % cap, so a cache of cap >= window positions holds a
   request however long it grows; see run_attention for chunks that would overwrite keys their own
   queries still need). Outputs: float32 (B, T, H D),
   then present_key, present_value (the caches, of the past's type, with the T new positions
   written in: bound to the same buffers as the past ones, they are appended to in place;
   otherwise the past is copied first).

   Token t of row b sits at position p = seqlens_k[b] - (T - 1) + t. Its key is rotated by p's
   angles, adjacent pairs (x[2i], x[2i + 1]) turning by (cos, sin)[p, i], and stored with its value
   at p; its query, rotated alike and scaled by 1 / sqrt(D), attends over positions 0 to p of its
   head's key/value head (query head h reads head h / (H / G)): scores, a softmax with the maximum
   subtracted, the values weighted by it. GroupQueryAttention on CPU runs a small matrix product
   per row and head (~12 us a row a layer for SmolLM2 at 64 positions); here a row's query is a few
   dot products and multiply-adds. Rows, heads and tokens are the tasks of the intra-op pool, each
   computed alone: a row's numbers do not depend on its batch. On AVX-512 the query heads that share
   a key/value head are one task, so each cached key and value is loaded once for all of them
   (loads bound this loop): 20-30 % faster on one thread, the same numbers bit for bit. */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "ort.h"

#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define AT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AT_AVX2 1
#endif

typedef struct {
    const float *qkv;  /* (B, T, (H + 2 G) D) */
    void *keys, *values; /* (S, G, cap, D), float32 or (half) float16: the caches, appended to in place */
    const int32_t *seqlens; /* (B,): cached + T - 1 */
    const int32_t *slots; /* (B,): each row's slot of the caches */
    const float *cos, *sin; /* (max_pos, D / 2) */
    float *out; /* (B, T, H D) */
    int64_t b, t, h, g, d, cap, max_pos;
    float scale;
    int half; /* the caches hold float16 (AttentionF16), else float32 */
    int64_t window; /* > 0: a query at p sees the keys at p - window + 1 .. p (a sliding window) */
} Attn;

/* The first key a query at pos sees. */
static inline int64_t first_key(const Attn *a, int64_t pos) { return a->window > 0 && pos >= a->window ? pos - a->window + 1 : 0; }

/* Where position pos sits in a cache row: p % cap on a windowed layer's ring, else p itself (the
   same index while p < cap, so a ring that has not wrapped is an ordinary cache). */
static inline int64_t slot_of(const Attn *a, int64_t pos) { return a->window > 0 ? pos % a->cap : pos; }

/* The rows a query sees, in order: n1 rows from a, then the rest from b (a ring's window that runs
   past its last row goes on at its first; n1 is all of them where it does not). Keys and values
   each have one; the loops over them run over the two parts in turn. */
typedef struct {
    const void *a, *b;
    int64_t n1;
} Span;

static inline const void *span_part(Span sp, int part) { return part ? sp.b : sp.a; }

#if defined(AT_AVX512)
/* exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), r in [-ln2/2, ln2/2], ~1 ulp */
static inline __m512 exp_ps(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

#define MAX_D 256

/* dst[i] = x[i] rounded to float16, i < n. */
static void to_half(uint16_t *dst, const float *x, int64_t n)
{
    int64_t i = 0;
#if defined(AT_AVX512)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(AT_AVX2)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        dst[i] = float_to_half(x[i]);
}

/* Element `index` of a cache of float32 or (half) float16 values, and the float at i from it. */
static inline const void *kv_row(const void *cache, int64_t index, const int half)
{
    return (const char *)cache + index * (half ? 2 : 4);
}

static inline float kv_at(const void *row, int64_t i, const int half)
{
    return half ? half_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* x (n floats) into a cache at element `index`, rounded to float16 where half. */
static void kv_store(void *cache, int64_t index, const float *x, int64_t n, const int half)
{
    if (half)
        to_half((uint16_t *)cache + index, x, n);
    else
        memcpy((float *)cache + index, x, (size_t)n * sizeof(float));
}

static inline int64_t position(const Attn *a, int64_t b, int64_t t) { return (int64_t)a->seqlens[b] - (a->t - 1) + t; }

/* Where row b's key/value head g starts in the caches, in elements. */
static inline int64_t cache_at(const Attn *a, int64_t b, int64_t g) { return ((int64_t)a->slots[b] * a->g + g) * a->cap * a->d; }

/* The rows of row b's kv head g in `cache` (keys or values) that a query sees: positions lo ..
   lo + n - 1, from slot_of(lo) on, wrapping to the ring's first row where they run past its end. */
static inline Span span(const Attn *a, const void *cache, int64_t b, int64_t g, int64_t lo, int64_t n, int half)
{
    const int64_t first = slot_of(a, lo), head = cache_at(a, b, g);
    const int64_t n1 = first + n <= a->cap ? n : a->cap - first;
    return (Span){kv_row(cache, (head + first * a->d), half), kv_row(cache, head, half), n1};
}

/* x (D) rotated in place by the angle of position pos, adjacent pairs (x[2i], x[2i + 1]). */
static void rotate(float *x, const Attn *a, int64_t pos)
{
    const float *c = a->cos + pos * (a->d / 2), *s = a->sin + pos * (a->d / 2);
    for (int64_t i = 0; i < a->d / 2; i++) {
        const float x0 = x[2 * i], x1 = x[2 * i + 1];
        x[2 * i] = x0 * c[i] - x1 * s[i];
        x[2 * i + 1] = x0 * s[i] + x1 * c[i];
    }
}

/* Phase 1, task (b, g): the T new keys (rotated) and values of kv head g into the caches. */
static void append_task(void *arg, size_t task)
{
    const Attn *a = (const Attn *)arg;
    const int64_t b = (int64_t)task / a->g, g = (int64_t)task % a->g, width = (a->h + 2 * a->g) * a->d;
    for (int64_t t = 0; t < a->t; t++) {
        const int64_t pos = position(a, b, t);
        if (pos < 0 || (a->window <= 0 && pos >= a->cap) || pos >= a->max_pos)
            continue; /* checked before: cannot happen */
        const float *row = a->qkv + (b * a->t + t) * width;
        float k[MAX_D];
        memcpy(k, row + (a->h + g) * a->d, (size_t)a->d * sizeof(float));
        rotate(k, a, pos);
        const int64_t at = cache_at(a, b, g) + slot_of(a, pos) * a->d;
        kv_store(a->keys, at, k, a->d, a->half);
        kv_store(a->values, at, row + (a->h + a->g + g) * a->d, a->d, a->half);
    }
}

#if defined(AT_AVX512)
/* s[j] = exp(s[j] - top) for j < n; returns their sum. */
static float softmax_numerators(float *s, int64_t n, float top)
{
    __m512 total = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(top);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
        _mm512_storeu_ps(s + j, e);
        total = _mm512_add_ps(total, e);
    }
    if (j < n) {
        const __mmask16 mask = (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), m));
        _mm512_mask_storeu_ps(s + j, mask, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
    }
    return _mm512_reduce_add_ps(total);
}
#endif


#if defined(AT_AVX2)
/* exp_ps's 8-wide twin (AVX2 has no scalef: 2^n is built in the exponent bits; x >= -87 keeps n + 127 >= 1) */
static inline __m256 exp8_ps(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 kv_load8(const void *row, int64_t i, const int half)
{
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)))
                : _mm256_loadu_ps((const float *)row + i);
}

static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* One head on AVX2, D (a multiple of 8) floats: attend_task's AVX-512 loop 8 wide. Without it the
   plain loops run, whose dot products the compiler cannot vectorize (a float sum may not be
   reordered): ~42 ns a position and head, against ~6 here (one thread, 1000 positions). */
static inline __attribute__((always_inline)) void attend8(const float *q, const Span keys, const Span values,
                                                          int64_t n, float *s, float *y, const int64_t D, const int half)
{
    const int64_t C = D / 8;
    __m256 qv[MAX_D / 8];
    for (int64_t i = 0; i < C; i++)
        qv[i] = _mm256_loadu_ps(q + 8 * i);
    float top = -INFINITY;
    for (int part = 0; part < 2; part++) {
        const void *rows = span_part(keys, part);
        const int64_t lo = part ? keys.n1 : 0, hi = part ? n : keys.n1;
        for (int64_t j = lo; j < hi; j++) {
            const void *k = kv_row(rows, (j - lo) * D, half);
            __m256 even = _mm256_mul_ps(qv[0], kv_load8(k, 0, half)), odd = _mm256_setzero_ps();
            int64_t i = 1;
            for (; i + 1 < C; i += 2) { /* two chains of multiply-adds, not one eight long */
                odd = _mm256_fmadd_ps(qv[i], kv_load8(k, 8 * i, half), odd);
                even = _mm256_fmadd_ps(qv[i + 1], kv_load8(k, 8 * (i + 1), half), even);
            }
            if (i < C)
                odd = _mm256_fmadd_ps(qv[i], kv_load8(k, 8 * i, half), odd);
            s[j] = hsum8(_mm256_add_ps(even, odd));
            top = s[j] > top ? s[j] : top;
        }
    }
    __m256 sum = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(top);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum8(sum);
    for (; j < n; j++) {
        s[j] = expf(s[j] - top);
        total += s[j];
    }
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    __m256 o[MAX_D / 8];
    for (int64_t i = 0; i < C; i++)
        o[i] = _mm256_setzero_ps();
    for (int part = 0; part < 2; part++) {
        const void *rows = span_part(values, part);
        const int64_t lo = part ? values.n1 : 0, hi = part ? n : values.n1;
        for (j = lo; j < hi; j++) {
            const __m256 p = _mm256_set1_ps(s[j]);
            const void *v = kv_row(rows, (j - lo) * D, half);
            for (int64_t i = 0; i < C; i++)
                o[i] = _mm256_fmadd_ps(p, kv_load8(v, 8 * i, half), o[i]);
        }
    }
    for (int64_t i = 0; i < C; i++)
        _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(o[i], inv));
}
#endif

#if defined(AT_AVX512)
/* Up to 4 query heads of one key/value head at once, D (a multiple of 16, at most MAX_D) floats a
   head: each key and value row is loaded once for all of them. A head's numbers are the same
   whether it goes alone (R = 1) or grouped: a key's products summed across the head, then across
   the vector; the values weighted key by key. q: the R queries, rotated and scaled; s: R * n
   floats of scratch; y: the R heads' outputs, side by side. */
static inline __m512 kv_load16(const void *row, int64_t i, const int half)
{
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)))
                : _mm512_loadu_ps((const float *)row + i);
}

/* The sums of the 16 lanes of a, b, c and d, added in _mm512_reduce_add_ps's order (so a key's
   score is the same bits whichever keys share its call): lane i with i + 8, then with i + 4, then
   lanes 0 + 2 and 1 + 3, then those two. Thirteen shuffles and adds for four sums, not 32. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d)
{
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1))); /* a, b, c, d: 4 lanes each */
    x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), x));
}

static inline __attribute__((always_inline)) void attend_heads(const float *q, const Span keys, const Span values,
                                                               int64_t n, float *s, float *y, const int64_t R,
                                                               const int64_t D, const int half)
{
    const int64_t C = D / 16;
    __m512 qv[4][MAX_D / 16];
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < C; i++)
            qv[r][i] = _mm512_loadu_ps(q + r * D + 16 * i);
    for (int part = 0; part < 2; part++) {
        const void *rows = span_part(keys, part);
        const int64_t lo = part ? keys.n1 : 0, hi = part ? n : keys.n1;
        for (int64_t j = lo; j < hi; j += 4) { /* four keys at a time: their sums share the shuffles (sum4) */
            __m512 acc[4][4];
            for (int64_t e = 0; e < 4; e++) {
                const void *k = kv_row(rows, ((j + e < hi ? j + e : hi - 1) - lo) * D, half); /* past the end: the last again */
                __m512 kv[MAX_D / 16];
                for (int64_t i = 0; i < C; i++)
                    kv[i] = kv_load16(k, 16 * i, half);
                for (int64_t r = 0; r < R; r++) {
                    __m512 a = _mm512_setzero_ps(); /* + 0: the product itself */
                    for (int64_t i = 0; i < C; i++)
                        a = _mm512_fmadd_ps(qv[r][i], kv[i], a);
                    acc[r][e] = a;
                }
            }
            for (int64_t r = 0; r < R; r++) {
                float four[4];
                _mm_storeu_ps(four, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
                for (int64_t e = 0; e < 4 && j + e < hi; e++)
                    s[r * n + j + e] = four[e];
            }
        }
    }
    float inv[4];
    for (int64_t r = 0; r < R; r++) {
        float *sr = s + r * n, top = -INFINITY;
        for (int64_t j = 0; j < n; j++)
            top = sr[j] > top ? sr[j] : top;
        inv[r] = 1.0f / softmax_numerators(sr, n, top);
    }
    __m512 o[4][MAX_D / 16];
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < C; i++)
            o[r][i] = _mm512_setzero_ps();
    for (int part = 0; part < 2; part++) {
        const void *rows = span_part(values, part);
        const int64_t lo = part ? values.n1 : 0, hi = part ? n : values.n1;
        for (int64_t j = lo; j < hi; j++) {
            const void *v = kv_row(rows, (j - lo) * D, half);
            __m512 vv[MAX_D / 16];
            for (int64_t i = 0; i < C; i++)
                vv[i] = kv_load16(v, 16 * i, half);
            for (int64_t r = 0; r < R; r++) {
                const __m512 p = _mm512_set1_ps(s[r * n + j]);
                for (int64_t i = 0; i < C; i++)
                    o[r][i] = _mm512_fmadd_ps(p, vv[i], o[r][i]);
            }
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < C; i++)
            _mm512_storeu_ps(y + r * D + 16 * i, _mm512_mul_ps(o[r][i], _mm512_set1_ps(inv[r])));
}
#endif

/* Phase 2, task (b, h, t): query t of row b, head h over keys 0..its position. */
static inline __attribute__((always_inline)) void attend_one(void *arg, size_t task, const int half)
{
    const Attn *a = (const Attn *)arg;
    const int64_t t = (int64_t)task % a->t, h = ((int64_t)task / a->t) % a->h, b = (int64_t)task / (a->t * a->h);
    const int64_t d = a->d, g = h / (a->h / a->g), width = (a->h + 2 * a->g) * d, pos = position(a, b, t);
    float *y = a->out + ((b * a->t + t) * a->h + h) * d;
    if (pos < 0 || (a->window <= 0 && pos >= a->cap)) {
        memset(y, 0, (size_t)d * sizeof(float));
        return;
    }
    float q[MAX_D];
    memcpy(q, a->qkv + (b * a->t + t) * width + h * d, (size_t)d * sizeof(float));
    rotate(q, a, pos);
    for (int64_t i = 0; i < d; i++)
        q[i] *= a->scale;
    const int64_t lo = first_key(a, pos), n = pos + 1 - lo;
    const Span keys = span(a, a->keys, b, g, lo, n, half), values = span(a, a->values, b, g, lo, n, half);
    float stack[1024], *s = n <= 1024 ? stack : (float *)malloc((size_t)n * sizeof(float));
    if (s == NULL) {
        memset(y, 0, (size_t)d * sizeof(float));
        return;
    }
    float top = -INFINITY;
#if defined(AT_AVX512)
    if (d % 16 == 0) { /* a head size other than 64 and 128 (those are grouped: attend_group_task) */
        attend_heads(q, keys, values, n, s, y, 1, d, half);
        if (s != stack)
            free(s);
        return;
    }
#elif defined(AT_AVX2)
    if (d % 8 == 0) {
        if (d == 64) /* the constant lets the compiler keep the query and the sums in registers */
            attend8(q, keys, values, n, s, y, 64, half);
        else
            attend8(q, keys, values, n, s, y, d, half);
        if (s != stack)
            free(s);
        return;
    }
#endif
    for (int64_t j = 0; j < n; j++) {
        const void *k = j < keys.n1 ? kv_row(keys.a, j * d, half) : kv_row(keys.b, (j - keys.n1) * d, half);
        float dot = 0.0f;
        for (int64_t i = 0; i < d; i++)
            dot += q[i] * kv_at(k, i, half);
        s[j] = dot;
        top = dot > top ? dot : top;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - top);
        total += s[j];
    }
    for (int64_t i = 0; i < d; i++)
        y[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const void *v = j < values.n1 ? kv_row(values.a, j * d, half) : kv_row(values.b, (j - values.n1) * d, half);
        for (int64_t i = 0; i < d; i++)
            y[i] += s[j] * kv_at(v, i, half);
    }
    for (int64_t i = 0; i < d; i++)
        y[i] /= total;
    if (s != stack)
        free(s);
}

static void attend_task(void *arg, size_t task) { attend_one(arg, task, 0); }
static void attend_task_half(void *arg, size_t task) { attend_one(arg, task, 1); }

#if defined(AT_AVX512)
/* Phase 2 where the heads share loads, task (b, g, t): the query heads of key/value head g. */
static inline __attribute__((always_inline)) void attend_group(void *arg, size_t task, const int half)
{
    const Attn *a = (const Attn *)arg;
    const int64_t t = (int64_t)task % a->t, g = ((int64_t)task / a->t) % a->g, b = (int64_t)task / (a->t * a->g);
    const int64_t d = a->d, per = a->h / a->g, width = (a->h + 2 * a->g) * d, pos = position(a, b, t);
    const int64_t chunk = d == 64 ? 4 : 2; /* heads at once: their queries and sums fit the registers */
    float *y = a->out + ((b * a->t + t) * a->h + g * per) * d;
    const int64_t lo = first_key(a, pos), n = pos + 1 - lo;
    float stack[4096], *s = chunk * n <= 4096 ? stack : (float *)malloc((size_t)(chunk * n) * sizeof(float));
    if (pos < 0 || (a->window <= 0 && pos >= a->cap) || s == NULL) {
        memset(y, 0, (size_t)(per * d) * sizeof(float));
        return;
    }
    float q[4 * 128];
    const Span keys = span(a, a->keys, b, g, lo, n, half), values = span(a, a->values, b, g, lo, n, half);
    for (int64_t h0 = 0; h0 < per; h0 += chunk) {
        const int64_t r = per - h0 < chunk ? per - h0 : chunk;
        for (int64_t i = 0; i < r; i++) {
            float *qi = q + i * d;
            memcpy(qi, a->qkv + (b * a->t + t) * width + (g * per + h0 + i) * d, (size_t)d * sizeof(float));
            rotate(qi, a, pos);
            for (int64_t e = 0; e < d; e++)
                qi[e] *= a->scale;
        }
        float *yh = y + h0 * d;
        if (d == 64) { /* constants: the compiler keeps queries and sums in registers */
            if (r == 4)
                attend_heads(q, keys, values, n, s, yh, 4, 64, half);
            else if (r == 3)
                attend_heads(q, keys, values, n, s, yh, 3, 64, half);
            else if (r == 2)
                attend_heads(q, keys, values, n, s, yh, 2, 64, half);
            else
                attend_heads(q, keys, values, n, s, yh, 1, 64, half);
        } else if (r == 2) {
            attend_heads(q, keys, values, n, s, yh, 2, 128, half);
        } else {
            attend_heads(q, keys, values, n, s, yh, 1, 128, half);
        }
    }
    if (s != stack)
        free(s);
}

static void attend_group_task(void *arg, size_t task) { attend_group(arg, task, 0); }
static void attend_group_task_half(void *arg, size_t task) { attend_group(arg, task, 1); }
#endif

typedef struct {
    void (*run)(void *, size_t);
    size_t tasks;
} Phase;

/* Phase 2's tasks: a query head each, or on AVX-512 (head sizes 64 and 128) the query heads of a
   key/value head together. */
static Phase attend_phase(const Attn *a)
{
#if defined(AT_AVX512)
    if (a->d == 64 || a->d == 128)
        return (Phase){a->half ? attend_group_task_half : attend_group_task, (size_t)(a->b * a->g * a->t)};
#endif
    return (Phase){a->half ? attend_task_half : attend_task, (size_t)(a->b * a->h * a->t)};
}

/* Runs fn over tasks 0 .. n - 1: ONNX Runtime's intra-op pool in the op, a plain loop in the tests. */
typedef OrtStatus *(*Runner)(void *context, void (*fn)(void *, size_t), size_t n, void *arg);

/* A windowed layer's chunk of T > 1 tokens on a ring too short to take them in place (cap <
   window + T - 1: writing its last keys would overwrite keys its first queries still see). The
   chunk runs on a temporary ring of window - 1 + T rows a row of the batch: the window's keys
   before the chunk are copied in (ring_in), the chunk appends and attends there as usual, and its
   new keys go back into the caches (ring_out). The numbers are those of a cache long enough. */
typedef struct {
    const Attn *cache; /* the op's caches */
    Attn *temp; /* the temporary rings, row b in slot b */
} Chunk;

static int64_t elem_size(const Attn *a) { return a->half ? 2 : 4; }

/* Copy positions [lo, hi) of kv head g from ring `from` (of row fb) to ring `to` (of row tb). */
static void copy_positions(const Attn *from, int64_t fb, const Attn *to, int64_t tb, int64_t g, int64_t lo, int64_t hi)
{
    const int64_t e = elem_size(from), row = from->d * e;
    for (int64_t pos = lo; pos < hi; pos++) {
        const int64_t src = (cache_at(from, fb, g) + slot_of(from, pos) * from->d) * e;
        const int64_t dst = (cache_at(to, tb, g) + slot_of(to, pos) * to->d) * e;
        memcpy((char *)to->keys + dst, (const char *)from->keys + src, (size_t)row);
        memcpy((char *)to->values + dst, (const char *)from->values + src, (size_t)row);
    }
}

/* Task (b, g): the window's keys before the chunk, from the caches into the temporary ring. */
static void ring_in(void *arg, size_t task)
{
    const Chunk *c = (const Chunk *)arg;
    const Attn *a = c->cache;
    const int64_t b = (int64_t)task / a->g, g = (int64_t)task % a->g, p0 = position(a, b, 0);
    copy_positions(a, b, c->temp, b, g, p0 - a->window + 1 > 0 ? p0 - a->window + 1 : 0, p0);
}

/* Task (b, g): the chunk's new keys that the caches keep (their last cap), back into them. */
static void ring_out(void *arg, size_t task)
{
    const Chunk *c = (const Chunk *)arg;
    const Attn *a = c->cache;
    const int64_t b = (int64_t)task / a->g, g = (int64_t)task % a->g, p0 = position(a, b, 0), end = position(a, b, a->t - 1) + 1;
    copy_positions(c->temp, b, a, b, g, end - a->cap > p0 ? end - a->cap : p0, end);
}

static int needs_chunk_ring(const Attn *a)
{
    if (a->window <= 0 || a->t <= 1 || a->cap >= a->window + a->t - 1)
        return 0;
    for (int64_t i = 0; i < a->b; i++)
        if ((int64_t)a->seqlens[i] >= a->cap) /* this row's chunk wraps the ring */
            return 1;
    return 0;
}

/* Append the rows' new keys and values, then attend (both phases through `run`). */
static OrtStatus *run_attention(Attn *a, Runner run, void *context)
{
    if (!needs_chunk_ring(a)) {
        CHECK(run(context, append_task, (size_t)(a->b * a->g), a));
        const Phase phase = attend_phase(a);
        return run(context, phase.run, phase.tasks, a);
    }
    Attn temp = *a;
    temp.cap = a->window + a->t - 1;
    const size_t bytes = (size_t)(a->b * a->g * temp.cap * a->d * elem_size(a));
    int32_t *slots = (int32_t *)malloc((size_t)a->b * sizeof(int32_t));
    temp.keys = malloc(bytes);
    temp.values = malloc(bytes);
    OrtStatus *status = NULL;
    if (slots == NULL || temp.keys == NULL || temp.values == NULL) {
        status = api != NULL ? fail("Attention: out of memory for a windowed chunk's keys") : NULL;
    } else {
        for (int64_t i = 0; i < a->b; i++)
            slots[i] = (int32_t)i;
        temp.slots = slots;
        Chunk chunk = {a, &temp};
        status = run(context, ring_in, (size_t)(a->b * a->g), &chunk);
        if (status == NULL)
            status = run(context, append_task, (size_t)(a->b * a->g), &temp);
        if (status == NULL) {
            const Phase phase = attend_phase(&temp);
            status = run(context, phase.run, phase.tasks, &temp);
        }
        if (status == NULL)
            status = run(context, ring_out, (size_t)(a->b * a->g), &chunk);
    }
    free(slots);
    free(temp.keys);
    free(temp.values);
    return status;
}

static OrtStatus *run_here(void *context, void (*fn)(void *, size_t), size_t n, void *arg)
{
    (void)context;
    for (size_t i = 0; i < n; i++)
        fn(arg, i);
    return NULL;
}

static OrtStatus *run_in_pool(void *context, void (*fn)(void *, size_t), size_t n, void *arg)
{
    return API(API_KernelContext_ParallelFor, KernelContext_ParallelFor_t)((const OrtKernelContext *)context, fn, n, 0, arg);
}

/* For the tests: the caches' rounding to float16 (to_half) of n floats. */
void exo_to_half(const float *x, uint16_t *out, int64_t n) { to_half(out, x, n); }

/* For the tests: the same computation without ONNX Runtime, on one thread; half: the caches are
   float16 (else float32); slots: each row's slot of the caches (the checks of compute() are the
   caller's). */
void exo_attention(const float *qkv, void *keys, void *values, const int32_t *seqlens, const int32_t *slots,
                   const float *cos, const float *sin, float *out, int64_t b, int64_t t, int64_t h, int64_t g, int64_t d,
                   int64_t cap, int64_t max_pos, int64_t half, float scale, int64_t window)
{
    Attn a = {qkv, keys, values, seqlens, slots, cos, sin, out, b, t, h, g, d, cap, max_pos,
              scale > 0.0f ? scale : 1.0f / sqrtf((float)d), half != 0, window};
    OrtStatus *status = run_attention(&a, run_here, NULL);
    (void)status; /* NULL, or out of memory: the tests' outputs then disagree */
}

/* ------------------------------------------------------------------ the op */

typedef struct {
    int64_t heads, kv_heads;
    int half; /* AttentionF16: float16 caches */
    float scale; /* the queries' scale (attribute "scale"; 0: 1 / sqrt(head_size)) */
    int64_t window; /* attribute "window": a sliding window of that many positions (0: none) */
} Kernel;

static OrtStatus *create_kernel(const void *op, OrtApiTable *given, const OrtKernelInfo *info, void **out)
{
    (void)given;
    Kernel *kernel = (Kernel *)calloc(1, sizeof(Kernel));
    if (kernel == NULL)
        return API(API_CreateStatus, CreateStatus_t)(ORT_FAIL, "Attention: out of memory");
    OrtStatus *status = int_attribute(info, "num_heads", &kernel->heads);
    if (status == NULL)
        status = int_attribute(info, "kv_num_heads", &kernel->kv_heads);
    if (status == NULL && (kernel->kv_heads <= 0 || kernel->heads <= 0 || kernel->heads % kernel->kv_heads != 0))
        status = fail("Attention: num_heads must be a positive multiple of kv_num_heads");
    if (status != NULL) {
        free(kernel);
        return status;
    }
    kernel->half = op == (const void *)&exo_attention_f16_op;
    optional_float_attribute(info, "scale", &kernel->scale);
    optional_int_attribute(info, "window", &kernel->window);
    if (kernel->scale < 0.0f || kernel->window < 0) {
        free(kernel);
        return fail("Attention: scale and window must not be negative");
    }
    *out = kernel;
    return NULL;
}

/* Why two rows of one token (T = 1) at positions p and q may not share a slot, or NULL where they
   may: they are one request's tokens at distinct positions (a verify step's rows beside other
   requests' decode steps), and on a ring (window > 0) the later one's key does not overwrite a
   key the earlier one's query sees (rows sharing a slot are at most cap - window apart). */
static const char *shared_slot(int64_t t, int64_t p, int64_t q, int64_t cap, int64_t window)
{
    if (t != 1)
        return "is another row's (rows share a slot only with one token each)";
    if (p == q)
        return "is another row's at the same position";
    const int64_t lo = p < q ? p : q, hi = p < q ? q : p;
    if (window > 0 && hi - cap >= (lo >= window ? lo - window + 1 : 0))
        return "is another row's too far ahead on the ring (its key would overwrite one the other sees)";
    return NULL;
}

static OrtStatus *input(OrtKernelContext *context, size_t index, const OrtValue **value, void **data)
{
    CHECK(API(API_KernelContext_GetInput, KernelContext_GetInput_t)(context, index, value));
    return API(API_GetTensorMutableData, GetTensorMutableData_t)((OrtValue *)*value, data);
}

static OrtStatus *compute(void *arg, OrtKernelContext *context)
{
    const Kernel *kernel = (const Kernel *)arg;
    const OrtValue *qkv_value, *pk_value, *pv_value, *seq_value, *total_value, *cos_value, *sin_value, *slot_value;
    void *qkv, *pk, *pv, *seq, *total, *cos, *sin, *slot;
    CHECK(input(context, 0, &qkv_value, &qkv));
    CHECK(input(context, 1, &pk_value, &pk));
    CHECK(input(context, 2, &pv_value, &pv));
    CHECK(input(context, 3, &seq_value, &seq));
    CHECK(input(context, 4, &total_value, &total));
    CHECK(input(context, 5, &cos_value, &cos));
    CHECK(input(context, 6, &sin_value, &sin));
    CHECK(input(context, 7, &slot_value, &slot));
    int64_t q_dims[8], k_dims[8], v_dims[8], s_dims[8], c_dims[8], n_dims[8], l_dims[8];
    size_t q_rank, k_rank, v_rank, s_rank, c_rank, n_rank, l_rank;
    CHECK(shape_of(qkv_value, q_dims, &q_rank));
    CHECK(shape_of(pk_value, k_dims, &k_rank));
    CHECK(shape_of(pv_value, v_dims, &v_rank));
    CHECK(shape_of(seq_value, s_dims, &s_rank));
    CHECK(shape_of(cos_value, c_dims, &c_rank));
    CHECK(shape_of(sin_value, n_dims, &n_rank));
    CHECK(shape_of(slot_value, l_dims, &l_rank));
    const int64_t h = kernel->heads, g = kernel->kv_heads, parts = h + 2 * g;
    if (q_rank != 3 || q_dims[2] % parts != 0)
        return fail("Attention: qkv must be (B, T, (num_heads + 2 kv_num_heads) * head_size)");
    const int64_t b = q_dims[0], t = q_dims[1], d = q_dims[2] / parts;
    if (d < 2 || d % 2 != 0 || d > MAX_D)
        return fail("Attention: the head size must be even and at most 256");
    if (k_rank != 4 || k_dims[1] != g || k_dims[3] != d || v_rank != 4 || memcmp(k_dims, v_dims, 4 * sizeof(int64_t)) != 0)
        return fail("Attention: past_key and past_value must be (slots, kv_num_heads, capacity, head_size)");
    if (s_rank != 1 || s_dims[0] != b)
        return fail("Attention: seqlens_k must be (B,)");
    if (l_rank != 1 || l_dims[0] != b)
        return fail("Attention: slots must be (B,)");
    const int32_t *slots = (const int32_t *)slot;
    const int32_t *seqlens = (const int32_t *)seq;
    const int64_t cap = k_dims[2];
    for (int64_t i = 0; i < b; i++) {
        const char *why = slots[i] < 0 || slots[i] >= k_dims[0] ? "is outside the caches'" : NULL;
        for (int64_t j = 0; j < i && why == NULL; j++)
            if (slots[j] == slots[i])
                why = shared_slot(t, seqlens[i], seqlens[j], cap, kernel->window);
        if (why != NULL) {
            char message[240];
            snprintf(message, sizeof message, "Attention: row %lld's slot %lld %s (%lld slots)", (long long)i,
                     (long long)slots[i], why, (long long)k_dims[0]);
            return fail(message);
        }
    }
    if (c_rank != 2 || c_dims[1] != d / 2 || n_rank != 2 || memcmp(c_dims, n_dims, 2 * sizeof(int64_t)) != 0)
        return fail("Attention: cos and sin must be (max_position, head_size / 2)");
    const int64_t max_pos = c_dims[0], limit = *(const int32_t *)total;
    for (int64_t i = 0; i < b; i++) {
        const int64_t last = seqlens[i];
        if (last - (t - 1) < 0 || (last >= cap && (kernel->window <= 0 || cap < kernel->window)) || last >= max_pos
            || last >= limit) {
            char message[200];
            snprintf(message, sizeof message,
                     "Attention: row %lld's positions %lld..%lld are outside the cache (%lld; a windowed layer's ring "
                     "holds at least its window), the rotary tables (%lld) or total_seq_len (%lld)", (long long)i, (long long)(last - (t - 1)), (long long)last,
                     (long long)cap, (long long)max_pos, (long long)limit);
            return fail(message);
        }
    }
    OrtValue *y_value, *ok_value, *ov_value;
    const int64_t y_dims[3] = {b, t, h * d};
    CHECK(API(API_KernelContext_GetOutput, KernelContext_GetOutput_t)(context, 0, y_dims, 3, &y_value));
    CHECK(API(API_KernelContext_GetOutput, KernelContext_GetOutput_t)(context, 1, k_dims, 4, &ok_value));
    CHECK(API(API_KernelContext_GetOutput, KernelContext_GetOutput_t)(context, 2, k_dims, 4, &ov_value));
    void *y, *ok, *ov;
    CHECK(API(API_GetTensorMutableData, GetTensorMutableData_t)(y_value, &y));
    CHECK(API(API_GetTensorMutableData, GetTensorMutableData_t)(ok_value, &ok));
    CHECK(API(API_GetTensorMutableData, GetTensorMutableData_t)(ov_value, &ov));
    const size_t cache_bytes = (size_t)(k_dims[0] * g * cap * d) * (kernel->half ? sizeof(uint16_t) : sizeof(float));
    if (ok != pk) /* not bound in place: the present starts as a copy of the past */
        memcpy(ok, pk, cache_bytes);
    if (ov != pv)
        memcpy(ov, pv, cache_bytes);
    if (b == 0 || t == 0)
        return NULL;
    Attn a = {(const float *)qkv, ok, ov, seqlens, slots, (const float *)cos, (const float *)sin, (float *)y,
              b, t, h, g, d, cap, max_pos, kernel->scale > 0.0f ? kernel->scale : 1.0f / sqrtf((float)d), kernel->half,
              kernel->window};
    return run_attention(&a, run_in_pool, context);
}

/* Two ops, one kernel: Attention on float32 caches, AttentionF16 on float16 ones. */
static const char *op_name(const void *op) { return op == (const void *)&exo_attention_f16_op ? "AttentionF16" : "Attention"; }
static int kv_type(const void *op) { return op == (const void *)&exo_attention_f16_op ? ELEM_FLOAT16 : ELEM_FLOAT; }
static int input_type(const void *op, size_t index)
{
    return index == 3 || index == 4 || index == 7 ? ELEM_INT32 : index == 1 || index == 2 ? kv_type(op) : ELEM_FLOAT;
}
static size_t input_count(const void *op) { (void)op; return 8; }
static int output_type(const void *op, size_t index) { return index == 0 ? ELEM_FLOAT : kv_type(op); }
static size_t output_count(const void *op) { (void)op; return 3; }

const CustomOp exo_attention_op =
    EXO_CUSTOM_OP(op_name, input_type, input_count, output_type, output_count, create_kernel, compute);
const CustomOp exo_attention_f16_op =
    EXO_CUSTOM_OP(op_name, input_type, input_count, output_type, output_count, create_kernel, compute);
