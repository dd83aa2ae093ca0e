#!/usr/bin/env python
"""Survey every transformers family whose experts use `@use_experts_implementation`.

For each family: pick its causal-LM model type (the family's own, or its `*_text` sub-config for
multimodal wrappers), build a tiny random config (the family's own key names for expert count,
top-k and sizes: hidden 32, <= 3 layers, 8 experts, top-2, vocab 260), write it with
`moeswarm.model.tiny.make_tiny_model`, serve experts 0-3 and 4-7 from two in-process workers
(`open_worker` nodes on asyncio loops in background threads, real TCP on 127.0.0.1) and check that
the swarm's logits are `torch.equal` to eager's over a prefill of 10 tokens + 8 greedy decode
steps, as tests/test_families.py does with worker processes.

    python scripts/survey_families.py                    # all families, JSON summary on stdout
    python scripts/survey_families.py qwen3_moe jamba    # some families
    python scripts/survey_families.py --json out.json    # also write the summary to a file

Families already in FAMILIES / EXTRA_FAMILIES use their line there; the others get the generic
tiny keys below (`SURVEY_ONLY` adds per-family quirks that are not yet in tiny.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import importlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings

import torch

DECODE_STEPS = 8
PREFILL = [11, 42, 7, 99, 3, 250, 18, 64, 5, 77]
TIMEOUT_S = 120

# The family's config key -> its tiny value, set when the family's default config has the key.
# Keys whose default is None are left None (an absent feature: no q LoRA, no expert groups...),
# except the ALWAYS ones (dots1 and deepseek_v2 default their expert counts to None).
GENERIC = {
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "moe_topk": 2,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32, "shared_experts_intermediate_size": 32, "dense_intermediate_size": 64,
    "top_k_experts": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 2, "num_expert_group": 2, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "o_lora_rank": 16, "o_groups": 2,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "index_topk": 4, "index_head_dim": 8, "index_n_heads": 2, "index_topk_blocks": 2,
    "linear_head_dim": 8, "linear_num_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 16, "mamba_num_heads": 4,
    "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 1, "mamba_dt_rank": 4, "mamba_n_groups": 1,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8,
    "router_hidden_size": 16, "gated_norm_rank": 4,
    "first_k_dense_replace": 1, "num_dense_layers": 1, "moe_layer_start_index": 1, "moe_layer_end_index": 2,
    "use_mamba_kernels": False,
}
ALWAYS = {"num_experts", "n_routed_experts", "num_experts_per_tok", "n_shared_experts"}
# Per-layer lists sized for the full model: reset to None so the config derives them for 3 layers.
PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "layer_rope_theta", "num_attention_heads_per_layer",
                   "mlp_only_layers", "local_layer_ids")

# Quirks for families not (yet) in tiny.py's tables: model type -> overrides of the generic keys.
# Families that pass move to FAMILIES / EXTRA_FAMILIES with their quirks.
SURVEY_ONLY: dict[str, dict] = {}


def families() -> list[str]:
    """The transformers model directories whose modeling file uses the experts interface."""
    import transformers

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = []
    for path in sorted(glob.glob(os.path.join(root, "*", "modeling_*.py"))):
        with open(path, encoding="utf-8") as source:
            if "use_experts_implementation" in source.read():
                found.append(os.path.basename(os.path.dirname(path)))
    return found


def model_classes(family: str) -> list[str]:
    """The family's task heads (`*For*` classes) in its modeling file."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return [name for name in getattr(module, "__all__", dir(module)) if "For" in name and "PreTrained" not in name]


def causal_model_type(family: str) -> tuple[str | None, list[str]]:
    """(the model type AutoModelForCausalLM builds for `family`, or None; the family's model types)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    module = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    types = [t for t, cls in CONFIG_MAPPING_NAMES.items() if hasattr(module, cls)]
    for choice in (f"{family}_text", family, *types):  # a composite config's text part first
        if choice in types and MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(choice):
            return choice, types
    return None, types


def generic_keys(model_type: str) -> dict:
    """Tiny values for the expert/attention keys the family's default config has."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    keys = {}
    for key, value in GENERIC.items():
        if key in defaults and (defaults[key] is not None or key in ALWAYS):
            keys[key] = value
    if "kv_lora_rank" in defaults:  # multi-head latent attention: as many kv heads as heads
        keys["num_key_value_heads"] = 4
    if defaults.get("pad_token_id") is not None and defaults["pad_token_id"] >= 260:
        keys["pad_token_id"] = 258
    for key in PER_LAYER_LISTS:
        if isinstance(defaults.get(key), list) and defaults[key]:
            keys[key] = None
    return keys


def family_keys(model_type: str) -> tuple[dict, str]:
    """The tiny keys for `model_type` beyond COMMON, and where they come from."""
    from moeswarm.model import tiny

    for table_name in ("FAMILIES", "EXTRA_FAMILIES"):
        table = getattr(tiny, table_name, {})
        if model_type in table:
            return dict(table[model_type]), table_name
    return {**generic_keys(model_type), **SURVEY_ONLY.get(model_type, {})}, "generic"


