# gpu.bench.gemm: `hotpath bench gemm` (bf16 against FP8 GEMMs) on one GPU at tiny-moe's shapes and
# the 8192^3 cube, its --bench_json record checked for every product and the FP8 recipe
# (tests/gpu/bench_gemm_case.sh). Read by tests/gpu/gpu_cases.cmake, so the build tree and the
# GPU bundle both run it; it skips (exit 77, saying why) without a CUDA build or a GPU.
hp_gpu_case(gpu.bench.gemm GPUS 1 TIMEOUT 600
            COMMAND bash ${HP_GPU_SRC}/tests/gpu/bench_gemm_case.sh ${HP} ${CFG}/tiny-moe.ini
                    ${GW}/bench_gemm ${HP_GPU_PYTHON})
