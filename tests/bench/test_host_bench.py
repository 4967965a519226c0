"""The host bench times decode steps: every sequence must be decoding through them."""

from bench.host_bench import step_cpu_ms


def test_steps_are_timed_with_the_whole_batch_decoding() -> None:
    ms = step_cpu_ms(8)  # raises if a sequence left the batch before the timed steps ended
    assert 0.0 < ms < 1000.0
