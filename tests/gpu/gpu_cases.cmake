# The GPU cases of CTest other than the GoogleTest cases of gpu_tests, label `gpu`: one list, read
# by the build tree (tests/CMakeLists.txt) and by the GPU bundle's CTestTestfile.cmake
# (tests/gpu/bundle_ctest.cmake, written by launch/scripts/gpu_bundle.sh). Every case runs through
# tests/gpu/gpu_case.sh, which skips it (exit status 77, saying why) in a build without CUDA, with
# fewer GPUs than it needs, or without a Python module it needs. Checks compare what the runs
# write for machines (metrics JSONL, checkpoint digests, exit statuses), never log wording.
#
# The includer sets HP_GPU_HOTPATH, HP_GPU_TESTS (the gpu_tests program), HP_GPU_CMP
# (hp_hf_compare), HP_GPU_SRC (the repository root), HP_GPU_WORK (a scratch directory),
# HP_GPU_PYTHON and HP_GPU_BUILD (0 in a build without CUDA), and defines
#   hp_gpu_add(NAME LABELS GPUS TIMEOUT SETUP REQUIRES COMMAND...)  registers one case
#   hp_gpu_mpi(OUT N)                                                the launch prefix of N ranks
# More cases join from tests/gpu/cases/*.cmake (the end of this file).

include(${CMAKE_CURRENT_LIST_DIR}/gpu_settings.cmake)

# hp_gpu_case(NAME GPUS n [MPI] [PY_MODULES m...] [CLEAN path...] [SETUP f] [REQUIRES f...]
#             [LABELS l...] [TIMEOUT s] COMMAND program args...)
# COMMAND on n GPUs: under MPI on n ranks with MPI, else one process; skipped with fewer GPUs.
function(hp_gpu_case name)
  cmake_parse_arguments(A "MPI" "GPUS;TIMEOUT;SETUP" "PY_MODULES;CLEAN;REQUIRES;LABELS;COMMAND"
                        ${ARGN})
  set(cmd ${A_COMMAND})
  set(labels gpu ${A_LABELS})
  if(A_MPI)
    hp_gpu_mpi(prefix ${A_GPUS})
    set(cmd ${prefix} ${cmd})
    list(APPEND labels mpi)
  endif()
  set(wrap bash ${HP_GPU_SRC}/tests/gpu/gpu_case.sh ${A_GPUS})
  foreach(m ${A_PY_MODULES})
    list(APPEND wrap --python-module ${m})
  endforeach()
  foreach(p ${A_CLEAN})
    list(APPEND wrap --clean ${p})
  endforeach()
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  hp_gpu_add(${name} "${labels}" ${A_GPUS} ${A_TIMEOUT} "${A_SETUP}" "${A_REQUIRES}"
             ${wrap} -- ${cmd})
endfunction()

set(HP ${HP_GPU_HOTPATH})
set(CFG ${HP_GPU_SRC}/examples/configs)
set(CHECK ${HP_GPU_PYTHON} ${HP_GPU_SRC}/tests/tools/hp_check.py)
set(GW ${HP_GPU_WORK})

