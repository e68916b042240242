"""Tokenizer loading: a Hugging Face tokenizer directory, or the built-in character tokenizer.

The character tokenizer is a real Hugging Face fast tokenizer (built with the ``tokenizers``
library: a ``WordLevel`` model over :data:`CHARSET`, one token per character, ``Fuse``
decoder), so it saves with ``save_pretrained`` into run directories and HF exports and loads
back with ``AutoTokenizer.from_pretrained``. Ids: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2 (any
character outside the charset), then the charset in order. It has no bos token: prompts are
encoded without a prefix, and generation stops at ``<eos>``.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from mcore_rl.config.checks import ConfigError
from mcore_rl.config.schema import CHAR_TOKENIZER, ModelConfig

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
# Digits, ASCII letters and punctuation (+ - * = . , $ % ...), space and newline.
CHARSET = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in character tokenizer: ``len(SPECIAL_TOKENS) + len(CHARSET)`` = 99 tokens;
    ``"23+45="`` encodes to 6 ids and decodes back to the same text."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARSET))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                   eos_token="<eos>", unk_token="<unk>")


def load_tokenizer(model_cfg: ModelConfig,
                   use_chat_template: bool = False) -> PreTrainedTokenizerBase:
    """The run's tokenizer, with ``pad_token_id`` and ``eos_token_id`` set.

    Source, in order: the character tokenizer when ``model.tokenizer == "char"``, or when both
    ``model.tokenizer`` and ``model.hf_path`` are null; else the directory (or hub id)
    ``model.tokenizer``; else ``model.hf_path``. A loaded tokenizer without a pad token gets
    its eos token as pad (padding is masked out, so sharing the id is safe; the convention of
    transformers' and TRL's examples, ``tokenizer.pad_token = tokenizer.eos_token``).

    Args:
        model_cfg: the ``model`` section.
        use_chat_template: ``data.use_chat_template``; a loaded tokenizer must then have a chat
            template (the character tokenizer has none and renders plain text, with a warning
            from :class:`~mcore_rl.data.prompts.PromptDataset`).

    Raises:
        ConfigError: the tokenizer cannot be loaded, has no eos token, or has no chat template
            while ``use_chat_template`` (the message names the config keys and path).
    """
    if model_cfg.tokenizer == CHAR_TOKENIZER or (model_cfg.tokenizer is None
                                                 and model_cfg.hf_path is None):
        return build_char_tokenizer()
    key, path = (("model.tokenizer", model_cfg.tokenizer) if model_cfg.tokenizer is not None
                 else ("model.hf_path", model_cfg.hf_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())  # transformers' messages span several lines
        raise ConfigError(f"{key}: {path}: cannot load a tokenizer: {reason}") from e
    if tokenizer.eos_token is None:
        raise ConfigError(f"{key}: {path}: the tokenizer has no eos token; generation cannot stop")
    if use_chat_template and tokenizer.chat_template is None:
        raise ConfigError(f"data.use_chat_template=true but the tokenizer of {key}={path} has no "
                          f"chat template (tokenizer_config.json or chat_template.jinja); set "
                          f"data.use_chat_template=false or model.tokenizer to a directory with one")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_difference(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> str | None:
    """How two tokenizers would tokenize a text differently, or None when they would not: the
    first of their vocabularies (token -> id; added tokens included), eos ids, and, for fast
    tokenizers, their normalizer, pre-tokenizer and model (merges) that differs. Truncation,
    padding and chat templates are not compared (the ids of one text are what a reward model
    reads)."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        diff = sorted(set(va.items()) ^ set(vb.items()))[:3]
        return f"vocabularies differ ({len(va)} and {len(vb)} tokens; e.g. {diff})"
    if a.eos_token_id != b.eos_token_id:
        return f"eos ids differ ({a.eos_token_id} and {b.eos_token_id})"
    if getattr(a, "is_fast", False) and getattr(b, "is_fast", False):
        import json

        ja, jb = (json.loads(t.backend_tokenizer.to_str()) for t in (a, b))
        for part in ("normalizer", "pre_tokenizer", "model"):
            if ja.get(part) != jb.get(part):
                return f"their {part.replace('_', '-')}s differ"
    return None
