# Background checkpoint saves (checkpoint_async=true; launch/train/async_checkpoint.h), from the
# whole program: resuming from checkpoints written in the background continues bitwise; a kill
# at every phase of a background write leaves the previous checkpoint loadable; a write that
# fails (an injected full disk, a damaged snapshot) ends the run with exit 1 leaving `latest` and
# no partial file; SIGUSR1 with a save in flight waits for it, saves and exits 75. Included from
# tests/cli/CMakeLists.txt after the checkpoint section, whose straight runs are the references
# (ckpt_np<N>_straight: 6 steps; sig_straight: 16 steps on 2 ranks).
set(AS ${C}/async)
set(ASYNC --checkpoint_async=true)

# Every step's checkpoint written in the background, 3 steps, then a new process resumes from
# the newest and runs to 6: the losses of 6 straight steps and their parameters and moments, on
# 1, 2 (ep=2) and 4 (dp=2 x ep=2) ranks, optimizer_sharding none and zero1 (whose losses and
# state equal none's bitwise). The first run's step 3 is committed by the writer (the end of the
# run only waits for it).
foreach(spec "1:1:none" "2:2:zero1" "2:2:none" "4:2:none" "4:2:zero1")
  string(REPLACE ":" ";" spec "${spec}")
  list(GET spec 0 np)
  list(GET spec 1 ep)
  list(GET spec 2 sh)
  set(k ${AS}/np${np}_${sh})
  set(args ${ASYNC} --optimizer_sharding=${sh} --checkpoint_every=1 --checkpoint_dir=${k}/ckpt)
  hp_ckpt_run(async.np${np}_${sh}.first_half ${np} ${ep} SETUP async_np${np}_${sh}_half
              CLEAN ${k} EXIT 0 PASS "saved .*step_00000003.h5 .*in the background"
              ARGS --steps=6 --stop_at_step=3 ${args} --metrics_path=${k}/a.jsonl)
  hp_ckpt_run(async.np${np}_${sh}.resumed ${np} ${ep} REQUIRES async_np${np}_${sh}_half
              SETUP async_np${np}_${sh}_resumed CLEAN ${k}/b.jsonl
              ARGS --steps=6 --resume=auto ${args} --metrics_path=${k}/b.jsonl)
  hp_cli_check(async.np${np}_${sh}.same_losses_as_straight NP ${np}
               REQUIRES async_np${np}_${sh}_resumed ckpt_np${np}_straight
               ARGS losses ${k}/a.jsonl,${k}/b.jsonl ${C}/np${np}/s.jsonl --same-steps --steps 6)
  hp_cli_check(async.np${np}_${sh}.same_params_as_straight NP ${np}
               REQUIRES async_np${np}_${sh}_resumed ckpt_np${np}_straight
               ARGS digests --hotpath ${HP} ${k}/ckpt/step_00000006.h5
                    ${C}/np${np}/straight/step_00000006.h5)
endforeach()

