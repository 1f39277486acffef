"""Fixtures for the agent tests beyond the session ones: started processes and in-process servers."""

import pytest
from fleet_helpers import procs  # noqa: F401  (fixture)


@pytest.fixture(scope="session")
def anthropic():  # noqa: ANN201 - the module
    """The anthropic SDK, imported by the tests that use it rather than at collection: its import (~2 s of CPU)
    would otherwise be paid by every test process."""
    import anthropic

    return anthropic
