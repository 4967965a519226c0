from worker.executor.block_manager import BlockManager
from worker.executor.scheduler import ScheduledBatch, Scheduler
from worker.executor.sequence import Sequence
from worker.executor.types import (
    CapacitySchedulerPolicy,
    ExecutorConfig,
    Request,
    RequestState,
    SchedulerConfig,
)


def make_seq(i: int, prompt_len: int, max_tokens: int = 8, priority: float = 0.5) -> Sequence:
    request = Request(input_token_ids=list(range(1000 * i, 1000 * i + prompt_len)), max_tokens=max_tokens,
                      priority=priority)
    return Sequence(
        request_id=i, request=request, token_ids=list(request.input_token_ids), num_prompt_tokens=prompt_len,
        end_id=-1, stop_words=[], bad_words=[], seed=i, sampling_params=(0.0, 0.0, 1.0, 0.0),
    )


def make_scheduler(num_blocks: int = 64, block_size: int = 4, policy: CapacitySchedulerPolicy =
                   CapacitySchedulerPolicy.GUARANTEED_NO_EVICT, **kw: int) -> Scheduler:
    config = ExecutorConfig(scheduler_config=SchedulerConfig(capacity_scheduler_policy=policy), **kw)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(num_blocks, block_size))


def run(batch: ScheduledBatch) -> None:
    """What the executor does after a forward: advance, and append a token where one is sampled."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.append(7)


def test_chunked_context_respects_the_token_budget_and_mixes_with_generation() -> None:
    s = make_scheduler(max_num_tokens=16)
    short, long = make_seq(1, 5), make_seq(2, 40)
    s.add(short)
    run(s.schedule())
    s.add(long)
    b = s.schedule()
    # short generates one token; long gets the remaining 15 of the budget.
    assert b.seqs == [short, long] and b.num_new_tokens == [1, 15]
    run(b)
    b = s.schedule()
    assert b.num_new_tokens == [1, 15]
    run(b)
    b = s.schedule()
    assert b.num_new_tokens == [1, 10]  # the last chunk of the 40-token prompt
    run(b)
    assert long.num_generated == 1


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    s = make_scheduler(max_num_tokens=16, enable_chunked_context=False)
    a, b = make_seq(1, 10), make_seq(2, 10)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch.seqs == [a] and s.waiting == [b]
    assert b.blocks.block_ids == []  # nothing held while waiting


def test_max_batch_size_caps_running_requests() -> None:
    s = make_scheduler(max_batch_size=2)
    for i in range(4):
        s.add(make_seq(i, 3))
    assert len(s.schedule()) == 2 and len(s.waiting) == 2


def test_priority_orders_admission() -> None:
    s = make_scheduler(max_batch_size=1)
    low, high = make_seq(1, 3, priority=0.1), make_seq(2, 3, priority=0.9)
    s.add(low)
    s.add(high)
    assert s.schedule().seqs == [high]


def test_guaranteed_no_evict_reserves_room_to_finish() -> None:
    # 8 blocks of 4 tokens. Each request needs ceil((4 + 12) / 4) = 4 blocks to finish.
    s = make_scheduler(num_blocks=8, block_size=4)
    seqs = [make_seq(i, 4, max_tokens=12) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    assert s.schedule().seqs == seqs[:2]  # the third would not be able to finish
    for _ in range(30):
        batch = s.schedule()
        if not batch:
            break
        run(batch)
        for seq in list(s.running):
            if seq.num_generated >= seq.request.max_tokens:
                s.remove(seq)
    assert all(seq.num_generated >= 12 for seq in seqs)
    assert s.blocks.num_free == 8


def test_max_utilization_preempts_the_newest_and_resumes_it() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, policy=CapacitySchedulerPolicy.MAX_UTILIZATION)
    old, new = make_seq(1, 4, max_tokens=8), make_seq(2, 4, max_tokens=8)
    s.add(old)
    s.add(new)
    preempted = []
    for _ in range(40):
        batch = s.schedule()
        preempted += batch.preempted
        if not batch:
            break
        run(batch)
        for seq in list(s.running):
            if seq.num_generated >= seq.request.max_tokens:
                s.remove(seq)
        s.blocks.check_invariants([q.blocks for q in s.running + s.waiting])
    assert new in preempted and old not in preempted
    assert old.num_generated == 8 and new.num_generated == 8
    assert new.state is not RequestState.QUEUED
    assert s.blocks.num_free == 4
