"""The decode attention alone on one GPU (issue 37): microseconds a call (in a CUDA graph) of the Triton
flash-decoding kernel (mcore_rl/megatron/flash_decode.py) per tuning (keys a block, warps a
program) against bmm (``decode_attention``, compiled: scores product, softmax, values product),
at SmolLM2-135M's attention (9 query heads, 3 KV groups, head size 64), bf16, 256 rows, for the
rows' own keys (span 300) and the shared-prompt layout (32 prompts of 150 keys, groups of 8,
response span 150; and the GSM8K step's power-of-two buckets), each tuning with and without
``tail_skip`` (the loops stopped after a row's last kept key). Prints a table; each kernel
checked against the fp32 reference.

    python3 scripts/gpu/flash_decode_bench.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.megatron.attention import decode_attention  # noqa: E402
from mcore_rl.megatron.flash_decode import launch, reference_decode  # noqa: E402


def _time(fn, n=20, replays=20) -> float:
    """Device microseconds a call: ``n`` calls captured in one CUDA graph (as the decoder
    replays them: no host launch cost), the graph replayed ``replays`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    return replay_ms(graph, replays) * 1000 / n


def replay_ms(graph, replays: int) -> float:
    """Device milliseconds a replay of ``graph``: one replay to warm up, then ``replays`` back
    to back timed by CUDA events (no host launch cost between them)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    b, ng, nq, d, scale = 256, 3, 3, 64, 64 ** -0.5
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, ng * nq, d, device=dev, dtype=dt, generator=g)
    cache = [torch.randn(b, ng, 513, d, device=dev, dtype=dt, generator=g) for _ in range(2)]
    prompt = [torch.randn(32, ng, 257, d, device=dev, dtype=dt, generator=g) for _ in range(2)]
    layouts = {}
    span = 300
    last = torch.randint(span // 2, span, (b,), device=dev, generator=g)
    layouts["rows"] = (cache[0][:, :, :span], cache[1][:, :, :span],
                       torch.arange(span, device=dev)[None] > last[:, None], None, None)
    sp, sr = 150, 150
    lengths = torch.randint(80, sp + 1, (b,), device=dev, generator=g)
    mask = torch.cat((torch.arange(sp, device=dev)[None] >= lengths[:, None],
                      torch.arange(sr, device=dev)[None] > last[:, None] - span // 2), 1)
    layouts["shared"] = (cache[0][:, :, :sr], cache[1][:, :, :sr], mask,
                         prompt[0][:, :, :sp], prompt[1][:, :, :sp])
    # the GSM8K step's buckets: prompt span 256 (each group's prompt 90-210 tokens), response
    # span 256 at response token 160 of every row (the decoder's power-of-two spans)
    sp = sr = 256
    plen = torch.randint(90, 211, (32,), device=dev, generator=g).repeat_interleave(8)
    mask = torch.cat((torch.arange(sp, device=dev)[None] >= plen[:, None],
                      (torch.arange(sr, device=dev) > 160)[None].expand(b, sr)), 1)
    layouts["buckets"] = (cache[0][:, :, :sr], cache[1][:, :, :sr], mask,
                          prompt[0][:, :, :sp], prompt[1][:, :, :sp])
    bmm = torch.compile(decode_attention)
    print(f"{'layout':8s} {'kernel':24s} {'us/call':>9s} {'max err':>9s}")
    for name, (k, v, m, pk, pv) in layouts.items():
        ref = reference_decode(q, k, v, m, scale, pk, pv).float()
        if pk is None:
            us = _time(lambda: bmm(q[None], k, v, m, scale))
            err = (bmm(q[None], k, v, m, scale)[0].view_as(q).float() - ref).abs().max()
            print(f"{name:8s} {'bmm (compiled)':24s} {us:9.1f} {float(err):9.4f}")
        for block_n, warps in ((16, 2), (32, 1), (32, 2), (32, 4), (64, 2), (64, 4)):
            for tail in (False, True):
                def call():
                    return launch(q, k, v, m, scale, pk, pv, block_n=block_n, num_warps=warps,
                                  tail_skip=tail)
                label = f"triton n={block_n} w={warps}{' skip' if tail else ''}"
                try:
                    err = (call().float() - ref).abs().max()
                    us = _time(call)
                except Exception as e:  # a tuning that does not compile
                    print(f"{name:8s} {label}: FAILED {e}"[:200])
                    continue
                print(f"{name:8s} {label:24s} {us:9.1f} {float(err):9.4f}")


if __name__ == "__main__":
    main()
