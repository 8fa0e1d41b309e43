# check_elf.cmake: libebb.so depends on no allocator and stays dlopen-able, read from its ELF.
#   cmake -DREADELF=/usr/bin/readelf -DLIB=/path/libebb.so -P check_elf.cmake
# Fails when libebb
#  - has a NEEDED entry for jemalloc (or tcmalloc/mimalloc): linking it would replace the host
#    program's malloc, and Debian's jemalloc uses initial-exec TLS, which breaks dlopen;
#  - defines malloc/free/calloc/realloc itself (same effect as linking an allocator);
#  - is marked STATIC_TLS (initial-exec TLS of its own: dlopen may fail with "cannot allocate
#    memory in static TLS block").
foreach(v READELF LIB)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check_elf.cmake: pass -D${v}=...")
  endif()
endforeach()

execute_process(COMMAND ${READELF} -d ${LIB} OUTPUT_VARIABLE dyn RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "readelf -d ${LIB} failed (${rc})")
endif()
string(REGEX MATCHALL "\\(NEEDED\\)[^\n]*" needed "${dyn}")
message(STATUS "libebb NEEDED entries:")
foreach(n ${needed})
  message(STATUS "  ${n}")
endforeach()

set(bad "")
if(dyn MATCHES "NEEDED\\)[^\n]*(jemalloc|tcmalloc|mimalloc)")
  list(APPEND bad "a NEEDED entry for ${CMAKE_MATCH_1}")
endif()
if(dyn MATCHES "\\(FLAGS\\)[^\n]*STATIC_TLS")
  list(APPEND bad "the STATIC_TLS flag (initial-exec TLS)")
endif()

# Defined dynamic symbols: "Num: Value Size Type Bind Vis Ndx Name"; Ndx UND means undefined.
execute_process(COMMAND ${READELF} --dyn-syms -W ${LIB} OUTPUT_VARIABLE syms RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "readelf --dyn-syms ${LIB} failed (${rc})")
endif()
foreach(sym malloc free calloc realloc)
  if(syms MATCHES "FUNC +[A-Z]+ +DEFAULT +[0-9]+ ${sym}(@|\n)")
    list(APPEND bad "a definition of ${sym}")
  endif()
endforeach()

if(bad)
  list(JOIN bad "; " why)
  message(FATAL_ERROR "${LIB} has ${why}. libebb must leave its host's malloc alone and stay "
                      "loadable with dlopen (see README, Dependencies).")
endif()
message(STATUS "ok: ${LIB} needs no allocator library, defines no malloc, has no static TLS")
