# precision=fp8 on the GPU: tiny-moe trained 100 steps with bf16 GEMMs and with FP8 GEMMs (dense
# and experts), same seed and data; every step's loss of the FP8 run is within 5% of the bf16
# run's. The products' agreement with the CPU emulation is CudaModel.Fp8* and CudaFp8.* in
# gpu_tests. Read by tests/gpu/gpu_cases.cmake (build tree and GPU bundle).
set(g ${GW}/fp8)
foreach(p bf16 fp8)
  hp_gpu_case(gpu.fp8.tiny_moe.${p} GPUS 1 SETUP gpu_fp8_${p} CLEAN ${g}/${p}.jsonl
              COMMAND ${HP} train --config ${CFG}/tiny-moe.ini --device=cuda --steps=100
                      --precision=${p} --metrics_path=${g}/${p}.jsonl)
endforeach()
hp_gpu_case(gpu.fp8.tiny_moe.losses_within_5_percent GPUS 1 REQUIRES "gpu_fp8_bf16;gpu_fp8_fp8"
            COMMAND ${CHECK} losses ${g}/fp8.jsonl ${g}/bf16.jsonl --rel 0.05 --first 1 --steps 100
                    --same-steps)
