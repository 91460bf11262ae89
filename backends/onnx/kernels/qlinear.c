/* exo-tui's ONNX Runtime custom op: y = x @ w.T for a 4- or 8-bit affine-quantized w, read as it is stored.

   Op "QLinear" in domain "exo.tui". Inputs: X float32 (..., K); W uint8 (N, K / 32, B), one
   B-byte block per 32 weights of a row: the scale s and the bias b as float16, then the codes q.
   Attributes K, N and bits:
     bits 4, B = 20: 16 bytes, the low nibble of byte j being code j and the high nibble code j + 16
                     (GGUF's Q4_1 block; Q4_0 is b = -8 s);
     bits 8, B = 36: 32 bytes, one code each (GGUF's Q8_0 is q = its signed code + 128, b = -128 s).
   Output Y float32 (..., N) with

       y[m, n] = sum over k of x[m, k] * (s * q[n, k] + b)      (float32, as the dequantized matrix)

   Each row of X is reduced in the same order whatever the number of rows, so a request's logits
   do not depend on the batch it ran in. Work is split over output columns on the session's
   intra-op thread pool.

   It talks to ONNX Runtime through its C API, whose tables are append-only: the few entries used
   here are named by their index below (they hold for API version 17, ONNX Runtime 1.17, and
   later), so the library builds without ONNX Runtime's headers. */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
#endif

/* ------------------------------------------------------------------ ONNX Runtime's C API */

typedef struct OrtStatus OrtStatus;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef void *const OrtApiTable; /* struct OrtApi: function pointers only */

typedef struct {
    OrtApiTable *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

enum { ORT_API_FOR_THIS = 17 };
enum { ELEM_FLOAT = 1, ELEM_UINT8 = 2 }; /* ONNXTensorElementDataType */
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 }; /* OrtErrorCode */

/* Indices into struct OrtApi. */
enum {
    API_CreateStatus = 0,
    API_CreateCustomOpDomain = 26,
    API_CustomOpDomain_Add = 27,
    API_AddCustomOpDomain = 28,
    API_GetTensorMutableData = 51,
    API_GetDimensionsCount = 61,
    API_GetDimensions = 62,
    API_GetTensorTypeAndShape = 65,
    API_KernelInfoGetAttribute_int64 = 86,
    API_KernelContext_GetInput = 90,
    API_KernelContext_GetOutput = 91,
    API_ReleaseStatus = 93,
    API_ReleaseTensorTypeAndShapeInfo = 99,
    API_KernelContext_ParallelFor = 274,
};

static OrtApiTable *api;

#define API(index, type) ((type)api[index])
typedef OrtStatus *(*CreateStatus_t)(int, const char *);
typedef OrtStatus *(*CreateCustomOpDomain_t)(const char *, OrtCustomOpDomain **);
typedef OrtStatus *(*CustomOpDomain_Add_t)(OrtCustomOpDomain *, const void *);
typedef OrtStatus *(*AddCustomOpDomain_t)(OrtSessionOptions *, OrtCustomOpDomain *);
typedef OrtStatus *(*GetTensorMutableData_t)(OrtValue *, void **);
typedef OrtStatus *(*GetDimensionsCount_t)(const OrtTensorTypeAndShapeInfo *, size_t *);
typedef OrtStatus *(*GetDimensions_t)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t);
typedef OrtStatus *(*GetTensorTypeAndShape_t)(const OrtValue *, OrtTensorTypeAndShapeInfo **);
typedef OrtStatus *(*KernelInfoGetAttribute_int64_t)(const OrtKernelInfo *, const char *, int64_t *);
typedef OrtStatus *(*KernelContext_GetInput_t)(const OrtKernelContext *, size_t, const OrtValue **);
typedef OrtStatus *(*KernelContext_GetOutput_t)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **);
typedef void (*ReleaseTensorTypeAndShapeInfo_t)(OrtTensorTypeAndShapeInfo *);
typedef OrtStatus *(*KernelContext_ParallelFor_t)(const OrtKernelContext *, void (*)(void *, size_t), size_t,
                                                  size_t, void *);

#define CHECK(call)                      \
    do {                                 \
        OrtStatus *status_ = (call);     \
        if (status_ != NULL)             \
            return status_;              \
    } while (0)

