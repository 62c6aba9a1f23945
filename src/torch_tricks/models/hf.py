"""Hugging Face ``transformers`` models by name, built offline from a config (issue 13).

``--model hf:TYPE[:HEAD]`` builds a randomly initialised model of any transformers model
type (``gpt2``, ``bert``, ``vit``, ``llama``, ``t5`` ...) from transformers' own default
config for that type (``AutoConfig.for_model``); ``--model path/to/config.json[:HEAD]``
(or a folder holding ``config.json``) builds one from a local config file. Nothing is
downloaded: no weights, no tokenizer, no hub look-up.

The head (``HEAD``) picks the ``AutoModelFor...`` class:

==========================  =======================================
``causal-lm``               ``AutoModelForCausalLM``
``masked-lm``               ``AutoModelForMaskedLM``
``seq2seq``                 ``AutoModelForSeq2SeqLM``
``classification``          ``AutoModelForSequenceClassification``
``image-classification``    ``AutoModelForImageClassification``
``base``                    ``AutoModel`` (no head)
==========================  =======================================

Without a head, the first of ``seq2seq``, ``image-classification``, ``masked-lm``,
``causal-lm``, ``base`` that the model type has is used (:data:`DEFAULT_ORDER`): so
``t5``/``bart`` are seq2seq LMs, ``vit`` an image classifier, ``bert``/``roberta`` masked
LMs (BERT also has a causal-LM head, but it is an encoder), ``gpt2``/``llama`` causal LMs.

Overrides (``hf_config={"n_layer": 2}`` or ``--hf-config n_layer=2,n_embd=64``) are
passed to the config's constructor, so derived fields (LLaMA's ``head_dim``) follow
them; an alias of ``attribute_map`` (``num_hidden_layers`` for GPT-2's ``n_layer``) is
accepted; a key the config does not have is a :class:`UserError`. The key
``attn_implementation`` picks the attention kernel (default ``sdpa``; ``eager`` gives the
same MACs, see :func:`build`).

What the built model looks like to the rest of torch-tricks:

* ``use_cache`` is switched off (unless overridden): the model is built to be measured
  and trained, not to generate, so its output holds no key/value cache.
* ``return_dict`` keeps its default: outputs are ``ModelOutput`` objects (torch pytrees).
* Inputs are positional: the first forward argument (``input_ids`` or ``pixel_values``).
  An encoder-decoder model (``t5``) whose forward gets no ``decoder_input_ids`` (nor
  ``labels``/``decoder_inputs_embeds``) is given the encoder ids shifted right by one,
  starting with ``decoder_start_token_id`` (else the pad token) -- teacher forcing, what the model does with
  ``labels`` -- by a forward pre-hook, so one token input runs the whole model.
* The default input is ``long:T:VOCAB`` for token models (``T`` = 128, or the model's
  largest position if smaller; ``VOCAB`` from the config) and ``CxHxW`` from
  ``num_channels``/``image_size`` for image models; ``None`` (the CLI asks for
  ``--input``) for other inputs (audio ...).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import json
import os
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

from torch_tricks._optional import install_hint, require
from torch_tricks.errors import UserError, one_line

__all__ = [
    "HEADS",
    "DEFAULT_ORDER",
    "FAMILIES",
    "is_hf_ref",
    "parse_hf_config",
    "build",
    "list_families",
    "default_input",
]

PREFIX = "hf:"
INSTALL = install_hint("hf")

# head suffix -> (Auto class, the modeling_auto mapping of model types it supports)
HEADS: dict[str, tuple[str, str]] = {
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "seq2seq": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "classification": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "image-classification": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    "base": ("AutoModel", "MODEL_MAPPING_NAMES"),
}
DEFAULT_ORDER = ("seq2seq", "image-classification", "masked-lm", "causal-lm", "base")
FAMILIES = ("gpt2", "bert", "vit", "llama", "t5")  # the ones `torch-tricks models` lists
DEFAULT_ATTENTION = "sdpa"
DEFAULT_SEQ_LEN = 128


# -- references ---------------------------------------------------------------------------

def _split_path_ref(ref: str) -> tuple[str, str | None] | None:
    """``path/config.json[:HEAD]`` or ``folder[:HEAD]`` holding a config.json -> (path, head)."""
    head: str | None = None
    path = ref
    if not (path.endswith(".json") or os.path.isdir(path)):
        base, sep, tail = ref.rpartition(":")
        if not sep or not base:
            return None
        path, head = base, tail
    return (path, head) if _is_config_path(path) else None


def _is_config_path(path: str) -> bool:
    """A ``.json`` file name, or a folder holding a config.json."""
    return path.endswith(".json") or (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")))


def is_hf_ref(ref: str) -> bool:
    """Whether ``load_model`` should hand ``ref`` to this module."""
    return ref.startswith(PREFIX) or _split_path_ref(ref) is not None


# -- overrides ----------------------------------------------------------------------------

def _value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text.strip()


def parse_hf_config(text: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """``"n_layer=4,n_embd=256"`` -> ``{"n_layer": 4, "n_embd": 256}`` (int, float, bool,
    none or str); a mapping is taken as it is."""
    if text is None:
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    items = (item.strip() for item in text.split(","))
    return dict(_key_value(item) for item in items if item)


def _key_value(item: str) -> tuple[str, Any]:
    key, sep, val = item.partition("=")
    if not sep or not key.strip():
        raise UserError(f"bad --hf-config item {item!r}: expected KEY=VALUE, e.g. n_layer=4,n_embd=256")
    return key.strip(), _value(val)


# -- transformers -------------------------------------------------------------------------

def _transformers():
    return require("transformers", "hf", "hf: models")


def _mappings(tf) -> dict[str, Mapping[str, Any]]:
    from transformers.models.auto import modeling_auto

    return {head: getattr(modeling_auto, names) for head, (_, names) in HEADS.items()}


def _heads_for(tf, model_type: str) -> list[str]:
    maps = _mappings(tf)
    return [h for h in HEADS if model_type in maps[h]]


def _pick_head(tf, model_type: str, head: str | None, what: str) -> str:
    if head is not None and head not in HEADS:
        raise UserError(f"unknown head {head!r} in --model {what}: choose one of {', '.join(HEADS)}")
    have = _heads_for(tf, model_type)
    if head is None:
        return _default_head(have, model_type, what)
    if head not in have:
        raise UserError(
            f"model type {model_type!r} has no {head} head in transformers {tf.__version__}: "
            f"choose one of {', '.join(have) or 'none'} (--model {what})"
        )
    return head


def _default_head(have: list[str], model_type: str, what: str) -> str:
    """The first head of :data:`DEFAULT_ORDER` the model type has."""
    for h in DEFAULT_ORDER:
        if h in have:
            return h
    raise UserError(f"transformers has no model class for model type {model_type!r} (--model {what})")


def _unknown_type(tf, model_type: str) -> UserError:
    from transformers import CONFIG_MAPPING

    names = sorted(CONFIG_MAPPING.keys())
    close = difflib.get_close_matches(model_type, names, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return UserError(
        f"unknown transformers model type {model_type!r}{hint}: choose one of the {len(names)} model types of "
        f"transformers {tf.__version__}, e.g. {', '.join(FAMILIES)} (all of them: python -c \"import transformers; "
        "print(*sorted(transformers.CONFIG_MAPPING))\")"
    )


def _read_config_file(path: str) -> dict[str, Any]:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UserError(f"no config file {file!r}: give a transformers config.json (or the folder holding it)")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {file!r} as a transformers config: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise UserError(f"{file!r} has no \"model_type\": it is not a transformers config.json")
    return data


def _make_config(tf, model_type: str, base: dict[str, Any], overrides: dict[str, Any], what: str):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise _unknown_type(tf, model_type)
    cls = CONFIG_MAPPING[model_type]
    probe = _new_config(cls, base, f"bad config for --model {what}")
    aliases = getattr(cls, "attribute_map", {}) or {}
    kwargs = dict(base)
    for key, val in overrides.items():
        if not hasattr(probe, key):
            raise _unknown_key(cls, probe, key, model_type)
        kwargs[aliases.get(key, key)] = val
    if hasattr(probe, "use_cache"):
        kwargs.setdefault("use_cache", False)
    return _new_config(cls, kwargs, f"bad --hf-config for --model {what}")


def _new_config(cls: type, kwargs: dict[str, Any], what_failed: str) -> Any:
    """``cls(**kwargs)``; a UserError starting with ``what_failed`` if the config refuses them."""
    try:
        return cls(**kwargs)
    except Exception as exc:
        raise UserError(f"{what_failed}: {type(exc).__name__}: {one_line(exc)}") from None


def _unknown_key(cls: type, probe: Any, key: str, model_type: str) -> UserError:
    return UserError(
        f"unknown --hf-config key {key!r} for {cls.__name__} (model type {model_type!r}): "
        "use one of its config fields, e.g. "
        + ", ".join(k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                "intermediate_size", "vocab_size") if hasattr(probe, k))
    )


# -- default input ------------------------------------------------------------------------

def default_input(config: Any, main_input: str = "input_ids") -> str | None:
    """The CLI input spec (batch excluded) a model of ``config`` takes as ``main_input``."""
    if main_input == "pixel_values":
        return _image_input(config)
    if main_input == "input_ids":
        return _token_input(config)
    return None


def _image_input(config: Any) -> str | None:
    """``CxHxW`` from ``num_channels`` and ``image_size`` (one int, or a pair)."""
    size = getattr(config, "image_size", None)
    channels = getattr(config, "num_channels", 3) or 3
    if isinstance(size, int):
        h = w = size
    elif isinstance(size, (list, tuple)) and len(size) == 2:
        h, w = size
    else:
        return None
    return f"{channels}x{h}x{w}"


def _token_input(config: Any) -> str | None:
    """``long:T:VOCAB``, ``T`` no longer than the model's positions."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not vocab:
        return None
    for name in ("max_position_embeddings", "n_positions"):
        most = getattr(text, name, None)
        if isinstance(most, int) and most > 0:
            return f"long:{min(DEFAULT_SEQ_LEN, most)}:{vocab}"
    return f"long:{DEFAULT_SEQ_LEN}:{vocab}"


