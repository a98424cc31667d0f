"""Collection with the committed tiny policy, its real tokenizer and the real sandbox.

The loop's unit tests use scripted fakes; these check the same two promises end to end: rendering
the stored segments at the collect config reproduces every context the model was given, and the
same seed gives the same warehouse contents.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

import pytest

from cleaner.config import DEFAULT_POLICY, CollectConfig
from cleaner.engine.collect.job import CollectRequest, collect_job, iteration_seed
from cleaner.engine.collect.schedule import collect
from cleaner.engine.collect.tasks import toy_tasks
from cleaner.engine.model.chat import ChatFormat
from cleaner.engine.model.torch_backend import TorchBackend
from cleaner.engine.saar.walk import render, view_for
from cleaner.sandbox import SandboxConfig, make_sandbox
from cleaner.warehouse import Warehouse
from tests.agent_fakes import collect_parts
from tests.helpers import assert_same_collection, comparable


@pytest.fixture(scope="module")
def backend():
    return TorchBackend(DEFAULT_POLICY)


CONFIG = CollectConfig(n_prompts=6, group_size=4, seed=3, sandbox=SandboxConfig(workers=1))


def _collect_with_contexts(backend, config: CollectConfig):
    """Collect toy tasks; yield (rollout, its segments in order, the end of the k-th generation's
    context, that context) for every context the model was given, in order."""
    contexts: list[tuple[str, list[int]]] = []
    chat = ChatFormat(backend.tokenizer)
    with make_sandbox(config.sandbox) as sandbox:
        batches = collect_parts(toy_tasks(6, seed=11), config, backend, sandbox, chat, progress=False,
                                on_context=lambda rollout_id, ids: contexts.append((rollout_id, list(ids))))
    rollouts = {r.rollout_id: r for b in batches for r in b.rollouts}
    by_rollout = defaultdict(list)
    for segment in sorted((s for b in batches for s in b.segments), key=lambda s: s.seq):
        by_rollout[segment.rollout_id].append(segment)
    generations_seen = Counter()
    for rollout_id, context in contexts:
        own = by_rollout[rollout_id]
        # The k-th context of a rollout is the rendering of everything before its k-th generation.
        k = generations_seen[rollout_id]
        generations_seen[rollout_id] += 1
        end = [i for i, s in enumerate(own) if s.kind == "assistant"][k]
        yield rollouts[rollout_id], own, end, context


def test_stored_segments_reproduce_every_context(backend):
    chat = ChatFormat(backend.tokenizer)
    retried, views = 0, set()
    for rollout, own, end, context in _collect_with_contexts(backend, CONFIG):
        view = view_for(rollout.rollback_draw, True, CONFIG)
        assert list(render(own[:end], view, chat.decode).token_ids) == context
        retried += own[end].attempt > 0
        views.add(rollout.collect_view)
    assert retried > 0, "the sample should contain contexts after a failed call"
    assert views == {"purified"}


def test_is_gated_collection_is_reproduced_by_purify_at_the_collect_config(backend):
    """tau 0.5 on the per-token IS (the sum rejects every merge of this policy: docs/experiments.md): the
    agent loop scores each retry with the backend; purify's render with the prefix-trie scorer must
    give every context again."""
    from cleaner.engine.saar.gate import ScoreCache

    config = dataclasses.replace(CONFIG, rollback_is_threshold=0.5, rollback_is_mode="mean")
    chat = ChatFormat(backend.tokenizer)
    cache, gated, merged = ScoreCache(), 0, 0
    for rollout, own, end, context in _collect_with_contexts(backend, config):
        view = view_for(rollout.rollback_draw, True, config)
        while (rendered := render(own[:end], view, chat.decode, oracle=cache)).provisional:
            cache.fill(backend.scorer(progress=False).score_rows)
        assert list(rendered.token_ids) == context
        gated, merged = gated + rendered.stats.n_gated, merged + rendered.stats.n_deep + rendered.stats.n_shallow
    assert merged > 0 and gated > 0, "the sample should contain merges the gate kept and rejected"


def _stored(warehouse: Warehouse) -> tuple[list, list]:
    """Iteration 0's rollouts and segments, as collections compare."""
    return comparable(warehouse.read_rollouts(0), warehouse.read_segments(0))


def _collect_interrupted(root, backend, config: CollectConfig, parts: int) -> Warehouse:
    """Commit the first `parts` parts of a collection, drop the rest (the rollouts then in flight
    included), and finish it with `resume`."""
    warehouse = Warehouse(root)
    chat = ChatFormat(backend.tokenizer)
    warehouse.save_collect_config(0, config.to_json())
    written = []

    class Crash(Exception):
        pass

    def write(part) -> None:  # commits `parts` parts, then fails: the collection stops there
        if len(written) == parts:
            raise Crash
        warehouse.write_rollouts(0, part.rollouts, part.segments)
        written.append(part)

    with make_sandbox(config.sandbox) as sandbox, pytest.raises(Crash):
        collect(toy_tasks(config.n_prompts, seed=iteration_seed(config)), config, backend, sandbox, chat,
                write=write, progress=False)
    assert 0 < len(warehouse.rollout_ids(0)) < config.n_prompts * config.group_size
    collect_job(warehouse, CollectRequest(config, resume=True), backend=backend, progress=False)
    return warehouse


def test_the_schedule_never_changes_the_warehouse(tmp_path, backend):
    """Lock step and each rollout on its own clock, parts and resumes cut anywhere: the same rollouts,
    token for token; the behaviour log-probs within the torch backend's batching tolerance
    (tests/helpers.py's BATCH_ATOL: its batched forwards are not batch-invariant)."""
    config = dataclasses.replace(CONFIG, n_prompts=5)
    reference = Warehouse(tmp_path / "lockstep")
    collect_job(reference, CollectRequest(dataclasses.replace(config, schedule="lockstep", batch_rollouts=64)),
                backend=backend, progress=False)
    expected = _stored(reference)
    assert len(expected[0]) == 20 and any(r.n_failed_calls > 0 for r in expected[0])  # some failed calls
    again = Warehouse(tmp_path / "again")
    collect_job(again, CollectRequest(dataclasses.replace(config, batch_rollouts=5, max_concurrent_rollouts=7)),
                backend=backend, progress=False)
    assert_same_collection(_stored(again), expected)
    resumed = _collect_interrupted(tmp_path / "resumed", backend,
                                   dataclasses.replace(config, batch_rollouts=3, max_concurrent_rollouts=6), parts=2)
    assert_same_collection(_stored(resumed), expected)
    resumed_lockstep = _collect_interrupted(tmp_path / "resumed-lockstep", backend,
                                            dataclasses.replace(config, batch_rollouts=6, schedule="lockstep"), parts=1)
    assert_same_collection(_stored(resumed_lockstep), expected)
