"""The experts a worker hosts, and the maths it runs on a DISPATCH.

Legend: T = dispatched tokens, k = router top-k, d = hidden size, n_e = rows routed to expert e,
S = sum of n_e (the routed (token, expert) pairs this worker computes).

A worker may hold any set of experts per layer. Each contiguous run of them is one module of
the family's own experts class with the eager implementation; each expert runs on exactly the
rows routed to it in eager's order (slot-major, then token), as a one-expert problem: the same
inputs through the same kernels, at the same address alignment, give the same bits as a local
eager run. GGUF experts kept quantized (kernels/quant_experts.py) are a QuantExperts module in the
family's place: its products' bits depend only on the weight row and the input row, so they hold
the same guarantee at any alignment, and the local reference computes with the same module.
"""

from __future__ import annotations

import copy
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np
import torch

from moeswarm.errors import ProtocolError
from moeswarm.ids import LayerId, format_ids, runs
from moeswarm.model.hosted import HostedLayer
from moeswarm.wire.config import CombineMode
from moeswarm.wire.messages import U8_IDS, Dispatch, Result
from moeswarm.worker.served import Served


_NUMPY_ADD_ROWS = 64  # up to this many routed pairs, a PARTIAL answer's adds go in numpy (_by_token)
_FEW_IDS = 64  # up to this many ids, a DISPATCH's id checks reduce a Python list (`_check`)


@dataclass(frozen=True)
class _Run:
    """Consecutive hosted experts in one experts module: global expert `experts[i]` is its expert i."""

    experts: range
    module: torch.nn.Module
    sentinel: int | None = None  # the id the module takes as "no expert" (eager's own sums), where probed sound
    sums_itself: bool = False  # the module takes -1 as "no expert" (`_sums_itself`)


@dataclass(frozen=True)
class SelfSumming:
    """A layer whose experts here are one module that sums a partial DISPATCH itself (`run`'s
    one-call case), and the table a u8 wire id maps through to the id that module takes."""

    module: torch.nn.Module
    u8_ids: np.ndarray  # [256] int64: the module's id for each u8 wire id; `other` for 255 (another holder's slot), -2 not held here
    other: int  # the id the module takes as "no expert of mine": -1, or its sentinel
    first: int = 0  # the module's expert i is expert first + i


