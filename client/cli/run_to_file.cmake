# cmake -DCMD="prog|arg|..." -DOUT=file [-DIN=file] -P run_to_file.cmake
# Runs CMD (arguments separated by '|') with stdout to OUT (stdin from IN);
# fails the build step, showing stderr, when CMD fails.
string(REPLACE "|" ";" _cmd "${CMD}")
# In a sanitizer build (make test-sanitize) a leak report at exit would fail
# the build step; the programs only print text here.
set(ENV{ASAN_OPTIONS} "detect_leaks=0")
set(_in)
if(IN)
  set(_in INPUT_FILE ${IN})
endif()
execute_process(COMMAND ${_cmd} ${_in} OUTPUT_FILE ${OUT}.tmp RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  file(REMOVE ${OUT}.tmp)
  message(FATAL_ERROR "${CMD} failed (${_rc})")
endif()
file(RENAME ${OUT}.tmp ${OUT})
