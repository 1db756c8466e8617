/* ---------------------------------------------------------------- attention forward
 * One query row (a query token and a query head) over the keys it may see: keys [lo, hi] of its
 * sequence, where hi = len_k - 1 (or its position, causal) and lo = 0 (or position - window + 1),
 * and, with an explicit mask (masked_attention), only those of them the mask shows its token. They
 * are walked in 64-key blocks (fixed_order.KEY_BLOCK) anchored at key 0, or with a mask at the
 * first key the token may see (docs/adr/0015). Per block, for its visible keys j:
 *
 *   s_j = dot(q, k_j) * scale, dot the GEMM's fp32 order (kernels.c's header; bf16 widened first),
 *         which the backward (attention_backward.c) recomputes with the same call, finding the
 *         forward's scores bit for bit;
 *   M = max(m, s_j over j) (NaN propagates); shift = M, or 0 where M = -inf;
 *   alpha = exp(m - shift); p_j = exp(s_j - shift), and p = 0 for the block's other slots;
 *   l = l * alpha + fold16(((p[0:16] + p[16:32]) + p[32:48]) + p[48:64]);
 *   acc[d] = acc[d] * alpha + (one fp32 FMA chain over visible j ascending of p_j v_j[d], from +0);
 *   m = M;
 *
 * and finally out = acc / l (acc / 1 = 0 where the row saw no key). exp is exp_log.c's. Every
 * quantity of a row is a function of that row's query, its keys and its position alone, so the
 * rows that share a work item, the thread count and the instruction set change no bit; and a block
 * the row cannot see would be an exact no-op (alpha = 1, p = 0), so skipping it changes none either.
 * Keys a row cannot see are never read into its sums, so a NaN there does not reach it. The three
 * paths below run the softmax and the output on 16-lane vectors: across 16 keys for the
 * probabilities and the block sum, across 16 dimensions of d for the output. */

#define KEY_BLOCK 64

typedef struct {
    int64_t B, Hq, Hkv, D;
    const char *q, *k, *v;
    const int64_t *cu_q, *len_k, *k_start, *table;
    int64_t table_stride, block_size, window;
    int64_t kv_token, kv_head;  /* element strides of k and v between keys and between heads */
    const unsigned char *mask;  /* NULL, or [Tq, mask_stride] bytes: key j visible to query token t */
    int64_t mask_stride;
    float scale;
    int causal, dt, isa;
    float *out, *row_max, *row_sum;
    int64_t *item_start; /* [B + 1]: the first work item of each sequence */
    int64_t tokens;      /* query tokens per work item (with all G query heads of one KV head) */
    atomic_int failed;   /* set by an item that could not allocate its buffers */
} attn_job;

/* Lane operations on 16 fp32 lanes, one set per instruction set; loadw widens 16-bit elements. */
typedef struct { float x[16]; } s16;
INLINE s16 s16_zero(void) { s16 r; for (int i = 0; i < 16; i++) r.x[i] = 0.0f; return r; }
INLINE s16 s16_set(float a) { s16 r; for (int i = 0; i < 16; i++) r.x[i] = a; return r; }
/* count: how many lanes to load or store, from the first; 16 or more means all. */
INLINE s16 s16_load(const float *p, int count) {
    s16 r = s16_zero();
    for (int i = 0; i < count && i < 16; i++) r.x[i] = p[i];
    return r;
}
INLINE s16 s16_loadw(const char *p, int64_t k, int dt, int count) {
    s16 r = s16_zero();
    for (int i = 0; i < count && i < 16; i++) r.x[i] = load_scalar(p, k + i, dt);
    return r;
}
INLINE void s16_store(float *p, s16 a, int count) { for (int i = 0; i < count && i < 16; i++) p[i] = a.x[i]; }
INLINE s16 s16_fma(s16 a, s16 b, s16 c) { for (int i = 0; i < 16; i++) c.x[i] = fmaf(a.x[i], b.x[i], c.x[i]); return c; }
INLINE s16 s16_add(s16 a, s16 b) { for (int i = 0; i < 16; i++) a.x[i] = a.x[i] + b.x[i]; return a; }
INLINE s16 s16_sub(s16 a, s16 b) { for (int i = 0; i < 16; i++) a.x[i] = a.x[i] - b.x[i]; return a; }
INLINE s16 s16_mul(s16 a, s16 b) { for (int i = 0; i < 16; i++) a.x[i] = a.x[i] * b.x[i]; return a; }
INLINE s16 s16_div(s16 a, s16 b) { for (int i = 0; i < 16; i++) a.x[i] = a.x[i] / b.x[i]; return a; }
INLINE s16 s16_exp(s16 a) { for (int i = 0; i < 16; i++) a.x[i] = s_exp(a.x[i]); return a; }

