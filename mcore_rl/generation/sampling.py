"""Next-token sampling of every rollout backend: temperature, top-p, greedy, and the logprob
convention, driven by per-row random streams.

Logprob convention: ``generation_logprobs`` at a sampled token is
``log_softmax(logits / temperature)`` in float32, taken BEFORE top-p filtering. That is what the
trainer computes for the same temperature, so trainer/rollout logprob parity is exact up to
kernel numerics; with ``top_p < 1`` it is the logprob under the unfiltered (temperature-scaled)
distribution, not under the truncated one the token was drawn from. Greedy decoding reports
``log_softmax(logits)`` (temperature 1).

Randomness: row ``r`` of a ``generate`` call (its index among the call's prompts) draws its
``k``-th response token with the ``k``-th number of a uniform stream of its own
(:func:`row_uniforms`, a ``torch.Generator`` seeded with ``(seed, r)``), by inverse transform
sampling (the inversion method, Devroye 1986, "Non-Uniform Random Variate Generation", ch. II.2:
the token whose cumulative-probability interval holds the uniform: :func:`scan_inverse`, or with
``generation.block_sampling`` the same inversion in two levels, :func:`block_inverse`, whose
cumulative sums round differently). Rollouts therefore depend only on the seed,
the prompts and the logits: not on ``generation.batch_size``, on how rows are split over
data-parallel ranks, or on the backend (among those sampling with :class:`Sampler`; the ``vllm``
backend gives each row's request the seed :func:`row_seed` and samples with vLLM's own method).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from transformers import TopPLogitsWarper

from mcore_rl.config.checks import check
from mcore_rl.config.schema import GenerationConfig

# A row stream's seed is (seed * _SEED_MULTIPLIER + row) mod 2**32: torch's CPU generator
# (mt19937) keeps only 32 bits of a seed. Odd multiplier (Knuth's multiplicative hash constant,
# TAOCP vol. 3, sec. 6.4), so the streams of one seed's rows are distinct.
_SEED_MULTIPLIER = 2654435761


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row``'s random stream in a ``generate`` call seeded with ``seed``:
    ``(seed * 2654435761 + row) mod 2**32`` (the ``vllm`` backend hands it to the engine as the
    request's seed).

    Raises:
        ValueError: ``row`` outside ``[0, 2**32)``.
    """
    if not 0 <= row < 2**32:
        raise ValueError(f"row_seed: row index {row} outside [0, 2**32)")
    return (int(seed) * _SEED_MULTIPLIER + int(row)) % 2**32


