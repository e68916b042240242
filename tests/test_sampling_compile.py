"""generation.compile_decode compiles the decode step's sampler (:meth:`Sampler.step`): Inductor
(CPU C++ kernels) against the eager :class:`Sampler`, on a few thousand rows of a 49,152-token
vocabulary (SmolLM2's) and of a small odd one (97): logit spreads from flat to peaked enough
that tokens underflow to probability 0, -inf heads and tails, fp32 and bf16 logits, uniforms
from 0 to the largest float32 below 1, row counts from 8 to 512 (one compile for all).

- Logprobs of equal tokens within ``1e-5 + eps max_i |x_i| / T`` (``eps`` float32's machine
  epsilon, ``x`` the row's finite logits, ``T`` the temperature; 1 at greedy): the fused
  log-softmax rounds the log-sum-exp and the scaled logits otherwise than ATen's kernels.
  Measured <= 0.74 of that bound; 8.9e-6 at most over rows of logit spread <= 4, 1.05e-4 over
  rows of spread 200 (logits ~ 900, scaled ~ 1300: an ulp there is 1.2e-4); temperature 1 in
  fp32: equal.
- Tokens equal except where the draw lies within float32 rounding of a cdf boundary between
  the two tokens: the target within 1e-6 of the eager cdf there (in float64; measured <=
  1.2e-7; as between :func:`block_inverse` and :func:`scan_inverse` in
  tests/test_generation.py). Apart from uniforms at the ends of [0, 1), at most ``n / 250``
  rows differ (measured: 3 of 1,536 for the whole-vocabulary scan at 49,152 tokens, whose
  near-flat rows Inductor's scan sums in another order; none with block_sampling or top-p);
  a token with probability 0 is never drawn. Greedy tokens equal.

Inductor's CPU kernels are compiled with ``cpp.simdlen=256`` (the AVX2 vectors of the pinned
arithmetic, tests/conftest.py): with its default, torch 2.13 loops over 16 floats with 8-float
vectors at the 49,152-token vocabulary with dynamic rows and returns wrong tokens and logprobs
or corrupts the heap, so the decoder keeps the sampler eager on the CPU
(:class:`~mcore_rl.generation.megatron.MegatronDecoder`).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.compile_fx import compile_fx

from mcore_rl.config.schema import GenerationConfig
from mcore_rl.generation.sampling import Sampler

EPS = torch.finfo(torch.float32).eps
# (temperature, top_p, block_sampling): the SmolLM2 recipes' draw, the scan at temperature 1
# (no division), top-p
CONFIGS = [(0.7, 1.0, True), (1.0, 1.0, False), (0.7, 0.8, False)]
SPREADS = (0.1, 1.0, 4.0, 30.0, 200.0)


def _rows(n: int, vocab: int, seed: int):
    """Logits ``[n, vocab]`` of the module docstring's spreads and -inf heads and tails, their
    spread per row, and uniforms (every 11th the largest float32 below 1, every 13th 0)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.tensor(SPREADS).repeat(n // len(SPREADS) + 1)[:n]
    logits = torch.randn(n, vocab, generator=g) * spread[:, None]
    logits[::3, -5:] = float("-inf")
    logits[1::7, :4] = float("-inf")
    uniforms = torch.rand(n, generator=g)
    ends = torch.zeros(n, dtype=torch.bool)
    ends[::11] = ends[1::13] = True
    uniforms[::11] = 1 - 2.0 ** -24
    uniforms[1::13] = 0.0
    return logits, spread, uniforms, ends


def _eager_cdf(sampler: Sampler, logits: torch.Tensor) -> torch.Tensor:
    """The normalized cdf (float64) of the distribution the eager sampler draws from: the
    softmax of the temperature-scaled logits, after top-p."""
    scaled = logits.float() / sampler.temperature
    if sampler._top_p is not None:
        scaled = sampler._top_p(None, scaled)
    cdf = torch.softmax(scaled.double(), -1).cumsum(-1)
    return cdf / cdf[:, -1:]


def _chunks(n: int, sizes):
    """Slices over ``n`` rows of the sizes ``sizes`` in turn (the last one shorter)."""
    out, start, k = [], 0, 0
    while start < n:
        out.append(slice(start, min(start + sizes[k % len(sizes)], n)))
        start, k = out[-1].stop, k + 1
    return out


@pytest.fixture
def inductor():
    """A compiler that counts its graphs: ``(compile, graphs)``, Inductor with AVX2-wide
    vectors (module docstring); torch.compile's caches reset around the test."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    with inductor_config.patch({"cpp.simdlen": 256}):
        yield functools.partial(torch.compile, backend=backend), graphs
    torch._dynamo.reset()


@pytest.mark.parametrize("vocab,n", [(49152, 1536), (97, 6000)])
@pytest.mark.parametrize("temperature,top_p,blocks", CONFIGS)
def test_compiled_sampler_is_the_eager_one_within_rounding(inductor, vocab, n, temperature,
                                                           top_p, blocks):
    compile, graphs = inductor
    cfg = GenerationConfig(temperature=temperature, top_p=top_p, block_sampling=blocks)
    sampler = Sampler(cfg, compile=compile)
    logits, spread, uniforms, ends = _rows(n, vocab, vocab)
    sizes = [512, 256, 8, 64] if vocab > 1000 else [512, 8, 64, 1000, 256]
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        ratio, worst, apart, gaps = [], {s: 0.0 for s in SPREADS}, 0, [0.0]
        for greedy in (False, True):
            for rows in _chunks(n, sizes):
                u = None if greedy else uniforms[rows]
                (t0, lp0), (t1, lp1) = sampler(x[rows], u), sampler.step(x[rows], u)
                assert torch.isfinite(lp1).all()  # never a token of probability 0
                finite = x[rows].float().masked_fill(torch.isinf(x[rows].float()), 0)
                bound = 1e-5 + EPS * finite.abs().amax(-1) / (1.0 if greedy else temperature)
                same = t0 == t1
                ratio.append(float(((lp1 - lp0).abs() / bound)[same].max()))
                for s in SPREADS:
                    pick = same & (spread[rows] == s)
                    if pick.any():
                        worst[s] = max(worst[s], float((lp1 - lp0).abs()[pick].max()))
                if greedy:
                    assert torch.equal(t0, t1)
                    continue
                differ = (~same).nonzero().squeeze(-1)
                apart += int((~ends[rows][differ]).sum())
                if differ.numel():
                    cdf = _eager_cdf(sampler, x[rows][differ])
                    low = torch.minimum(t0, t1)[differ]
                    gaps.append(float((cdf.gather(1, low[:, None])[:, 0] -
                                       u[differ].double()).abs().max()))
        print(f"\n{vocab=} {dtype} T={temperature} top_p={top_p} blocks={blocks}: logprob diff "
              f"max {max(ratio):.3f} of the bound; by spread {worst}; tokens apart (uniforms "
              f"not at the ends) {apart}, largest gap {max(gaps):.3g}")
        assert max(gaps) < 1e-6 and apart <= n // 250
        assert max(ratio) <= 1.0, max(ratio)
    # one compile for every row count: sampled and greedy, fp32 and bf16 logits
    assert len(graphs) == 4, len(graphs)


def test_step_is_the_eager_call_without_a_compiler():
    """compile_decode off: :meth:`Sampler.step` is the eager call, bit for bit."""
    sampler = Sampler(GenerationConfig(temperature=0.7, block_sampling=True))
    logits, _, uniforms, _ = _rows(40, 97, 1)
    for u in (uniforms, None):
        (t0, lp0), (t1, lp1) = sampler(logits, u), sampler.step(logits, u)
        assert torch.equal(t0, t1) and torch.equal(lp0, lp1)
