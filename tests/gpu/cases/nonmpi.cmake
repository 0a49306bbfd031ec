# gpu.nonmpi.np2: two ranks on two GPUs launched without mpirun (RANK/WORLD_SIZE, bootstrap=file:),
# a save whose gathers go over NCCL, and a bitwise resume (tests/parallel/nonmpi_gpu.sh). Read by
# tests/gpu/gpu_cases.cmake, so the build tree and the GPU bundle both run it; it skips (exit 77,
# saying why) without a CUDA build or with fewer than 2 GPUs visible.
hp_gpu_case(gpu.nonmpi.np2 GPUS 2 TIMEOUT 900
            COMMAND bash ${HP_GPU_SRC}/tests/parallel/nonmpi_gpu.sh ${HP} ${CFG}/tiny-moe.ini
                    ${GW}/nonmpi ${HP_GPU_PYTHON} ${HP_GPU_SRC}/tests/tools/hp_check.py
                    ${HP_GPU_BUILD})
