/* ---------------------------------------------------------------- exp and log
 * One algorithm, written once over a small set of lane operations (EXPLOG_BODY), instantiated for
 * one float (scalar), 8 lanes (AVX2) and 16 lanes (AVX-512). Every step is an IEEE operation that
 * rounds the same way in each (add, mul, div, fma, round-to-nearest-even, integer bit moves), so the
 * three give the same bits. Accuracy: about 1 ulp (tests/test_native_exp_log.py checks against
 * float64).
 *
 * exp(x): n = rint(x log2 e); r = x - n ln2 (two-part ln2, by fma); a degree-7 Taylor polynomial
 * (|r| <= ln2 / 2: truncation below 0.1 ulp); times 2^n in two exact-exponent steps, so subnormal
 * results round once. x is clamped to [-104, 89], beyond which exp is 0 or inf in fp32.
 * log(x): x = 2^k m with m in [sqrt(1/2), sqrt(2)); f = m - 1, s = f / (2 + f); log(1 + f) by the
 * classic minimax fit in s^2 (fdlibm's logf coefficients); plus k ln2 in two parts. */

#define EXP_LO -104.0f
#define EXP_HI 89.0f
#define LOG2E 1.44269502162933349609375f
#define LN2_HI 0.693145751953125f
#define LN2_LO 1.428606765330187045e-06f
#define LOG_LN2_HI 6.9313812256e-01f
#define LOG_LN2_LO 9.0580006145e-06f
#define LG1 0.66666662693f
#define LG2 0.40000972152f
#define LG3 0.28498786688f
#define LG4 0.24279078841f

/* Lane operations of the scalar path. */
typedef float s_v;
typedef int32_t s_i;
INLINE s_v s_set(float a) { return a; }
INLINE s_v s_add(s_v a, s_v b) { return a + b; }
INLINE s_v s_sub(s_v a, s_v b) { return a - b; }
INLINE s_v s_mul(s_v a, s_v b) { return a * b; }
INLINE s_v s_div(s_v a, s_v b) { return a / b; }
INLINE s_v s_fma(s_v a, s_v b, s_v c) { return fmaf(a, b, c); }
INLINE s_v s_rint(s_v a) { return nearbyintf(a); }
INLINE s_v s_clamp(s_v a, float lo, float hi) { return a < lo ? lo : (a > hi ? hi : a); }
INLINE s_i s_toint(s_v a) { return (s_i)a; }
INLINE s_v s_fromint(s_i a) { return (float)a; }
INLINE s_i s_bits(s_v a) { s_i i; memcpy(&i, &a, 4); return i; }
INLINE s_v s_float(s_i i) { s_v a; memcpy(&a, &i, 4); return a; }
INLINE s_i s_iadd(s_i a, s_i b) { return a + b; }
INLINE s_i s_isub(s_i a, s_i b) { return a - b; }
INLINE s_i s_iand(s_i a, s_i b) { return a & b; }
INLINE s_i s_ior(s_i a, s_i b) { return a | b; }
INLINE s_i s_iset(int32_t a) { return a; }
INLINE s_i s_shl(s_i a, int n) { return (s_i)((uint32_t)a << n); }
INLINE s_i s_sra(s_i a, int n) { return a >> n; }
INLINE s_i s_srl(s_i a, int n) { return (s_i)((uint32_t)a >> n); }
/* Selects: where cond, a, else b. */
INLINE s_v s_sel_nan(s_v x, s_v a, s_v b) { return x != x ? a : b; }
INLINE s_v s_sel_lt(s_v x, float t, s_v a, s_v b) { return x < t ? a : b; }
INLINE s_v s_sel_gt(s_v x, float t, s_v a, s_v b) { return x > t ? a : b; }
INLINE s_v s_sel_eq(s_v x, float t, s_v a, s_v b) { return x == t ? a : b; }
INLINE s_i s_isel_gt(s_v x, float t, s_i a, s_i b) { return x > t ? a : b; }