# A kill inside the background write of step 4 (checkpoints every 2 steps) at each phase:
# snapshot (taken, nothing written), begin (file created), data (half the tensors), close (file
# complete, not committed), rename (committed, `latest` not moved) and latest (`latest` moved).
# The checkpoint `latest` names is loadable, resume=auto continues from it bitwise, and no
# temporary file is left. On 1 rank every phase; on 2 ranks the phases the synchronous kill
# tests above do not name (they run in the background too, checkpoint_async being the default).
foreach(spec "1:1:snapshot:0" "1:1:begin:0" "1:1:data:0" "1:1:close:0" "1:1:rename:0"
             "1:1:latest:0" "2:2:snapshot:1" "2:2:latest:0")
  string(REPLACE ":" ";" spec "${spec}")
  list(GET spec 0 np)
  list(GET spec 1 ep)
  list(GET spec 2 point)
  list(GET spec 3 victim)
  set(n async.kill.np${np}_${point})
  set(f async_kill_np${np}_${point})
  set(k ${AS}/kill_np${np}_${point})
  set(args ${ASYNC} --steps=6 --checkpoint_every=2 --checkpoint_dir=${k})
  hp_ckpt_run(${n}.killed ${np} ${ep} WILL_FAIL TIMEOUT 90 SETUP ${f}
              ENV HOTPATH_FAULT=kill-save-${point}:${victim}:4 CLEAN ${k} ${k}.a.jsonl
              ARGS ${args} --metrics_path=${k}.a.jsonl)
  if(point STREQUAL "latest")
    set(resumed_at 4)
    set(expect --latest step_00000004.h5 --present step_00000004.h5)
  elseif(point STREQUAL "rename")
    set(resumed_at 2)
    set(expect --latest step_00000002.h5 --present step_00000004.h5)
  else()
    set(resumed_at 2)
    set(expect --latest step_00000002.h5 --absent step_00000004.h5)
  endif()
  hp_cli_check(${n}.latest_is_loadable NP ${np} REQUIRES ${f} SETUP ${f}_checked
               ARGS dir ${k} --present step_00000002.h5 ${expect})
  hp_ckpt_run(${n}.restarted ${np} ${ep} REQUIRES ${f}_checked SETUP ${f}_restarted
              CLEAN ${k}.b.jsonl ARGS ${args} --resume=auto --metrics_path=${k}.b.jsonl)
  math(EXPR first "${resumed_at} + 1")
  math(EXPR count "6 - ${resumed_at}")
  hp_cli_check(${n}.continues_bitwise NP ${np} REQUIRES ${f}_restarted ckpt_np${np}_straight
               ARGS losses ${k}.b.jsonl ${C}/np${np}/s.jsonl --first ${first} --steps ${count})
  hp_cli_check(${n}.no_temporary_left NP ${np} REQUIRES ${f}_restarted
               ARGS dir ${k} --latest step_00000006.h5 --absent step_00000004.h5.tmp
                    --absent step_00000006.h5.tmp)
endforeach()

# A background write that fails (checkpoints every 2 steps; the save of step 4): a full disk
# half way through the tensors (every rank, or the one rank of a 1-rank run), after the file was
# closed, or a snapshot damaged after its checksum on rank 0 only (the writers agree before
# creating the file). Every rank stops at the next step boundary with exit 1, naming the error;
# step 2 stays `latest`, nothing of step 4 is left, and resume=auto continues bitwise.
foreach(spec "2:2:data:-1:No space left on device.*partial file was removed"
             "2:2:close:-1:No space left on device.*partial file was removed"
             "2:2:snapshot:0:snapshot of .* changed after it was taken"
             "1:1:data:0:No space left on device.*partial file was removed")
  string(REPLACE ":" ";" spec "${spec}")
  list(GET spec 0 np)
  list(GET spec 1 ep)
  list(GET spec 2 point)
  list(GET spec 3 victim)
  list(GET spec 4 message)
  set(n async.fail.np${np}_${point})
  set(f async_fail_np${np}_${point})
  set(k ${AS}/fail_np${np}_${point})
  set(args ${ASYNC} --steps=6 --checkpoint_every=2 --checkpoint_dir=${k})
  hp_ckpt_run(${n}.stopped ${np} ${ep} EXIT 1 TIMEOUT 90 SETUP ${f}
              PASS "checkpoint of step 4 not saved: .*${message}"
              ENV HOTPATH_FAULT=fail-save-${point}:${victim}:4 CLEAN ${k} ${k}.a.jsonl
              ARGS ${args} --metrics_path=${k}.a.jsonl)
  hp_cli_check(${n}.previous_is_latest NP ${np} REQUIRES ${f} SETUP ${f}_checked
               ARGS dir ${k} --latest step_00000002.h5 --present step_00000002.h5
                    --absent step_00000004.h5 --absent step_00000004.h5.tmp
                    --absent step_00000006.h5)
  hp_ckpt_run(${n}.restarted ${np} ${ep} REQUIRES ${f}_checked SETUP ${f}_restarted
              CLEAN ${k}.b.jsonl ARGS ${args} --resume=auto --metrics_path=${k}.b.jsonl)
  hp_cli_check(${n}.continues_bitwise NP ${np} REQUIRES ${f}_restarted ckpt_np${np}_straight
               ARGS losses ${k}.b.jsonl ${C}/np${np}/s.jsonl --first 3 --steps 4)
endforeach()

