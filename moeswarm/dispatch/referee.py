"""The backbone computing a request itself, to settle a dispute between two holders.

The backbone has the model source: when two holders answer the same rows differently and no
third holder can be asked, it loads the disputed experts of that layer (as `hold_local` loads the
local store: sources/loading.py `load_experts`) and runs the request through the same ExpertStore a
worker runs, so in exact mode its answer is the honest one, bit for bit. Loaded sets are kept
(at most `keep`, the oldest dropped): a liar keeps lying, and the next dispute is at once.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from moeswarm.sources.loading import load_experts
from moeswarm.sources.source import ModelSource
from moeswarm.wire.messages import Dispatch, Result
from moeswarm.worker.store import ExpertStore


class Referee:
    def __init__(self, source: ModelSource, num_experts: int, hidden_size: int, keep: int = 4):
        self.source, self.num_experts, self.hidden_size, self.keep = source, num_experts, hidden_size, keep
        self._stores: OrderedDict[tuple[int, tuple[int, ...]], ExpertStore] = OrderedDict()
        self.loads = 0

    def __call__(self, request: Dispatch) -> Result:
        index = request.top_k_index.numpy()
        experts = tuple(np.unique(index[index >= 0]).tolist())  # ascending
        key = (int(request.layer), experts)
        store = self._stores.get(key)
        if store is None:
            hosted, _, _ = load_experts(self.source, list(experts), (key[0], key[0]))
            store = ExpertStore(hosted, self.num_experts, self.hidden_size)
            self.loads += 1
            self._stores[key] = store
            while len(self._stores) > self.keep:
                self._stores.popitem(last=False)
        self._stores.move_to_end(key)
        return store.run(request)