@contextlib.contextmanager
def thread_workers(path: str, expert_sets: list[list[int]]):
    """One worker node per expert set, each on its own asyncio loop in a daemon thread."""
    from moeswarm.sources.loading import load_experts
    from moeswarm.node.worker import WorkerConfig, open_worker
    from moeswarm.worker.store import ExpertStore

    def loader(experts):
        def load():
            hosted, source, num_experts = load_experts(path, experts)
            return ExpertStore(hosted, num_experts, source.config.hidden_size), source
        return load

    loops, nodes, addresses = [], [], []
    try:
        for experts in expert_sets:
            node = open_worker(WorkerConfig(), loader(experts))
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True).start()
            loops.append(loop)
            host, port = asyncio.run_coroutine_threadsafe(node.start(), loop).result(30)
            nodes.append(node)
            addresses.append(f"{host}:{port}")
        yield addresses
    finally:
        for loop, node in zip(loops, nodes):
            asyncio.run_coroutine_threadsafe(node.stop(), loop).result(10)
        for loop in loops:
            loop.call_soon_threadsafe(loop.stop)


class OwnCacheStepper:
    """Stepper's forward, but the model makes its own cache (MiniMax refuses a DynamicCache)."""

    def __init__(self, model):
        self.model, self.cache = model, None

    @torch.inference_mode()
    def forward(self, tokens: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([tokens]), past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[0].float()


def check(model_type: str, keys: dict, workdir: str, stepper=None) -> dict:
    """Make the tiny model and prove remote == local; return what was measured."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from moeswarm.forward.stepper import Stepper
    from moeswarm.model import tiny

    stepper = stepper or Stepper
    from moeswarm.model.experts import experts_modules
    from moeswarm.sources.loading import load_local
    from moeswarm.swarm import open_swarm

    record = {"model_type": model_type, "model_class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], "keys": keys}
    added = model_type not in tiny.FAMILIES
    if added:  # make_tiny_model reads FAMILIES: lend it this family's line for the survey
        tiny.FAMILIES[model_type] = keys
    try:
        stage = "make"
        path = str(tiny.make_tiny_model(model_type, os.path.join(workdir, model_type)))
        stage = "load_local"
        local_model = load_local(path)
        modules = experts_modules(local_model)
        record["experts_class"] = type(next(iter(modules.values()))[1]).__name__ if modules else None
        record["moe_layers"] = list(modules)
        if not modules:
            return {**record, "status": "fail", "stage": stage, "reason": "no experts module found in the tiny model"}
        local = stepper(local_model)
        stage = "workers"
        with thread_workers(path, [[0, 1, 2, 3], [4, 5, 6, 7]]) as addresses:
            stage = "connect"
            swarm = open_swarm(path, addresses)
            try:
                remote = stepper(swarm.model)
                feed = list(PREFILL)
                for step in range(1 + DECODE_STEPS):
                    stage = f"step {step}"
                    remote_logits, local_logits = remote.forward(feed), local.forward(feed)
                    if not torch.isfinite(local_logits).all():
                        return {**record, "status": "fail", "stage": stage, "reason": "eager logits are not finite"}
                    if not torch.equal(remote_logits, local_logits):
                        diff = (remote_logits - local_logits).abs().max().item()
                        return {**record, "status": "fail", "stage": stage,
                                "reason": f"logits differ at step {step} (max abs diff {diff:.3g})"}
                    feed = [int(remote_logits[-1].argmax())]
                summary = swarm.accounting()
            finally:
                swarm.close()
        served = set(summary["worker_rtt_ms_mean"])
        if served != set(addresses):
            return {**record, "status": "fail", "stage": "accounting", "reason": f"only {sorted(served)} served experts"}
        if summary["layer_calls"] != (1 + DECODE_STEPS) * len(modules):
            return {**record, "status": "fail", "stage": "accounting",
                    "reason": f"{summary['layer_calls']} layer calls, expected {(1 + DECODE_STEPS) * len(modules)}"}
        return {**record, "status": "pass"}
    except Exception as error:  # noqa: BLE001 - the survey records every failure and goes on
        message = f"{type(error).__name__}: {error}".splitlines()[0][:400]
        return {**record, "status": "fail", "stage": stage, "reason": message,
                "where": traceback.extract_tb(error.__traceback__)[-1].filename.split("site-packages/")[-1]}
    finally:
        if added:
            del tiny.FAMILIES[model_type]


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout(f"no result within {TIMEOUT_S} s")


def survey(names: list[str]) -> list[dict]:
    results = []
    signal.signal(signal.SIGALRM, _alarm)
    with tempfile.TemporaryDirectory(prefix="moeswarm-survey-") as workdir:
        for family in names:
            started = time.perf_counter()
            model_type, types = causal_model_type(family)
            if model_type is None:
                heads = ", ".join(model_classes(family)) or "none"
                record = {"family": family, "status": "n/a", "model_types": types,
                          "reason": f"no model type of this family is in AutoModelForCausalLM (its model classes: {heads})"}
            else:
                keys, source = family_keys(model_type)
                signal.alarm(TIMEOUT_S)
                try:
                    record = {"family": family, "keys_from": source, **check(model_type, keys, workdir)}
                    if "uses cache of its own" in record.get("reason", ""):  # is the Stepper's cache the only problem?
                        retry = check(model_type, keys, os.path.join(workdir, "own-cache"), OwnCacheStepper)
                        record["with_model_own_cache"] = retry["status"] + (f": {retry['reason']}" if "reason" in retry else "")
                except _Timeout as error:
                    record = {"family": family, "model_type": model_type, "status": "fail", "reason": str(error)}
                finally:
                    signal.alarm(0)
            record["seconds"] = round(time.perf_counter() - started, 1)
            print(f"{family:24s} {record['status']:5s} {record.get('reason', '')}", file=sys.stderr, flush=True)
            results.append(record)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="transformers model directories (default: all)")
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    results = survey(args.families or families())
    counts = {status: sum(r["status"] == status for r in results) for status in ("pass", "fail", "n/a")}
    summary = {"counts": counts, "families": results}
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
