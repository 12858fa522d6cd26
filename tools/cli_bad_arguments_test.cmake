# Every bad command line makes `sparsa` print exactly one line on stderr (no stack trace, no usage dump) and exit 2.
# Usage: cmake -DSPARSA=<path to the sparsa tool> -P cli_bad_arguments_test.cmake
cmake_minimum_required(VERSION 3.25)
set(missing_file /nonexistent/sparsa-cli-test.npy)
set(missing_qkv "--q|${missing_file}|--k|${missing_file}|--v|${missing_file}")
# One case per line, arguments separated by "|" (a ";" would flatten the list).
set(cases
  "<none>"
  "frobnicate"
  "demo|--n|abc"
  "demo|--n|12"
  "demo|--bogus"
  "demo|--heads|8:3"
  "run|--q|q.npy"
  "run|--policy|nope|--q|q.npy"
  "run|--policy|dense"
  "run|--policy|sparge|--theta|2|--q|q.npy"
  "run|--policy|dense|--q|${missing_file}|--k|${missing_file}|--v|${missing_file}"
  "run|--policy|dense|--causal=1"
  # Checked before anything is read or computed; each line names what is wrong ("=>" then a regex of the message).
  "run|--policy|block_sparse|--causal|${missing_qkv}=>needs --block-mask"
  "run|--policy|token_indices|${missing_qkv}=>needs --indices"
  "run|--policy|sink_window|--delta|${missing_qkv}=>--delta needs --causal"
  "run|--policy|dense|${missing_qkv}=>No such file or directory"
  "run|--policy|dense|--q|${CMAKE_CURRENT_LIST_DIR}|--k|${missing_file}|--v|${missing_file}=>is a directory"
  "run|--policy|dense|--out|${CMAKE_CURRENT_LIST_DIR}|${missing_qkv}=>is a directory"
  "run|--policy|dense|--out|/nonexistent/o.npy|${missing_qkv}=>does not exist"
  "demo|--n|512|--save|${CMAKE_CURRENT_LIST_FILE}/inputs=>cannot create folder")
set(failures 0)
foreach(case IN LISTS cases)
  set(expected "")
  if(case MATCHES "^(.*)=>(.*)$")
    set(case "${CMAKE_MATCH_1}")
    set(expected "${CMAKE_MATCH_2}")
  endif()
  if(case STREQUAL "<none>")
    set(args "")
  else()
    string(REPLACE "|" ";" args "${case}")
  endif()
  set(expected_text "")
  if(expected)
    set(expected_text " and a message matching '${expected}'")
  endif()
  execute_process(COMMAND ${SPARSA} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(STRIP "${err}" err_stripped)
  string(REGEX MATCHALL "\n" newlines "${err_stripped}")
  list(LENGTH newlines extra_lines)
  if(NOT rc EQUAL 2 OR NOT extra_lines EQUAL 0 OR NOT err_stripped MATCHES "^sparsa: "
     OR (expected AND NOT err_stripped MATCHES "${expected}"))
    message(SEND_ERROR "sparsa ${args}: exit ${rc} (expected 2${expected_text}), stderr:\n${err}")
    math(EXPR failures "${failures} + 1")
  else()
    message(STATUS "sparsa ${args} -> exit 2: ${err_stripped}")
  endif()
endforeach()
if(failures)
  message(FATAL_ERROR "${failures} bad command lines were not reported as one line with exit status 2")
endif()
