from fleet_helpers import procs  # noqa: F401  (fixture)
