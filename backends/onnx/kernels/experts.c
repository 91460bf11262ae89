/* exo-tui's ONNX Runtime custom op for a mixture of experts whose matrices stay in GGUF's blocks:
   the router's choice and each chosen expert's SwiGLU MLP, each expert run once per step on all
   the rows routed to it, reading only the chosen experts' tiles.

   Op "Experts" in domain "exo.tui". Inputs: X float32 (..., H); L float32 (..., E), the router's
   logits of each row; W1 uint8 (E, ceil(2F / 32), ...): each expert's gate rows then its up rows
   as one QLinear matrix (2F columns over K = H, tiles as qlinear.c lays them out, format bits1 /
   kquant1); W2 uint8 (E, ceil(H / 32), ...): each expert's down matrix (H columns over K = F,
   format bits2 / kquant2). Attributes H, F, k (experts per row), norm (1: the chosen weights
   renormalised to sum to 1), bits1, kquant1, bits2, kquant2, xbits (QLinear's precision). Output
   Y float32 (..., H):

       p = softmax(L[r]);  c = the k largest of p (ties to the lower expert);  w = p[c] (/ sum)
       Y[r] = sum over j in 0..k-1 of w[j] * down_c[j](silu(gate_c[j](X[r])) * up_c[j](X[r]))

   in that order of j (the largest weight first). A step gathers each chosen expert's rows into
   one block, runs the gate/up products of every chosen expert as one ParallelFor over their tiles,
   the activation, then the down products the same way: with several rows (a prompt, a batch of
   decode steps) an expert's tile is read once for all its rows. Every row is reduced the same
   way whatever else is in the step (QLinear's property), so a request's output does not depend
   on its batch. */

#define _DEFAULT_SOURCE /* madvise's advice under -std=c11 */
#include <math.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ort.h"
#include "qlinear.h"

typedef struct {
    int64_t h, f, k, norm, xbits;
    int fmt1, fmt2;
    int advised; /* the weights' pages asked to be huge (huge_pages), once per kernel */
} Experts;

/* Asks Linux to back [p, p + n) with 2 MiB pages and to make them now (MADV_COLLAPSE, 6.1+):
   ONNX Runtime copies the experts into buffers of its own on 4 KiB pages (the bench's qwen3moe
   file: 1.4 GB of its 2.0 GB of anonymous memory), and a step reads its k experts from all over
   them. Measured on that file's shape (128 Q4_K experts, H 2048, F 768, k 8, one row, one
   thread, called directly, 400 alternating calls): 1.065 ms on 2 MiB pages against 1.095 ms on
   4 KiB ones (p10), about 3 %; the collapse costs about 0.4 s at the first step (1.4 GB).
   Advice only (the contents stay as they are); where the kernel cannot, nothing changes. */
static void huge_pages(const void *p, size_t n)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20, lo = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    const uintptr_t hi = ((uintptr_t)p + n) & ~(huge - 1);
    if (hi <= lo)
        return;
    madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
    madvise((void *)lo, hi - lo, MADV_COLLAPSE);
#else
    (void)p, (void)n;
#endif
}

typedef struct {
    QLJob *jobs;      /* one per chosen expert, in expert order */
    int64_t tiles;    /* each job's tiles */
    const int64_t *row_job; /* each gathered row's job, and its row within it */
    const int64_t *row_in;
} Step;

static void tile_task(void *arg, size_t task)
{
    const Step *s = (const Step *)arg;
    ql_tile(&s->jobs[(int64_t)task / s->tiles], (int64_t)task % s->tiles);
}

static void quantize_task(void *arg, size_t row)
{
    const Step *s = (const Step *)arg;
    ql_quantize_row(&s->jobs[s->row_job[row]], s->row_in[row]);
}

/* The k largest of p[0..e) in c (largest first, ties to the lower index) and their weights. */
static void route(const float *logits, int64_t e, int64_t k, int64_t norm, float *p, int64_t *c, float *w)
{
    float top = logits[0];
    for (int64_t i = 1; i < e; i++)
        top = logits[i] > top ? logits[i] : top;
    double sum = 0.0;
    for (int64_t i = 0; i < e; i++)
        sum += (p[i] = expf(logits[i] - top));
    for (int64_t i = 0; i < e; i++)
        p[i] = (float)(p[i] / sum);
    double chosen = 0.0;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < e; i++)
            if (p[i] != -1.0f && (best < 0 || p[i] > p[best])) /* NaN logits too: each row gets k experts */
                best = i;
        c[j] = best;
        w[j] = p[best];
        chosen += p[best];
        p[best] = -1.0f; /* taken */
    }
    if (norm)
        for (int64_t j = 0; j < k; j++)
            w[j] = (float)(w[j] / chosen);
}

