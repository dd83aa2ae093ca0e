"""A chat as prompt tokens, through the model's own chat template (HF tokenizer config or GGUF metadata)."""

from __future__ import annotations

from moeswarm.errors import MoeSwarmError, one_line
from moeswarm.model.tokenizer import TextCodec


class NoChatTemplate(MoeSwarmError):
    pass


def chat_template(codec: TextCodec) -> str | None:
    return getattr(codec.tokenizer, "chat_template", None) if codec.tokenizer is not None else None


def chat_prompt(codec: TextCodec, messages: list[dict]) -> list[int]:
    """The token ids of `messages` ([{role, content}]) rendered by the template, ready for the assistant's turn."""
    if not chat_template(codec):
        raise NoChatTemplate("this model has no chat template (neither its tokenizer config nor its GGUF metadata "
                             "gives one): use /v1/completions with a plain prompt")
    try:
        text = codec.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # the template's own checks (roles must alternate, ...) raise from jinja
        raise MoeSwarmError(f"the model's chat template refused these messages: {one_line(error)}") from None
    return codec.encode(text)