def row_uniforms(seed: int, rows: Sequence[int], steps: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The uniform streams of ``rows``: ``[len(rows), steps]`` float32 in ``[0, 1)`` on ``device``.

    Row ``r``'s stream is ``torch.rand(steps)`` from a generator seeded with
    :func:`row_seed` ``(seed, r)``, so distinct rows of one seed never share a stream
    (for ``r < 2**32``) and a prefix of ``steps`` is the same whatever ``steps`` is.

    Raises:
        ValueError: a row index outside ``[0, 2**32)`` or ``steps < 0``.
    """
    if steps < 0:
        raise ValueError(f"row_uniforms: steps must be >= 0, got {steps}")
    out = torch.empty((len(rows), steps), dtype=torch.float32, device=device)
    generator = torch.Generator(device=device)
    for i, row in enumerate(rows):
        generator.manual_seed(row_seed(seed, row))
        out[i] = torch.rand(steps, generator=generator, device=device)
    return out


def check_sampling(cfg: GenerationConfig) -> None:
    """Raise ``ConfigError`` (a ``ValueError``) naming the key when a ``generation`` value
    (``temperature`` > 0, ``top_p`` in (0, 1], ...) is outside what the schema declares
    (:func:`mcore_rl.config.checks.check`, the check config loading runs)."""
    check(cfg, "generation")


def last_with_mass(probs: torch.Tensor) -> torch.Tensor:
    """The index of each row's last token with probability > 0: ``[n]`` int32 of ``probs``
    ``[n, V]`` (0 for a row with none), by one max over ``where(probs > 0, index, 0)`` (no scan;
    the same numbers as ``(probs > 0).int().cumsum(-1).argmax(-1)``, whose first maximum is that
    token). The index tensor is made at each call, not kept: a CUDA graph of a decode step must
    own every buffer it reads."""
    index = torch.arange(probs.shape[-1], dtype=torch.int32, device=probs.device)
    return (probs > 0).mul(index).amax(dim=-1)


class Sampler:
    """Picks next tokens from last-position logits under the module's conventions.

    Args:
        cfg: ``generation`` config; its ``temperature`` (> 0) scales the logits and its
            ``top_p`` in (0, 1] keeps the smallest set of most likely tokens whose mass reaches
            it (nucleus sampling, Holtzman et al. 2020, "The Curious Case of Neural Text
            Degeneration", sec. 3.1; transformers' ``TopPLogitsWarper``); 1 disables it. Its
            ``block_sampling`` draws by :func:`block_inverse` (the probabilities then ``exp``
            of the logprobs, without top-p) instead of :func:`scan_inverse`.
        compile: the compiler of :meth:`step` (``generation.compile_decode``: the megatron
            decoder passes the compiler and mode of its compiled decode layers), or None: the
            sampler runs eagerly, :meth:`step` is :meth:`__call__`.

    Compiled (:meth:`step`): one compiled callable per sampler, the row dimension of its inputs
    marked dynamic (``torch._dynamo.maybe_mark_dynamic``), so one compile serves every row
    bucket of the decoder; greedy (``uniforms`` None) and sampled calls are two graphs, each
    counted against torch.compile's recompile limit (8 by default) of :meth:`__call__`'s code,
    as are other configurations' samplers. Inductor fuses the float cast, the temperature, the
    log-softmax, the ``exp`` and the block sums into a few passes over ``[n, V]``. Not bit for
    bit :meth:`__call__` (the fused log-softmax rounds otherwise): a token's logprob within
    ``1e-5 + eps max_i |logits_i| / temperature`` of the eager one (float32's ``eps``; <= 8.9e-6
    for logits of spread <= 4), tokens the same except where the draw lies within float32
    rounding of a cdf boundary (as between :func:`block_inverse` and :func:`scan_inverse`),
    greedy tokens the same (``tests/test_sampling_compile.py``: Inductor's CPU kernels with
    AVX2-wide vectors; with torch 2.13's default width under the pinned AVX2 arithmetic they
    compute it wrong, so the megatron decoder compiles it on CUDA only). Top-p (transformers'
    ``TopPLogitsWarper``: a sort, a scan and a scatter) compiles in the same graph.

    Raises:
        ValueError: ``generation.temperature`` or ``generation.top_p`` out of range
            (:func:`check_sampling`).
    """

    def __init__(self, cfg: GenerationConfig, compile: Optional[Callable] = None):
        check_sampling(cfg)
        self.temperature = float(cfg.temperature)
        self.top_p = float(cfg.top_p)
        self.blocks = bool(cfg.block_sampling)
        self._top_p = TopPLogitsWarper(cfg.top_p) if cfg.top_p < 1 else None
        self._compiled = None if compile is None else compile(self.__call__)

    def step(self, logits: torch.Tensor,
             uniforms: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`__call__` compiled (with a ``compile``; eager without), the row dimension of
        ``logits`` and ``uniforms`` marked dynamic: the megatron decoder's decode steps (class
        docstring: the bound against the eager call)."""
        if self._compiled is None:
            return self(logits, uniforms)
        for t in (logits, uniforms):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return self._compiled(logits, uniforms)

    def __call__(self, logits: torch.Tensor,
                 uniforms: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Next tokens and their logprobs.

        Args:
            logits: ``[n, V]`` over the real vocabulary (no padded columns), any float dtype.
            uniforms: ``[n]`` numbers in ``[0, 1)`` (one per row, from :func:`row_uniforms`);
                None decodes greedily (argmax).

        Returns:
            ``tokens`` ``[n]`` int64 and their ``logprobs`` ``[n]`` float32 (module docstring),
            on the device of ``logits``.
        """
        logits = logits.float()
        if uniforms is None:
            tokens = logits.argmax(dim=-1)
            logprobs = torch.log_softmax(logits, dim=-1)
        else:
            # x / 1.0 == x exactly: temperature 1 skips a pass over [n, V].
            scaled = logits if self.temperature == 1.0 else logits / self.temperature
            logprobs = torch.log_softmax(scaled, dim=-1)  # before top-p: see the module docstring
            if self._top_p is not None:
                scaled = self._top_p(None, scaled)
                probs = torch.softmax(scaled, dim=-1)
            elif self.blocks:  # the probabilities from the logprobs: no second softmax
                probs = logprobs.exp()
            else:
                probs = torch.softmax(scaled, dim=-1)
            uniforms = uniforms.to(probs.device, torch.float32)
            tokens = block_inverse(probs, uniforms) if self.blocks else \
                scan_inverse(probs, uniforms)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def scan_inverse(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse transform sampling over the whole vocabulary (the module docstring's draw):
    token ``i`` of row ``r`` is the first whose ``cdf = cumsum(probs)`` exceeds ``uniforms[r] *
    cdf[-1]``.

    Args:
        probs: ``[n, V]`` float32, non-negative, each row with mass.
        uniforms: ``[n]`` float32 in ``[0, 1)`` on ``probs``' device.

    Returns:
        ``[n]`` int64 tokens, each with probability > 0.
    """
    cdf = probs.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Rounding (of a parallel scan's cdf) can put the draw past the last token with mass:
    # take that token then.
    return torch.minimum(tokens, last_with_mass(probs))


# Most tokens per block of block_inverse: 192 blocks of the 49,152-token SmolLM2 vocabulary.
_BLOCK = 256


def block_inverse(probs: torch.Tensor, uniforms: torch.Tensor, block: int = _BLOCK
                  ) -> torch.Tensor:
    """:func:`scan_inverse` in two levels (``generation.block_sampling``): the vocabulary in
    blocks of ``b`` tokens (``b``: ``block`` halved while it does not divide ``V``, down to 32;
    below that the probabilities are padded with zeros to a multiple of ``block``, one copy);
    one sum per block and a scan over the ``ceil(V / block)`` block sums pick the block whose
    cumulative interval holds ``uniforms[r] * total``, and a scan of that block's ``block``
    probabilities picks the token inside it. The same inversion (the cdf at token ``i`` is the
    blocks before it plus the tokens before it in its block), without the scan, the second
    softmax and the max over the whole ``[n, V]`` tensor of :func:`scan_inverse`: its full
    passes are one sum (and, from :class:`Sampler`, one ``exp``); the rest are ``[n, V / b]``
    and ``[n, b]`` tensors.

    Not bit for bit :func:`scan_inverse`: the cumulative sums are rounded in another order, so
    a token differs only where the target lies within that rounding of an interval's boundary
    (a few float32 ulps of the total: <= 1.2e-7 measured over the differing draws of 20,000
    rows a vocabulary, ``tests/test_generation.py``; there only uniforms at the ends of
    ``[0, 1)`` drew other tokens). Per draw that is about ``sum_i min(p_i, rounding at
    token i)``: negligible for peaked distributions, up to ~``V x 1e-7`` for near-flat ones
    over ``V`` tokens (random weights over SmolLM2's 49,152: 1 row of 16 left the scan's
    tokens within 15 steps, ``SMOKE=1 scripts/gpu/decode_step_profile.py``); from there the
    row's rollout is another sample of the same distribution. A token with probability 0 is
    never drawn.

    Args / Returns: as :func:`scan_inverse`; ``block`` >= 1.
    """
    n, vocab = probs.shape
    block = min(block, vocab)
    while block > 32 and vocab % block:
        block //= 2
    count = -(-vocab // block)
    if count * block != vocab:  # zero mass past the vocabulary: never drawn
        probs = F.pad(probs, (0, count * block - vocab))
    blocks = probs.view(n, count, block)
    sums = blocks.sum(-1)  # [n, count]
    cdf = sums.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)  # [n, 1]
    # the first block whose cumulative sum exceeds the target; rounding can put the target
    # past the last block with mass: that block then
    chosen = torch.minimum(torch.searchsorted(cdf, target, right=True),
                           last_with_mass(sums)[:, None])  # [n, 1] int64
    before = F.pad(cdf, (1, 0)).gather(1, chosen)  # the mass of the blocks before it
    inside = blocks.gather(1, chosen[:, :, None].expand(n, 1, block))[:, 0]  # [n, block]
    # target - before >= 0: the chosen block's predecessors sum to at most the target
    offset = torch.searchsorted(inside.cumsum(dim=-1), target - before, right=True)
    offset = torch.minimum(offset, last_with_mass(inside)[:, None])
    return (chosen * block + offset).squeeze(-1)