# ---- save and resume on the GPU -----------------------------------------------------------------
# tiny-moe, deterministic: 6 steps straight vs 3 + save + a new process + resume + 3, on one GPU
# and on 2 ranks (ep=2). The resumed steps' losses and gradient norms, and the parameters and
# AdamW moments of the step-6 checkpoints, are bitwise those of the straight run.
foreach(np 1 2)
  set(g ${GW}/ckpt/np${np})
  set(f gpu_ckpt_np${np})
  set(mpi)
  if(np GREATER 1)
    set(mpi MPI)
  endif()
  set(run ${HP} train --config ${CFG}/tiny-moe.ini --device=cuda --deterministic=true --steps=6
      --ep_size=${np})
  hp_gpu_case(gpu.ckpt.np${np}.straight GPUS ${np} ${mpi} SETUP ${f}_straight
              CLEAN ${g}/straight CLEAN ${g}/s.jsonl
              COMMAND ${run} --checkpoint_dir=${g}/straight --metrics_path=${g}/s.jsonl)
  hp_gpu_case(gpu.ckpt.np${np}.first_half GPUS ${np} ${mpi} SETUP ${f}_half
              CLEAN ${g}/run CLEAN ${g}/a.jsonl
              COMMAND ${run} --stop_at_step=3 --checkpoint_dir=${g}/run --metrics_path=${g}/a.jsonl)
  hp_gpu_case(gpu.ckpt.np${np}.resumed GPUS ${np} ${mpi} REQUIRES ${f}_half SETUP ${f}_resumed
              CLEAN ${g}/b.jsonl
              COMMAND ${run} --resume=auto --checkpoint_dir=${g}/run --metrics_path=${g}/b.jsonl)
  hp_gpu_case(gpu.ckpt.np${np}.resumed_losses_bitwise GPUS ${np}
              REQUIRES "${f}_resumed;${f}_straight"
              COMMAND ${CHECK} losses ${g}/b.jsonl ${g}/s.jsonl --first 4 --steps 3)
  hp_gpu_case(gpu.ckpt.np${np}.resumed_grad_norms_bitwise GPUS ${np}
              REQUIRES "${f}_resumed;${f}_straight"
              COMMAND ${CHECK} losses ${g}/b.jsonl ${g}/s.jsonl --first 4 --steps 3
                      --field grad_norm)
  hp_gpu_case(gpu.ckpt.np${np}.resumed_checkpoint_bitwise GPUS ${np}
              REQUIRES "${f}_resumed;${f}_straight"
              COMMAND ${CHECK} digests --hotpath ${HP} ${g}/run/step_00000006.h5
                      ${g}/straight/step_00000006.h5)
endforeach()

# ---- optimizer_sharding=zero1 -------------------------------------------------------------------
# One GPU: zero1 is the straight run above bit for bit (losses, gradient norms, the step-6
# parameters and moments).
set(z ${GW}/zero1/np1)
hp_gpu_case(gpu.zero1.np1.run GPUS 1 SETUP gpu_zero1_np1 CLEAN ${z}
            COMMAND ${HP} train --config ${CFG}/tiny-moe.ini --device=cuda --deterministic=true
                    --steps=6 --optimizer_sharding=zero1 --checkpoint_dir=${z}/ckpt
                    --metrics_path=${z}/z.jsonl)
foreach(field loss grad_norm)
  hp_gpu_case(gpu.zero1.np1.${field}_equals_none GPUS 1 REQUIRES "gpu_zero1_np1;gpu_ckpt_np1_straight"
              COMMAND ${CHECK} losses ${z}/z.jsonl ${GW}/ckpt/np1/s.jsonl --same-steps --steps 6
                      --field ${field})
endforeach()
hp_gpu_case(gpu.zero1.np1.checkpoint_equals_none GPUS 1
            REQUIRES "gpu_zero1_np1;gpu_ckpt_np1_straight"
            COMMAND ${CHECK} digests --hotpath ${HP} ${z}/ckpt/step_00000006.h5
                    ${GW}/ckpt/np1/straight/step_00000006.h5)
# Two GPUs: GPT-OSS-20b with 4 layers, ep=2, 16,384 tokens a rank of documents uniform in
# 64..4095 tokens, 20 steps under zero1 and under none: the same global batches, losses within
# 1% (the reduce-scatter and the all-reduce sum in different orders, in bf16 compute).
set(z ${GW}/zero1/np2)
foreach(mode none zero1)
  hp_gpu_case(gpu.zero1.np2.${mode} GPUS 2 MPI SETUP gpu_zero1_np2_${mode} TIMEOUT 900
              CLEAN ${z}/${mode}.jsonl
              COMMAND ${HP} train --config ${CFG}/gptoss-20b.ini --n_layers=4 --device=cuda
                      --synthetic_doc_len=uniform:64:4096 --ep_size=2 --batch_tokens=32768
                      --steps=20 --log_every=5 --optimizer_sharding=${mode}
                      --metrics_path=${z}/${mode}.jsonl)
endforeach()
hp_gpu_case(gpu.zero1.np2.losses_within_1_percent GPUS 2
            REQUIRES "gpu_zero1_np2_none;gpu_zero1_np2_zero1"
            COMMAND ${CHECK} losses ${z}/zero1.jsonl ${z}/none.jsonl --rel 1e-2 --same-steps
                    --steps 20)

