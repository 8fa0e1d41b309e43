#!/usr/bin/env bash
# readme_example.sh BUILD_DIR WORK_DIR README: the README's C example (its first ```c block), built
# against ebb installed from BUILD_DIR into WORK_DIR/prefix (headers and libebb, through
# pkg-config, as a user's program is) and run: it must exit 0 and its loss must go down.
set -euo pipefail
build="$1"
work="$2"
readme="$3"
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
awk '/^```c$/ { inside = 1; next } /^```$/ { if (inside) exit } inside' "$readme" > "$work/example.c"
if [ ! -s "$work/example.c" ]; then
  echo "no \`\`\`c block in $readme"
  exit 1
fi
pc="$(find "$work/prefix" -name ebb.pc)"
export PKG_CONFIG_PATH
PKG_CONFIG_PATH="$(dirname "$pc")"
libdir="$(pkg-config --variable=libdir ebb)"
# shellcheck disable=SC2046
cc -std=c11 -Wall -Wextra -Werror "$work/example.c" -o "$work/example" $(pkg-config --cflags --libs ebb) -Wl,-rpath,"$libdir"
"$work/example" | tee "$work/out.txt"
first="$(awk '/^step 0 loss/ { print $4 }' "$work/out.txt")"
last="$(awk '/^step [0-9]+ loss/ { v = $4 } END { print v }' "$work/out.txt")"
if [ -z "$first" ] || [ -z "$last" ] || ! awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }'; then
  echo "the loss did not go down: first $first, last $last"
  exit 1
fi
