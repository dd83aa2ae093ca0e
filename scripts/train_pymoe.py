#!/usr/bin/env python
"""Train ``pymoe``: a small fine-grained qwen2_moe LM on the Python standard library, from scratch, on CPU.

Reproducible: fixed seeds, sorted file list, hash-based file split (see ``scripts/pymoe/corpus.py``),
window order drawn from a seeded ``torch.Generator``. Float32 on CPU, 2 threads.

    python scripts/train_pymoe.py --out models/pymoe/hf            # full run (the shipped model)
    python scripts/train_pymoe.py --out /tmp/x --steps 20          # smoke test

Writes to ``--out``: the model (``save_pretrained``, float32 safetensors), the tokenizer
(tokenizer.json + tokenizer_config.json, PreTrainedTokenizerFast), ``train_log.json`` (tokens
trained, wall time, loss curve); next to it (parent dir): ``split.json`` (exact file lists) and
``heldout.txt`` (held-out documents joined by ``<|endoftext|>``).

Tokenizer: byte-level BPE (vocab 4096) trained with ``tokenizers`` using the Qwen2 pre-tokenizer
regex, so llama.cpp's ``qwen2`` pre-tokenizer reproduces it exactly (see
``scripts/convert_pymoe_gguf.py``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

# Passive OpenMP waiting: on a shared 2-core machine, torch's default spinning barriers made a
# 2-thread step up to ~25x slower whenever another process took a core (measured: 1.4 s vs 37 s).
# Must be set before torch initialises OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from moeswarm.progress import progress  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from pymoe import corpus  # noqa: E402

SEED = 1234
VOCAB = 4096
# Identical to Qwen2's tokenizer.json regex and to llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2.
QWEN2_PRETOK = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

MODEL_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,  # unused (every layer is MoE) but kept sane
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    num_experts=32,
    num_experts_per_tok=8,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=256,
    # llama.cpp's qwen2moe graph does not renormalise the top-k weights: keep False so both agree.
    norm_topk_prob=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    # Modest load balancing (Mixtral/OLMoE use 0.01-0.02): avoids collapse, leaves real skew.
    router_aux_loss_coef=0.01,
    output_router_logits=False,  # turned on explicitly in the training forward
    tie_word_embeddings=False,  # llama.cpp's qwen2moe expects its own output matrix
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    use_sliding_window=False,
    bos_token_id=None,
)


def train_tokenizer(train_texts: list[str], out: pathlib.Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOK), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[corpus.EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=corpus.EOT, pad_token=corpus.EOT, model_max_length=256,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/pymoe/hf")
    ap.add_argument("--steps", type=int, default=1400)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--experts-impl", default="grouped_mm", help="training experts implementation (batched_mm gathers a weight copy per token-expert pair: ~15x slower on CPU)")
    ap.add_argument("--max-minutes", type=float, default=42.0,
                    help="safety cap: stop early (and say so in train_log.json) past this wall time")
    ap.add_argument("--stop-after-step", type=int, default=None,
                    help="stop after this many steps with the schedule of --steps: replays a run that the "
                         "wall cap stopped early (train_log.json: steps_done) with the same data order and LR schedule")
    args = ap.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    # ---- corpus and split -------------------------------------------------------------------
    train_files, held_files = corpus.split()
    train_texts = [corpus.read(f) for f in train_files]
    held_texts = [corpus.read(f) for f in held_files]
    (out.parent / "split.json").write_text(json.dumps({
        "python": sys.version.split()[0],
        "stdlib_root": "sysconfig.get_paths()['stdlib']",
        "exclude_dir_parts": sorted(corpus.EXCLUDE_PARTS),
        "rule": f"held out iff int(sha256(relpath).hexdigest(), 16) % 100 < {corpus.HELDOUT_PERCENT}",
        "train": train_files, "heldout": held_files,
    }, indent=1) + "\n")
    (out.parent / "heldout.txt").write_text(corpus.EOT.join(held_texts))

    # ---- tokenizer ----------------------------------------------------------------------------
    tok = train_tokenizer(train_texts, out)
    eot = tok.convert_tokens_to_ids(corpus.EOT)
    ids: list[int] = []
    for t in train_texts:  # sorted file order: deterministic stream
        ids.extend(tok(t, add_special_tokens=False)["input_ids"])
        ids.append(eot)
    data = torch.tensor(ids, dtype=torch.long)
    print(f"train tokens in corpus: {len(data)}  files: {len(train_files)}  (tokenizer+data {time.time()-t_start:.0f}s)", flush=True)

    # ---- model --------------------------------------------------------------------------------
    from transformers import GenerationConfig, Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(**MODEL_CONFIG, eos_token_id=eot, pad_token_id=eot)
    model = Qwen2MoeForCausalLM(cfg)
    model.set_experts_implementation(args.experts_impl)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params}", flush=True)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n or "bias" in n else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10 %
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        prog = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))

    gen = torch.Generator().manual_seed(SEED)
    n_windows = len(data) - args.ctx - 1
    log = []
    tokens_trained = 0
    t_train = time.time()
    stopped_early = False
    for step in progress(range(args.steps), desc="training", unit="step"):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        starts = torch.randint(0, n_windows, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.ctx] for s in starts.tolist()])
        out_ = model(input_ids=x, labels=x, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out_.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_trained += x.numel()
        if step % 25 == 0 or step == args.steps - 1:
            el = time.time() - t_train
            lm = (out_.loss - cfg.router_aux_loss_coef * out_.aux_loss).item()
            rec = {"step": step, "lm_loss": round(lm, 4), "aux_loss": round(out_.aux_loss.item(), 4),
                   "lr": round(lr_at(step), 6), "tokens": tokens_trained, "elapsed_s": round(el, 1)}
            log.append(rec)
            print(json.dumps(rec), f"tok/s={tokens_trained/el:.0f}", flush=True)
        if args.stop_after_step is not None and step + 1 >= args.stop_after_step:
            stopped_early = True
            break
        if (time.time() - t_start) / 60 > args.max_minutes:
            stopped_early = True
            print(f"stopping early at step {step}: wall cap {args.max_minutes} min", flush=True)
            break
    train_wall = time.time() - t_train

    # ---- save ---------------------------------------------------------------------------------
    model.eval()
    # Ship with the reference ("eager") experts; users pick another implementation at load time.
    model.config._experts_implementation = None
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(eos_token_id=eot, pad_token_id=eot, do_sample=False,
                                               max_new_tokens=64)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    summary = {
        "seed": SEED, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "steps_planned": args.steps, "steps_done": step + 1, "stopped_early": stopped_early,
        "batch": args.batch, "ctx": args.ctx, "lr": args.lr, "warmup": args.warmup,
        "experts_impl_training": args.experts_impl, "threads": torch.get_num_threads(),
        "train_corpus_tokens": len(data), "tokens_trained": tokens_trained,
        "epochs": round(tokens_trained / len(data), 3),
        "train_wall_s": round(train_wall, 1), "total_wall_s": round(time.time() - t_start, 1),
        "params": n_params, "torch": torch.__version__, "log": log,
    }
    (out / "train_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}), flush=True)


if __name__ == "__main__":
    main()
