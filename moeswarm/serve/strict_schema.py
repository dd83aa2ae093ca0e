"""A JSON schema as the strict implementations read it, before it is compiled to a grammar.

vLLM (xgrammar's strict mode) and llama.cpp's json-schema-to-grammar treat an object schema that
lists properties and leaves `additionalProperties` unset as closed: no other key may be written
(OpenAI refuses such a strict schema outright). LangChain's `bind_tools`, its
`with_structured_output(method="function_calling")` and litellm send such schemas; read as JSON
Schema's open default, a small model adds keys until max_tokens. `closed` gives them
`additionalProperties: false`, and bounds what a small model would otherwise write until
max_tokens: an integer without `minimum`/`maximum` has at most 16 digits (llama.cpp's bound), and
so has a number's integer part; a string without `maxLength` (nor a pattern, format, enum or const
of its own) has at most STRING_CHARS characters. Given bounds (`minLength`, `maxLength`,
`minimum`, ...) are kept, and compiled by llguidance.

`closed` also checks that a schema is small enough to compile (MAX_DEPTH levels, MAX_NODES
subschemas): a pathological schema is refused in one line before the grammar library sees it.
"""

from __future__ import annotations

DIGITS = 16  # llama.cpp's bound on an integer's digits
INTEGER_BOUND = 10**DIGITS - 1
STRING_CHARS = 64  # a string's length when its schema gives none
MAX_DEPTH = 64  # nested subschemas
MAX_NODES = 10_000  # subschemas in all
# keywords whose value is one subschema, or a {name: subschema} map, or a list of subschemas
ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
       "unevaluatedProperties", "additionalItems")
MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


class SchemaTooLarge(ValueError):
    pass


def closed(schema: object) -> object:
    """A copy of `schema` with every object that lists properties closed (unless it says otherwise)
    and every unbounded integer bounded to DIGITS digits; SchemaTooLarge past MAX_DEPTH or MAX_NODES."""
    return _Walk().visit(schema, 0)


class _Walk:
    def __init__(self):
        self.nodes = 0

    def visit(self, schema: object, depth: int) -> object:
        if not isinstance(schema, dict):
            if isinstance(schema, list) and depth > MAX_DEPTH:  # a deep list of lists (enum values, say)
                raise SchemaTooLarge(f"nested more than {MAX_DEPTH} levels deep")
            return schema  # true/false, or a keyword's plain value
        self.nodes += 1
        if depth > MAX_DEPTH:
            raise SchemaTooLarge(f"nested more than {MAX_DEPTH} levels deep")
        if self.nodes > MAX_NODES:
            raise SchemaTooLarge(f"more than {MAX_NODES} subschemas")
        out = dict(schema)
        for key in ONE:
            if isinstance(out.get(key), dict):
                out[key] = self.visit(out[key], depth + 1)
        for key in MAP:
            if isinstance(out.get(key), dict):
                out[key] = {name: self.visit(sub, depth + 1) for name, sub in out[key].items()}
        for key in LIST:
            if isinstance(out.get(key), list):
                out[key] = [self.visit(sub, depth + 1) for sub in out[key]]
        for key in ("enum", "const"):  # plain values, but counted: a huge enum is a huge grammar
            if isinstance(out.get(key), list):
                self.nodes += len(out[key])
                if self.nodes > MAX_NODES:
                    raise SchemaTooLarge(f"more than {MAX_NODES} subschemas and enum values")
        types = out.get("type")
        types = types if isinstance(types, list) else [types]
        if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out \
                and "patternProperties" not in out:
            out["additionalProperties"] = False
        if "integer" in types or "number" in types:
            _bound(out)
        if "string" in types and not any(key in out for key in ("maxLength", "pattern", "format", "enum", "const")):
            out["maxLength"] = max(STRING_CHARS, out["minLength"]) if _number(out.get("minLength")) else STRING_CHARS
        return out


def _bound(schema: dict) -> None:
    """Give each open end of a numeric schema the 16-digit bound (an end it gives stays, and a bound
    that would contradict it is not added)."""
    low = [v for v in (schema.get("minimum"), schema.get("exclusiveMinimum")) if _number(v)]
    high = [v for v in (schema.get("maximum"), schema.get("exclusiveMaximum")) if _number(v)]
    if "minimum" not in schema and "exclusiveMinimum" not in schema and all(v > -INTEGER_BOUND for v in high):
        schema["minimum"] = -INTEGER_BOUND
    if "maximum" not in schema and "exclusiveMaximum" not in schema and all(v < INTEGER_BOUND for v in low):
        schema["maximum"] = INTEGER_BOUND


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
