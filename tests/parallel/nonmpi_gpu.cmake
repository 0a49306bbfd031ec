# gpu.nonmpi.np2: two ranks on two GPUs launched without mpirun (RANK/WORLD_SIZE, bootstrap=file:),
# a save whose gathers go over NCCL, and a bitwise resume (tests/parallel/nonmpi_gpu.sh). Label
# gpu, registered in every build: it skips (exit 77, saying why) without a CUDA build or with
# fewer than 2 GPUs visible. Included by tests/CMakeLists.txt.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  set(hp_nonmpi_python ${Python3_EXECUTABLE})
else()
  set(hp_nonmpi_python python3)
endif()
if(HOTPATH_CUDA)
  set(hp_nonmpi_cuda 1)
else()
  set(hp_nonmpi_cuda 0)
endif()
add_test(NAME gpu.nonmpi.np2
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/nonmpi_gpu.sh $<TARGET_FILE:hotpath>
                 ${PROJECT_SOURCE_DIR}/examples/configs/tiny-moe.ini
                 ${CMAKE_CURRENT_BINARY_DIR}/nonmpi_gpu ${hp_nonmpi_python}
                 ${PROJECT_SOURCE_DIR}/tests/tools/hp_check.py ${hp_nonmpi_cuda})
set_tests_properties(gpu.nonmpi.np2 PROPERTIES LABELS gpu PROCESSORS 2 TIMEOUT 900
                     SKIP_RETURN_CODE 77)