#define EXPLOG_BODY(P, T)                                                                           \
    T INLINE P##_v P##_exp(P##_v x) {                                                               \
        P##_v xc = P##_clamp(x, EXP_LO, EXP_HI);                                                    \
        P##_v n = P##_rint(P##_mul(xc, P##_set(LOG2E)));                                            \
        P##_v r = P##_fma(n, P##_set(-LN2_HI), xc);                                                 \
        r = P##_fma(n, P##_set(-LN2_LO), r);                                                        \
        P##_v p = P##_set(1.0f / 5040.0f);                                                          \
        p = P##_fma(p, r, P##_set(1.0f / 720.0f));                                                  \
        p = P##_fma(p, r, P##_set(1.0f / 120.0f));                                                  \
        p = P##_fma(p, r, P##_set(1.0f / 24.0f));                                                   \
        p = P##_fma(p, r, P##_set(1.0f / 6.0f));                                                    \
        p = P##_fma(p, r, P##_set(0.5f));                                                           \
        p = P##_fma(p, r, P##_set(1.0f));                                                           \
        p = P##_fma(p, r, P##_set(1.0f));                                                           \
        P##_i ni = P##_toint(n);                                                                    \
        P##_i n1 = P##_sra(P##_iadd(ni, P##_srl(ni, 31)), 1); /* n / 2 toward zero */               \
        P##_i n2 = P##_isub(ni, n1);                                                                \
        P##_v s1 = P##_float(P##_shl(P##_iadd(n1, P##_iset(127)), 23));                             \
        P##_v s2 = P##_float(P##_shl(P##_iadd(n2, P##_iset(127)), 23));                             \
        P##_v y = P##_mul(P##_mul(p, s1), s2);                                                      \
        return P##_sel_nan(x, x, y);                                                                \
    }                                                                                               \
    T INLINE P##_v P##_log(P##_v x) {                                                               \
        /* Subnormals are scaled up by 2^23 first (k then starts at -23). */                        \
        P##_v xs = P##_sel_lt(x, 1.17549435e-38f, P##_mul(x, P##_set(8388608.0f)), x);              \
        P##_v k0 = P##_sel_lt(x, 1.17549435e-38f, P##_set(-23.0f), P##_set(0.0f));                 \
        P##_i u = P##_bits(xs);                                                                     \
        P##_i e = P##_isub(P##_iand(P##_srl(u, 23), P##_iset(0xff)), P##_iset(127));                \
        P##_v m = P##_float(P##_ior(P##_iand(u, P##_iset(0x7fffff)), P##_iset(0x3f800000)));        \
        P##_i big = P##_isel_gt(m, 1.41421353816986083984375f, P##_iset(1), P##_iset(0));           \
        m = P##_sel_gt(m, 1.41421353816986083984375f, P##_mul(m, P##_set(0.5f)), m);                \
        P##_v k = P##_add(k0, P##_fromint(P##_iadd(e, big)));                                       \
        P##_v f = P##_sub(m, P##_set(1.0f));                                                        \
        P##_v s = P##_div(f, P##_add(P##_set(2.0f), f));                                            \
        P##_v z = P##_mul(s, s);                                                                    \
        P##_v w = P##_mul(z, z);                                                                    \
        P##_v t1 = P##_mul(w, P##_add(P##_set(LG2), P##_mul(w, P##_set(LG4))));                     \
        P##_v t2 = P##_mul(z, P##_add(P##_set(LG1), P##_mul(w, P##_set(LG3))));                     \
        P##_v R = P##_add(t2, t1);                                                                  \
        P##_v hfsq = P##_mul(P##_mul(P##_set(0.5f), f), f);                                         \
        P##_v inner = P##_add(P##_mul(s, P##_add(hfsq, R)), P##_mul(k, P##_set(LOG_LN2_LO)));       \
        P##_v y = P##_sub(P##_mul(k, P##_set(LOG_LN2_HI)), P##_sub(P##_sub(hfsq, inner), f));       \
        y = P##_sel_eq(x, 0.0f, P##_set(-INFINITY), y);                                             \
        y = P##_sel_eq(x, INFINITY, x, y);                                                          \
        y = P##_sel_lt(x, 0.0f, P##_set(NAN), y);                                                   \
        return P##_sel_nan(x, x, y);                                                                \
    }

EXPLOG_BODY(s, )

