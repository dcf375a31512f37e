"""The backend's registration: found through an installed distribution's entry point, its
BackendSpec accepted by the core (operation names, devices, unsupported keys, launcher,
``available`` a reason string, a factory taking the documented keywords)."""

import pytest

from tdist.testing.scenarios import ScenarioContext


def test_registration(tdist_scenario: ScenarioContext) -> None:
    if not tdist_scenario.strict:
        pytest.skip(f"reference run ({tdist_scenario.dist_module}): torch's backends are not plugins")
    import tdist
    from tdist._backend import _spec_problems

    spec = tdist.get_backend_spec(tdist_scenario.backend)  # a refused plugin: the error says why
    assert spec.name == tdist_scenario.backend, f"registered as {spec.name!r}, asked for {tdist_scenario.backend!r}"
    assert spec.distribution, f"backend {spec.name!r} was not registered through an installed distribution"
    problems = _spec_problems(spec)
    assert not problems, f"backend {spec.name!r}: " + "; ".join(problems)
