/* C = A @ B on AVX512-BF16 dot-product instructions, for FP32 operands whose
 * values bfloat16 holds exactly (an FP8 grid, bfloat16's own).
 *
 * Each operand is packed into bfloat16 pairs along K (the high half of the
 * FP32 bit pattern, which for such values is the value itself), then an
 * MR x NR block of C accumulates in FP32 with _mm512_dpbf16_ps: every product
 * of two bfloat16 values is exact in FP32, so the result differs from an FP32
 * GEMM's only in the order of the FP32 additions. A and B may have any
 * strides; C is contiguous. A batch of products shares one parallel region.
 * Built and loaded by lpcompile/cpu_gemm.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MR 8  /* rows of C per block: 16 accumulators, 2 B vectors, 1 A broadcast */
#define NR 32 /* columns of C per block: two vectors of 16 FP32 */

/* The bfloat16 bits of an FP32 value bfloat16 holds exactly; NaNs stay NaN. */
static inline uint32_t bf16_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) & 0x8000u) | 0x7fc0u;
  return u >> 16;
}

/* Scratch for the packed operands, kept per calling thread between calls up to
 * KEEP_WORDS (32 MiB); a larger one is freed after its call. */
#define KEEP_WORDS ((size_t)8 << 20)
/* Outputs of this many floats (512 KiB, half a Zen 4 core's L2) and more are written
 * with non-temporal stores; see block(). */
#define STREAM_FLOATS ((size_t)1 << 17)
static _Thread_local uint32_t* scratch;
static _Thread_local size_t scratch_words;

static void release_large_scratch(void) {
  if (scratch_words > KEEP_WORDS) {
    free(scratch);
    scratch = NULL;
    scratch_words = 0;
  }
}

static uint32_t* scratch_for(size_t words) {
  if (words > scratch_words) {
    free(scratch);
    scratch = aligned_alloc(64, (words * 4 + 63) / 64 * 64);
    scratch_words = scratch ? words : 0;
  }
  return scratch;
}

/* Pack rows [0, rows) x K of each of `batch` matrices X (batch stride sb, row
 * stride sr, K stride sk) into panels of `width` rows: for q = matrix * panels +
 * panel, out[(q * KP + p) * width + r] holds X[r][2p], X[r][2p + 1] of that
 * panel's row r. Reads run along whichever of X's dimensions is contiguous. */
static void pack(const float* x, int64_t sb, int64_t sr, int64_t sk, int64_t batch, int64_t rows, int64_t K,
                 int width, uint32_t* out) {
  int64_t KP = (K + 1) / 2, panels = (rows + width - 1) / width;
  if (sr == 1 && sk != 1) {
#pragma omp for collapse(2)
    for (int64_t q = 0; q < batch * panels; q++)
      for (int64_t p = 0; p < KP; p++)
        for (int r = 0; r < width; r++) {
          int64_t row = q % panels * width + r, k = 2 * p;
          const float* src = x + q / panels * sb;
          uint32_t v = 0;
          if (row < rows) {
            v = bf16_bits(src[row + k * sk]);
            if (k + 1 < K) v |= bf16_bits(src[row + (k + 1) * sk]) << 16;
          }
          out[(q * KP + p) * width + r] = v;
        }
    return;
  }
#pragma omp for collapse(2)
  for (int64_t q = 0; q < batch * panels; q++)
    for (int r = 0; r < width; r++) {
      int64_t row = q % panels * width + r;
      uint32_t* dst = out + q * KP * width + r;
      if (row >= rows) {
        for (int64_t p = 0; p < KP; p++) dst[p * width] = 0;
        continue;
      }
      const float* src = x + q / panels * sb + row * sr;
      for (int64_t p = 0; p < K / 2; p++)
        dst[p * width] = bf16_bits(src[2 * p * sk]) | bf16_bits(src[(2 * p + 1) * sk]) << 16;
      if (K % 2) dst[(KP - 1) * width] = bf16_bits(src[(K - 1) * sk]);
    }
}

