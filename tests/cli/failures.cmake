# Failure behaviour (docs/failure-behaviour.md): bad values, unusable outputs, non-finite steps,
# changed configs, damaged or unwritable checkpoints. Included by tests/cli/CMakeLists.txt, whose
# helpers (hp_cli, hp_cli_check, hp_cli_config_error) and variables (HP, CHECK, W, IN, CFG, TINY,
# MOE) it uses. Every case is a class: several members of it, each a test.
set(F ${W}/failures)
file(MAKE_DIRECTORY ${F})
file(READ ${CFG}/tiny-moe.ini tiny_moe_ini)
string(ASCII 239 187 191 utf8_bom)
string(ASCII 13 cr)

# ==== the config file is read literally ==========================================================
# '#' inside a value is part of it: the paths are used as written, nothing is cut off (';' too:
# tests/launch/config_file_test.cpp).
file(WRITE ${IN}/literal.ini "${tiny_moe_ini}\ncheckpoint_dir = ${F}/literal/exp#2\n"
           "metrics_path = ${F}/literal/m#1.jsonl\n")
hp_cli(ini.literal.run SETUP ini_literal CLEAN ${F}/literal
       COMMAND ${HP} train --config ${IN}/literal.ini --seq_len=128 --batch_tokens=1024 --steps=1)
hp_cli_check(ini.literal.hash_in_checkpoint_dir REQUIRES ini_literal
             ARGS dir "${F}/literal/exp#2" --latest step_00000001.h5 --present step_00000001.h5)
hp_cli_check(ini.literal.hash_in_metrics_path REQUIRES ini_literal
             ARGS jsonl "${F}/literal/m#1.jsonl" --lines 1)
hp_cli_check(ini.literal.nothing_cut_off REQUIRES ini_literal
             ARGS dir ${F}/literal --present "exp#2" --present "m#1.jsonl" --absent exp --absent m)
# Comment lines ('#' or ';' first, after blanks), a UTF-8 byte order mark, CR LF line ends.
string(REPLACE "\n" "${cr}\n" tiny_moe_crlf "${tiny_moe_ini}")
file(WRITE ${IN}/bom_crlf.ini "${utf8_bom}# first line after a BOM${cr}\n  ; indented comment${cr}\n"
           "\t# tab-indented comment${cr}\n${tiny_moe_crlf}")
file(WRITE ${IN}/bom_key.ini "${utf8_bom}${tiny_moe_ini}")
hp_cli(ini.bom_and_crlf EXIT 0 PASS "params: total=1792688 active=601776"
       COMMAND ${HP} train --config ${IN}/bom_crlf.ini --dry-run)
hp_cli(ini.bom_before_a_key EXIT 0 PASS "params: total=1792688 active=601776"
       COMMAND ${HP} train --config ${IN}/bom_key.ini --dry-run)
file(WRITE ${IN}/dup.ini "${tiny_moe_ini}\nd_model = 64\n")
file(WRITE ${IN}/section.ini "[model]\n${tiny_moe_ini}")
file(WRITE ${IN}/no_equals.ini "${tiny_moe_ini}\nd_model 64\n")
hp_cli_config_error(ini.error.key_twice "dup.ini' line [0-9]+: key 'd_model' is given twice"
                    train --config ${IN}/dup.ini --dry-run)
hp_cli_config_error(ini.error.section "section.ini' line 1: sections"
                    train --config ${IN}/section.ini --dry-run)
hp_cli_config_error(ini.error.no_equals "no_equals.ini' line [0-9]+: expected key = value"
                    train --config ${IN}/no_equals.ini --dry-run)

# ==== the command line ===========================================================================
hp_cli_config_error(args.config_is_directory "--config '.*' is a directory"
                    train --config ${CFG} --dry-run)
hp_cli_config_error(args.config_missing_file "cannot open config file '.*no-such.ini'"
                    train --config ${IN}/no-such.ini --dry-run)
hp_cli_config_error(args.positional_ini "unexpected argument '.*tiny-moe.ini'.*--config"
                    train ${CFG}/tiny-moe.ini --dry-run)
hp_cli_config_error(args.positional_word "unexpected argument 'extra'"
                    train ${MOE} extra --dry-run)
hp_cli_config_error(args.eval_positional "unexpected argument 'ckpt'"
                    eval ${MOE} ckpt)
hp_cli_config_error(args.no_config "no model: give --config FILE" train --dry-run)

