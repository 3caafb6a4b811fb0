#!/usr/bin/env bash
# The one command that installs everything and runs the whole test suite:
# unit tests, host integration tests (as root) and the VM tests inside one
# QEMU guest. Extra arguments go to pytest.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
scripts/setup.sh
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure here, never a pass.
if [ "$rc" -eq 5 ]; then
  echo "kvtier: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$rc"