# ---- a checkpoint resumed under another layout ---------------------------------------------------
# Four GPUs: tiny-moe trained 3 of 6 steps at ep=4 under zero1, then resumed from that checkpoint
# under the same layout and at dp=2 x ep=2: the other layout's steps 4-6 within 2% of the same
# layout's (the reductions and the expert GEMMs' shapes change, in bf16 compute).
set(r ${GW}/reshard)
set(run ${HP} train --config ${CFG}/tiny-moe.ini --device=cuda --deterministic=true --steps=6
    --optimizer_sharding=zero1)
hp_gpu_case(gpu.reshard.np4.first_half GPUS 4 MPI SETUP gpu_reshard_half CLEAN ${r}
            COMMAND ${run} --ep_size=4 --stop_at_step=3 --checkpoint_dir=${r}/ckpt
                    --metrics_path=${r}/a.jsonl)
foreach(layout same other)
  if(layout STREQUAL "same")
    set(ep 4)
  else()
    set(ep 2)
  endif()
  hp_gpu_case(gpu.reshard.np4.resume_${layout} GPUS 4 MPI REQUIRES gpu_reshard_half
              SETUP gpu_reshard_${layout} CLEAN ${r}/${layout}.jsonl
              COMMAND ${run} --ep_size=${ep} --resume=${r}/ckpt/step_00000003.h5
                      --metrics_path=${r}/${layout}.jsonl)
endforeach()
hp_gpu_case(gpu.reshard.np4.other_layout_losses GPUS 4
            REQUIRES "gpu_reshard_same;gpu_reshard_other"
            COMMAND ${CHECK} losses ${r}/other.jsonl ${r}/same.jsonl --rel 2e-2 --first 4
                    --steps 3)

# ---- compute-sanitizer --------------------------------------------------------------------------
# Per tool: its canary must be reported; the GPU tests (every op and attention path against the
# CPU reference, the allocator, whole-model steps) in HP_GPU_SANITIZE_SHARDS cases that can run
# at once, and two training steps of tiny-moe, must not be (tests/gpu/sanitize.sh).
set(SAN bash ${HP_GPU_SRC}/tests/gpu/sanitize.sh)
foreach(tool ${HP_GPU_SANITIZE_TOOLS})
  hp_gpu_case(gpu.sanitize.${tool}.canary GPUS 1 LABELS sanitize
              COMMAND ${SAN} ${tool} canary ${HP_GPU_TESTS})
  math(EXPR last "${HP_GPU_SANITIZE_SHARDS} - 1")
  foreach(i RANGE ${last})
    hp_gpu_case(gpu.sanitize.${tool}.tests.shard${i} GPUS 1 LABELS sanitize TIMEOUT 3600
                COMMAND ${SAN} ${tool} tests ${HP_GPU_TESTS} ${i} ${HP_GPU_SANITIZE_SHARDS})
  endforeach()
  # racecheck over `hotpath train` grows the process past the host's memory (130 GB resident on
  # a 128 GiB H200 host, then the kernel's OOM killer): racecheck's training steps are those of
  # the CudaModel.* tests in its shards.
  if(NOT tool STREQUAL "racecheck")
    hp_gpu_case(gpu.sanitize.${tool}.train GPUS 1 LABELS sanitize TIMEOUT 1800
                COMMAND ${SAN} ${tool} train ${HP} ${CFG}/tiny-moe.ini)
  endif()
endforeach()

