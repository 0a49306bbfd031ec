# What the build tree's and the GPU bundle's GPU cases share (tests/gpu/gpu_cases.cmake).
# The gpu_tests suites that run on 2 ranks (one GPU each) under MPI, not in one process.
set(HP_GPU_MPI_SUITES "Nccl[A-Za-z]*")
# compute-sanitizer: the tools, and the processes the GPU tests are split into under each.
set(HP_GPU_SANITIZE_TOOLS memcheck racecheck initcheck synccheck)
set(HP_GPU_SANITIZE_SHARDS 8)
