"""generation.decode_attention=triton: one fused flash-decoding kernel a layer
(mcore_rl/megatron/flash_decode.py and its Triton kernel).

- the Triton kernel itself, run on CPU by Triton's interpreter (``TRITON_INTERPRET=1``, in a
  subprocess: the variable must be set before Triton is imported), against the attention
  computed another way: ``decode_attention`` (bmm) and ``shared_decode_attention`` in fp32
  within 1e-5 per element, over ragged masks (a row with one key, a block of masked keys, spans
  not multiples of the kernel's 32-key block), strided views of a cache, 3 query heads per KV
  group; bf16 within one bf16 rounding of the fp32 attention of the same inputs;
- the op's CPU path (``reference_decode``: bmm on fp32 copies) against bmm, and its error;
- the decoder with compile_decode and decode_attention=triton, traced by torch.compile (the
  captured graph run as it is, the op called inside it), with and without shared prompts: the
  same tokens as Megatron's layers, logprobs within 5e-5, one compile for every bucket and span;
- bad input named, and the load-time refusal without compile_decode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from dist_utils import run_distributed
from test_decode_layer import _decoder, _run

from mcore_rl.megatron.attention import decode_attention, shared_decode_attention
from mcore_rl.megatron.flash_decode import flash_decode, reference_decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs(dtype, rows=8, ng=3, np_=9, hn=64, span=37, prompt_span=0, groups=2, seed=0):
    """Query ``[rows, np, hn]``, keys and values ``[rows, ng, span, hn]`` (views of a larger
    cache), a ragged mask (row 0 keeps only its first key, the last row every key, row 1 its
    first 70: with span 130 its last 32-key blocks are all masked) and, with ``prompt_span``,
    ``groups`` shared prompts ``[groups, ng, prompt_span, hn]`` whose padding is masked."""
    g = torch.Generator().manual_seed(seed)
    cache = [torch.randn(rows + 2, ng, span + 11, hn, generator=g).to(dtype) for _ in range(2)]
    keys, values = (c[:rows, :, :span] for c in cache)
    query = torch.randn(rows, np_, hn, generator=g).to(dtype)
    last = torch.randint(0, span, (rows,), generator=g)
    last[0], last[-1], last[1] = 0, span - 1, min(69, span - 1)
    mask = torch.arange(span)[None] > last[:, None]
    prompts = (None, None)
    if prompt_span:
        buffers = [torch.randn(groups, ng, prompt_span + 5, hn, generator=g).to(dtype)
                   for _ in range(2)]
        prompts = tuple(b[:, :, :prompt_span] for b in buffers)
        lengths = torch.randint(1, prompt_span + 1, (rows,), generator=g)
        mask = torch.cat((torch.arange(prompt_span)[None] >= lengths[:, None], mask), dim=1)
    return (query, keys, values, mask, hn ** -0.5) + prompts


def _kernel_checks() -> dict:
    """Run in a subprocess with TRITON_INTERPRET=1: the kernel against bmm, the shared
    layout and the fp32 reference; bad input."""
    from mcore_rl.megatron.flash_decode import launch

    out = {}
    for span in (37, 130):
        q, k, v, mask, scale, _, _ = _inputs(torch.float32, span=span)
        got = launch(q, k, v, mask, scale)
        bmm = decode_attention(q[None], k, v, mask, scale)[0].view_as(q)
        out[f"fp32/{span}/bmm"] = float((got - bmm).abs().max())
        out[f"fp32/{span}/reference"] = float((got - reference_decode(q, k, v, mask,
                                                                      scale)).abs().max())
    args = _inputs(torch.float32, span=50, prompt_span=90)
    q = args[0]
    got = launch(*args)
    shared = shared_decode_attention(q[None], args[5], args[6], *args[1:5])[0].view_as(q)
    out["fp32/shared/bmm"] = float((got - shared).abs().max())
    args16 = _inputs(torch.bfloat16, span=130)
    exact = reference_decode(*(t.float() for t in args16[:3]), args16[3], args16[4])
    got = launch(*args16[:5])
    out["bf16/dtype"] = str(got.dtype)
    out["bf16/error"] = float((got.float() - exact).abs().max())
    out["bf16/scale"] = float(exact.abs().max())
    # the loops stopped after each row's last kept key against the whole span walked: the
    # same bits (rows and shared layouts, fp32 and bf16; masks with holes inside too)
    same = {}
    for name, case in (("rows/fp32", _inputs(torch.float32, span=130)),
                       ("rows/bf16", args16),
                       ("shared/fp32", args),
                       ("shared/bf16", _inputs(torch.bfloat16, span=70, prompt_span=100))):
        holes = case[3].clone()
        holes[2:, 0] = True  # every row from 2 keeps a later key (masks keep a prefix or more)
        for mask, tag in ((case[3], ""), (holes, "/holes")):
            whole = launch(*case[:3], mask, *case[4:], tail_skip=False)
            same[name + tag] = bool(torch.equal(launch(*case[:3], mask, *case[4:]), whole))
    out["tail_skip_equal"] = same
    # and it reads nothing past the block of a row's last kept key: values there set to NaN
    # reach the output of the whole walk (0 * NaN) but not of the stopped one
    q32, k32, v32, mask32, scale32 = _inputs(torch.float32, span=130)[:5]
    poisoned, k32 = v32.clone(), k32.clone()  # keys and values: the same strides
    kept = torch.arange(130)[None].expand_as(mask32).masked_fill(mask32, -1).amax(1) + 1
    for r, n in enumerate(kept.tolist()):
        poisoned[r, :, -(-n // 32) * 32:] = float("nan")
    out["tail_skip_nan_rows"] = [
        int(launch(q32, k32, poisoned, mask32, scale32, tail_skip=t).isnan().any(-1).any(-1).sum())
        for t in (True, False)]
    out["rope"] = _rope_kernel_checks()
    errors = []
    for bad in (lambda: launch(q, args[1], args[2], args[3][:, :10], args[4]),  # mask width
                lambda: launch(q[:, :8], args[1], args[2], args[3], args[4])):  # 8 heads, 3 groups
        try:
            bad()
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


def _rope_kernel_checks() -> dict:
    """The fused kernel (RoPE, cache write, attention: launch_rope) against its parts run one
    after the other (rope_rows, the indexed write, launch) on copies of the same cache, rows
    and shared layouts, fp32 and bf16 (run with TRITON_INTERPRET=1): the output's max
    difference and its scale, the written keys' max relative difference, values equal."""
    from mcore_rl.megatron.flash_decode import launch, launch_rope, rope_rows
    from mcore_rl.megatron.rope import cos_sin

    out = {}
    for name, dtype, prompt_span in (("rows/fp32", torch.float32, 0),
                                     ("rows/bf16", torch.bfloat16, 0),
                                     ("shared/fp32", torch.float32, 90),
                                     ("shared/bf16", torch.bfloat16, 90)):
        q, keys, values, mask, scale, pk, pv = _inputs(dtype, span=70, prompt_span=prompt_span)
        b, ng, span, d = keys.shape
        # each row's new key goes to its last kept slot (the decoder's mask keeps it)
        at = torch.arange(span)[None].expand(b, span).masked_fill(mask[:, -span:], -1).amax(1)
        g = torch.Generator().manual_seed(1)
        qkv = torch.randn(b, ng, (q.shape[1] // ng + 2) * d, generator=g).to(dtype)
        angles = torch.rand(b, d // 2, generator=g) * 6.0
        cos, signed = cos_sin(torch.cat((angles, angles), -1), dtype)
        fused_k, fused_v = keys.clone(), values.clone()
        got = launch_rope(qkv, cos, signed, at, fused_k, fused_v, mask, scale, pk, pv)
        parts_k, parts_v = keys.clone(), values.clone()
        nq = qkv.shape[2] // d - 2
        query, key, value = torch.split(qkv, [nq * d, d, d], dim=2)
        rows = torch.arange(b)
        parts_k[rows, :, at] = rope_rows(key, cos, signed)
        parts_v[rows, :, at] = value
        want = launch(rope_rows(query.reshape(b, -1, d), cos, signed), parts_k, parts_v, mask,
                      scale, pk, pv)
        out[name] = {"output": float((got.float() - want.float()).abs().max()),
                     "output_scale": float(want.float().abs().max()),
                     "keys": float(((fused_k.float() - parts_k.float()).abs()
                                    / parts_k.float().abs().clamp(min=1e-30)).max()),
                     "values": bool(torch.equal(fused_v, parts_v)),
                     "written": bool(not torch.equal(fused_k, keys))}
    return out


@pytest.fixture(scope="module")
def kernel_checks() -> dict:
    code = (f"import json, sys; sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); "
            "import test_flash_decode as t; print('RESULT', json.dumps(t._kernel_checks()))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_kernel_equals_bmm_in_fp32(kernel_checks):
    for key in ("fp32/37/bmm", "fp32/130/bmm", "fp32/37/reference", "fp32/130/reference",
                "fp32/shared/bmm"):
        assert kernel_checks[key] < 1e-5, (key, kernel_checks[key])  # measured <= 8.4e-7


def test_kernel_rounds_once_in_bf16(kernel_checks):
    assert kernel_checks["bf16/dtype"] == "torch.bfloat16"
    # fp32 scores and softmax, the probabilities rounded for the values' product, the output
    # rounded once: within a few bf16 units (2^-8 relative) of the largest output
    assert kernel_checks["bf16/error"] <= 2 ** -6 * kernel_checks["bf16/scale"], kernel_checks


def test_kernel_stops_after_the_last_kept_key_bit_for_bit(kernel_checks):
    """Stopping each row's loops after its last kept key (a span bucket's masked padding is
    not read) gives the same bits as walking the whole span."""
    assert kernel_checks["tail_skip_equal"] and all(kernel_checks["tail_skip_equal"].values()), \
        kernel_checks["tail_skip_equal"]
    stopped, whole = kernel_checks["tail_skip_nan_rows"]
    assert stopped == 0 and whole > 0, (stopped, whole)  # the padding is not read at all


def test_fused_rope_kernel_equals_its_parts(kernel_checks):
    """triton_rope's kernel (the query and key rotated, the key and value written into the
    cache, the attention) against RoPE, the indexed write and the attention kernel run one
    after the other: fp32 bit for bit; bf16 within one rounding of the rotated keys (Triton's
    interpreter rounds fp32 to bf16 otherwise than torch: 0.0156 on values of ~2 in a direct
    check; a GPU's cvt.rn rounds as torch does) and the output within 4 bf16 ulps of its
    scale."""
    for name, got in kernel_checks["rope"].items():
        assert got["values"] and got["written"], (name, got)
        if name.endswith("fp32"):
            assert got["output"] == 0.0 and got["keys"] == 0.0, (name, got)
        else:
            assert got["keys"] <= 2.0 ** -7, (name, got)
            assert got["output"] <= 2.0 ** -6 * got["output_scale"], (name, got)


def test_kernel_names_bad_input(kernel_checks):
    first, second = kernel_checks["errors"]
    assert "mask" in first and "bool" in first
    assert "multiple of the 3 KV groups" in second


def test_op_cpu_path_equals_bmm():
    for prompt_span in (0, 90):
        args = _inputs(torch.float32, span=130, prompt_span=prompt_span)
        q = args[0]
        got = flash_decode(*args)
        if prompt_span:
            want = shared_decode_attention(q[None], args[5], args[6], *args[1:5])[0]
        else:
            want = decode_attention(q[None], *args[1:5])[0]
        assert float((got - want.view_as(q)).abs().max()) < 1e-5
    with pytest.raises(ValueError, match="flash_decode: mask"):
        flash_decode(q, args[1], args[2], args[3].int(), args[4], args[5], args[6])


def _traced(attention: str = "triton") -> dict:
    """Rollouts with decode_attention=``attention`` (triton or triton_rope) through a
    torch.compile backend that runs the captured graphs as they are (the op's CPU path inside,
    or between them with triton_rope), against Megatron's layers, fp32, without and with shared
    prompts."""
    import functools

    from torch._dynamo import reset

    dec = _decoder("fp32")
    out = {}
    for shared in (False, True):
        megatron = _run(dec, False, shared_prompt_kv=shared)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        reset()
        got = _run(dec, functools.partial(torch.compile, backend=backend),
                   decode_attention=attention, shared_prompt_kv=shared)
        name = "shared" if shared else "rows"
        out[name] = {"lengths": len({len(t) for t in megatron[0]}),
                     "tokens_equal": all(torch.equal(x, y) for x, y in zip(got[0], megatron[0])),
                     "logprob_diff": max(float((x - y).abs().max())
                                         for x, y in zip(got[1], megatron[1])),
                     "graphs": len(graphs),
                     "op_called": any("flash_decode" in str(gm.code) for gm in graphs)}
    return out


@pytest.mark.parametrize("attention", ["triton", "triton_rope"])
def test_triton_decode_layers_traced_give_megatrons_tokens(attention):
    """With triton_rope the op (RoPE, the cache write, the attention) runs between the
    compiled attention_in and projection_mlp, outside the graphs."""
    (out,) = run_distributed(_traced, 1, attention)
    for name in ("rows", "shared"):
        got = out[name]
        assert got["lengths"] > 3, got  # rows end at different steps: compaction into buckets
        assert got["tokens_equal"], got
        assert got["logprob_diff"] < 5e-5, got
        assert got["op_called"] == (attention == "triton"), got
        # attention_in (twice: the first layer's has no previous MLP output to add),
        # attention_out (projection_mlp with triton_rope) and the sampler (Sampler.step), for
        # every bucket
        assert got["graphs"] == 4, got


def _qk_norm_refusal() -> str:
    import dataclasses

    from test_decode_layer import ARCH

    from mcore_rl.megatron.decode_layer import DecodeLayers

    dec = _decoder("fp32", dataclasses.replace(ARCH, family="qwen3", qkv_bias=False))
    DecodeLayers(dec.gpt.decoder.layers, compile=None, attention="triton")  # accepted
    try:
        DecodeLayers(dec.gpt.decoder.layers, compile=None, attention="triton_rope")
    except NotImplementedError as e:
        return str(e)
    return ""


def test_triton_rope_refuses_query_and_key_norms():
    """A layer with qk_layernorm (Qwen3) normalizes the query and key before RoPE, which the
    fused kernel does not: refused by name, triton named as the way out."""
    (message,) = run_distributed(_qk_norm_refusal, 1)
    assert "qk_layernorm" in message and "use triton" in message, message


def test_triton_needs_compile_decode():
    from mcore_rl.config.loader import ConfigError, load_config

    base = ["generation.backend=megatron", "generation.decode_attention=triton"]
    cfg = load_config("grpo_synthetic", base + ["generation.compile_decode=true",
                                                "generation.shared_prompt_kv=true"])
    assert cfg.generation.decode_attention == "triton"
    with pytest.raises(ConfigError, match="decode_attention=triton is the attention") as e:
        load_config("grpo_synthetic", base)
    assert "set generation.compile_decode=true" in str(e.value)
