/* ---------------------------------------------------------------- attention backward
 * The gradients of the forward (attention.c) over packed sequences, with or without a mask (not
 * through a block table), from its row max m and row sum l. The rows of a sequence and KV head are ordered
 * i = t * G + g (query token t, head g of the group). A row sees the keys the forward's row saw,
 * in 64-key blocks from the same anchor A (key 0, or with a mask the first key it sees). For row i
 * and each key j it sees:
 *
 *   s_ij = the forward's score (the same dot, so the same bits); shift_i = m_i, or 0 where m_i = -inf;
 *   p_ij = exp(s_ij - shift_i) / l_i (l_i = 1 where it is 0), exp exp_log.c's;
 *   dp_ij = dot(dO_i, v_j), the GEMM's order on dO in q's dtype;
 *   delta_i = over the row's blocks ascending, from +0: delta_i + fold16(((w[0:16] + w[16:32]) +
 *             w[32:48]) + w[48:64]), w the block's p_ij dp_ij by slot j - block start, 0 where unseen;
 *   ds_ij = p_ij (dp_ij - delta_i);
 *   dq_i[d] = (over the row's blocks ascending, from +0: acc + one FMA chain over the block's keys
 *             j ascending of ds_ij k_j[d], from +0) * scale;
 *   dk_j[d] = (over the rows that see j, ascending, in groups of 64 (the last may be shorter), from
 *             +0: acc + (over the group's runs of 8 rows, from +0: g + one FMA chain over the run's
 *             rows i of ds_ij q_i[d], from +0)) * scale;
 *   dv_j[d] = the same with p_ij dO_i[d], unscaled.
 *
 * delta sums p dp rather than dO . O so that dp - delta cancels exactly where it should (a row that
 * sees one key), as the portable backward does. dk and dv sum in three levels (8, 64, all) since a
 * key may be seen by thousands of rows: one chain of 64 was twice as far from float64 as eager. None of these sums can reach -0 (x + y rounds an
 * exact zero to +0, and every one starts from +0), so a block or a row that adds nothing is an
 * exact no-op and is skipped. A key's groups count only the rows that see it, so rows that see
 * nothing (padding) change no bit of dk and dv. A row's sums never take a key it cannot see, nor
 * a key's sums a row that cannot see it (a tile's scores may cover such pairs; they are set to +0
 * before any sum). Phase 1 items are the forward's (tokens of a sequence x one KV head):
 * delta and dq; phase 2 items are a sequence's 64-key block x one KV head: dk and dv. Each output
 * is written by one item, so neither the thread count nor the instruction set changes a bit. */

/* How many of 16-lane chunk c's lanes fall inside d < D (0 past the end: such a chunk loads zeros
 * and stores nothing). */
static inline int chunk_lanes(int64_t D, int c) {
    int64_t left = D - 16 * (int64_t)c;
    return (int)(left < 0 ? 0 : left < 16 ? left : 16);
}

#define ROW_GROUP_ATTN 64 /* powers of two */
#define ROW_RUN_ATTN 8
#define BWD_TILE (4 * MR) /* phase 2's rows per pass over a key's chains */

typedef struct {
    attn_job J;              /* the forward's arguments (no table); row_max, row_sum its results */
    const char *dout;        /* [Tq, Hq, D] in q's dtype */
    float *delta;            /* [Tq, Hq] */
    float *dq, *dk, *dv;     /* fp32, laid out as q, k, v */
    int64_t *key_item_start; /* [B + 1]: phase 2's first item of each sequence */
    int64_t *lo, *hi;        /* [Tq]: each query token's first and last key (with a mask, shown) */
} attn_bwd_job;

/* Up to MR rows (global rows r_of[i], packed queries Qt and upstream gradients Ot in q's dtype)
 * against one key block (krow, vrow; n keys), row i seeing the block's keys [ja_of[i], je_of[i]],
 * with a mask only those whose bit is set in bits_of[i]: Pm[i * KEY_BLOCK + j] = p_ij and
 * DPm[...] = dp_ij where it sees j, +0 elsewhere. S: scratch. */
