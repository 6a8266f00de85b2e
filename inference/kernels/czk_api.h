/* czk's public interface: the one declaration of its structs and entry points.
 *
 * Included by czk.c and read verbatim by inference/_czk_build.py as the cffi
 * cdef, so the C source and the Python binding cannot disagree. cffi parses
 * it too: keep it to typedefs and prototypes (no preprocessor lines).
 */

typedef struct {
    int kind;
    int bits;
    int64_t group;
    int64_t rows, cols;
    const void *data;
    const uint16_t *scales;
    const uint16_t *mins;
} czk_mat;

typedef struct {
    int n_heads, n_kv, head_dim, rot;
    float eps, scale;
    czk_mat q, k, v, o;
    const float *in_norm, *post_norm, *qb, *kb, *vb;
    int qk_norm;
    float clip;
    const float *q_norm, *k_norm;
    const float *ob;
} czk_attn;

typedef struct czk_pool czk_pool;

int czk_level(void);
void czk_set_cap(int level);
void czk_set_min_work(int64_t w);
void czk_set_attn_share(int on);
czk_pool *czk_pool_new(int n);
int czk_pool_size(const czk_pool *p);
void czk_pool_park(czk_pool *p);
void czk_pool_free(czk_pool *p);
void czk_quantize_input(const float *x, int64_t n, int8_t *q, float *sx, float *bsum);
int64_t czk_work_bytes(int64_t n);
int czk_matvec(czk_pool *p, const czk_mat *m, const float *x, float *y, void *work);
int64_t czk_matmul_work_bytes(int64_t nvec, int64_t n);
int czk_matmul(czk_pool *p, const czk_mat *m, const float *x, int64_t nvec, float *y,
               void *work);
int64_t czk_moe_work_bytes(int n, int64_t H, int64_t I);
int czk_moe(czk_pool *p, int n, const czk_mat *table, const int64_t *slots, const float *w,
            const float *x, float *y, void *work);
int64_t czk_moe_one_work_bytes(int n, int64_t H, int64_t I);
int czk_moe_one(czk_pool *p, int n, int j, const czk_mat *table, int64_t slot, int64_t I,
                const float *x, void *work);
void czk_moe_sum(int n, int64_t H, const float *w, const void *work, float *y);
void czk_rmsnorm(const float *x, const float *w, int64_t n, float eps, float *out);
int64_t czk_attn_work_bytes(const czk_attn *a, int64_t H, int64_t length);
int czk_attn_decode(czk_pool *p, const czk_attn *a, int64_t H, float *h, float *x_out,
                    float *kc, float *vc, int64_t cap, int64_t pos, int64_t window,
                    const float *cs, const float *sn, void *work);
int czk_row(const czk_mat *m, int64_t r, float *out);
int czk_topk(const float *logits, int E, int k, int renorm, int64_t *idx, float *w);
int czk_attn_decode_batch(czk_pool *p, const czk_attn *a, int64_t H, int B, float *h,
                          float *x_out, const uintptr_t *kp, const uintptr_t *vp,
                          int64_t pstride, const int64_t *cap, const int64_t *pos,
                          int64_t window, const float *cs, const float *sn, int64_t rope_w,
                          int64_t rope_rows, const czk_mat *router, int k, int renorm,
                          float *logits, int64_t *idx, float *w, void *work, int64_t wstride);
int czk_attn_decode_waves(czk_pool *p, const czk_attn *a, int64_t H, int nwaves,
                          const int64_t *waves, const int64_t *groups, float *h, float *x_out,
                          const uintptr_t *kp, const uintptr_t *vp, int64_t pstride,
                          const int64_t *cap, const int64_t *pos, int64_t window,
                          const float *cs, const float *sn, int64_t rope_w, int64_t rope_rows,
                          const czk_mat *router, int k, int renorm, float *logits, int64_t *idx,
                          float *w, void *work, int64_t wstride);
int czk_union(const int64_t *idx, int64_t n, const int32_t *resident, int E, int64_t *out);
int64_t czk_moe_batch_work_bytes(int B, int k, int64_t H, int64_t I);
int czk_moe_batch(czk_pool *p, int B, int k, const czk_mat *table, int64_t n_slots,
                  int E, const int64_t *experts, const int64_t *slots, int n_held,
                  const int64_t *idx, const float *w, const float *x, float *y, float *resid,
                  int64_t H, void *work, int64_t nwork,
                  float *dpairs, uint8_t *pdone, int finish);
int czk_head_batch(czk_pool *p, int B, const float *h, int64_t H, const float *norm, float eps,
                   const czk_mat *lm_head, float *logits, void *work, int64_t wstride);
int czk_rows_take(const czk_mat *m, int B, const int64_t *tokens, float *out);
int czk_gdn(czk_pool *p, int64_t T, int nk, int nv, int dk, int dv, int K, const float *mixed,
            const float *b, const float *a, const float *conv_w, const float *a_log,
            const float *dt_bias, float *conv_state, float *state, float *out);
int czk_conv_silu(int64_t T, int64_t C, int K, const float *x, int64_t xstride,
                  const float *w, const float *bias, float *conv_state, float *out);
int czk_mamba_scan(czk_pool *p, int64_t T, int64_t I, int N, const float *x, const float *dt,
                   const float *dt_bias, const float *neg_a, const float *B, const float *Cm,
                   const float *D, const float *z, int64_t zstride, float *state, float *out);
