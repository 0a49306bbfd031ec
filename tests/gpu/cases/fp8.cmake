# precision=fp8 on the GPU: tiny-moe trained 100 steps with bf16 GEMMs, with FP8 GEMMs (dense and
# experts, the default classes) and with the unembedding's products in FP8 as well; same seed and
# data; the mean loss of every 10 consecutive steps of each FP8 run is within 5% of the bf16
# run's. Single steps are not compared: a change at the level of rounding (the gradient norm
# summed in another order) moved one step of the bf16 run by 6.6% and its 10-step means by at
# most 1.7% (docs/testing.md, "Comparing losses"). The products' agreement
# with the CPU emulation is CudaModel.Fp8* and CudaFp8.* in gpu_tests. Read by
# tests/gpu/gpu_cases.cmake (build tree and GPU bundle).
set(g ${GW}/fp8)
foreach(p bf16 fp8)
  hp_gpu_case(gpu.fp8.tiny_moe.${p} GPUS 1 SETUP gpu_fp8_${p} CLEAN ${g}/${p}.jsonl
              COMMAND ${HP} train --config ${CFG}/tiny-moe.ini --device=cuda --steps=100
                      --precision=${p} --metrics_path=${g}/${p}.jsonl)
endforeach()
hp_gpu_case(gpu.fp8.tiny_moe.fp8_unembedding GPUS 1 SETUP gpu_fp8_unembedding
            CLEAN ${g}/fp8_unembedding.jsonl
            COMMAND ${HP} train --config ${CFG}/tiny-moe.ini --device=cuda --steps=100
                    --precision=fp8 --fp8_gemms=dense,experts,unembedding
                    --metrics_path=${g}/fp8_unembedding.jsonl)
hp_gpu_case(gpu.fp8.tiny_moe.losses_within_5_percent GPUS 1 REQUIRES "gpu_fp8_bf16;gpu_fp8_fp8"
            COMMAND ${CHECK} losses ${g}/fp8.jsonl ${g}/bf16.jsonl --rel 0.05 --window 10 --first 1
                    --steps 100 --same-steps)
hp_gpu_case(gpu.fp8.tiny_moe.unembedding_losses_within_5_percent GPUS 1
            REQUIRES "gpu_fp8_bf16;gpu_fp8_unembedding"
            COMMAND ${CHECK} losses ${g}/fp8_unembedding.jsonl ${g}/bf16.jsonl --rel 0.05 --window 10
                    --first 1 --steps 100 --same-steps)