# ---- Hugging Face models on the GPU -------------------------------------------------------------
# Each fixture (tests/hf/fixtures) imported, fine-tuned 2 steps on the GPU, exported as bf16
# safetensors; transformers loads the export and its logits match hotpath's CUDA eval of the same
# rows within 0.1 (tests/hf/check_export.py; bf16 can flip a near-tie expert choice of a
# GPT-OSS position: 2 such positions allowed). Then the loss mask on the device: the imported
# llama fine-tuned on masked SFT rows, whose masked loss must drop by 0.2.
set(FX ${HP_GPU_SRC}/tests/hf/fixtures)
set(h ${GW}/hf)
foreach(m llama qwen3 gptoss)
  hp_gpu_case(gpu.hf.${m}.import GPUS 1 LABELS hf SETUP gpu_hf_${m} CLEAN ${h}/${m}.h5
              COMMAND ${HP} import-hf ${FX}/${m} --out ${h}/${m}.h5 --force)
  hp_gpu_case(gpu.hf.${m}.finetune GPUS 1 LABELS hf REQUIRES gpu_hf_${m} SETUP gpu_hf_${m}_ft
              CLEAN ${h}/${m}_ft
              COMMAND ${HP} train --config ${h}/${m}.ini --init_from=${h}/${m}.h5
                      --data=${FX}/${m}/tokens.h5 --seq_len=16 --batch_tokens=32 --steps=2
                      --lr=1e-3 --warmup_steps=0 --eot_token=95 --device=cuda
                      --checkpoint_dir=${h}/${m}_ft --log_every=1)
  hp_gpu_case(gpu.hf.${m}.export_bf16 GPUS 1 LABELS hf REQUIRES gpu_hf_${m}_ft
              SETUP gpu_hf_${m}_export CLEAN ${h}/${m}_bf16
              COMMAND ${HP} export-hf ${h}/${m}_ft --out ${h}/${m}_bf16 --dtype bf16)
  hp_gpu_case(gpu.hf.${m}.eval GPUS 1 LABELS hf REQUIRES gpu_hf_${m}_ft SETUP gpu_hf_${m}_eval
              CLEAN ${h}/${m}.dump.safetensors
              COMMAND ${HP} eval --config ${h}/${m}.ini --checkpoint ${h}/${m}_ft
                      --data ${FX}/${m}/tokens.h5 --seq_len=16 --batch_tokens=64 --batches=1
                      --shuffle=false --packing=whole --eot_token=95 --device=cuda
                      --dump_logits=${h}/${m}.dump.safetensors)
  set(outliers 0)
  if(m STREQUAL "gptoss")
    set(outliers 2)
  endif()
  hp_gpu_case(gpu.hf.${m}.matches_transformers GPUS 1 LABELS hf
              PY_MODULES torch transformers safetensors h5py
              REQUIRES "gpu_hf_${m}_export;gpu_hf_${m}_eval"
              COMMAND ${HP_GPU_PYTHON} ${HP_GPU_SRC}/tests/hf/check_export.py ${h}/${m}_bf16
                      ${h}/${m}.dump.safetensors ${FX}/${m}/tokens.h5 --seq_len 16 --tol 0.1
                      --outliers ${outliers} --device cuda)
endforeach()
hp_gpu_case(gpu.hf.sft.data GPUS 1 LABELS hf SETUP gpu_hf_sft_data
            CLEAN ${h}/sft_a.h5 CLEAN ${h}/sft_b.h5
            COMMAND ${HP_GPU_CMP} sft-data ${h}/sft_a.h5 ${h}/sft_b.h5 --vocab 96 --eot 95
                    --docs 24 --seed 5)
hp_gpu_case(gpu.hf.sft.train GPUS 1 LABELS hf REQUIRES "gpu_hf_llama;gpu_hf_sft_data"
            SETUP gpu_hf_sft CLEAN ${h}/sft.jsonl
            COMMAND ${HP} train --config ${h}/llama.ini --init_from=${h}/llama.h5
                    --data=${h}/sft_a.h5 --seq_len=16 --batch_tokens=64 --steps=12 --lr=1e-2
                    --min_lr=1e-2 --warmup_steps=0 --eot_token=95 --device=cuda --log_every=100
                    --metrics_path=${h}/sft.jsonl)
hp_gpu_case(gpu.hf.sft.masked_loss_drops GPUS 1 LABELS hf REQUIRES gpu_hf_sft
            COMMAND ${HP_GPU_CMP} decreases ${h}/sft.jsonl --by 0.2)

# ---- more cases: tests/gpu/cases/*.cmake --------------------------------------------------------
# Each file there calls hp_gpu_case (and may use HP, CFG, CHECK and GW); both lists include it.
if(CMAKE_SCRIPT_MODE_FILE)
  file(GLOB hp_gpu_more ${CMAKE_CURRENT_LIST_DIR}/cases/*.cmake)
else()
  file(GLOB hp_gpu_more CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/cases/*.cmake)
endif()
foreach(f ${hp_gpu_more})
  include(${f})
endforeach()
