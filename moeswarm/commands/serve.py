"""`moeswarm serve`: an OpenAI-compatible gateway; concurrent requests share every MoE round trip.

Every flag can also come from the environment as MOESWARM_<FLAG> (--max-batch: MOESWARM_MAX_BATCH);
a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys

from moeswarm.commands._setup import add_quiet, quiet_progress, set_backbone_threads, set_switch_interval
from moeswarm.commands._speculate import add_speculate
from moeswarm.commands._stages import add_stages, check_stages
from moeswarm.commands._swarm import check_workers_or_swarm, model_from_swarm
from moeswarm.commands._swarm_flags import add_swarm_flags, swarm_config
from moeswarm.commands._types import non_negative, non_negative_seconds, port, positive, seconds
from moeswarm.generation.draft_names import DEFAULT_DRAFT, DRAFTERS, check_draft_flags
from moeswarm.serve.options import ServeOptions
from moeswarm.serve.options import model_name as _model_name  # noqa: F401 (its name here before serve/options.py)

ENV_PREFIX = "MOESWARM_"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None,
        help="model directory (config.json + safetensors) or GGUF file (.gguf); with --swarm INVITE it may be left out: "
             "the backbone (every tensor but the routed experts) is fetched from the invite's seeder into ~/.cache/moeswarm/join, "
             "the whole model with --check-local")
    add("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    add("--port", type=port, default=8080, help="TCP port to listen on (0: any free one, printed at start)")
    add("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    add("--model-name", default=None, help="the model's id in the API (default: the model's directory or file name)")
    add_speculate(add, "request per step; a request may ask for fewer with 'speculate'")
    add("--draft", choices=DRAFTERS, default=DEFAULT_DRAFT,
        help="where --speculate's drafts come from: ngram (prompt lookup), suffix (the longest earlier match in this and recent requests), local (the backbone with only its "
             "--local-experts, no round trip), both (n-gram on a match of 2+ tokens, else local)")
    add("--max-batch", type=positive, default=16, help="requests stepped together; more wait in a queue")
    add("--groups", type=non_negative, default=0, metavar="G",
        help="batches in flight: a step's requests split into G groups that take turns at every MoE layer, so one "
             "computes while another's trip is on the wire (0, the default: one or two, whichever steps faster as measured)")
    add("--ctx-size", type=positive, default=None,
        help="positions per request, prompt and output (default: the model's max_position_embeddings)")
    add("--prefill-chunk", type=positive, default=64, help="most prompt tokens a request feeds per step")
    add("--step-tokens", type=positive, default=256,
        help="token budget of a step: decode tokens first, then prompt chunks; grows up to 8x while the prompt "
             "tokens' compute fits in the step's wait on replies (engine/step_budget.py)")
    add("--cache-slots", type=non_negative, default=8, help="finished requests' KV caches kept for prefix reuse (0: off)")
    add("--check-local", action="store_true",
        help="debug: run every batched step on a local eager model too and count logits that are not bit-identical "
             "(moeswarm_check_local_mismatched_logits in /metrics)")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="uvicorn's log level")
    add_swarm_flags(parser)
    add_stages(parser)
    _add_http_flags(parser)
    _defaults_from_environment(parser)
    add_quiet(parser)


# -- the HTTP side's flags: requests, their defaults and limits (not the swarm's) ----------------------------

def _add_http_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP API")
    add = group.add_argument
    add("--chat-template", default=None, metavar="FILE|NAME",
        help="the chat template of /v1/chat/completions: a Jinja file, or chatml (default: the model's own)")
    add("--max-tokens", type=positive, default=None, metavar="N",
        help="a request's max_tokens when it gives none (default: 16 for completions, as OpenAI; chat: until the context is full)")
    add("--cors-origins", default=None, metavar="ORIGINS",
        help="comma-separated origins a browser page may call the API from (* for any; default: none)")
    add("--max-queue", type=non_negative, default=256, metavar="N",
        help="requests waiting for a slot; past that, 429 with Retry-After")
    add("--max-connections", type=positive, default=512, metavar="N",
        help="open HTTP connections; one past that is closed as soon as it is accepted")
    add("--header-timeout", type=seconds, default=10.0, metavar="SECONDS",
        help="a request's headers must arrive within this (from the connection or the previous response)")
    add("--body-timeout", type=seconds, default=30.0, metavar="SECONDS",
        help="a request's body must arrive within this after its headers")
    add("--drain-seconds", type=non_negative_seconds, default=30.0, metavar="SECONDS",
        help="on SIGINT or SIGTERM, new requests get 503 and running ones get this long to end; streams still "
             "running then end with an error event and [DONE] (default: 30; 0: at once; a second signal: at once)")


def _defaults_from_environment(parser: argparse.ArgumentParser) -> None:
    """MOESWARM_<FLAG> gives a flag's default; argparse converts it with the flag's own type."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = os.environ.get(ENV_PREFIX + action.dest.upper())
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.strip().lower() in ("1", "true", "yes", "on")
        else:
            action.default = value  # a string default goes through the flag's type, as if given on the command line
        action.required = False


def run(args: argparse.Namespace) -> int:
    quiet_progress(args)
    check_workers_or_swarm(args)
    model_from_swarm(args)
    check_draft_flags(args.draft, args.speculate, args.local_experts is not None)  # the engine checks the held experts
    from moeswarm.serve.server import serve

    serve(options_from(args), _holders(args), on_listening=_say_listening, on_ready=_ready,
          before_load=lambda: _process_settings(args.threads))
    return 0


def options_from(args: argparse.Namespace) -> ServeOptions:
    """The ServeOptions the flags ask for (the swarm's and the stages' flags go to `_holders`)."""
    return ServeOptions(
        model=args.model, backbone_dtype=args.backbone_dtype, host=args.host, port=args.port, api_key=args.api_key,
        model_name=args.model_name, log_level=args.log_level, ctx_size=args.ctx_size, max_batch=args.max_batch,
        speculate=args.speculate, speculate_policy=args.speculate_policy, draft=args.draft, groups=args.groups, prefill_chunk=args.prefill_chunk,
        step_tokens=args.step_tokens, cache_slots=args.cache_slots, check_local=args.check_local,
        workers=tuple(args.workers or ()), chat_template=args.chat_template,
        max_tokens=args.max_tokens, cors_origins=tuple(o.strip() for o in (args.cors_origins or "").split(",") if o.strip()),
        max_queue=args.max_queue, max_connections=args.max_connections, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, drain_s=args.drain_seconds)


def _holders(args: argparse.Namespace):
    """The server's way from the opened model to its SwarmConfig and stages: the flags, checked against the
    model; with --stages-swarm the chain is found on the swarm here (check_stages sets args.stages, and
    args.stage_watch: the swarm kept joined for stages announced later)."""
    def holders(source, report):
        swarm = swarm_config(args, source, report=report)
        check_stages(args, swarm, source)
        return swarm, tuple(args.stages or ()), args.stage_watch

    return holders


def _process_settings(threads: int | None) -> None:
    """This process's torch threads and GIL switch interval, once the flags are checked (serve's `before_load`)."""
    set_backbone_threads(threads)
    set_switch_interval()


def _say_listening(host: str, port: int) -> None:
    print(f"moeswarm serve: listening on http://{host}:{port}", flush=True)


def _ready(line: str) -> None:
    """The model and its holders are loaded: out of the collector's walks on every step (gc_freeze.py); say so."""
    from moeswarm.gc_freeze import freeze_loaded

    freeze_loaded()
    print(f"moeswarm serve: {line}", file=sys.stderr, flush=True)
