# The held-out loss during training (eval_data, eval_every, eval_batches; launch/train/evaluation.h),
# included by tests/cli/CMakeLists.txt (uses its HP, CHECK, W, MOE and TINY). A held-out HDF5 file
# of 200 documents (mean length 100); 2 global batches of 1024 tokens per evaluation.
#  - The JSONL eval_loss of step s equals `hotpath eval` of the checkpoint saved at step s,
#    exactly (--eval_json: the same double): the same code, parameters, batches and sums.
#  - Training with evaluations is bitwise training without: losses, gradient norms, flops and the
#    per-step sync counts.
#  - dp x ep at 2 and 4 ranks, zero1, offload and packing=whole evaluate too, and give what one
#    rank's `hotpath eval` gives for the same parameters (relative 1e-5: the sums fold over
#    ranks in another order) or exactly what the same layout gives.
#  - Bad values stop the run before any work, naming the key.
set(EV ${W}/eval)
file(MAKE_DIRECTORY ${EV})
hp_cli(eval.data SETUP ev_data CLEAN ${EV}/held_out.h5
       COMMAND ${HP} data synth --out ${EV}/held_out.h5 --docs 200 --vocab_size 16
               --synthetic_vocab 8 --synthetic_mean_doc_len 100 --seed 11)
set(EVAL --eval_data=${EV}/held_out.h5 --eval_batches=2)
set(EVAL_TOOL eval ${MOE} --seq_len=128 --batch_tokens=1024 --data=${EV}/held_out.h5 --batches=2)

# ---- one rank: every 2 steps, a checkpoint every 2 steps; and the same run without evaluation --
hp_cli(eval.np1.run REQUIRES ev_data SETUP ev_np1 CLEAN ${EV}/np1 ${EV}/np1.jsonl EXIT 0
       PASS "step=2 [^\n]* eval_loss=[0-9.]+\n.*done: steps=6 [^\n]* eval_loss=[0-9.]+"
       COMMAND ${HP} ${TINY} --steps=6 ${EVAL} --eval_every=2 --checkpoint_dir=${EV}/np1
               --checkpoint_every=2 --metrics_path=${EV}/np1.jsonl)
hp_cli(eval.np1.without SETUP ev_np1_without CLEAN ${EV}/without.jsonl
       COMMAND ${HP} ${TINY} --steps=6 --metrics_path=${EV}/without.jsonl)
foreach(field loss grad_norm aux_loss flops)
  hp_cli_check(eval.np1.same_${field}_as_without REQUIRES ev_np1 ev_np1_without
               ARGS losses ${EV}/np1.jsonl ${EV}/without.jsonl --field ${field} --same-steps
                    --steps 6)
endforeach()
# Evaluated steps: 2, 4, 6; the step's own syncs are those of a step without evaluation.
hp_cli_check(eval.np1.evaluated_steps REQUIRES ev_np1
             ARGS jsonl ${EV}/np1.jsonl --lines 6
                  --all "('eval_loss' in r) == (step % 2 == 0)"
                  --all "'eval_loss' not in r or (eval_tokens == 2 * 1024 and 'eval_ms' in r)"
                  --all "syncs == {'metadata': 0, 'routing': 4, 'offload': 0, 'loss': 1, 'other': 0}"
                  --all "flops > 6 * tokens")
foreach(step 2 6)
  hp_cli(eval.np1.tool_step${step} REQUIRES ev_np1 SETUP ev_np1_tool${step}
         CLEAN ${EV}/np1.tool${step}.json
         COMMAND ${HP} ${EVAL_TOOL} --checkpoint=${EV}/np1/step_0000000${step}.h5
                 --eval_json=${EV}/np1.tool${step}.json)
  hp_cli_check(eval.np1.equals_tool_step${step} REQUIRES ev_np1_tool${step}
               ARGS compare ${EV}/np1.jsonl ${EV}/np1.tool${step}.json --step ${step}
                    --expect "a['eval_loss'] == b['eval_loss']"
                    --expect "a['eval_tokens'] == b['eval_tokens'] and b['batches'] == 2")
endforeach()

# ---- offload (one rank, double buffering over a simulated link): the same eval_loss, bitwise ---
hp_cli(eval.offload.run REQUIRES ev_data SETUP ev_offload CLEAN ${EV}/offload.jsonl
       COMMAND ${HP} ${TINY} --steps=6 ${EVAL} --eval_every=2 --offload=double --sim_link_gbps=2
               --metrics_path=${EV}/offload.jsonl)
foreach(step 2 4 6)
  hp_cli_check(eval.offload.same_eval_loss_step${step} REQUIRES ev_offload ev_np1
               ARGS compare ${EV}/offload.jsonl ${EV}/np1.jsonl --step ${step}
                    --expect "a['eval_loss'] == b['eval_loss'] and a['loss'] == b['loss']")
endforeach()