#if LS_X86
/* Lane operations of the AVX2 path (8 lanes). */
typedef __m256 a_v;
typedef __m256i a_i;
AVX2_T INLINE a_v a_set(float a) { return _mm256_set1_ps(a); }
AVX2_T INLINE a_v a_add(a_v a, a_v b) { return _mm256_add_ps(a, b); }
AVX2_T INLINE a_v a_sub(a_v a, a_v b) { return _mm256_sub_ps(a, b); }
AVX2_T INLINE a_v a_mul(a_v a, a_v b) { return _mm256_mul_ps(a, b); }
AVX2_T INLINE a_v a_div(a_v a, a_v b) { return _mm256_div_ps(a, b); }
AVX2_T INLINE a_v a_fma(a_v a, a_v b, a_v c) { return _mm256_fmadd_ps(a, b, c); }
AVX2_T INLINE a_v a_rint(a_v a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
AVX2_T INLINE a_v a_sel(a_v m, a_v a, a_v b) { return _mm256_blendv_ps(b, a, m); }
AVX2_T INLINE a_v a_clamp(a_v a, float lo, float hi) {
    a_v r = a_sel(_mm256_cmp_ps(a, a_set(lo), _CMP_LT_OQ), a_set(lo), a);
    return a_sel(_mm256_cmp_ps(a, a_set(hi), _CMP_GT_OQ), a_set(hi), r);
}
AVX2_T INLINE a_i a_toint(a_v a) { return _mm256_cvttps_epi32(a); }
AVX2_T INLINE a_v a_fromint(a_i a) { return _mm256_cvtepi32_ps(a); }
AVX2_T INLINE a_i a_bits(a_v a) { return _mm256_castps_si256(a); }
AVX2_T INLINE a_v a_float(a_i i) { return _mm256_castsi256_ps(i); }
AVX2_T INLINE a_i a_iadd(a_i a, a_i b) { return _mm256_add_epi32(a, b); }
AVX2_T INLINE a_i a_isub(a_i a, a_i b) { return _mm256_sub_epi32(a, b); }
AVX2_T INLINE a_i a_iand(a_i a, a_i b) { return _mm256_and_si256(a, b); }
AVX2_T INLINE a_i a_ior(a_i a, a_i b) { return _mm256_or_si256(a, b); }
AVX2_T INLINE a_i a_iset(int32_t a) { return _mm256_set1_epi32(a); }
AVX2_T INLINE a_i a_shl(a_i a, int n) { return _mm256_slli_epi32(a, n); }
AVX2_T INLINE a_i a_sra(a_i a, int n) { return _mm256_srai_epi32(a, n); }
AVX2_T INLINE a_i a_srl(a_i a, int n) { return _mm256_srli_epi32(a, n); }
AVX2_T INLINE a_v a_sel_nan(a_v x, a_v a, a_v b) { return a_sel(_mm256_cmp_ps(x, x, _CMP_UNORD_Q), a, b); }
AVX2_T INLINE a_v a_sel_lt(a_v x, float t, a_v a, a_v b) { return a_sel(_mm256_cmp_ps(x, a_set(t), _CMP_LT_OQ), a, b); }
AVX2_T INLINE a_v a_sel_gt(a_v x, float t, a_v a, a_v b) { return a_sel(_mm256_cmp_ps(x, a_set(t), _CMP_GT_OQ), a, b); }
AVX2_T INLINE a_v a_sel_eq(a_v x, float t, a_v a, a_v b) { return a_sel(_mm256_cmp_ps(x, a_set(t), _CMP_EQ_OQ), a, b); }
AVX2_T INLINE a_i a_isel_gt(a_v x, float t, a_i a, a_i b) {
    return _mm256_castps_si256(a_sel(_mm256_cmp_ps(x, a_set(t), _CMP_GT_OQ), _mm256_castsi256_ps(a),
                                     _mm256_castsi256_ps(b)));
}
EXPLOG_BODY(a, AVX2_T)

/* Lane operations of the AVX-512 path (16 lanes). */
typedef __m512 z_v;
typedef __m512i z_i;
AVX512_T INLINE z_v z_set(float a) { return _mm512_set1_ps(a); }
AVX512_T INLINE z_v z_add(z_v a, z_v b) { return _mm512_add_ps(a, b); }
AVX512_T INLINE z_v z_sub(z_v a, z_v b) { return _mm512_sub_ps(a, b); }
AVX512_T INLINE z_v z_mul(z_v a, z_v b) { return _mm512_mul_ps(a, b); }
AVX512_T INLINE z_v z_div(z_v a, z_v b) { return _mm512_div_ps(a, b); }
AVX512_T INLINE z_v z_fma(z_v a, z_v b, z_v c) { return _mm512_fmadd_ps(a, b, c); }
AVX512_T INLINE z_v z_rint(z_v a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
AVX512_T INLINE z_v z_clamp(z_v a, float lo, float hi) {
    a = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, z_set(lo), _CMP_LT_OQ), a, z_set(lo));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, z_set(hi), _CMP_GT_OQ), a, z_set(hi));
}
AVX512_T INLINE z_i z_toint(z_v a) { return _mm512_cvttps_epi32(a); }
AVX512_T INLINE z_v z_fromint(z_i a) { return _mm512_cvtepi32_ps(a); }
AVX512_T INLINE z_i z_bits(z_v a) { return _mm512_castps_si512(a); }
AVX512_T INLINE z_v z_float(z_i i) { return _mm512_castsi512_ps(i); }
AVX512_T INLINE z_i z_iadd(z_i a, z_i b) { return _mm512_add_epi32(a, b); }
AVX512_T INLINE z_i z_isub(z_i a, z_i b) { return _mm512_sub_epi32(a, b); }
AVX512_T INLINE z_i z_iand(z_i a, z_i b) { return _mm512_and_si512(a, b); }
AVX512_T INLINE z_i z_ior(z_i a, z_i b) { return _mm512_or_si512(a, b); }
AVX512_T INLINE z_i z_iset(int32_t a) { return _mm512_set1_epi32(a); }
AVX512_T INLINE z_i z_shl(z_i a, int n) { return _mm512_slli_epi32(a, n); }
AVX512_T INLINE z_i z_sra(z_i a, int n) { return _mm512_srai_epi32(a, n); }
AVX512_T INLINE z_i z_srl(z_i a, int n) { return _mm512_srli_epi32(a, n); }
AVX512_T INLINE z_v z_sel_nan(z_v x, z_v a, z_v b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), b, a); }
AVX512_T INLINE z_v z_sel_lt(z_v x, float t, z_v a, z_v b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, z_set(t), _CMP_LT_OQ), b, a); }
AVX512_T INLINE z_v z_sel_gt(z_v x, float t, z_v a, z_v b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, z_set(t), _CMP_GT_OQ), b, a); }
AVX512_T INLINE z_v z_sel_eq(z_v x, float t, z_v a, z_v b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, z_set(t), _CMP_EQ_OQ), b, a); }
AVX512_T INLINE z_i z_isel_gt(z_v x, float t, z_i a, z_i b) { return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, z_set(t), _CMP_GT_OQ), b, a); }
EXPLOG_BODY(z, AVX512_T)
#endif

