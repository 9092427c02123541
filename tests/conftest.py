"""Settings shared by every test directory.

Hypothesis: no per-example deadline and no "too slow" health check. Both are wall-clock
assertions, and this suite runs under pytest-xdist on two loaded cores, where a property test's
example can take seconds for reasons that have nothing to do with the code under test. The
properties themselves are unchanged; the examples still run."""

from hypothesis import HealthCheck, settings

settings.register_profile("ntp", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ntp")