#define ATTN_BWD_BLOCK(P, T)                                                                        \
    T static void attn_bwd_block_##P(const attn_bwd_job *W, int mr, const char *Qt, const char *Ot,  \
                                     const int64_t *r_of, const char *const *krow, const char *const *vrow, \
                                     int n, const int *ja_of, const int *je_of, const uint64_t *bits_of, \
                                     float *S, float *Pm, float *DPm) {                             \
        const attn_job *J = &W->J;                                                                  \
        const int64_t lda = J->D * (J->dt == DT_F32 ? 4 : 2);                                       \
        int ja_u = KEY_BLOCK, je_u = -1;                                                            \
        for (int i = 0; i < mr; i++)                                                                \
            if (ja_of[i] <= je_of[i]) {                                                             \
                if (ja_of[i] < ja_u) ja_u = ja_of[i];                                               \
                if (je_of[i] > je_u) je_u = je_of[i];                                               \
            }                                                                                       \
        if (ja_u > je_u) {                                                                          \
            memset(Pm, 0, (size_t)(mr * KEY_BLOCK) * 4);                                            \
            memset(DPm, 0, (size_t)(mr * KEY_BLOCK) * 4);                                           \
            return;                                                                                 \
        }                                                                                           \
        attn_scores(J, mr, Qt, lda, krow, n, ja_u, je_u, S, J->scale);                              \
        attn_scores(J, mr, Ot, lda, vrow, n, ja_u, je_u, DPm, 1.0f);                                \
        for (int i = 0; i < mr; i++) {                                                              \
            float *p = Pm + i * KEY_BLOCK, *dp = DPm + i * KEY_BLOCK;                               \
            const int ja = ja_of[i], je = je_of[i];                                                 \
            if (ja <= je) {                                                                         \
                const float m = J->row_max[r_of[i]], l = J->row_sum[r_of[i]];                        \
                const float shift = m == -INFINITY ? 0.0f : m, div = l == 0.0f ? 1.0f : l;          \
                for (int c = 0; c < KEY_BLOCK / 16; c++)                                            \
                    if (16 * c <= je && 16 * c + 15 >= ja)                                          \
                        P##16_store(p + 16 * c, P##16_div(P##16_exp(P##16_sub(P##16_load(S + i * KEY_BLOCK + 16 * c, 16), \
                                                                             P##16_set(shift))),     \
                                                         P##16_set(div)), 16);                      \
            }                                                                                       \
            for (int j = 0; j < KEY_BLOCK; j++)                                                     \
                if (j < ja || j > je || (J->mask && !(bits_of[i] >> j & 1))) p[j] = dp[j] = 0.0f;   \
        }                                                                                           \
    }

/* Rows rows[0 .. mr) of sequence b (i = t * G + g), KV head hk: their global rows, queries and
 * upstream gradients packed (Qt, Ot), each row's keys [lo, hi] (with a mask, its first and last
 * shown key) and its anchor. */
static void attn_bwd_rows_of(const attn_bwd_job *W, int64_t b, int64_t hk, const int64_t *rows, int mr,
                             int64_t *r_of, int64_t *lo_of, int64_t *hi_of, int64_t *anchor_of, char *Qt, char *Ot) {
    const attn_job *J = &W->J;
    const int64_t G = J->Hq / J->Hkv, q0 = J->cu_q[b];
    const int64_t row_bytes = J->D * (J->dt == DT_F32 ? 4 : 2);
    for (int i = 0; i < mr; i++) {
        int64_t t = rows[i] / G;
        r_of[i] = (q0 + t) * J->Hq + hk * G + rows[i] % G;
        lo_of[i] = W->lo[q0 + t];
        hi_of[i] = W->hi[q0 + t];
        anchor_of[i] = J->mask ? lo_of[i] : 0;
        memcpy(Qt + i * row_bytes, J->q + r_of[i] * row_bytes, (size_t)row_bytes);
        memcpy(Ot + i * row_bytes, W->dout + r_of[i] * row_bytes, (size_t)row_bytes);
    }
}

/* Whether the row of query token row t (of q) sees key j, given its keys [lo, hi]. */
static inline int attn_sees(const attn_job *J, int64_t qt, int64_t lo, int64_t hi, int64_t j) {
    return lo <= j && j <= hi && (!J->mask || J->mask[qt * J->mask_stride + j]);
}

/* The key rows of block [k0, k0 + n) of sequence b, KV head hk, in k and v. */
static void attn_bwd_key_rows(const attn_job *J, int64_t b, int64_t hk, int64_t k0, int n, const char **krow,
                              const char **vrow) {
    const int64_t es = J->dt == DT_F32 ? 4 : 2;
    for (int j = 0; j < n; j++) {
        int64_t off = attn_key_offset(J, b, k0 + j) + hk * J->kv_head;
        krow[j] = J->k + off * es;
        vrow[j] = J->v + off * es;
    }
}

/* A row's keys [lo, hi] in block [k0, k0 + n), relative to k0 (*ja > *je: none), and with a mask
 * the bits of those the mask shows (query token row qt). */
static inline void attn_bwd_clip(const attn_job *J, int64_t qt, int64_t lo, int64_t hi, int64_t k0, int n, int *ja,
                                 int *je, uint64_t *bits) {
    if (lo < k0) lo = k0;
    if (hi > k0 + n - 1) hi = k0 + n - 1;
    *ja = (int)(lo - k0);
    *je = lo <= hi ? (int)(hi - k0) : -1;
    *bits = 0;
    if (J->mask)
        for (int j = *ja; j <= *je; j++)
            if (J->mask[qt * J->mask_stride + k0 + j]) *bits |= (uint64_t)1 << j;
}

