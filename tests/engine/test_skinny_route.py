"""``skinny_linear._multi_row_route``, the 2-8 row choice for 16-bit projections, on the shapes it
was measured on (benchmarks/results/2026-11-26-gemv-rows-h100-h200.md): a change of the route has
to come with a new sweep. The kernels themselves are checked on CUDA (tests/gpu/test_skinny_linear_cuda.py)."""
import pytest

pytest.importorskip("triton")
from hybrid_engine.models.skinny_linear import _multi_row_route  # noqa: E402

# 8B shapes (N, K) -> the kernel at 2, 3, 4 and 8 rows
ROUTES = {
    "mamba in_proj": ((18560, 4096), ("dot", "dot", "dot", "dot")),
    "mlp up_proj": ((21504, 4096), ("dot", "dot", "dot", "dot")),
    "lm_head": ((131072, 4096), ("dot", "dot", "dot", "dot")),
    "mamba out_proj": ((4096, 8192), ("cublas",) * 4),
    "mlp down_proj": ((4096, 21504), ("cublas",) * 4),
    "attn q/o_proj": ((4096, 4096), ("cublas",) * 4),
    "attn k/v_proj": ((1024, 4096), ("fma", "fma", "fma", "cublas")),
    "nano in_proj (not swept: the old dot config)": ((10304, 2688), ("dot",) * 4),
}


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_route_of_the_swept_shapes(name):
    (N, K), kernels = ROUTES[name]
    got = tuple(_multi_row_route(M, N, K)[0] for M in (2, 3, 4, 8))
    assert got == kernels, (name, got)


def test_fma_route_configs_by_rows():
    """k/v at 2 rows: one walk of (2, 2048); at 3-4 rows: (4, 1024) (H100 6.6 us vs 8.8 for the dot kernel)."""
    assert _multi_row_route(2, 1024, 4096)[1] == dict(block_n=2, block_k=2048, num_warps=4)
    assert _multi_row_route(4, 1024, 4096)[1] == dict(block_n=4, block_k=1024, num_warps=4)


def test_fp8_one_row_configs_of_the_swept_shapes(monkeypatch):
    """The FP8 one-row dispatch (``fp8_kernels.fp8_skinny_linear``) on the shapes its configs were
    swept on: small weights (the k/v projections) one 4096-wide K tile with 8 warps; K = 2688 (Nano:
    mamba in_proj, q_proj, shared-expert up) (4, 1024, 4), whose K tiles leave fewer lanes masked;
    the long rows (N <= 4096, N * K >= 2^24) (8, 2048, 8), shorter ones (2, 2048, 4); wider N (the
    8B in_proj and up_proj) (4, 2048, 4) (benchmarks/results/2026-11-29-fp8-gemv-h200.md)."""
    import torch
    from hybrid_engine.quantization import fp8_kernels
    seen = []
    monkeypatch.setattr(fp8_kernels, "fp8_skinny_linear_fma",
                        lambda x, w, s, b, **cfg: seen.append((cfg["block_n"], cfg["block_k"], cfg["num_warps"])))
    want = {(10304, 2688): (4, 1024, 4), (4096, 2688): (4, 1024, 4), (3712, 2688): (4, 1024, 4),
            (2688, 4096): (2, 2048, 4), (2688, 3712): (2, 2048, 4), (18560, 4096): (4, 2048, 4),
            (21504, 4096): (4, 2048, 4), (4096, 21504): (8, 2048, 8), (4096, 8192): (8, 2048, 8),
            (4096, 4096): (8, 2048, 8), (1024, 4096): (2, 4096, 8), (256, 2688): (2, 4096, 8)}
    for (N, K), cfg in want.items():
        seen.clear()
        fp8_kernels.fp8_skinny_linear(torch.zeros(1, K), torch.zeros(N, K, dtype=torch.float8_e4m3fn),
                                      torch.ones(N))
        assert seen == [cfg], ((N, K), seen)


def test_fp8_few_rows_route_by_dtype(monkeypatch):
    """The FP8 2-8-row dispatch: 16-bit rows take the dot kernel, (32, 512); float32 rows (a float32
    FP8 model, an FP8 drafter of a float32 engine) take the one-row kernel at its one-row config, so
    each row keeps a one-token step's bits (the interpreter's ``fp8_f32_rows_invariant`` checks them)."""
    import torch
    from hybrid_engine.quantization import fp8_kernels
    seen = []
    monkeypatch.setattr(fp8_kernels, "fp8_skinny_linear_dot",
                        lambda x, w, s, b, **cfg: seen.append(("dot", cfg["block_n"], cfg["block_k"])))
    monkeypatch.setattr(fp8_kernels, "fp8_skinny_linear_fma",
                        lambda x, w, s, b, **cfg: seen.append(("fma", cfg["block_n"], cfg["block_k"])))
    want = {(torch.bfloat16, 1024, 2048): ("dot", 32, 512), (torch.float16, 16384, 1024): ("dot", 32, 512),
            (torch.float32, 1024, 2048): ("fma",) + tuple(fp8_kernels._fma_config(1024, 2048)[k] for k in ("block_n", "block_k")),
            (torch.float32, 4096, 4096): ("fma", 8, 2048)}
    for (dtype, N, K), route in want.items():
        for rows in (2, 4, 8):
            seen.clear()
            fp8_kernels.fp8_skinny_linear(torch.zeros(rows, K, dtype=dtype), torch.zeros(N, K, dtype=torch.float8_e4m3fn),
                                          torch.ones(N))
            assert seen == [route], ((dtype, N, K, rows), seen)
