"""Rollouts decoded by the policy workers with the policy's own Megatron-Core ``GPTModel``:
the weights are shared in place, so a refit copies nothing.

Two halves:

- :class:`MegatronDecoder` runs inside each policy worker (``PolicyWorker.generate``, which gets
  the class from :class:`MegatronGenerationBackend` with each call: the workers do not import
  the generation floor above them): Megatron's
  modules (embedding, transformer block, output layer) with a static KV cache
  (:class:`~mcore_rl.megatron.attention.KVCache`) and our sampling
  (:mod:`mcore_rl.generation.sampling`), so the rollout conventions are those of the ``hf``
  backend.
- :class:`MegatronGenerationBackend` is the controller's :class:`GenerationBackend`: it splits
  the prompts over the data-parallel ranks and assembles the rollout batch.

Decoding scheme. A chunk of ``generation.batch_size`` prompts fills the first rows ("slots") of
the cache. Prefill: the right-padded prompts run in one forward (causal attention; a valid token
never sees a later pad), which stores every layer's keys and values and samples each row's first
response token from the logits at its last prompt token. Decode steps: one forward of one token
per row, each row at its own position (its rotary embedding taken from Megatron's
``RotaryEmbedding`` table at that position, passed to the transformer block), writing its key and
value there and attending over its own cached positions (:func:`~mcore_rl.megatron.attention.
decode_attention`). Every tensor a step reads or writes has a fixed shape and address, so on CUDA
a step is captured once as a CUDA graph and replayed (``generation.cuda_graphs``): one graph per
(rows, attended span) bucket, rows and spans rounded up to powers of two, captured at the first
step that needs it (that step runs eagerly on the capture stream and is the warm-up) and kept
between ``generate`` calls while the parameters stay at their addresses (a colocated run frees
them with the KV cache before training: :meth:`MegatronGenerationBackend.offload`). Sampling
(temperature, top-p, per-row random streams) and the bookkeeping (eos, budgets, response
buffers) are part of the step, so replays need no host work beyond reading which rows still
run. That read never waits for the device to drain: every :data:`_SYNC_EVERY` steps the done
flags are copied to pinned host memory without blocking (a CUDA event marks the copy), and the
host acts on the copy of the previous such point, by then long done while the device still has
the steps queued since. When at most half the rows of a bucket still ran there, the batch is
compacted into the next smaller bucket (those rows' cache rows and states moved to the front),
so rows that ended stop costing; when none ran, the chunk ends. Acting on flags one period old
only compacts and stops up to :data:`_SYNC_EVERY` steps later; a row that ended steps on without
effect (nothing of it is read), so the responses are the same.

Issue 37's switches (docs/design.md, "Generation backends"): with a row sink
(``reward.score_while_decoding``) the rows the host finds ended at a sync point are sent to the
controller one period later (:class:`_Emitter`), ahead of the call's answer, so their rewards
are scored while the rest decode; ``generation.shared_prompt_kv`` lays a chunk's prompt groups
(equal consecutive prompts, :func:`_prompt_groups`) in groups of slots that read one copy of
the prompt's keys and values (prefilled once per group; compaction by whole groups);
``generation.compile_decode`` runs a decode step's layers through
:class:`~mcore_rl.megatron.decode_layer.DecodeLayers`, compiled once for every layer and bucket,
and on CUDA compiles its sampler (:meth:`~mcore_rl.generation.sampling.Sampler.step`) with
them.

Why not Megatron-Core's inference engines or CUDA graphs: its static-batching KV cache keeps one
sequence offset for the whole batch (prompt tokens past the shortest prompt were fed one position
at a time), its CUDA-graph decoding needs flash decode (flash-attn) with static batching, and its
dynamic engine asserts flash-attn >= 2.7.3 at its first forward; the GPU image has no flash-attn.
The graphs here are ``torch.cuda.CUDAGraph`` over Megatron's own modules, so they run the
``torch`` and ``local`` layer specs on megatron-core 0.16.1 (CPU, eager) to 0.19.x (GPU, bf16).

Tensor parallelism > 1 (:func:`decode_graphs`): the steps are graphs only with
``generation.cuda_graphs_tp`` (opt-in: built and tested on CPU, not run on a GPU yet), eager
otherwise. A graph then holds the step's TP collectives (the all-reduces of the
vocabulary-parallel embedding and the row-parallel layers, the all-gather of the logits): NCCL
calls captured through torch's ``ProcessGroupNCCL``, which hands captured work to no watchdog.
What Megatron-Core's and vLLM's TP graphs need holds here:

- the TP communicator exists before any capture: a chunk's prefill runs the same collectives
  eagerly before its first decode step, and each capture's warm-up step runs the step's own on
  the capture stream, the stream the capture then uses (vLLM saw NCCL 2.28's buffer
  registration fail when warm-up and capture ran on different streams);
- every TP rank captures and replays the same graphs in the same order: each decision is a
  function of what the ranks of a TP group hold alike, the config and layout (graphs or not),
  the prompts (buckets, spans, buffer growth, which drops the graphs) and the done flags the
  host reads at sync points (the logits are gathered over TP and the rows' random streams are
  the same, so every rank samples the same tokens); the one rank-local input, the parameters'
  addresses (moved: drop the graphs), is or-ed over the TP group once a call
  (:func:`_tp_any`). A capture's warm-up step runs on every rank at the same step, and
  ``torch.cuda.graph`` synchronizes the device before capturing, which waits for the warm-up's
  collectives and so for every rank to get there;
- no host sync inside a step (at TP=1 already none), and none from the process group: an
  environment that would add one (``TORCH_NCCL_BLOCKING_WAIT``, ``TORCH_NCCL_NAN_CHECK``), or
  the allocator's expandable segments without ``NCCL_GRAPH_REGISTER=0`` on Hopper, is refused
  at the first call (:func:`tp_graph_env_errors`). Captures use ``capture_error_mode=
  "thread_local"``, so the process group's watchdog thread querying earlier work's events does
  not invalidate them.

A failed capture raises naming ``generation.cuda_graphs_tp`` (the other TP ranks then wait in
their next collective until the run stops on the error). Models with experts stay eager.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import queue
import threading
from concurrent.futures import Future, as_completed
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from mcore_rl.config.schema import GenerationConfig, MegatronConfig
from mcore_rl.generation.base import (BackendContext, FinishedGroup, GenerationBackend,
                                      GroupAssembler, Response, check_lengths, check_prompts,
                                      response_budgets, stop_ids)
from mcore_rl.generation.checks import megatron_layout_errors
from mcore_rl.generation.sampling import Sampler, check_sampling, row_uniforms
from mcore_rl.workers.interfaces import PolicyAPI


def check_layout(megatron: MegatronConfig) -> None:
    """Raise ``NotImplementedError`` naming the config keys for a policy layout
    :class:`MegatronDecoder` does not run (:func:`mcore_rl.generation.checks.
    megatron_layout_errors`: pipeline, sequence or expert parallelism)."""
    errors = megatron_layout_errors(megatron)
    if errors:
        raise NotImplementedError("; ".join(errors))


def decode_graphs(cfg: GenerationConfig, device: torch.device, tensor_parallel: int,
                  moe: bool) -> bool:
    """Whether :class:`MegatronDecoder` replays its decode steps as CUDA graphs: with
    ``cfg.cuda_graphs`` on a CUDA ``device`` for a dense model (``moe`` false: MoE layers read
    their experts' token counts on the host, which a capture forbids), at ``tensor_parallel`` 1,
    or above it with ``cfg.cuda_graphs_tp`` (the tensor-parallel collectives captured in the
    graphs). A function of the config and the layout alone, so the ranks of a TP group decide
    alike."""
    if not cfg.cuda_graphs or device.type != "cuda" or moe:
        return False
    return tensor_parallel == 1 or cfg.cuda_graphs_tp


def _truthy(value: Optional[str]) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "y", "on")


def tp_graph_env_errors(environ: Mapping[str, str], capability_major: int) -> List[str]:
    """Settings of a process's environment under which a decode step's tensor-parallel NCCL
    collectives cannot be captured in a CUDA graph (``generation.cuda_graphs_tp``); one message
    per reason, each naming its variable; empty when none.

    ``TORCH_NCCL_BLOCKING_WAIT`` (each collective's wait polls its event on the host, which a
    capture forbids); ``TORCH_NCCL_NAN_CHECK`` (reads a NaN check of each input on the host);
    on GPUs before Blackwell (``capability_major`` < 10) the caching allocator's
    ``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``) without
    ``NCCL_GRAPH_REGISTER=0``, a pair Megatron-Core's CUDA graphs refuse (illegal memory
    accesses once NCCL registers the graphs' buffers)."""
    errors = []
    for name, why in (("TORCH_NCCL_BLOCKING_WAIT", "each collective's wait polls on the host"),
                      ("TORCH_NCCL_NAN_CHECK", "each collective reads a NaN check on the host")):
        if _truthy(environ.get(name)):
            errors.append(f"{name}={environ[name]} ({why}, which a CUDA-graph capture forbids)")
    alloc = ",".join(environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    if (capability_major < 10 and "expandable_segments:true" in alloc.replace(" ", "").lower()
            and environ.get("NCCL_GRAPH_REGISTER", "") != "0"):
        errors.append("expandable_segments:True in the CUDA allocator's settings needs "
                      "NCCL_GRAPH_REGISTER=0 with NCCL collectives in CUDA graphs (illegal memory "
                      "accesses otherwise, as Megatron-Core's CUDA graphs state)")
    return errors


def _check_tp_graph_env(device: torch.device) -> None:
    """Raise ``RuntimeError`` naming ``generation.cuda_graphs_tp`` where
    :func:`tp_graph_env_errors` finds this process's environment unfit."""
    errors = tp_graph_env_errors(os.environ, torch.cuda.get_device_capability(device)[0])
    if errors:
        raise RuntimeError("decode steps with tensor-parallel collectives cannot be captured as "
                           "CUDA graphs here: " + "; ".join(errors) + "; change that or set "
                           "generation.cuda_graphs_tp=false to decode eagerly")


def _tp_any(flag: bool, group, device: torch.device) -> bool:
    """``flag`` or-ed over the ranks of the process group ``group`` (a MAX all-reduce of one
    int32 on ``device``; the host waits for it). Every rank of ``group`` must call it."""
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(t.item())


# TransformerConfig switches turned off while decoding: the bias+dropout+add and bias+SwiGLU
# fusions, which megatron-core compiles with torch.compile. Eager decoding is bound by the host
# (one token per forward), and a compiled call costs ~88 us of guard checks and graph dispatch
# against ~10-30 us for the eager ops it replaces (scripts/gpu/decode_profile.py,
# bench/RESULTS.md); a compiled function inside a CUDA-graph capture would also recompile there.
# Training keeps them.
_DECODE_OFF = ("bias_dropout_fusion", "bias_activation_fusion")
# Prompt tokens per prefill forward: a chunk's prompts are prefilled in groups of rows of at
# most this many (padded) tokens, which bounds the activations of one forward.
_PREFILL_TOKENS = 16384
# Smallest row bucket and smallest attended span (powers of two): smaller ones would only add
# graphs to capture for steps that cost no less.
_MIN_ROWS, _MIN_SPAN = 8, 128
# Every this many decode steps the host sends the done flags to itself (a copy without waiting)
# and acts on those it sent the previous time (module docstring); in between, a row that ended
# steps on without effect (nothing of it is read).
_SYNC_EVERY = 4
# Numbers the generate_async calls of this process (their tags for rows sent ahead).
_CALLS = itertools.count()


@contextlib.contextmanager
def _inference_mode(model: torch.nn.Module, config):
    """The model in eval mode without autograd and with the :data:`_DECODE_OFF` switches of its
    ``TransformerConfig`` ``config`` off (Megatron's layers read them at each forward); all
    restored afterwards, also on an exception.

    Compiled code runs eagerly inside (``torch.compiler.set_stance("force_eager")``): with
    ``policy.megatron.compile_layers`` the layers are ``torch.compile``-d for training, and a
    decoding forward through them would recompile for every layer (the KV-cache attention reads
    the cache of its ``layer_number``, an int torch.compile specializes on), for grad mode, for
    prefill and for each row bucket, past torch.compile's recompile limit, whose cache the
    training shapes share. Decode steps are replayed as CUDA graphs, so eager layers cost no
    host time there."""
    was_training = model.training
    switches = {name: getattr(config, name) for name in _DECODE_OFF}
    model.eval()
    try:
        for name in _DECODE_OFF:
            setattr(config, name, False)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            yield
    finally:
        model.train(was_training)
        for name, value in switches.items():
            setattr(config, name, value)


def _is_stop(tokens: torch.Tensor, stops) -> torch.Tensor:
    """Bool mask of ``tokens`` (any shape, int64) that end a response: equal to ``stops`` (an
    int: eos) or in it (an int64 tensor of ids, on the tokens' device)."""
    return tokens == stops if isinstance(stops, int) else torch.isin(tokens, stops)


def _responses(tokens: torch.Tensor, logprobs: torch.Tensor, counts: torch.Tensor,
               stops) -> List[Response]:
    """One :class:`Response` per row of host tensors ``tokens`` ``[n, W]`` int64, ``logprobs``
    ``[n, W]`` float32 (response token ``k`` in column ``k``) and ``counts`` ``[n]`` (tokens
    of each row); truncated: the last token is none of ``stops`` (:func:`_is_stop`)."""
    if isinstance(stops, torch.Tensor):
        stops = stops.cpu()
    out = []
    for i in range(tokens.shape[0]):
        c = int(counts[i])
        response = tokens[i, :c]
        out.append(Response(response, logprobs[i, :c], not bool(_is_stop(response[-1:], stops))))
    return out


class _Emitter:
    """Sends a chunk's finished rows to the controller before ``generate`` returns (its
    ``row_sink``), so their rewards are scored while the other rows decode.

    At a sync point the host has the done flags of the previous one (:class:`_Slots`); the rows
    they newly mark done are final (a row that ended writes only past its count), so
    :meth:`collect` gathers them on the device and copies them to host memory without waiting;
    the next :meth:`collect` (or :meth:`finish`), a sync period later, finds the copy done and
    sends them. :meth:`finish` then sends the chunk's rows not sent yet.

    Args:
        send: ``send(list of (row of the generate call, Response))``.
        rows: the call's row of each chunk row.
        stops: the stop tokens (an int, or a tensor of ids).
    """

    def __init__(self, send, rows: range, stops):
        self.send, self.rows, self.stops = send, rows, stops
        self.sent: set = set()  # chunk rows sent or on their way
        self._pending = None  # (chunk rows, host tensors, event or None)

    def collect(self, slots: "_Slots", flags: List[bool], row_of: List[int]) -> None:
        """At a sync point: send the rows gathered at the previous one; gather those ``flags``
        (the received done flags of the slots, ``row_of`` their chunk rows) newly mark done."""
        self._flush()
        new = [i for i, done in enumerate(flags) if done and row_of[i] >= 0
               and row_of[i] not in self.sent]
        if not new:
            return
        index = slots.to_device(new)
        host, event = [], None
        for t in (slots.out_tokens, slots.out_logprobs, slots.counts):
            part = t[index]
            if part.is_cuda:
                copy = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
                copy.copy_(part, non_blocking=True)
                part = copy
            host.append(part)
        if index.is_cuda:
            event = torch.cuda.Event()
            event.record()
        chunk_rows = [row_of[i] for i in new]
        self.sent.update(chunk_rows)
        self._pending = (chunk_rows, host, event)

    def finish(self, responses: List[Response]) -> None:
        """The chunk ended with ``responses`` (one per chunk row): send what is left."""
        self._flush()
        rest = [(self.rows[i], r) for i, r in enumerate(responses) if i not in self.sent]
        if rest:
            self.send(rest)

    def _flush(self) -> None:
        if self._pending is None:
            return
        chunk_rows, host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()  # long done: a sync period of steps was queued after it
        self.send([(self.rows[r], response)
                   for r, response in zip(chunk_rows, _responses(*host, self.stops))])


def _prompt_groups(prompts: List[List[int]]) -> Tuple[int, Optional[List[int]]]:
    """Rows that share a prompt (``generation.shared_prompt_kv``): runs of equal consecutive
    prompts (GRPO's group of one prompt's responses) become groups of ``G`` slots, ``G`` the
    most frequent run length (the longer on a tie); a longer run is cut into groups of ``G``,
    a shorter one leaves slots without a row.

    Returns:
        ``(G, slot of each row)``, or ``(1, None)`` when no two consecutive prompts are equal
        (the per-row layout)."""
    runs: List[List[int]] = []  # [first row, length]
    for i, p in enumerate(prompts):
        if runs and prompts[i - 1] == p:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    lengths = [n for _, n in runs]
    group = max(set(lengths), key=lambda n: (lengths.count(n), n))
    if group == 1:
        return 1, None
    slot_of, groups = [], 0
    for _, n in runs:
        for a in range(0, n, group):
            slot_of.extend(groups * group + j for j in range(min(group, n - a)))
            groups += 1
    return group, slot_of


def _group_floor(group: int) -> int:
    """Fewest groups of ``group`` rows a bucket holds: at least :data:`_MIN_ROWS` rows."""
    return max(1, -(-_MIN_ROWS // group))


def _bucket(n: int, floor: int, cap: Optional[int] = None) -> int:
    """The smallest power of two ``>= max(n, floor)``, at most ``cap`` when given."""
    p = floor
    while p < n:
        p *= 2
    return p if cap is None else min(p, cap)


class _Slots:
    """Per-row decoding state of :class:`MegatronDecoder`, in static buffers of ``rows`` rows
    (a step on bucket ``B`` reads and writes rows ``0 .. B-1``):

    ``tokens`` [rows] int64 (the next input token), ``positions`` [rows] int64 (its position),
    ``steps`` [rows] int64 (the response index of the token the next step samples), ``budgets``
    [rows] int64, ``done`` [rows] bool, ``counts`` [rows] int64 (response tokens so far),
    ``uniforms`` [rows, slots] float32 (the row's random stream), ``out_tokens`` [rows, slots]
    int64 and ``out_logprobs`` [rows, slots] float32 (response token ``k`` in column ``k``),
    ``plens`` [rows] int64 (the prompt's length: with shared prompts, where its response
    starts).

    On the host: ``seen`` [rows] bool, the done flags as last sent by :meth:`send_done` (pinned
    memory on CUDA, written by the device when the copy runs; :meth:`received_done` waits for
    it)."""

    PER_ROW = ("tokens", "positions", "steps", "budgets", "done", "counts", "uniforms",
               "out_tokens", "out_logprobs", "plens")

    def __init__(self, rows: int, slots: int, device: torch.device):
        long = dict(dtype=torch.long, device=device)
        self.rows, self.slots, self.device = rows, slots, device
        cuda = device.type == "cuda"
        self.seen = torch.ones(rows, dtype=torch.bool, pin_memory=cuda)
        self._sent, self._event = 0, torch.cuda.Event() if cuda else None
        self.tokens, self.positions = torch.zeros(rows, **long), torch.zeros(rows, **long)
        self.steps, self.budgets = torch.zeros(rows, **long), torch.zeros(rows, **long)
        self.counts, self.plens = torch.zeros(rows, **long), torch.zeros(rows, **long)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.uniforms = torch.zeros(rows, slots, dtype=torch.float32, device=device)
        self.out_tokens = torch.zeros(rows, slots, **long)
        self.out_logprobs = torch.zeros(rows, slots, dtype=torch.float32, device=device)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (``[m]`` int64), moved to rows ``0 .. m-1``."""
        m = index.numel()
        for name in self.PER_ROW:
            t = getattr(self, name)
            t[:m] = t[index]

    def send_done(self, bucket: int) -> None:
        """Queue the copy of ``done[:bucket]`` into ``seen`` behind the work queued so far,
        without waiting for it (on the CPU the copy is made at once)."""
        self.seen[:bucket].copy_(self.done[:bucket], non_blocking=True)
        self._sent = bucket
        if self._event is not None:
            self._event.record()

    def received_done(self) -> List[bool]:
        """The done flags of the last :meth:`send_done` (of its ``bucket`` rows), once the copy
        has run (waits for the device up to that point only)."""
        if self._event is not None:
            self._event.synchronize()
        return self.seen[:self._sent].tolist()

    def to_device(self, values: List[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the device, copied without waiting for the device
        (from pinned memory on CUDA: ``torch.tensor(values, device=...)`` would drain it)."""
        t = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)


class MegatronDecoder:
    """Decodes prompts with a policy worker's model (module docstring: the scheme); keeps its KV
    cache, row states and CUDA graphs between calls. With ``generation.compile_decode`` a decode
    step's layers are :class:`~mcore_rl.megatron.decode_layer.DecodeLayers` compiled by
    ``_compiler`` (``torch.compile``, with ``mode=generation.compile_decode_mode`` unless that
    is ``default``; compiled at the first step, one compile for every layer and bucket, again
    when the mode or ``generation.decode_attention`` changes; with ``decode_attention=flex``
    the attention's half once per row bucket), prefill stays Megatron's. On CUDA the decode
    step's sampler is compiled too, by the same compiler and mode
    (:meth:`~mcore_rl.generation.sampling.Sampler.step`: one compile for every bucket, greedy
    and sampled two, again when the layers are recompiled or ``temperature``, ``top_p`` or
    ``block_sampling`` change; logprobs within float32 rounding of the eager sampler's, tokens
    the same except at rounding boundaries of the cdf); the prefill's first tokens are sampled
    eagerly (any row count; a compile at one row would be another entry against the
    recompile limit). On the CPU the sampler stays eager: Inductor's C++ kernels (torch 2.13)
    compute it wrong with dynamic rows under the pinned AVX2 arithmetic
    (:func:`mcore_rl.megatron.cpu_backend.pin_arithmetic`) at a 49,152-token vocabulary (loops
    of 16 floats over 8-float vectors; right with ``torch._inductor.config.cpp.simdlen=256``,
    as ``tests/test_sampling_compile.py`` compiles it).

    Args:
        model: the worker's model chunk (``DistributedDataParallel`` around, with bf16,
            ``Float16Module`` around a ``GPTModel``); weights used in place, unchanged.
        megatron: the policy's ``policy.megatron`` config (layout checked by
            :func:`check_layout`; ``layer_spec``, ``tensor_model_parallel_size``).
        vocab_size: the real vocabulary; padded logit columns are never sampled.

    Raises:
        NotImplementedError: a layout :func:`check_layout` refuses.

    Memory: the cache holds ``rows x slots`` tokens of keys and values per layer (rows: the
    largest chunk so far rounded up to a power of two; slots: its longest prompt + response
    rounded up to 128 tokens, at most ``max_total_length``), kept between calls (grown when a
    call needs more) until :meth:`release`.
    """

    _layers = None  # DecodeLayers with generation.compile_decode
    _layers_mode = None  # the (compile_decode_mode, decode_attention) of _layers
    _sampler: Optional[Sampler] = None  # with generation.compile_decode: compiled with _layers
    _sampling = None  # the (temperature, top_p, block_sampling) of _sampler
    _sampler_on_cpu = False  # compile _sampler on the CPU too (tests: with a tracing backend)
    _stops: Optional[Tuple[torch.Tensor, tuple]] = None  # (stop-id tensor, its ids): _stops_key
    _compiler = staticmethod(torch.compile)  # what compiles both (tests: an eager stand-in)

    def __init__(self, model: torch.nn.Module, megatron: MegatronConfig, vocab_size: int):
        from megatron.core.utils import unwrap_model

        check_layout(megatron)
        self.model, self.megatron, self.vocab_size = model, megatron, int(vocab_size)
        self.gpt = unwrap_model(model)
        self.device = next(self.gpt.parameters()).device
        self.attentions = [layer.self_attention for layer in self.gpt.decoder.layers]
        self._slots: Optional[_Slots] = None
        self._cache = None
        self._rope: Optional[torch.Tensor] = None
        self._graphs: Dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._stream = None
        self._weights: Tuple[int, ...] = ()

    def release(self) -> None:
        """Free the KV cache, row states and CUDA graphs (the next call makes new ones)."""
        self._slots = self._cache = self._rope = self._pool = None
        self._graphs = {}

    # ------------------------------------------------------------------ public
    def generate(self, prompts: List[List[int]], first_row: int, seed: int, greedy: bool,
                 cfg: GenerationConfig, eos_token_id: int, pad_token_id: int,
                 max_total_length: int, row_sink=None) -> List[Response]:
        """Decode ``prompts``; one :class:`Response` per prompt.

        Args:
            prompts: token-id lists (checked by the caller); may be empty.
            first_row: the index of ``prompts[0]`` in the ``generate`` call, so each row draws
                from its own stream (:func:`~mcore_rl.generation.sampling.row_uniforms`).
            seed, greedy: as in :meth:`GenerationBackend.generate`.
            cfg: ``generation`` config (sampling, ``max_new_tokens``, ``batch_size`` rows per
                chunk, ``cuda_graphs``, ``cuda_graphs_tp``).
            eos_token_id, pad_token_id, max_total_length: as for the ``hf`` backend;
                ``eos_token_id`` may be a list of ids, each of which ends a response (the
                per-call ``stop_token_ids`` of :meth:`GenerationBackend.generate_async`).
            row_sink: a tag of the worker group's partial results
                (:func:`mcore_rl.distributed.worker_group.send_partial`), or None: finished rows
                are sent under it as ``[(row of the call, Response), ...]`` before this returns
                (:class:`_Emitter`: rows that ended, one sync period after the host learns of
                them; each chunk's other rows when it ends), by TP rank 0 only.

        Returns:
            Per prompt: response tokens [R] int64 and logprobs [R] float32 on the CPU,
            truncated flag.

        Raises:
            RuntimeError: with CUDA graphs at TP > 1 (``cuda_graphs_tp``), an environment
                :func:`tp_graph_env_errors` refuses, or a failed capture (:meth:`_step_once`).

        Collective over the tensor-parallel group (every TP rank calls it with the same prompts;
        logits are gathered over TP, so every rank samples the same tokens; with CUDA graphs at
        TP > 1 the ranks also or their parameters-moved flags once a call, :func:`_tp_any`).
        """
        from mcore_rl.megatron.attention import kv_cache_attention

        tp = self.megatron.tensor_model_parallel_size
        graphs = decode_graphs(cfg, self.device, tp, self.gpt.config.num_moe_experts is not None)
        weights = tuple(p.data_ptr() for p in self.gpt.parameters())
        moved = weights != self._weights  # (offload and restore): the graphs read old addresses
        if graphs and tp > 1:
            _check_tp_graph_env(self.device)
            # Every TP rank drops its graphs or none: addresses may move on one rank only, and a
            # rank recapturing (its step eager) while another replays would pair eager NCCL
            # calls with captured ones.
            moved = _tp_any(moved, self._tp_group(), self.device)
        if moved:
            self._graphs, self._weights = {}, weights
        layers_mode = (cfg.compile_decode_mode, cfg.decode_attention)
        compiler = self._compiler
        if cfg.compile_decode_mode != "default":  # torch.compile's own default otherwise
            compiler = functools.partial(compiler, mode=cfg.compile_decode_mode)
        if cfg.compile_decode and (self._layers is None or self._layers_mode != layers_mode):
            from mcore_rl.megatron.decode_layer import DecodeLayers

            self._layers = DecodeLayers(self.gpt.decoder.layers, compile=compiler,
                                        attention=cfg.decode_attention)
            self._layers_mode = layers_mode
            self._sampler = None  # compiled anew with the layers' compiler and mode
        sampling = (cfg.temperature, cfg.top_p, cfg.block_sampling)
        if not cfg.compile_decode:
            self._layers = self._sampler = None
            sampler = Sampler(cfg)
        elif self._sampler is None or self._sampling != sampling:
            on = self.device.type == "cuda" or self._sampler_on_cpu  # class docstring
            self._sampler = Sampler(cfg, compile=compiler if on else None)
            self._sampling, sampler = sampling, self._sampler
        else:
            check_sampling(cfg)  # as Sampler(cfg) does
            sampler = self._sampler
        ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
        # One id: compared as an int (the one-turn path, unchanged); several (or none:
        # generation.ignore_eos) a device tensor.
        stops = int(ids[0]) if len(ids) == 1 else torch.tensor(sorted({int(t) for t in ids}),
                                                               dtype=torch.long, device=self.device)
        send = None
        if row_sink is not None and self._tp_rank() == 0:
            from mcore_rl.distributed.worker_group import send_partial

            send = functools.partial(send_partial, row_sink)
        out = []
        for start in range(0, len(prompts), cfg.batch_size):
            chunk = prompts[start:start + cfg.batch_size]
            budgets = response_budgets(chunk, cfg.max_new_tokens, max_total_length)
            group, slot_of = _prompt_groups(chunk) if cfg.shared_prompt_kv else (1, None)
            if group == 1:
                self._reserve(_bucket(len(chunk), _MIN_ROWS),
                              max(len(p) + b for p, b in zip(chunk, budgets)), max_total_length)
            else:
                groups = _bucket(max(slot_of) // group + 1, _group_floor(group))
                self._reserve_shared(groups * group, groups, max(len(p) for p in chunk),
                                     max(budgets), max_total_length)
            rows = range(first_row + start, first_row + start + len(chunk))
            emitter = None if send is None else _Emitter(send, rows, stops)
            with _inference_mode(self.model, self.gpt.config), \
                    kv_cache_attention(self.attentions, self._cache):
                out.extend(self._decode_chunk(chunk, budgets, rows, seed, greedy, sampler, graphs,
                                              stops, int(pad_token_id), emitter, group, slot_of))
        return out

    def _tp_rank(self) -> int:
        if self.megatron.tensor_model_parallel_size == 1:
            return 0
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_rank()

    @staticmethod
    def _tp_group():
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    # ------------------------------------------------------------------ buffers
    def _reserve(self, rows: int, width: int, max_total_length: int) -> None:
        """Buffers of at least ``rows`` rows and ``width`` slots (``width <=
        max_total_length``); grown when smaller, which drops the graphs."""
        from mcore_rl.megatron.attention import KVCache

        slots = min(-(-width // _MIN_SPAN) * _MIN_SPAN, max_total_length)
        have = self._slots
        if self._cache is not None and self._cache.prompt_rows:  # the shared layout's
            have = None
        if have is not None and have.rows >= rows and have.slots >= width:
            return
        if have is not None:
            rows, slots = max(rows, have.rows), max(slots, have.slots)
        self.release()
        self._slots = _Slots(rows, slots, self.device)
        self._cache = KVCache(self.attentions, rows, slots, self.gpt.config.params_dtype,
                              self.device)
        # Megatron's rotary table (as its GPTModel.forward computes it) at positions 0..slots-1.
        self._rope = self.gpt.rotary_pos_emb(slots).reshape(slots, -1)

    def _reserve_shared(self, rows: int, groups: int, prompt_width: int, response_width: int,
                        max_total_length: int) -> None:
        """Buffers of the shared-prompt layout (:class:`~mcore_rl.megatron.attention.KVCache`
        with prompt rows): ``groups`` prompts of up to ``prompt_width`` tokens, ``rows``
        responses of up to ``response_width``, each rounded up to 128 tokens (at most
        ``max_total_length``); row states of ``prompt + response`` slots (positions and the
        rotary table run over both). Grown when smaller (or made from the per-row layout),
        which drops the graphs."""
        from mcore_rl.megatron.attention import KVCache

        def rounded(n: int) -> int:
            return min(-(-n // _MIN_SPAN) * _MIN_SPAN, max_total_length)

        cache, pslots, rslots = self._cache, rounded(prompt_width), rounded(response_width)
        if cache is not None and cache.prompt_rows:
            if (cache.rows >= rows and cache.prompt_rows >= groups
                    and cache.prompt_slots >= pslots and cache.slots >= rslots):
                return
            rows, groups = max(rows, cache.rows), max(groups, cache.prompt_rows)
            pslots, rslots = max(pslots, cache.prompt_slots), max(rslots, cache.slots)
        self.release()
        self._slots = _Slots(rows, pslots + rslots, self.device)
        self._cache = KVCache(self.attentions, rows, rslots, self.gpt.config.params_dtype,
                              self.device, prompt_rows=groups, prompt_slots=pslots)
        self._rope = self.gpt.rotary_pos_emb(pslots + rslots).reshape(pslots + rslots, -1)

    # ------------------------------------------------------------------ model pieces
    def _hidden(self, tokens: torch.Tensor, rope: torch.Tensor,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Final hidden states ``[s, b, h]`` of ``tokens`` ``[b, s]`` with rotary frequencies
        ``rope`` (``[s, 1, 1, d]`` for positions ``0..s-1``, or ``[1, b, 1, d]``: one position
        per row): ``GPTModel.forward``'s embedding and transformer block, with the positions
        given instead of taken from the sequence index."""
        hidden = self.gpt.embedding(input_ids=tokens, position_ids=None)
        return self.gpt.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rope)

    def _decode_hidden(self, tokens: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[1, B, h]`` of a decode step (``tokens`` ``[B]``, ``rope``
        ``[1, B, 1, d]``): :meth:`_hidden`, or with ``generation.compile_decode`` the same
        embedding and final norm around the compiled decode layers
        (:class:`~mcore_rl.megatron.decode_layer.DecodeLayers`)."""
        if self._layers is None:
            return self._hidden(tokens[:, None], rope, None)
        from mcore_rl.megatron.rope import cos_sin

        gpt = self.gpt
        hidden = gpt.embedding(input_ids=tokens[:, None], position_ids=None)
        cos, signed_sin = cos_sin(rope, hidden.dtype)
        # _inference_mode runs compiled code eagerly (Megatron's compiled training layers);
        # these functions are compiled for decoding
        with torch.compiler.set_stance("default"):
            hidden = self._layers(hidden, cos, signed_sin, self._cache)
        return gpt.decoder.final_layernorm(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[b, vocab_size]`` (gathered over TP; bf16 with bf16 weights, as
        ``get_logprobs`` keeps them) of final hidden states ``[1, b, h]``."""
        gpt = self.gpt
        weight = gpt.shared_embedding_or_output_weight() if \
            gpt.share_embeddings_and_output_weights else None
        logits, _ = gpt.output_layer(hidden, weight=weight, runtime_gather_output=True)
        return logits[0, :, :self.vocab_size]

    # ------------------------------------------------------------------ one chunk
    def _decode_chunk(self, prompts: List[List[int]], budgets: List[int], rows: range, seed: int,
                      greedy: bool, sampler: Sampler, graphs: bool, eos: int,
                      pad: int, emitter: Optional["_Emitter"] = None, group: int = 1,
                      slot_of: Optional[List[int]] = None) -> List[Response]:
        """Prefill and decode one chunk in slots ``0 ..`` of the buffers (module docstring);
        finished rows go to ``emitter`` as the host learns of them. With shared prompts
        (:func:`_prompt_groups`): ``group`` rows a group, ``slot_of`` the slot of each chunk
        row; the buffers' layout is the shared one (:meth:`_reserve_shared`) and the batch is
        compacted by whole groups."""
        s, n = self._slots, len(prompts)
        cache = self._cache
        floor = _group_floor(group)
        cap = s.rows if group == 1 else min(s.rows // group, cache.prompt_rows)
        if slot_of is None:
            bucket = _bucket(n, _MIN_ROWS, s.rows)
            row_of = list(range(n)) + [-1] * (bucket - n)  # chunk row of each slot, -1: none
        else:
            bucket = group * _bucket(max(slot_of) // group + 1, floor, cap)
            row_of = [-1] * bucket
            for i, slot in enumerate(slot_of):
                row_of[slot] = i
        lengths = [len(p) for p in prompts]
        steps = max(budgets)
        if not greedy:
            uniforms = row_uniforms(seed, rows, steps, self.device)
            if slot_of is None:
                s.uniforms[:n, :steps] = uniforms
            else:
                s.uniforms[s.to_device(slot_of), :steps] = uniforms
        if slot_of is None:
            self._prefill(prompts, budgets, bucket, greedy, sampler, eos, pad)
        else:
            self._prefill_shared(prompts, budgets, bucket, row_of, group, greedy, sampler, eos,
                                 pad)
        results = (torch.zeros(n, s.slots, dtype=torch.long, device=self.device),
                   torch.zeros(n, s.slots, dtype=torch.float32, device=self.device),
                   torch.zeros(n, dtype=torch.long, device=self.device))
        longest = max(lengths)
        k = 1  # response index sampled by the next step (the same for every row of a chunk)
        while k < steps:
            if (k - 1) % _SYNC_EVERY == 0:
                if k > 1:  # the flags sent at the previous sync point (module docstring)
                    flags = s.received_done()
                    if emitter is not None:  # before a compaction moves those rows
                        emitter.collect(s, flags, row_of)
                    # groups (rows, without shared prompts) that still ran then
                    live = [j for j in range(bucket // group)
                            if not all(flags[j * group:(j + 1) * group])]
                    if not live:
                        break
                    smaller = group * _bucket(len(live), floor, cap)
                    if smaller < bucket:  # compaction: the rows that ran then to the front
                        self._collect(results, row_of)
                        keep = [j * group + i for j in live for i in range(group)]
                        index = s.to_device(keep)
                        s.keep_rows(index)
                        cache.keep_rows(index)
                        if group > 1:
                            cache.keep_rows(s.to_device(live), prompts=True)
                        s.done[len(keep):smaller] = True
                        row_of = [row_of[i] for i in keep] + [-1] * (smaller - len(keep))
                        bucket = smaller
                        longest = max(lengths[r] for r in row_of if r >= 0)
                s.send_done(bucket)
            if group == 1:
                span = _bucket(longest + k, _MIN_SPAN, s.slots)
            else:  # the prompts' span, the responses' span, the group size
                span = (_bucket(longest, _MIN_SPAN, cache.prompt_slots),
                        _bucket(k, _MIN_SPAN, cache.slots), group)
            self._step_once(bucket, span, greedy, sampler, eos, graphs)
            k += 1
        self._collect(results, row_of)
        out = _responses(*(t.cpu() for t in results), eos)
        if emitter is not None:
            emitter.finish(out)
        return out

    def _collect(self, results, row_of: List[int]) -> None:
        """Copy the responses of the slots that hold chunk rows into ``results`` (tokens,
        logprobs, counts per chunk row)."""
        s = self._slots
        slots = [i for i, r in enumerate(row_of) if r >= 0]
        index, target = s.to_device(slots), s.to_device([row_of[i] for i in slots])
        for out, src in zip(results, (s.out_tokens, s.out_logprobs, s.counts)):
            out.index_copy_(0, target, src[index])

    def _prefill(self, prompts: List[List[int]], budgets: List[int], bucket: int, greedy: bool,
                 sampler: Sampler, eos: int, pad: int) -> None:
        """Prefill the chunk's prompts into slots ``0 .. n-1`` (in groups of rows of at most
        :data:`_PREFILL_TOKENS` padded tokens) and sample each row's first response token; slots
        ``n .. bucket-1`` are set done (padding rows of the bucket)."""
        from mcore_rl.megatron.model import attention_mask

        s, n, device = self._slots, len(prompts), self.device
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        group = max(1, _PREFILL_TOKENS // max(len(p) for p in prompts))
        for a in range(0, n, group):
            part = prompts[a:a + group]
            b, width = len(part), max(len(p) for p in part)
            tokens = torch.full((b, width), pad, dtype=torch.long)
            for i, p in enumerate(part):
                tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
            tokens = tokens.to(device)  # built on the host, one copy
            rows = torch.arange(a, a + b, device=device)
            self._cache.prefill(rows)
            hidden = self._hidden(tokens, self._rope[:width].view(width, 1, 1, -1),
                                  attention_mask(self.megatron.layer_spec, b, width, device))
            last = hidden[lengths[a:a + b] - 1, torch.arange(b, device=device)]  # [b, h]
            noise = None if greedy else s.uniforms[a:a + b, 0]
            token, logprob = sampler(self._logits(last[None]), noise)
            s.tokens[a:a + b], s.out_tokens[a:a + b, 0] = token, token
            s.out_logprobs[a:a + b, 0] = logprob
        budget = torch.tensor(budgets, device=device)
        s.positions[:n], s.budgets[:n] = lengths, budget
        s.steps[:n], s.counts[:n] = 1, 1
        s.done[:n] = _is_stop(s.tokens[:n], eos) | (budget <= 1)
        s.positions[n:bucket], s.steps[n:bucket], s.counts[n:bucket] = 0, 0, 0
        s.tokens[n:bucket], s.done[n:bucket] = pad, True

    def _prefill_shared(self, prompts: List[List[int]], budgets: List[int], bucket: int,
                        row_of: List[int], group: int, greedy: bool, sampler: Sampler, eos: int,
                        pad: int) -> None:
        """:meth:`_prefill` with shared prompts: each group's prompt (slots ``j * group ..``,
        ``row_of`` their chunk rows) is prefilled once, into prompt row ``j`` of the cache, and
        each row of the group samples its first token from the group's logits with its own
        random stream; slots without a row are set done."""
        from mcore_rl.megatron.model import attention_mask

        s, device = self._slots, self.device
        slots = [i for i, r in enumerate(row_of) if r >= 0]
        first = {}  # group -> its first chunk row (whose prompt the group shares)
        for i in slots:
            first.setdefault(i // group, row_of[i])
        groups = sorted(first)
        s.positions[:bucket], s.plens[:bucket], s.steps[:bucket] = 0, 0, 0
        s.counts[:bucket], s.tokens[:bucket], s.done[:bucket] = 0, pad, True
        width_of = {j: len(prompts[first[j]]) for j in groups}
        part = max(1, _PREFILL_TOKENS // max(width_of.values()))
        for a in range(0, len(groups), part):
            these = groups[a:a + part]
            b, width = len(these), max(width_of[j] for j in these)
            tokens = torch.full((b, width), pad, dtype=torch.long)
            for i, j in enumerate(these):
                tokens[i, :width_of[j]] = torch.tensor(prompts[first[j]], dtype=torch.long)
            tokens = tokens.to(device)
            self._cache.prefill(s.to_device(these), prompts=True)
            hidden = self._hidden(tokens, self._rope[:width].view(width, 1, 1, -1),
                                  attention_mask(self.megatron.layer_spec, b, width, device))
            last = hidden[s.to_device([width_of[j] - 1 for j in these]),
                          torch.arange(b, device=device)]  # [b, h]
            logits = self._logits(last[None])
            mine = [i for i in slots if i // group in these]
            index = s.to_device(mine)
            rows_logits = logits[s.to_device([these.index(i // group) for i in mine])]
            noise = None if greedy else s.uniforms[index, 0]
            token, logprob = sampler(rows_logits, noise)
            s.tokens[index], s.out_tokens[index, 0], s.out_logprobs[index, 0] = \
                token, token, logprob
        index = s.to_device(slots)
        lengths = s.to_device([len(prompts[row_of[i]]) for i in slots])
        budget = s.to_device([budgets[row_of[i]] for i in slots])
        s.positions[index], s.plens[index], s.budgets[index] = lengths, lengths, budget
        s.steps[index], s.counts[index] = 1, 1
        s.done[index] = _is_stop(s.tokens[index], eos) | (budget <= 1)

    # ------------------------------------------------------------------ decode steps
    def _step(self, bucket: int, span, greedy: bool, sampler: Sampler, eos: int) -> None:
        """One decode step of rows ``0 .. bucket-1``, attending to positions ``< span`` (an
        int), or with shared prompts to ``span = (prompt span, response span, group size)``
        (:meth:`KVCache.decode_shared`): every read and write is on the static buffers (what a
        CUDA graph replays)."""
        s = self._slots
        tokens, positions, steps = s.tokens[:bucket], s.positions[:bucket], s.steps[:bucket]
        done = s.done[:bucket]
        if isinstance(span, tuple):
            self._cache.decode_shared(positions, s.plens[:bucket], *span)
        else:
            self._cache.decode(positions, span)
        rope = self._rope[positions].view(1, bucket, 1, -1)
        logits = self._logits(self._decode_hidden(tokens, rope))
        column = steps[:, None]
        noise = None if greedy else s.uniforms[:bucket].gather(1, column).squeeze(1)
        # compiled with generation.compile_decode (Sampler.step; eager otherwise), run compiled
        # inside _inference_mode as the layers are (_decode_hidden)
        with torch.compiler.set_stance("default"):
            token, logprob = sampler.step(logits, noise)
        s.out_tokens[:bucket].scatter_(1, column, token[:, None])
        s.out_logprobs[:bucket].scatter_(1, column, logprob[:, None])
        running = ~done
        s.counts[:bucket].add_(running)
        done.logical_or_(running & (_is_stop(token, eos) | (steps + 1 >= s.budgets[:bucket])))
        tokens.copy_(token)
        last = s.slots - 1  # rows that ended keep stepping (unread): stay inside the buffers
        positions.add_(1).clamp_(max=last)
        steps.add_(1).clamp_(max=last)

    def _stops_key(self, eos):
        """``eos`` as part of a graph key: the int, or a stop-id tensor's ids as a tuple, read
        from the device once per tensor (a generate call makes one; reading it at every step
        would wait for the device each time, as under ``generation.ignore_eos``)."""
        if isinstance(eos, int):
            return eos
        if self._stops is None or self._stops[0] is not eos:
            self._stops = (eos, tuple(eos.tolist()))
        return self._stops[1]

    def _step_once(self, bucket: int, span, greedy: bool, sampler: Sampler, eos: int,
                   graphs: bool) -> None:
        """:meth:`_step`, replayed from its CUDA graph with ``graphs`` (captured on first use:
        that step runs eagerly on the capture stream first, as the warm-up; at TP > 1 every TP
        rank captures at the same step, module docstring).

        Raises:
            RuntimeError: the capture failed; names ``generation.cuda_graphs`` (TP=1) or
                ``generation.cuda_graphs_tp`` (TP > 1) to turn off."""
        if not graphs:
            return self._step(bucket, span, greedy, sampler, eos)
        # the sampler's draw and the compiled layers' mode too: each captures other kernels
        key = (bucket, span, greedy, sampler.temperature, sampler.top_p, sampler.blocks,
               self._stops_key(eos), None if self._layers is None else self._layers_mode)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if self._pool is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            self._step(bucket, span, greedy, sampler, eos)
        torch.cuda.current_stream().wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        try:
            self._capture(graph, lambda: self._step(bucket, span, greedy, sampler, eos))
        except Exception as e:
            off = "cuda_graphs_tp" if self.megatron.tensor_model_parallel_size > 1 else \
                "cuda_graphs"
            raise RuntimeError(f"capturing a decode step as a CUDA graph failed ({e}); "
                               f"set generation.{off}=false to decode eagerly") from e
        self._graphs[key] = graph

    def _capture(self, graph: "torch.cuda.CUDAGraph", step) -> None:
        """Capture ``step()`` into ``graph`` on the capture stream, in the decoder's graph pool:
        what ``torch.cuda.graph`` does without its ``torch.cuda.empty_cache()`` and host-cache
        emptying at every capture. Those return the last training step's cached blocks (and
        the pinned blocks of :meth:`_Slots.to_device`) to the driver, which the next training
        step and decode step allocate again (``cudaFree`` / ``cudaMalloc`` / ``cudaHostAlloc``,
        each a wait for the device; 316 ``cudaFree`` in one GSM8K generate call on one H200,
        bench/RESULTS.md) while captures go on for new (rows, span) buckets."""
        torch.cuda.synchronize()  # as torch.cuda.graph: the warm-up's work is done
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                step()
            finally:
                graph.capture_end()


class MegatronGenerationBackend(GenerationBackend):
    """Rollouts decoded by the policy workers with the policy's weights in place
    (``generation.backend: megatron``); :meth:`refit` copies nothing.

    Each data-parallel group of the policy decodes a contiguous share of the prompt groups
    (:class:`MegatronDecoder`, through ``PolicyWorker.generate``); rows keep their random
    streams, so the rollouts do not depend on the DP layout. Needs a policy layout
    :func:`check_layout` accepts (the workers raise ``NotImplementedError`` otherwise).

    Args:
        policy: the policy's worker group with its DP layout
            (:class:`mcore_rl.distributed.worker_group.DataParallelGroup`: ``dp_size``,
            ``call_per_dp_async``).
        cfg: ``generation`` config (temperature, top_p, max_new_tokens, batch_size: rows per
            decoding chunk on each DP rank, cuda_graphs).
        eos_token_id: ends a response (kept as its last token).
        pad_token_id: fills ``input_ids`` after a row's end.
        max_total_length: cap on prompt + response tokens (``data.max_total_length``).
        vocab_size: the policy's real vocabulary (prompt ids are checked against it).

    Raises:
        ValueError: a ``generation.*`` value or ``max_total_length`` out of range.
    """

    shares_policy_weights = True

    def __init__(self, policy, cfg: GenerationConfig, eos_token_id: int, pad_token_id: int,
                 max_total_length: int, vocab_size: int):
        check_sampling(cfg)
        check_lengths(cfg, max_total_length)
        self.policy = policy
        self.cfg = cfg
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.max_total_length = int(max_total_length)
        self.vocab_size = int(vocab_size)

    @classmethod
    def from_context(cls, ctx: BackendContext) -> "MegatronGenerationBackend":
        """The run's backend, decoding on ``ctx.policy``."""
        return cls(ctx.policy, ctx.cfg.generation, ctx.eos_token_id, ctx.pad_token_id,
                   ctx.cfg.data.max_total_length, ctx.vocab_size)

    def refit(self, policy) -> Dict[str, float]:
        """Shared weights: the workers decode with the policy's current parameters, so nothing
        is exported or copied (``refit/gbytes`` 0)."""
        return {"refit/gbytes": 0.0}

    def offload(self) -> None:
        """Colocated (:class:`~mcore_rl.controller.colocation.Colocation`, before logprobs and
        training): every policy worker frees its decoder's KV cache and CUDA graphs
        (``PolicyWorker.release_decoder``); the next ``generate`` makes them again, recapturing
        its graphs. Without colocation they stay between calls."""
        self.policy.call(PolicyAPI).release_decoder()

    def generate_async(self, prompts: List[List[int]], seed: int, greedy: bool = False,
                       group_size: int = 1,
                       stop_token_ids: Optional[Sequence[int]] = None) -> Iterator[FinishedGroup]:
        """See :meth:`GenerationBackend.generate_async`; sampling as the ``hf`` backend's. Each
        DP rank starts on its share of the groups at once; a share's groups come when it is
        decoded.

        Raises (beyond the interface's, when iterated): ``WorkerError`` of the worker group when
        a worker raises, for example ``RuntimeError`` naming ``prepare_for_lp_inference()``
        while the policy's weights are offloaded, or ``NotImplementedError`` for a refused
        layout.
        """
        check_prompts(prompts, self.vocab_size, self.max_total_length)
        groups = GroupAssembler(len(prompts), group_size)
        dp, num_groups = self.policy.dp_size, len(prompts) // group_size
        bounds = [round(d * num_groups / dp) * group_size for d in range(dp + 1)]
        # Rows sent ahead of the answers (the worker group's partial results): into `inbox`.
        tag, inbox = ("megatron-rows", id(self), next(_CALLS)), queue.Queue()
        listen = getattr(self.policy, "listen", None)
        streamed = listen is not None and listen(tag, inbox.put)
        first_row = {}
        for d in range(dp):
            if bounds[d] < bounds[d + 1]:
                future = self.policy.call_per_dp_async(PolicyAPI, dp_ranks=[d]).generate(
                    [[prompts[bounds[d]:bounds[d + 1]], bounds[d], seed, greedy]],
                    decoder=MegatronDecoder, cfg=self.cfg,
                    eos_token_id=stop_ids(self.cfg, self.eos_token_id, stop_token_ids),
                    pad_token_id=self.pad_token_id, max_total_length=self.max_total_length,
                    row_sink=tag if streamed else None)
                first_row[future] = bounds[d]
        if not streamed:
            return self._collect(first_row, groups)
        left, lock = [len(first_row)], threading.Lock()

        def answered(future: Future) -> None:  # a call's rows all came before its answer
            inbox.put(future)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                listen(tag, None)

        for future in list(first_row):
            future.add_done_callback(answered)
        return self._collect_streamed(first_row, groups, inbox)

    @staticmethod
    def _collect(first_row: Dict, groups: GroupAssembler) -> Iterator[FinishedGroup]:
        for future in as_completed(first_row):
            yield from groups.add(first_row[future], future.result()[0])

    @staticmethod
    def _collect_streamed(first_row: Dict, groups: GroupAssembler,
                          inbox: queue.Queue) -> Iterator[FinishedGroup]:
        """The groups as their rows come: sent ahead by the decoders (``(row, Response)``
        lists) or in a call's answer (the call's future), whichever is first."""
        left = len(first_row)
        while left:
            item = inbox.get()
            if isinstance(item, Future):
                left -= 1
                yield from groups.add(first_row[item], item.result()[0])
            else:
                yield from groups.add_rows(item)
