"""The MoE block's shared expert on a side stream (``moe_ops.start_beside``), on CUDA: the block
equals one stream's kernels bit for bit, eager and in a CUDA graph; the fork runs on another
stream and is joined by the routed experts' combine (16-bit and NVFP4 experts); the side output is
``record_stream``-ed only without per-stream allocator pools. The handle's CPU behaviour is in
tests/engine/test_moe_side_output.py."""
import pytest
import torch


@pytest.mark.gpu
def test_moe_block_with_the_shared_expert_beside_equals_one_stream(monkeypatch):
    """The MoE block runs its shared expert on a side stream beside the router, the routing and
    the routed experts, joined at their combine (moe_ops.start_beside). Eager and replayed from a
    CUDA graph (a fork and a join inside it), its output equals the same kernels on one stream bit
    for bit, at decode and grouped-path batch sizes, and the expert counters count each token once
    per call."""
    import hybrid_engine.models.moe as moe_mod
    from hybrid_engine.config import MOE, ModelConfig
    from hybrid_engine.models.synthetic import sens_init_
    cfg = ModelConfig(layer_types=(MOE,), vocab_size=16, hidden_size=256, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=128, intermediate_size=256, n_routed_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=128, moe_shared_expert_intermediate_size=384,
                      routed_scaling_factor=2.5)
    moe = moe_mod.MoE(cfg)
    sens_init_(moe, seed=5)
    moe = moe.to("cuda", torch.bfloat16)
    moe.gate.weight.data = moe.gate.weight.data.float()          # the router runs in float32
    moe.reset_runtime_state()
    from hybrid_engine.models.moe_ops import SideOutput
    beside = moe_mod.start_beside
    shared_expert, streams = moe_mod.shared_expert, []

    def recorded(x, mlp):                # where the shared expert runs
        streams.append(torch.cuda.current_stream())
        return shared_expert(x, mlp)
    monkeypatch.setattr(moe_mod, "shared_expert", recorded)

    def one_stream(side, device):
        return SideOutput(side())
    for T in (1, 8, 40):
        x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            got = moe(x)
            assert streams[-1] != torch.cuda.current_stream()            # on the side stream
            monkeypatch.setattr(moe_mod, "start_beside", one_stream)
            ref = moe(x)
            monkeypatch.setattr(moe_mod, "start_beside", beside)
            torch.testing.assert_close(got, ref, atol=0, rtol=0)
            assert ref.float().abs().max() > 0.1
            xs = x.clone()
            moe(xs)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = moe(xs)
            for _ in range(2):
                xs.copy_(torch.randn_like(xs))
                moe.read_expert_load()
                g.replay()
                torch.cuda.synchronize()
                assert sum(moe.read_expert_load()) == T * 4
                monkeypatch.setattr(moe_mod, "start_beside", one_stream)
                torch.testing.assert_close(y, moe(xs), atol=0, rtol=0)
                monkeypatch.setattr(moe_mod, "start_beside", beside)


@pytest.mark.gpu
def test_beside_runs_on_another_stream_and_joins_it():
    """moe_ops.start_beside: side() runs on another stream than the work after it, and wait()
    makes the current stream wait for it: a slow side kernel (a ~30 ms spin, then the write) is
    seen complete by the current stream's next kernel. Without the join the sum reads the output
    before it is written."""
    from hybrid_engine.models.moe_ops import start_beside
    x = torch.zeros(1 << 20, device="cuda")
    streams = []

    def side():
        streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(60_000_000)
        return x + 1.0

    def main():
        streams.append(torch.cuda.current_stream())
        return torch.ones(3, device="cuda")
    for _ in range(3):
        torch.cuda.synchronize()
        started = start_beside(side, x.device)
        m = main()
        s = started.wait()
        assert started.wait() is s                           # once; later calls only return it
        total = s.sum()                                      # on the current stream
        assert float(total) == x.numel() and float(m.sum()) == 3.0
        assert streams[-2] != streams[-1] == torch.cuda.current_stream()


