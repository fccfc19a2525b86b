#!/usr/bin/env bash
# The Python API reference: Sphinx autodoc over the installed package (docs/api/conf.py:
# the modules' docstrings, and for the compiled module the stub
# python/shmbridge/_native.pyi) into target/api-docs/ (open index.html). A docstring
# reference that resolves to nothing, or a docstring that is not valid reST, fails the
# build (nitpicky, -W).
#   bash scripts/api-docs.sh            with .venv (pip install . and the `docs` extra first)
#   bash scripts/api-docs.sh PYTHON     with an interpreter that has shmbridge and Sphinx
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
rm -rf target/api-docs
"$python" -m sphinx -q -W --keep-going -n -b html -d target/api-docs-doctrees docs/api target/api-docs
echo "api-docs: target/api-docs/index.html"
