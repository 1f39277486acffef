"""Fixtures for the agent tests beyond the session ones: started processes and in-process servers."""

from fleet_helpers import procs  # noqa: F401  (fixture)