/* Phase 1: tokens [t0, t1) of sequence b with every query head of KV head hk, MR rows at a time.
 * The first walk, over 64-key blocks from kstart (a multiple of 64), keeps every p and dp of the
 * rows' keys in Pall, DPall ([MR, span], span = keys from kstart, zero past the last, unseen keys
 * zero); then each row takes its delta over its own blocks, and a second walk over the key blocks
 * makes dq's chains (part: each row's chain of its current block). Kw: with 16-bit dtypes, the
 * keys the item's rows see widened to fp32, once per item, by key. */
#define ATTN_BWD_ROWS(P, T)                                                                         \
    T static void attn_bwd_rows_##P(const attn_bwd_job *W, int64_t b, int64_t t0, int64_t t1, int64_t hk, \
                                    char *Qt, char *Ot, float *S, float *Pm, float *DPm, float *Kw,  \
                                    float *Pall, float *DPall, int64_t span, float *part) {         \
        const attn_job *J = &W->J;                                                                  \
        const int64_t D = J->D, G = J->Hq / J->Hkv, len_k = J->len_k[b], q0 = J->cu_q[b];           \
        const int nd = (int)((D + 15) / 16);                                                        \
        const char *krow[KEY_BLOCK], *vrow[KEY_BLOCK];                                              \
        float lanes[16];                                                                            \
        if (J->dt != DT_F32) { /* every key some row of the item sees, widened once */              \
            const int64_t es = 2;                                                                   \
            int64_t ulo = INT64_MAX, uhi = -1;                                                      \
            for (int64_t t = t0; t < t1; t++)                                                       \
                if (W->lo[q0 + t] <= W->hi[q0 + t]) {                                               \
                    if (W->lo[q0 + t] < ulo) ulo = W->lo[q0 + t];                                   \
                    if (W->hi[q0 + t] > uhi) uhi = W->hi[q0 + t];                                   \
                }                                                                                   \
            for (int64_t j = ulo; j <= uhi; j++) {                                                  \
                const char *kj = J->k + (attn_key_offset(J, b, j) + hk * J->kv_head) * es;          \
                for (int c = 0; c < nd; c++) {                                                      \
                    int cnt = chunk_lanes(D, c);                                                    \
                    P##16_store(Kw + j * D + 16 * c, P##16_loadw(kj, 16 * c, J->dt, cnt), cnt);    \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int64_t i0 = t0 * G; i0 < t1 * G; i0 += MR) {                                          \
            int mr = (int)(t1 * G - i0 < MR ? t1 * G - i0 : MR);                                    \
            int64_t r_of[MR], lo_of[MR], hi_of[MR], a_of[MR], next_of[MR], first = INT64_MAX, last = -1; \
            int64_t rows[MR];                                                                       \
            for (int i = 0; i < mr; i++) rows[i] = i0 + i;                                          \
            attn_bwd_rows_of(W, b, hk, rows, mr, r_of, lo_of, hi_of, a_of, Qt, Ot);                 \
            for (int i = 0; i < mr; i++) {                                                          \
                W->delta[r_of[i]] = 0.0f;                                                           \
                if (lo_of[i] > hi_of[i]) continue;                                                  \
                if (lo_of[i] < first) first = lo_of[i];                                             \
                if (hi_of[i] > last) last = hi_of[i];                                               \
            }                                                                                       \
            if (last < 0) continue; /* no row sees a key: dq stays zero */                          \
            const int64_t kstart = first / KEY_BLOCK * KEY_BLOCK;                                   \
            for (int64_t k0 = kstart; k0 <= last; k0 += KEY_BLOCK) {                                \
                int n = (int)(len_k - k0 < KEY_BLOCK ? len_k - k0 : KEY_BLOCK), ja_of[MR], je_of[MR]; \
                uint64_t bits_of[MR];                                                               \
                attn_bwd_key_rows(J, b, hk, k0, n, krow, vrow);                                     \
                for (int i = 0; i < mr; i++)                                                        \
                    attn_bwd_clip(J, q0 + (i0 + i) / G, lo_of[i], hi_of[i], k0, n, &ja_of[i], &je_of[i], &bits_of[i]); \
                attn_bwd_block_##P(W, mr, Qt, Ot, r_of, krow, vrow, n, ja_of, je_of, bits_of, S, Pm, DPm); \
                for (int i = 0; i < mr; i++) {                                                      \
                    memcpy(Pall + i * span + (k0 - kstart), Pm + i * KEY_BLOCK, KEY_BLOCK * 4);      \
                    memcpy(DPall + i * span + (k0 - kstart), DPm + i * KEY_BLOCK, KEY_BLOCK * 4);    \
                }                                                                                   \
            }                                                                                       \
            const int64_t filled = (last / KEY_BLOCK + 1) * KEY_BLOCK - kstart;                     \
            for (int i = 0; i < mr; i++) {                                                          \
                memset(Pall + i * span + filled, 0, KEY_BLOCK * 4); /* a block may run past `last` */ \
                memset(DPall + i * span + filled, 0, KEY_BLOCK * 4);                                \
            }                                                                                       \
            for (int i = 0; i < mr; i++) {                                                          \
                const int64_t lo = lo_of[i], hi = hi_of[i], A = a_of[i];                              \
                if (lo > hi) continue;                                                              \
                float *p = Pall + i * span - kstart, *dp = DPall + i * span - kstart; /* by key */  \
                const int64_t b_first = A + (lo - A) / KEY_BLOCK * KEY_BLOCK;                       \
                float delta = 0.0f;                                                                 \
                for (int64_t b0 = b_first; b0 <= hi; b0 += KEY_BLOCK) {                             \
                    P##16 w = P##16_mul(P##16_load(p + b0, 16), P##16_load(dp + b0, 16));           \
                    for (int c = 1; c < KEY_BLOCK / 16; c++)                                        \
                        w = P##16_add(w, P##16_mul(P##16_load(p + b0 + 16 * c, 16), P##16_load(dp + b0 + 16 * c, 16))); \
                    P##16_store(lanes, w, 16);                                                      \
                    delta = delta + fold16(lanes);                                                  \
                }                                                                                   \
                W->delta[r_of[i]] = delta;                                                          \
                for (int64_t j = lo; j <= hi; j++) /* dp becomes ds in place */                     \
                    dp[j] = p[j] * (dp[j] - delta);                                                 \
                next_of[i] = b_first + KEY_BLOCK;                                                   \
            }                                                                                       \
            /* dq by key block (a block's keys stay in cache for the tile's rows); a row's chain    \
             * restarts where its own next block starts. acc is the row of dq itself. */           \
            memset(part, 0, (size_t)(MR * D) * 4);                                                  \
            for (int64_t k0 = kstart; k0 <= last; k0 += KEY_BLOCK) {                                \
                int n = (int)(len_k - k0 < KEY_BLOCK ? len_k - k0 : KEY_BLOCK);                     \
                attn_bwd_key_rows(J, b, hk, k0, n, krow, vrow);                                     \
                for (int i = 0; i < mr; i++) {                                                      \
                    const int64_t lo = lo_of[i], hi = hi_of[i], qt = q0 + (i0 + i) / G;             \
                    const int64_t ja = lo > k0 ? lo : k0, je = hi < k0 + n - 1 ? hi : k0 + n - 1;   \
                    if (ja > je) continue;                                                          \
                    const float *ds = DPall + i * span - kstart;                                    \
                    int64_t next = next_of[i];                                                      \
                    for (int c0 = 0; c0 < nd; c0 += 4) { /* four chunks of d: four chains in flight */ \
                        int cnt[4];                                                                 \
                        P##16 acc[4], pc[4];                                                        \
                        float *a = W->dq + r_of[i] * D + 16 * c0, *pt = part + i * D + 16 * c0;     \
                        for (int u = 0; u < 4; u++) {                                               \
                            cnt[u] = chunk_lanes(D, c0 + u);                                        \
                            acc[u] = P##16_load(a + 16 * u, cnt[u]);                                \
                            pc[u] = P##16_load(pt + 16 * u, cnt[u]);                                \
                        }                                                                           \
                        next = next_of[i];                                                          \
                        for (int64_t j = ja; j <= je; j++) {                                        \
                            if (j == next) { /* the row's next block */                             \
                                for (int u = 0; u < 4; u++) {                                       \
                                    acc[u] = P##16_add(acc[u], pc[u]);                              \
                                    pc[u] = P##16_zero();                                           \
                                }                                                                   \
                                next += KEY_BLOCK;                                                  \
                            }                                                                       \
                            if (J->mask && !attn_sees(J, qt, lo, hi, j)) continue;                  \
                            const float *kr = (J->dt == DT_F32 ? (const float *)krow[j - k0]        \
                                                               : Kw + j * D) + 16 * c0;             \
                            const P##16 dsj = P##16_set(ds[j]);                                     \
                            for (int u = 0; u < 4; u++)                                             \
                                pc[u] = P##16_fma(dsj, P##16_load(kr + 16 * u, cnt[u]), pc[u]);     \
                        }                                                                           \
                        for (int u = 0; u < 4; u++) {                                               \
                            P##16_store(a + 16 * u, acc[u], cnt[u]);                                \
                            P##16_store(pt + 16 * u, pc[u], cnt[u]);                                \
                        }                                                                           \
                    }                                                                               \
                    next_of[i] = next;                                                              \
                }                                                                                   \
            }                                                                                       \
            for (int i = 0; i < mr; i++) {                                                          \
                if (lo_of[i] > hi_of[i]) continue;                                                  \
                for (int c = 0; c < nd; c++) {                                                      \
                    int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                             \
                    float *a = W->dq + r_of[i] * D + 16 * c;                                        \
                    P##16 sum = P##16_add(P##16_load(a, cnt), P##16_load(part + i * D + 16 * c, cnt)); \
                    P##16_store(a, P##16_mul(sum, P##16_set(J->scale)), cnt);                       \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }

/* Phase 2: key block [k0, k0 + n) of sequence b, KV head hk, over the rows that see some key of it,
 * BWD_TILE at a time: Qw, Ow the rows' queries and upstream gradients widened to fp32; PK, PV each key's
 * chains of its current run of rows, GK, GV the sums of its current group's complete runs, AK, AV
 * the sums of its complete groups. */
#define ATTN_BWD_KEYS(P, T)                                                                         \
    T static void attn_bwd_keys_##P(const attn_bwd_job *W, int64_t b, int64_t k0, int64_t hk, char *Qt, \
                                    char *Ot, float *Qw, float *Ow, float *S, float *Pm, float *DPm, \
                                    float *PK, float *PV, float *GK, float *GV, float *AK, float *AV) { \
        const attn_job *J = &W->J;                                                                  \
        const int64_t D = J->D, G = J->Hq / J->Hkv, len_k = J->len_k[b], q0 = J->cu_q[b];           \
        const int64_t len_q = J->cu_q[b + 1] - q0;                                                  \
        const int nd = (int)((D + 15) / 16);                                                        \
        const int n = (int)(len_k - k0 < KEY_BLOCK ? len_k - k0 : KEY_BLOCK);                       \
        const char *krow[KEY_BLOCK], *vrow[KEY_BLOCK];                                              \
        attn_bwd_key_rows(J, b, hk, k0, n, krow, vrow);                                             \
        memset(AK, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        memset(AV, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        memset(PK, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        memset(PV, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        memset(GK, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        memset(GV, 0, (size_t)(KEY_BLOCK * D) * 4);                                                 \
        int64_t count[KEY_BLOCK] = {0}; /* rows that have seen key j so far */                      \
        const int64_t row_bytes = D * (J->dt == DT_F32 ? 4 : 2);                                    \
        for (int64_t t = 0, g = 0;;) {                                                              \
            /* The next BWD_TILE rows, in order, of the tokens whose keys reach into the block. */  \
            int64_t rows[BWD_TILE];                                                                 \
            int mr = 0, any = 0;                                                                    \
            for (; mr < BWD_TILE && t < len_q; g = g + 1 == G ? 0 : g + 1, t += g == 0) {          \
                const int64_t lo = W->lo[q0 + t], hi = W->hi[q0 + t];                               \
                if (lo > hi || hi < k0 || lo > k0 + n - 1) {                                        \
                    g = G - 1; /* the whole token is skipped */                                     \
                    continue;                                                                       \
                }                                                                                   \
                rows[mr++] = t * G + g;                                                             \
            }                                                                                       \
            if (mr == 0) break;                                                                     \
            int ja_of[BWD_TILE], je_of[BWD_TILE];                                                   \
            int64_t r_of[BWD_TILE], lo_of[BWD_TILE], hi_of[BWD_TILE], a_of[BWD_TILE];               \
            uint64_t bits_of[BWD_TILE];                                                             \
            attn_bwd_rows_of(W, b, hk, rows, mr, r_of, lo_of, hi_of, a_of, Qt, Ot);                 \
            for (int i = 0; i < mr; i++) {                                                          \
                attn_bwd_clip(J, q0 + rows[i] / G, lo_of[i], hi_of[i], k0, n, &ja_of[i], &je_of[i], &bits_of[i]); \
                if (J->mask && !bits_of[i]) je_of[i] = -1;                                          \
                any |= ja_of[i] <= je_of[i];                                                        \
            }                                                                                       \
            if (!any) continue;                                                                     \
            for (int u = 0; u < mr; u += MR)                                                        \
                attn_bwd_block_##P(W, mr - u < MR ? mr - u : MR, Qt + u * row_bytes, Ot + u * row_bytes, r_of + u, \
                                   krow, vrow, n, ja_of + u, je_of + u, bits_of + u, S, Pm + u * KEY_BLOCK, \
                                   DPm + u * KEY_BLOCK);                                            \
            for (int i = 0; i < mr; i++) {                                                          \
                float *ds = DPm + i * KEY_BLOCK; /* dp becomes ds in place */                       \
                const float delta = W->delta[r_of[i]];                                              \
                for (int j = ja_of[i]; j <= je_of[i]; j++) ds[j] = Pm[i * KEY_BLOCK + j] * (ds[j] - delta); \
                for (int c = 0; c < nd; c++) {                                                      \
                    int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                             \
                    P##16_store(Qw + i * D + 16 * c, P##16_loadw(Qt, i * D + 16 * c, J->dt, cnt), cnt); \
                    P##16_store(Ow + i * D + 16 * c, P##16_loadw(Ot, i * D + 16 * c, J->dt, cnt), cnt); \
                }                                                                                   \
            }                                                                                       \
            for (int j = 0; j < n; j++) {                                                           \
                int seen_by[BWD_TILE], seen = 0;                                                    \
                for (int i = 0; i < mr; i++) {                                                      \
                    seen_by[i] = ja_of[i] <= j && j <= je_of[i] && (!J->mask || (bits_of[i] >> j & 1)); \
                    seen += seen_by[i];                                                             \
                }                                                                                   \
                if (!seen) continue;                                                                \
                for (int c0 = 0; c0 < nd; c0 += 4) { /* four chunks of d: eight chains in flight */  \
                    int cnt[4];                                                                     \
                    P##16 sk[4], sv[4];                                                             \
                    float *pk = PK + j * D + 16 * c0, *pv = PV + j * D + 16 * c0;                   \
                    float *gk = GK + j * D + 16 * c0, *gv = GV + j * D + 16 * c0;                   \
                    float *ak = AK + j * D + 16 * c0, *av = AV + j * D + 16 * c0;                   \
                    for (int u = 0; u < 4; u++) {                                                   \
                        cnt[u] = chunk_lanes(D, c0 + u);                                            \
                        sk[u] = P##16_load(pk + 16 * u, cnt[u]);                                    \
                        sv[u] = P##16_load(pv + 16 * u, cnt[u]);                                    \
                    }                                                                               \
                    int64_t rows = count[j];                                                        \
                    for (int i = 0; i < mr; i++) {                                                  \
                        if (!seen_by[i]) continue;                                                  \
                        if (rows > 0 && (rows & (ROW_RUN_ATTN - 1)) == 0) /* a run is complete */   \
                            for (int u = 0; u < 4; u++) {                                           \
                                P##16_store(gk + 16 * u, P##16_add(P##16_load(gk + 16 * u, cnt[u]), sk[u]), cnt[u]); \
                                P##16_store(gv + 16 * u, P##16_add(P##16_load(gv + 16 * u, cnt[u]), sv[u]), cnt[u]); \
                                sk[u] = sv[u] = P##16_zero();                                       \
                            }                                                                       \
                        if (rows > 0 && (rows & (ROW_GROUP_ATTN - 1)) == 0) /* and a group */       \
                            for (int u = 0; u < 4; u++) {                                           \
                                P##16_store(ak + 16 * u, P##16_add(P##16_load(ak + 16 * u, cnt[u]), P##16_load(gk + 16 * u, cnt[u])), cnt[u]); \
                                P##16_store(av + 16 * u, P##16_add(P##16_load(av + 16 * u, cnt[u]), P##16_load(gv + 16 * u, cnt[u])), cnt[u]); \
                                P##16_store(gk + 16 * u, P##16_zero(), cnt[u]);                     \
                                P##16_store(gv + 16 * u, P##16_zero(), cnt[u]);                     \
                            }                                                                       \
                        const P##16 dsj = P##16_set(DPm[i * KEY_BLOCK + j]), pj = P##16_set(Pm[i * KEY_BLOCK + j]); \
                        const float *qw = Qw + i * D + 16 * c0, *ow = Ow + i * D + 16 * c0;         \
                        for (int u = 0; u < 4; u++) {                                               \
                            sk[u] = P##16_fma(dsj, P##16_load(qw + 16 * u, cnt[u]), sk[u]);         \
                            sv[u] = P##16_fma(pj, P##16_load(ow + 16 * u, cnt[u]), sv[u]);          \
                        }                                                                           \
                        rows++;                                                                     \
                    }                                                                               \
                    for (int u = 0; u < 4; u++) {                                                   \
                        P##16_store(pk + 16 * u, sk[u], cnt[u]);                                    \
                        P##16_store(pv + 16 * u, sv[u], cnt[u]);                                    \
                    }                                                                               \
                }                                                                                   \
                count[j] += seen;                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int64_t e = 0; e < n * D; e += 16) { /* the last run and group */                       \
            int cnt = (int)(n * D - e < 16 ? n * D - e : 16);                                       \
            P##16 gk = P##16_add(P##16_load(GK + e, cnt), P##16_load(PK + e, cnt));                 \
            P##16 gv = P##16_add(P##16_load(GV + e, cnt), P##16_load(PV + e, cnt));                 \
            P##16_store(AK + e, P##16_add(P##16_load(AK + e, cnt), gk), cnt);                       \
            P##16_store(AV + e, P##16_add(P##16_load(AV + e, cnt), gv), cnt);                       \
        }                                                                                           \
        for (int j = 0; j < n; j++) {                                                               \
            int64_t off = attn_key_offset(J, b, k0 + j) + hk * J->kv_head;                          \
            for (int c = 0; c < nd; c++) {                                                          \
                int cnt = (int)(D - 16 * c < 16 ? D - 16 * c : 16);                                 \
                P##16_store(W->dk + off + 16 * c, P##16_mul(P##16_load(AK + j * D + 16 * c, cnt), P##16_set(J->scale)), cnt); \
                P##16_store(W->dv + off + 16 * c, P##16_load(AV + j * D + 16 * c, cnt), cnt);       \
            }                                                                                       \
        }                                                                                           \
    }

ATTN_BWD_BLOCK(s, )
ATTN_BWD_ROWS(s, )
ATTN_BWD_KEYS(s, )
#if LS_X86
ATTN_BWD_BLOCK(a, AVX2_T)
ATTN_BWD_ROWS(a, AVX2_T)
ATTN_BWD_KEYS(a, AVX2_T)
ATTN_BWD_BLOCK(z, AVX512_T)
ATTN_BWD_ROWS(z, AVX512_T)
ATTN_BWD_KEYS(z, AVX512_T)
#endif

/* The sequence b with starts[b] <= item < starts[b + 1]. */
static int64_t attn_sequence_of(const int64_t *starts, int64_t B, int64_t item) {
    int64_t lo = 0, hi = B;
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (starts[mid] <= item) lo = mid; else hi = mid;
    }
    return lo;
}

/* 64-byte aligned scratch of `floats` fp32 values, zeroed (the exp reads whole 16-lane groups of
 * S, lanes past a row's keys included; zeroed memory keeps those reads defined). */
static float *attn_scratch(size_t floats, void **base) {
    *base = calloc(1, floats * 4 + 64);
    return *base ? (float *)(((uintptr_t)*base + 63) & ~(uintptr_t)63) : NULL;
}

static void attn_bwd_rows_item(void *ctx, int64_t item) {
    attn_bwd_job *W = (attn_bwd_job *)ctx;
    const attn_job *J = &W->J;
    int64_t b = attn_sequence_of(J->item_start, J->B, item), r = item - J->item_start[b];
    int64_t t0 = (r / J->Hkv) * J->tokens, hk = r % J->Hkv, len_q = J->cu_q[b + 1] - J->cu_q[b];
    int64_t t1 = t0 + J->tokens < len_q ? t0 + J->tokens : len_q;
    /* Keys from a multiple of 64 to the last block's end, and a block past it read as zeros. */
    int64_t span = (J->len_k[b] / KEY_BLOCK + 2) * KEY_BLOCK;
    size_t D = (size_t)J->D, kw = J->dt == DT_F32 ? 0 : (size_t)J->len_k[b] * D;
    void *base;
    float *S = attn_scratch(3 * MR * KEY_BLOCK + kw + 2 * (size_t)span * MR + 3 * MR * D, &base);
    if (!S) {
        atomic_store(&((attn_job *)J)->failed, 1);
        return;
    }
    float *Pm = S + MR * KEY_BLOCK, *DPm = Pm + MR * KEY_BLOCK, *Kw = DPm + MR * KEY_BLOCK;
    float *Pall = Kw + kw, *DPall = Pall + (size_t)span * MR;
    float *part = DPall + (size_t)span * MR;
    char *Qt = (char *)(part + MR * D), *Ot = Qt + MR * D * 4;
#if LS_X86
    if (J->isa >= ISA_AVX512) attn_bwd_rows_z(W, b, t0, t1, hk, Qt, Ot, S, Pm, DPm, Kw, Pall, DPall, span, part);
    else if (J->isa == ISA_AVX2) attn_bwd_rows_a(W, b, t0, t1, hk, Qt, Ot, S, Pm, DPm, Kw, Pall, DPall, span, part);
    else
#endif
        attn_bwd_rows_s(W, b, t0, t1, hk, Qt, Ot, S, Pm, DPm, Kw, Pall, DPall, span, part);
    free(base);
}

static void attn_bwd_keys_item(void *ctx, int64_t item) {
    attn_bwd_job *W = (attn_bwd_job *)ctx;
    const attn_job *J = &W->J;
    int64_t b = attn_sequence_of(W->key_item_start, J->B, item), r = item - W->key_item_start[b];
    int64_t k0 = (r / J->Hkv) * KEY_BLOCK, hk = r % J->Hkv;
    size_t D = (size_t)J->D, blk = KEY_BLOCK * D;
    void *base;
    float *S = attn_scratch(MR * KEY_BLOCK + 2 * BWD_TILE * KEY_BLOCK + 4 * BWD_TILE * D + 6 * blk, &base);
    if (!S) {
        atomic_store(&((attn_job *)J)->failed, 1);
        return;
    }
    float *Pm = S + MR * KEY_BLOCK, *DPm = Pm + BWD_TILE * KEY_BLOCK, *Qw = DPm + BWD_TILE * KEY_BLOCK;
    float *Ow = Qw + BWD_TILE * D, *PK = Ow + BWD_TILE * D, *PV = PK + blk, *GK = PV + blk, *GV = GK + blk;
    float *AK = GV + blk, *AV = AK + blk;
    char *Qt = (char *)(AV + blk), *Ot = Qt + BWD_TILE * D * 4;
#if LS_X86
    if (J->isa >= ISA_AVX512) attn_bwd_keys_z(W, b, k0, hk, Qt, Ot, Qw, Ow, S, Pm, DPm, PK, PV, GK, GV, AK, AV);
    else if (J->isa == ISA_AVX2) attn_bwd_keys_a(W, b, k0, hk, Qt, Ot, Qw, Ow, S, Pm, DPm, PK, PV, GK, GV, AK, AV);
    else
#endif
        attn_bwd_keys_s(W, b, k0, hk, Qt, Ot, Qw, Ow, S, Pm, DPm, PK, PV, GK, GV, AK, AV);
    free(base);
}

/* Attention backward (the order of the attention backward section above): the arguments as
 * ls_attention_fwd takes them, without a block table; dout [Tq, Hq, D] in q's dtype; row_max,
 * row_sum the forward's. dq (fp32, as q) and dk, dv (fp32, keys at the element offsets k's are at)
 * must be zero on entry: rows and keys that no score involves stay zero. delta: fp32 [Tq, Hq]
 * scratch. Returns 0, -1 for arguments it cannot take, -2 when memory runs out. */
int ls_attention_bwd(int64_t B, int64_t Hq, int64_t Hkv, int64_t D, const void *q, const void *k, const void *v,
                     const void *dout, int64_t kv_token, int64_t kv_head, const int64_t *cu_q, const int64_t *len_k,
                     const int64_t *k_start, const unsigned char *mask, int64_t mask_stride, float scale, int causal,
                     int64_t window, const float *row_max, const float *row_sum, float *delta, float *dq, float *dk,
                     float *dv, int dt, int isa, int threads) {
    if (B < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || window < 0 || dt < DT_F32 || dt > DT_F16 ||
        kv_token <= 0 || kv_head < 0 || !ls_cpu_supports(isa) || k_start == NULL)
        return -1;
    for (int64_t b = 0; b < B; b++)
        if (cu_q[b + 1] < cu_q[b] || len_k[b] < 0 || (mask && len_k[b] > mask_stride)) return -1;
    const int64_t tq = B > 0 ? cu_q[B] : 0;
    int64_t *starts = (int64_t *)malloc((size_t)(2 * B + 2 + 2 * tq) * 8);
    if (!starts) return -2;
    int64_t tokens = Hq / Hkv >= 64 ? 1 : 64 / (Hq / Hkv), work = 0;
    int64_t *key_starts = starts + B + 1, *lo = key_starts + B + 1, *hi = lo + tq;
    starts[0] = key_starts[0] = 0;
    attn_bwd_job W = {{B, Hq, Hkv, D, (const char *)q, (const char *)k, (const char *)v, cu_q, len_k, k_start, NULL,
                       0, 0, window, kv_token, kv_head, mask, mask_stride, scale, causal, dt, isa, NULL,
                       (float *)row_max, (float *)row_sum, starts, tokens, 0},
                      (const char *)dout, delta, dq, dk, dv, key_starts, lo, hi};
    for (int64_t b = 0; b < B; b++) {
        int64_t len_q = cu_q[b + 1] - cu_q[b];
        starts[b + 1] = starts[b] + (len_q + tokens - 1) / tokens * Hkv;
        key_starts[b + 1] = key_starts[b] + (len_q ? (len_k[b] + KEY_BLOCK - 1) / KEY_BLOCK * Hkv : 0);
        work += len_q * len_k[b];
        for (int64_t t = 0; t < len_q; t++) { /* once here, not per key block in phase 2 */
            attn_interval(&W.J, len_k[b], len_k[b] - len_q + t, &lo[cu_q[b] + t], &hi[cu_q[b] + t]);
            attn_mask_bounds(&W.J, cu_q[b] + t, &lo[cu_q[b] + t], &hi[cu_q[b] + t]);
        }
    }
    int team = work * Hq * D < (int64_t)1 << 14 ? 1 : threads;
    parallel_for(attn_bwd_rows_item, &W, starts[B], team);
    if (!atomic_load(&W.J.failed)) parallel_for(attn_bwd_keys_item, &W, key_starts[B], team);
    free(starts);
    return atomic_load(&W.J.failed) ? -2 : 0;
}
