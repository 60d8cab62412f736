"""EmbedQueue, the embedding requests' scheduler path: passes packed across requests in tier
order within the token and sequence budgets, large requests spread over passes, refusals."""

from ultrafast.core.embed_queue import EmbedJob, EmbedQueue
from ultrafast.request import ServiceTier


def ids(n: int, token: int = 5) -> list[int]:
    return [token] * n


def taken(pieces) -> list[tuple[int, int]]:
    return [(id(p.job), p.index) for p in pieces]


def test_one_pass_takes_inputs_of_several_requests():
    queue = EmbedQueue(max_batch_tokens=100, max_seqs=8, max_waiting_inputs=100)
    a, b = EmbedJob([ids(10), ids(10)]), EmbedJob([ids(10)])
    assert queue.add(a) is None and queue.add(b) is None
    pieces = queue.next_batch()
    assert taken(pieces) == [(id(a), 0), (id(a), 1), (id(b), 0)]
    assert queue.next_batch() == [] and not queue.has_work()


def test_priority_inputs_go_first_whatever_their_arrival():
    queue = EmbedQueue(max_batch_tokens=100, max_seqs=8, max_waiting_inputs=100)
    flex = EmbedJob([ids(4)], ServiceTier.FLEX)
    default = EmbedJob([ids(4)], ServiceTier.DEFAULT)
    priority = EmbedJob([ids(4)], ServiceTier.PRIORITY)
    for job in (flex, default, priority):
        queue.add(job)
    assert [p.job for p in queue.next_batch()] == [priority, default, flex]


def test_token_budget_splits_a_large_request_and_a_later_priority_one_cuts_in():
    queue = EmbedQueue(max_batch_tokens=30, max_seqs=8, max_waiting_inputs=100)
    big = EmbedJob([ids(10) for _ in range(5)])
    queue.add(big)
    assert taken(queue.next_batch()) == [(id(big), 0), (id(big), 1), (id(big), 2)]
    urgent = EmbedJob([ids(10)], ServiceTier.PRIORITY)
    queue.add(urgent)
    assert taken(queue.next_batch()) == [(id(urgent), 0), (id(big), 3), (id(big), 4)]
    assert queue.num_waiting_inputs == 0


def test_sequence_budget_caps_a_pass():
    queue = EmbedQueue(max_batch_tokens=1000, max_seqs=3, max_waiting_inputs=100)
    job = EmbedJob([ids(2) for _ in range(7)])
    queue.add(job)
    sizes = []
    while pieces := queue.next_batch():
        sizes.append(len(pieces))
    assert sizes == [3, 3, 1]


def test_cancelled_job_is_skipped_and_its_inputs_uncounted():
    queue = EmbedQueue(max_batch_tokens=100, max_seqs=8, max_waiting_inputs=100)
    gone, kept = EmbedJob([ids(3), ids(3)]), EmbedJob([ids(3)])
    queue.add(gone)
    queue.add(kept)
    gone.cancelled = True
    assert [p.job for p in queue.next_batch()] == [kept]
    assert queue.num_waiting_inputs == 0


def test_refusals_queue_full_and_input_longer_than_a_pass():
    queue = EmbedQueue(max_batch_tokens=16, max_seqs=8, max_waiting_inputs=3)
    assert queue.add(EmbedJob([ids(2)] * 3)) is None
    full = queue.add(EmbedJob([ids(2)]))
    assert full is not None and full.code == "queue_full"
    too_long = EmbedQueue(16, 8, 100).add(EmbedJob([ids(2), ids(17)]))
    assert too_long is not None and too_long.code == "input_too_long"
    assert "input 1" in too_long.message


def test_pass_tokens_bounds_a_pass_but_a_long_input_still_runs_alone():
    queue = EmbedQueue(max_batch_tokens=100, max_seqs=8, max_waiting_inputs=100, pass_tokens=25)
    job = EmbedJob([ids(10), ids(10), ids(10), ids(60), ids(5)])
    queue.add(job)
    sizes = []
    while pieces := queue.next_batch():
        sizes.append([len(job.inputs[p.index]) for p in pieces])
    assert sizes == [[10, 10], [10], [60], [5]]
