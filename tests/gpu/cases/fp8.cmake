# precision=fp8 on the GPU: tiny-moe trained 100 steps with bf16 GEMMs, with FP8 GEMMs (dense and
# experts, the default classes), with the unembedding's logits and input gradient in FP8 as well,
# and with every class, the unembedding's weight gradient included; same seed and data; the mean
# loss of every 10 consecutive steps of each FP8 run is within 5% of the bf16 run's. Single steps are not compared: a change at the level of rounding (the gradient norm
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
hp_gpu_case(gpu.fp8.tiny_moe.fp8_all GPUS 1 SETUP gpu_fp8_all CLEAN ${g}/fp8_all.jsonl
            COMMAND ${HP} train --config ${CFG}/tiny-moe.ini --device=cuda --steps=100
                    --precision=fp8 --fp8_gemms=dense,experts,unembedding,unembedding_wgrad
                    --metrics_path=${g}/fp8_all.jsonl)
hp_gpu_case(gpu.fp8.tiny_moe.all_losses_within_5_percent GPUS 1 REQUIRES "gpu_fp8_bf16;gpu_fp8_all"
            COMMAND ${CHECK} losses ${g}/fp8_all.jsonl ${g}/bf16.jsonl --rel 0.05 --window 10
                    --first 1 --steps 100 --same-steps)