# ---- 2 ranks (ep=2), eval_every=0: only the final evaluation; stream and whole packing (a small
# window, so that rows are padded) --------------------------------------------------------------
set(stream --packing=stream)
set(whole --packing=whole --packing_window=4)
foreach(pack stream whole)
  set(n np2_${pack})
  hp_cli(eval.${n}.run NP 2 REQUIRES ev_data SETUP ev_${n} CLEAN ${EV}/${n} ${EV}/${n}.jsonl
         COMMAND ${HP} ${TINY} --steps=4 --ep_size=2 ${${pack}} ${EVAL} --eval_every=0
                 --checkpoint_dir=${EV}/${n} --metrics_path=${EV}/${n}.jsonl)
  hp_cli_check(eval.${n}.final_only NP 2 REQUIRES ev_${n}
               ARGS jsonl ${EV}/${n}.jsonl --lines 4 --all "('eval_loss' in r) == (step == 4)")
  # The same layout's `hotpath eval`: exactly; one rank's: within 1e-5.
  hp_cli(eval.${n}.tool_np2 NP 2 REQUIRES ev_${n} SETUP ev_${n}_tool2 CLEAN ${EV}/${n}.tool2.json
         COMMAND ${HP} ${EVAL_TOOL} --ep_size=2 ${${pack}}
                 --checkpoint=${EV}/${n}/step_00000004.h5 --eval_json=${EV}/${n}.tool2.json)
  hp_cli_check(eval.${n}.equals_tool_np2 NP 2 REQUIRES ev_${n}_tool2
               ARGS compare ${EV}/${n}.jsonl ${EV}/${n}.tool2.json --step 4
                    --expect "a['eval_loss'] == b['eval_loss'] and a['eval_tokens'] == b['eval_tokens']")
  hp_cli(eval.${n}.tool_np1 REQUIRES ev_${n} SETUP ev_${n}_tool1 CLEAN ${EV}/${n}.tool1.json
         COMMAND ${HP} ${EVAL_TOOL} ${${pack}} --checkpoint=${EV}/${n}/step_00000004.h5
                 --eval_json=${EV}/${n}.tool1.json)
  hp_cli_check(eval.${n}.matches_tool_np1 NP 2 REQUIRES ev_${n}_tool1
               ARGS compare ${EV}/${n}.jsonl ${EV}/${n}.tool1.json --step 4
                    --expect "abs(a['eval_loss'] - b['eval_loss']) <= 1e-5 * b['eval_loss']"
                    --expect "a['eval_tokens'] == b['eval_tokens']")
endforeach()
# whole packing pads its rows: fewer document tokens than positions are evaluated.
hp_cli_check(eval.np2_whole.pads NP 2 REQUIRES ev_np2_whole
             ARGS jsonl ${EV}/np2_whole.jsonl --last "0 < eval_tokens < 2 * 1024")

# ---- 4 ranks (dp=2 x ep=2), every step: zero1 bitwise none; one rank's hotpath eval within 1e-5 --
foreach(mode none zero1)
  set(n np4_${mode})
  hp_cli(eval.${n}.run NP 4 REQUIRES ev_data SETUP ev_${n} CLEAN ${EV}/${n} ${EV}/${n}.jsonl
         COMMAND ${HP} ${TINY} --steps=3 --ep_size=2 --optimizer_sharding=${mode} ${EVAL}
                 --eval_every=1 --checkpoint_dir=${EV}/${n} --metrics_path=${EV}/${n}.jsonl)
endforeach()
hp_cli_check(eval.np4_zero1.same_eval_loss_as_none NP 4 REQUIRES ev_np4_none ev_np4_zero1
             ARGS losses ${EV}/np4_zero1.jsonl ${EV}/np4_none.jsonl --field eval_loss
                  --same-steps --steps 3)
hp_cli(eval.np4_zero1.tool_np1 REQUIRES ev_np4_zero1 SETUP ev_np4_zero1_tool1
       CLEAN ${EV}/np4_zero1.tool1.json
       COMMAND ${HP} ${EVAL_TOOL} --checkpoint=${EV}/np4_zero1/step_00000003.h5
               --eval_json=${EV}/np4_zero1.tool1.json)
hp_cli_check(eval.np4_zero1.matches_tool_np1 NP 4 REQUIRES ev_np4_zero1_tool1
             ARGS compare ${EV}/np4_zero1.jsonl ${EV}/np4_zero1.tool1.json --step 3
                  --expect "abs(a['eval_loss'] - b['eval_loss']) <= 1e-5 * b['eval_loss']"
                  --expect "a['eval_tokens'] == b['eval_tokens']")

# ---- bad values: exit status 2 before any work, naming the key; no metrics file written -------
hp_cli_config_error(eval.error.every_negative "'eval_every': must be >= 0"
                    train ${MOE} --eval_every=-1 --eval_data=${EV}/held_out.h5 --dry-run)
hp_cli_config_error(eval.error.every_without_data "'eval_every': =5 needs eval_data"
                    train ${MOE} --eval_every=5 --dry-run)
hp_cli_config_error(eval.error.batches_zero "'eval_batches': must be >= 1, got 0"
                    train ${MOE} --eval_batches=0 --eval_data=${EV}/held_out.h5 --dry-run)
hp_cli(eval.error.missing_file SETUP ev_missing EXIT 2 CLEAN ${EV}/missing.jsonl
       PASS "config key 'eval_data' \\([^)]*no-such.h5\\): cannot open"
       COMMAND ${HP} ${TINY} --steps=2 --eval_data=${EV}/no-such.h5
               --metrics_path=${EV}/missing.jsonl)
hp_cli_check(eval.error.missing_file_wrote_nothing REQUIRES ev_missing
             ARGS dir ${EV} --absent missing.jsonl)
