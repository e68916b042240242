"""generation.compile_decode: a decode step's layers as two functions of tensors
(mcore_rl/megatron/decode_layer.py), compiled once for every layer and bucket.

In one gloo process, a tiny Qwen2-shaped model (QKV bias, GQA, SwiGLU; torch spec) decodes the
same prompts with Megatron's layers and with the decode-layer functions:

- run eagerly, the functions give Megatron's rollouts bit for bit (fp32 and bf16; per-row and
  shared-prompt caches);
- traced by torch.compile (a backend that runs the captured graph as it is, so the numbers stay
  eager's): still bit for bit, with one compile per function for every layer, row bucket and
  attended span (two of attention_in: the first layer's, without a previous MLP output to add;
  and one more for the shared-prompt attention), and one of the decode step's sampler for every
  row bucket;
- compiled by Inductor (CPU C++ kernels; slow): the same tokens, logprobs within 5e-5 (fp32;
  7.9e-6 measured), and no residual add taken into an ``addmm`` (Inductor's post-grad pattern
  ``addmm``, which CPU applies as CUDA does: the generated code's ``addmm`` calls add the QKV
  bias only).

generation.compile_decode_mode: torch.compile's ``mode`` (none for ``default``), a new compile
when it changes; refused at load without compile_decode; max-autotune-no-cudagraphs by Inductor
on CPU (slow-marked; seconds): the same tokens, logprobs within 5e-5.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from dist_utils import run_distributed

from mcore_rl.config.schema import GenerationConfig, MegatronConfig, ModelArchConfig

VOCAB = 64
ARCH = ModelArchConfig(family="qwen2", num_layers=3, hidden_size=64, num_attention_heads=4,
                       num_query_groups=2, ffn_hidden_size=96, max_position_embeddings=512,
                       qkv_bias=True, tie_word_embeddings=False, vocab_size=VOCAB)
# Responses long enough for two attended spans (128, 256) and rows that end at different steps
# (compaction into smaller row buckets); groups of 4 rows per prompt for the shared cache.
GEN = GenerationConfig(temperature=0.8, max_new_tokens=150, batch_size=32)


def _prompts():
    g = torch.Generator().manual_seed(2)
    distinct = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
                for n in torch.randint(4, 40, (6,), generator=g)]
    return [p for p in distinct for _ in range(4)]


def _decoder(precision: str, arch: ModelArchConfig = ARCH):
    from mcore_rl.generation.megatron import MegatronDecoder
    from mcore_rl.megatron import rope
    from mcore_rl.megatron.model import build_model, wrap_float16

    rope.install()  # as every Megatron worker does
    torch.manual_seed(0)
    megatron = MegatronConfig(layer_spec="torch", precision=precision)
    (chunk,) = wrap_float16(build_model(arch, megatron, VOCAB, "cpu"), precision)
    with torch.no_grad():  # larger weights than the init's: rows end at different steps
        for p in chunk.parameters():
            p.mul_(3.0)
    dec = MegatronDecoder(chunk, megatron, VOCAB)
    dec._sampler_on_cpu = True  # the sampler compiled too, as on CUDA (Inductor: VOCAB is small)
    return dec


def _run(dec, compiler, **overrides):
    """Tokens and logprobs of one generate call with ``dec._compiler = compiler`` (None: the
    functions eagerly; False: Megatron's layers)."""
    dec._layers, dec._compiler = None, compiler
    cfg = dataclasses.replace(GEN, compile_decode=compiler is not False, **overrides)
    out = dec.generate(_prompts(), 0, 5, False, cfg, eos_token_id=1, pad_token_id=0,
                       max_total_length=200)
    return [r.tokens for r in out], [r.logprobs for r in out]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and \
        all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _checks(inductor: bool) -> dict:
    from torch._dynamo import reset

    out = {}
    for precision in ("fp32", "bf16"):
        dec = _decoder(precision)
        for shared in (False, True):
            name = f"{precision}/{'shared' if shared else 'rows'}"
            megatron = _run(dec, False, shared_prompt_kv=shared)
            out[name + "/lengths"] = sorted({len(t) for t in megatron[0]})
            out[name + "/eager_equal"] = _same(_run(dec, None, shared_prompt_kv=shared), megatron)
    dec = _decoder("fp32")
    megatron = {s: _run(dec, False, shared_prompt_kv=s) for s in (False, True)}
    graphs = []

    def backend(gm, example_inputs):  # the captured graph, run as it is
        graphs.append(gm)
        return gm.forward

    reset()
    traced = functools.partial(torch.compile, backend=backend)
    for shared in (False, True):
        got = _run(dec, traced, shared_prompt_kv=shared)
        out[f"traced/{shared}/equal"] = _same(got, megatron[shared])
        out[f"traced/{shared}/graphs"] = len(graphs)
    if inductor:
        from torch._inductor.utils import run_and_get_code

        reset()
        got, codes = run_and_get_code(_run, dec, torch.compile)
        out["inductor/addmm_inputs"] = _addmm_inputs(codes)
        out["inductor/tokens_equal"] = all(torch.equal(x, y) for x, y in zip(got[0],
                                                                           megatron[False][0]))
        out["inductor/logprob_diff"] = max(float((x - y).abs().max())
                                           for x, y in zip(got[1], megatron[False][1]))
    return out


def _addmm_inputs(codes) -> list:
    """The shape (as Inductor's generated Python asserts it: ``(128, )``) of the added input of
    every ``extern_kernels.addmm`` call in ``codes`` (the compiled functions' generated code),
    or ``"not an input"`` for a buffer computed in the graph (a residual stream's sum)."""
    import re

    shapes = []
    for code in codes:
        asserted = dict(re.findall(r"assert_size_stride\((\w+), (\([^)]*\))", code))
        for name in re.findall(r"extern_kernels\.addmm\((\w+),", code):
            shapes.append(asserted.get(name, "not an input"))
    return shapes


def _fast_checks() -> dict:
    return {"checks": _checks(False), "modes": _modes()}


@pytest.fixture(scope="module")
def fast():
    """The checks of the tests not marked slow, in one spawned process."""
    (out,) = run_distributed(_fast_checks, 1)
    return out


def _slow_checks() -> dict:
    return {"inductor": _checks(True), "autotuned": _autotuned()}


@pytest.fixture(scope="module")
def slow():
    """The inductor checks (slow-marked tests), in one spawned process."""
    (out,) = run_distributed(_slow_checks, 1, timeout_s=2400)
    return out


def test_decode_layers_equal_megatrons_and_compile_once(fast):
    out = fast["checks"]
    for precision in ("fp32", "bf16"):
        for cache in ("rows", "shared"):
            assert out[f"{precision}/{cache}/eager_equal"], (precision, cache)
            assert len(out[f"{precision}/{cache}/lengths"]) > 3  # rows end at different steps
    # two graphs for attention_in (the first layer's: no previous MLP output to add), one for
    # attention_out over 3 layers, and one for the sampler (Sampler.step), over row buckets
    # 32 .. 8 and spans 128 and 256; the shared-prompt cache adds one for its attention
    assert out["traced/False/equal"] and out["traced/False/graphs"] == 4
    assert out["traced/True/equal"] and out["traced/True/graphs"] == 5


@pytest.mark.slow
def test_inductor_decode_layers_within_the_bound(slow):
    out = slow["inductor"]
    assert out["inductor/tokens_equal"]
    assert out["inductor/logprob_diff"] < 5e-5  # 7.9e-6 measured (3x weights: large logits)


@pytest.mark.slow
def test_inductor_takes_no_residual_add_into_addmm(slow):
    """Inductor's post-grad pattern ``addmm`` (torch/_inductor/fx_passes/post_grad.py) would
    turn ``residual + x @ W`` into ``addmm(residual, x, W)`` (on CUDA a copy of the residual
    before the GEMM); decode_layer keeps the residual adds out of it (attention_out's
    docstring). The model's only added bias is the QKV layer's (``[128]``): every ``addmm`` adds
    it, one a compile of attention_in (the pattern on CPU as on CUDA: the check sees it)."""
    shapes = slow["inductor"]["inductor/addmm_inputs"]
    assert shapes and all(s == "(128, )" for s in shapes), shapes  # before: [B, h] residuals too


def _autotuned() -> dict:
    """Inductor with ``mode="max-autotune-no-cudagraphs"`` (as generation.compile_decode_mode
    passes it) against Megatron's layers, fp32."""
    from torch._dynamo import reset

    dec = _decoder("fp32")
    megatron = _run(dec, False)
    reset()
    cfg = dataclasses.replace(GEN, compile_decode=True,
                              compile_decode_mode="max-autotune-no-cudagraphs")
    dec._layers, dec._compiler = None, torch.compile
    out = dec.generate(_prompts(), 0, 5, False, cfg, eos_token_id=1, pad_token_id=0,
                       max_total_length=200)
    return {"tokens_equal": all(torch.equal(r.tokens, x) for r, x in zip(out, megatron[0])),
            "logprob_diff": max(float((r.logprobs - y).abs().max())
                                for r, y in zip(out, megatron[1]))}


@pytest.mark.slow
def test_autotuned_decode_layers_within_the_bound(slow):
    out = slow["autotuned"]
    assert out["tokens_equal"]
    assert out["logprob_diff"] < 5e-5  # 7.9e-6 measured on CPU (no GPU GEMM templates there)

def test_compile_decode_is_refused_where_the_functions_do_not_apply():
    from mcore_rl.config.loader import ConfigError, load_config

    base = ["generation.backend=megatron", "generation.compile_decode=true"]
    assert load_config("grpo_synthetic", base).generation.compile_decode
    with pytest.raises(ConfigError, match="compile_decode=true compiles dense layers") as error:
        load_config("grpo_synthetic", base + ["cluster.num_workers=2",
                                              "policy.megatron.tensor_model_parallel_size=2"])
    assert "set generation.compile_decode=false" in str(error.value)  # the remedy, same line


def _modes() -> list:
    """The keyword arguments of each compile call (a recording eager stand-in) over generate
    calls of modes default, max-autotune-no-cudagraphs (twice: compiled once) and default."""
    dec = _decoder("fp32")
    calls = []

    def record(fn, **kwargs):
        calls.append(kwargs)
        return fn

    dec._compiler = record
    out = []
    for mode in ("default", "max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs",
                 "default"):
        cfg = dataclasses.replace(GEN, compile_decode=True, compile_decode_mode=mode,
                                  max_new_tokens=4)
        dec.generate(_prompts()[:4], 0, 5, False, cfg, eos_token_id=1, pad_token_id=0,
                     max_total_length=200)
        out.append(list(calls))
        calls.clear()
    return out


def test_compile_decode_mode_is_passed_to_the_compiler(fast):
    out = fast["modes"]
    autotune = {"mode": "max-autotune-no-cudagraphs"}
    # attention_in, attention_out, the sampler
    assert out == [[{}, {}, {}], [autotune] * 3, [], [{}, {}, {}]]


def test_compile_decode_mode_defaults_and_is_refused_without_compile_decode():
    from mcore_rl.config.loader import ConfigError, load_config

    assert GenerationConfig().compile_decode_mode == "default"
    base = ["generation.backend=megatron",
            "generation.compile_decode_mode=max-autotune-no-cudagraphs"]
    cfg = load_config("grpo_synthetic", base + ["generation.compile_decode=true"])
    assert cfg.generation.compile_decode_mode == "max-autotune-no-cudagraphs"
    with pytest.raises(ConfigError, match="compile_decode_mode=max-autotune-no-cudagraphs") as e:
        load_config("grpo_synthetic", base + ["generation.compile_decode=false"])
    assert "set generation.compile_decode=true" in str(e.value)  # the remedy
    with pytest.raises(ConfigError, match="compile_decode_mode"):
        load_config("grpo_synthetic", ["generation.compile_decode_mode=max-autotune"])
