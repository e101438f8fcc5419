# Decides whether the GPU targets are built.
#   RAGSHARD_WITH_CUDA=OFF   never.
#   RAGSHARD_WITH_CUDA=AUTO  when nvcc and NCCL's header are found (NCCL itself is opened at
#                            run time: server/daemon/cuda/nccl_api.h).
#   RAGSHARD_WITH_CUDA=ON    required: configuring fails when either is missing.
# Sets RAGSHARD_HAVE_CUDA and, when true, the imported target ragshard::nccl.
set(RAGSHARD_HAVE_CUDA OFF)
if(NOT RAGSHARD_WITH_CUDA STREQUAL "OFF")
  if(NOT RAGSHARD_WITH_CUDA MATCHES "^(AUTO|ON)$")
    message(FATAL_ERROR "RAGSHARD_WITH_CUDA must be AUTO, ON or OFF, got '${RAGSHARD_WITH_CUDA}'")
  endif()
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  find_package(CUDAToolkit QUIET)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND AND NCCL_INCLUDE_DIR)
    # "native" needs a GPU at configure time; name the architectures explicitly.
    if(NOT CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    # NCCL's header only: the library is opened at run time (server/daemon/cuda/nccl_api.h).
    add_library(ragshard_nccl_imported INTERFACE)
    target_include_directories(ragshard_nccl_imported INTERFACE ${NCCL_INCLUDE_DIR})
    add_library(ragshard::nccl ALIAS ragshard_nccl_imported)
    set(RAGSHARD_HAVE_CUDA ON)
    message(STATUS "ragshard: GPU targets enabled (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, nccl.h in ${NCCL_INCLUDE_DIR})")
  elseif(RAGSHARD_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "RAGSHARD_WITH_CUDA=ON but the CUDA compiler, toolkit or nccl.h was not found "
                        "(nvcc: '${CMAKE_CUDA_COMPILER}', toolkit: ${CUDAToolkit_FOUND}, "
                        "nccl.h: '${NCCL_INCLUDE_DIR}')")
  else()
    message(STATUS "ragshard: GPU targets disabled (CUDA or NCCL not found)")
  endif()
endif()