# -- encoder-decoder: decoder ids from the encoder ids ------------------------------------

def _fill_decoder_ids(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
    """Forward pre-hook: teacher-forcing decoder ids when the caller gave none."""
    if not _lacks_decoder_input(module, args, kwargs):
        return None
    ids = args[0] if args else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    start = _decoder_start_id(module)
    dec = torch.cat([ids.new_full((ids.shape[0], 1), start), ids[:, :-1]], dim=1)
    return args, {**kwargs, "decoder_input_ids": dec}


def _lacks_decoder_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Neither keyword nor positional decoder input (ids, embeddings or labels) was given."""
    if any(kwargs.get(k) is not None for k in ("decoder_input_ids", "decoder_inputs_embeds", "labels")):
        return False
    params = list(inspect.signature(module.forward).parameters)
    return "decoder_input_ids" in params and len(args) <= params.index("decoder_input_ids")


def _decoder_start_id(module: nn.Module) -> int:
    cfg = module.config
    gen = getattr(module, "generation_config", None)
    start = getattr(cfg, "decoder_start_token_id", None)  # transformers 5: not a field of every config
    if start is None:
        start = getattr(gen, "decoder_start_token_id", None)
    if start is None:  # T5's convention: decoding starts with the pad token
        start = getattr(cfg, "pad_token_id", None) or 0
    if isinstance(start, (list, tuple)):
        start = start[0]
    return int(start)


# -- size and noise -----------------------------------------------------------------------

def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None (no check)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_fits(shell: nn.Module, ref: str) -> None:
    """A default config can be huge (``hf:llama`` is LLaMA-7B): refuse, in one line, a model
    whose fp32 weights alone exceed the memory available, instead of being killed building it."""
    params = sum(p.numel() for p in shell.parameters())
    need = sum(t.numel() * t.element_size() for t in [*shell.parameters(), *shell.buffers()])
    have = _available_bytes()
    if have is not None and need > have:
        raise UserError(
            f"--model {ref} as configured has {params:.3g} parameters, {need / 2**30:.1f} GiB of weights: more than "
            f"the {have / 2**30:.1f} GiB of memory available; make it smaller with --hf-config "
            "(e.g. num_hidden_layers=2,hidden_size=256,num_attention_heads=4,intermediate_size=1024)"
        )


@contextlib.contextmanager
def _quiet(tf) -> Iterator[None]:
    """transformers logs config warnings (a bos id outside a shrunk vocabulary ...) on
    stderr: the library does not print, so they are silenced while building."""
    logging = tf.utils.logging
    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)


# -- build --------------------------------------------------------------------------------

def build(ref: str, hf_config: str | Mapping[str, Any] | None = None) -> tuple[nn.Module, str | None]:
    """The model ``ref`` (``hf:TYPE[:HEAD]`` or ``path/config.json[:HEAD]``) with random
    weights, and its default input spec.

    Attention runs as ``sdpa`` by default: ``summary`` counts its MACs from the query/key/
    value shapes (QK^T and AV, GQA included, the causal mask not halving them), exactly as
    the two matmuls of ``eager`` attention count, so both give the same totals; ``sdpa`` is
    what transformers runs by default and what timings should see.
    """
    tf = _transformers()
    overrides = parse_hf_config(hf_config)
    attn = overrides.pop("attn_implementation", DEFAULT_ATTENTION)
    model_type, head, base = _type_head_base(ref)
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise _unknown_type(tf, model_type)
    head = _pick_head(tf, model_type, head or None, ref)
    with _quiet(tf):
        config = _make_config(tf, model_type, base, overrides, ref)
    model = _from_config(tf, getattr(tf, HEADS[head][0]), config, attn, ref)
    if getattr(model.config, "is_encoder_decoder", False):
        model.register_forward_pre_hook(_fill_decoder_ids, with_kwargs=True)
    return model, default_input(model.config, getattr(model, "main_input_name", "input_ids"))


def _type_head_base(ref: str) -> tuple[str, str | None, dict[str, Any]]:
    """(model type, head or None, config fields) of ``hf:TYPE[:HEAD]`` or a config.json reference."""
    if ref.startswith(PREFIX):
        model_type, _, head = ref[len(PREFIX):].partition(":")
        if not model_type:
            raise UserError(f"--model {ref}: name a transformers model type, e.g. hf:gpt2, hf:bert:classification")
        return model_type, head, {}
    split = _split_path_ref(ref)
    if split is None:
        raise UserError(f"--model {ref}: not a transformers config.json path")
    path, head = split
    base = _read_config_file(path)
    model_type = base.pop("model_type")
    if base.get("auto_map"):
        raise UserError(f"{path!r} needs remote code (auto_map), which torch-tricks does not run")
    return model_type, head, base


def _from_config(tf, auto_cls: Any, config: Any, attn: str, ref: str) -> nn.Module:
    """Build on the meta device first to refuse a model too big for memory, then for real."""
    try:
        with _quiet(tf):
            with torch.device("meta"):  # the size first, without allocating it (~1 s for 7e9 parameters)
                shell = auto_cls.from_config(config, attn_implementation=attn)
            _check_fits(shell, ref)
            del shell
            return auto_cls.from_config(config, attn_implementation=attn)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"cannot build --model {ref}: {type(exc).__name__}: {one_line(exc)}") from None


def list_families() -> list[dict[str, Any]]:
    """The common families for ``torch-tricks models``: name, default head and input.

    Without transformers: one entry saying what to install.
    """
    try:
        tf = _transformers()
    except UserError:
        return [{"name": "hf:TYPE[:HEAD]", "input": None,
                 "description": f"any transformers model type, offline from its config: {INSTALL}"}]
    from transformers import CONFIG_MAPPING

    out = []
    for name in FAMILIES:
        head = _pick_head(tf, name, None, PREFIX + name)
        main = "pixel_values" if head == "image-classification" else "input_ids"
        cfg = CONFIG_MAPPING[name]()
        out.append({"name": PREFIX + name, "input": default_input(cfg, main),
                    "description": f"transformers {name}, {head} head by default, random weights from its "
                                   f"default config (:HEAD, --hf-config to change)"})
    return out
