"""Drive an engine step by step with the host-sync detector armed around every launch."""
import torch


def launch_steps_without_sync(eng, steps: int) -> None:
    """Launch ``steps`` steps, each under torch.cuda sync debug mode "error" (a hidden host sync on
    the step path raises), reading each step's output one step late as the async loop does."""
    prev = eng.take_inflight()
    for _ in range(steps):
        torch.cuda.set_sync_debug_mode("error")
        try:
            cur, failed = eng.launch()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not failed and cur is not None
        if prev is not None:
            eng.commit(prev, prev.result())
        prev = cur
    eng.commit(prev, prev.result())


def rest_sooner(llm) -> None:
    """The engine's adaptive policy with the rule these GPU tests' schedules were counted under
    (threshold 0.25, decay 0.8: an always-rejected row rests after 2 steps, against ~10 with the
    defaults), so a short schedule has its width-0 steps; untimed, so host timing moves no width."""
    policy = llm.engine.runner.policy
    policy.threshold, policy.decay = 0.25, 0.8
    policy.stop_timing()      # widths from acceptance alone: the same in the eager and the fused engine
