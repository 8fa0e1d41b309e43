# check_tracer.cmake: runs tracer_probe under libebb-alloc-tracer and compares the trace with what
# the probe did (see tracer_probe.c), then replays it with ebb-alloc-replay.
# cmake -DTRACER=lib.so -DPROBE=prog -DREPLAY=prog -DDIR=scratch_dir -P check_tracer.cmake
file(MAKE_DIRECTORY "${DIR}")

# run_probe(trace_var env...): the probe under the tracer with EBB_ALLOC_TRACE=<DIR>/<name> and the
# given variables; fails unless it exits 0. Sets <trace_var> to the trace ("" when none written).
function(run_probe name)
  set(trace "${DIR}/${name}.trace")
  file(REMOVE "${trace}")
  execute_process(COMMAND ${CMAKE_COMMAND} -E env LD_PRELOAD=${TRACER} EBB_ALLOC_TRACE=${trace} ${ARGN} ${PROBE}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name}: tracer_probe exited '${rc}'\nstdout: ${out}\nstderr: ${err}")
  endif()
  set(${name}_err "${err}" PARENT_SCOPE)
  if(EXISTS "${trace}")
    file(READ "${trace}" text)
    set(${name} "${text}" PARENT_SCOPE)
  else()
    set(${name} "" PARENT_SCOPE)
  endif()
endfunction()

# 1. Every call traced. The single-threaded part line for line: the block below 4 KiB, the one
#    allocated while paused and their frees are absent; the realloc frees its old block; the
#    newline of a mark becomes a space.
run_probe(all)
set(expected [=[
# ebb-alloc-tracer: blocks of 4096 bytes or more from malloc calloc realloc posix_memalign aligned_alloc memalign
# part 1
a 0 8192
a 1 8192
f 0
a 2 1048576
a 3 5000
a 4 8192
a 5 4096
# step 1 with a newline
f 1
f 3
f 4
f 5
# threads
]=])
string(LENGTH "${expected}" n)
string(SUBSTRING "${all}" 0 ${n} head)
if(NOT head STREQUAL expected)
  message(FATAL_ERROR "all: the trace does not start as expected:\n${head}\nexpected:\n${expected}")
endif()
# The threads: every block of 4 KiB or more allocated and freed, 4 x 2000 of each; the children
# (a fork, an exec) add nothing; `# end` is the last line (nothing after ebb_alloc_tracer_stop).
string(FIND "${all}" "# threads\n" t0)
string(FIND "${all}" "# children\n" t1)
math(EXPR len "${t1} - ${t0}")
string(SUBSTRING "${all}" ${t0} ${len} threads)
string(REGEX REPLACE "\n" ";" lines "${threads}")
set(na 0)
set(nf 0)
foreach(l ${lines})
  if(l MATCHES "^a [0-9]+ [0-9]+$")
    math(EXPR na "${na} + 1")
  elseif(l MATCHES "^f [0-9]+$")
    math(EXPR nf "${nf} + 1")
  elseif(NOT l STREQUAL "# threads")
    message(FATAL_ERROR "all: unexpected line in the threads' part: '${l}'")
  endif()
endforeach()
if(NOT na EQUAL 8000 OR NOT nf EQUAL 8000)
  message(FATAL_ERROR "all: the threads' part holds ${na} allocations and ${nf} frees; expected 8000 of each")
endif()
string(SUBSTRING "${all}" ${t1} -1 tail)
if(NOT tail STREQUAL "# children\n# end\n")
  message(FATAL_ERROR "all: after the threads expected '# children' and '# end' only, got:\n${tail}")
endif()
# The trace is one ebb-alloc-replay reads: no free of a block that is not live, no id twice.
execute_process(COMMAND ${REPLAY} ${DIR}/all.trace RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES " allocs=8006 ")
  message(FATAL_ERROR "all: ebb-alloc-replay exited '${rc}' (expected 0 and allocs=8006)\n${out}${err}")
endif()

# 2. Only some calls, and a higher threshold: posix_memalign's 5000 bytes only (memalign's 4096
#    are below 4097); the threads' mallocs are absent.
run_probe(some EBB_ALLOC_TRACE_CALLS=posix_memalign,memalign EBB_ALLOC_TRACE_MIN=4097)
set(expected [=[
# ebb-alloc-tracer: blocks of 4097 bytes or more from posix_memalign memalign
# part 1
a 0 5000
# step 1 with a newline
f 0
# threads
# children
# end
]=])
if(NOT some STREQUAL expected)
  message(FATAL_ERROR "some: got:\n${some}\nexpected:\n${expected}")
endif()

# 3. A call name the tracer does not know: nothing traced (no file), a message, the program runs.
run_probe(bad EBB_ALLOC_TRACE_CALLS=malloc,mallocx)
if(NOT bad STREQUAL "" OR EXISTS "${DIR}/bad.trace")
  message(FATAL_ERROR "bad: a trace was written with an unknown call name:\n${bad}")
endif()
if(NOT bad_err MATCHES "EBB_ALLOC_TRACE_CALLS names a call it does not know; expected a comma-separated list of malloc, calloc")
  message(FATAL_ERROR "bad: no message about EBB_ALLOC_TRACE_CALLS on stderr:\n${bad_err}")
endif()
message(STATUS "ok: the trace matches the probe's calls (8006 allocations, 8000 from 4 threads)")
