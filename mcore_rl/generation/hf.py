"""Rollouts with a Hugging Face transformers model and our own decoding loop.

The loop calls the model's forward with its KV cache (prompts left-padded), so the random
streams and the logprobs are ours (:mod:`mcore_rl.generation.sampling`: logprobs of
``logits / temperature`` taken before top-p), not ``model.generate``'s.
"""

from __future__ import annotations

import copy
import time
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import transformers
from transformers import AutoModelForCausalLM

from mcore_rl.config.schema import GenerationConfig
from mcore_rl.generation.base import (BackendContext, FinishedGroup, GenerationBackend,
                                      GroupAssembler, Response, check_lengths, check_prompts,
                                      response_budgets, stop_ids)
from mcore_rl.generation.remote import RemoteGeneration
from mcore_rl.generation.sampling import Sampler, row_uniforms
from mcore_rl.workers.interfaces import PolicyAPI


class HFGenerationBackend(GenerationBackend):
    """Batched sampling (temperature, top-p) or greedy decoding with a transformers model in
    the controller's process (``generation.backend: hf``); refit pulls the policy's Hugging
    Face-named weights (:meth:`refit`, :meth:`update_weights`).

    Args:
        hf_config: the causal LM's config; the model is built by
            ``AutoModelForCausalLM.from_config`` (a copy of it; weights come only by
            :meth:`update_weights`).
        cfg: ``generation`` config (temperature, top_p, max_new_tokens, batch_size).
        eos_token_id: ends a response (kept as its last token).
        pad_token_id: fills ``input_ids`` after a row's end.
        max_total_length: cap on prompt + response tokens (``data.max_total_length``).
        device: where the model runs.
        dtype: the model's parameter dtype; logprobs are always float32.

    Raises:
        ValueError: a ``generation.*`` value or ``max_total_length`` out of range.
    """

    def __init__(
        self,
        hf_config: transformers.PretrainedConfig,
        cfg: GenerationConfig,
        eos_token_id: int,
        pad_token_id: int,
        max_total_length: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.sampler = Sampler(cfg)
        check_lengths(cfg, max_total_length)
        self.cfg = cfg
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.max_total_length = int(max_total_length)
        self.device = torch.device(device)
        with self.device:
            # from_config writes the dtype into the config it gets: give it a copy.
            self.model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=dtype)
        self.model.eval().requires_grad_(False)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self._weights_loaded = False
        self.last_refit_seconds = 0.0
        self.last_refit_bytes = 0

    @classmethod
    def from_context(cls, ctx: BackendContext) -> GenerationBackend:
        """The run's backend: the policy's ``hf_config`` on the run's device (fp32), in the
        controller's process, or with ``generation.num_workers`` > 0 in that many processes of
        its own (:class:`~mcore_rl.generation.remote.RemoteGeneration`)."""
        if ctx.cfg.generation.num_workers:
            return RemoteGeneration.from_context(ctx, engine=cls)
        return cls(ctx.hf_config, ctx.cfg.generation, ctx.eos_token_id, ctx.pad_token_id,
                   ctx.cfg.data.max_total_length, device=ctx.device)

    @classmethod
    def worker_groups(cls, cfg) -> Dict[str, int]:
        """``{"generation": generation.num_workers}`` when the model runs in processes of its
        own, else none."""
        n = cfg.generation.num_workers
        return {"generation": n} if n else {}

    def refit(self, policy) -> Dict[str, float]:
        """Pull the policy's full Hugging Face-named weights (``get_hf_weights``, gathered over
        TP and PP to policy rank 0, on the host) and copy them in (:meth:`update_weights`).
        Returns ``refit/gbytes``."""
        self.update_weights(policy.call(PolicyAPI).get_hf_weights()[0].items())
        return {"refit/gbytes": self.last_refit_bytes / 1e9}

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Refit from ``(name, tensor)`` pairs, Hugging Face names, full tensors, streamed.

        Every parameter must be written; a tied ``lm_head.weight`` may be absent (writing
        ``model.embed_tokens.weight`` writes it). Tensors are cast to the model's dtype and
        device. Sets ``last_refit_seconds`` (wall seconds) and ``last_refit_bytes`` (bytes
        received). After a failed refit :meth:`generate` refuses to run until a good one.

        Raises:
            ValueError: unknown names, a shape mismatch, or parameters left unwritten.
        """
        start = time.perf_counter()
        self._weights_loaded = False
        targets = self.model.state_dict(keep_vars=True)  # includes tied aliases
        params = dict(self.model.named_parameters())  # one name per (tied) parameter
        written, unknown, nbytes = set(), [], 0
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                unknown.append(name)
                continue
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            written.add(id(target))
            nbytes += tensor.numel() * tensor.element_size()
        missing = [n for n, p in params.items() if id(p) not in written]
        if unknown or missing:
            raise ValueError(
                f"update_weights: unknown names {unknown}; parameters left unwritten {missing}"
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._weights_loaded = True
        self.last_refit_seconds = time.perf_counter() - start
        self.last_refit_bytes = nbytes

    def generate_async(self, prompts: List[List[int]], seed: int, greedy: bool = False,
                       group_size: int = 1, first_row: int = 0,
                       stop_token_ids: Optional[Sequence[int]] = None) -> Iterator[FinishedGroup]:
        """See :meth:`GenerationBackend.generate_async`. Decodes while iterated, in chunks of
        ``generation.batch_size`` prompts; the groups a chunk completes come after it. A row
        stops at eos (or at any of ``stop_token_ids``, when given) or after ``min(max_new_tokens, max_total_length - prompt length)`` tokens.
        Sampling: :class:`~mcore_rl.generation.sampling.Sampler` with row ``i``'s stream
        ``row_uniforms(seed, [first_row + i], ...)``: ``first_row`` places these prompts in a
        larger call whose rows are decoded in parts (by several processes) and must sample as
        that call would.
        """
        if not self._weights_loaded:
            raise RuntimeError(
                "HFGenerationBackend.generate: no weights were loaded; call update_weights "
                "(refit from the policy) first"
            )
        check_prompts(prompts, self.vocab_size, self.max_total_length)
        stops = stop_ids(self.cfg, self.eos_token_id, stop_token_ids)
        return self._decode(prompts, seed, greedy, GroupAssembler(len(prompts), group_size),
                            first_row, stops)

    def _decode(self, prompts: List[List[int]], seed: int, greedy: bool,
                groups: GroupAssembler, first_row: int,
                stops: List[int]) -> Iterator[FinishedGroup]:
        for start in range(0, len(prompts), self.cfg.batch_size):
            rows = range(start, min(start + self.cfg.batch_size, len(prompts)))
            streams = range(first_row + rows.start, first_row + rows.stop)
            yield from groups.add(start, self._generate_chunk([prompts[i] for i in rows], streams,
                                                              seed, greedy, stops))

    @torch.inference_mode()
    def _generate_chunk(self, prompts: List[List[int]], rows: range, seed: int,
                        greedy: bool, stops: List[int]) -> List[Response]:
        """Decode one chunk (``rows``: the prompts' indices in the ``generate`` call; a row ends
        at a token of ``stops``)."""
        n, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token at width-1
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p):] = 1
        # built on the host, one copy each (not a blocking copy per row)
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        budget = torch.tensor(response_budgets(prompts, self.cfg.max_new_tokens, self.max_total_length),
                              device=self.device)
        steps = int(budget.max())
        uniforms = None if greedy else row_uniforms(seed, rows, steps, self.device)
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        stop_tensor = torch.tensor(stops, dtype=torch.long, device=self.device)
        tokens, logprobs, active = [], [], []
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1)
        for step in range(steps):
            token, logprob = self.sampler(out.logits[:, -1], None if greedy else uniforms[:, step])
            token = token.masked_fill(done, self.pad_token_id)
            tokens.append(token)
            logprobs.append(logprob)
            active.append(~done)
            done = done | torch.isin(token, stop_tensor) | (budget <= step + 1)
            if bool(done.all()):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((n, 1))], dim=1)
            position_ids = position_ids[:, -1:] + 1
            out = self.model(input_ids=token[:, None], attention_mask=attention_mask,
                             position_ids=position_ids, past_key_values=out.past_key_values,
                             use_cache=True)
        tokens = torch.stack(tokens, 1).cpu()
        logprobs = torch.stack(logprobs, 1).float().cpu()
        lengths = torch.stack(active, 1).sum(1).cpu()
        results = []
        for i in range(n):
            r = int(lengths[i])
            hit_eos = int(tokens[i, r - 1]) in stops
            results.append(Response(tokens[i, :r], logprobs[i, :r], not hit_eos))
        return results
