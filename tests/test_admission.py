"""`kvpot.engine.admission`: the one admission test the scheduler, offline runs and the server share."""

from __future__ import annotations

import threading

import pytest

from kvpot.engine.admission import Admission, QueueFull


def test_places_are_slots_plus_the_queue_and_a_refusal_says_how_full():
    admission = Admission(2, 1)
    places = [admission.take() for _ in range(3)]
    assert admission.places == 3 and not admission.has_room()
    view = admission.view()
    assert (view.taken, view.running, view.waiting) == (3, 2, 1)
    with pytest.raises(QueueFull, match=r"all 2 slots are busy and 1 requests wait \(max_waiting 1\); retry later"):
        admission.take()
    places[0].release()
    places[0].release()  # a second release gives nothing back twice
    admission.release(places[0])
    assert admission.view().taken == 2 and admission.has_room()
    admission.take()
    assert admission.view().taken == 3


def test_no_limit_and_an_empty_queue():
    unbounded = Admission(1, None)
    for _ in range(100):
        unbounded.take()
    assert unbounded.places is None and unbounded.has_room() and unbounded.view().waiting == 99
    slots_only = Admission(1, 0)
    slots_only.take()
    with pytest.raises(QueueFull, match="0 requests wait"):
        slots_only.take()


def test_threads_never_take_more_places_than_there_are():
    admission, lock, granted, refused = Admission(4, 6), threading.Lock(), [], []

    def worker():
        for _ in range(200):
            try:
                place = admission.take()
            except QueueFull:
                with lock:
                    refused.append(1)
                continue
            assert admission.view().taken <= 10
            with lock:
                granted.append(place)
            place.release()
            place.release()  # racing double releases stay one

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert admission.view().taken == 0 and len(granted) + len(refused) == 1600 and granted
