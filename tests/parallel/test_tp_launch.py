"""How the ranks of a tensor-parallel engine are launched and talk: ``torchrun`` (rank 0 is the
engine, the other ranks serve as its workers and exit, and no gloo thread outlives the shutdown),
the shared-memory step mailbox, and the step messages a steady decode sends (only the grown block
lists)."""
import os

import numpy as np
import pytest

from hf_reference import hf_greedy
from hybrid_engine import LLM, SamplingParams


def test_torchrun_launch(model_dirs, tmp_path):
    """``torchrun --nproc-per-node 2`` runs the script on two ranks: rank 0's LLM is the engine,
    rank 1's serves as its worker and exits; rank 0 prints transformers' tokens."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    d = model_dirs("tp_moe", pattern="M*-EM*E", vocab_size=251, seed=3)
    prompt = [7, 8, 9, 10, 11]
    script = tmp_path / "tp_script.py"
    script.write_text(
        "import json\n"
        "from hybrid_engine import LLM, SamplingParams\n"
        f"llm = LLM({str(d)!r}, device='cpu', tensor_parallel_size=2)\n"
        f"out = llm.generate([{prompt}], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),"
        " use_tqdm=False)\n"
        "print('TOKENS', json.dumps(out[0].outputs[0].token_ids), flush=True)\n"
        "llm.shutdown()\n"
        "import os\n"           # the group's gloo threads end with it (left alive, they raced the exit)
        "print('THREADS', sorted(open(f'/proc/self/task/{t}/comm').read().strip()"
        " for t in os.listdir('/proc/self/task')), flush=True)\n")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), str(script)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    lines = [ln for ln in res.stdout.splitlines() if "TOKENS" in ln]
    assert len(lines) == 1                                   # only rank 0 got past LLM(...)
    assert json.loads(lines[0].split("TOKENS", 1)[1]) == hf_greedy(d, [prompt], 6)[0]
    threads = [ln for ln in res.stdout.splitlines() if ln.startswith("THREADS")]
    assert len(threads) == 1 and "gloo" not in threads[0], threads


def _free_port() -> int:
    from hybrid_engine.parallel.group import free_port
    return free_port()


def test_shm_channel_round_trips_and_refuses_oversized_messages():
    """The step mailbox: messages arrive in order (the writer waits for the reader's ack of the
    previous one), an empty payload (the "over gloo" marker) round-trips, too big is a ValueError."""
    from hybrid_engine.parallel.channel import ShmChannel
    writer = ShmChannel(None, readers=2, size=4096)
    readers = [ShmChannel(writer.name, readers=2, reader=i) for i in range(2)]
    try:
        for msg in (b"step-1", b"", bytes(range(256)) * 10):
            writer.send(msg)
            assert [r.recv() for r in readers] == [msg, msg]
        with pytest.raises(ValueError, match="exceeds"):
            writer.send(b"x" * (writer.capacity + 1))
    finally:
        for r in readers:
            r.close()
        writer.close(unlink=True)


def test_steady_step_messages_carry_only_the_grown_block_lists(model_dirs):
    """SchedulerOutput.for_workers: a steady decode step sends the new ids of the rows that grew
    (all a worker's runner reads: a BlockTail past the ids the ranks' batches already hold), None
    for the others; any other step goes whole. Checked on the steps a real engine schedules
    (4-token blocks: rows grow every few steps), with the held counts from the engine's own
    runner as rank 0's ParallelRunner reads them."""
    import pickle

    from hybrid_engine.parallel.worker import ParallelRunner
    from hybrid_engine.scheduling.scheduler_output import BlockTail
    d = model_dirs("tp_moe", pattern="M*-EM*E", vocab_size=251, seed=3)
    llm = LLM(str(d), device="cpu", max_num_seqs=4, block_size=4, async_scheduling=False)
    eng = llm.engine
    sent = []
    execute = eng.runner.execute
    held_blocks = ParallelRunner(eng.runner, tp=None)._held_blocks

    def spy(sched):
        # the block lists are the scheduler's live lists (they keep growing): copied as sent
        ids = sched.decode.req_ids if sched.decode else ()
        held = {rid: (held_blocks(rid), list(b)) for rid, b in zip(ids, sched.decode.block_ids if ids else ())}
        w = sched.for_workers(held_blocks)
        sent.append((sched, w, held, pickle.loads(pickle.dumps(w))))      # the last: as a worker gets it
        return execute(sched)
    eng.runner.execute = spy
    rng = np.random.default_rng(4)
    for n in (30, 9, 17):
        eng.add_request(eng.make_request(rng.integers(3, 250, n).tolist(),
                                         SamplingParams(max_tokens=24, ignore_eos=True)))
    while eng.has_work():
        eng.step()
    steady = [(s, w, h, r) for s, w, h, r in sent if s.decode is not None and not (s.other_rows or s.new_requests
                                                                                   or s.removed_req_ids)]
    assert len(steady) >= 10 and any(s.decode.grown for s, _, _, _ in steady)
    assert any(not s.decode.grown for s, _, _, _ in steady)        # most steps grow no row
    for s, w, _, _ in sent:
        if not any(s is t for t, _, _, _ in steady):
            assert w is s
    for s, _, held, w in steady:
        grown = set(s.decode.grown)
        assert w.decode.req_ids == s.decode.req_ids and w.step_id == s.step_id
        for i, (rid, got) in enumerate(zip(s.decode.req_ids, w.decode.block_ids)):
            if i not in grown:
                assert got is None
                continue
            had, full = held[rid]                                # as the workers held it, as sent
            assert isinstance(got, BlockTail) and got.start == had < len(full) == len(got)
            assert list(got[had:len(got)]) == full[had:]
            with pytest.raises(IndexError):
                got[0:len(got)]                                  # never stale ids before the tail
        if grown:
            assert len(pickle.dumps(w)) < len(pickle.dumps(s))
