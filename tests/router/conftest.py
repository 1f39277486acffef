from router_helpers import procs  # noqa: F401  (fixture)