# SIGUSR1 to rank 1 after step 3 while the background write of step 2 is still in flight (it
# starts 2 s late on every rank: slow-save): the ranks wait for it, save the step they stopped
# at synchronously and exit 75; resume=auto then continues bitwise to step 16.
set(AG ${AS}/preempt)
hp_cli(async.preempt.in_flight SETUP async_sig_stopped TIMEOUT 240
       PASS "waited [0-9.e+-]+ ms for the background save in flight"
       COMMAND ${CHECK} signal --signal USR1 --rank 1 --after 3 --exit 75
               --metrics ${AG}/a.jsonl --clean ${AG}/run --
               ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${HP_MPIEXEC_PREFLAGS} ${HP}
               ${MPIEXEC_POSTFLAGS} ${TINY} --steps=${SIG_STEPS} --ep_size=2 ${ASYNC}
               --checkpoint_every=2 --checkpoint_dir=${AG}/run --metrics_path=${AG}/a.jsonl)
set_tests_properties(cli.async.preempt.in_flight PROPERTIES
                     LABELS "cli;mpi" PROCESSORS 2
                     ENVIRONMENT "${HP_MPI_ENV};HOTPATH_FAULT=slow-save:-1:2")
hp_cli_check(async.preempt.saved_the_last_step NP 2 REQUIRES async_sig_stopped
             SETUP async_sig_checked
             ARGS dir ${AG}/run --latest-of ${AG}/a.jsonl --below ${SIG_STEPS}
                  --present step_00000002.h5)
hp_ckpt_run(async.preempt.resumed 2 2 REQUIRES async_sig_checked SETUP async_sig_resumed
            CLEAN ${AG}/b.jsonl
            ARGS --steps=${SIG_STEPS} ${ASYNC} --checkpoint_every=2 --checkpoint_dir=${AG}/run
                 --resume=auto --metrics_path=${AG}/b.jsonl)
hp_cli_check(async.preempt.resumed_bitwise NP 2 REQUIRES async_sig_resumed sig_straight
             ARGS losses ${AG}/a.jsonl,${AG}/b.jsonl ${G}/s.jsonl --same-steps
                  --steps ${SIG_STEPS})

# A host whose available memory cannot hold the snapshot (no-host-memory on rank 1 only): every
# rank saves synchronously, rank 0 saying why before step 1, and the checkpoints are those of a
# straight run.
set(k ${AS}/no_memory)
set(why "the host snapshot .*does not fit in the available host memory \\(MemAvailable 0")
hp_ckpt_run(async.no_host_memory.synchronous 2 2 SETUP async_no_memory CLEAN ${k}
            ENV HOTPATH_FAULT=no-host-memory:1:0 PASS "checkpoint: synchronous saves \\(${why}"
            ARGS --steps=6 ${ASYNC} --checkpoint_every=2 --checkpoint_dir=${k})
hp_cli_check(async.no_host_memory.same_params_as_straight NP 2
             REQUIRES async_no_memory ckpt_np2_straight
             ARGS digests --hotpath ${HP} ${k}/step_00000006.h5 ${C}/np2/straight/step_00000006.h5)

# The memory plan counts the snapshot's host memory when a run saves in the background (at most
# the masters and moments a rank owns: `optimizer_bytes`), and none without background saves.
hp_cli(async.dry_run.snapshot_in_plan SETUP async_plan CLEAN ${AS}/plan.json
       PASS "host \\(snapshot\\) +[0-9.]+ MiB  \\(at most: background checkpoint saves"
       COMMAND ${HP} ${TINY} --dry-run --checkpoint_dir=${AS}/never --plan_json=${AS}/plan.json)
hp_cli_check(async.dry_run.snapshot_bytes REQUIRES async_plan
             ARGS json ${AS}/plan.json --expect "host_snapshot_bytes == optimizer_bytes > 0")
hp_cli(async.dry_run.no_snapshot_when_synchronous SETUP async_plan_sync
       CLEAN ${AS}/plan_sync.json
       COMMAND ${HP} ${TINY} --dry-run --checkpoint_dir=${AS}/never --checkpoint_async=false
               --plan_json=${AS}/plan_sync.json)
hp_cli_check(async.dry_run.no_snapshot_bytes REQUIRES async_plan_sync
             ARGS json ${AS}/plan_sync.json --expect "host_snapshot_bytes == 0")
