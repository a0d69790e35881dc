"""``runtime/steering.py``: the words a member puts in the commit's tail, and what every member
concludes from the same words (the behaviour with real workers and kills:
tests/lightning/test_lightning_recovery.py and tests/accelerate/test_accelerate_recovery.py,
``..._agreed_on_the_next_commit`` / ``..._after_the_next_commit``)."""

from chameleon_ft.runtime.steering import Steering


def test_a_member_that_decided_nothing_puts_zero_in_the_tail():
    assert Steering().word() == 0.0


def test_every_member_concludes_the_same_from_the_same_words():
    voter, local, idle = Steering(), Steering(), Steering()
    voter.defer_stop(True)
    local.decided_locally()
    local.defer_stop(False)  # a stop decided "no" is held too, but votes nothing
    words = {0: idle.word(), 1: voter.word(), 3: local.word()}
    assert words == {0: 0.0, 1: 3.0, 3: 1.0}
    for s in (voter, local, idle):
        assert s.agree(words, step=9) is True
        assert (s.stop_at, s.adopt, s.voters, s.word()) == (9, True, (1,), 0.0)
        assert s.stops_now(9) and not s.stops_now(10)


def test_local_decisions_without_a_stop_vote_only_ask_for_rank_0s_bookkeeping():
    s = Steering()
    s.decided_locally()
    assert s.agree({2: s.word()}, step=4) is True
    assert s.stop_at is None and s.adopt and not s.stops_now(4)


def test_an_adopting_member_learns_the_agreed_stop_from_the_run_state():
    source, adopter = Steering(), Steering()
    source.agree({1: 2.0}, step=12)
    adopter.load_state_dict(source.state_dict())
    assert adopter.stops_now(12)
    adopter.load_state_dict(None)  # a checkpoint from before the field: unchanged
    assert adopter.stop_at == 12
