/* The part of QLinear's kernel (qlinear.c) that other ops of the library run: one matrix product
   y = x @ w.T on W's tiles (see qlinear.c for the layouts), a tile at a time, so an op can hand
   the tiles of several products to one ParallelFor (experts.c: every chosen expert's at once). */

#ifndef EXO_QLINEAR_H
#define EXO_QLINEAR_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const float *x;
    const uint8_t *w;
    float *y;
    int64_t m, k, n;
    int fmt;         /* the tile format: FMT_Q4 ... FMT_Q5 (ql_format) */
    int64_t xbits;   /* 0: X as it is; 16 or 8: X as integer codes, in xq */
    const void *xq;  /* int16_t or int8_t codes, m * k */
    const float *xd, *xs; /* per block: the codes' scale, and the float sum of X */
    const int32_t *xi;    /* per block, int8: the codes' sums of its two halves of 16 */
} QLJob;

int ql_format(int64_t bits, int64_t kquant); /* the tile format, -1 if none */
int ql_is_kquant(int fmt);
int64_t ql_tile_bytes(int fmt, int64_t k);   /* one tile's bytes for K = k */
void ql_tile(const QLJob *job, int64_t tile); /* columns [32 tile, 32 tile + 32) of Y, every row */
void *ql_integer_scratch(QLJob *job);         /* xbits 16 or 8: room for X's codes (free()); NULL if none */
void ql_quantize_row(const QLJob *job, int64_t row); /* row `row` of X to its codes (after ql_integer_scratch) */

#endif
