"""lm-evaluation-harness against a real `moeswarm serve`, as its users run it: `lm_eval --model
local-completions` with its default settings (token-id requests) and `--batch_size 2` (a list of
prompts per request), on two small local tasks written here (tests/lm_eval_tasks/: yaml + jsonl, no
hub): a multiple-choice task scored by log-likelihood and a generate_until task.

What lm-eval got is checked against the bundled model run locally: every log-likelihood equals the
sum of the local log-softmax over the continuation's tokens (JSON carries the float32 values
exactly and lm-eval adds them in order, as done here), the accuracy it reports is the fraction of
documents whose gold choice is the local favourite, and each generated line is the local greedy text.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moeswarm.bundled import TRAINED
from moeswarm.generation.sampling import log_probs
from moeswarm.forward.stepper import Stepper

pytest.importorskip("lm_eval")

TASKS = Path(__file__).parent / "lm_eval_tasks"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory, trained_serve):
    """lm-eval's results and its logged samples per task, from one run against a served swarm."""
    out = tmp_path_factory.mktemp("lm_eval")
    model_args = f"model=pymoe,base_url={trained_serve.url}/v1/completions,tokenizer={TRAINED}"
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
         "--tasks", "pymoe_choice,pymoe_lines", "--include_path", str(TASKS), "--batch_size", "2",
         "--output_path", str(out), "--log_samples"],
        cwd=TASKS,  # the task yamls name their jsonl files relative to it
        env={**os.environ, **OFFLINE, "HF_HOME": str(out / "hf")},
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    [results] = glob.glob(str(out / "pymoe" / "results_*.json"))
    samples = {}
    for task in ("pymoe_choice", "pymoe_lines"):
        [path] = glob.glob(str(out / "pymoe" / f"samples_{task}_*.jsonl"))
        samples[task] = sorted((json.loads(line) for line in open(path)), key=lambda sample: sample["doc_id"])
    return json.loads(Path(results).read_text()), samples


@pytest.fixture(scope="module")
def local(trained_local):
    return trained_local  # conftest: the bundled model and its codec, shared with the other served-model tests


def _loglikelihood(model, codec, context: str, continuation: str) -> tuple[float, bool]:
    """What a log-likelihood request should give, encoded as lm-eval encodes a pair (the
    continuation's tokens are those of the whole text past the context's)."""
    whole, context_ids = codec.encode(context + continuation), codec.encode(context)
    rows = log_probs(Stepper(model).forward(whole))  # [n, V]
    positions = range(len(context_ids) - 1, len(whole) - 1)  # row i predicts token i + 1
    total = sum(float(rows[i, whole[i + 1]]) for i in positions)
    greedy = all(int(rows[i].argmax()) == whole[i + 1] for i in positions)
    return total, greedy


def _greedy_line(model, codec, context: str, max_tokens: int) -> str:
    """The greedy continuation of `context`, up to `max_tokens` tokens or the end of text, cut at
    the first newline (the task's `until`)."""
    stepper, tokens = Stepper(model), []
    logits = stepper.forward(codec.encode(context))[-1]
    while len(tokens) < max_tokens:
        token = int(logits.argmax())
        if token == codec.eos_token_id:
            break
        tokens.append(token)
        logits = stepper.forward([token])[-1]
    return codec.decode(tokens).split("\n", 1)[0]


def test_every_loglikelihood_equals_the_local_log_softmax(evaluation, local):
    _, samples = evaluation
    requests = 0
    for sample in samples["pymoe_choice"]:
        for arguments, [[value, greedy]] in zip(sample["arguments"].values(), sample["resps"]):
            expected, expected_greedy = _loglikelihood(*local, arguments["arg_0"], arguments["arg_1"])
            assert float(value) == expected, (arguments, value, expected)
            assert (greedy == "True") == expected_greedy
            requests += 1
    assert requests == 12  # 4 documents x 3 choices


def test_accuracy_is_the_share_of_documents_whose_gold_choice_the_model_favours(evaluation, local):
    results, samples = evaluation
    favoured = []
    for sample in samples["pymoe_choice"]:
        doc = sample["doc"]
        scores = [_loglikelihood(*local, doc["context"], " " + choice)[0] for choice in doc["choices"]]
        favoured.append(scores.index(max(scores)) == doc["answer"])
    accuracy = results["results"]["pymoe_choice"]["acc,none"]
    assert isinstance(accuracy, float) and accuracy == sum(favoured) / len(favoured)


def test_generate_until_returns_the_local_greedy_text(evaluation, local):
    _, samples = evaluation
    assert len(samples["pymoe_lines"]) == 3
    for sample in samples["pymoe_lines"]:
        expected = _greedy_line(*local, sample["doc"]["context"], max_tokens=12)  # the yaml's max_gen_toks
        assert expected and sample["resps"] == [[expected]]
