# Sourced by scripts/build.sh and scripts/test.sh (with ROOT set to the clone): compile through ccache when it is
# installed (setup.sh installs it), with the cache outside the clone, like the venvs, so that a fresh clone on this
# machine (CI's) reuses the objects of earlier builds: a cold developer build takes about 150 s on 2 cores, a warm
# one about 30. Paths under the clone are hashed relative to it (CCACHE_BASEDIR) and the build directory is left out
# (CCACHE_NOHASHDIR), so clones at different paths share hits for build directories inside them (one outside, as
# test_gpu_check's, hits from the same clone path only); a compiler is known by its content, so a wrapper script made
# afresh by a test is still the same compiler. CMake reads the launcher variables on a build directory's
# first configure only. T3D_CCACHE=0 turns this off; a launcher or cache directory already set is kept.
if [ "${T3D_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
  export CCACHE_DIR="${CCACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/t3d/ccache}"
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}" CCACHE_NOHASHDIR=1 CCACHE_COMPILERCHECK=content
  export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-3G}"
  for lang in C CXX CUDA; do
    v="CMAKE_${lang}_COMPILER_LAUNCHER"
    [ -n "${!v:-}" ] || export "$v=ccache"
  done
  unset lang v
fi
