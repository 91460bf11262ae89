/* The entry point ONNX Runtime calls when a session registers this library: the domain "exo.tui"
   with its ops, QLinear (qlinear.c), Attention and AttentionF16 (attention.c), Experts (experts.c). */

#include "ort.h"

OrtApiTable *api;

OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base)
{
    api = base->GetApi(ORT_API_FOR_THIS);
    if (api == NULL)
        return NULL; /* cannot even make a status: ONNX Runtime older than 1.17 */
    OrtCustomOpDomain *domain;
    CHECK(API(API_CreateCustomOpDomain, CreateCustomOpDomain_t)("exo.tui", &domain));
    CHECK(API(API_CustomOpDomain_Add, CustomOpDomain_Add_t)(domain, &exo_qlinear_op));
    CHECK(API(API_CustomOpDomain_Add, CustomOpDomain_Add_t)(domain, &exo_attention_op));
    CHECK(API(API_CustomOpDomain_Add, CustomOpDomain_Add_t)(domain, &exo_attention_f16_op));
    CHECK(API(API_CustomOpDomain_Add, CustomOpDomain_Add_t)(domain, &exo_experts_op));
    return API(API_AddCustomOpDomain, AddCustomOpDomain_t)(options, domain);
}
