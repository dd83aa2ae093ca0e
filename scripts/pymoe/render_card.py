#!/usr/bin/env python
"""Render ``docs/model-card.md`` from ``models/pymoe/eval.json`` (written by ``scripts/eval_pymoe.py``).

Every number in the card is read from that JSON, so the card never reports a number the eval did
not print.

    python scripts/pymoe/render_card.py
"""
from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def fence(s: str) -> str:
    return "```python\n" + s.replace("```", "` ` `") + "\n```"


def main() -> None:
    ev = json.loads((ROOT / "models/pymoe/eval.json").read_text())
    split = json.loads((ROOT / "models/pymoe/split.json").read_text())
    c, p, tr, ho, rt, pl = ev["config"], ev["params"], ev["training"], ev["heldout"], ev["routing"], ev["prompt_lookup"]
    top10_key = next(k for k in rt["per_layer"][0] if k.startswith("top10pct_share("))
    sizes = {str(f.relative_to(ROOT)): f.stat().st_size for f in sorted((ROOT / "models/pymoe").rglob("*")) if f.is_file()}
    L = []
    a = L.append
    a("# pymoe: a small trained fine-grained MoE for moeswarm\n")
    a("A from-scratch `qwen2_moe` language model trained on the Python standard library on this project's "
      "2-core CPU machine. It exists so that the demo, the correctness gates and the benchmarks have a "
      "*trained* MoE (peaked logits, real routing skew) that ships with the repository, in Hugging Face "
      "format and as llama.cpp GGUF files. It is a toy: it writes Python-shaped text, not working programs.\n")
    a("All numbers below were printed by `scripts/eval_pymoe.py` (saved as `models/pymoe/eval.json`) and "
      "copied into this card by `scripts/pymoe/render_card.py`.\n")
    a("## Files\n")
    a("| file | bytes |\n|---|---:|")
    for rel, size in sizes.items():
        a(f"| `{rel}` | {size:,} |")
    a(f"\nTotal: {sum(sizes.values()):,} bytes.\n")
    a("Reproduce: `python scripts/train_pymoe.py` (HF model, tokenizer, split, held-out text), "
      "`python scripts/pymoe/prompts.py`, `python scripts/convert_pymoe_gguf.py`, `python scripts/eval_pymoe.py`, "
      "`python scripts/pymoe/render_card.py`.\n")
    a("## Architecture\n")
    a("transformers `Qwen2MoeForCausalLM` (GGUF arch `qwen2moe`); every layer is MoE with one gated shared expert.\n")
    a("| setting | value |\n|---|---|")
    for k, v in c.items():
        a(f"| `{k}` | {v} |")
    a("\nAttention has q/k/v biases (`qkv_bias`, the qwen2_moe default); RoPE theta 10000; RMSNorm eps 1e-6; "
      "`norm_topk_prob=False` because llama.cpp's qwen2moe graph does not renormalise the top-k weights.\n")
    a("| parameters | count |\n|---|---:|")
    a(f"| total | {p['total']:,} |")
    a(f"| routed experts (all layers) | {p['routed_experts']:,} ({p['per_expert']:,} per expert) |")
    a(f"| routed-expert share of total | {p['routed_share']:.1%} |")
    a(f"| active per token (non-routed + {c['num_experts_per_tok']}/{c['num_experts']} of routed) | {p['active_per_token']:,} |")
    a(f"| active per token excluding the input embedding | {p['active_per_token_excl_embeddings']:,} |")
    a(f"| input embedding / lm_head (untied) | {p['embedding']:,} / {p['lm_head']:,} |\n")
    a("## Tokenizer\n")
    a(f"Byte-level BPE, vocabulary {c['vocab_size']} (incl. `<|endoftext|>`, id 0, used as end-of-text and padding; "
      "no BOS), trained with `tokenizers` on the training files. The pre-tokenizer is Qwen2's regex verbatim "
      "followed by byte-level mapping, so llama.cpp's `qwen2` pre-tokenizer reproduces it: the GGUF converter is "
      "told so (`scripts/convert_pymoe_gguf.py`) and the eval checks llama.cpp's tokenization against "
      "transformers' on every held-out document (see GGUF section).\n")
    a("## Corpus and split\n")
    a(f"The running Python's standard library (`sysconfig.get_paths()['stdlib']`, Python {split['python']}): every "
      f"`*.py` file, sorted by relative path, excluding directories named {', '.join('`'+x+'`' for x in split['exclude_dir_parts'])} "
      "(test suites; IDLE; lib2to3; generated docs and codec tables that would dominate). "
      f"Split by file: {split['rule']}. {len(split['train'])} training files, {len(split['heldout'])} held-out files; "
      "exact lists in `models/pymoe/split.json`, held-out text in `models/pymoe/heldout.txt` "
      "(documents joined by `<|endoftext|>`). A different Python version has different files: the shipped split "
      "and held-out text are the reference.\n")
    a("## Training\n")
    a(f"Seed {tr['seed']}; AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), peak LR {tr['lr']}, "
      f"{tr['warmup']} warm-up steps then cosine to 10 %; gradient clipping 1.0; batch {tr['batch']} x {tr['ctx']} tokens, "
      "windows drawn uniformly from the concatenated training stream by a seeded generator; router aux "
      f"(load-balancing) loss coefficient {c['router_aux_loss_coef']}; float32; {tr['threads']} CPU threads "
      f"(`OMP_WAIT_POLICY={tr.get('omp_wait_policy')}`); training experts implementation `{tr['experts_impl_training']}`.\n")
    a("| | |\n|---|---:|")
    a(f"| training-corpus tokens | {tr['train_corpus_tokens']:,} |")
    a(f"| steps | {tr['steps_done']} of {tr['steps_planned']} planned (stopped early: {tr['stopped_early']}) |")
    a(f"| tokens trained | {tr['tokens_trained']:,} ({tr['epochs']} epochs) |")
    a(f"| training wall time (2 shared CPU cores) | {tr['train_wall_s']} s |")
    a(f"| last logged training LM loss | {tr['final_logged_lm_loss']} |\n")
    a("## Held-out loss\n")
    a(f"transformers, `experts_implementation=\"eager\"`, float32; {ho['tokens']:,} predicted tokens "
      f"({ho['windows']} non-overlapping windows of {ho['ctx']}):\n")
    a(f"- loss **{ho['loss']}** nats/token, perplexity **{ho['ppl']}**\n")
    a("## Sample greedy generations (transformers)\n")
    for g in ev["generations"]:
        a(f"Prompt `{g['prompt']!r}`, 48 new tokens:\n")
        a(fence(g["prompt"] + g["continuation"]) + "\n")
    a("## Routing skew (held-out tokens)\n")
    a(f"Routing mass of an expert = sum of its top-{rt['top_k']} routing weights over the {rt['tokens']:,} held-out "
      f"tokens. Top 10 % = the {top10_key.split('(top')[1].rstrip(')')} most-loaded of {rt['num_experts']} experts "
      f"(uniform routing would give {rt['uniform_top10pct_share']}). With {rt['num_experts']} experts the top-32 share "
      "is trivially 1.0; the top-8 share is given as well. `max/min xN`: the most/least loaded expert's share times N "
      "(1.0 = even).\n")
    a("| layer | top-10 % share | top-8 share | top-32 share | max xN | min xN | normalised entropy | top-10 % share by count |")
    a("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rt["per_layer"]:
        a(f"| {r['layer']} | {r[top10_key]} | {r['top8_share']} | {r['top32_share']} | {r['max_expert_share_xN']} | "
          f"{r['min_expert_share_xN']} | {r['norm_entropy']} | {r['top10pct_share_by_count']} |")
    a(f"\nMean top-10 % share over layers: {rt['mean_top10pct_share']}.\n")
    a("## n-gram prompt lookup (speculative decoding proxy)\n")
    a(f"On the {pl['prompts']} held-out prompts of `models/pymoe/prompts.jsonl`, {pl['new_tokens_per_prompt']} greedy tokens "
      f"each: draft K={pl['K']} tokens by matching the context's last 3-gram (else 2-gram) at its latest earlier "
      "occurrence; accept the longest prefix equal to the model's greedy tokens, plus one token from the model. "
      f"Checked equal to plain greedy decoding on {pl['matches_plain_greedy_checked_on']} prompts.\n")
    a(f"- verification steps: {pl['steps']}, tokens produced: {pl['tokens']}")
    a(f"- mean tokens per verification step (accepted + 1): **{pl['mean_tokens_per_step']}**")
    a(f"- mean accepted draft tokens per step: **{pl['mean_accepted_per_step']}**")
    a(f"- steps that had a draft: {pl['share_steps_with_draft']}; mean accepted per drafted step: {pl['mean_accepted_per_drafted_step']}\n")
    rep = [q for q in pl["per_prompt"] if q["repetitive"]]
    if rep:
        a("Prompts marked repetitive in prompts.jsonl: " + ", ".join(f"{q['id']} {q['tokens_per_step']} tokens/step" for q in rep) + ".\n")
    a("## GGUF files (llama.cpp)\n")
    a("Made by llama.cpp's own `convert_hf_to_gguf.py` (F16) and `llama_model_quantize` (Q8_0, Q4_K_M from an F32 "
      "GGUF), see `scripts/convert_pymoe_gguf.py`. With hidden 128 and expert width 64, most rows are not multiples "
      "of 256, so llama.cpp falls back from K-quants for those tensors; the types actually written are listed. "
      "Logits: llama.cpp (`Llama(logits_all=True)`) vs transformers eager float32 on the first held-out prompts, "
      "every position.\n")
    a("| file | bytes | tensor types (count) | tokenization equal (held-out docs) | positions | mean cos | min cos | argmax agree |")
    a("|---|---:|---|---|---:|---:|---:|---:|")
    for n, g in ev["gguf"].items():
        tt = ", ".join(f"{k} {v}" for k, v in sorted(g["tensor_types"]["counts"].items()))
        a(f"| {n} | {g['bytes']:,} | {tt} | {g['tokenization_equal_docs']} | {g['positions']} | {g['mean_cos']} | {g['min_cos']} | {g['argmax_agree']} |")
    a("\nTypes per tensor kind:\n")
    names = list(ev["gguf"])
    kinds = sorted(set().union(*(g["tensor_types"]["by_tensor"] for g in ev["gguf"].values())))
    a("| tensor | " + " | ".join(names) + " |")
    a("|---|" + "---|" * len(names))
    for k in kinds:
        a(f"| `{k}` | " + " | ".join(", ".join(ev["gguf"][n]["tensor_types"]["by_tensor"].get(k, [])) for n in names) + " |")
    a("\nllama.cpp greedy continuation of `'def fibonacci(n):\\n'` (32 tokens):\n")
    for n, g in ev["gguf"].items():
        a(f"{n}:\n")
        a(fence("def fibonacci(n):\n" + g["greedy_fibonacci"]) + "\n")
    a("## Limitations\n")
    a("- Tiny and briefly trained: it continues Python-looking text, often repetitive, and is not a code assistant.\n"
      "- The split is by file of one Python version's stdlib; near-duplicate code across stdlib files exists, so "
      "held-out loss is optimistic compared with unseen third-party code.\n"
      "- Routing statistics are for held-out stdlib text only.\n")
    (ROOT / "docs/model-card.md").write_text("\n".join(L) + "\n")
    print("wrote docs/model-card.md")


if __name__ == "__main__":
    main()
