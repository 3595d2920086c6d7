"""CPU kernels: the AVX512-BF16 GEMM (:mod:`.gemm`, ``mm_bf16.c``)."""