static OrtStatus *fail(const char *message) { return API(API_CreateStatus, CreateStatus_t)(ORT_INVALID_ARGUMENT, message); }

/* struct OrtCustomOp up to the fields of version 17 */
typedef struct {
    uint32_t version;
    void *(*CreateKernel)(const void *op, OrtApiTable *api, const OrtKernelInfo *info);
    const char *(*GetName)(const void *op);
    const char *(*GetExecutionProviderType)(const void *op);
    int (*GetInputType)(const void *op, size_t index);
    size_t (*GetInputTypeCount)(const void *op);
    int (*GetOutputType)(const void *op, size_t index);
    size_t (*GetOutputTypeCount)(const void *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const void *op, size_t index);
    int (*GetOutputCharacteristic)(const void *op, size_t index);
    int (*GetInputMemoryType)(const void *op, size_t index);
    int (*GetVariadicInputMinArity)(const void *op);
    int (*GetVariadicInputHomogeneity)(const void *op);
    int (*GetVariadicOutputMinArity)(const void *op);
    int (*GetVariadicOutputHomogeneity)(const void *op);
    OrtStatus *(*CreateKernelV2)(const void *op, OrtApiTable *api, const OrtKernelInfo *info, void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *context);
    OrtStatus *(*InferOutputShapeFn)(const void *op, void *context);
    int (*GetStartVersion)(const void *op);
    int (*GetEndVersion)(const void *op);
} CustomOp;

/* ------------------------------------------------------------------ the kernel */

#define BLOCK 32
#define ROWS 8 /* rows of X per pass over a row of W */
#define COLS_PER_TASK 32
#define BLOCK_BYTES(bits) ((bits) == 4 ? 20 : 36)

static inline float half_to_float(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(QL_AVX512) || defined(QL_AVX2)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* y[r * ldy] = x[r] . w for rows r < rows (rows <= ROWS), one row w of W (nb blocks): each block
   is dequantized once (s * q + b, float32) and multiplied into every row. */
static inline __attribute__((always_inline)) void dot_rows(const float *x, int64_t k, const uint8_t *w,
                                                            int64_t nb, float *y, int64_t ldy, const int rows,
                                                            const int bits)
{
    const int step = BLOCK_BYTES(bits);
#if defined(QL_AVX512)
    const __m512i low = _mm512_set1_epi32(0x0F);
    __m512 a0[ROWS], a1[ROWS];
    for (int r = 0; r < rows; r++)
        a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += step) {
        const __m512 s = _mm512_set1_ps(half_to_float(w)), c = _mm512_set1_ps(half_to_float(w + 2));
        __m512i q0, q1; /* codes of weights 0-15 and 16-31 */
        if (bits == 4) {
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 4)));
            q0 = _mm512_and_si512(q, low);
            q1 = _mm512_srli_epi32(q, 4);
        } else {
            q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 4)));
            q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 20)));
        }
        const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), s, c);
        const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), s, c);
        const float *xb = x + b * BLOCK;
        for (int r = 0; r < rows; r++) {
            a0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + r * k), w0, a0[r]);
            a1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + r * k + 16), w1, a1[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
#elif defined(QL_AVX2)
    const __m256i low = _mm256_set1_epi32(0x0F);
    __m256 a[ROWS][2];
    for (int r = 0; r < rows; r++)
        a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += step) {
        const __m256 s = _mm256_set1_ps(half_to_float(w)), c = _mm256_set1_ps(half_to_float(w + 2));
        __m256i q[4]; /* codes of weights 0-7, 8-15, 16-23, 24-31 */
        if (bits == 4) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + 4));
            const __m256i lo = _mm256_cvtepu8_epi32(bytes), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
            q[0] = _mm256_and_si256(lo, low);
            q[1] = _mm256_and_si256(hi, low);
            q[2] = _mm256_srli_epi32(lo, 4);
            q[3] = _mm256_srli_epi32(hi, 4);
        } else {
            for (int i = 0; i < 4; i++)
                q[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 4 + 8 * i)));
        }
        __m256 wv[4];
        for (int i = 0; i < 4; i++)
            wv[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[i]), s, c);
        const float *xb = x + b * BLOCK;
        for (int r = 0; r < rows; r++) {
            const float *xr = xb + r * k;
            a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), wv[0], a[r][0]);
            a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), wv[1], a[r][1]);
            a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), wv[2], a[r][0]);
            a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), wv[3], a[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m256 v = _mm256_add_ps(a[r][0], a[r][1]);
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        y[r * ldy] = _mm_cvtss_f32(t);
    }
