"""Hypothesis profiles: fixed, derandomised examples by default so every run (CI included)
checks the same cases; ``--hypothesis-profile=thorough`` explores."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, max_examples=30, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=400, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")
