# Cross-compiling for aarch64 Linux with Debian's cross toolchain (apt-get install g++-aarch64-linux-gnu qemu-user).
# The target's libc and libstdc++ live in /usr/aarch64-linux-gnu; tests run under qemu-user through
# CMAKE_CROSSCOMPILING_EMULATOR, which ctest and gtest_discover_tests put in front of every test executable.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(SPARSA_AARCH64_TRIPLE aarch64-linux-gnu)
set(SPARSA_AARCH64_SYSROOT /usr/${SPARSA_AARCH64_TRIPLE})
set(CMAKE_C_COMPILER ${SPARSA_AARCH64_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${SPARSA_AARCH64_TRIPLE}-g++)

# Host programs (cmake, python, nm of the host) from the host; libraries, headers and packages only from the target.
set(CMAKE_FIND_ROOT_PATH ${SPARSA_AARCH64_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# The ABI symbol test reads the library with the target's nm.
set(SPARSA_NM ${SPARSA_AARCH64_TRIPLE}-nm CACHE FILEPATH "nm that reads the target's ELF files")

find_program(SPARSA_QEMU_AARCH64 qemu-aarch64 qemu-aarch64-static)
if(SPARSA_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${SPARSA_QEMU_AARCH64} -L ${SPARSA_AARCH64_SYSROOT})
endif()