/* Runs one product per chosen expert (jobs[0..active)): the rows' codes first at the integer
   precisions, then every job's tiles, on the session's threads (context NULL: on this one).
   Returns 0, -1 out of memory, -2 ONNX Runtime's error in *status. */
static int run_jobs(OrtKernelContext *context, OrtStatus **status, Step *step, int64_t active, int64_t rows)
{
    void **scratch = (void **)calloc((size_t)active, sizeof(void *));
    if (scratch == NULL)
        return -1;
    int rc = 0;
    if (step->jobs[0].xbits) {
        for (int64_t a = 0; a < active && rc == 0; a++)
            if ((scratch[a] = ql_integer_scratch(&step->jobs[a])) == NULL)
                rc = -1;
        if (rc == 0 && (context == NULL || rows < 16))
            for (int64_t r = 0; r < rows; r++)
                quantize_task(step, (size_t)r);
        else if (rc == 0 && (*status = API(API_KernelContext_ParallelFor, KernelContext_ParallelFor_t)(
                                 context, quantize_task, (size_t)rows, 0, step)) != NULL)
            rc = -2;
    }
    const size_t tasks = (size_t)(active * step->tiles);
    if (rc == 0 && context == NULL)
        for (size_t t = 0; t < tasks; t++)
            tile_task(step, t);
    else if (rc == 0 && (*status = API(API_KernelContext_ParallelFor, KernelContext_ParallelFor_t)(
                             context, tile_task, tasks, 0, step)) != NULL)
        rc = -2;
    for (int64_t a = 0; a < active; a++)
        free(scratch[a]);
    free(scratch);
    return rc;
}

/* The op on m rows of x (H each) with their logits (E each) into y. Returns as run_jobs. */
static int forward(const Experts *op, const float *x, const float *logits, const uint8_t *w1, const uint8_t *w2,
                   float *y, int64_t m, int64_t e, OrtKernelContext *context, OrtStatus **status)
{
    const int64_t h = op->h, f = op->f, k = op->k, pairs = m * k;
    const int64_t t1 = (2 * f + 31) / 32, t2 = (h + 31) / 32;
    const int64_t b1 = ql_tile_bytes(op->fmt1, h), b2 = ql_tile_bytes(op->fmt2, f);
    /* one allocation: per pair its expert, gathered row, and that row's job and place in it; per
       expert its count, first row and job; the jobs; per pair its weight; the router's
       probabilities; the gathered rows, their gate/up products, activations and down products */
    const size_t ints = (size_t)(4 * pairs + 3 * e);
    const size_t floats = (size_t)(pairs + e + pairs * h + pairs * 2 * f + pairs * f + pairs * h);
    char *mem = (char *)malloc(ints * sizeof(int64_t) + (size_t)e * sizeof(QLJob) + floats * sizeof(float));
    if (mem == NULL)
        return -1;
    int64_t *chosen = (int64_t *)mem, *gathered = chosen + pairs, *row_job = gathered + pairs, *row_in = row_job + pairs;
    int64_t *count = row_in + pairs, *first = count + e, *job_of = first + e;
    QLJob *jobs = (QLJob *)(job_of + e);
    float *weight = (float *)(jobs + e), *probs = weight + pairs, *xg = probs + e;
    float *g = xg + pairs * h, *act = g + pairs * 2 * f, *d = act + pairs * f;

    memset(count, 0, (size_t)e * sizeof(int64_t));
    for (int64_t r = 0; r < m; r++) {
        route(logits + r * e, e, k, op->norm, probs, chosen + r * k, weight + r * k);
        for (int64_t j = 0; j < k; j++)
            count[chosen[r * k + j]]++;
    }
    int64_t active = 0, next = 0;
    for (int64_t i = 0; i < e; i++) {
        first[i] = next;
        next += count[i];
        job_of[i] = count[i] ? active++ : -1;
        count[i] = 0; /* counted again below, as each expert's rows are placed */
    }
    for (int64_t r = 0; r < m; r++) /* each expert's rows in row order */
        for (int64_t j = 0; j < k; j++) {
            const int64_t i = chosen[r * k + j], at = first[i] + count[i]++;
            gathered[r * k + j] = at;
            row_job[at] = job_of[i];
            row_in[at] = count[i] - 1;
            memcpy(xg + at * h, x + r * h, (size_t)h * sizeof(float));
        }

    Step step = {jobs, t1, row_job, row_in};
    for (int64_t i = 0; i < e; i++)
        if (job_of[i] >= 0)
            jobs[job_of[i]] = (QLJob){xg + first[i] * h, w1 + i * t1 * b1, g + first[i] * 2 * f, count[i], h, 2 * f,
                                      op->fmt1, op->xbits, NULL, NULL, NULL, NULL};
    int rc = run_jobs(context, status, &step, active, pairs);
    if (rc == 0) {
        for (int64_t p = 0; p < pairs; p++) { /* silu(gate) * up */
            const float *gp = g + p * 2 * f;
            float *ap = act + p * f;
            for (int64_t c = 0; c < f; c++)
                ap[c] = gp[c] / (1.0f + expf(-gp[c])) * gp[f + c];
        }
        step.tiles = t2;
        for (int64_t i = 0; i < e; i++)
            if (job_of[i] >= 0)
                jobs[job_of[i]] = (QLJob){act + first[i] * f, w2 + i * t2 * b2, d + first[i] * h, count[i], f, h,
                                          op->fmt2, op->xbits, NULL, NULL, NULL, NULL};
        rc = run_jobs(context, status, &step, active, pairs);
    }
    if (rc == 0)
        for (int64_t r = 0; r < m; r++) { /* each row's experts in the order of their weights */
            float *yr = y + r * h;
            memset(yr, 0, (size_t)h * sizeof(float));
            for (int64_t j = 0; j < k; j++) {
                const float wj = weight[r * k + j], *dp = d + gathered[r * k + j] * h;
                for (int64_t c = 0; c < h; c++)
                    yr[c] += wj * dp[c];
            }
        }
    free(mem);
    return rc;
}

