"""harness.gpu_slots: the machine-wide slots of the large GPU cases."""

from __future__ import annotations

import threading
import time

from harness.gpu_slots import LARGE_CASE_GIB, gpu_slot, slots_for


def test_a_gpu_holds_as_many_large_cases_as_its_memory_allows():
    gib = 2**30
    assert slots_for(80 * gib) == 80 // LARGE_CASE_GIB
    assert slots_for(141 * gib) == 141 // LARGE_CASE_GIB
    assert slots_for(16 * gib) == 1
    assert slots_for(80 * gib, override="5") == 5


def test_a_case_waits_until_a_slot_of_its_gpu_is_free(tmp_path):
    entered = []
    with gpu_slot("GPU-a", 2, tmp_path) as first, gpu_slot("GPU-a", 2, tmp_path) as second:
        assert first < 0.5 and second < 0.5
        with gpu_slot("GPU-b", 2, tmp_path) as other_gpu:  # another GPU's slots are its own
            assert other_gpu < 0.5

        def third():
            with gpu_slot("GPU-a", 2, tmp_path, poll_s=0.01) as waited:
                entered.append(waited)

        waiter = threading.Thread(target=third)
        waiter.start()
        time.sleep(0.3)
        assert entered == [], "a third case ran while both slots were held"
    waiter.join(5)
    assert len(entered) == 1 and entered[0] >= 0.25
