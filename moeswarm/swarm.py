"""A backbone wired to its workers: load without experts, connect, check, attach the hook."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from moeswarm.dispatch.connection import WorkerConnection
from moeswarm.dispatch.dispatcher import Dispatcher
from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.model.backend import attach
from moeswarm.model.checkpoint import Checkpoint
from moeswarm.model.experts import experts_modules, num_experts_of
from moeswarm.model.loading import load_backbone


@dataclass
class Swarm:
    model: PreTrainedModel
    checkpoint: Checkpoint
    dispatcher: Dispatcher
    moe_layers: list[int]

    def close(self) -> None:
        self.dispatcher.close()


def connect_swarm(model_path, workers: list[str], fanout: str = "star", mode: str = "exact",
                  wire_dispatch: str | None = None, wire_combine: str | None = None) -> Swarm:
    if not workers:
        raise MoeSwarmError("no workers given: pass --workers HOST:PORT[,HOST:PORT...]")
    model, checkpoint = load_backbone(model_path)
    connections = [WorkerConnection(address) for address in workers]
    try:
        for connection in connections:
            info = connection.connect(checkpoint.fingerprint)
            if info.fingerprint != checkpoint.fingerprint:
                raise WorkerError(connection.address, f"serves model {info.fingerprint}, not {checkpoint.fingerprint}")
        num_experts = num_experts_of(model)
        dispatcher = Dispatcher(connections, num_experts, fanout, mode, wire_dispatch, wire_combine)
        layers = list(experts_modules(model))
        dispatcher.check_covers(layers)
    except BaseException:
        for connection in connections:
            connection.close()
        raise
    attach(model, dispatcher)
    return Swarm(model, checkpoint, dispatcher, layers)