/* One MR x NR block of C from packed panels a (MR rows) and b (NR columns). */
static void block(const uint32_t* a, const uint32_t* b, int64_t KP, float* c, int64_t ldc, int64_t rows,
                  int64_t cols, int stream) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < KP; p++) {
    __m512bh b0 = (__m512bh)_mm512_load_si512(b + p * NR);
    __m512bh b1 = (__m512bh)_mm512_load_si512(b + p * NR + 16);
    for (int r = 0; r < MR; r++) {
      __m512bh ar = (__m512bh)_mm512_set1_epi32((int)a[p * MR + r]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
    }
  }
  __mmask16 m0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
  __mmask16 m1 = cols <= 16 ? 0 : cols >= 32 ? 0xffff : (__mmask16)((1u << (cols - 16)) - 1);
  /* A large C bypasses the cache (non-temporal stores, whole aligned blocks): it is
   * written once, and in a training step it is usually cold, so ordinary stores first
   * read every line of it (the MLP's 4 MB weight gradient: 1.15 ms in a step, 0.81 ms
   * so). A small C is better left in cache for the kernel that reads it next. */
  if (stream && cols == NR && (uintptr_t)c % 64 == 0 && ldc % 16 == 0) {
    for (int r = 0; r < rows; r++) {
      _mm512_stream_ps(c + r * ldc, acc[r][0]);
      _mm512_stream_ps(c + r * ldc + 16, acc[r][1]);
    }
    return;
  }
  for (int r = 0; r < rows; r++) {
    _mm512_mask_storeu_ps(c + r * ldc, m0, acc[r][0]);
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, acc[r][1]);
  }
}

/* C[i] = A[i] @ B[i] for i < batch, A[i] (M, K) and B[i] (K, N) with the given
 * strides, C contiguous (batch, M, N), on `threads` OpenMP threads. Returns 0,
 * or -1 when the scratch for the packed operands cannot be allocated. */
int lp_bmm_bf16(const float* A, int64_t sab, int64_t sam, int64_t sak, const float* B, int64_t sbb, int64_t sbk,
                int64_t sbn, float* C, int64_t batch, int64_t M, int64_t N, int64_t K, int threads) {
  if (batch == 0 || M == 0 || N == 0) return 0;
  if (K == 0) {
    memset(C, 0, (size_t)(batch * M * N) * sizeof(float));
    return 0;
  }
  int64_t KP = (K + 1) / 2, MB = (M + MR - 1) / MR, NB = (N + NR - 1) / NR;
  size_t a_words = ((size_t)(batch * MB * MR * KP) + 15) / 16 * 16; /* b starts 64-byte aligned */
  uint32_t* a = scratch_for(a_words + (size_t)(batch * NB * NR * KP));
  if (!a) return -1;
  uint32_t* b = a + a_words;
  int stream = (size_t)(batch * M * N) >= STREAM_FLOATS;
#pragma omp parallel num_threads(threads)
  {
    pack(A, sab, sam, sak, batch, M, K, MR, a);
    pack(B, sbb, sbn, sbk, batch, N, K, NR, b); /* B's columns are the rows of B^T */
#pragma omp for collapse(3) nowait
    for (int64_t i = 0; i < batch; i++)
      for (int64_t nb = 0; nb < NB; nb++)
        for (int64_t mb = 0; mb < MB; mb++) {
          int64_t rows = M - mb * MR < MR ? M - mb * MR : MR, cols = N - nb * NR < NR ? N - nb * NR : NR;
          block(a + (i * MB + mb) * KP * MR, b + (i * NB + nb) * KP * NR, KP, C + (i * M + mb * MR) * N + nb * NR,
                N, rows, cols, stream);
        }
    _mm_sfence(); /* this thread's non-temporal stores are visible before the region ends */
  }
  release_large_scratch();
  return 0;
}
