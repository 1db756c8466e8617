/* lockstep's native CPU kernels (docs/adr/0010-native-cpu-backend.md).
 *
 * One reduction order for every CPU, thread count and instruction set:
 *
 *   dot(a[0:K], b[0:K]): 16 lanes; lane j runs one fp32 FMA chain s_j = fma(a[k], b[k], s_j) over
 *   k = j, j + 16, j + 32, ... < K, in increasing k, from s_j = +0. The lanes then fold in a fixed
 *   tree: t_j = s_j + s_{j+8}, u_j = t_j + t_{j+4}, v_j = u_j + u_{j+2}, r = v_0 + v_1.
 *
 * bf16 has its own order, the arithmetic of the VDPBF16PS instruction as Intel's SDM specifies it
 * (docs/adr/0018): 16 lanes over chunks of 32 elements; lane j of chunk c takes k = 32 c + 2 j + 1,
 * then k = 32 c + 2 j, each as s_j = ftz(fma(daz(a[k]), daz(b[k]), s_j)), from s_j = +0, the chunk
 * past K zero-filled (daz: a denormal input is a zero of its sign; ftz: so is a denormal result;
 * the product is exact and rounded once, with the add). The lanes then fold as above. CPUs with
 * AVX512_BF16 run the instruction itself (after a self-test against this definition); the other
 * paths compute the definition.
 *
 * The scalar, AVX2 and AVX-512 paths perform exactly these IEEE operations (an AVX2 register holds
 * half of the lanes, an AVX-512 register all 16, the scalar path one), so their bits agree. bf16
 * and fp16 inputs are widened exactly to fp32 before they are multiplied. Threads divide the output
 * tiles among themselves and never split a dot product, so the thread count changes no bit either.
 *
 * Build: cc -O3 -shared -fPIC -pthread -ffp-contract=off kernels.c -lm (lockstep/backends/native/build.py).
 * -ffp-contract=off keeps the compiler from fusing the fold's adds with anything.
 */

/* The kernels are one translation unit: this file includes the others in order, each using what
 * the header and the files before it define, so that the compiler sees every kernel at once, as
 * one file, and inlines the hot helpers (exp and log, the widening loads, the micro-tiles) into
 * the loops that call them; only the ls_ functions are exported. */
#include "kernels.h"

#include "threads.c"
#include "exp_log.c"
#include "tiles.c"
#include "isa.c"
#include "gemm.c"
#include "float64.c"
#include "attention.c"
#include "attention_backward.c"
#include "rows.c"
#include "lm_head.c"

int ls_abi_version(void) { return 15; }