# ==== every key's range, checked before any work, naming the key ==================================
# "NAME|ARGS|REGEX": `train --config tiny-moe.ini ARGS --dry-run` exits 2 printing REGEX.
foreach(spec
    "norm_eps_inf|--norm_eps=inf|'norm_eps': must be finite and > 0"
    "norm_eps_nan|--norm_eps=nan|'norm_eps': must be finite"
    "adam_eps_inf|--adam_eps=inf|'adam_eps': must be finite and > 0"
    "grad_clip_nan|--grad_clip=nan|'grad_clip': must be finite"
    "grad_clip_inf|--grad_clip=inf|'grad_clip': must be finite"
    "rope_theta_inf|--rope_theta=inf|'rope_theta': must be finite and > 0"
    "init_std_inf|--init_std=inf|'init_std': must be finite and > 0"
    "swiglu_alpha_inf|--swiglu_alpha=inf|'swiglu_alpha': must be finite and > 0"
    "swiglu_limit_nan|--swiglu_limit=nan|'swiglu_limit': must be finite"
    "lr_inf|--lr=inf|'lr': must be finite and > 0"
    "lr_nan|--lr=nan|'lr': must be finite and > 0"
    "weight_decay_inf|--weight_decay=inf|'weight_decay': must be finite"
    "moe_aux_coef_inf|--moe_aux_coef=inf|'moe_aux_coef': must be finite"
    "synthetic_zipf_inf|--synthetic_zipf=inf|'synthetic_zipf': must be finite"
    "sim_link_gbps_inf|--sim_link_gbps=inf|'sim_link_gbps': must be >= 0"
    "yarn_original_zero|--rope_scaling_factor=2 --rope_original_max_positions=0|'rope_original_max_positions': must be >= 1"
    "yarn_beta_fast_zero|--rope_scaling_factor=2 --rope_beta_fast=0|'rope_beta_fast': must be finite and > 0"
    "yarn_factor_inf|--rope_scaling_factor=inf|'rope_scaling_factor': must be finite"
    "seed_minus_one|--seed=-1|'seed': must be an integer in \\[0, 18446744073709551615\\], got '-1'"
    "seed_too_large|--seed=18446744073709551616|'seed': must be an integer"
    "seed_not_integer|--seed=1e3|'seed': must be an integer"
    "eot_token_negative|--eot_token=-2|'eot_token': must be -1 \\(vocab_size - 1\\) or a token id >= 0"
    "collective_timeout_huge|--collective_timeout_s=1e300|'collective_timeout_s': must be in \\[0.001, 1e\\+06\\]"
    "collective_timeout_tiny|--collective_timeout_s=1e-9|'collective_timeout_s': must be in"
    "collective_timeout_inf|--collective_timeout_s=inf|'collective_timeout_s': must be in"
    "batch_tokens_int32|--seq_len=1000 --batch_tokens=3000000000|'batch_tokens': must be <= 2147483647"
    "vocab_size_int32|--vocab_size=3000000000|'vocab_size': must be <= 2147483647"
    "d_model_huge|--d_model=2000000000|'d_model': must be <= 1048576"
    "experts_huge|--n_experts=65536 --expert_ffn_dim=1000000 --d_model=1000000 --head_dim=250000|'d_model': the model would have about .* parameters"
    "nonfinite_enum|--nonfinite=ignore|'nonfinite': must be abort or skip"
    "expert_gemm_enum|--expert_gemm=cutlass|'expert_gemm': must be serial, streams or grouped"
    "gemm_autotune_bool|--gemm_autotune=maybe|option '--gemm_autotune' is invalid. Valid choices are 'on"
    "attention_autotune_bool|--attention_autotune=2|option '--attention_autotune' is invalid. Valid choices are 'on"
    "comm_overlap_bool|--comm_overlap=sometimes|option '--comm_overlap' is invalid. Valid choices are 'on"
    "attention_enum|--attention=flash|'attention': must be auto, cudnn or tiled"
    "allow_config_change_key|--allow_config_change=lr|'allow_config_change': 'lr' is not a model key")
  string(REPLACE "|" ";" spec "${spec}")
  list(GET spec 0 name)
  list(GET spec 1 args)
  list(GET spec 2 regex)
  separate_arguments(args UNIX_COMMAND "${args}")
  hp_cli_config_error(range.${name} "${regex}" train ${MOE} ${args} --dry-run)
endforeach()
# Sizes whose buffers cannot be allocated are refused before any allocation (CPU backend: against
# the host's memory), naming the key, instead of dying in std::bad_alloc.
hp_cli_config_error(range.batch_tokens_beyond_memory
                    "'batch_tokens': 1000000000 tokens need at least .* GiB of host memory"
                    train ${MOE} --seq_len=1000 --batch_tokens=1000000000 --device=cpu --steps=1)
hp_cli(range.batch_tokens_beyond_memory_two_ranks NP 2 EXIT 2
       PASS "'batch_tokens': 1000000000 tokens need at least .* GiB of host memory"
       COMMAND ${HP} train ${MOE} --seq_len=1000 --batch_tokens=1000000000 --device=cpu --steps=1
               --ep_size=2)
hp_cli_config_error(range.model_beyond_memory "the model .* needs at least .* GiB of host memory"
                    train --config ${CFG}/gptoss-120b.ini --device=cpu --steps=1)
# synthetic_* describe the synthetic source only: with file data a too-small vocab_size is
# reported as vocab_size, with the file and offset of the first token at or above it.
hp_cli(range.file_data_vocab_size EXIT nonzero REQUIRES data_wide
       PASS "wide.bin is not below vocab_size 8"
       COMMAND ${HP} train ${MOE} --batch_tokens=512 --seq_len=64 --data=${W}/data/wide.bin
               --vocab_size=8 --steps=1)

