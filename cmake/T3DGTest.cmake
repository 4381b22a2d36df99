# GoogleTest for the C and kernel test suites: the installed package (Debian: libgtest-dev) when find_package(GTest)
# finds one, otherwise GoogleTest built from the sources in T3D_GTEST_SOURCE_DIR (Debian's googletest package puts
# them in /usr/src/googletest; scripts/gpu-check.sh carries a copy of them to machines that have no GoogleTest).
# Either way the targets GTest::gtest and GTest::gtest_main exist afterwards. Included by tests/c and tests/kernels;
# the first one to build from source defines the targets for the whole project (they are global).
set(T3D_GTEST_SOURCE_DIR "" CACHE PATH "GoogleTest sources, built when find_package(GTest) finds no GoogleTest")
if(NOT TARGET GTest::gtest_main)
  find_package(GTest QUIET)
  if(NOT GTest_FOUND)
    if(NOT T3D_GTEST_SOURCE_DIR OR NOT EXISTS "${T3D_GTEST_SOURCE_DIR}/CMakeLists.txt")
      message(FATAL_ERROR "t3d: GoogleTest not found. Install it (Debian: libgtest-dev), point T3D_GTEST_SOURCE_DIR at "
              "its sources (Debian's googletest package: /usr/src/googletest), or configure with "
              "-DT3D_BUILD_TESTS=OFF. T3D_GTEST_SOURCE_DIR='${T3D_GTEST_SOURCE_DIR}'")
    endif()
    message(STATUS "t3d: building GoogleTest from ${T3D_GTEST_SOURCE_DIR}")
    set(BUILD_GMOCK OFF CACHE BOOL "t3d: GoogleTest without gMock" FORCE)
    set(INSTALL_GTEST OFF CACHE BOOL "t3d: GoogleTest is not installed with t3d" FORCE)
    # Static, whatever BUILD_SHARED_LIBS says: the test binaries then run without an rpath to it.
    set(_t3d_shared_libs ${BUILD_SHARED_LIBS})
    set(BUILD_SHARED_LIBS OFF)
    add_subdirectory("${T3D_GTEST_SOURCE_DIR}" "${CMAKE_BINARY_DIR}/_deps/googletest" EXCLUDE_FROM_ALL)
    set(BUILD_SHARED_LIBS ${_t3d_shared_libs})
    if(NOT TARGET GTest::gtest)
      add_library(GTest::gtest ALIAS gtest)
    endif()
    if(NOT TARGET GTest::gtest_main)
      add_library(GTest::gtest_main ALIAS gtest_main)
    endif()
  endif()
endif()
