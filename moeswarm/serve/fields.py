"""Which request fields the routes take: every field either works or is refused by name.

The rule (docs/serve.md): a field the request model declares works as documented; a field that
changes nothing here by its nature (who the end user is, OpenAI's storage and billing hints:
NO_EFFECT) is accepted and does nothing; a field set to null is absent; any other field is refused
with a 400 that names every such field. Fields whose name is known but which are not built
(NOT_BUILT: legacy functions, suffix, other servers' grammar fields) may also come empty ([], {},
"", "none"), as some clients send them so.
"""

from __future__ import annotations

from moeswarm.errors import printable

# Fields that would change the output and are not built: a request that sets one gets a 400 naming it.
NOT_BUILT = ("tools", "tool_choice", "functions", "function_call", "suffix", "guided_json",
             "guided_regex", "guided_choice", "guided_grammar", "grammar", "json_schema", "typical_p", "mirostat",
             "tfs_z", "prediction", "audio", "modalities")
# Fields that change nothing on any server but OpenAI's own (an end user's id, storage, billing, cache keys).
NO_EFFECT = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
             "prompt_cache_retention")
EMPTY = (None, [], {}, "none", "")
MOST_NAMED = 8  # unknown fields named in one error


def refused_fields(extra: dict) -> str | None:
    """The error for the undeclared fields `extra` of a request ({name: value}), or None when each of
    them may pass (NO_EFFECT, null, or a NOT_BUILT one left empty)."""
    built = [name for name in NOT_BUILT if extra.get(name) not in EMPTY]
    if built:
        return f"{built[0]}: not supported by this server ({', '.join(built)})"
    unknown = [name for name, value in extra.items()
               if value is not None and name not in NO_EFFECT and name not in NOT_BUILT]
    if not unknown:
        return None
    named = ", ".join(printable(str(name), 64) for name in unknown[:MOST_NAMED])
    more = f" and {len(unknown) - MOST_NAMED} more" if len(unknown) > MOST_NAMED else ""
    return (f"{printable(str(unknown[0]), 64)}: unknown field{'s' if len(unknown) > 1 else ''} {named}{more}: "
            "this server refuses fields it does not implement (docs/serve.md lists those it takes)")