# ==== every output is checked before step 1 (before the ranks meet) ===============================
# Read-only file system, no permission, a regular file in the way: exit 2 naming the key and the
# reason, before any step (even with checkpoint_every=0, where the first save is the last).
set(O ${F}/outputs)
file(WRITE ${IN}/regular_file "not a directory\n")
hp_cli(outputs.checkpoint_dir_read_only_fs PASS "'checkpoint_dir': cannot write .*Read-only file system"
       COMMAND ${CHECK} fs --at ${O}/ro --readonly --exit 2 --forbid "step=1 " --
               ${HP} ${TINY} --steps=2 --checkpoint_dir=${O}/ro/ckpt)
set_tests_properties(cli.outputs.checkpoint_dir_read_only_fs PROPERTIES SKIP_RETURN_CODE 77
                     SKIP_REGULAR_EXPRESSION "\\[hp_check\\] skipped")
hp_cli(outputs.checkpoint_dir_no_permission PASS "'checkpoint_dir': cannot write .*Permission denied"
       COMMAND ${CHECK} fs --at ${O}/perm --size 1m --as-nobody --exit 2 --forbid "step=1 " --
               ${HP} ${TINY} --steps=2 --checkpoint_dir=${O}/perm/ckpt)
set_tests_properties(cli.outputs.checkpoint_dir_no_permission PROPERTIES SKIP_RETURN_CODE 77
                     SKIP_REGULAR_EXPRESSION "\\[hp_check\\] skipped")
hp_cli_config_error(outputs.checkpoint_dir_is_a_file
                    "'checkpoint_dir': cannot write '.*regular_file': it exists and is not a directory"
                    ${TINY} --steps=2 --checkpoint_dir=${IN}/regular_file)
hp_cli_config_error(outputs.checkpoint_dir_under_a_file "'checkpoint_dir': cannot write '.*regular_file/sub'"
                    ${TINY} --steps=2 --checkpoint_dir=${IN}/regular_file/sub)
hp_cli(outputs.metrics_path_read_only_fs PASS "'metrics_path': cannot write .*Read-only file system"
       COMMAND ${CHECK} fs --at ${O}/ro_m --readonly --exit 2 --forbid "step=1 " --
               ${HP} ${TINY} --steps=2 --metrics_path=${O}/ro_m/m.jsonl)
set_tests_properties(cli.outputs.metrics_path_read_only_fs PROPERTIES SKIP_RETURN_CODE 77
                     SKIP_REGULAR_EXPRESSION "\\[hp_check\\] skipped")
hp_cli_config_error(outputs.metrics_path_is_a_directory "'metrics_path': cannot write '.*': it is a directory"
                    ${TINY} --steps=2 --metrics_path=${IN})
hp_cli_config_error(outputs.metrics_path_under_a_file "'metrics_path': cannot write '.*regular_file'"
                    ${TINY} --steps=2 --metrics_path=${IN}/regular_file/m.jsonl)
hp_cli_config_error(outputs.bench_json_is_a_directory "'bench_json': cannot write '.*': it is a directory"
                    bench step ${MOE} --seq_len=128 --batch_tokens=1024 --bench_json=${IN})
hp_cli(outputs.bench_json_read_only_fs PASS "'bench_json': cannot write .*Read-only file system"
       COMMAND ${CHECK} fs --at ${O}/ro_b --readonly --exit 2 --
               ${HP} bench step ${MOE} --seq_len=128 --batch_tokens=1024 --bench_json=${O}/ro_b/b.json)
set_tests_properties(cli.outputs.bench_json_read_only_fs PROPERTIES SKIP_RETURN_CODE 77
                     SKIP_REGULAR_EXPRESSION "\\[hp_check\\] skipped")
# Under mpirun too: every rank stops before the job starts.
hp_cli(outputs.checkpoint_dir_is_a_file_two_ranks NP 2 EXIT nonzero
       PASS "'checkpoint_dir': cannot write '.*regular_file': it exists and is not a directory"
       COMMAND ${HP} ${TINY} --steps=2 --ep_size=2 --checkpoint_dir=${IN}/regular_file)
# Missing directories of an output are created.
hp_cli(outputs.metrics_path_parent_created SETUP outputs_parent CLEAN ${O}/new
       COMMAND ${HP} ${TINY} --steps=1 --metrics_path=${O}/new/sub/m.jsonl)
hp_cli_check(outputs.metrics_path_parent_created_check REQUIRES outputs_parent
             ARGS jsonl ${O}/new/sub/m.jsonl --lines 1)

# ==== metrics on resume: history kept, the resumed steps appended =================================
set(MR ${F}/metrics_resume)
# 6 steps as 3 + resume + 3 into one metrics file: steps 1..6, losses bitwise the straight run's.
hp_cli(metrics_resume.first_half SETUP mr_half CLEAN ${MR}
       COMMAND ${HP} ${TINY} --steps=6 --stop_at_step=3 --checkpoint_dir=${MR}/ckpt
               --metrics_path=${MR}/m.jsonl)
