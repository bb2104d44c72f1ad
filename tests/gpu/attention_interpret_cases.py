"""Paged-attention cases for Triton's interpreter (interpret_cases.py merges them into its CASES and
runs them with the others): decode, verify and prefill rows, key ranges split forced and by the
default rule, FP8 caches. Float32 but for a few float16 cases."""
import torch

import attention_cases as ac
from hybrid_engine.attention.triton_attention import triton_paged_attention

F32 = torch.float32


def _row_split_bounds():
    outs = {}

    def impl(bound):
        def f(q, kc, vc, qsl, sl, bt, sc, mq, ms, **k):
            outs[bound] = triton_paged_attention(q, kc, vc, qsl, sl, bt, sc, mq, bound or ms, block_n=16, **k)
            return outs[bound]
        return f
    res = [ac.check_attention(impl(bound), "cpu", F32, [1, 4, 0, 3, 1, 1], [300, 40, 0, 700, 0, 63], nH=8,
                              nkv=2, hd=16, bs=4, seed=6) for bound in (None, 8192, 262144)]
    assert torch.equal(outs[8192], outs[262144]), "decode ranges depend on the length bound"
    return res


def _leading_tokens():
    """Tokens before query_start_loc[0] (no engine caller has them) come out zero like the graph
    padding after the last row: the rows' tokens shifted by 9 (G = 3 heads a KV head)."""
    lead = 9

    def shifted(q, kc, vc, qsl, sl, bt, sc, mq, ms, **k):
        q2 = torch.cat([torch.randn(lead, *q.shape[1:], dtype=q.dtype), q])
        out = triton_paged_attention(q2, kc, vc, qsl + lead, sl, bt, sc, mq, ms, block_n=16, **k)
        assert torch.equal(out[:lead], torch.zeros_like(out[:lead])), "tokens before query_start_loc[0]"
        return out[lead:]
    return ac.check_attention(shifted, "cpu", F32, [1, 4, 0, 2], [6, 3, 2, 17], nH=6, nkv=2, hd=16, bs=4,
                              seed=8)


ATTENTION_CASES = {
    # graph padding longer than a query tile (40 tokens: several passes of the zeroing loop), three
    # query heads a KV head (not a power of two: masked head rows), split and not
    "attention_long_padding_g3": lambda: ac.check_attention(triton_paged_attention, "cpu", F32,
                                                            [1, 4, 0, 2], [6, 3, 2, 17], nH=6, nkv=2,
                                                            hd=16, bs=4, pad=40, seed=9),
    "attention_long_padding_g3_split": lambda: ac.check_attention(
        lambda *a, **k: triton_paged_attention(*a, num_splits=3, block_n=16, **k), "cpu", F32,
        [1, 4, 0, 2], [6, 3, 200, 140], nH=6, nkv=2, hd=16, bs=4, pad=40, seed=10),
    "attention_leading_tokens": _leading_tokens,
    "attention_decode": lambda: ac.check_attention(triton_paged_attention, "cpu", F32,
                                                   [1, 4, 0, 4], [6, 3, 2, 17], nH=8, nkv=2,
                                                   hd=16, bs=4),
    "attention_split": lambda: ac.check_attention(
        lambda *a, **k: triton_paged_attention(*a, num_splits=3, block_n=16, **k), "cpu", F32,
        [1, 4, 0, 4], [6, 3, 200, 140], nH=8, nkv=2, hd=16, bs=4, seed=2),
    # decode / verify rows split by the default rule: ranges cut from each row's own length (rows of
    # 1, 44, 64, 301 and 703 keys and an empty one), under the batch's own bound, 8192 and 262144;
    # only the ranges inside a row are stored and combined. Under 8192 and 262144 the rule takes
    # the same range count (22), so cut from the rows the outputs are the same bits. The rows of 4
    # query tokens combine in one load there, and in the loop under the batch's own bound (6 ranges)
    "attention_decode_row_split": lambda: _row_split_bounds(),
    "attention_prefill": lambda: ac.check_attention(triton_paged_attention, "cpu", F32,
                                                    [20, 3], [0, 5], nH=4, nkv=4, hd=32, bs=8,
                                                    seed=1),
    # prefill tiles with their keys split into ranges (several query blocks a row, causal), forced
    # and by the automatic rule (a short chunk after a long context: few tiles, many keys)
    "attention_prefill_split": lambda: ac.check_attention(
        lambda *a, **k: triton_paged_attention(*a, num_splits=3, block_q=8, block_n=16, **k), "cpu", F32,
        [20, 3, 37], [0, 5, 90], nH=4, nkv=2, hd=16, bs=4, seed=4),
    "attention_prefill_split_auto_f16": lambda: ac.check_attention(
        lambda *a, **k: triton_paged_attention(*a, block_q=8, **k), "cpu", torch.float16,
        [21, 2], [1100, 7], nH=4, nkv=2, hd=16, bs=16, seed=5),
    # FP8 KV cache (codes over the whole e4m3 range, non-unit scales): float32 and float16 q
    "attention_fp8_decode": lambda: ac.check_attention(triton_paged_attention, "cpu", F32,
                                                       [1, 4, 0, 4], [6, 3, 2, 17], nH=8, nkv=2,
                                                       hd=16, bs=4, kv_scales=(0.0123, 0.37)),
    # an FP8 cache under the default rule's row-cut ranges (a 262144 bound), an 8-token verify row
    "attention_fp8_decode_row_split": lambda: ac.check_attention(
        lambda q, kc, vc, qsl, sl, bt, sc, mq, ms, **k: triton_paged_attention(
            q, kc, vc, qsl, sl, bt, sc, mq, 262144, block_n=16, **k), "cpu", torch.float16,
        [1, 8, 0, 3], [300, 40, 5, 700], nH=4, nkv=2, hd=16, bs=4, seed=7, kv_scales=(0.004, 2.5)),
    "attention_fp8_split_f16": lambda: ac.check_attention(
        lambda *a, **k: triton_paged_attention(*a, num_splits=3, block_n=16, **k), "cpu",
        torch.float16, [1, 3, 0], [6, 150, 40], nH=4, nkv=2, hd=16, bs=4, seed=3,
        kv_scales=(0.004, 2.5)),
    "attention_fp8_prefill": lambda: ac.check_attention(triton_paged_attention, "cpu", F32,
                                                        [20, 3], [0, 5], nH=4, nkv=4, hd=32, bs=8,
                                                        seed=1, kv_scales=(0.02, 0.005)),
}
