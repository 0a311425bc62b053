"""Tokenizers: the byte-level tokenizer of the embedded default model, and a wrapper that loads any
checkpoint's `tokenizer.json` (through `tokenizers`) and renders its chat template (through jinja2).

The default model's tokenizer maps every byte of UTF-8 text to one token (GPT-2's byte-to-unicode
alphabet, no merges), so any text round-trips; a few special tokens come first: `<pad>`, `<bos>`,
`<eos>` and the chat role markers. Its chat template is a user turn followed by the assistant prefix:
`<bos><|user|>37+48=<|assistant|>` and the model answers `85<eos>`.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, USER, ASSISTANT, SYSTEM)

# Tools (a request's `tools`) go first as a system turn, one line each (name, properties as compact JSON, the
# description): the model's context is 512 byte tokens; an assistant's tool calls are written as
# the JSON array a forced call produces (`jaxdp.api.parsers.forced_calls`: [{"name": ..., "parameters": ...}]); a tool
# result is a system turn. Without tools the prompt is the one the model was trained on.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}" + SYSTEM + "Tools:"
    "{% for tool in tools %}{{ '\\n' }}{{ tool.function.name }}"
    "{{ (tool.function.parameters or {}).get('properties', {}) | tojson(separators=(',', ':')) }}"
    "{% if tool.function.description %} {{ tool.function.description }}{% endif %}{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}" + SYSTEM + "{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}"
    "{% if message['tool_calls'] %}[{% for call in message['tool_calls'] %}{% if not loop.first %},{% endif %}"
    "{\"name\":{{ call.function.name | tojson }},\"parameters\":"
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}{% endfor %}]{% endif %}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}" + SYSTEM + "Tool result: {{ message['content'] }}"
    "{% else %}{{ raise_exception('unknown role ' ~ message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def build_byte_tokenizer() -> tokenizers.Tokenizer:
    """Special tokens at ids 0..5, then the 256 byte symbols: 262 tokens."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = vocab[BOS]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)])
    return tok


def save_default_tokenizer(out_dir: str | Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False, "model_max_length": 4096,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a token as a string or as {"content": ...} (AddedToken)."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` for chat templates: plain JSON (jinja2's own escapes <, > and & for HTML, which
    would change the tool schemas a template writes into the prompt)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


# what apply_chat_template itself hands the template; a template keyword argument may not replace these
TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class Tokenizer:
    """A checkpoint's tokenizer: `encode`, `decode`, `apply_chat_template`, the special token ids."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json; pass a checkpoint directory that "
                                    "includes its tokenizer (or send token ids instead of text)")
        self.dir = d
        self.tok = tokenizers.Tokenizer.from_file(str(path))
        cfg_path = d / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.chat_template: str | None = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        if self.chat_template is None and (d / "chat_template.jinja").exists():
            self.chat_template = (d / "chat_template.jinja").read_text()
        self._template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
        return cls(model_dir) if (Path(model_dir) / "tokenizer.json").exists() else None

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id(self.pad_token)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its longest vocabulary entry, special tokens included):
        a text of C characters has at least C / max_token_chars tokens, a bound known before tokenizing."""
        return max((len(t) for t in self.tok.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. from the chat template) are
        recognised, and a bos is added once (never twice when the text already starts with it)."""
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text of a conversation, rendered with the checkpoint's jinja2 chat template as transformers
        renders it: `messages`, `tools` (OpenAI's tool definitions, None when there are none) and
        `add_generation_prompt`, the special tokens, then `kwargs` (a request's chat_template_kwargs, such as
        `thinking` or `enable_thinking`), with transformers' `tojson`, `raise_exception`, `strftime_now` and loop
        controls. A keyword argument may not replace one of TEMPLATE_ARGUMENTS (ValueError)."""
        if self.chat_template is None:
            raise ValueError(f"the tokenizer in {self.dir} has no chat_template; send a plain completion "
                             "prompt instead")
        clash = sorted(TEMPLATE_ARGUMENTS & kwargs.keys())
        if clash:
            raise ValueError(f"{clash[0]} is an argument of the chat template itself, not a keyword argument to "
                             "add to it")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                              extensions=[jinja2.ext.loopcontrols])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)
        special = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     **(special | kwargs))
