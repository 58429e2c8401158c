"""Print line coverage per package from the ``.coverage`` file `make test` leaves behind.

Only code run inside the pytest process is counted: what runs in the processes the tests start (a
dispatcher, Ray job drivers and workers) does not show here, so the figures are a lower bound.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import coverage
from coverage.exceptions import NoDataError

ROOT = Path(__file__).resolve().parent.parent


def by_package(data_file: Path) -> dict[str, tuple[int, int]]:
    """``{package: (statements, statements run)}`` for every measured file under the checkout."""
    cov = coverage.Coverage(data_file=str(data_file), config_file=str(ROOT / "pyproject.toml"))
    cov.load()
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for filename in cov.get_data().measured_files():
        path = Path(filename)
        try:
            package = path.relative_to(ROOT).parts[0]
        except ValueError:
            continue
        _, statements, _, missing, _ = cov.analysis2(filename)
        totals[package][0] += len(statements)
        totals[package][1] += len(statements) - len(missing)
    return {name: (s, r) for name, (s, r) in sorted(totals.items())}


def main() -> int:
    data_file = ROOT / ".coverage"
    try:
        rows = by_package(data_file)
    except NoDataError:
        print(f"no coverage data in {data_file}", file=sys.stderr)
        return 1
    print("line coverage per package (pytest process only)")
    all_s = all_r = 0
    for name, (statements, ran) in rows.items():
        all_s, all_r = all_s + statements, all_r + ran
        print(f"  {name:12} {ran:6}/{statements:<6} {100 * ran / max(statements, 1):5.1f} %")
    print(f"  {'total':12} {all_r:6}/{all_s:<6} {100 * all_r / max(all_s, 1):5.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