@pytest.mark.gpu
@pytest.mark.parametrize("T,quant", [(1, None), (8, None), (40, None), (40, "nvfp4")])
def test_routed_experts_join_the_side_output_before_their_combine(T, quant):
    """routed_experts(add=SideOutput): the side stream's output is waited for just before the
    combine adds it. A slow side kernel (a ~30 ms spin, then the write) must be seen complete:
    the result equals the experts plus the finished tensor, bit for bit, on the GEMV (T 1, 8) and
    grouped paths, bf16 and NVFP4 experts, eager and replayed from a CUDA graph (the fork and the
    join inside it). Without the join the combine reads the side output before it is written."""
    from types import SimpleNamespace

    from hybrid_engine.models.moe_ops import routed_experts, start_beside
    from hybrid_engine.quantization.experts import Nvfp4Experts
    E, k, D, F = 16, 4, 256, 128
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
    up = torch.randn(E, F, D, generator=g, device="cuda").to(torch.bfloat16) / 8
    down = torch.randn(E, D, F, generator=g, device="cuda").to(torch.bfloat16) / 8
    scales = {}
    if quant == "nvfp4":            # as quantization="nvfp4" stores them (per expert)
        q = Nvfp4Experts.quantized_from(SimpleNamespace(up_proj=up, down_proj=down))
        up, down = q.up_proj.data, q.down_proj.data
        scales = dict(up_scale=q.up_proj_weight_scale_2.data, down_scale=q.down_proj_weight_scale_2.data,
                      up_blocks=q.up_proj_weight_scale.data, down_blocks=q.down_proj_weight_scale.data)
    ids = torch.argsort(torch.rand(T, E, generator=g, device="cuda"), dim=1)[:, :k].to(torch.int32)
    wts = torch.rand(T, k, generator=g, device="cuda")
    base = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
    g_in = torch.Generator(device="cuda").manual_seed(T + 1)
    for factor in (2.0, 3.0):       # a new value each time: a stale block cannot pass for the output
        torch.cuda.synchronize()

        def side():
            torch.cuda._sleep(60_000_000)
            return base * factor
        started = start_beside(side, x.device)
        got = routed_experts(x, up, down, ids, wts, add=started, **scales)
        started.wait()
        torch.cuda.synchronize()
        want = routed_experts(x, up, down, ids, wts, add=base * factor, **scales)
        assert got.abs().max() > 0.1
        torch.testing.assert_close(got, want, atol=0, rtol=0)

    def slow_side():
        torch.cuda._sleep(60_000_000)
        return base * 2.0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        started = start_beside(slow_side, x.device)
        got = routed_experts(x, up, down, ids, wts, add=started, **scales)
        started.wait()
    for _ in range(2):              # new side inputs each replay: a stale output cannot pass
        base.copy_(torch.randn(T, D, generator=g_in, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(got, routed_experts(x, up, down, ids, wts, add=base * 2.0, **scales),
                                   atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("per_stream_pools", [True, False])
def test_beside_records_the_side_output_only_without_per_stream_pools(monkeypatch, per_stream_pools):
    """moe_ops.SideOutput.wait skips record_stream under torch's native allocator (a pool per
    stream: the side stream's next use of the block waits for the current stream) and records the
    side output on the current stream under an allocator without per-stream pools
    (cudaMallocAsync), once; the machine's allocator here is the native one."""
    from hybrid_engine.models import moe_ops
    assert moe_ops._per_stream_pools()
    recorded = []
    real = torch.Tensor.record_stream
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: (recorded.append(s), real(t, s)))
    monkeypatch.setattr(moe_ops, "_per_stream_pools", lambda: per_stream_pools)
    x = torch.randn(4, 8, device="cuda")
    started = moe_ops.start_beside(lambda: x * 2.0, x.device)
    s = started.wait()
    started.wait()
    torch.testing.assert_close(s, x * 2.0, atol=0, rtol=0)
    assert recorded == ([] if per_stream_pools else [torch.cuda.current_stream()])
