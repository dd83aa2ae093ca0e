"""A chat as prompt tokens, through a chat template: serve's --chat-template, else the model's own
(HF tokenizer config or GGUF metadata).

--chat-template takes a file holding a Jinja template or one of NAMED_TEMPLATES.
"""

from __future__ import annotations

from pathlib import Path

from moeswarm.errors import MoeSwarmError, one_line
from moeswarm.sources.tokenizer import TextCodec

# ChatML (Qwen's, and many others'); the bundled model's own is in models/pymoe/hf/tokenizer_config.json.
CHATML = ("{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
NAMED_TEMPLATES = {"chatml": CHATML}


class NoChatTemplate(MoeSwarmError):
    pass


def chat_template(codec: TextCodec) -> str | None:
    return getattr(codec.tokenizer, "chat_template", None) if codec.tokenizer is not None else None


def read_chat_template(given: str) -> str:
    """--chat-template's text: a named template, or a file's (checked to compile)."""
    if given in NAMED_TEMPLATES:
        text = NAMED_TEMPLATES[given]
    else:
        path = Path(given)
        if not path.is_file():
            raise MoeSwarmError(f"--chat-template {given!r} is neither a file nor a named template "
                                f"({', '.join(NAMED_TEMPLATES)})")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise MoeSwarmError(f"--chat-template: cannot read {given}: {one_line(error)}") from None
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as error:
        raise MoeSwarmError(f"--chat-template {given}: not a Jinja template: {one_line(error)} (line {error.lineno})") from None
    return text


def set_chat_template(codec: TextCodec, template: str) -> None:
    """Make `template` the codec's chat template (replacing the model's own)."""
    if codec.tokenizer is None:
        raise MoeSwarmError(f"--chat-template needs a tokenizer, and this model has none ({codec.name})")
    codec.tokenizer.chat_template = template


def chat_prompt(codec: TextCodec, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """The token ids of `messages` ([{role, content}]) rendered by the template (tools: OpenAI's tool
    list, for the templates that show it): ready for the assistant's turn, or (continue_final_message,
    vLLM's and transformers' meaning) ending inside the last message, which the output continues."""
    if not chat_template(codec):
        raise NoChatTemplate("this model has no chat template (neither its tokenizer config nor its GGUF metadata "
                             "gives one): start serve with --chat-template FILE|chatml, or use /v1/completions")
    try:
        text = codec.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt,
                                                   continue_final_message=continue_final_message)
    except Exception as error:  # the template's own checks (roles must alternate, ...) raise from jinja
        raise MoeSwarmError(f"the model's chat template refused these messages: {one_line(error)}") from None
    return codec.encode(text)


def echoed(messages: list[dict]) -> str:
    """What chat's echo puts ahead of the answer (vLLM's meaning): the last message's text when it is
    the assistant's own (the answer continues it), else nothing."""
    if not messages or messages[-1]["role"] != "assistant":
        return ""
    return messages[-1]["content"] or ""
