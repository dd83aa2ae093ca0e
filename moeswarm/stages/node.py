"""`open_stage`: a stage put together (its span of the model, its experts' holders, its server)."""

from __future__ import annotations

import ssl

from moeswarm.generation.ragged import install, supports_ragged
from moeswarm.errors import MoeSwarmError
from moeswarm.model.source import as_source
from moeswarm.stages.server import StageLimits, StageServer
from moeswarm.stages.span import keep_span
from moeswarm.swarm import Swarm, open_swarm
from moeswarm.swarm_config import SwarmConfig


def open_stage(model_path, span: range, workers: list[str], config: SwarmConfig | None = None,
               limits: StageLimits | None = None, tls_server: ssl.SSLContext | None = None,
               ) -> tuple[StageServer, Swarm]:
    """Load decoder layers `span` of the model (their trunk only), reach their experts (`workers`,
    the swarm, or this process), and return the stage's server (not yet listening) with its swarm
    (close it when the server stops)."""
    source = as_source(model_path)
    total = source.config.get_text_config().num_hidden_layers
    if span.stop > total:  # before anything loads
        raise MoeSwarmError(f"--layers {span.start}-{span.stop - 1}: the model has decoder layers 0-{total - 1}")
    swarm = open_swarm(source, workers, config, layers=span, ends=False)
    try:
        if not supports_ragged(swarm.model):
            raise MoeSwarmError(f"{swarm.model.config.model_type}: its layers keep a state a stage cannot pack "
                                "(recurrent or latent attention): it cannot be staged")
        install(swarm.model)
        keep_span(swarm.model, span)
        config = config or SwarmConfig()
        server = StageServer(swarm.model, span, source.fingerprint, limits, tls_server, config.tls)
    except BaseException:
        swarm.close()
        raise
    return server, swarm
