# cmake -DASM=<assembly> -P check_prefetch.cmake
# The decoding step's software prefetch is in the generated code: every
# function of the step that GCC or Clang kept out of line (decode_states,
# partial_dots_gn, axpy_keys_gn; ELF assembly, where .type and .size bound a
# function; names mangled _ZN..., so not the lambdas local to them, _ZZN...)
# holds a prefetchnta. Where none was kept apart, the whole file
# must hold one. See prefetch_emitted.cpp.
file(READ "${ASM}" _asm)
string(REGEX MATCHALL "\\.type[ \t]+_ZN[A-Za-z0-9_.$]*(decode_states|partial_dots_gn|axpy_keys_gn)[A-Za-z0-9_.$]*, *@function"
       _types "${_asm}")
set(_checked 0)
foreach(_type IN LISTS _types)
  string(REGEX REPLACE "^\\.type[ \t]+([^,]*),.*$" "\\1" _fn "${_type}")
  string(FIND "${_asm}" "\n${_fn}:" _begin)
  string(FIND "${_asm}" ".size\t${_fn}," _end)
  if(_begin LESS 0 OR _end LESS _begin)
    message(FATAL_ERROR "${ASM}: cannot find the body of ${_fn}")
  endif()
  math(EXPR _len "${_end} - ${_begin}")
  string(SUBSTRING "${_asm}" ${_begin} ${_len} _body)
  string(REGEX MATCHALL "[ \t]prefetchnta[ \t]" _found "${_body}")
  list(LENGTH _found _n)
  if(_n EQUAL 0)
    message(FATAL_ERROR "${ASM}: ${_fn} has no prefetchnta: the compiler dropped the decoding "
                        "step's prefetch (see tests/prefetch_emitted.cpp)")
  endif()
  message(STATUS "${_fn}: ${_n} x prefetchnta")
  math(EXPR _checked "${_checked} + 1")
endforeach()
if(_checked EQUAL 0)
  string(REGEX MATCHALL "[ \t]prefetchnta[ \t]" _found "${_asm}")
  list(LENGTH _found _n)
  if(_n EQUAL 0)
    message(FATAL_ERROR "${ASM}: no prefetchnta: the compiler dropped the decoding step's prefetch")
  endif()
  message(STATUS "${ASM}: no step function kept apart; ${_n} x prefetchnta in all")
endif()
