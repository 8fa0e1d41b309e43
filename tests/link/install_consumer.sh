#!/usr/bin/env bash
# install_consumer.sh BUILD_DIR WORK_DIR: installs ebb from BUILD_DIR into WORK_DIR/prefix, then
# builds and runs a small C program against it twice: through the CMake package
# (find_package(ebb), target ebb::ebb) and through pkg-config (ebb.pc). Both must find the
# emulated driver installed next to libebb and print the driver they got.
set -euo pipefail
build="$1"
work="$2"
rm -rf "$work"
mkdir -p "$work/src"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
cat > "$work/src/main.c" <<'C'
#include <ebb/ebb.h>
#include <stdio.h>
int main(void) {
  if (ebb_init() != EBB_OK) {
    printf("ebb_init failed: %s\n", ebb_last_error());
    return 1;
  }
  ebb_driver_info info;
  if (ebb_driver_get_info(&info) != EBB_OK) return 1;
  printf("consumer: driver %s, %d device(s)\n", info.name, info.device_count);
  return ebb_shutdown() == EBB_OK ? 0 : 1;
}
C
cat > "$work/src/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.25)
project(ebb_consumer C)
find_package(ebb REQUIRED)
add_executable(consumer main.c)
target_link_libraries(consumer PRIVATE ebb::ebb)
CM
cmake -S "$work/src" -B "$work/b" -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log"
cmake --build "$work/b" > "$work/build.log"
"$work/b/consumer"
pc="$(find "$work/prefix" -name ebb.pc)"
export PKG_CONFIG_PATH
PKG_CONFIG_PATH="$(dirname "$pc")"
libdir="$(pkg-config --variable=libdir ebb)"
# shellcheck disable=SC2046
cc "$work/src/main.c" -o "$work/consumer_pc" $(pkg-config --cflags --libs ebb) -Wl,-rpath,"$libdir"
"$work/consumer_pc"
