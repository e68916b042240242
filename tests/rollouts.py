"""Random right-padded rollout rows for the worker tests (the batch conventions of
``mcore_rl.data.batch``): one place for what the policy, value and layout tests feed."""

from __future__ import annotations

from typing import Dict, Tuple

import torch


def random_rows(n: int, vocab: int, prompt_lengths: Tuple[int, int], response_lengths: Tuple[int, int],
                generator: torch.Generator, extra_width: int = 0) -> Dict[str, torch.Tensor]:
    """``n`` rows of random token ids in ``[1, vocab)``, right-padded with 0.

    Args:
        prompt_lengths, response_lengths: inclusive ``(low, high)`` token counts, drawn per row.
        generator: draws the prompt lengths, the response lengths, then each row's ids, in that
            order; callers draw their extra keys from it afterwards.
        extra_width: padding columns past the longest row.

    Returns:
        ``input_ids`` [n, S] int64, ``input_lengths`` and ``prompt_lengths`` [n] int64,
        ``token_mask`` [n, S] float32 (1 on response tokens), ``sample_mask`` [n] float32 (ones).
    """
    plen = torch.randint(prompt_lengths[0], prompt_lengths[1] + 1, (n,), generator=generator)
    rlen = torch.randint(response_lengths[0], response_lengths[1] + 1, (n,), generator=generator)
    width = int((plen + rlen).max()) + extra_width
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width)
    for i in range(n):
        length = int(plen[i] + rlen[i])
        ids[i, :length] = torch.randint(1, vocab, (length,), generator=generator)
        mask[i, int(plen[i]):length] = 1
    return {"input_ids": ids, "input_lengths": plen + rlen, "prompt_lengths": plen,
            "token_mask": mask, "sample_mask": torch.ones(n)}
