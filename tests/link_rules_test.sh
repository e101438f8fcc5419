#!/usr/bin/env bash
# cmake/LinkRules.cmake on small projects of its own: a daemon that links (through another
# library) one that builds a planning-engine source, and a planner that links one that builds a
# node-protocol source, stop the configuration naming the program, the library and the file;
# programs that keep to the rules configure.
# Usage: tests/link_rules_test.sh SOURCE_DIR
set -euo pipefail
src=$(cd "${1:?usage: link_rules_test.sh SOURCE_DIR}" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# project NAME ENGINE_SOURCES PROTOCOL_SOURCES DAEMON_LINKS PLANNER_LINKS
project() {
  local dir=$work/$1
  mkdir -p "$dir"
  for f in $2 $3 main.cc; do echo "int f_${f%%.*}() { return 0; }" > "$dir/$f"; done
  echo 'int main() { return 0; }' > "$dir/main.cc"
  cat > "$dir/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.16)
project(link_rules_$1 LANGUAGES CXX)
add_library(ragshard_engine STATIC $2)
add_library(ragshard_protocol STATIC $3)
add_library(middle STATIC main.cc)
target_link_libraries(middle PUBLIC $4)
add_executable(ragshardd main.cc)
target_link_libraries(ragshardd PRIVATE middle)
add_executable(ragshard-planner main.cc)
target_link_libraries(ragshard-planner PRIVATE $5)
include($src/cmake/LinkRules.cmake)
CMAKE
  cmake -S "$dir" -B "$dir/build" > "$dir/log" 2>&1
}

fail=0
expect_refused() {  # NAME WORDS...
  local name=$1
  shift
  if project "$name" "${@:1:4}"; then
    echo "FAIL: $name configured; LinkRules should have stopped it"
    fail=1
    return
  fi
  for word in "${@:5}"; do
    if ! grep -q -- "$word" "$work/$name/log"; then
      echo "FAIL: $name: the error does not name '$word':"
      cat "$work/$name/log"
      fail=1
    fi
  done
}

expect_refused daemon_links_engine "planner.cc validator.cc" "command_queue.cc" \
  ragshard_engine ragshard_engine "ragshardd links ragshard_engine" "planner.cc"
expect_refused planner_links_protocol "planner.cc" "fd_passing.cc" ragshard_protocol \
  "ragshard_engine ragshard_protocol" "ragshard-planner links ragshard_protocol" "fd_passing.cc"
if ! project allowed "planner.cc models.cc" "command_queue.cc unsharded_view.cc" \
  ragshard_protocol ragshard_engine; then
  echo "FAIL: programs that keep to the rules were refused:"
  cat "$work/allowed/log"
  fail=1
fi
[[ $fail == 0 ]] && echo "link rules: 2 violations refused by name, 1 layout allowed"
exit $fail