static OrtStatus *compute(void *arg, OrtKernelContext *context)
{
    const Experts *op = (const Experts *)arg;
    const OrtValue *values[4];
    int64_t dims[8], l_dims[8], w1_dims[8], w2_dims[8];
    size_t rank, l_rank, w1_rank, w2_rank;
    for (size_t i = 0; i < 4; i++)
        CHECK(API(API_KernelContext_GetInput, KernelContext_GetInput_t)(context, i, &values[i]));
    CHECK(shape_of(values[0], dims, &rank));
    CHECK(shape_of(values[1], l_dims, &l_rank));
    CHECK(shape_of(values[2], w1_dims, &w1_rank));
    CHECK(shape_of(values[3], w2_dims, &w2_rank));
    const int64_t h = op->h, f = op->f, e = l_dims[l_rank - 1];
    if (dims[rank - 1] != h)
        return fail("Experts: the last dimension of X is not H");
    int64_t m = 1, lm = 1;
    for (size_t i = 0; i + 1 < rank; i++)
        m *= dims[i];
    for (size_t i = 0; i + 1 < l_rank; i++)
        lm *= l_dims[i];
    if (lm != m || e < op->k)
        return fail("Experts: L must have one row of at least k logits per row of X");
    if (w1_rank != 3 || w1_dims[0] != e || w1_dims[1] != (2 * f + 31) / 32 || w1_dims[2] != ql_tile_bytes(op->fmt1, h))
        return fail("Experts: W1 must be (E, ceil(2F / 32), a tile's bytes for K = H)");
    if (w2_rank != 3 || w2_dims[0] != e || w2_dims[1] != (h + 31) / 32 || w2_dims[2] != ql_tile_bytes(op->fmt2, f))
        return fail("Experts: W2 must be (E, ceil(H / 32), a tile's bytes for K = F)");
    OrtValue *y_value;
    CHECK(API(API_KernelContext_GetOutput, KernelContext_GetOutput_t)(context, 0, dims, rank, &y_value));
    void *data[5];
    for (size_t i = 0; i < 4; i++)
        CHECK(API(API_GetTensorMutableData, GetTensorMutableData_t)((OrtValue *)values[i], &data[i]));
    CHECK(API(API_GetTensorMutableData, GetTensorMutableData_t)(y_value, &data[4]));
    if (m == 0)
        return NULL;
    if (__atomic_exchange_n(&((Experts *)op)->advised, 1, __ATOMIC_RELAXED) == 0) {
        huge_pages(data[2], (size_t)(w1_dims[0] * w1_dims[1] * w1_dims[2]));
        huge_pages(data[3], (size_t)(w2_dims[0] * w2_dims[1] * w2_dims[2]));
    }
    OrtStatus *status = NULL;
    const int rc = forward(op, (const float *)data[0], (const float *)data[1], (const uint8_t *)data[2],
                           (const uint8_t *)data[3], (float *)data[4], m, e, context, &status);
    if (rc == -1)
        return API(API_CreateStatus, CreateStatus_t)(ORT_FAIL, "Experts: out of memory");
    return status;
}

