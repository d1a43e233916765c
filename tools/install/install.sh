#!/usr/bin/env bash
# Installs what BUILD holds into PREFIX: lib/libmagice.so and bin/magice-trace, with the libraries
# tools/install/libraries marks as carried in lib/magice/, where the library's run path
# ($ORIGIN/magice) and the tool's ($ORIGIN/../lib/magice) find them. Not in lib/ itself: with
# PREFIX=/usr/local that is on the system's search path, and our copies would stand in for the
# machine's own in every program. It only copies, so a machine without a compiler (a GPU node
# with a carried build/, tests/gpu/run.sh) installs the same files `make install` does.
# Usage: tools/install/install.sh BUILD PREFIX    (DESTDIR, if set, is put in front of PREFIX)
set -eu
[ $# = 2 ] || { echo "usage: $0 BUILD PREFIX" >&2; exit 2; }
build=$1
dest=${DESTDIR:-}$2
list="$(dirname "$0")/libraries"
carried=$(awk '$1 == "carried" {print $2}' "$list")
[ -n "$carried" ] || { echo "install: no carried library in $list" >&2; exit 1; }
for f in libmagice.so magice-trace $carried; do
  [ -f "$build/$f" ] || { echo "install: $build/$f is missing (run make first)" >&2; exit 1; }
done
install -d "$dest/lib/magice" "$dest/bin"
install -m 0755 "$build/libmagice.so" "$dest/lib/libmagice.so"
install -m 0755 "$build/magice-trace" "$dest/bin/magice-trace"
for l in $carried; do install -m 0644 "$build/$l" "$dest/lib/magice/$l"; done
echo "installed in $dest: lib/libmagice.so bin/magice-trace;" \
  "in lib/magice/: ${carried//$'\n'/ }"