class ExpertStore:
    def __init__(self, hosted: dict[LayerId, HostedLayer], num_experts: int, hidden_size: int):
        if not hosted:
            raise ValueError("an expert store needs at least one hosted layer")
        self._held = {int(layer): tuple(int(e) for e in h.experts) for layer, h in sorted(hosted.items())}
        self._runs = {int(layer): _split(h, hidden_size) for layer, h in hosted.items()}
        self._holds = {layer: np.isin(np.arange(num_experts), held) for layer, held in self._held.items()}  # [E] bool
        self._locals = {layer: _local_ids(layer_runs, num_experts) for layer, layer_runs in self._runs.items()}  # [E + 3]
        self._dtypes = {layer: compute_dtype(layer_runs[0].module) for layer, layer_runs in self._runs.items()}
        self._num_experts = num_experts
        self._hidden_size = hidden_size
        self.served = Served(self._held, num_experts)  # rows computed per expert: the measured load

    @property
    def held(self) -> dict[int, tuple[int, ...]]:
        """{MoE layer: the experts held in it, ascending}."""
        return dict(self._held)

    @property
    def num_experts(self) -> int:
        """The model's routed experts per layer (not how many this worker holds)."""
        return self._num_experts

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    def whole_layers(self) -> dict[int, torch.nn.Module]:
        """{layer: its experts module} for the layers where this store holds every expert (one module:
        what a whole local model calls there, dispatch/in_process.py)."""
        return {layer: layer_runs[0].module for layer, layer_runs in self._runs.items()
                if len(self._held[layer]) == self._num_experts and len(layer_runs) == 1}

    def express_plan(self, layer: int):
        """(the C plan of the layer's experts, its first expert) where they are one run of quantized
        experts (one C call gives a DISPATCH's sums or rows: worker/express_answer.py), else None."""
        layer_runs = self._runs.get(layer)
        if layer_runs is None or len(layer_runs) != 1 or not layer_runs[0].sums_itself:
            return None
        plan = getattr(layer_runs[0].module, "_plan", None)
        return None if plan is None else (plan, layer_runs[0].experts.start)

    def self_summing(self, layer: int) -> SelfSumming | None:
        """How `run` answers a partial DISPATCH of `layer` in one module call, where it does (one run of
        experts that sums itself, or takes a sentinel), for a caller that reads u8 ids off the wire
        itself (worker/express_answer.py): the ids it maps through the table are those `_check` accepts
        when no value is -2 and not every value is `other`."""
        layer_runs = self._runs.get(layer)
        if layer_runs is None or len(layer_runs) != 1:
            return None
        only = layer_runs[0]
        if not only.sums_itself and only.sentinel is None:
            return None
        other = -1 if only.sums_itself else only.sentinel
        table = self._locals[layer].take(U8_IDS + 2, mode="clip")  # [256]: the run's id, -1, or -2
        table[table == -1] = other
        return SelfSumming(only.module, table, other, only.experts.start)

    def ids_table(self, layer: int) -> np.ndarray:
        """[E + 3] int64: at position id + 2 (clipped), the id within its run where held here, -1 for
        -1, -2 otherwise (what `_check` looks the ids up in)."""
        return self._locals[layer]

    def describe(self) -> str:
        """e.g. "layers 0-3, experts 0-3,9,17-20"; per layer when the layers hold different experts."""
        expert_sets = set(self._held.values())
        if len(expert_sets) == 1:
            return f"layers {format_ids(list(self._held))}, experts {format_ids(expert_sets.pop())}"
        return "; ".join(f"layer {layer}: experts {format_ids(experts)}" for layer, experts in self._held.items())

    def run(self, request: Dispatch) -> Result:
        """The Result of `request` (ProtocolError naming what is wrong with it); its rows counted in `served`."""
        result = self._run(request)
        self.served.add(result.layer, result.experts, result.counts)
        return result

    @torch.inference_mode()
    def _run(self, request: Dispatch) -> Result:
        layer_runs, index, local = self._check(request)  # [T, k] int64 numpy each: ids, and ids within their run
        if request.mode == CombineMode.PARTIAL and len(layer_runs) == 1:
            only = layer_runs[0]
            if only.sums_itself:
                return self._sums(request, only, local, local)
            if only.sentinel is not None:
                return self._sums(request, only, local, np.where(local < 0, only.sentinel, local))
        outputs, hit, counts, token_ids = _pairs(layer_runs, request.hidden, index, request.top_k_weights)
        if request.mode == CombineMode.PARTIAL:
            outputs = _by_token(outputs, token_ids, index.shape[0])  # [T, d], experts added in ascending order
        return Result(request.layer, request.mode, outputs, hit, counts.tolist(), request.wire_combine)

    def _sums(self, request: Dispatch, run: _Run, local: np.ndarray, ids: np.ndarray) -> Result:
        """Partial sums [T, d] in one call of a module that adds its experts' rows into each token
        itself, in eager's order (ascending experts, slot-major then token, from zero): the bits of
        the rows computed one pair at a time and added by `index_add_`, without building the pairs.
        A decode step's DISPATCH then costs its kernel and a few numpy calls: a torch call costs
        more here, where caches are cold and the OpenMP threads asleep (docs/measured.md, "store").
        local: [T, k] the run's own expert ids, -1 where another holder has the slot; ids: the same
        as the module takes them (-1, or its sentinel: `_Run.sentinel`)."""
        counts = np.bincount(local.reshape(-1) + 1, minlength=len(run.experts) + 1)[1:]  # [n] rows per run expert
        hit = np.flatnonzero(counts)
        outputs = run.module(request.hidden, torch.from_numpy(ids), request.top_k_weights)  # [T, d]
        return Result(request.layer, request.mode, outputs, (hit + run.experts.start).tolist(), counts[hit].tolist(),
                      request.wire_combine)

    def _check(self, request: Dispatch) -> tuple[list[_Run], np.ndarray, np.ndarray]:
        """The layer's runs, the ids [T, k] as int64 numpy and each id within its run [T, k] (-1 for
        -1), once the request is found sound. The ids' test is one table lookup and two reductions
        (numpy: a few microseconds where torch's per-call cost is ~10 each); what is wrong with them
        is found, and named, only when the test fails."""
        layer_runs = self._runs.get(request.layer)
        if layer_runs is None:
            raise ProtocolError(f"layer {request.layer} is not served by this worker (it serves {self.describe()})")
        tokens, width = request.hidden.shape
        if width != self._hidden_size:
            raise ProtocolError(f"hidden size {width} does not match the model's {self._hidden_size}")
        dtype = self._dtypes[request.layer]
        if request.hidden.dtype != dtype:
            raise ProtocolError(f"dtype mismatch: hidden states are {request.hidden.dtype}, the experts compute in {dtype}")
        if not request.top_k_weights.is_floating_point():
            raise ProtocolError(f"routing weights must be floating point, got {request.top_k_weights.dtype}")
        if tokens == 0:
            raise ProtocolError("DISPATCH with no tokens")
        index = request.top_k_index.numpy().astype(np.int64, copy=False)  # [T, k]
        local = self._locals[request.layer].take(index + 2, mode="clip")  # [T, k]: < -1 where not held here
        # a decode step's few ids are reduced in Python: cheaper there than two numpy reductions
        if local.size <= _FEW_IDS:
            values = local.ravel().tolist()
            lowest, highest = (min(values), max(values)) if values else (-2, -2)
        else:
            lowest, highest = int(local.min()), int(local.max())
        if lowest >= -1 and highest >= 0:
            return layer_runs, index, local
        self._refuse(request.layer, index)

    def _refuse(self, layer: int, index: np.ndarray) -> None:
        """ProtocolError naming what is wrong with the ids [T, k] of a DISPATCH of `layer`."""
        wrong = (index < -1) | (index >= self._num_experts)
        if wrong.any():
            bad = int(index[wrong][0])
            raise ProtocolError(f"expert id {bad} out of range: the model has experts 0-{self._num_experts - 1}")
        chosen = index[index >= 0]
        if chosen.size == 0:
            raise ProtocolError("DISPATCH routes no token to any expert (every id is -1)")
        outside = chosen[~self._holds[layer][chosen]]
        if outside.size:
            raise ProtocolError(
                f"expert {int(outside[0])} of layer {layer} is not held by this worker "
                f"(it holds experts {format_ids(self._held[layer])})"
            )
        raise AssertionError(f"ids refused by their table but found sound: {index.tolist()}")


