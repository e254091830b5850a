#!/usr/bin/env bash
# Prints a command that runs Python >= 3.12 (JAX 0.11 needs it): python3.12/python3.13 on PATH, else pyenv's.
for candidate in python3.13 python3.12 python3; do
  if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    command -v "$candidate"; exit 0
  fi
done
if command -v pyenv >/dev/null 2>&1; then
  version=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.[0-9]+)?$' | sort -V | head -n 1)
  if [[ -n $version ]]; then echo "$(pyenv root)/versions/$version/bin/python"; exit 0; fi
fi
echo "no Python >= 3.12 found (JAX 0.11.2 needs it): install one, e.g. 'pyenv install 3.12'" >&2
exit 1