#if LS_X86
typedef struct { __m256 lo, hi; } a16;
AVX2_T INLINE a16 a16_zero(void) { a16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
AVX2_T INLINE a16 a16_set(float a) { a16 r = {_mm256_set1_ps(a), _mm256_set1_ps(a)}; return r; }
AVX2_T INLINE a16 a16_load(const float *p, int count) {
    if (count >= 16) { a16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
    float buf[16] = {0};
    memcpy(buf, p, (size_t)count * 4);
    a16 r = {_mm256_loadu_ps(buf), _mm256_loadu_ps(buf + 8)};
    return r;
}
AVX2_T INLINE a16 a16_loadw(const char *p, int64_t k, int dt, int count) {
    a16 r = {load8(p, k, dt, count < 8 ? count : 8), load8(p, k + 8, dt, count - 8 < 8 ? count - 8 : 8)};
    return r;
}
AVX2_T INLINE void a16_store(float *p, a16 a, int count) {
    if (count >= 16) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); return; }
    float buf[16];
    _mm256_storeu_ps(buf, a.lo);
    _mm256_storeu_ps(buf + 8, a.hi);
    memcpy(p, buf, (size_t)count * 4);
}
AVX2_T INLINE a16 a16_fma(a16 a, a16 b, a16 c) {
    a16 r = {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; return r;
}
AVX2_T INLINE a16 a16_add(a16 a, a16 b) { a16 r = {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; return r; }
AVX2_T INLINE a16 a16_sub(a16 a, a16 b) { a16 r = {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; return r; }
AVX2_T INLINE a16 a16_mul(a16 a, a16 b) { a16 r = {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; return r; }
AVX2_T INLINE a16 a16_div(a16 a, a16 b) { a16 r = {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; return r; }
AVX2_T INLINE a16 a16_exp(a16 a) { a16 r = {a_exp(a.lo), a_exp(a.hi)}; return r; }

typedef __m512 z16;
AVX512_T INLINE z16 z16_zero(void) { return _mm512_setzero_ps(); }
AVX512_T INLINE z16 z16_set(float a) { return _mm512_set1_ps(a); }
AVX512_T INLINE z16 z16_load(const float *p, int count) {
    return count >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1u), p);
}
AVX512_T INLINE z16 z16_loadw(const char *p, int64_t k, int dt, int count) { return load16(p, k, dt, count); }
AVX512_T INLINE void z16_store(float *p, z16 a, int count) {
    if (count >= 16) _mm512_storeu_ps(p, a);
    else _mm512_mask_storeu_ps(p, (__mmask16)((1u << count) - 1u), a);
}
AVX512_T INLINE z16 z16_fma(z16 a, z16 b, z16 c) { return _mm512_fmadd_ps(a, b, c); }
AVX512_T INLINE z16 z16_add(z16 a, z16 b) { return _mm512_add_ps(a, b); }
AVX512_T INLINE z16 z16_sub(z16 a, z16 b) { return _mm512_sub_ps(a, b); }
AVX512_T INLINE z16 z16_mul(z16 a, z16 b) { return _mm512_mul_ps(a, b); }
AVX512_T INLINE z16 z16_div(z16 a, z16 b) { return _mm512_div_ps(a, b); }
AVX512_T INLINE z16 z16_exp(z16 a) { return z_exp(a); }
#endif

/* Key j of sequence b: the element offset of its head 0 in k (and v), packed or through the block table. */
static inline int64_t attn_key_offset(const attn_job *J, int64_t b, int64_t j) {
    if (J->table) {
        int64_t blk = J->table[b * J->table_stride + j / J->block_size];
        return (blk * J->block_size + j % J->block_size) * J->kv_token;
    }
    return J->k_start[b] + j * J->kv_token;
}

/* The keys [lo, hi] of query token t (of sequence b, at `pos`) before any mask; lo > hi: none. */
static inline void attn_interval(const attn_job *J, int64_t len_k, int64_t pos, int64_t *lo, int64_t *hi) {
    *lo = J->window > 0 ? pos - J->window + 1 : 0;
    *hi = J->causal ? pos : len_k - 1;
    if (*lo < 0) *lo = 0;
    if (*hi > len_k - 1) *hi = len_k - 1;
}

/* With a mask, [lo, hi] narrowed to the first and last key in it that the mask shows (global query row qt). */
static inline void attn_mask_bounds(const attn_job *J, int64_t qt, int64_t *lo, int64_t *hi) {
    if (!J->mask) return;
    const unsigned char *m = J->mask + qt * J->mask_stride;
    while (*lo <= *hi && !m[*lo]) (*lo)++;
    while (*hi >= *lo && !m[*hi]) (*hi)--;
}

/* The scores of up to MR query rows (A, row stride lda bytes) against the block's keys from
 * ja & ~3 to je: s[i * KEY_BLOCK + j] = dot(A_i, k_j) * scale, by the GEMM's micro-tiles (runs of
 * up to NR keys one stride apart; a run that crosses a cache block splits into single keys). The
 * backward passes value rows as krow and scale 1 (an exact no-op) for dot(dO_i, v_j). */
static void attn_scores(const attn_job *J, int mr, const char *A, int64_t lda, const char *const *krow, int n,
                        int ja, int je, float *s, float scale) {
    micro_fn micro = micro_of(J->isa);
    float folded[MR * NR], one[MR * NR];
    int64_t ldb = J->kv_token * (J->dt == DT_F32 ? 4 : 2);
    int dt = J->dt == DT_BF16 ? DT_BF16_WIDE : J->dt;
    for (int j = ja & ~(NR - 1); j <= je; j += NR) {
        int nr = n - j < NR ? n - j : NR;
        int run = 1;
        while (run < nr && krow[j + run] == krow[j] + run * ldb) run++;
        if (run == nr) {
            micro(dt, mr, nr, J->D, A, lda, krow[j], ldb, NULL, folded);
        } else { /* one key at a time */
            for (int jj = 0; jj < nr; jj++) {
                micro(dt, mr, 1, J->D, A, lda, krow[j + jj], ldb, NULL, one);
                for (int i = 0; i < mr; i++) folded[i * NR + jj] = one[i * NR];
            }
        }
        for (int i = 0; i < mr; i++)
            for (int jj = 0; jj < nr; jj++) s[i * KEY_BLOCK + j + jj] = folded[i * NR + jj] * scale;
    }
}

/* One work item: tokens [t0, t1) of sequence b, with every query head of KV head hk: R = (t1 - t0) * G
 * rows, row i = token t0 + i / G, head hk * G + i % G. Qp holds their queries packed (as stored),
 * S their scores of one block, Vb the block's values widened to fp32 (16-bit dtypes only). The
 * tokens that share a block anchor walk the blocks together, one anchor after another (without a
 * mask every token's anchor is key 0: one walk); a row is touched by its own anchor's walk only. */
#define ATTN_ITEM(P, T)                                                                             \
    T static void attn_item_##P(const attn_job *J, int64_t b, int64_t t0, int64_t t1, int64_t hk,     \
                                char *Qp, float *S, float *Vb) {                                   \
        const int64_t D = J->D, G = J->Hq / J->Hkv, len_k = J->len_k[b];                             \
        const int64_t q0 = J->cu_q[b], len_q = J->cu_q[b + 1] - q0;                                \
        const int64_t es = J->dt == DT_F32 ? 4 : 2;                                                 \
        const int nd = (int)((D + 15) / 16);                                                        \
        const int R = (int)((t1 - t0) * G);                                                         \
        int64_t lo_of[KEY_BLOCK], hi_of[KEY_BLOCK]; /* each token's first and last visible key */   \
        for (int64_t t = t0; t < t1; t++) {                                                         \
            attn_interval(J, len_k, len_k - len_q + t, &lo_of[t - t0], &hi_of[t - t0]);             \
            attn_mask_bounds(J, q0 + t, &lo_of[t - t0], &hi_of[t - t0]);                            \
            memcpy(Qp + (t - t0) * G * D * es, J->q + ((q0 + t) * J->Hq + hk * G) * D * es, (size_t)(G * D * es)); \
        }                                                                                           \
        const char *krow[KEY_BLOCK], *vrow[KEY_BLOCK];                                              \
        float p[KEY_BLOCK] __attribute__((aligned(64)));                                            \
        float lanes[16];                                                                            \
        for (int64_t done = -1;;) {                                                                 \
            /* The next anchor after `done`, and the keys its tokens see. */                       \
            int64_t A = INT64_MAX, first = INT64_MAX, last = -1;                                    \
            for (int64_t t = 0; t < t1 - t0; t++) {                                                 \
                int64_t a = J->mask ? lo_of[t] : 0;                                                 \
                if (lo_of[t] <= hi_of[t] && a > done && a < A) A = a;                               \
            }                                                                                       \
            if (A == INT64_MAX) break;                                                              \
            for (int64_t t = 0; t < t1 - t0; t++)                                                   \
                if (lo_of[t] <= hi_of[t] && (J->mask ? lo_of[t] : 0) == A) {                       \
                    if (lo_of[t] < first) first = lo_of[t];                                         \
                    if (hi_of[t] > last) last = hi_of[t];                                           \
                }                                                                                   \
            done = A;                                                                               \
        for (int64_t k0 = A + (first - A) / KEY_BLOCK * KEY_BLOCK; k0 <= last; k0 += KEY_BLOCK) {   \
            int n = (int)(len_k - k0 < KEY_BLOCK ? len_k - k0 : KEY_BLOCK);                         \
            for (int j = 0; j < n; j++) {                                                           \
                int64_t off = attn_key_offset(J, b, k0 + j) + hk * J->kv_head;                      \
                krow[j] = J->k + off * es;                                                          \
                vrow[j] = J->v + off * es;                                                          \
                if (J->dt != DT_F32)                                                                \
                    for (int c = 0; c < nd; c++) {                                                  \
                        int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                         \
                        P##16_store(Vb + j * D + 16 * c, P##16_loadw(vrow[j], 16 * c, J->dt, cnt), cnt); \
                    }                                                                               \
            }                                                                                       \
            /* Each row's visible keys of the block: [ja, je] (ja > je: none), and with a mask the  \
             * bits of those in it the mask shows. */                                              \
            int ja_of[MR], je_of[MR];                                                               \
            uint64_t bits_of[MR];                                                                   \
            for (int i0 = 0; i0 < R; i0 += MR) {                                                    \
                int mr = R - i0 < MR ? R - i0 : MR, ja_u = KEY_BLOCK, je_u = -1;                    \
                for (int i = 0; i < mr; i++) {                                                      \
                    int64_t t = (i0 + i) / G, lo = lo_of[t], hi = hi_of[t];                         \
                    if (J->mask && lo != A) hi = -1; /* another anchor's row */                     \
                    if (lo < k0) lo = k0;                                                           \
                    if (hi > k0 + n - 1) hi = k0 + n - 1;                                           \
                    bits_of[i] = 0;                                                                 \
                    if (J->mask && lo <= hi) {                                                      \
                        const unsigned char *m = J->mask + (q0 + t0 + t) * J->mask_stride + k0;     \
                        for (int64_t j = lo - k0; j <= hi - k0; j++)                                \
                            if (m[j]) bits_of[i] |= (uint64_t)1 << j;                               \
                        if (!bits_of[i]) hi = lo - 1;                                               \
                        else {                                                                      \
                            lo = k0 + __builtin_ctzll(bits_of[i]);                                  \
                            hi = k0 + 63 - __builtin_clzll(bits_of[i]);                             \
                        }                                                                           \
                    }                                                                               \
                    ja_of[i] = (int)(lo - k0);                                                      \
                    je_of[i] = (int)(hi - k0);                                                      \
                    if (ja_of[i] <= je_of[i]) {                                                     \
                        if (ja_of[i] < ja_u) ja_u = ja_of[i];                                       \
                        if (je_of[i] > je_u) je_u = je_of[i];                                       \
                    }                                                                               \
                }                                                                                   \
                if (ja_u > je_u) continue; /* an exact no-op for these rows */                      \
                attn_scores(J, mr, Qp + (int64_t)i0 * D * es, D * es, krow, n, ja_u, je_u, S, J->scale); \
                for (int i = 0; i < mr; i++) {                                                      \
                    int ja = ja_of[i], je = je_of[i];                                               \
                    if (ja > je) continue;                                                          \
                    const uint64_t bits = bits_of[i];                                               \
                    const int dense = J->mask == NULL;                                              \
                    const float *si = S + i * KEY_BLOCK;                                            \
                    int64_t r = (q0 + t0 + (i0 + i) / G) * J->Hq + hk * G + (i0 + i) % G;           \
                    float m = J->row_max[r], M = m;                                                 \
                    for (int j = ja; j <= je; j++)                                                  \
                        if ((dense || (bits >> j & 1)) && (si[j] > M || si[j] != si[j])) M = si[j]; \
                    if (m != m) M = m;                                                              \
                    float shift = M == -INFINITY ? 0.0f : M;                                        \
                    float alpha = s_exp(m - shift);                                                 \
                    for (int c = 0; c < KEY_BLOCK / 16; c++) {                                      \
                        if (16 * c > je || 16 * c + 15 < ja) {                                      \
                            memset(p + 16 * c, 0, 64);                                              \
                            continue;                                                               \
                        }                                                                           \
                        P##16_store(p + 16 * c, P##16_exp(P##16_sub(P##16_load(si + 16 * c, 16), P##16_set(shift))), 16); \
                    }                                                                               \
                    for (int j = 0; j < KEY_BLOCK; j++)                                             \
                        if (j < ja || j > je || !(dense || (bits >> j & 1))) p[j] = 0.0f;           \
                    P##16 sum = P##16_add(P##16_add(P##16_add(P##16_load(p, 16), P##16_load(p + 16, 16)), \
                                                    P##16_load(p + 32, 16)), P##16_load(p + 48, 16)); \
                    P##16_store(lanes, sum, 16);                                                    \
                    J->row_sum[r] = J->row_sum[r] * alpha + fold16(lanes);                          \
                    float *o = J->out + r * D;                                                      \
                    for (int c = 0; c < nd; c++) {                                                  \
                        int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                         \
                        P##16 pv = P##16_zero();                                                    \
                        if (J->dt == DT_F32)                                                        \
                            for (int j = ja; j <= je; j++) {                                        \
                                if (!(dense || (bits >> j & 1))) continue;                          \
                                pv = P##16_fma(P##16_set(p[j]), P##16_load((const float *)vrow[j] + 16 * c, cnt), pv); \
                            }                                                                       \
                        else                                                                        \
                            for (int j = ja; j <= je; j++) {                                        \
                                if (!(dense || (bits >> j & 1))) continue;                          \
                                pv = P##16_fma(P##16_set(p[j]), P##16_load(Vb + j * D + 16 * c, cnt), pv); \
                            }                                                                       \
                        P##16 a = P##16_load(o + 16 * c, cnt);                                      \
                        P##16_store(o + 16 * c, P##16_add(P##16_mul(a, P##16_set(alpha)), pv), cnt); \
                    }                                                                               \
                    J->row_max[r] = M;                                                              \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        }                                                                                           \
        for (int i = 0; i < R; i++) {                                                               \
            int64_t r = (q0 + t0 + i / G) * J->Hq + hk * G + i % G;                                 \
            float l = J->row_sum[r] == 0.0f ? 1.0f : J->row_sum[r];                                 \
            float *o = J->out + r * D;                                                              \
            for (int c = 0; c < nd; c++) {                                                          \
                int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                                 \
                P##16_store(o + 16 * c, P##16_div(P##16_load(o + 16 * c, cnt), P##16_set(l)), cnt); \
            }                                                                                       \
        }                                                                                           \
    }

ATTN_ITEM(s, )
#if LS_X86
ATTN_ITEM(a, AVX2_T)
ATTN_ITEM(z, AVX512_T)
#endif

static void attn_item(void *ctx, int64_t item) {
    attn_job *J = (attn_job *)ctx;
    int64_t lo = 0, hi = J->B; /* the sequence b with item_start[b] <= item < item_start[b + 1] */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (J->item_start[mid] <= item) lo = mid; else hi = mid;
    }
    int64_t b = lo, r = item - J->item_start[b], G = J->Hq / J->Hkv;
    int64_t t0 = (r / J->Hkv) * J->tokens, hk = r % J->Hkv, len_q = J->cu_q[b + 1] - J->cu_q[b];
    int64_t t1 = t0 + J->tokens < len_q ? t0 + J->tokens : len_q;
    size_t rows = (size_t)((t1 - t0) * G), vb = J->dt == DT_F32 ? 0 : (size_t)KEY_BLOCK * J->D;
    /* calloc: the exp reads whole 16-lane groups of S, lanes past a row's keys included (their
     * results are then zeroed); zeroed memory keeps those reads defined. */
    char *buf = (char *)calloc(1, rows * (size_t)J->D * 4 + ((size_t)MR * KEY_BLOCK + vb) * 4 + 64);
    if (!buf) {
        atomic_store(&J->failed, 1);
        return;
    }
    float *S = (float *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    float *Vb = S + MR * KEY_BLOCK;
    char *Qp = (char *)(Vb + vb);
#if LS_X86
    if (J->isa >= ISA_AVX512) attn_item_z(J, b, t0, t1, hk, Qp, S, Vb);
    else if (J->isa == ISA_AVX2) attn_item_a(J, b, t0, t1, hk, Qp, S, Vb);
    else
#endif
        attn_item_s(J, b, t0, t1, hk, Qp, S, Vb);
    free(buf);
}

/* Attention forward over packed sequences (the order of the attention section above). q: [Tq, Hq, D]
 * contiguous, sequence b's queries at rows cu_q[b] .. cu_q[b + 1]; k, v: head h of sequence b's key j
 * at element k_start[b] + j * kv_token + h * kv_head (packed), or, when table is not NULL, at
 * (table[b * table_stride + j / block_size] * block_size + j % block_size) * kv_token + h * kv_head
 * (a paged cache of block_size-row blocks), its D elements contiguous; len_k[b] keys. A query's
 * position is len_k - len_q + its index. causal: keys past the position are hidden; window > 0:
 * keys at or before position - window are hidden. mask (or NULL): query row t (of q) sees key j only
 * where mask[t * mask_stride + j] is nonzero, and its blocks start at the first key it sees.
 * out: fp32 [Tq, Hq, D]; row_max, row_sum: fp32 [Tq, Hq], each row's final m and l (rows outside
 * every sequence are not written). Returns 0, -1 for arguments it cannot take, -2 when memory runs
 * out. */
int ls_attention_fwd(int64_t B, int64_t Hq, int64_t Hkv, int64_t D, const void *q, const void *k, const void *v,
                     int64_t kv_token, int64_t kv_head, const int64_t *cu_q, const int64_t *len_k,
                     const int64_t *k_start, const int64_t *table, int64_t table_stride, int64_t block_size,
                     const unsigned char *mask, int64_t mask_stride, float scale, int causal, int64_t window,
                     float *out, float *row_max, float *row_sum, int dt, int isa, int threads) {
    if (B < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || window < 0 || dt < DT_F32 || dt > DT_F16 ||
        kv_token <= 0 || kv_head < 0 || !ls_cpu_supports(isa) || (table ? block_size <= 0 : k_start == NULL))
        return -1;
    for (int64_t b = 0; mask && b < B; b++)
        if (len_k[b] > mask_stride) return -1;
    for (int64_t b = 0; b < B; b++)
        if (cu_q[b + 1] < cu_q[b] || len_k[b] < 0) return -1;
    int64_t *item_start = (int64_t *)malloc((size_t)(B + 1) * 8);
    if (!item_start) return -2;
    /* About 64 rows per item: the block's keys are read once for all of them (never for the bits). */
    int64_t tokens = Hq / Hkv >= 64 ? 1 : 64 / (Hq / Hkv);
    item_start[0] = 0;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t len_q = cu_q[b + 1] - cu_q[b];
        item_start[b + 1] = item_start[b] + (len_q + tokens - 1) / tokens * Hkv;
        work += len_q * len_k[b];
        /* Each row starts as one that has seen no key. */
        for (int64_t r = cu_q[b] * Hq; r < cu_q[b + 1] * Hq; r++) {
            row_max[r] = -INFINITY;
            row_sum[r] = 0.0f;
            memset(out + r * D, 0, (size_t)D * 4);
        }
    }
    attn_job J = {B, Hq, Hkv, D, (const char *)q, (const char *)k, (const char *)v, cu_q, len_k, k_start, table,
                  table_stride, block_size, window, kv_token, kv_head, mask, mask_stride, scale, causal, dt, isa,
                  out, row_max, row_sum, item_start, tokens, 0};
    /* Small problems run on the calling thread: waking workers would cost more than they save. */
    parallel_for(attn_item, &J, item_start[B], work * Hq * D < (int64_t)1 << 16 ? 1 : threads);
    free(item_start);
    return atomic_load(&J.failed) ? -2 : 0;
}