def _local_ids(layer_runs: list[_Run], num_experts: int) -> np.ndarray:
    """[E + 3]: at position id + 2 (clipped into the table), the id within its run where this store
    holds it, -1 for -1 (another holder's slot), -2 for anything else (not held, < -1, >= E)."""
    table = np.full(num_experts + 3, -2, dtype=np.int64)
    table[1] = -1
    for run in layer_runs:
        table[run.experts.start + 2 : run.experts.stop + 2] = np.arange(len(run.experts))
    return table


def _pairs(layer_runs: list[_Run], hidden: torch.Tensor, index: np.ndarray,
           weights: torch.Tensor) -> tuple[torch.Tensor, list[int], np.ndarray, np.ndarray]:
    """(rows [S, d], the hit experts ascending, their pair counts [n], each row's token [S]): every
    routed (token, slot) pair of `index` [T, k] (-1: none), each a row w * E(x), grouped by expert
    ascending and, within an expert, slot-major then token (eager's order)."""
    tokens_in = index.shape[0]
    # A stable sort of the slot-major flattening by expert id.
    flat = index.T.reshape(-1)  # [k * T]: position slot * T + token
    order = np.argsort(flat, kind="stable")[np.count_nonzero(flat < 0):]  # [S]; unrouted slots (-1) sort first
    chosen = flat[order]  # [S], ascending
    starts = [0, *(np.flatnonzero(chosen[1:] != chosen[:-1]) + 1).tolist(), len(order)]  # each hit expert's first pair
    hit = chosen[starts[:-1]].tolist()  # the hit experts, ascending
    counts = np.diff(starts)  # pairs per hit expert
    token_ids, slot_ids = order % tokens_in, order // tokens_in  # [S] each
    pair_weights = _take(weights, token_ids, slot_ids).unsqueeze(1)  # [S, 1]
    outputs = []
    for run in layer_runs:
        first, last = bisect_left(hit, run.experts.start), bisect_left(hit, run.experts.stop)
        if first == last:
            continue
        pairs = slice(starts[first], starts[last])  # the run's pairs: contiguous, grouped by expert
        local = torch.from_numpy(chosen[pairs] - run.experts.start).unsqueeze(1)  # [S_run, 1] int64
        # One call of the family's eager experts over the run's pairs: each expert sees exactly its
        # rows in eager's order (the same matrices as a local run); each output row is one pair's w * E(x).
        outputs.append(run.module(_take(hidden, token_ids[pairs]), local, pair_weights[pairs]))  # [S_run, d]
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), hit, counts, token_ids


def _by_token(rows: torch.Tensor, token_ids: np.ndarray, tokens: int) -> torch.Tensor:
    """rows [S, d] -> [T, d]: each token's rows added from zero in row order (index_add_'s adds).

    A decode step's few float32 rows are added by numpy (`add.at` adds in index order, IEEE single
    as torch's): index_add_ opens an OpenMP region, costly with cold caches and sleeping threads."""
    if rows.dtype == torch.float32 and rows.shape[0] <= _NUMPY_ADD_ROWS:
        total = np.zeros((tokens, rows.shape[1]), np.float32)
        np.add.at(total, token_ids, rows.numpy())
        return torch.from_numpy(total)
    return torch.zeros(tokens, rows.shape[1], dtype=rows.dtype).index_add_(0, torch.from_numpy(token_ids), rows)


def _sums_itself(module: torch.nn.Module) -> bool:
    """Whether `module` takes ids < 0 as "no expert" and adds each token's rows itself in eager's
    order (QuantExperts says so); the families' eager classes index with every id."""
    return getattr(module, "skips_unrouted", False)


