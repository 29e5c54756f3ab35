#!/usr/bin/env bash
# The non-test files of node/, coordinator/ and client-sdk/ over 500 lines (a file's
# `#[cfg(test)] mod tests` at its end, and tests.rs files, are not counted): issue 32's bound,
# which scripts/check.sh enforces.
#
#   scripts/long-files.sh          # lists them; exits 1 if there is one
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
while IFS= read -r file; do
  case "$file" in */tests.rs | */tests/*) continue ;; esac
  lines=$(awk '/^#\[cfg\(test\)\]/ { getline next_line; if (next_line ~ /^mod tests *\{/) exit } { n++ } END { print n + 0 }' "$file")
  if [ "$lines" -gt 500 ]; then
    echo "$lines $file"
    status=1
  fi
done < <(find node coordinator client-sdk -name '*.rs' -not -path '*/target/*' | sort)
exit "$status"
