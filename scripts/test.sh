#!/usr/bin/env bash
# Set up and run the whole test suite (lint first). Fails if pytest collected no tests.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh 2>&1 | grep -v "^WARNING: Location"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then echo "scripts/setup.sh failed: not running the tests" >&2; exit 1; fi
. .venv/bin/activate
ruff check . || exit 1
# a C kernel this CPU runs that fails to build or load fails the run, instead of serving on the slow eager path
export FLEETLLM_REQUIRE_KERNELS=1
# four test processes (pytest-xdist) on two cores, each module whole on one: the suite waits on servers and child
# processes much of the time (a cold run on 2 cores: 331 s with three, 289 s with four, for the same CPU seconds)
python -m pytest -q -p no:cacheprovider -n 4 --dist loadfile "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit $rc