def _take(tensor: torch.Tensor, *ids: np.ndarray) -> torch.Tensor:
    """tensor[ids] (one index array per leading dimension), by numpy where the dtype has it: torch's
    gather opens an OpenMP region, costly with cold caches and sleeping threads, for a small copy
    (docs/measured.md, "store"). Rows: _take(hidden, token_ids) [S, d]; pairs: _take(weights, token_ids, slot_ids) [S]."""
    if tensor.dtype in (torch.float32, torch.float16, torch.float64):
        return torch.from_numpy(tensor.numpy()[ids])
    return tensor[tuple(torch.from_numpy(i) for i in ids)]


def _split(hosted: HostedLayer, width: int) -> list[_Run]:
    """One module per contiguous run of hosted experts, each placed as in a full local model."""
    found, start = [], 0
    for experts in runs(hosted.experts):
        module = _narrowed(hosted.module, start, start + len(experts))
        mirror_alignment(module, experts.start)
        found.append(_Run(experts, module, _sentinel(module, width), _sums_itself(module)))
        start += len(experts)
    return found


@torch.inference_mode()
def _sentinel(module: torch.nn.Module, width: int) -> int | None:
    """The id `module` (of hidden size `width`) takes as "no expert" in a PARTIAL call (`ExpertStore._sums`), or None.

    transformers' eager experts one-hot ids into num_experts + 1 classes and skip the last: called
    with it in another holder's slots, they give each token's sum of this holder's experts in
    eager's own order, the bits `_pairs` then `_by_token` give at a higher cost a decode call
    (docs/measured.md, "store"). Not every family's eager code does so (gpt-oss one-hots into
    num_experts), so this is probed, on a few tokens routed through the first and last experts and
    the sentinel: the module is called so only where it gave exactly the pairs' bits."""
    n = getattr(module, "num_experts", None)
    if type(n) is not int or n < 1 or _sums_itself(module):
        return None
    dtype = compute_dtype(module)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, width, generator=generator).to(dtype)  # [3, d]
    index = np.array([[0, -1], [-1, n - 1], [n - 1, 0]], np.int64)  # [3, 2]
    weights = torch.rand(3, 2, generator=generator).to(dtype)
    try:
        rows, _, _, token_ids = _pairs([_Run(range(n), module)], hidden, index, weights)
        expected = _by_token(rows, token_ids, 3)
        got = module(hidden, torch.from_numpy(np.where(index < 0, n, index)), weights)
    except Exception:  # noqa: BLE001 - the sentinel is out of this family's range: the pairs path
        return None
    return n if got.shape == expected.shape and got.dtype == expected.dtype and torch.equal(got, expected) else None


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype an experts module takes hidden states in (a QuantExperts says; otherwise its parameters')."""
    return getattr(module, "compute_dtype", None) or next(module.parameters()).dtype


def _narrowed(module: torch.nn.Module, start: int, stop: int) -> torch.nn.Module:
    """The experts module restricted to its experts [start, stop) (views, no copy); itself when that is all of it."""
    if start == 0 and stop == module.num_experts:
        return module
    if hasattr(module, "narrow"):  # QuantExperts: its own views of the GGUF blocks
        return module.narrow(start, stop)
    narrowed = copy.copy(module)  # shares config and submodules; gets its own parameter table
    narrowed._parameters = {
        name: torch.nn.Parameter(param[start:stop], requires_grad=False) for name, param in module._parameters.items()
    }
    # Eager code one-hots expert ids with num_classes=num_experts (gpt_oss): local ids must stay below it.
    narrowed.num_experts = stop - start
    return narrowed


def mirror_alignment(module: torch.nn.Module, first_expert: int, quantum_bytes: int = 64) -> None:
    """Place each hosted expert's weights at the same address alignment as in a full local model.

    CPU matmul kernels take different paths (and give different low-order bits) depending on how
    an operand's address sits against the 64-byte vector width. In a local model, expert e of a
    stacked [E, ...] parameter starts e * expert_bytes past a 64-byte-aligned base; a worker
    holding experts from `first_expert` on would start its expert 0 at a different residue unless
    its buffer is shifted to match.
    """
    for name, param in list(module.named_parameters(recurse=False)):
        itemsize = param.element_size()
        expert_bytes = param[0].numel() * itemsize
        if expert_bytes % quantum_bytes == 0 or quantum_bytes % itemsize:
            continue  # every expert already starts at the same residue
        buffer = torch.empty(param.numel() + quantum_bytes // itemsize, dtype=param.dtype)
        want = (first_expert * expert_bytes) % quantum_bytes
        shift = ((want - buffer.data_ptr()) % quantum_bytes) // itemsize
        view = buffer[shift : shift + param.numel()].view(param.shape)
        view.copy_(param.detach())
        setattr(module, name, torch.nn.Parameter(view, requires_grad=False))
