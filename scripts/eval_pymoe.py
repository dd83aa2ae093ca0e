#!/usr/bin/env python
"""Evaluate pymoe; print JSON and write it to ``models/pymoe/eval.json``.

Every number in ``docs/model-card.md`` comes from this script's output. Reference maths is
transformers with the ``eager`` experts implementation, float32, 2 threads.

Measures:
- parameter counts: total, routed experts, active per token (non-routed + top_k/num_experts of
  routed), routed-expert share;
- held-out loss / perplexity: the held-out files (``models/pymoe/heldout.txt``, documents joined by
  ``<|endoftext|>``), tokenized per document with an end-of-text token after each, concatenated and
  cut into non-overlapping windows of ``ctx`` tokens; mean next-token cross-entropy over all
  predicted positions;
- routing skew per layer over those same held-out tokens: routing mass of expert e = sum over
  tokens of its top-k routing weight (0 when not selected). Reported: share of mass on the top
  10 % of experts (ceil(0.1 * N)), on the top 32 of N (1.0 when N = 32), on the top 8, the
  least-loaded expert's share x N (1.0 = perfectly even), and the normalised entropy;
- greedy generations for the demo prompts (``generate``, ``do_sample=False``);
- n-gram prompt lookup on the held-out prompts: greedy decoding where each verification step
  drafts K=4 tokens by finding the latest earlier occurrence of the context's last 3-gram (then
  2-gram) and copying what followed; the longest draft prefix equal to the model's own greedy
  tokens is accepted, plus the model's next token. Mean tokens per step = accepted + 1. The output
  is checked to equal plain greedy decoding;
- GGUF files: tensor types (``gguf.GGUFReader``), llama.cpp tokenization vs transformers on the
  held-out documents, and llama.cpp logits (``Llama(logits_all=True)``) vs transformers logits on
  held-out prompts: cosine per position (mean/min) and argmax agreement.

    python scripts/eval_pymoe.py [--model models/pymoe] [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared 2-core machine: see train_pymoe.py
import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"


def load(hf_dir: pathlib.Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, experts_implementation="eager")
    model.eval()
    return tok, model


def param_counts(model) -> dict:
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    embed = model.get_input_embeddings().weight.numel()
    lm_head = model.get_output_embeddings().weight.numel()
    active = total - routed + routed * cfg.num_experts_per_tok // cfg.num_experts
    return {"total": total, "routed_experts": routed, "routed_share": round(routed / total, 4),
            "active_per_token": active, "embedding": embed, "lm_head": lm_head,
            "active_per_token_excl_embeddings": active - embed,
            "per_expert": routed // (cfg.num_experts * cfg.num_hidden_layers)}


def heldout_ids(tok, model_dir: pathlib.Path) -> list[int]:
    eot = tok.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for doc in (model_dir / "heldout.txt").read_text().split(EOT):
        ids += tok(doc, add_special_tokens=False)["input_ids"] + [eot]
    return ids


@torch.no_grad()
def heldout_loss_and_routing(model, ids: list[int], ctx: int, batch: int = 8) -> tuple[dict, dict]:
    cfg = model.config
    L, E, k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    mass = torch.zeros(L, E, dtype=torch.float64)
    count = torch.zeros(L, E, dtype=torch.float64)
    hooks = []
    for li, layer in enumerate(model.model.layers):
        def hook(mod, inp, out, li=li):
            _, w, idx = out  # router_logits, top-k weights, top-k indices
            mass[li].index_add_(0, idx.reshape(-1), w.reshape(-1).double())
            count[li].index_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.float64))
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    n_win = (len(ids) - 1) // ctx
    x_all = torch.tensor(ids[: n_win * ctx + 1])
    tot_nll, tot_n = 0.0, 0
    for b in range(0, n_win, batch):
        rows = range(b, min(n_win, b + batch))
        x = torch.stack([x_all[r * ctx:(r + 1) * ctx] for r in rows])
        y = torch.stack([x_all[r * ctx + 1:(r + 1) * ctx + 1] for r in rows])
        logits = model(input_ids=x).logits
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
        tot_nll += nll.item()
        tot_n += y.numel()
    for h in hooks:
        h.remove()
    loss = tot_nll / tot_n
    top10 = math.ceil(0.1 * E)
    per_layer = []
    for li in range(L):
        m = mass[li] / mass[li].sum()
        c = count[li] / count[li].sum()
        s = torch.sort(m, descending=True).values
        ent = -(m[m > 0] * m[m > 0].log()).sum().item() / math.log(E)
        per_layer.append({
            "layer": li,
            f"top10pct_share(top{top10})": round(s[:top10].sum().item(), 4),
            "top32_share": round(s[:min(32, E)].sum().item(), 4),
            "top8_share": round(s[:8].sum().item(), 4),
            "max_expert_share_xN": round(s[0].item() * E, 3),
            "min_expert_share_xN": round(s[-1].item() * E, 3),
            "norm_entropy": round(ent, 4),
            "top10pct_share_by_count": round(torch.sort(c, descending=True).values[:top10].sum().item(), 4),
        })
    return ({"tokens": tot_n, "windows": n_win, "ctx": ctx, "loss": round(loss, 4), "ppl": round(math.exp(loss), 3)},
            {"num_experts": E, "top_k": k, "tokens": tot_n, "uniform_top10pct_share": round(top10 / E, 4),
             "per_layer": per_layer,
             "mean_top10pct_share": round(float(np.mean([p[f"top10pct_share(top{top10})"] for p in per_layer])), 4)})


@torch.no_grad()
def greedy_next(model, ids: list[int]) -> torch.Tensor:
    """Greedy token after every position of ``ids`` (full recompute: simple and exact)."""
    return model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)


def lookup_draft(ctx: list[int], K: int = 4) -> list[int]:
    for n in (3, 2):
        if len(ctx) <= n:
            continue
        tail = ctx[-n:]
        for s in range(len(ctx) - n - 1, -1, -1):  # latest earlier occurrence
            if ctx[s:s + n] == tail:
                return ctx[s + n:s + n + K]
    return []


@torch.no_grad()
def prompt_lookup(model, tok, prompts: list[dict], new_tokens: int, K: int = 4) -> dict:
    steps = produced = accepted = drafted_steps = 0
    per_prompt = []
    checked = 0
    for p in prompts:
        ids = tok(p["text"], add_special_tokens=False)["input_ids"]
        ctx = list(ids)
        ps = pa = 0
        while len(ctx) - len(ids) < new_tokens:
            draft = lookup_draft(ctx, K)[: new_tokens - (len(ctx) - len(ids)) - 1] if True else []
            g = greedy_next(model, ctx + draft)[len(ctx) - 1:]  # model's greedy token at each draft slot
            a = 0
            while a < len(draft) and draft[a] == g[a].item():
                a += 1
            ctx += draft[:a] + [g[a].item()]
            ps += 1
            pa += a
            drafted_steps += bool(draft)
        steps += ps
        accepted += pa
        produced += len(ctx) - len(ids)
        per_prompt.append({"id": p["id"], "repetitive": p.get("repetitive"), "steps": ps,
                           "tokens_per_step": round((len(ctx) - len(ids)) / ps, 3)})
        if checked < 2:  # speculation must not change the output: compare with plain greedy generate
            ref = model.generate(torch.tensor([ids]), max_new_tokens=len(ctx) - len(ids), do_sample=False)[0].tolist()
            assert ref == ctx, f"prompt lookup diverged from greedy on {p['id']}"
            checked += 1
    return {"K": K, "ngram": [3, 2], "new_tokens_per_prompt": new_tokens, "prompts": len(prompts),
            "steps": steps, "tokens": produced, "mean_tokens_per_step": round(produced / steps, 4),
            "mean_accepted_per_step": round(accepted / steps, 4),
            "share_steps_with_draft": round(drafted_steps / steps, 4),
            "mean_accepted_per_drafted_step": round(accepted / max(1, drafted_steps), 4),
            "matches_plain_greedy_checked_on": checked, "per_prompt": per_prompt}


def gguf_types(path: pathlib.Path) -> dict:
    from gguf import GGUFReader
    r = GGUFReader(str(path))
    counts: dict[str, int] = {}
    for t in r.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    kinds: dict[str, set] = {}
    for t in r.tensors:
        kinds.setdefault(t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name, set()).add(t.tensor_type.name)
    return {"counts": counts, "by_tensor": {k: sorted(v) for k, v in sorted(kinds.items())}}


@torch.no_grad()
def gguf_compare(path: pathlib.Path, model, tok, prompts: list[dict], heldout_docs: list[str]) -> dict:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    # Tokenization parity on the held-out text (llama.cpp's qwen2 pre-tokenizer vs ours).
    tok_docs_equal = sum(
        llm.tokenize(d.encode(), add_bos=False, special=False) == tok(d, add_special_tokens=False)["input_ids"]
        for d in heldout_docs)
    cos_all, agree, n_pos, per_prompt = [], 0, 0, []
    for p in prompts:
        ids = tok(p["text"], add_special_tokens=False)["input_ids"]
        llm.reset()
        llm.eval(ids)
        lg = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        ref = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
        cos = (lg * ref).sum(-1) / (np.linalg.norm(lg, axis=-1) * np.linalg.norm(ref, axis=-1))
        ag = int((lg.argmax(-1) == ref.argmax(-1)).sum())
        cos_all.append(cos)
        agree += ag
        n_pos += len(ids)
        per_prompt.append({"id": p["id"], "positions": len(ids), "mean_cos": round(float(cos.mean()), 5),
                           "min_cos": round(float(cos.min()), 5), "argmax_agree": round(ag / len(ids), 4)})
    cos_all = np.concatenate(cos_all)
    gen = llm.create_completion("def fibonacci(n):\n", max_tokens=32, temperature=0.0, top_k=1)["choices"][0]["text"]
    del llm
    return {"bytes": path.stat().st_size, "tensor_types": gguf_types(path),
            "tokenization_equal_docs": f"{tok_docs_equal}/{len(heldout_docs)}",
            "positions": n_pos, "mean_cos": round(float(cos_all.mean()), 5), "min_cos": round(float(cos_all.min()), 5),
            "argmax_agree": round(agree / n_pos, 4), "per_prompt": per_prompt,
            "greedy_fibonacci": gen}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models/pymoe"), help="dir with hf/, gguf/, heldout.txt, prompts.jsonl")
    ap.add_argument("--out", default=None, help="JSON output (default <model>/eval.json)")
    ap.add_argument("--lookup-new-tokens", type=int, default=64)
    ap.add_argument("--gguf-prompts", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="few prompts, for a smoke test")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    mdir = pathlib.Path(args.model)
    t0 = time.time()
    tok, model = load(mdir / "hf")
    prompts = [json.loads(l) for l in (mdir / "prompts.jsonl").read_text().splitlines() if l.strip()]
    held = [p for p in prompts if p["kind"] == "heldout"]
    demo = [p for p in prompts if p["kind"] == "demo"]
    if args.quick:
        held, demo = held[:3], demo[:2]

    res: dict = {"model": str(mdir / "hf"), "config": {k: getattr(model.config, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "norm_topk_prob", "router_aux_loss_coef", "max_position_embeddings", "tie_word_embeddings")}}
    res["params"] = param_counts(model)
    log = mdir / "hf" / "train_log.json"
    if log.exists():
        tl = json.loads(log.read_text())
        res["training"] = {k: v for k, v in tl.items() if k != "log"}
        res["training"]["final_logged_lm_loss"] = tl["log"][-1]["lm_loss"]

    ids = heldout_ids(tok, mdir)
    if args.quick:
        ids = ids[: 8 * 256 + 1]
    res["heldout"], res["routing"] = heldout_loss_and_routing(model, ids, ctx=model.config.max_position_embeddings)
    print(json.dumps({"heldout": res["heldout"]}), file=sys.stderr, flush=True)

    res["generations"] = []
    for p in demo:
        x = tok(p["text"], return_tensors="pt", add_special_tokens=False)
        y = model.generate(**x, max_new_tokens=48, do_sample=False)[0, x["input_ids"].shape[1]:]
        res["generations"].append({"id": p["id"], "prompt": p["text"], "continuation": tok.decode(y)})

    res["prompt_lookup"] = prompt_lookup(model, tok, held, args.lookup_new_tokens)
    print(json.dumps({"prompt_lookup": {k: v for k, v in res["prompt_lookup"].items() if k != "per_prompt"}}),
          file=sys.stderr, flush=True)

    docs = (mdir / "heldout.txt").read_text().split(EOT)
    res["gguf"] = {}
    for name in ("F16", "Q8_0", "Q4_K_M"):
        f = mdir / "gguf" / f"pymoe-{name}.gguf"
        if f.exists():
            res["gguf"][name] = gguf_compare(f, model, tok, held[: args.gguf_prompts], docs)
    res["eval_wall_s"] = round(time.time() - t0, 1)
    text = json.dumps(res, indent=1)
    print(text)
    pathlib.Path(args.out or mdir / "eval.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