hp_cli(metrics_resume.second_half REQUIRES mr_half SETUP mr_resumed
       COMMAND ${HP} ${TINY} --steps=6 --resume=auto --checkpoint_dir=${MR}/ckpt
               --metrics_path=${MR}/m.jsonl)
hp_cli_check(metrics_resume.appended REQUIRES mr_resumed ckpt_np1_straight
             ARGS losses ${MR}/m.jsonl ${C}/np1/s.jsonl --same-steps --steps 6)
# Killed at step 6 with checkpoints at 2 and 4: the file holds steps 1..5; the resumed run keeps
# 1..4, drops 5 (it is computed again) and appends 5, 6.
hp_cli(metrics_resume.killed WILL_FAIL SETUP mr_killed CLEAN ${MR}k ENV HOTPATH_FAULT=kill:0:6
       COMMAND ${HP} ${TINY} --steps=6 --checkpoint_every=2 --checkpoint_dir=${MR}k/ckpt
               --metrics_path=${MR}k/m.jsonl)
hp_cli_check(metrics_resume.killed_has_5_steps REQUIRES mr_killed SETUP mr_killed_checked
             ARGS jsonl ${MR}k/m.jsonl --lines 5 --last "step == 5")
hp_cli(metrics_resume.after_kill REQUIRES mr_killed_checked SETUP mr_after_kill
       COMMAND ${HP} ${TINY} --steps=6 --checkpoint_every=2 --resume=auto
               --checkpoint_dir=${MR}k/ckpt --metrics_path=${MR}k/m.jsonl)
hp_cli_check(metrics_resume.rows_past_the_checkpoint_dropped REQUIRES mr_after_kill ckpt_np1_straight
             ARGS losses ${MR}k/m.jsonl ${C}/np1/s.jsonl --same-steps --steps 6)

# ==== a run does not overwrite newer checkpoints ==================================================
set(OV ${F}/overwrite)
hp_cli(overwrite.setup SETUP ov_made CLEAN ${OV}
       COMMAND ${HP} ${TINY} --steps=4 --checkpoint_every=2 --checkpoint_dir=${OV})
hp_cli(overwrite.older_checkpoint_refused REQUIRES ov_made SETUP ov_refused EXIT 2
       PASS "holds committed checkpoints up to step 4, newer than the checkpoint resumed from.*step 2.*--allow_overwrite=true"
       COMMAND ${HP} ${TINY} --steps=4 --checkpoint_dir=${OV} --resume=${OV}/step_00000002.h5)
hp_cli(overwrite.fresh_start_refused REQUIRES ov_made SETUP ov_refused EXIT 2
       PASS "holds committed checkpoints up to step 4, newer than this fresh start"
       COMMAND ${HP} ${TINY} --steps=4 --checkpoint_dir=${OV})
hp_cli_check(overwrite.refusals_changed_nothing REQUIRES ov_refused SETUP ov_unchanged
             ARGS dir ${OV} --latest step_00000004.h5 --present step_00000002.h5
                  --present step_00000004.h5 --absent step_00000003.h5)
hp_cli(overwrite.allowed REQUIRES ov_unchanged SETUP ov_allowed
       COMMAND ${HP} ${TINY} --steps=4 --stop_at_step=3 --checkpoint_dir=${OV}
               --resume=${OV}/step_00000002.h5 --allow_overwrite=true)
hp_cli_check(overwrite.allowed_moves_latest REQUIRES ov_allowed
             ARGS dir ${OV} --latest step_00000003.h5 --present step_00000004.h5)

