# HSDP_TORCH_PYTHON: a python3 that can `import torch` (Debian's python3-torch), for the tests and
# benchmarks that script a model in Python. Empty when there is none; those tests then skip.
# /usr/bin/python3 first: a pyenv or venv python3 earlier on PATH usually lacks the system torch.
if(NOT DEFINED HSDP_TORCH_PYTHON)
  set(_hsdp_torch_python "")
  find_program(_hsdp_path_python3 python3)
  foreach(candidate /usr/bin/python3 "${_hsdp_path_python3}")
    if(candidate AND EXISTS "${candidate}" AND NOT _hsdp_torch_python)
      execute_process(COMMAND "${candidate}" -c "import torch"
        RESULT_VARIABLE _hsdp_rc OUTPUT_QUIET ERROR_QUIET TIMEOUT 120)
      if(_hsdp_rc EQUAL 0)
        set(_hsdp_torch_python "${candidate}")
      endif()
    endif()
  endforeach()
  set(HSDP_TORCH_PYTHON "${_hsdp_torch_python}" CACHE FILEPATH
    "python3 with torch, for tests that script models (empty: none)")
  if(HSDP_TORCH_PYTHON)
    message(STATUS "python3 with torch: ${HSDP_TORCH_PYTHON}")
  else()
    message(STATUS "python3 with torch: not found (TorchScript tests will skip)")
  endif()
endif()
