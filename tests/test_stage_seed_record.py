"""A stage member's seed record (discovery/seed_record.py `layers`, `trunk`) and the pieces a
joiner asks it for (slices/sources.py): a stage's slice, exactly; an experts member's record keeps its bytes."""

from __future__ import annotations

import pytest

from moeswarm.bundled import PYMOE
from moeswarm.discovery.record import RecordError
from moeswarm.discovery.seed_record import SeedRecord, parse_seed_record
from moeswarm.slices.manifest import Manifest, build_manifest, load_manifest, write_manifest
from moeswarm.slices.sources import fetch_sources

SHA = "ab" * 32


def test_a_stage_seed_record_round_trips_and_an_experts_one_keeps_its_fields():
    experts = SeedRecord("10.0.0.7:7001", "fp", SHA, (0, 1), False)
    assert set(experts.to_value()) == {"v", "address", "fingerprint", "manifest", "experts", "tls", "online"}
    stage = SeedRecord("10.0.0.7:7002", "fp", SHA, (0, 1), True, layers=(3, 5), trunk=True)
    assert stage.to_value()["layers"] == [3, 5] and stage.to_value()["trunk"] is True
    assert parse_seed_record("10.0.0.7:7002", stage.to_value(), "fp") == stage
    assert parse_seed_record("10.0.0.7:7002", stage.offline().to_value(), "fp") == stage.offline()
    bad = {
        "layers": ([5, 3], "layers [5, 3] is not [first, last] with 0 <= first <= last < 4096"),
        "trunk": (1, "trunk must be true or false"),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(RecordError) as caught:
            parse_seed_record("10.0.0.7:7002", {**stage.to_value(), field: value}, "fp")
        assert str(caught.value) == message, field
    with pytest.raises(RecordError, match="layers 'x'"):
        parse_seed_record("10.0.0.7:7002", {**stage.to_value(), "layers": "x"}, "fp")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Manifest:
    model = PYMOE / "gguf" / "pymoe-Q4_K_M.gguf"
    out = tmp_path_factory.mktemp("manifest") / "pymoe.manifest.json"
    write_manifest(build_manifest(model), out)
    return load_manifest(out)


def _keys(pieces) -> frozenset:
    return frozenset((p.offset, p.length) for p in pieces)


def test_a_joiner_asks_a_stage_seed_for_its_slice_pieces_only(manifest):
    experts = tuple(manifest.data["expert_ids"])
    moe = manifest.moe_layers()
    stage = SeedRecord("127.0.0.1:7002", manifest.fingerprint, manifest.sha256, experts, False,
                       layers=(moe[0], moe[0]), trunk=True)
    empty = SeedRecord("127.0.0.1:7003", manifest.fingerprint, manifest.sha256, experts, False,
                       layers=(4000, 4000), trunk=True)  # no MoE layer of this model: passed over
    sources = fetch_sources("127.0.0.1:7000", [stage, empty], manifest, False, None, b"x")
    assert [s.address for s in sources] == ["127.0.0.1:7002", "127.0.0.1:7000"]
    wanted = _keys(manifest.pieces(experts, (moe[0], moe[0]), True))
    assert sources[0].pieces == wanted
    shared = _keys(manifest.pieces(experts, (moe[0], moe[0]), False))  # the header, samples, its experts
    other_layer = _keys(manifest.pieces(experts, (moe[1], moe[1]), False)) - shared
    assert other_layer and other_layer.isdisjoint(wanted)  # another layer's experts are not claimed