#else
    float acc[ROWS][BLOCK];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < BLOCK; j++)
            acc[r][j] = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += step) {
        const float s = half_to_float(w), c = half_to_float(w + 2);
        float wf[BLOCK];
        for (int j = 0; j < BLOCK; j++) {
            const int q = bits == 4 ? (j < 16 ? w[4 + j] & 0x0F : w[4 + j - 16] >> 4) : w[4 + j];
            wf[j] = (float)q * s + c;
        }
        const float *xb = x + b * BLOCK;
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < BLOCK; j++)
                acc[r][j] += xb[r * k + j] * wf[j];
    }
    for (int r = 0; r < rows; r++) {
        float sum = 0.0f;
        for (int j = 0; j < BLOCK; j++)
            sum += acc[r][j];
        y[r * ldy] = sum;
    }
#endif
}

typedef void (*dot_fn)(const float *, int64_t, const uint8_t *, int64_t, float *, int64_t);
#define DOT_ROWS(R, BITS)                                                                                  \
    static void dot_##BITS##_##R(const float *x, int64_t k, const uint8_t *w, int64_t nb, float *y, int64_t ldy) \
    {                                                                                                      \
        dot_rows(x, k, w, nb, y, ldy, R, BITS);                                                            \
    }
#define DOTS(BITS)                                                                                           \
    DOT_ROWS(1, BITS) DOT_ROWS(2, BITS) DOT_ROWS(3, BITS) DOT_ROWS(4, BITS) DOT_ROWS(5, BITS) DOT_ROWS(6, BITS) \
    DOT_ROWS(7, BITS) DOT_ROWS(8, BITS)                                                                      \
    static const dot_fn dots_##BITS[ROWS + 1] = {NULL,          dot_##BITS##_1, dot_##BITS##_2, dot_##BITS##_3, \
                                                 dot_##BITS##_4, dot_##BITS##_5, dot_##BITS##_6, dot_##BITS##_7, \
                                                 dot_##BITS##_8};
DOTS(4)
DOTS(8)

typedef struct {
    const float *x;
    const uint8_t *w;
    float *y;
    int64_t m, k, n, bits;
} Job;

/* Columns [task * COLS_PER_TASK, ...) of Y, every row. */
static void run_task(void *arg, size_t task)
{
    const Job *job = (const Job *)arg;
    const int64_t nb = job->k / BLOCK, n0 = (int64_t)task * COLS_PER_TASK, row_bytes = nb * BLOCK_BYTES(job->bits);
    const int64_t n1 = n0 + COLS_PER_TASK < job->n ? n0 + COLS_PER_TASK : job->n;
    const dot_fn *dots = job->bits == 4 ? dots_4 : dots_8;
    for (int64_t m0 = 0; m0 < job->m; m0 += ROWS) {
        const int64_t rows = job->m - m0 < ROWS ? job->m - m0 : ROWS;
        const dot_fn dot = dots[rows];
        for (int64_t n = n0; n < n1; n++)
            dot(job->x + m0 * job->k, job->k, job->w + n * row_bytes, nb, job->y + m0 * job->n + n, job->n);
    }
}

/* For the tests: the same computation without ONNX Runtime, on one thread. */
void exo_qlinear(const float *x, const uint8_t *w, float *y, int64_t m, int64_t k, int64_t n, int64_t bits)
{
    Job job = {x, w, y, m, k, n, bits};
    for (size_t t = 0; t < (size_t)((n + COLS_PER_TASK - 1) / COLS_PER_TASK); t++)
        run_task(&job, t);
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
    int64_t k, n, bits;
} Kernel;