# ==== non-finite steps: nonfinite=abort | skip, agreed by every rank ===============================
# HOTPATH_FAULT=nan:RANK:STEP makes RANK's gradients NaN at STEP (after their all-reduce: only
# that rank sees it). abort: exit 2 naming the step, nothing of it saved; skip: parameters and
# moments byte-equal to the state before the step, counted in the log, metrics and checkpoint.
set(NF ${F}/nonfinite)
# The zero1 variants (optimizer_sharding=zero1, each rank updates its shards only): the NaN
# reaches the reduced rows of the victim's shards, and every rank still agrees.
foreach(spec "1:1:0:none" "2:2:1:none" "2:1:1:zero1" "2:2:0:zero1")
  string(REPLACE ":" ";" spec "${spec}")
  list(GET spec 0 np)
  list(GET spec 1 ep)
  list(GET spec 2 victim)
  list(GET spec 3 sharding)
  set(n np${np})
  if(sharding STREQUAL "zero1")
    set(n np${np}_ep${ep}_zero1)
  endif()
  set(L --ep_size=${ep} --optimizer_sharding=${sharding})
  hp_cli(nonfinite.${n}.reference NP ${np} SETUP nf_${n}_ref CLEAN ${NF}/${n}/ref
         COMMAND ${HP} ${TINY} ${L} --steps=4 --stop_at_step=2 --checkpoint_dir=${NF}/${n}/ref)
  hp_cli(nonfinite.${n}.abort NP ${np} SETUP nf_${n}_abort CLEAN ${NF}/${n}/abort EXIT 2
         PASS "training diverged at step 3.*nonfinite=abort" ENV HOTPATH_FAULT=nan:${victim}:3
         COMMAND ${HP} ${TINY} ${L} --steps=4 --checkpoint_every=1
                 --checkpoint_dir=${NF}/${n}/abort)
  hp_cli_check(nonfinite.${n}.abort_saved_nothing_of_the_step NP ${np} REQUIRES nf_${n}_abort
               ARGS dir ${NF}/${n}/abort --latest step_00000002.h5 --absent step_00000003.h5
                    --absent step_00000003.h5.tmp)
  hp_cli(nonfinite.${n}.skip NP ${np} SETUP nf_${n}_skip CLEAN ${NF}/${n}/skip ${NF}/${n}/skip.jsonl
         PASS "step 3: .*grad_norm=nan not finite: skipped" ENV HOTPATH_FAULT=nan:${victim}:3
         COMMAND ${HP} ${TINY} ${L} --steps=4 --stop_at_step=3 --nonfinite=skip
                 --checkpoint_dir=${NF}/${n}/skip --metrics_path=${NF}/${n}/skip.jsonl)
  hp_cli_check(nonfinite.${n}.skip_leaves_state_bitwise NP ${np} REQUIRES nf_${n}_skip nf_${n}_ref
               ARGS digests --hotpath ${HP} ${NF}/${n}/skip/step_00000003.h5
                    ${NF}/${n}/ref/step_00000002.h5)
  hp_cli_check(nonfinite.${n}.skip_counted_in_metrics NP ${np} REQUIRES nf_${n}_skip
               ARGS jsonl ${NF}/${n}/skip.jsonl --lines 3
                    --last "step == 3 and r['finite'] == False and skipped and skipped_steps == 1")
  hp_cli_check(nonfinite.${n}.skip_counted_in_checkpoint NP ${np} REQUIRES nf_${n}_skip
               ARGS inspect --hotpath ${HP} ${NF}/${n}/skip/step_00000003.h5
                    --expect "step == 3" --expect "skipped_steps == 1")
endforeach()
# The count carries over a resume: skip at 3, save, resume, skip at 5: 2 skipped at the end.
hp_cli(nonfinite.skip_resume.first NP 1 SETUP nf_sr_a CLEAN ${NF}/sr ENV HOTPATH_FAULT=nan:0:3
       COMMAND ${HP} ${TINY} --steps=6 --stop_at_step=4 --nonfinite=skip --checkpoint_dir=${NF}/sr)
hp_cli(nonfinite.skip_resume.second NP 1 REQUIRES nf_sr_a SETUP nf_sr_b ENV HOTPATH_FAULT=nan:0:5
       PASS "done: steps=6 skipped=2"
       COMMAND ${HP} ${TINY} --steps=6 --nonfinite=skip --resume=auto --checkpoint_dir=${NF}/sr)
hp_cli_check(nonfinite.skip_resume.counted REQUIRES nf_sr_b
             ARGS inspect --hotpath ${HP} ${NF}/sr/step_00000006.h5 --expect "skipped_steps == 2")
# Weights driven past the float range by a huge (finite) lr: no checkpoint of them is committed.
hp_cli(nonfinite.huge_lr_commits_nothing SETUP nf_huge CLEAN ${NF}/huge EXIT nonzero
       PASS "checkpoint of step 1 not saved: tensor /params/.* holds non-finite values"
       COMMAND ${HP} ${TINY} --steps=3 --lr=1e30 --checkpoint_every=1 --checkpoint_dir=${NF}/huge)
hp_cli_check(nonfinite.huge_lr_dir_empty REQUIRES nf_huge
             ARGS dir ${NF}/huge --absent latest --absent step_00000001.h5
                  --absent step_00000001.h5.tmp)
# nonfinite=skip also catches an update that would itself make the weights non-finite (lr=1e39
# overflows the float range): it is never applied, so the skipped steps' checkpoints hold finite
# state; more than max_skipped_steps skipped in a row stop the run (2). With lr=1e38 the update is
# finite but the next forward is not: every step after the first is skipped, and the run stops
# instead of going on with a stale loss.
foreach(spec "1:none" "2:zero1")
  string(REPLACE ":" ";" spec "${spec}")
  list(GET spec 0 np)
  list(GET spec 1 sharding)
  set(n np${np}_${sharding})
  hp_cli(nonfinite.update_overflow.${n}.stops NP ${np} SETUP nf_over_${n} CLEAN ${NF}/over_${n}
         EXIT 2 PASS "stopping at step 3: 3 steps in a row were skipped as non-finite.*max_skipped_steps=2.*lower lr"
         COMMAND ${HP} ${TINY} --optimizer_sharding=${sharding} --steps=40 --lr=1e39
                 --warmup_steps=0 --nonfinite=skip --max_skipped_steps=2 --checkpoint_every=1
                 --checkpoint_dir=${NF}/over_${n})
  hp_cli_check(nonfinite.update_overflow.${n}.saved_finite_state NP ${np} REQUIRES nf_over_${n}
               ARGS inspect --hotpath ${HP} ${NF}/over_${n}/step_00000002.h5
                    --expect "step == 2" --expect "skipped_steps == 2")
