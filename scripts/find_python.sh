#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter (jax 0.11 needs it), or fail with a hint.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for cand in "${PYTHON:-}" python3.12 python3.13 python3; do
  [ -n "$cand" ] || continue
  if command -v "$cand" >/dev/null 2>&1 && ok "$cand"; then command -v "$cand"; exit 0; fi
done
# pyenv keeps interpreters that are not on PATH until selected.
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -V); do
    p="$(pyenv root)/versions/$v/bin/python3"
    if ok "$p"; then echo "$p"; exit 0; fi
  done
fi
for p in "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3; do
  if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
done
echo "error: jaxinfer needs Python >= 3.12 (jax 0.11); none found. Install one, or set PYTHON=/path/to/python3.12" >&2
exit 1
