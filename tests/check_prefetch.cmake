# cmake -DASM=<assembly> -P check_prefetch.cmake
# The decoding step's software prefetch is in the generated code: every
# function of the step that GCC or Clang kept out of line (decode_states,
# partial_dots_gn, axpy_keys_gn; ELF assembly, where .type and .size bound a
# function; names mangled _ZN..., so not the lambdas local to them, _ZZN...)
# holds both of its hints, prefetchnta (taken on AMD processors) and
# prefetcht1 (elsewhere; detail::kDecodePrefetchNta). Where none was kept
# apart, the whole file must hold both. See prefetch_emitted.cpp.
file(READ "${ASM}" _asm)
string(REGEX MATCHALL "\\.type[ \t]+_ZN[A-Za-z0-9_.$]*(decode_states|partial_dots_gn|axpy_keys_gn)[A-Za-z0-9_.$]*, *@function"
       _types "${_asm}")
set(_bodies)
foreach(_type IN LISTS _types)
  string(REGEX REPLACE "^\\.type[ \t]+([^,]*),.*$" "\\1" _fn "${_type}")
  string(FIND "${_asm}" "\n${_fn}:" _begin)
  string(FIND "${_asm}" ".size\t${_fn}," _end)
  if(_begin LESS 0 OR _end LESS _begin)
    message(FATAL_ERROR "${ASM}: cannot find the body of ${_fn}")
  endif()
  math(EXPR _len "${_end} - ${_begin}")
  string(SUBSTRING "${_asm}" ${_begin} ${_len} _body)
  foreach(_insn prefetchnta prefetcht1)
    string(REGEX MATCHALL "[ \t]${_insn}[ \t]" _found "${_body}")
    list(LENGTH _found _n)
    if(_n EQUAL 0)
      message(FATAL_ERROR "${ASM}: ${_fn} has no ${_insn}: the compiler dropped the decoding "
                          "step's prefetch (see tests/prefetch_emitted.cpp)")
    endif()
    message(STATUS "${_fn}: ${_n} x ${_insn}")
  endforeach()
  list(APPEND _bodies "${_fn}")
endforeach()
if(NOT _bodies)
  foreach(_insn prefetchnta prefetcht1)
    string(REGEX MATCHALL "[ \t]${_insn}[ \t]" _found "${_asm}")
    list(LENGTH _found _n)
    if(_n EQUAL 0)
      message(FATAL_ERROR "${ASM}: no ${_insn}: the compiler dropped the decoding step's prefetch")
    endif()
    message(STATUS "${ASM}: no step function kept apart; ${_n} x ${_insn} in all")
  endforeach()
endif()