endforeach()
hp_cli(nonfinite.update_overflow.warned EXIT 2
       PASS "step 1: loss=.* finite, but the update \\(lr=[0-9.e+]+\\) would make parameters or moments non-finite: skipped"
       COMMAND ${HP} ${TINY} --steps=40 --lr=1e39 --warmup_steps=0 --nonfinite=skip
               --max_skipped_steps=0)
hp_cli(nonfinite.huge_lr_skip_stops EXIT 2
       PASS "stopping at step 4: 3 steps in a row were skipped"
       COMMAND ${HP} ${TINY} --steps=40 --lr=1e38 --warmup_steps=0 --nonfinite=skip
               --max_skipped_steps=2)
hp_cli_config_error(range.max_skipped_steps_negative "'max_skipped_steps': must be >= 0"
                    train ${MOE} --max_skipped_steps=-1 --dry-run)
# The summary line never shows a stale loss: a skipped last step is said, with the step its loss
# belongs to; with no step applied there is no loss to show.
hp_cli(nonfinite.summary.last_step_skipped ENV HOTPATH_FAULT=nan:0:3
       PASS "done: steps=3 skipped=1 final_loss=[0-9.]+ \\(step 2, the last applied; step 3 skipped\\)"
       COMMAND ${HP} ${TINY} --steps=3 --nonfinite=skip)
hp_cli(nonfinite.summary.no_step_applied
       PASS "done: steps=2 skipped=2 final_loss=none \\(no step applied in this run: 2 skipped\\)"
       COMMAND ${HP} ${TINY} --steps=40 --stop_at_step=2 --lr=1e39 --warmup_steps=0
               --nonfinite=skip)

# ==== the disk fills during a save =================================================================
# A 30 MiB tmpfs holds one tiny-moe checkpoint (21 MiB), not two: the save of step 2 fails. The
# run exits 1 naming the step (no crash at exit), removes its partial file and leaves step 1 and
# `latest` as they were; the next run, on a disk with room, resumes from step 1 and saves again,
# a stale .tmp of the same step in its way notwithstanding. 16 MiB: even the first save fails.
set(DF ${F}/disk_full)
hp_cli(disk_full.second_save PASS "checkpoint of step 2 not saved: .*No space left on device.*partial file was removed"
       SETUP df_second
       COMMAND ${CHECK} fs --at ${DF}/mnt --size 30m --keep ${DF}/after --exit 1
               --forbid "[Ss]egmentation|infinite loop|core dumped" --
               ${HP} ${TINY} --steps=3 --checkpoint_every=1 --checkpoint_dir=${DF}/mnt/ckpt)
set_tests_properties(cli.disk_full.second_save PROPERTIES SKIP_RETURN_CODE 77
                     SKIP_REGULAR_EXPRESSION "\\[hp_check\\] skipped")
hp_cli_check(disk_full.previous_checkpoint_kept REQUIRES df_second SETUP df_checked
             ARGS dir ${DF}/after/ckpt --latest step_00000001.h5 --present step_00000001.h5
                  --absent step_00000002.h5.tmp --absent step_00000002.h5)
hp_cli(disk_full.previous_checkpoint_valid REQUIRES df_checked EXIT 0
       PASS "checksums: ok" COMMAND ${HP} inspect ${DF}/after/ckpt/step_00000001.h5)
file(WRITE ${IN}/stale.tmp "a stale temporary file of an earlier failed save\n")
hp_cli(disk_full.stale_tmp_planted REQUIRES df_checked SETUP df_stale
       COMMAND ${CMAKE_COMMAND} -E copy ${IN}/stale.tmp ${DF}/after/ckpt/step_00000002.h5.tmp)
hp_cli(disk_full.next_run_saves REQUIRES df_stale SETUP df_next
       COMMAND ${HP} ${TINY} --steps=3 --checkpoint_every=1 --resume=auto
               --checkpoint_dir=${DF}/after/ckpt)
hp_cli_check(disk_full.next_run_committed REQUIRES df_next
             ARGS dir ${DF}/after/ckpt --latest step_00000003.h5 --present step_00000002.h5
                  --absent step_00000002.h5.tmp)
hp_cli(disk_full.first_save PASS "checkpoint of step 1 not saved: .*No space left on device"
       SETUP df_first
       COMMAND ${CHECK} fs --at ${DF}/mnt1 --size 16m --keep ${DF}/after1 --exit 1
               --forbid "[Ss]egmentation|infinite loop|core dumped" --
               ${HP} ${TINY} --steps=2 --checkpoint_every=1 --checkpoint_dir=${DF}/mnt1/ckpt)
set_tests_properties(cli.disk_full.first_save PROPERTIES SKIP_RETURN_CODE 77
                     SKIP_REGULAR_EXPRESSION "\\[hp_check\\] skipped")
hp_cli_check(disk_full.first_save_left_nothing REQUIRES df_first
             ARGS dir ${DF}/after1/ckpt --absent latest --absent step_00000001.h5
                  --absent step_00000001.h5.tmp)

