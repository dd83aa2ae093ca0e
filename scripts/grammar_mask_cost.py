"""Per-token mask cost of llguidance, xgrammar and outlines-core on the bundled model's vocabulary.

What serve/grammar.py's choice of llguidance rests on. The three are not all dependencies of
moeswarm: install them aside, without their dependencies (xgrammar's pull in triton), and point
this script at them:

    pip download --no-deps -d /tmp/wheels llguidance xgrammar outlines-core apache-tvm-ffi
    pip install --no-deps --target /tmp/gram /tmp/wheels/*.whl
    python scripts/grammar_mask_cost.py /tmp/gram

It walks a JSON document that matches a schema token by token, timing each library's mask of
allowed next tokens (a bitmask over the 4,096 ids, as each fills one); each library runs twice and
the second run is the one to read (the first pays for lazy initialisation).
"""
import json, statistics, sys, time
if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])
import torch
from moeswarm.bundled import TRAINED
from moeswarm.sources.tokenizer import load_text_codec

codec = load_text_codec(TRAINED, 4096)
hf = codec.tokenizer
V = 4096
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"],
          "additionalProperties": False}
DOC = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}'
ids = codec.encode(DOC)
print("doc tokens", len(ids))

def report(name, setup_s, times):
    times = sorted(times)
    print(f"{name:14s} compile {setup_s*1000:8.1f} ms   mask p50 {statistics.median(times)*1e6:7.1f} us  "
          f"p90 {times[int(len(times)*0.9)]*1e6:7.1f} us  max {times[-1]*1e6:7.1f} us  ({len(times)} tokens)")

def llg():
    import llguidance, llguidance.hf, llguidance.torch as lt
    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=V)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": True})
    m = llguidance.LLMatcher(tok, grammar)
    setup = time.perf_counter() - t0
    mask = lt.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in ids:
        s = time.perf_counter(); lt.fill_next_token_bitmask(m, mask, 0); times.append(time.perf_counter() - s)
        assert m.consume_token(t), (t, m.get_error())
    report("llguidance", setup, times)

def xg():
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    m = xgr.GrammarMatcher(compiled)
    setup = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in ids:
        s = time.perf_counter(); m.fill_next_token_bitmask(mask); times.append(time.perf_counter() - s)
        assert m.accept_token(t), t
    report("xgrammar", setup, times)

def oc():
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    # byte-level BPE: outlines-core's Vocabulary wants each token's text as the tokenizer spells it
    def bytes_to_unicode():
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b); cs.append(256 + n); n += 1
        return dict(zip(bs, map(chr, cs)))
    back = {c: b for b, c in bytes_to_unicode().items()}
    vocab = {}
    for token, i in hf.get_vocab().items():
        if i != hf.eos_token_id:
            vocab.setdefault(bytes(back[c] for c in token), []).append(i)
    v = Vocabulary(hf.eos_token_id, vocab)
    regex = build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?")
    index = Index(regex, v)
    guide = Guide(index)
    setup = time.perf_counter() - t0
    times = []
    mask = torch.zeros((V + 31) // 32, dtype=torch.int32)  # a bitmask, as the others fill
    for t in ids:
        s = time.perf_counter(); guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        times.append(time.perf_counter() - s)
        guide.advance(t)
    report("outlines-core", setup, times)

for f in (llg, xg, oc) * 2:
    try:
        f()
    except Exception as e:
        print(f.__name__, "failed:", type(e).__name__, str(e)[:300])
