/* The part of ONNX Runtime's C API that exo-tui's kernels use, declared here so the library builds
   without ONNX Runtime's headers. Its tables are append-only: the entries are named by their index
   in struct OrtApi (they hold for API version 17, ONNX Runtime 1.17, and later). */

#ifndef EXO_ORT_H
#define EXO_ORT_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

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
enum { ELEM_FLOAT = 1, ELEM_UINT8 = 2, ELEM_INT32 = 6, ELEM_FLOAT16 = 10 }; /* ONNXTensorElementDataType */
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
    API_KernelInfoGetAttribute_float = 85,
    API_KernelInfoGetAttribute_int64 = 86,
    API_KernelContext_GetInput = 90,
    API_KernelContext_GetOutput = 91,
    API_ReleaseStatus = 93,
    API_ReleaseTensorTypeAndShapeInfo = 99,
    API_KernelContext_ParallelFor = 274,
};

extern OrtApiTable *api; /* set by RegisterCustomOps (register.c) */

#define API(index, type) ((type)api[index])
typedef OrtStatus *(*CreateStatus_t)(int, const char *);
typedef OrtStatus *(*CreateCustomOpDomain_t)(const char *, OrtCustomOpDomain **);
typedef OrtStatus *(*CustomOpDomain_Add_t)(OrtCustomOpDomain *, const void *);
typedef OrtStatus *(*AddCustomOpDomain_t)(OrtSessionOptions *, OrtCustomOpDomain *);
typedef OrtStatus *(*GetTensorMutableData_t)(OrtValue *, void **);
typedef OrtStatus *(*GetDimensionsCount_t)(const OrtTensorTypeAndShapeInfo *, size_t *);
typedef OrtStatus *(*GetDimensions_t)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t);
typedef OrtStatus *(*GetTensorTypeAndShape_t)(const OrtValue *, OrtTensorTypeAndShapeInfo **);
typedef void (*ReleaseStatus_t)(OrtStatus *);
typedef OrtStatus *(*KernelInfoGetAttribute_float_t)(const OrtKernelInfo *, const char *, float *);
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

static inline OrtStatus *fail(const char *message) { return API(API_CreateStatus, CreateStatus_t)(ORT_INVALID_ARGUMENT, message); }

/* The op's integer attribute called name. */
static inline OrtStatus *int_attribute(const OrtKernelInfo *info, const char *name, int64_t *out)
{
    return API(API_KernelInfoGetAttribute_int64, KernelInfoGetAttribute_int64_t)(info, name, out);
}

/* An optional attribute: *out keeps its value where the node has none. */
static inline void optional_int_attribute(const OrtKernelInfo *info, const char *name, int64_t *out)
{
    int64_t value;
    OrtStatus *status = int_attribute(info, name, &value);
    if (status == NULL)
        *out = value;
    else
        API(API_ReleaseStatus, ReleaseStatus_t)(status);
}

static inline void optional_float_attribute(const OrtKernelInfo *info, const char *name, float *out)
{
    float value;
    OrtStatus *status = API(API_KernelInfoGetAttribute_float, KernelInfoGetAttribute_float_t)(info, name, &value);
    if (status == NULL)
        *out = value;
    else
        API(API_ReleaseStatus, ReleaseStatus_t)(status);
}

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

/* The dimensions of a tensor of rank 1 to 8. */
static inline OrtStatus *shape_of(const OrtValue *value, int64_t *dims, size_t *rank)
{
    OrtTensorTypeAndShapeInfo *info;
    CHECK(API(API_GetTensorTypeAndShape, GetTensorTypeAndShape_t)(value, &info));
    OrtStatus *status = API(API_GetDimensionsCount, GetDimensionsCount_t)(info, rank);
    if (status == NULL && (*rank < 1 || *rank > 8))
        status = fail("exo.tui: a tensor must have 1 to 8 dimensions");
    if (status == NULL)
        status = API(API_GetDimensions, GetDimensions_t)(info, dims, *rank);
    API(API_ReleaseTensorTypeAndShapeInfo, ReleaseTensorTypeAndShapeInfo_t)(info);
    return status;
}

/* What every op here answers alike. */
static inline void op_destroy(void *kernel) { free(kernel); }
static inline const char *op_provider(const void *op) { (void)op; return "CPUExecutionProvider"; }
static inline int op_required(const void *op, size_t index) { (void)op; (void)index; return 0; }
static inline int op_cpu_memory(const void *op, size_t index) { (void)op; (void)index; return 0; }
static inline int op_since_version(const void *op) { (void)op; return 1; }

/* An op's table: the callbacks it has of its own, the rest as above. */
#define EXO_CUSTOM_OP(name_fn, input_type_fn, input_count_fn, output_type_fn, output_count_fn, create_fn, compute_fn) \
    {                                                                                                              \
        .version = ORT_API_FOR_THIS, .GetName = name_fn, .GetExecutionProviderType = op_provider,                  \
        .GetInputType = input_type_fn, .GetInputTypeCount = input_count_fn, .GetOutputType = output_type_fn,       \
        .GetOutputTypeCount = output_count_fn, .KernelDestroy = op_destroy, .GetInputCharacteristic = op_required,  \
        .GetOutputCharacteristic = op_required, .GetInputMemoryType = op_cpu_memory, .CreateKernelV2 = create_fn,   \
        .KernelComputeV2 = compute_fn, .GetStartVersion = op_since_version, .GetEndVersion = NULL,                  \
    }

extern const CustomOp exo_qlinear_op, exo_attention_op, exo_attention_f16_op, exo_experts_op;

#endif
