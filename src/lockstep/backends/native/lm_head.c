/* ---------------------------------------------------------------- logit chunks
 * The LM head's row arithmetic on one vocabulary chunk of logits [rows, L], as the GEMM left them
 * (fp32, bf16 or fp16, rows ld elements apart): fixed_order.lse_fold and fixed_order.logit_grad,
 * operation for operation, on exp_log.c's exp and rows.c's row sum, so they give the bits of those
 * compositions. Each logit is widened exactly to fp32 and divided by the temperature t (fp32; not
 * at t = 1, where the composition does not divide either).
 *
 *   fold (mode 0): M = the row's max (NaN propagates), or max(run_max, it) after the first chunk
 *                  (where the two are +0 and -0, M's sign may differ from torch.maximum's, which
 *                  itself differs between its vector body and its tail; no value below depends on
 *                  it: exp(+-0) = 1, and M + log(S) is the same);
 *                  S = row_sum(exp(x - M)), or run_sum * exp(run_max - M) + row_sum(exp(x - M));
 *                  run_max, run_sum <- M, S.
 *   grad (mode 1): d = -exp(x - lse); d[local] = d[local] + inside; out = d * gs, stored as fp32 or
 *                  bf16 (torch's rounding).
 *
 * A row's values depend on that row alone, so the rows that share a work item, the thread count and
 * the instruction set change no bit. */

typedef struct {
    const char *x;
    int64_t rows, L, ld, chunk;      /* fold: the row is folded `chunk` elements at a time */
    int dt, out_dt, mode, first, isa;
    float t;
    float *run_max, *run_sum;        /* fold: per row, in and out */
    const float *lse, *inside, *gs;  /* grad: per row */
    const int64_t *local;            /* grad: per row, in [0, L) */
    void *out;                       /* grad: [rows, L] contiguous */
    atomic_int failed;
} logit_job;

INLINE void logit_rows(logit_job *J, int64_t item) {
    const int64_t L = J->L, C = J->mode == 0 ? J->chunk : L;
    float acc[SUM_WIDTH];
    float *e = (float *)malloc((size_t)C * 4);
    if (!e) {
        atomic_store(&J->failed, 1);
        return;
    }
    const int es = J->dt == DT_F32 ? 4 : 2;
    for (int64_t r = item * ROWS_ITEM; r < (item + 1) * ROWS_ITEM && r < J->rows; r++) {
        for (int64_t c0 = 0; c0 < L; c0 += C) {
            const int64_t n = L - c0 < C ? L - c0 : C;
            const int first = J->first && c0 == 0;
            load_block(J->x + (r * J->ld + c0) * es, J->dt, 0, n, n, e);
            if (J->t != 1.0f)
                for (int64_t j = 0; j < n; j++) e[j] = e[j] / J->t;
            if (J->mode == 0) {
                float m = row_max(e, n);
                const float old = first ? m : J->run_max[r]; /* the first chunk's inputs are never read */
                if (!first) m = old != old || m != m ? NAN : (old > m ? old : m);
                for (int64_t j = 0; j < n; j++) e[j] = e[j] - m;
                unary_isa(J->isa, e, e, n, FN_EXP);
                float sum = row_sum_f32(e, n, acc);
                J->run_sum[r] = first ? sum : J->run_sum[r] * s_exp(old - m) + sum;
                J->run_max[r] = m;
            } else {
                const float lse = J->lse[r], g = J->gs[r];
                for (int64_t j = 0; j < n; j++) e[j] = e[j] - lse;
                unary_isa(J->isa, e, e, n, FN_EXP);
                for (int64_t j = 0; j < n; j++) e[j] = -e[j];
                e[J->local[r]] = e[J->local[r]] + J->inside[r];
                for (int64_t j = 0; j < n; j++) e[j] = e[j] * g;
                store_block((char *)J->out, J->out_dt, r * L, n, e);
            }
        }
    }
    free(e);
}

#define LOGIT_PASSES(P, T)                                                                          \
    T static void logit_item_##P(void *ctx, int64_t item) { logit_rows((logit_job *)ctx, item); }

LOGIT_PASSES(s, )
#if LS_X86
LOGIT_PASSES(a, AVX2_T)
LOGIT_PASSES(z, AVX512_T)
#endif

/* The logit-chunk arithmetic above on x [rows, L] (dtype dt, rows ld elements apart), temperature t:
 * mode 0 folds the row's consecutive chunks of `chunk` elements (the last may be shorter), one
 * after another, into run_max and run_sum ([rows] fp32; their inputs are not read when first is
 * set): the bits of one call per chunk, in one; mode 1 (chunk = L) writes the logits' gradient
 * into out [rows, L] (out_dt fp32 or bf16) from lse, inside and gs ([rows] fp32) and local ([rows]
 * int64 in [0, L)). Returns 0, -1 for arguments it cannot take, -2 when memory runs out. */
int ls_logit_rows(int64_t rows, int64_t L, int64_t chunk, const void *x, int64_t ld, int dt, float t, int mode,
                  int first, float *run_max, float *run_sum, const float *lse, const int64_t *local,
                  const float *inside, const float *gs, void *out, int out_dt, int isa, int threads) {
    if (rows < 0 || L < 1 || ld < L || chunk < 1 || chunk > L || (mode == 1 && chunk != L) || dt < DT_F32 ||
        dt > DT_F16 || mode < 0 || mode > 1 || !ls_cpu_supports(isa))
        return -1;
    if (mode == 0 && (!run_max || !run_sum)) return -1;
    if (mode == 1 && (!lse || !local || !inside || !gs || !out || (out_dt != DT_F32 && out_dt != DT_BF16))) return -1;
    if (mode == 1)
        for (int64_t r = 0; r < rows; r++)
            if (local[r] < 0 || local[r] >= L) return -1;
    logit_job J = {(const char *)x, rows, L, ld, chunk, dt, out_dt, mode, first, isa, t, run_max, run_sum, lse,
                   inside, gs, local, out, 0};
    parallel_for(ELEMENTWISE_FOR(logit_item, isa), &J, (rows + ROWS_ITEM - 1) / ROWS_ITEM,
                 rows * L < (1 << 16) ? 1 : threads);
    return atomic_load(&J.failed) ? -2 : 0;
}
