"""Rollouts with a Hugging Face transformers model and our own decoding loop.

The loop calls the model's forward with its KV cache, so the RNG (a seeded
``torch.Generator``) and the logprobs are ours, not ``model.generate``'s.

Logprob choice: ``generation_logprobs`` at a sampled token is
``log_softmax(logits / temperature)`` in float32, taken BEFORE top-p filtering. That is
what the trainer computes for the same temperature, so trainer/rollout logprob parity is
exact up to kernel numerics; with ``top_p < 1`` it is the logprob under the unfiltered
(temperature-scaled) distribution, not under the truncated one the token was drawn from.
Greedy decoding reports ``log_softmax(logits)`` (temperature 1).
"""

from __future__ import annotations

import copy
import time
from typing import Iterable, List, Tuple

import torch
import transformers
from transformers import AutoModelForCausalLM, TopPLogitsWarper

from mcore_rl.config.schema import GenerationConfig
from mcore_rl.data.batch import Batch
from mcore_rl.generation.base import GenerationBackend


class HFGenerationBackend(GenerationBackend):
    """Batched sampling (temperature, top-p) or greedy decoding with a transformers model.

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
        if not cfg.temperature > 0:
            raise ValueError(f"generation.temperature must be > 0, got {cfg.temperature}")
        if not 0 < cfg.top_p <= 1:
            raise ValueError(f"generation.top_p must be in (0, 1], got {cfg.top_p}")
        if cfg.max_new_tokens < 1:
            raise ValueError(f"generation.max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
        if cfg.batch_size < 1:
            raise ValueError(f"generation.batch_size must be >= 1, got {cfg.batch_size}")
        if max_total_length < 2:
            raise ValueError(f"max_total_length (data.max_total_length) must be >= 2, got {max_total_length}")
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
        self._top_p = TopPLogitsWarper(cfg.top_p) if cfg.top_p < 1 else None
        self._weights_loaded = False
        self.last_refit_seconds = 0.0
        self.last_refit_bytes = 0

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

    @torch.inference_mode()
    def generate(self, prompts: List[List[int]], seed: int, greedy: bool = False) -> Batch:
        """See :meth:`GenerationBackend.generate`. Prompts are decoded in chunks of
        ``generation.batch_size``; a row stops at eos or after ``min(max_new_tokens,
        max_total_length - prompt length)`` tokens. Sampling: temperature, then top-p
        (nucleus, Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration",
        sec. 3.1), drawn with ``torch.multinomial`` from a generator seeded with ``seed``.
        """
        if not self._weights_loaded:
            raise RuntimeError(
                "HFGenerationBackend.generate: no weights were loaded; call update_weights "
                "(refit from the policy) first"
            )
        self._check_prompts(prompts)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(seed))
        responses = []
        for start in range(0, len(prompts), self.cfg.batch_size):
            chunk = prompts[start:start + self.cfg.batch_size]
            responses.extend(self._generate_chunk(chunk, generator, greedy))
        return self._assemble(prompts, responses)

    def _check_prompts(self, prompts: List[List[int]]) -> None:
        if not prompts:
            raise ValueError("generate: no prompts")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"generate: prompt {i} is empty")
            if len(prompt) >= self.max_total_length:
                raise ValueError(
                    f"generate: prompt {i} has {len(prompt)} tokens, leaving no room for a response "
                    f"under max_total_length (data.max_total_length) = {self.max_total_length}"
                )
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"generate: prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:8]}")

    def _next_tokens(self, logits: torch.Tensor, generator: torch.Generator, greedy: bool):
        """Tokens [n] int64 and their logprobs [n] float32 from last-position logits [n, V]."""
        logits = logits.float()
        if greedy:
            tokens = logits.argmax(dim=-1)
            logprobs = torch.log_softmax(logits, dim=-1)
        else:
            scaled = logits / self.cfg.temperature
            logprobs = torch.log_softmax(scaled, dim=-1)  # before top-p: see the module docstring
            if self._top_p is not None:
                scaled = self._top_p(None, scaled)
            probs = torch.softmax(scaled, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    def _generate_chunk(self, prompts: List[List[int]], generator: torch.Generator, greedy: bool):
        """Decode one chunk; returns per prompt ``(tokens [R] int64, logprobs [R] float32,
        truncated bool)`` on the CPU, R the response length."""
        n, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long, device=self.device)
        attention_mask = torch.zeros((n, width), dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token at width-1
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        budget = torch.tensor(
            [min(self.cfg.max_new_tokens, self.max_total_length - len(p)) for p in prompts],
            device=self.device,
        )
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        tokens, logprobs, active = [], [], []
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1)
        for step in range(int(budget.max())):
            token, logprob = self._next_tokens(out.logits[:, -1], generator, greedy)
            token = token.masked_fill(done, self.pad_token_id)
            tokens.append(token)
            logprobs.append(logprob)
            active.append(~done)
            done = done | (token == self.eos_token_id) | (budget <= step + 1)
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
            hit_eos = bool(tokens[i, r - 1] == self.eos_token_id)
            results.append((tokens[i, :r], logprobs[i, :r], not hit_eos))
        return results

    def _assemble(self, prompts: List[List[int]], responses) -> Batch:
        """The right-padded batch (keys in :meth:`GenerationBackend.generate`)."""
        prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        response_lengths = torch.tensor([len(r[0]) for r in responses], dtype=torch.long)
        input_lengths = prompt_lengths + response_lengths
        b, s = len(prompts), int(input_lengths.max())
        input_ids = torch.full((b, s), self.pad_token_id, dtype=torch.long)
        token_mask = torch.zeros((b, s), dtype=torch.float32)
        generation_logprobs = torch.zeros((b, s), dtype=torch.float32)
        for i, (prompt, (tokens, logprobs, _)) in enumerate(zip(prompts, responses)):
            p, end = len(prompt), int(input_lengths[i])
            input_ids[i, :p] = torch.tensor(prompt, dtype=torch.long)
            input_ids[i, p:end] = tokens
            token_mask[i, p:end] = 1.0
            generation_logprobs[i, p:end] = logprobs
        return {
            "input_ids": input_ids,
            "input_lengths": input_lengths,
            "prompt_lengths": prompt_lengths,
            "response_lengths": response_lengths,
            "token_mask": token_mask,
            "generation_logprobs": generation_logprobs,
            "truncated": torch.tensor([float(r[2]) for r in responses], dtype=torch.float32),
        }
