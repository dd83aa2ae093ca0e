"""One HTTP request's jobs: n completions of each prompt, submitted together, their events gathered
into one answer or one stream.

Choice i of prompt p has index p * n + i (OpenAI's order). With a seed, choice i samples with seed + i,
so a list of prompts gives each prompt what it gets alone, and the n choices of a prompt differ.
Every job is cancelled when the answer is done, failed or abandoned: a client that goes away, even
one waiting for a whole answer, frees its slots at the engine's next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import Response

from moeswarm.generation.sampling import SamplingParams
from moeswarm.engine.job import Delta, Failed, Finished, Job, PromptLogprobs, Rewind, TokenLogprob
from moeswarm.serve.responses import APIError, Logprobs, Shapes, error_body, prompt_logprobs, sse
from moeswarm.serve.schemas import Tool
from moeswarm.serve.tools import answer_calls, call_entry

DISCONNECT_POLL_S = 0.05  # how often a whole answer's client is checked for having gone away
ABANDONED = -1  # the index of the event that says the client went away


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    text: str  # what echo shows
    max_tokens: int = 0  # new tokens at most (checked against the context by the caller)


@dataclass(frozen=True)
class Ask:
    """What every job of one request shares."""

    params: SamplingParams
    stops: tuple[str, ...] = ()
    speculate: int | None = None
    n: int = 1
    logprobs: int | None = None  # alternatives per new token; None: no log-probabilities
    echo: bool = False  # the prompt's text before the completion's (and its log-probabilities with logprobs)
    make_constraint: Callable[[], object] | None = None  # a fresh grammar Constraint per job (structured output)
    tools: tuple[Tool, ...] = ()
    tool_mode: str | None = None  # chat: None, "auto", "required" or a function's name (serve/tools.py)
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives per prompt token; None: off


class Run:
    def __init__(self, prompts: list[Prompt], ask: Ask, shapes: Shapes, piece: Callable[[int], str],
                 arrived: float | None = None):
        """arrived: when the HTTP request arrived (time.monotonic(); None: now): its jobs' `submitted`."""
        self.prompts, self.ask, self.shapes, self.piece = prompts, ask, shapes, piece
        self.events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.jobs = []
        for prompt in prompts:
            for i in range(ask.n):
                params = ask.params if ask.params.seed is None else replace(ask.params, seed=ask.params.seed + i)
                emit = _emitter(loop, self.events, len(self.jobs))
                # a job with log-probabilities scores its prompt too (shown with echo only): every row of its
                # prompt is then computed, as a plain forward of the prompt computes it
                scored = [k for k in (ask.logprobs, ask.prompt_logprobs) if k is not None]
                self.jobs.append(Job(prompt.tokens, prompt.max_tokens, params, emit, ask.stops, ask.speculate,
                                     logprobs=ask.logprobs, prompt_logprobs=max(scored) if scored else None,
                                     constraint=ask.make_constraint() if ask.make_constraint else None,
                                     ignore_eos=ask.ignore_eos, min_tokens=ask.min_tokens))
                if arrived is not None:
                    self.jobs[-1].submitted = arrived

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.ask.n]

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancelled.set()  # done, failed or abandoned: the engine drops it at its next step if it still runs

    def logprobs_shape(self, index: int) -> Logprobs:
        offset = 0 if self.ask.echo else len(self.prompt_of(index).text)
        return Logprobs(self.shapes.chat, self.piece, offset)

    async def whole(self, request: Request):
        count = len(self.jobs)
        texts: list[list[str]] = [[] for _ in range(count)]
        scores: list[list[TokenLogprob]] = [[] for _ in range(count)]
        done: list[Finished | None] = [None] * count
        prompt_scored = [0] * count  # echo: the prompt's scores ahead of the output's
        prompts: list[tuple[TokenLogprob, ...]] = [()] * count  # the prompt's scores (prompt_logprobs)
        watcher = asyncio.create_task(self._watch(request))
        try:
            while any(d is None for d in done):
                index, event = await self.events.get()
                if index == ABANDONED:
                    return Response(status_code=499)
                if isinstance(event, PromptLogprobs):
                    prompts[index] = event.logprobs
                    if self.echo_scores:
                        scores[index][:0] = [replace(s, top=s.top[: self.ask.logprobs]) for s in event.logprobs]
                        prompt_scored[index] = len(event.logprobs)
                elif isinstance(event, Delta):
                    texts[index].append(event.text)
                    scores[index].extend(event.logprobs)
                elif isinstance(event, Rewind):  # a liar's steps undone: their text is taken back
                    texts[index] = ["".join(texts[index])[: event.text]]
                    del scores[index][prompt_scored[index] + event.tokens :]
                elif isinstance(event, Finished):
                    done[index] = event
                elif isinstance(event, Failed):
                    raise APIError(event.status, event.message)
        finally:
            watcher.cancel()
            self.cancel()
        choices = []
        for index in range(count):
            generated = "".join(texts[index])
            text = (self.prompt_of(index).text if self.ask.echo else "") + generated
            logprobs = self.logprobs_shape(index).shape(scores[index]) if self.ask.logprobs is not None else None
            calls = self.calls_in(generated, done[index].reason)
            if calls is not None:
                reason = "length" if done[index].reason == "length" else "tool_calls"
                choices.append(self.shapes.call_choice(index, [call_entry(c) for c in calls], reason, logprobs))
            else:
                choices.append(self.shapes.choice(index, text, done[index].reason, logprobs))
            if self.ask.prompt_logprobs is not None and not self.shapes.chat:  # vLLM's place: each choice's
                choices[-1]["prompt_logprobs"] = prompt_logprobs(prompts[index], self.ask.prompt_logprobs, self.piece)
        scored = prompt_logprobs(prompts[0], self.ask.prompt_logprobs, self.piece) \
            if self.ask.prompt_logprobs is not None and self.shapes.chat else None  # chat: one prompt, at the top
        return self.shapes.whole(choices, done, self.ask.n, scored)

    @property
    def echo_scores(self) -> bool:
        """Whether the prompt's log-probabilities go ahead of the output's (completions' echo)."""
        return self.ask.echo and self.ask.logprobs is not None and not self.shapes.chat

    def calls_in(self, text: str, reason: str) -> list[dict] | None:
        """The tool calls a chat answer makes, if tools are on and it makes (or was cut making) them."""
        return answer_calls(text, list(self.ask.tools), self.ask.tool_mode, reason)

    def held(self, text: str) -> bool:
        """Whether a streamed answer's text so far may still be a tool call: kept back until it is known."""
        if self.ask.tool_mode is None:
            return False
        return self.ask.tool_mode != "auto" or text.lstrip()[:1] in ("", "{")

    async def _watch(self, request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.cancel()
        self.events.put_nowait((ABANDONED, None))

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        shapes, count = self.shapes, len(self.jobs)
        shapers = [self.logprobs_shape(index) for index in range(count)]
        done: list[Finished | None] = [None] * count
        kept = [""] * count  # text held back while it may be a tool call
        try:
            for index in range(count):
                if shapes.chat:
                    yield sse(shapes.chunk(role=True, index=index))
                if self.ask.echo and not self.echo_scores and self.prompt_of(index).text:
                    yield sse(shapes.chunk(self.prompt_of(index).text, index=index))
            while any(d is None for d in done):
                index, event = await self.events.get()
                if isinstance(event, PromptLogprobs):
                    if not self.echo_scores:
                        continue
                    trimmed = [replace(s, top=s.top[: self.ask.logprobs]) for s in event.logprobs]
                    yield sse(shapes.chunk(self.prompt_of(index).text, index=index,
                                           logprobs=shapers[index].shape(trimmed)))
                elif isinstance(event, Delta):
                    logprobs = shapers[index].shape(event.logprobs) if self.ask.logprobs is not None else None
                    text = event.text
                    if self.held(kept[index] + text):
                        kept[index], text = kept[index] + text, ""
                    elif kept[index]:  # no call after all: what was held goes out first
                        kept[index], text = "", kept[index] + text
                    if text or logprobs:
                        yield sse(shapes.chunk(text, index=index, logprobs=logprobs))
                elif isinstance(event, Finished):
                    done[index] = event
                    calls = self.calls_in(kept[index], event.reason) if self.ask.tool_mode is not None else None
                    if calls is not None:
                        for at, call in enumerate(calls):
                            yield sse(shapes.call_chunk(index, call_entry(call, index=at)))
                        yield sse(shapes.chunk(None, "length" if event.reason == "length" else "tool_calls", index=index))
                        continue
                    if kept[index]:
                        yield sse(shapes.chunk(kept[index], index=index))
                    yield sse(shapes.chunk(None, event.reason, index=index))
                elif isinstance(event, Rewind):  # text already sent cannot be taken back: end with an error
                    yield sse(error_body(503, "a worker was caught lying after this answer was streamed in part: "
                                              "the answer is withdrawn; ask again"))
                    break
                elif isinstance(event, Failed):
                    yield sse(error_body(event.status, event.message))
                    break
            else:
                if include_usage:
                    yield sse(shapes.usage_chunk(done, self.ask.n))
            yield sse("[DONE]")
        finally:
            self.cancel()  # a client that went away frees its slots at the engine's next step


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    def emit(event) -> None:  # called from the engine's thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, (index, event))
        except RuntimeError:  # the event loop is gone (the server is stopping)
            pass

    return emit
