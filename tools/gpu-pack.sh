#!/usr/bin/env bash
# tools/gpu-pack.sh [builddir] [outdir]: a build of ebb that a GPU machine without ebb's
# dependencies can run, in one compressed file, for tools/gpu-check.sh to use as it is.
#
# Why: a lent GPU machine has the CUDA toolkit and CMake but not hwloc, OpenBLAS, SLEEF or
# Catch2, and cannot fetch them; a full build directory (debug info, ~1.5 GB) is too large to
# send. This script
# 1. configures builddir (default build/gpu: RelWithDebInfo like the default preset, with MPI
#    unless GPU_PACK_MPI=0) and builds it;
# 2. copies into a staging tree of the same layout the test programs, ebb-info, ebb-train, the
#    benchmarks that link only libebb and its dependencies (not the libtorch or oneDNN peers),
#    libebb and the emulated driver, every CTestTestfile.cmake, and strips the programs;
# 3. adds deplib/: the shared libraries those programs need that are not the C and C++ runtime
#    (hwloc, OpenBLAS and its Fortran runtime, SLEEF, jemalloc...);
# 4. writes PACKED (the source and build paths, the commit, whether it has MPI) and packs it all into
#    outdir/ebb-gpu.tar.xz (default outdir gpu-pack/, which git ignores), printing its size.
# On the GPU machine: tar xJf gpu-pack/ebb-gpu.tar.xz && tools/gpu-check.sh <builddir> (the
# builddir recorded in PACKED, relative to the repository; gpu-check.sh sees PACKED, skips the
# build, sets LD_LIBRARY_PATH and links the recorded source path to the repository when the two
# differ, since CTest files and run paths name absolute paths).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
B=${1:-build/gpu}
O=${2:-gpu-pack}
[[ $B == /* ]] && { echo "gpu-pack: give builddir relative to the repository ($B)"; exit 1; }
[[ $O == /* ]] || O=$root/$O
# MPI: on unless GPU_PACK_MPI=0. The lent GPU machines have Open MPI 4.1 (libmpi.so.40, the ABI of
# Debian's 4.1), so the build's MPI libraries are not packed: the machine's run them.
mpi=${GPU_PACK_MPI:-1}
no_mpi=$([[ $mpi == 0 ]] && echo ON || echo OFF)
if [[ ! -f $B/CMakeCache.txt ]]; then
  cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_DISABLE_FIND_PACKAGE_MPI=$no_mpi
else
  cmake -S . -B "$B" -DCMAKE_DISABLE_FIND_PACKAGE_MPI=$no_mpi >/dev/null
fi
cmake --build "$B" -j "$(nproc)"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
S=$stage/$B
mkdir -p "$S/bin" "$S/lib" "$S/deplib"
peers='ebb-bench-engine-torch|ebb-bench-ops_peer|ebb-bench-optim|ebb-bench-dnnl'
for f in "$B"/bin/*; do
  [[ -f $f ]] || continue
  name=${f##*/}
  [[ $name =~ ^($peers)$ ]] && continue
  cp -p "$f" "$S/bin/"
  file -b "$S/bin/$name" | grep -q ELF && strip --strip-debug "$S/bin/$name"
done
cp -P "$B"/lib/*.so* "$S/lib/"
for f in "$S"/lib/*.so*; do [[ -L $f ]] || strip --strip-debug "$f"; done
# CTest's files: the directories' CTestTestfile.cmake and the test lists Catch2's discovery wrote.
(cd "$B" && find . -name CTestTestfile.cmake -o -name "*_include-*.cmake" -o -name "*_tests-*.cmake") |
while read -r t; do
  mkdir -p "$S/${t%/*}"
  cp "$B/$t" "$S/$t"
done
cp "$B/CMakeCache.txt" "$S/CMakeCache.txt.packed" # for reading only: not a build tree there

# The libraries every ELF needs, less the C and C++ runtime the GPU machine has (newer) and, in a
# build with MPI, Open MPI and what it loads (hwloc among them: one copy in the process, the
# machine's, which keeps its soname).
for f in "$S"/bin/* "$S"/lib/*.so*; do
  file -b "$f" | grep -q ELF && ldd "$f" 2>/dev/null | awk '$3 ~ /^\// {print $3}'
done | sort -u | while read -r l; do
  case ${l##*/} in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libstdc++.so*|libgcc_s.so*|ld-linux*|libebb*) ;;
    libmpi*|libopen-rte*|libopen-pal*|libevent*|libpmix*|libhwloc*|libudev*|libz.so*|libfabric*|libuc[pst]*|libibverbs*|librdmacm*|libpsm*|libnl-*|libltdl*|libmunge*)
      [[ $mpi == 0 ]] && cp -L "$l" "$S/deplib/" ;;
    *) cp -L "$l" "$S/deplib/" ;;
  esac
done

{
  echo "source=$root"
  echo "builddir=$B"
  echo "commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo +changes)"
  echo "packed=$(date -u +%Y-%m-%dT%H:%MZ)"
  # a build without MPI (GPU_PACK_MPI=0) defines dist.mpi_missing in its suite
  echo "mpi=$(grep -qs 'dist\.mpi_missing' "$B/tests/dist/CTestTestfile.cmake" && echo off || echo on)"
  # programs the tests run by absolute path, which the GPU machine may have elsewhere
  echo "programs=$(grep -hE '^(CMAKE_COMMAND|EBB_PYTHON3[A-Z_]*|EBB_CHROMIUM|MPIEXEC_EXECUTABLE):' "$B/CMakeCache.txt" | cut -d= -f2- | sort -u | tr '\n' ' ')"
} >"$S/PACKED"
mkdir -p "$O"
tar -C "$stage" -cf - "$B" | xz -T0 -9e --lzma2=dict=192MiB >"$O/ebb-gpu.tar.xz"
echo "gpu-pack: $O/ebb-gpu.tar.xz $(du -h "$O/ebb-gpu.tar.xz" | cut -f1) ($(find "$S/bin" -type f | wc -l) programs, deplib: $(ls "$S/deplib" | tr '\n' ' '))"
