# The dependency rule, checked on the #include directives of a source tree.
#
#   cmake -DHP_ROOT=<tree> [-DHP_STAMP=<file>] -P check_layering.cmake
#
# Every C++/CUDA file under <tree>/{framework,parallel,optim,launch} belongs to a layer: its
# folder (framework/<folder> inside framework/). An include of a project header ("framework/...",
# "parallel/...", "optim/...", "launch/...", "tests/...") must name a layer in the including
# layer's row of the table below; framework/ never includes MPI or NCCL headers itself; and no
# include climbs out of its folder with "..". Each violation is printed as file:line with the
# rule, and the script fails. On success it touches HP_STAMP, if given.
#
# The table is the transitive closure of the allowed edges (docs/design.md, "Layering"):
#   launch -> optim -> parallel -> framework
#   framework: model -> backend -> data -> core, checkpoint -> core

cmake_minimum_required(VERSION 3.25)

if(NOT HP_ROOT OR NOT IS_DIRECTORY "${HP_ROOT}")
  message(FATAL_ERROR "check_layering: HP_ROOT must name the tree to check (got '${HP_ROOT}')")
endif()
get_filename_component(HP_ROOT "${HP_ROOT}" ABSOLUTE)

set(hp_framework_layers
    framework/model framework/backend framework/data framework/core framework/checkpoint)
set(hp_layers ${hp_framework_layers} parallel optim launch)

set(hp_uses_framework/core framework/core)
set(hp_uses_framework/data framework/data framework/core)
set(hp_uses_framework/backend framework/backend framework/data framework/core)
set(hp_uses_framework/model framework/model framework/backend framework/data framework/core)
set(hp_uses_framework/checkpoint framework/checkpoint framework/core)
set(hp_uses_parallel parallel ${hp_framework_layers})
set(hp_uses_optim optim parallel ${hp_framework_layers})
set(hp_uses_launch launch optim parallel ${hp_framework_layers})

# System headers framework/ must reach only through an interface that parallel/ implements.
set(hp_framework_forbidden_system mpi.h nccl.h)

string(CONCAT hp_rule "launch -> optim -> parallel -> framework, inside framework: "
              "model -> backend -> data -> core, checkpoint -> core")

# The layer of a file, by its path relative to the root; empty for a file outside every layer.
function(hp_layer_of rel out)
  set(layer "")
  if(rel MATCHES "^framework/([^/]+)/")
    set(layer "framework/${CMAKE_MATCH_1}")
  elseif(rel MATCHES "^framework/")
    set(layer "framework/")
  elseif(rel MATCHES "^(parallel|optim|launch|tests)/")
    set(layer "${CMAKE_MATCH_1}")
  endif()
  set(${out} "${layer}" PARENT_SCOPE)
endfunction()

# 1-based number of the first line of `file` that holds `text`.
function(hp_line_of file text out)
  file(READ "${file}" content)
  # Characters that would split or join CMake list elements go first. (Messages below avoid ';'
  # for the same reason.)
  string(REPLACE "\\" "/" content "${content}")
  string(REPLACE ";" "," content "${content}")
  string(REPLACE "[" "(" content "${content}")
  string(REPLACE "]" ")" content "${content}")
  string(REPLACE "[" "(" text "${text}")
  string(REPLACE "]" ")" text "${text}")
  string(REPLACE "\n" ";" lines "${content}")
  set(n 0)
  foreach(line IN LISTS lines)
    math(EXPR n "${n} + 1")
    if(line STREQUAL text)
      set(${out} ${n} PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out} "?" PARENT_SCOPE)
endfunction()

set(hp_violations "")
set(hp_files "")
foreach(dir framework parallel optim launch)
  if(IS_DIRECTORY "${HP_ROOT}/${dir}")
    file(GLOB_RECURSE found RELATIVE "${HP_ROOT}"
         "${HP_ROOT}/${dir}/*.h" "${HP_ROOT}/${dir}/*.hpp" "${HP_ROOT}/${dir}/*.cpp"
         "${HP_ROOT}/${dir}/*.cc" "${HP_ROOT}/${dir}/*.cu" "${HP_ROOT}/${dir}/*.cuh")
    list(APPEND hp_files ${found})
  endif()
endforeach()
list(SORT hp_files)

foreach(rel IN LISTS hp_files)
  hp_layer_of("${rel}" layer)
  if(NOT layer IN_LIST hp_layers)
    string(CONCAT why "${rel}:1: not in a known layer (a new folder needs a row in "
                      "cmake/check_layering.cmake and a target of its own)")
    list(APPEND hp_violations "${why}")
    continue()
  endif()
  file(STRINGS "${HP_ROOT}/${rel}" includes REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"][^>\"]+[>\"]")
  foreach(inc IN LISTS includes)
    string(REGEX MATCH "^[ \t]*#[ \t]*include[ \t]*([<\"])([^>\"]+)[>\"]" _ "${inc}")
    set(delim "${CMAKE_MATCH_1}")
    set(header "${CMAKE_MATCH_2}")
    set(why "")
    hp_layer_of("${header}" target)
    if(header MATCHES "(^|/)\\.\\.(/|$)")
      string(CONCAT why "\"${header}\" climbs out of its folder "
                        "(include project headers by their path from the root)")
    elseif(target STREQUAL "tests")
      set(why "${layer} includes \"${header}\" of tests/ (libraries never use the tests)")
    elseif(target)
      if(NOT target IN_LIST hp_uses_${layer})
        string(REPLACE ";" ", " allowed "${hp_uses_${layer}}")
        string(CONCAT why "${layer} includes \"${header}\" of ${target} "
                          "(${layer} may include ${allowed} only)")
      endif()
    elseif(delim STREQUAL "<" AND layer MATCHES "^framework/" AND
           header IN_LIST hp_framework_forbidden_system)
      string(CONCAT why "${layer} includes <${header}> (framework/ reaches MPI and NCCL only "
                        "through interfaces that parallel/ implements)")
    endif()
    if(why)
      hp_line_of("${HP_ROOT}/${rel}" "${inc}" line)
      list(APPEND hp_violations "${rel}:${line}: ${why}")
    endif()
  endforeach()
endforeach()

list(LENGTH hp_files n_files)
if(hp_violations)
  list(LENGTH hp_violations n)
  foreach(v IN LISTS hp_violations)
    message(NOTICE "${v}")
  endforeach()
  message(FATAL_ERROR "layering: ${n} violation(s) of the dependency rule (${hp_rule}) "
                      "in ${n_files} files under ${HP_ROOT}")
endif()
message(STATUS "layering: ${n_files} files follow the dependency rule")
if(HP_STAMP)
  file(TOUCH "${HP_STAMP}")
endif()
