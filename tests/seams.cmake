# ctest unit/seams: the test seams (tally__test_hook, TALLY_TEST_BATCH_STALL,
# TALLY_HTTP_LOSE_EVERY, tally__test_rseq_spin) are compiled in only with
# TALLY_TEST_SEAMS.
#   cmake -DNM=nm -DSRC=dir -DSOURCES=a.c;b.c -DWITHOUT=o|o -DWITH=o|o -P seams.cmake
# WITHOUT: SOURCES compiled without TALLY_TEST_SEAMS; WITH: the library's
# objects, compiled with it.
cmake_minimum_required(VERSION 3.18) # IN_LIST
set(seam_pattern "tally__test_hook|TALLY_TEST_BATCH_STALL|TALLY_HTTP_LOSE_EVERY|tally__test_rseq_spin")

# what one object holds of the seams: its symbols and its strings
function(seams_in obj out)
  execute_process(COMMAND ${NM} ${obj} OUTPUT_VARIABLE syms RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} ${obj} failed")
  endif()
  file(STRINGS ${obj} strs REGEX "${seam_pattern}")
  string(REGEX MATCHALL "${seam_pattern}" found "${syms} ${strs}")
  list(REMOVE_DUPLICATES found)
  set(${out} "${found}" PARENT_SCOPE)
endfunction()

# every source with a seam is one this test compiles without them
file(GLOB_RECURSE all RELATIVE ${SRC} ${SRC}/src/*.c)
foreach(f ${all})
  file(STRINGS ${SRC}/${f} hits REGEX "TALLY__TEST_HOOK|TALLY_TEST_SEAMS|getenv\\(\"TALLY_TEST")
  if(hits AND NOT f IN_LIST SOURCES)
    message(FATAL_ERROR "${f} has a test seam: add it to TALLY_SEAM_SOURCES in tests/CMakeLists.txt")
  endif()
endforeach()

string(REPLACE "|" ";" without "${WITHOUT}")
list(LENGTH without n)
list(LENGTH SOURCES m)
if(NOT n EQUAL m)
  message(FATAL_ERROR "expected ${m} objects compiled without the seams, got ${n}")
endif()
foreach(obj ${without})
  seams_in(${obj} found)
  if(found)
    message(FATAL_ERROR "${obj}, compiled without TALLY_TEST_SEAMS, still has: ${found}")
  endif()
endforeach()

# the check sees the seams where they are compiled in
string(REPLACE "|" ";" with "${WITH}")
set(seen)
foreach(obj ${with})
  seams_in(${obj} found)
  list(APPEND seen ${found})
endforeach()
foreach(want tally__test_hook TALLY_TEST_BATCH_STALL)
  if(NOT want IN_LIST seen)
    message(FATAL_ERROR "the library built for the tests has no ${want}: is the check blind?")
  endif()
endforeach()
message(STATUS "${n} sources compiled without the test seams keep none")