static OrtStatus *create_kernel(const void *op_, OrtApiTable *given, const OrtKernelInfo *info, void **out)
{
    (void)op_;
    (void)given;
    Experts *op = (Experts *)calloc(1, sizeof(Experts));
    if (op == NULL)
        return API(API_CreateStatus, CreateStatus_t)(ORT_FAIL, "Experts: out of memory");
    int64_t bits1 = 0, kquant1 = 0, bits2 = 0, kquant2 = 0;
    OrtStatus *status = int_attribute(info, "H", &op->h);
    if (status == NULL)
        status = int_attribute(info, "F", &op->f);
    if (status == NULL)
        status = int_attribute(info, "k", &op->k);
    if (status == NULL)
        status = int_attribute(info, "bits1", &bits1);
    if (status == NULL)
        status = int_attribute(info, "bits2", &bits2);
    if (status == NULL) {
        optional_int_attribute(info, "kquant1", &kquant1);
        optional_int_attribute(info, "kquant2", &kquant2);
        optional_int_attribute(info, "norm", &op->norm);
        optional_int_attribute(info, "xbits", &op->xbits);
        op->fmt1 = ql_format(bits1, kquant1);
        op->fmt2 = ql_format(bits2, kquant2);
        if (op->fmt1 < 0 || op->fmt2 < 0)
            status = fail("Experts: bits must be 4, 5 or 8, or kquant 4, 5 or 6 (Q4_K, Q5_K, Q6_K)");
    }
    if (status == NULL && (op->h <= 0 || op->f <= 0 || op->k <= 0 || op->h % 32 || op->f % 32))
        status = fail("Experts: H and F must be positive multiples of 32, k positive");
    if (status == NULL && ((ql_is_kquant(op->fmt1) && op->h % 256) || (ql_is_kquant(op->fmt2) && op->f % 256)))
        status = fail("Experts: a K-quant matrix needs K (H for gate/up, F for down) a multiple of 256");
    if (status == NULL && op->xbits != 0 && op->xbits != 8 && op->xbits != 16)
        status = fail("Experts: xbits must be 0 (float32), 8 or 16");
    if (status == NULL && op->xbits) {
        QLJob probe = {NULL, NULL, NULL, 1, 32, 32, op->fmt1, op->xbits, NULL, NULL, NULL, NULL};
        void *scratch = ql_integer_scratch(&probe);
        if (scratch == NULL)
            status = fail("Experts: this build has no integer products (they need AVX2 or AVX-512 VNNI)");
        free(scratch);
    }
    if (status != NULL) {
        free(op);
        return status;
    }
    *out = op;
    return NULL;
}

static const char *op_name(const void *op) { (void)op; return "Experts"; }
static int input_type(const void *op, size_t index) { (void)op; return index < 2 ? ELEM_FLOAT : ELEM_UINT8; }
static size_t input_count(const void *op) { (void)op; return 4; }
static int output_type(const void *op, size_t index) { (void)op; (void)index; return ELEM_FLOAT; }
static size_t output_count(const void *op) { (void)op; return 1; }

const CustomOp exo_experts_op =
    EXO_CUSTOM_OP(op_name, input_type, input_count, output_type, output_count, create_kernel, compute);

/* For the tests: the op's computation without ONNX Runtime, on one thread. Returns 0, or -1 if
   it cannot (no such format, no integer products in this build, out of memory). */
int exo_experts(const float *x, const float *logits, const uint8_t *w1, const uint8_t *w2, float *y, int64_t m,
                int64_t e, int64_t h, int64_t f, int64_t k, int64_t norm, int64_t bits1, int64_t kquant1, int64_t bits2,
                int64_t kquant2, int64_t xbits)
{
    const Experts op = {h, f, k, norm, xbits, ql_format(bits1, kquant1), ql_format(bits2, kquant2), 1};
    if (op.fmt1 < 0 || op.fmt2 < 0 || k > e || h % 32 || f % 32)
        return -1;
    if (xbits) {
        QLJob probe = {NULL, NULL, NULL, 1, 32, 32, op.fmt1, xbits, NULL, NULL, NULL, NULL};
        void *scratch = ql_integer_scratch(&probe);
        if (scratch == NULL)
            return -1;
        free(scratch);
    }
    return forward(&op, x, logits, w1, w2, y, m, e, NULL, NULL) == 0 ? 0 : -1;
}