# ==== a changed model config on resume and eval ====================================================
# The checkpoint stores the model config; a key that changes what the model computes without
# changing a tensor's shape is an error naming it, unless --allow_config_change names it.
set(CF ${F}/config_change)
hp_cli(config_change.setup SETUP cf_made CLEAN ${CF}
       COMMAND ${HP} ${TINY} --steps=2 --checkpoint_dir=${CF})
foreach(spec "activation|--activation=swiglu|activation=gptoss -> swiglu"
             "window_layers|--window_layers=all|window_layers=even -> all"
             "sliding_window|--sliding_window=16|sliding_window=32 -> 16"
             "rope_theta|--rope_theta=500000|rope_theta=10000 -> 500000"
             "norm_eps|--norm_eps=1e-6|norm_eps=1.0000000000000001e-05 -> 9.9999999999999995e-07"
             "swiglu_limit|--swiglu_limit=5|swiglu_limit=7 -> 5"
             "yarn|--rope_scaling_factor=4|rope_scaling_factor=1 -> 4"
             "d_model|--d_model=64 --head_dim=16|d_model=128 -> 64")
  string(REPLACE "|" ";" spec "${spec}")
  list(GET spec 0 key)
  list(GET spec 1 args)
  list(GET spec 2 regex)
  separate_arguments(args UNIX_COMMAND "${args}")
  hp_cli(config_change.resume.${key} REQUIRES cf_made EXIT 2
         PASS "saved with another model config: ${regex}.*--allow_config_change="
         COMMAND ${HP} ${TINY} --steps=3 --resume=${CF}/step_00000002.h5 ${args})
  hp_cli(config_change.eval.${key} REQUIRES cf_made EXIT 2
         PASS "saved with another model config: ${regex}"
         COMMAND ${HP} eval ${MOE} --seq_len=128 --batch_tokens=1024 --checkpoint=${CF}
                 --batches=1 ${args})
endforeach()
# resume=auto does not fall back to an older checkpoint past a changed config.
hp_cli(config_change.auto_does_not_fall_back REQUIRES cf_made EXIT 2
       PASS "saved with another model config: rope_theta=10000 -> 500000"
       COMMAND ${HP} ${TINY} --steps=3 --resume=auto --checkpoint_dir=${CF} --rope_theta=500000
               --allow_overwrite=true)
hp_cli(config_change.two_ranks NP 2 REQUIRES cf_made EXIT 2
       PASS "saved with another model config: activation=gptoss -> swiglu"
       COMMAND ${HP} ${TINY} --ep_size=2 --steps=3 --resume=${CF}/step_00000002.h5
               --activation=swiglu)
hp_cli(config_change.allowed_resume REQUIRES cf_made EXIT 0
       PASS "rope_theta=10000 when saved, 500000 now \\(allowed by allow_config_change\\)"
       COMMAND ${HP} ${TINY} --steps=3 --resume=${CF}/step_00000002.h5 --rope_theta=500000
               --allow_config_change=rope_theta,window_layers --window_layers=all)
hp_cli(config_change.allowed_eval REQUIRES cf_made EXIT 0 PASS "eval_loss=[0-9.]+ tokens="
       COMMAND ${HP} eval ${MOE} --seq_len=128 --batch_tokens=1024 --checkpoint=${CF} --batches=1
               --activation=swiglu --allow_config_change=activation)

# ==== load errors end a multi-rank job with the status of a single process (2) ===================
hp_cli(load_error.missing_checkpoint_two_ranks NP 2 EXIT 2 PASS "does not exist"
       COMMAND ${HP} ${TINY} --ep_size=2 --steps=1 --resume=${F}/no-such-checkpoint.h5)
hp_cli(load_error.damaged_checkpoint_two_ranks NP 2 EXIT 2 REQUIRES dmg_flip
       PASS "resume: checkpoint .*cannot be loaded.*CRC-32C"
       COMMAND ${HP} ${TINY} --ep_size=2 --steps=6 --resume=${C}/flip/step_00000006.h5)
hp_cli(load_error.damaged_checkpoint_one_rank EXIT 2 REQUIRES dmg_flip
       PASS "resume: checkpoint .*cannot be loaded.*CRC-32C"
       COMMAND ${HP} ${TINY} --steps=6 --resume=${C}/flip/step_00000006.h5)
hp_cli(load_error.eval_truncated_two_ranks NP 2 EXIT 2 REQUIRES dmg_trunc
       PASS "eval: checkpoint .*cannot be loaded"
       COMMAND ${HP} eval ${MOE} --seq_len=128 --batch_tokens=1024 --ep_size=2 --batches=1
               --checkpoint=${C}/trunc/step_00000006.h5)