static OrtStatus *create_kernel(const void *op, OrtApiTable *given, const OrtKernelInfo *info, void **out)
{
    (void)op;
    (void)given;
    Kernel *kernel = (Kernel *)calloc(1, sizeof(Kernel));
    if (kernel == NULL)
        return API(API_CreateStatus, CreateStatus_t)(ORT_FAIL, "QLinear: out of memory");
    OrtStatus *status = API(API_KernelInfoGetAttribute_int64, KernelInfoGetAttribute_int64_t)(info, "K", &kernel->k);
    if (status == NULL)
        status = API(API_KernelInfoGetAttribute_int64, KernelInfoGetAttribute_int64_t)(info, "N", &kernel->n);
    if (status == NULL)
        status = API(API_KernelInfoGetAttribute_int64, KernelInfoGetAttribute_int64_t)(info, "bits", &kernel->bits);
    if (status == NULL && (kernel->k <= 0 || kernel->k % BLOCK != 0 || kernel->n <= 0))
        status = fail("QLinear: K must be a positive multiple of 32 and N positive");
    if (status == NULL && kernel->bits != 4 && kernel->bits != 8)
        status = fail("QLinear: bits must be 4 or 8");
    if (status != NULL) {
        free(kernel);
        return status;
    }
    *out = kernel;
    return NULL;
}

static OrtStatus *shape_of(const OrtValue *value, int64_t *dims, size_t *rank)
{
    OrtTensorTypeAndShapeInfo *info;
    CHECK(API(API_GetTensorTypeAndShape, GetTensorTypeAndShape_t)(value, &info));
    OrtStatus *status = API(API_GetDimensionsCount, GetDimensionsCount_t)(info, rank);
    if (status == NULL && (*rank < 1 || *rank > 8))
        status = fail("QLinear: X must have 1 to 8 dimensions");
    if (status == NULL)
        status = API(API_GetDimensions, GetDimensions_t)(info, dims, *rank);
    API(API_ReleaseTensorTypeAndShapeInfo, ReleaseTensorTypeAndShapeInfo_t)(info);
    return status;
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
    if (w_rank != 3 || w_dims[0] != kernel->n || w_dims[1] != kernel->k / BLOCK || w_dims[2] != BLOCK_BYTES(kernel->bits))
        return fail(kernel->bits == 4 ? "QLinear: W must be (N, K / 32, 20) for bits 4" : "QLinear: W must be (N, K / 32, 36) for bits 8");
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
    Job job = {(const float *)x, (const uint8_t *)w, (float *)y, m, kernel->k, kernel->n, kernel->bits};
    const size_t tasks = (size_t)((kernel->n + COLS_PER_TASK - 1) / COLS_PER_TASK);
    return API(API_KernelContext_ParallelFor, KernelContext_ParallelFor_t)(context, run_task, tasks, 0, &job);
}

static void destroy(void *kernel) { free(kernel); }
static const char *op_name(const void *op) { (void)op; return "QLinear"; }
static const char *op_provider(const void *op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const void *op, size_t index) { (void)op; return index == 0 ? ELEM_FLOAT : ELEM_UINT8; }
static size_t input_count(const void *op) { (void)op; return 2; }
static int output_type(const void *op, size_t index) { (void)op; (void)index; return ELEM_FLOAT; }
static size_t output_count(const void *op) { (void)op; return 1; }
static int required(const void *op, size_t index) { (void)op; (void)index; return 0; }
static int cpu_memory(const void *op, size_t index) { (void)op; (void)index; return 0; }
static int since_version(const void *op) { (void)op; return 1; }

static const CustomOp qlinear = {
    .version = ORT_API_FOR_THIS,
    .GetName = op_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = input_type,
    .GetInputTypeCount = input_count,
    .GetOutputType = output_type,
    .GetOutputTypeCount = output_count,
    .KernelDestroy = destroy,
    .GetInputCharacteristic = required,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = cpu_memory,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
    .GetStartVersion = since_version,
    .GetEndVersion = NULL,
};

OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base)
{
    api = base->GetApi(ORT_API_FOR_THIS);
    if (api == NULL)
        return NULL; /* cannot even make a status: ONNX Runtime older than 1.17 */
    OrtCustomOpDomain *domain;
    CHECK(API(API_CreateCustomOpDomain, CreateCustomOpDomain_t)("exo.tui", &domain));
    CHECK(API(API_CustomOpDomain_Add, CustomOpDomain_Add_t)(domain, &qlinear));
    return API(API_AddCustomOpDomain, AddCustomOpDomain_t)(options, domain);
}
