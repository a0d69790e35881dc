"""The dead marks' batched read, checked on any store (TCPStore or etcd)."""

from __future__ import annotations


def dead_marks_are_read_in_a_few_requests(store, count) -> None:
    """``coordination.reported_dead_among`` on ``store`` (requests counted by ``count``): 200
    registered workers, none marked, then 7 and 150 reported dead, then 150's id taken by a
    replacement (a newer incarnation: alive)."""
    from chameleon_ft.runtime.coordination import (_incarnation_key, dead_workers, report_dead, reported_dead,
                                                   reported_dead_among)
    workers = range(200)
    for w in workers:
        store.add(_incarnation_key(w), 1)
    c0 = count()
    assert reported_dead_among(store, workers) == set()
    assert count() - c0 <= 2  # the log read (TCPStore: check, get)
    report_dead(store, 7)
    report_dead(store, 150)
    c0 = count()
    assert reported_dead_among(store, workers) == {7, 150}
    assert count() - c0 <= 3  # the log, then the two marked workers' incarnations in one multi_get
    store.add(_incarnation_key(150), 1)  # a replacement took id 150
    got = reported_dead_among(store, workers)
    assert got == {7} == {w for w in workers if reported_dead(store, w)}  # the per-worker rule agrees
    assert dead_workers(store) == {"7"}  # every marked worker (the quorum over etcd's ``gone``)
    assert reported_dead_among(store, [3, 150]) == set()