# ==== a preemption signal during start-up ==========================================================
# The handlers are installed first thing in main; HOTPATH_FAULT=sigterm:RANK:0 raises SIGTERM
# there, before the options are read. The run stops before step 1 with 75, all ranks together,
# leaving no checkpoint and no metrics file.
set(PS ${F}/preempt_start)
foreach(np 1 2)
  math(EXPR victim "${np} - 1")
  hp_cli(preempt.sigterm_at_start.np${np} NP ${np} SETUP ps_${np} CLEAN ${PS}/${np} ${PS}/${np}.jsonl
         EXIT 75 ENV HOTPATH_FAULT=sigterm:${victim}:0
         PASS "preemption signal during start-up: stopping before any step; exit status 75"
         COMMAND ${HP} ${TINY} --ep_size=${np} --steps=3 --checkpoint_dir=${PS}/${np}
                 --metrics_path=${PS}/${np}.jsonl)
  hp_cli_check(preempt.sigterm_at_start.np${np}.nothing_written NP ${np} REQUIRES ps_${np}
               ARGS dir ${PS} --absent ${np}.jsonl)
endforeach()
hp_cli_check(preempt.sigterm_at_start.no_checkpoint REQUIRES ps_1
             ARGS dir ${PS}/1 --absent latest --absent step_00000001.h5)

# ==== options that were read as something else, or ignored ========================================
# device_memory_gib below 0.001 GiB rounds to 0 bytes, which meant "no check"; --plan_world and
# --plan_json only plan (--dry-run); a CPU dry run makes the host-memory check a run makes.
hp_cli_config_error(range.device_memory_gib_tiny_dry_run
                    "'device_memory_gib': must be auto, off \\(no check\\), a number of GiB in .0.001"
                    train ${MOE} --dry-run --device_memory_gib=1e-12)
hp_cli_config_error(range.device_memory_gib_tiny_run "'device_memory_gib'.*got '1e-12'"
                    train ${MOE} --steps=1 --device_memory_gib=1e-12)
hp_cli_config_error(args.plan_world_without_dry_run "--plan_world=4 plans a layout .*needs --dry-run"
                    train ${MOE} --steps=1 --plan_world=4)
hp_cli_config_error(args.plan_json_without_dry_run "--plan_json=.*needs --dry-run"
                    train ${MOE} --steps=1 --plan_json=${F}/plan.json)
hp_cli_config_error(range.dry_run_cpu_beyond_memory
                    "'batch_tokens': 1000000000 tokens need at least .* GiB of host memory"
                    train ${MOE} --device=cpu --dry-run --seq_len=1000 --batch_tokens=1000000000)

# ==== inspect of a file that is no checkpoint ======================================================
hp_cli(inspect.not_a_checkpoint EXIT 2
       PASS "checkpoint .*garbage.h5 cannot be read: the file is corrupt or not a hotpath checkpoint"
       COMMAND ${HP} inspect ${IN}/garbage.h5)

# ==== eval --dump_logits: checked before the evaluation, never replaces a file unasked ==============
set(DL ${F}/dump_logits)
file(MAKE_DIRECTORY ${DL})
file(WRITE ${IN}/logits_keep.orig "a file hotpath did not create\n")
hp_cli(dump_logits.unwritable_dir EXIT 2
       PASS "--dump_logits .*no-such-dir/l.safetensors cannot be written: No such file or directory"
       COMMAND ${HP} eval ${MOE} --seq_len=128 --batch_tokens=1024 --checkpoint=${F}/no-such.h5
               --dump_logits=${DL}/no-such-dir/l.safetensors)
hp_cli(dump_logits.a_directory EXIT 2 PASS "--dump_logits .*dump_logits is a directory"
       COMMAND ${HP} eval ${MOE} --seq_len=128 --batch_tokens=1024 --checkpoint=${F}/no-such.h5
               --dump_logits=${DL})
hp_cli(dump_logits.plant SETUP dl_planted
       COMMAND ${CMAKE_COMMAND} -E copy ${IN}/logits_keep.orig ${DL}/keep.safetensors)
hp_cli(dump_logits.existing_refused EXIT 2 REQUIRES dl_planted ckpt_np1_straight SETUP dl_refused
       PASS "--dump_logits .*keep.safetensors already exists; .*--force"
       COMMAND ${HP} eval ${MOE} --seq_len=128 --batch_tokens=1024 --checkpoint=${C}/np1/straight
               --batches=1 --dump_logits=${DL}/keep.safetensors)
hp_cli(dump_logits.existing_unchanged REQUIRES dl_refused SETUP dl_unchanged
       COMMAND ${CMAKE_COMMAND} -E compare_files ${IN}/logits_keep.orig ${DL}/keep.safetensors)
hp_cli(dump_logits.force_replaces EXIT 0 REQUIRES dl_unchanged ckpt_np1_straight SETUP dl_forced
       PASS "eval_loss=[0-9.]+"
       COMMAND ${HP} eval ${MOE} --seq_len=128 --batch_tokens=1024 --checkpoint=${C}/np1/straight
               --batches=1 --dump_logits=${DL}/keep.safetensors --force)
hp_cli(dump_logits.force_replaced WILL_FAIL REQUIRES dl_forced
       COMMAND ${CMAKE_COMMAND} -E compare_files ${IN}/logits_keep.orig ${DL}/keep.safetensors)
hp_cli(dump_logits.force_outside_eval EXIT 2 PASS "--force .*hotpath eval --dump_logits"
       COMMAND ${HP} ${TINY} --steps=1 --force)
