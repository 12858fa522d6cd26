# GPU backends of sparsa: CUDA (nvcc, sm_80 + sm_90a) and HIP (hipcc, gfx90a + gfx940) from one source tree,
# backends/gpu/ (engine/, kernels/, policies/, runtime/: docs/gpu.md has the file map). Included by the top-level CMakeLists.txt after the `sparsa` target exists; appends sources and
# definitions to it and adds the GPU tests (tests/gpu) and nothing else.
#
#   SPARSA_CUDA  (default ON when nvcc is found)  -> SPARSA_WITH_CUDA, cudart linked statically so libsparsa still
#                                                    loads on a machine without a driver
#   SPARSA_HIP   (default OFF, opt-in)           -> SPARSA_WITH_HIP, the same .cu files compiled by hipcc as HIP
#                                                    (-x hip)
include_guard(GLOBAL)
include(CheckLanguage)

# The one list of GPU sources, generated: every .cu under backends/gpu (any folder depth), for CUDA and for HIP alike.
set(SPARSA_GPU_DIR ${PROJECT_SOURCE_DIR}/backends/gpu)
file(GLOB_RECURSE SPARSA_GPU_SOURCES CONFIGURE_DEPENDS ${SPARSA_GPU_DIR}/*.cu)
list(SORT SPARSA_GPU_SOURCES)

# ---- CUDA ----
# sm_80 (A100 and later) + sm_90a (Hopper, wgmma-capable). -DCMAKE_CUDA_ARCHITECTURES=... overrides. The default
# goes into the cache before enable_language(CUDA), which would otherwise cache nvcc's own default (sm_75 with
# nvcc 13) and hand it to every later reconfigure.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "80;90a" CACHE STRING "CUDA architectures of the CUDA backend")
endif()
set(SPARSA_CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
check_language(CUDA)
set(_sparsa_cuda_default OFF)
if(CMAKE_CUDA_COMPILER)
  set(_sparsa_cuda_default ON)
endif()
option(SPARSA_CUDA "Build the CUDA backend" ${_sparsa_cuda_default})

if(SPARSA_CUDA AND NOT CMAKE_CUDA_COMPILER)
  set(SPARSA_CUDA_OFF_REASON "SPARSA_CUDA=ON but no nvcc was found")
  message(STATUS "sparsa: CUDA backend: OFF (SPARSA_CUDA=ON but no nvcc was found)")
  set(SPARSA_CUDA OFF)
elseif(NOT SPARSA_CUDA)
  if(CMAKE_CUDA_COMPILER)
    message(STATUS "sparsa: CUDA backend: OFF (SPARSA_CUDA=OFF)")
  else()
    set(SPARSA_CUDA_OFF_REASON "no nvcc found")
    message(STATUS "sparsa: CUDA backend: OFF (no nvcc found)")
  endif()
else()
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  target_sources(sparsa PRIVATE ${SPARSA_GPU_SOURCES})
  target_compile_definitions(sparsa PRIVATE SPARSA_WITH_CUDA)
  target_compile_options(sparsa PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
  set_target_properties(sparsa PROPERTIES CUDA_ARCHITECTURES "${SPARSA_CUDA_ARCHITECTURES}" CUDA_RUNTIME_LIBRARY Static CUDA_VISIBILITY_PRESET hidden
                                          CUDA_SEPARABLE_COMPILATION OFF)
  message(STATUS "sparsa: CUDA backend: ON (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures "
                 "${SPARSA_CUDA_ARCHITECTURES})")
endif()

# ---- HIP (hipcc through custom commands: CMake 3.25's HIP language does not find Debian's ROCm layout) ----
find_program(SPARSA_HIPCC hipcc)
# Opt-in: hipcc builds are slow and no AMD device is available to test on; -DSPARSA_HIP=ON turns it on.
option(SPARSA_HIP "Build the HIP backend (hipcc)" OFF)
set(SPARSA_HIP_ARCHITECTURES "gfx90a;gfx940" CACHE STRING "AMD GPU architectures of the HIP backend")

if(SPARSA_HIP AND NOT SPARSA_HIPCC)
  message(STATUS "sparsa: HIP backend: OFF (SPARSA_HIP=ON but no hipcc was found)")
  set(SPARSA_HIP OFF)
elseif(NOT SPARSA_HIP)
  message(STATUS "sparsa: HIP backend: OFF (SPARSA_HIP=OFF; pass -DSPARSA_HIP=ON to build it with hipcc)")
else()
  find_library(SPARSA_AMDHIP64 amdhip64 PATHS /opt/rocm/lib /usr/lib/x86_64-linux-gnu)
  if(NOT SPARSA_AMDHIP64)
    message(STATUS "sparsa: HIP backend: OFF (hipcc found but libamdhip64 is missing)")
    set(SPARSA_HIP OFF)
  endif()
endif()
if(SPARSA_HIP)
  set(_hip_flags -std=c++17 -O3 -fPIC -fvisibility=hidden -Wall -Wextra -DSPARSA_WITH_HIP -DSPARSA_BUILDING_LIBRARY
                 -I${PROJECT_SOURCE_DIR}/include)
  foreach(_arch IN LISTS SPARSA_HIP_ARCHITECTURES)
    list(APPEND _hip_flags --offload-arch=${_arch})
  endforeach()
  # Every header a HIP object may include (any depth under backends/gpu), so that editing one recompiles.
  file(GLOB_RECURSE _hip_headers CONFIGURE_DEPENDS ${SPARSA_GPU_DIR}/*.h ${SPARSA_GPU_DIR}/*.cuh)
  file(GLOB _hip_core_headers CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/*.h ${PROJECT_SOURCE_DIR}/src/common/*.h
       ${PROJECT_SOURCE_DIR}/include/sparsa/sparsa.h)
  list(APPEND _hip_headers ${_hip_core_headers})
  set(_hip_objects)
  foreach(_source IN LISTS SPARSA_GPU_SOURCES)
    # Objects mirror the source folders (sparsa_hip/kernels/forward_mma.o), so equal names in two folders never
    # collide.
    file(RELATIVE_PATH _relative ${SPARSA_GPU_DIR} ${_source})
    string(REGEX REPLACE "\\.cu$" ".o" _relative_object ${_relative})
    set(_object ${CMAKE_CURRENT_BINARY_DIR}/sparsa_hip/${_relative_object})
    get_filename_component(_object_dir ${_object} DIRECTORY)
    add_custom_command(
      OUTPUT ${_object}
      COMMAND ${CMAKE_COMMAND} -E make_directory ${_object_dir}
      COMMAND ${SPARSA_HIPCC} ${_hip_flags} -x hip -c ${_source} -o ${_object}
      DEPENDS ${_source} ${_hip_headers}
      COMMENT "hipcc ${_relative}"
      VERBATIM)
    list(APPEND _hip_objects ${_object})
  endforeach()
  set_source_files_properties(${_hip_objects} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
  target_sources(sparsa PRIVATE ${_hip_objects})
  target_compile_definitions(sparsa PRIVATE SPARSA_WITH_HIP)
  target_link_libraries(sparsa PRIVATE ${SPARSA_AMDHIP64})
  message(STATUS "sparsa: HIP backend: ON (hipcc ${SPARSA_HIPCC}, architectures ${SPARSA_HIP_ARCHITECTURES})")
endif()

# ---- GPU tests ----
if(SPARSA_BUILD_TESTS AND (SPARSA_CUDA OR SPARSA_HIP) AND EXISTS ${PROJECT_SOURCE_DIR}/tests/gpu/CMakeLists.txt)
  enable_testing()  # this file is included before the top level enables testing; ctest must see tests/gpu
  add_subdirectory(${PROJECT_SOURCE_DIR}/tests/gpu ${CMAKE_CURRENT_BINARY_DIR}/tests/gpu)
endif()
