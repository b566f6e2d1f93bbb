"""Hypothesis profiles: fixed, derandomised examples by default so every run (CI included)
checks the same cases; ``--hypothesis-profile=thorough`` explores. Also the input-space draw
(docs/input-space.md): :func:`input_cases` draws every dimension's class in combination, and
:func:`covering_strength` says which covering design the active profile must reach (``ci``:
every value class; ``thorough``: every feasible pair)."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

settings.register_profile(
    "ci", derandomize=True, max_examples=30, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=400, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")


def covering_strength() -> int:
    """2 (every pair of value classes) under the ``thorough`` profile, 1 (every class) otherwise."""
    return 2 if settings.get_current_profile_name() == "thorough" else 1


class _DrawChooser:
    """Free values of a case drawn by Hypothesis (so they shrink)."""

    def __init__(self, draw):
        self.draw = draw

    def pick(self, values):
        return self.draw(st.sampled_from(list(values)))

    def integer(self, lo, hi):
        return self.draw(st.integers(lo, hi))


@st.composite
def input_cases(draw):
    """An ``harness.input_space.InputCase``: each dimension's class drawn among those that keep
    the combination feasible, then the case's free values."""
    from harness.input_space import draw_assignment, realize

    assignment = draw_assignment(lambda classes: draw(st.sampled_from(classes)))
    return realize(assignment, _DrawChooser(draw))