/* FN_SQRT is the IEEE square root (sqrtss, vsqrtps): correctly rounded on every CPU, where
 * torch.sqrt takes MKL's vector math, whose bits follow the CPU's maker and vector unit. */
enum { FN_EXP = 0, FN_LOG = 1, FN_SQRT = 2 };

typedef struct {
    const float *x;
    float *y;
    int64_t n;
    int fn, isa;
} unary_job;

#define UNARY_CHUNK 4096

static void unary_scalar(const float *x, float *y, int64_t n, int fn) {
    for (int64_t i = 0; i < n; i++)
        y[i] = fn == FN_EXP ? s_exp(x[i]) : fn == FN_LOG ? s_log(x[i]) : __builtin_sqrtf(x[i]);
}

#if LS_X86
AVX2_T static void unary_avx2(const float *x, float *y, int64_t n, int fn) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a_v v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(y + i, fn == FN_EXP ? a_exp(v) : fn == FN_LOG ? a_log(v) : _mm256_sqrt_ps(v));
    }
    if (i < n) { /* the tail through a padded buffer, in the same lane code */
        float buf[8] = {0};
        memcpy(buf, x + i, (size_t)(n - i) * 4);
        a_v v = _mm256_loadu_ps(buf);
        _mm256_storeu_ps(buf, fn == FN_EXP ? a_exp(v) : fn == FN_LOG ? a_log(v) : _mm256_sqrt_ps(v));
        memcpy(y + i, buf, (size_t)(n - i) * 4);
    }
}

AVX512_T static void unary_avx512(const float *x, float *y, int64_t n, int fn) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = (__mmask16)(n - i >= 16 ? 0xffffu : ((1u << (n - i)) - 1u));
        z_v v = _mm512_maskz_loadu_ps(m, x + i);
        _mm512_mask_storeu_ps(y + i, m, fn == FN_EXP ? z_exp(v) : fn == FN_LOG ? z_log(v) : _mm512_sqrt_ps(v));
    }
}
#endif

static void unary_isa(int isa, const float *x, float *y, int64_t n, int fn) {
#if LS_X86
    if (isa >= ISA_AVX512) { unary_avx512(x, y, n, fn); return; }
    if (isa == ISA_AVX2) { unary_avx2(x, y, n, fn); return; }
#endif
    (void)isa;
    unary_scalar(x, y, n, fn);
}

static void unary_item(void *ctx, int64_t item) {
    const unary_job *u = (const unary_job *)ctx;
    int64_t start = item * UNARY_CHUNK, n = u->n - start < UNARY_CHUNK ? u->n - start : UNARY_CHUNK;
#if LS_X86
    if (u->isa >= ISA_AVX512) { unary_avx512(u->x + start, u->y + start, n, u->fn); return; }
    if (u->isa == ISA_AVX2) { unary_avx2(u->x + start, u->y + start, n, u->fn); return; }
#endif
    unary_scalar(u->x + start, u->y + start, n, u->fn);
}

/* y[i] = exp(x[i]) (fn 0), log(x[i]) (fn 1) or sqrt(x[i]) (fn 2) for i < n, fp32, contiguous; y may
 * alias x. Returns 0, or -1 for arguments it cannot take. */
int ls_unary(const float *x, float *y, int64_t n, int fn, int isa, int threads) {
    if (n < 0 || (fn != FN_EXP && fn != FN_LOG && fn != FN_SQRT) || !ls_cpu_supports(isa)) return -1;
    unary_job u = {x, y, n, fn, isa};
    int64_t items = (n + UNARY_CHUNK - 1) / UNARY_CHUNK;
    parallel_for(unary_item, &u, items, n < (1 << 16) ? 1 : threads);
    return 0;
}
